//! Autocast regions, threads, snapshots and the weight-cast cache through the public API.
use std::cell::Cell;
use std::error::Error;
use std::rc::Rc;

use ferrocuda_amp::autocast::{
    AmpState, Autocast, AutocastArg, AutocastError, CastPlan, DeviceKind, InferenceModeGuard,
    RedispatchGuard, cast_inputs_by_name, dtype, is_cache_enabled, is_enabled, nesting,
    thread_cache_len,
};
use ferrocuda_types::DType;

type TestResult = Result<(), Box<dyn Error>>;

use DType::{BF16, F16, F32, F64, I32};
use DeviceKind::{Cpu, Cuda, Xpu};

/// A parameter (or activation) as autocast sees it.
#[derive(Debug)]
struct W {
    dtype: DType,
    param: bool,
    id: u64,
    version: Cell<u64>,
}

fn weight(id: u64) -> W {
    W {
        dtype: F32,
        param: true,
        id,
        version: Cell::new(0),
    }
}

impl AutocastArg for W {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn device_kind(&self) -> DeviceKind {
        Cuda
    }
    fn is_leaf_requiring_grad(&self) -> bool {
        self.param
    }
    fn identity(&self) -> u64 {
        self.id
    }
    fn version(&self) -> u64 {
        self.version.get()
    }
}

/// The cast value: which source and version it was made from.
type Cast = Rc<(u64, u64, DType)>;

/// Runs `mm(w)` under the current state, casting through the cache; counts real casts.
fn use_weight(w: &W, casts: &Cell<u32>) -> Result<Option<Cast>, Box<dyn Error>> {
    let plan = cast_inputs_by_name(Cuda, "mm", [w])?;
    Ok(plan.cast_arg(w, |to| {
        casts.set(casts.get() + 1);
        Ok::<_, AutocastError>(Rc::new((w.id, w.version.get(), to)))
    })?)
}

#[test]
fn regions_nest_and_restore() -> TestResult {
    assert!(!is_enabled(Cuda));
    assert_eq!(dtype(Cuda), F16);
    assert_eq!(nesting(), 0);
    {
        let _a = Autocast::new(Cuda).dtype(BF16).enter()?;
        assert!(is_enabled(Cuda) && dtype(Cuda) == BF16 && nesting() == 1);
        {
            let _b = Autocast::new(Cuda)
                .enabled(false)
                .cache_enabled(false)
                .enter()?;
            assert!(!is_enabled(Cuda) && nesting() == 2 && !is_cache_enabled());
            assert_eq!(
                dtype(Cuda),
                BF16,
                "a region reads the current dtype when built"
            );
            let _c = Autocast::new(Cpu).enter()?;
            assert!(is_enabled(Cpu) && !is_enabled(Cuda) && nesting() == 3);
        }
        assert!(is_enabled(Cuda) && !is_enabled(Cpu) && is_cache_enabled() && nesting() == 1);
    }
    assert_eq!(AmpState::current(), AmpState::default());
    assert_eq!(nesting(), 0);
    Ok(())
}

/// PyTorch quirk: one `autocast` instance used as a decorator on a recursive function
/// leaves autocast enabled after the call. Here each entry owns its guard.
#[test]
fn one_region_entered_recursively_restores_the_outer_state() -> TestResult {
    fn recurse(region: &Autocast, depth: u32) -> Result<u32, AutocastError> {
        region.run(|| {
            if depth == 0 {
                Ok(nesting())
            } else {
                recurse(region, depth - 1)
            }
        })?
    }
    let region = Autocast::new(Cpu);
    assert_eq!(recurse(&region, 4)?, 5);
    assert!(!is_enabled(Cpu));
    assert_eq!(nesting(), 0);
    Ok(())
}

#[test]
fn unsupported_dtypes_are_refused_only_when_enabled() -> TestResult {
    for (d, bad) in [(Cpu, F32), (Xpu, F64), (Cuda, F32), (Cpu, I32)] {
        let e = Autocast::new(d).dtype(bad).enter().err();
        assert!(
            matches!(e, Some(AutocastError::UnsupportedDtype { device, dtype, .. }) if device == d && dtype == bad)
        );
        assert_eq!(nesting(), 0, "a refused region opens no scope");
    }
    let msg = Autocast::new(Cpu)
        .dtype(F32)
        .enter()
        .err()
        .map(|e| e.to_string());
    assert!(msg.is_some_and(|m| {
        m.contains("CPU Autocast only supports dtypes of torch.bfloat16, torch.float16")
    }));
    // Disabled with fp32 is fine (test_autocast_disabled_with_fp32_dtype), and the dtype is
    // still set inside the region (PyTorch quirk).
    let _g = Autocast::new(Cpu).dtype(F32).enabled(false).enter()?;
    assert_eq!(dtype(Cpu), F32);
    assert!(!is_enabled(Cpu));
    Ok(())
}

#[test]
fn new_threads_start_disabled_and_amp_state_carries_the_region() -> TestResult {
    let _g = Autocast::new(Cuda).dtype(BF16).enter()?;
    let seen = std::thread::spawn(|| (is_enabled(Cuda), dtype(Cuda), nesting()))
        .join()
        .map_err(|_| "thread failed")?;
    assert_eq!(seen, (false, F16, 0));
    let snapshot = AmpState::current();
    let carried = std::thread::spawn(move || {
        let inside = snapshot.run(|| (is_enabled(Cuda), dtype(Cuda), nesting()));
        (inside, is_enabled(Cuda), nesting())
    })
    .join()
    .map_err(|_| "thread failed")?;
    assert_eq!(carried, ((true, BF16, 1), false, 0));
    Ok(())
}

#[test]
fn amp_state_builds_and_validates() -> TestResult {
    let s = AmpState::default()
        .enable(Xpu, BF16)?
        .with_cache_enabled(false);
    assert!(s.is_enabled(Xpu) && s.is_any_enabled() && !s.cache_enabled());
    assert_eq!(s.dtype(Xpu), BF16);
    assert!(!s.disable(Xpu).is_any_enabled());
    assert!(AmpState::default().enable(Xpu, F32).is_err());
    Ok(())
}

#[test]
fn redispatch_guard_suspends_without_opening_a_scope() -> TestResult {
    let _g = Autocast::new(Cuda).enter()?;
    {
        let _inner = RedispatchGuard::new(Cuda);
        assert_eq!(nesting(), 1);
        assert_eq!(
            cast_inputs_by_name(Cuda, "mm", [&weight(1)])?,
            CastPlan::RunAsIs
        );
    }
    assert!(is_enabled(Cuda));
    Ok(())
}

#[test]
fn a_weight_is_cast_once_per_region() -> TestResult {
    let (w, casts) = (weight(10), Cell::new(0));
    {
        let _g = Autocast::new(Cuda).enter()?;
        let a = use_weight(&w, &casts)?;
        let b = use_weight(&w, &casts)?;
        assert_eq!(casts.get(), 1);
        assert!(a.zip(b).is_some_and(|(a, b)| Rc::ptr_eq(&a, &b)));
        assert_eq!(thread_cache_len::<Cast>(), 1);
    }
    assert_eq!(thread_cache_len::<Cast>(), 0, "the outermost exit clears");
    let _g = Autocast::new(Cuda).enter()?;
    use_weight(&w, &casts)?;
    assert_eq!(casts.get(), 2);
    Ok(())
}

/// PyTorch serves the stale cast after an in-place update inside one region; here the
/// version bump makes the next use recast.
#[test]
fn an_in_place_update_is_never_served_a_stale_cast() -> TestResult {
    let (w, casts) = (weight(11), Cell::new(0));
    let _g = Autocast::new(Cuda).enter()?;
    let before = use_weight(&w, &casts)?.ok_or("no cast")?;
    w.version.set(w.version.get() + 1); // an optimizer step wrote the weight in place
    let after = use_weight(&w, &casts)?.ok_or("no cast")?;
    assert_eq!((before.1, after.1), (0, 1));
    assert_eq!(casts.get(), 2);
    use_weight(&w, &casts)?;
    assert_eq!(casts.get(), 2);
    assert_eq!(
        thread_cache_len::<Cast>(),
        1,
        "the stale entry was replaced"
    );
    Ok(())
}

#[test]
fn only_fp32_leaf_parameters_are_cached() -> TestResult {
    let casts = Cell::new(0);
    let _g = Autocast::new(Cuda).enter()?;
    let activation = W {
        param: false,
        ..weight(12)
    };
    use_weight(&activation, &casts)?;
    use_weight(&activation, &casts)?;
    assert_eq!(casts.get(), 2);
    let bf16_param = W {
        dtype: BF16,
        ..weight(13)
    };
    use_weight(&bf16_param, &casts)?;
    use_weight(&bf16_param, &casts)?;
    assert_eq!(casts.get(), 4);
    assert_eq!(thread_cache_len::<Cast>(), 0);
    Ok(())
}

#[test]
fn cache_off_or_inference_mode_casts_every_time() -> TestResult {
    let (w, casts) = (weight(14), Cell::new(0));
    {
        let _g = Autocast::new(Cuda).cache_enabled(false).enter()?;
        use_weight(&w, &casts)?;
        use_weight(&w, &casts)?;
    }
    assert_eq!(casts.get(), 2);
    let _g = Autocast::new(Cuda).enter()?;
    {
        let _inference = InferenceModeGuard::new(true);
        use_weight(&w, &casts)?;
        use_weight(&w, &casts)?;
    }
    assert_eq!(casts.get(), 4);
    use_weight(&w, &casts)?;
    use_weight(&w, &casts)?;
    assert_eq!(casts.get(), 5);
    Ok(())
}

/// PyTorch: an inner `enabled=False` region's exit does not clear the cache.
#[test]
fn inner_exits_keep_the_cache() -> TestResult {
    let (w, casts) = (weight(15), Cell::new(0));
    let _g = Autocast::new(Cuda).enter()?;
    use_weight(&w, &casts)?;
    {
        let _off = Autocast::new(Cuda).enabled(false).enter()?;
        assert_eq!(use_weight(&w, &casts)?, None);
    }
    use_weight(&w, &casts)?;
    assert_eq!(casts.get(), 1);
    Ok(())
}

#[test]
fn another_threads_exit_does_not_clear_this_threads_cache() -> TestResult {
    let (w, casts) = (weight(16), Cell::new(0));
    let _g = Autocast::new(Cuda).enter()?;
    use_weight(&w, &casts)?;
    std::thread::spawn(|| {
        let _g = Autocast::new(Cuda).enter();
    })
    .join()
    .map_err(|_| "thread failed")?;
    use_weight(&w, &casts)?;
    assert_eq!(casts.get(), 1);
    Ok(())
}

#[test]
fn a_bf16_region_does_not_reuse_an_fp16_cast() -> TestResult {
    let (w, casts) = (weight(17), Cell::new(0));
    let _g = Autocast::new(Cuda).enter()?;
    let a = use_weight(&w, &casts)?.ok_or("no cast")?;
    let _b = Autocast::new(Cuda).dtype(BF16).enter()?;
    let b = use_weight(&w, &casts)?.ok_or("no cast")?;
    assert_eq!((a.2, b.2, casts.get()), (F16, BF16, 2));
    Ok(())
}
