//! Defect 2: autocast guards dropped out of order left autocast enabled. Each guard restored
//! the state it found, which is only right when guards drop in reverse order. Now the state
//! is always the thread's state before its first live guard with every live guard's change
//! applied in the order they were made, so once every guard is gone it is the state before
//! the first one, whatever the drop order.
use super::TestResult;
use ferrocuda_amp::autocast::{
    AmpState, Autocast, AutocastArg, AutocastError, AutocastGuard, DeviceKind, InferenceModeGuard,
    RedispatchGuard, StateGuard, cast_inputs_by_name, is_enabled, is_inference_mode, nesting,
    thread_cache_len,
};
use ferrocuda_types::DType;
use proptest::prelude::*;

use DeviceKind::{Cpu, Cuda, Xpu};

#[test]
fn two_regions_dropped_outer_first() -> TestResult {
    let before = AmpState::current();
    let a = Autocast::new(Cuda).enter()?;
    let b = Autocast::new(Cuda).dtype(DType::BF16).enter()?;
    drop(a);
    assert!(is_enabled(Cuda), "b is alive");
    assert_eq!(nesting(), 1);
    drop(b);
    assert!(!is_enabled(Cuda), "autocast left on");
    assert_eq!(AmpState::current(), before);
    assert_eq!(nesting(), 0);
    // On two devices: the state is the live guards' changes.
    let a = Autocast::new(Cuda).enter()?;
    let b = Autocast::new(Cpu).dtype(DType::BF16).enter()?;
    drop(a);
    assert!(!is_enabled(Cuda) && is_enabled(Cpu));
    drop(b);
    assert_eq!(AmpState::current(), before);
    Ok(())
}

#[test]
fn guards_kept_in_a_vec_and_dropped_in_insertion_order() -> TestResult {
    let before = AmpState::current();
    let mut guards = Vec::new();
    for (device, dtype) in [(Cuda, DType::F16), (Cpu, DType::BF16), (Cuda, DType::BF16)] {
        guards.push(Autocast::new(device).dtype(dtype).enter()?);
    }
    assert_eq!(AmpState::current().dtype(Cuda), DType::BF16);
    let mut it = guards.into_iter();
    drop(it.next());
    assert_eq!(
        (is_enabled(Cuda), AmpState::current().dtype(Cuda)),
        (true, DType::BF16),
        "the third region still holds CUDA in bf16"
    );
    drop(it.next());
    assert!(!is_enabled(Cpu));
    drop(it);
    assert_eq!(AmpState::current(), before);
    assert_eq!(nesting(), 0);
    Ok(())
}

#[test]
fn a_redispatch_guard_outliving_its_region() -> TestResult {
    let before = AmpState::current();
    let region = Autocast::new(Cuda).enter()?;
    let redispatch = RedispatchGuard::new(Cuda);
    assert!(!is_enabled(Cuda));
    drop(region);
    assert!(!is_enabled(Cuda));
    assert_eq!(nesting(), 0, "a redispatch guard is not a scope");
    drop(redispatch);
    assert!(
        !is_enabled(Cuda),
        "the region is gone: autocast must not come back"
    );
    assert_eq!(AmpState::current(), before);
    Ok(())
}

#[test]
fn a_state_guard_and_inference_guards_out_of_order() -> TestResult {
    let before = AmpState::current();
    let installed = AmpState::default()
        .enable(Xpu, DType::BF16)?
        .with_cache_enabled(false);
    let s = installed.enter();
    let i1 = InferenceModeGuard::new(true);
    let r = Autocast::new(Cpu).enter()?;
    let i2 = InferenceModeGuard::new(false);
    drop(s);
    drop(i1);
    assert!(!is_inference_mode(), "i2 is alive");
    assert!(is_enabled(Cpu) && !is_enabled(Xpu));
    drop(i2);
    assert!(!is_inference_mode());
    drop(r);
    assert_eq!(AmpState::current(), before);
    assert!(!is_inference_mode());
    Ok(())
}

/// A parameter as autocast sees it, for the weight-cast cache.
struct W;

impl AutocastArg for W {
    fn dtype(&self) -> DType {
        DType::F32
    }
    fn device_kind(&self) -> DeviceKind {
        Cuda
    }
    fn is_leaf_requiring_grad(&self) -> bool {
        true
    }
    fn identity(&self) -> u64 {
        0xa0d17
    }
    fn version(&self) -> u64 {
        0
    }
}

/// The cache is cleared when the last scope goes, whichever that is (PyTorch clears it at
/// the outermost exit).
#[test]
fn the_cache_is_cleared_when_the_last_scope_goes() -> TestResult {
    let a = Autocast::new(Cuda).enter()?;
    let b = Autocast::new(Cuda).enter()?;
    let plan = cast_inputs_by_name(Cuda, "mm", [&W])?;
    plan.cast_arg(&W, Ok::<_, AutocastError>)?;
    assert_eq!(thread_cache_len::<DType>(), 1);
    drop(a);
    assert_eq!(thread_cache_len::<DType>(), 1, "b is still open");
    drop(b);
    assert_eq!(thread_cache_len::<DType>(), 0);
    Ok(())
}

/// A region guard kept in a thread-local, dropped at thread exit: whichever order the
/// runtime destroys thread-locals in, one of the two threads drops the guard after the cast
/// cache is gone, and the guard then clears caches that no longer exist. That must not
/// panic (a panic in a thread-local destructor aborts the process).
#[test]
fn a_guard_dropped_after_its_threads_cache_is_gone() -> TestResult {
    thread_local! {
        static KEPT: std::cell::RefCell<Option<AutocastGuard>> =
            const { std::cell::RefCell::new(None) };
    }
    for cache_first in [false, true] {
        let worker = std::thread::spawn(move || -> Result<(), AutocastError> {
            let cast = || -> Result<(), AutocastError> {
                let plan = cast_inputs_by_name(Cuda, "mm", [&W])?;
                plan.cast_arg(&W, Ok::<_, AutocastError>)?;
                Ok(())
            };
            if cache_first {
                // Registers the cache's destructor before KEPT's.
                let _scope = Autocast::new(Cuda).enter()?;
                cast()?;
            }
            KEPT.with(|k| k.borrow_mut().take());
            let guard = Autocast::new(Cuda).enter()?;
            KEPT.with(|k| *k.borrow_mut() = Some(guard));
            cast()?;
            assert_eq!(thread_cache_len::<DType>(), 1);
            Ok(())
        });
        let outcome = worker.join().map_err(|_| "the thread panicked")?;
        outcome?;
    }
    Ok(())
}

/// A guard of any kind, as the test holds it.
#[allow(dead_code)]
enum Guard {
    Region(AutocastGuard),
    State(StateGuard),
    Redispatch(RedispatchGuard),
    Inference(InferenceModeGuard),
}

/// What a guard changes: the model applies it to a plain value.
#[derive(Copy, Clone, Debug)]
enum Change {
    Region {
        device: DeviceKind,
        dtype: DType,
        enabled: bool,
        cache: bool,
    },
    State(AmpState),
    Redispatch(DeviceKind),
    Inference(bool),
}

/// The model: the state before the first guard, then each live guard's change in order.
#[derive(Copy, Clone, Debug, PartialEq)]
struct Model {
    amp: AmpState,
    inference: bool,
}

impl Model {
    fn apply(mut self, change: Change) -> Model {
        match change {
            Change::Region {
                device,
                dtype,
                enabled,
                cache,
            } => {
                let with_dtype = self.amp.enable(device, dtype).expect("fp16 or bf16");
                self.amp = if enabled {
                    with_dtype
                } else {
                    with_dtype.disable(device)
                }
                .with_cache_enabled(cache);
            }
            Change::State(s) => self.amp = s,
            Change::Redispatch(d) => self.amp = self.amp.disable(d),
            Change::Inference(on) => self.inference = on,
        }
        self
    }

    fn now() -> Model {
        Model {
            amp: AmpState::current(),
            inference: is_inference_mode(),
        }
    }
}

fn enter(change: Change) -> Guard {
    match change {
        Change::Region {
            device,
            dtype,
            enabled,
            cache,
        } => Guard::Region(
            Autocast::new(device)
                .dtype(dtype)
                .enabled(enabled)
                .cache_enabled(cache)
                .enter()
                .expect("fp16 or bf16"),
        ),
        Change::State(s) => Guard::State(s.enter()),
        Change::Redispatch(d) => Guard::Redispatch(RedispatchGuard::new(d)),
        Change::Inference(on) => Guard::Inference(InferenceModeGuard::new(on)),
    }
}

fn device() -> impl Strategy<Value = DeviceKind> {
    prop_oneof![Just(Cuda), Just(Cpu), Just(Xpu)]
}

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F16), Just(DType::BF16)]
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        4 => (device(), dtype(), any::<bool>(), any::<bool>()).prop_map(
            |(device, dtype, enabled, cache)| Change::Region { device, dtype, enabled, cache }
        ),
        1 => (device(), dtype(), any::<bool>()).prop_map(|(d, t, cache)| {
            Change::State(
                AmpState::default()
                    .enable(d, t)
                    .expect("fp16 or bf16")
                    .with_cache_enabled(cache),
            )
        }),
        2 => device().prop_map(Change::Redispatch),
        1 => any::<bool>().prop_map(Change::Inference),
    ]
}

/// Enter a guard, or drop the live guard at a position (taken modulo the live count).
#[derive(Clone, Debug)]
enum Action {
    Enter(Change),
    Drop(usize),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => change().prop_map(Action::Enter),
        2 => any::<usize>().prop_map(Action::Drop),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random interleavings of enters and drops in any order, then the rest dropped in a
    /// random order: after every step the state is the model's, the nesting depth counts
    /// the live scopes, and at the end the state is the one before the first guard.
    #[test]
    fn any_drop_order_matches_the_model(
        actions in prop::collection::vec(action(), 0..40),
        tail in prop::collection::vec(any::<usize>(), 40),
    ) {
        let base = Model::now();
        let base_nesting = nesting();
        let mut live: Vec<(Change, Guard)> = Vec::new();
        let check = |live: &Vec<(Change, Guard)>| -> Result<(), TestCaseError> {
            let want = live.iter().fold(base, |m, (c, _)| m.apply(*c));
            prop_assert_eq!(Model::now(), want);
            let scopes = live
                .iter()
                .filter(|(c, _)| matches!(c, Change::Region { .. } | Change::State(_)))
                .count() as u32;
            prop_assert_eq!(nesting(), base_nesting + scopes);
            Ok(())
        };
        for a in actions {
            match a {
                Action::Enter(c) => live.push((c, enter(c))),
                Action::Drop(i) if !live.is_empty() => {
                    live.remove(i % live.len());
                }
                Action::Drop(_) => {}
            }
            check(&live)?;
        }
        for i in tail {
            if live.is_empty() {
                break;
            }
            live.remove(i % live.len());
            check(&live)?;
        }
        while let Some(g) = live.pop() {
            drop(g);
            check(&live)?;
        }
        prop_assert_eq!(Model::now(), base);
        prop_assert_eq!(nesting(), base_nesting);
    }
}
