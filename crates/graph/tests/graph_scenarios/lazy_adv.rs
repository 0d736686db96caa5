//! Adversarial tests of [`LazyGraphs`] on the fake device, from its contract: held bytes
//! never above the budget, the least recently used evicted first (checked against a model
//! over many keys and a seeded access sequence), an evicted graph's memory back with the
//! driver, outputs right after replays with new inputs, a closure's error in its warm-up or
//! its capture leaving the structure as it was and no memory behind, budget 0.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use ferrocuda_alloc::{Caching, CachingAllocator, DeviceAllocators};
use ferrocuda_driver::{FakeDriver, fake::Completion};
use ferrocuda_graph::{GraphError, LazyGraphs, LazyStats};
use ferrocuda_stream::{DeviceBuffer, Function, KernelCache, Module, Runtime, Stream};
use ferrocuda_testkit::{KERNELS, register_fake_kernels};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, KernelArg, LaunchConfig};
use std::sync::Arc;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type TestResult = Result<(), BoxError>;
const D0: DeviceIndex = DeviceIndex(0);
const MIB: u64 = 1 << 20;
const N: usize = 1024;

struct Dev {
    _fake: Arc<FakeDriver>,
    rt: Arc<Runtime>,
    allocators: Arc<DeviceAllocators>,
    scale: Function,
}

impl Dev {
    fn new(capacity: u64) -> Result<Dev, BoxError> {
        let fake = Arc::new(
            FakeDriver::builder()
                .capacity(capacity)
                .completion(Completion::Eager)
                .build(),
        );
        register_fake_kernels(&fake);
        let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
        let allocators =
            DeviceAllocators::new(fake.clone(), AllocatorConfig::default(), Caching::On);
        allocators.install(&rt);
        let module = Module::from_cuda_source(&rt, D0, "lazy_adv", KERNELS)?;
        Ok(Dev {
            scale: module.function("scale_f32")?,
            _fake: fake,
            rt,
            allocators,
        })
    }

    fn alloc(&self) -> &CachingAllocator {
        self.allocators.device(D0).unwrap()
    }

    fn lazy<T>(&self, budget: u64) -> LazyGraphs<u64, T> {
        LazyGraphs::new(self.rt.clone(), self.allocators.clone(), D0, budget).unwrap()
    }

    /// `y[..N] = a * x[..N]` on `stream`.
    fn scale(&self, stream: &Stream, y: &DeviceBuffer<f32>, x: &DeviceBuffer<f32>, a: f32) {
        let n = N as u32;
        let args = [y.arg(), x.arg(), KernelArg::value(&a), KernelArg::value(&n)];
        stream
            .launch(&self.scale, &LaunchConfig::for_elements(N, 256), &args)
            .unwrap();
    }

    /// A step for `batch`: a temporary of `batch` × 2 MiB, an output of `batch * input`.
    fn step(
        &self,
        stream: &Stream,
        input: &DeviceBuffer<f32>,
        batch: u64,
    ) -> Result<DeviceBuffer<f32>, BoxError> {
        let t = DeviceBuffer::<f32>::uninit(&self.rt, D0, (batch * MIB / 2) as usize)?;
        self.scale(stream, &t, input, batch as f32);
        let out = DeviceBuffer::<f32>::uninit(&self.rt, D0, N)?;
        self.scale(stream, &out, &t, 1.0);
        Ok(out)
    }

    fn reserved(&self) -> i64 {
        self.alloc().stats().reserved_bytes.all.current
    }

    fn allocated_now(&self) -> i64 {
        self.alloc().stats().allocated_bytes.all.current
    }

    /// Reserved bytes once the default pool's cache is emptied.
    fn reserved_without_cache(&self) -> i64 {
        self.alloc().empty_cache();
        self.reserved()
    }
}

fn expect(stream: &Stream, buf: &DeviceBuffer<f32>, v: f32, what: &str) -> TestResult {
    stream.synchronize()?;
    let got = buf.to_host()?;
    if let Some(i) = got.iter().position(|&x| x != v) {
        return Err(format!("{what}: element {i} is {}, expected {v}", got[i]).into());
    }
    Ok(())
}

/// What `step(batch)` reserves in a pool of its own: the temporary's segment (20 MiB
/// below 10 MiB, else its 2 MiB multiple) and a 2 MiB small segment for the output.
fn planned(batch: u64) -> u64 {
    let t = batch * 2 * MIB;
    (if t < 10 * MIB { 20 * MIB } else { t }) + 2 * MIB
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// 200 runs over 14 keys (two of them over the whole budget) in a seeded order, replays on
/// two streams with a new input value every run: outputs right, the LRU order, held bytes
/// and statistics as a model says, and the device's reserved memory = input + held.
#[test]
fn many_keys_follow_an_lru_model_and_give_memory_back() -> TestResult {
    let d = Dev::new(8 << 30)?;
    let input = DeviceBuffer::filled(&d.rt, D0, N, 1.0f32)?;
    let current = d.rt.current_stream(D0)?;
    let other = d.rt.new_stream(D0, 0)?;
    current.synchronize()?;
    let base = d.reserved_without_cache();
    let budget = 100 * MIB;
    let mut lazy = d.lazy::<DeviceBuffer<f32>>(budget);
    let keys = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 20, 30, 49, 60];
    let mut model: Vec<u64> = Vec::new();
    let mut want = LazyStats::default();
    let mut rng = Rng(0x5EED_1234_9876_0001);
    for run in 0..200u32 {
        let key = keys[rng.below(keys.len() as u64) as usize];
        let v = (run % 7 + 1) as f32;
        input.copy_from_host(&vec![v; N])?;
        let stream = if run % 3 == 0 { &other } else { &current };
        stream.wait_stream(&current)?;
        let r = lazy.run(key, stream, |s| d.step(s, &input, key));
        if planned(key) > budget {
            match r {
                Err(e) => match e.downcast_ref::<GraphError>() {
                    Some(GraphError::OverBudget {
                        planned: p,
                        budget: b,
                    }) => {
                        assert_eq!((*p, *b), (planned(key), budget), "run {run}");
                    }
                    _ => panic!("run {run}: key {key}: {e}"),
                },
                Ok(_) => panic!("run {run}: key {key} fit a budget it exceeds"),
            }
        } else {
            let out = r?;
            expect(stream, out, key as f32 * v, &format!("run {run} key {key}"))?;
            if let Some(i) = model.iter().position(|&k| k == key) {
                model.remove(i);
                want.replays += 1;
            } else {
                while model.iter().map(|&k| planned(k)).sum::<u64>() + planned(key) > budget {
                    model.remove(0);
                    want.evictions += 1;
                }
                want.captures += 1;
            }
            model.push(key);
        }
        current.wait_stream(stream)?;
        assert_eq!(lazy.keys_by_use(), model, "run {run}, key {key}");
        let held: u64 = model.iter().map(|&k| planned(k)).sum();
        assert_eq!(lazy.held_bytes(), held, "run {run}");
        assert!(lazy.held_bytes() <= budget);
        assert_eq!(lazy.stats(), want, "run {run}");
        assert_eq!(
            d.reserved_without_cache(),
            base + held as i64,
            "run {run}: the device holds the input and the held pools only"
        );
    }
    assert!(want.evictions > 20 && want.replays > 20, "{want:?}");
    drop(lazy);
    assert_eq!(d.reserved_without_cache(), base);
    d.alloc().check_invariants()?;
    Ok(())
}

/// An evicted graph's pool goes back to the driver at once (no `empty_cache`), evicting an
/// absent key is `false`, and the key captured again replays right.
#[test]
fn eviction_gives_memory_back_at_once_and_a_key_comes_back() -> TestResult {
    let d = Dev::new(8 << 30)?;
    let input = DeviceBuffer::filled(&d.rt, D0, N, 2.0f32)?;
    let current = d.rt.current_stream(D0)?;
    current.synchronize()?;
    let mut lazy = d.lazy::<DeviceBuffer<f32>>(GIB_BUDGET);
    for key in [3u64, 7] {
        let out = lazy.run(key, &current, |s| d.step(s, &input, key))?;
        expect(&current, out, 2.0 * key as f32, "first run")?;
    }
    let before = d.reserved();
    assert!(lazy.evict(&7)?);
    assert_eq!(
        d.reserved(),
        before - planned(7) as i64,
        "7's pool went back"
    );
    assert!(!lazy.evict(&7)?);
    assert!(!lazy.evict(&99)?);
    assert_eq!(lazy.keys_by_use(), vec![3]);
    let out = lazy.run(7, &current, |s| d.step(s, &input, 7))?;
    expect(&current, out, 14.0, "7 again")?;
    assert_eq!(lazy.stats().captures, 3);
    assert_eq!(lazy.held_bytes(), planned(3) + planned(7));
    Ok(())
}

const GIB_BUDGET: u64 = 1 << 30;

/// A budget equal to one key's plan holds that key; a second key of the same plan evicts
/// it; one byte less refuses the key.
#[test]
fn a_budget_equal_to_the_plan_fits_exactly() -> TestResult {
    let d = Dev::new(8 << 30)?;
    let input = DeviceBuffer::filled(&d.rt, D0, N, 1.0f32)?;
    let current = d.rt.current_stream(D0)?;
    current.synchronize()?;
    let mut lazy = d.lazy::<DeviceBuffer<f32>>(planned(1));
    lazy.run(1, &current, |s| d.step(s, &input, 1))?;
    lazy.run(2, &current, |s| d.step(s, &input, 2))?;
    assert_eq!(lazy.keys_by_use(), vec![2]);
    assert_eq!(lazy.stats().evictions, 1);
    let mut tight = d.lazy::<DeviceBuffer<f32>>(planned(1) - 1);
    let r = tight.run(1, &current, |s| d.step(s, &input, 1));
    assert!(matches!(
        r.err()
            .as_ref()
            .and_then(|e| e.downcast_ref::<GraphError>()),
        Some(GraphError::OverBudget { .. })
    ));
    assert_eq!(tight.held_bytes(), 0);
    Ok(())
}

/// Budget 0: a key that allocates is over budget (nothing held, nothing leaked); a key
/// whose work allocates nothing plans 0 bytes, fits, and replays right.
#[test]
fn budget_zero() -> TestResult {
    let d = Dev::new(8 << 30)?;
    let input = DeviceBuffer::filled(&d.rt, D0, N, 1.0f32)?;
    let output = DeviceBuffer::filled(&d.rt, D0, N, 0.0f32)?;
    let current = d.rt.current_stream(D0)?;
    current.synchronize()?;
    let (reserved, allocated) = (d.reserved_without_cache(), d.allocated_now());
    let mut lazy = d.lazy::<DeviceBuffer<f32>>(0);
    match lazy.run(1, &current, |s| d.step(s, &input, 1)) {
        Err(e) => match e.downcast_ref::<GraphError>() {
            Some(GraphError::OverBudget { planned: p, budget }) => {
                assert_eq!((*p, *budget), (planned(1), 0));
            }
            _ => panic!("{e}"),
        },
        Ok(_) => panic!("22 MiB fit a budget of 0"),
    }
    assert!(!lazy.contains(&1));
    assert_eq!(
        (d.reserved_without_cache(), d.allocated_now()),
        (reserved, allocated)
    );
    let mut lazy = d.lazy::<()>(0);
    for v in [3.0f32, 4.0, 5.0] {
        input.copy_from_host(&vec![v; N])?;
        lazy.run::<BoxError>(9, &current, |s| {
            d.scale(s, &output, &input, 2.0);
            Ok(())
        })?;
        expect(&current, &output, 2.0 * v, "no-allocation graph")?;
    }
    assert_eq!(lazy.held_bytes(), 0);
    assert_eq!(
        lazy.stats(),
        LazyStats {
            captures: 1,
            replays: 2,
            evictions: 0
        }
    );
    Ok(())
}

/// The closure fails in its warm-up (after allocating): the error is the closure's, the held
/// graphs, statistics and memory are as before, and the key works later.
#[test]
fn a_failed_warm_up_changes_nothing() -> TestResult {
    let d = Dev::new(8 << 30)?;
    let input = DeviceBuffer::filled(&d.rt, D0, N, 1.0f32)?;
    let current = d.rt.current_stream(D0)?;
    current.synchronize()?;
    let mut lazy = d.lazy::<DeviceBuffer<f32>>(50 * MIB);
    lazy.run(1, &current, |s| d.step(s, &input, 1))?;
    let (reserved, allocated, stats) =
        (d.reserved_without_cache(), d.allocated_now(), lazy.stats());
    let r = lazy.run(2, &current, |s| {
        let _t = d.step(s, &input, 2)?;
        Err::<DeviceBuffer<f32>, BoxError>("boom in warm-up".into())
    });
    assert_eq!(
        r.err().map(|e| e.to_string()),
        Some("boom in warm-up".into())
    );
    assert_eq!(lazy.keys_by_use(), vec![1]);
    assert_eq!((lazy.held_bytes(), lazy.stats()), (planned(1), stats));
    assert_eq!(
        d.allocated_now(),
        allocated,
        "the warm-up's memory was freed"
    );
    assert_eq!(d.reserved_without_cache(), reserved, "no pool left behind");
    let out = lazy.run(2, &current, |s| d.step(s, &input, 2))?;
    expect(&current, out, 2.0, "2 after its failed warm-up")?;
    let out = lazy.run(1, &current, |s| d.step(s, &input, 1))?;
    expect(&current, out, 1.0, "1 replayed")?;
    Ok(())
}

/// The closure succeeds in its warm-up and fails in its capture (after allocating and
/// launching): no graph for the key, the graph evicted for it stays evicted, no pool and
/// no capture left behind (other keys capture and replay), and the key works later.
#[test]
fn a_failed_capture_leaves_no_graph_and_no_memory() -> TestResult {
    let d = Dev::new(8 << 30)?;
    let input = DeviceBuffer::filled(&d.rt, D0, N, 1.0f32)?;
    let current = d.rt.current_stream(D0)?;
    current.synchronize()?;
    let (reserved, allocated) = (d.reserved_without_cache(), d.allocated_now());
    // Room for one graph of 22 MiB.
    let mut lazy = d.lazy::<DeviceBuffer<f32>>(30 * MIB);
    lazy.run(1, &current, |s| d.step(s, &input, 1))?;
    let mut calls = 0;
    let r = lazy.run(2, &current, |s| {
        calls += 1;
        let out = d.step(s, &input, 2)?;
        if calls == 2 {
            return Err::<DeviceBuffer<f32>, BoxError>("boom in capture".into());
        }
        Ok(out)
    });
    assert_eq!(calls, 2, "warm-up and capture");
    assert_eq!(
        r.err().map(|e| e.to_string()),
        Some("boom in capture".into())
    );
    assert!(!lazy.contains(&2) && !lazy.contains(&1));
    assert_eq!(lazy.keys_by_use(), Vec::<u64>::new());
    assert_eq!(lazy.held_bytes(), 0);
    current.synchronize()?;
    assert_eq!(
        d.allocated_now(),
        allocated,
        "the capture's blocks were freed"
    );
    assert_eq!(d.reserved_without_cache(), reserved, "its pool went back");
    for key in [3u64, 2, 3] {
        let out = lazy.run(key, &current, |s| d.step(s, &input, key))?;
        expect(&current, out, key as f32, "after a failed capture")?;
    }
    assert_eq!(lazy.held_bytes(), planned(3));
    Ok(())
}

/// A closure that panics in its capture: afterwards the structure still answers, holds no
/// graph for the key, and other keys capture and replay.
#[test]
fn a_panicking_capture_leaves_the_structure_usable() -> TestResult {
    let d = Dev::new(8 << 30)?;
    let input = DeviceBuffer::filled(&d.rt, D0, N, 1.0f32)?;
    let current = d.rt.current_stream(D0)?;
    current.synchronize()?;
    let (reserved, allocated) = (d.reserved_without_cache(), d.allocated_now());
    let mut lazy = d.lazy::<DeviceBuffer<f32>>(GIB_BUDGET);
    let mut calls = 0;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = lazy.run::<BoxError>(4, &current, |s| {
            calls += 1;
            let out = d.step(s, &input, 4)?;
            assert!(calls < 2, "panic in capture");
            Ok(out)
        });
    }));
    assert!(r.is_err());
    assert!(!lazy.contains(&4));
    assert_eq!(lazy.held_bytes(), 0);
    current.synchronize()?;
    assert_eq!(d.allocated_now(), allocated);
    assert_eq!(d.reserved_without_cache(), reserved);
    for key in [4u64, 5, 4] {
        let out = lazy.run(key, &current, |s| d.step(s, &input, key))?;
        expect(&current, out, key as f32, "after a panicking capture")?;
    }
    Ok(())
}

/// A step that uses its first temporary on another stream before dropping it: the eager
/// warm-up can reuse that memory for the second temporary, the capture may not (a capture
/// defers such frees to its end). Whatever the pool turns out to reserve, the held bytes
/// must stay within the budget (30 MiB: one 20 MiB temporary segment and the output's).
#[test]
fn a_cross_stream_temporary_keeps_held_bytes_within_the_budget() -> TestResult {
    let d = Dev::new(8 << 30)?;
    let input = DeviceBuffer::filled(&d.rt, D0, N, 1.0f32)?;
    let side = d.rt.new_stream(D0, 0)?;
    let current = d.rt.current_stream(D0)?;
    current.synchronize()?;
    let budget = 30 * MIB;
    let mut lazy = d.lazy::<DeviceBuffer<f32>>(budget);
    let r = lazy.run::<BoxError>(1, &current, |s| {
        let t1 = DeviceBuffer::<f32>::uninit(&d.rt, D0, (2 * MIB) as usize)?;
        d.scale(s, &t1, &input, 3.0);
        t1.record_stream(&side)?;
        drop(t1);
        let t2 = DeviceBuffer::<f32>::uninit(&d.rt, D0, (2 * MIB) as usize)?;
        d.scale(s, &t2, &input, 3.0);
        let out = DeviceBuffer::<f32>::uninit(&d.rt, D0, N)?;
        d.scale(s, &out, &t2, 1.0);
        Ok(out)
    });
    match r {
        Ok(out) => expect(&current, out, 3.0, "cross-stream step")?,
        Err(e) => assert!(
            matches!(
                e.downcast_ref::<GraphError>(),
                Some(GraphError::OverBudget { .. })
            ),
            "{e}"
        ),
    }
    assert!(
        lazy.held_bytes() <= budget,
        "{} MiB held, budget {} MiB",
        lazy.held_bytes() / MIB,
        budget / MIB
    );
    Ok(())
}
