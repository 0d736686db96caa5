//! The guarded cache as a wrapped function's caller sees it: MRU order, miss reasons,
//! recompile limits with PyTorch's counters and texts, automatic dynamic shapes,
//! invalidation, and a property test against a straightforward reference.
use std::convert::Infallible;

use ferrocuda_amp::autocast::{AmpState, DeviceKind};
use ferrocuda_amp::precision::PrecisionSettings;
use ferrocuda_graph::guards::{
    CacheConfig, CacheError, Call, GlobalState, GuardedCache, LibraryState, Limit, Specialization,
    TensorMeta,
};
use ferrocuda_types::{DType, DeviceIndex};
use proptest::prelude::*;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn globals() -> GlobalState {
    GlobalState::from_parts(
        LibraryState::default(),
        &AmpState::default(),
        &PrecisionSettings::PYTORCH_DEFAULT,
    )
}

fn vector<'a>(len: &'a [i64]) -> Result<TensorMeta<'a>, Box<dyn std::error::Error>> {
    Ok(TensorMeta::new(
        DType::F32,
        DeviceIndex(0),
        false,
        len,
        &[1],
    )?)
}

/// What a call did, without the borrow: ("hit" | "compiled" | "eager", value or warning).
fn outcome(call: Result<Call<'_, u32>, CacheError<Infallible>>) -> (String, String) {
    match call {
        Ok(Call::Hit { value, .. }) => ("hit".into(), value.to_string()),
        Ok(Call::Compiled {
            value, recompile, ..
        }) => (
            "compiled".into(),
            format!(
                "{value} {}",
                recompile.map(|r| r.to_string()).unwrap_or_default()
            ),
        ),
        Ok(Call::Eager { limit_hit }) => (
            "eager".into(),
            limit_hit.map(|h| h.to_string()).unwrap_or_default(),
        ),
        Ok(_) => ("other".into(), String::new()),
        Err(e) => ("error".into(), e.to_string()),
    }
}

fn run(cache: &mut GuardedCache<u32>, size: i64, g: &GlobalState) -> TestResult2 {
    let sizes = [size];
    let n = cache.len() as u32;
    Ok(outcome(cache.call(&[vector(&sizes)?], g, |_| Ok(n))))
}
type TestResult2 = Result<(String, String), Box<dyn std::error::Error>>;

fn static_config() -> CacheConfig {
    CacheConfig {
        automatic_dynamic_shapes: false,
        ..CacheConfig::default()
    }
}

#[test]
fn hits_move_to_the_front() -> TestResult {
    let g = globals();
    let mut cache = GuardedCache::new("f", static_config());
    for size in [1, 2, 3] {
        assert_eq!(run(&mut cache, size, &g)?.0, "compiled");
    }
    let order = |c: &GuardedCache<u32>| {
        c.entries()
            .filter_map(|e| c.value(e).copied())
            .collect::<Vec<_>>()
    };
    assert_eq!(order(&cache), [2, 1, 0]);
    assert_eq!(run(&mut cache, 1, &g)?, ("hit".into(), "0".into()));
    assert_eq!(order(&cache), [0, 2, 1]);
    assert_eq!(run(&mut cache, 3, &g)?, ("hit".into(), "2".into()));
    assert_eq!(order(&cache), [2, 0, 1]);
    assert_eq!(cache.stats().hits, 2);
    Ok(())
}

#[test]
fn a_recompile_says_why_each_entry_missed() -> TestResult {
    let g = globals();
    let mut cache = GuardedCache::new("f", static_config()).with_input_names(["x"]);
    let line = line!() - 1; // where `GuardedCache::new` was called
    run(&mut cache, 4, &g)?;
    let first = cache.entries().next().and_then(|e| cache.compile_id(e));
    let frame = first.ok_or("no entry")?.frame;
    run(&mut cache, 5, &g)?;
    let (what, log) = run(&mut cache, 7, &g)?;
    assert_eq!(what, "compiled");
    assert_eq!(cache.function().location.line(), line);
    let expected = format!(
        "2 Recompiling function f in {}:{line}\n    triggered by the following guard failure(s):\n    - {frame}/1: tensor 'x' size mismatch at index 0. expected 5, actual 7\n    - {frame}/0: tensor 'x' size mismatch at index 0. expected 4, actual 7",
        file!()
    );
    assert_eq!(log, expected);
    // A global-state change is reported before the inputs.
    let no_grad = GlobalState::from_parts(
        LibraryState {
            grad_mode: false,
            ..LibraryState::default()
        },
        &AmpState::default().enable(DeviceKind::Cuda, DType::BF16)?,
        &PrecisionSettings::PYTORCH_DEFAULT,
    );
    let sizes = [4];
    let reasons = cache.miss_reasons(&[vector(&sizes)?], &no_grad);
    assert_eq!(reasons.len(), 3);
    assert!(
        reasons
            .iter()
            .all(|r| r.ends_with(": GLOBAL_STATE changed: grad_mode autocast "))
    );
    Ok(())
}

#[test]
fn recompile_limit_then_run_only() -> TestResult {
    // torch.compile(dynamic=False) over sizes 1..9: 8 compiles, the 9th call runs eagerly
    // with the warning; frames total 9, ok 8.
    let g = globals();
    let mut cache = GuardedCache::new("f", static_config()).with_input_names(["x"]);
    for size in 1..=8 {
        assert_eq!(run(&mut cache, size, &g)?.0, "compiled");
    }
    let (what, warning) = run(&mut cache, 9, &g)?;
    assert_eq!(what, "eager");
    let frame = cache
        .entries()
        .next()
        .and_then(|e| cache.compile_id(e))
        .ok_or("empty")?
        .frame;
    let lines: Vec<&str> = warning.lines().collect();
    assert_eq!(lines[0], "torch._dynamo hit config.recompile_limit (8)");
    assert!(lines[1].starts_with("   function: 'f' ("));
    assert_eq!(
        lines[2],
        format!(
            "   last reason: {frame}/7: tensor 'x' size mismatch at index 0. expected 8, actual 9"
        )
    );
    assert_eq!(
        lines[3],
        "To log all recompilation reasons, use TORCH_LOGS=\"recompiles\"."
    );
    assert!(lines[4].starts_with("To diagnose recompilation issues, see https://"));
    let stats = cache.stats();
    assert_eq!((stats.frames_total, stats.frames_ok), (9, 8));
    assert!(cache.is_run_only());
    // Run-only: entries still hit, a miss runs eagerly without a warning or a compile.
    assert_eq!(run(&mut cache, 3, &g)?, ("hit".into(), "2".into()));
    assert_eq!(run(&mut cache, 10, &g)?, ("eager".into(), String::new()));
    let stats = cache.stats();
    assert_eq!(
        (stats.frames_total, stats.frames_ok, stats.eager_runs),
        (9, 8, 2)
    );
    assert_eq!(cache.len(), 8);
    Ok(())
}

#[test]
fn accumulated_limit_binds_when_the_recompile_limit_is_raised() -> TestResult {
    let g = globals();
    let config = CacheConfig {
        recompile_limit: 1000,
        ..static_config()
    };
    let mut cache = GuardedCache::new("f", config);
    for size in 1..=256 {
        assert_eq!(run(&mut cache, size, &g)?.0, "compiled");
    }
    let (what, warning) = run(&mut cache, 257, &g)?;
    assert_eq!(what, "eager");
    assert!(warning.starts_with("torch._dynamo hit config.accumulated_recompile_limit (256)\n"));
    assert_eq!(
        (cache.stats().frames_total, cache.stats().frames_ok),
        (257, 256)
    );
    Ok(())
}

#[test]
fn fail_on_recompile_limit_hit_is_a_typed_error() -> TestResult {
    let g = globals();
    let config = CacheConfig {
        recompile_limit: 2,
        fail_on_recompile_limit_hit: true,
        ..static_config()
    };
    let mut cache: GuardedCache<u32> = GuardedCache::new("f", config);
    run(&mut cache, 1, &g)?;
    run(&mut cache, 2, &g)?;
    for _ in 0..2 {
        let sizes = [3];
        match cache.call(&[vector(&sizes)?], &g, |_| Ok::<_, Infallible>(0)) {
            Err(CacheError::RecompileLimitHit(hit)) => {
                assert_eq!(hit.limit, Limit::Recompile);
                assert_eq!(hit.value, 2);
            }
            other => return Err(format!("expected the limit error, got {other:?}").into()),
        }
    }
    let sizes = [3];
    let err = cache.call(&[vector(&sizes)?], &g, |_| Ok::<_, Infallible>(0));
    assert_eq!(
        err.err().map(|e| e.to_string()).as_deref(),
        Some(
            "recompile_limit reached, because fail_on_recompile_limit_hit = True this is a HARD failure"
        )
    );
    // Not run-only: existing entries hit, and the error repeats for each miss.
    assert!(!cache.is_run_only());
    assert_eq!(run(&mut cache, 1, &g)?.0, "hit");
    Ok(())
}

#[test]
fn automatic_dynamic_costs_one_recompile() -> TestResult {
    let g = globals();
    let mut cache = GuardedCache::new("f", CacheConfig::default());
    let mut specs: Vec<Specialization> = Vec::new();
    let mut call = |cache: &mut GuardedCache<u32>, batch: i64| -> TestResult2 {
        let (sizes, strides) = ([batch, 16], [16, 1]);
        let x = TensorMeta::new(DType::F16, DeviceIndex(0), false, &sizes, &strides)?;
        let n = cache.len() as u32;
        Ok(outcome(cache.call(&[x], &g, |spec| {
            specs.push(spec.clone());
            Ok(n)
        })))
    };
    assert_eq!(call(&mut cache, 4)?.0, "compiled");
    assert_eq!(call(&mut cache, 8)?.0, "compiled");
    for batch in [3, 5, 8, 100, 4] {
        assert_eq!(
            call(&mut cache, batch)?,
            ("hit".into(), "1".into()),
            "batch {batch}"
        );
    }
    assert_eq!(specs.len(), 2);
    assert_eq!(specs[0].inputs()[0].sizes(), [Some(4), Some(16)]);
    assert_eq!(specs[1].inputs()[0].sizes(), [None, Some(16)]);
    assert_eq!(specs[1].inputs()[0].strides(), [Some(16), Some(1)]);
    assert_eq!(cache.stats().frames_ok, 2);
    Ok(())
}

#[test]
fn an_invalidated_entry_fails_and_moves_to_the_back() -> TestResult {
    let g = globals();
    let mut cache = GuardedCache::new("f", static_config()).with_input_names(["x"]);
    for size in [1, 2, 3] {
        run(&mut cache, size, &g)?;
    }
    let second = cache.entries().nth(1).ok_or("no entry")?;
    let id = cache.compile_id(second).ok_or("no id")?;
    assert_eq!(cache.invalidate(second, "a static input"), Some(1));
    assert_eq!(cache.invalidate(second, "a static input"), None);
    assert_eq!(cache.entries().last(), Some(second));
    assert_eq!(cache.value(second), None);
    let sizes = [2];
    let reasons = cache.miss_reasons(&[vector(&sizes)?], &g);
    assert_eq!(
        reasons.last().map(String::as_str),
        Some(
            format!("{id}: Cache line invalidated because a static input got deallocated").as_str()
        )
    );
    // The same input compiles a new entry; the dead one still counts towards the limits.
    assert_eq!(run(&mut cache, 2, &g)?.0, "compiled");
    assert_eq!(cache.len(), 4);
    Ok(())
}

// ---- property test: the cache's decision equals a reference walk --------------------------

/// One call of a random stream.
#[derive(Clone, Debug)]
struct Step {
    dtype: DType,
    requires_grad: bool,
    device: u16,
    sizes: Vec<i64>,
    strides: Vec<i64>,
    two_inputs: bool,
    grad_mode: bool,
    autocast: Option<DType>,
    /// Invalidate the entry at this MRU position before the call.
    invalidate: Option<usize>,
}

fn step() -> impl Strategy<Value = Step> {
    (
        prop::sample::select(vec![DType::F32, DType::F16]),
        any::<bool>(),
        0u16..2,
        prop::collection::vec((1i64..4, 1i64..3), 1..7),
        any::<bool>(),
        prop::bool::weighted(0.9),
        prop::sample::select(vec![None, Some(DType::F16), Some(DType::BF16)]),
        prop::option::weighted(0.1, 0usize..4),
    )
        .prop_map(
            |(dtype, requires_grad, device, dims, two_inputs, grad_mode, autocast, invalidate)| {
                Step {
                    dtype,
                    requires_grad,
                    device,
                    sizes: dims.iter().map(|d| d.0).collect(),
                    strides: dims.iter().map(|d| d.1).collect(),
                    two_inputs,
                    grad_mode,
                    autocast,
                    invalidate,
                }
            },
        )
}

/// The reference: entries in MRU order, each compared field by field.
#[derive(Clone, Debug)]
struct RefEntry {
    value: u32,
    spec: Specialization,
    globals: (bool, Option<DType>),
    dead: bool,
}

fn ref_passes(e: &RefEntry, inputs: &[TensorMeta<'_>], globals: (bool, Option<DType>)) -> bool {
    let guards = e.spec.inputs();
    !e.dead
        && e.globals == globals
        && guards.len() == inputs.len()
        && guards.iter().zip(inputs).all(|(g, t)| {
            g.dtype() == t.dtype()
                && g.device() == t.device()
                && g.requires_grad() == t.requires_grad()
                && g.rank() == t.sizes().len()
                && g.sizes()
                    .iter()
                    .zip(t.sizes())
                    .all(|(e, a)| e.is_none_or(|e| e == *a))
                && g.strides()
                    .iter()
                    .zip(t.strides())
                    .all(|(e, a)| e.is_none_or(|e| e == *a))
        })
}

fn check_stream(steps: &[Step], automatic: bool, limit: usize) -> Result<(), TestCaseError> {
    let config = CacheConfig {
        recompile_limit: limit,
        automatic_dynamic_shapes: automatic,
        ..CacheConfig::default()
    };
    let mut cache: GuardedCache<u32> = GuardedCache::new("prop", config);
    let mut reference: Vec<RefEntry> = Vec::new();
    let mut run_only = false;
    let other = [2i64, 2];
    let other_strides = [2i64, 1];
    for (n, s) in steps.iter().enumerate() {
        if let Some(pos) = s.invalidate {
            let id = cache.entries().nth(pos);
            if let (Some(id), Some(r)) = (id, reference.get(pos)) {
                let dead = !r.dead;
                prop_assert_eq!(cache.invalidate(id, "x").is_some(), dead);
                let mut e = reference.remove(pos);
                e.dead = true;
                reference.push(e);
            }
        }
        let x = TensorMeta::new(
            s.dtype,
            DeviceIndex(s.device),
            s.requires_grad,
            &s.sizes,
            &s.strides,
        )
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let y = TensorMeta::new(DType::F32, DeviceIndex(0), false, &other, &other_strides)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let inputs: Vec<TensorMeta<'_>> = if s.two_inputs { vec![x, y] } else { vec![x] };
        let mut amp = AmpState::default();
        if let Some(d) = s.autocast {
            amp = amp
                .enable(DeviceKind::Cuda, d)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        let lib = LibraryState {
            grad_mode: s.grad_mode,
            ..LibraryState::default()
        };
        let g = GlobalState::from_parts(lib, &amp, &PrecisionSettings::PYTORCH_DEFAULT);
        let key = (s.grad_mode, s.autocast);

        let expected = reference.iter().position(|e| ref_passes(e, &inputs, key));
        let mut compiled: Option<Specialization> = None;
        let value = n as u32;
        let got = cache.call(&inputs, &g, |spec| {
            compiled = Some(spec.clone());
            Ok::<_, Infallible>(value)
        });
        match (got, expected) {
            (Ok(Call::Hit { value, .. }), Some(pos)) => {
                let e = reference.remove(pos);
                prop_assert_eq!(*value, e.value);
                reference.insert(0, e);
            }
            (Ok(Call::Compiled { value, .. }), None) => {
                prop_assert!(!run_only && reference.len() < limit);
                let spec = compiled
                    .take()
                    .ok_or_else(|| TestCaseError::fail("no spec"))?;
                // The specialisation admits the inputs it was compiled for.
                let e = RefEntry {
                    value: *value,
                    spec,
                    globals: key,
                    dead: false,
                };
                prop_assert!(ref_passes(&e, &inputs, key));
                reference.insert(0, e);
            }
            (Ok(Call::Eager { limit_hit }), None) => {
                prop_assert!(run_only || reference.len() >= limit);
                prop_assert_eq!(limit_hit.is_some(), !run_only);
                run_only = true;
            }
            (other, expected) => {
                return Err(TestCaseError::fail(format!(
                    "cache {other:?}, reference {expected:?}"
                )));
            }
        }
        let order: Vec<u32> = cache
            .entries()
            .filter_map(|e| cache.value(e).copied())
            .collect();
        let live: Vec<u32> = reference
            .iter()
            .filter(|e| !e.dead)
            .map(|e| e.value)
            .collect();
        prop_assert_eq!(order, live);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn decisions_equal_a_reference_walk(
        steps in prop::collection::vec(step(), 1..60),
        automatic in any::<bool>(),
        limit in 1usize..10,
    ) {
        check_stream(&steps, automatic, limit)?;
    }
}
