//! Graph scenarios only the fake device can stage: a small device, so that garbage
//! collection, the oversize release and cross-stream reuse act while a graph holds a free
//! private segment (issue 12 item 1), another thread's free at the exact moment a capture
//! starts or ends (issue 12 item 5), and re-capturing in a loop in manual completion.
use ferrocuda_alloc::{Caching, CachingAllocator, DeviceAllocators};
use ferrocuda_driver::{Call, FakeDriver, fake::Completion};
use ferrocuda_graph::{CaptureMode, CudaGraph, PhiloxGenerator, PoolId};
use ferrocuda_stream::{DeviceBuffer, Function, KernelCache, Module, Runtime, Stream};
use ferrocuda_testkit::{KERNELS, register_fake_kernels};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, KernelArg, LaunchConfig};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;
const D0: DeviceIndex = DeviceIndex(0);
const MIB: u64 = 1 << 20;
/// Elements the kernels touch.
const N: usize = 1024;
/// A 4 MiB buffer of `f32`: a large-pool request, served from a 20 MiB segment.
const FOUR_MIB: usize = (4 * MIB / 4) as usize;

/// A fake device of `capacity` bytes with a caching allocator configured by `config`.
struct Device {
    fake: Arc<FakeDriver>,
    rt: Arc<Runtime>,
    allocators: Arc<DeviceAllocators>,
    scale: Function,
}

/// A captured graph `output = 6 * input` whose capture freed a 4 MiB temporary, leaving
/// its private pool with a whole free 20 MiB segment.
struct Captured {
    graph: CudaGraph,
    pool: PoolId,
    input: DeviceBuffer<f32>,
    output: DeviceBuffer<f32>,
}

impl Device {
    fn new(config: &str, capacity: u64) -> Result<Device, Box<dyn std::error::Error>> {
        Device::with_completion(config, capacity, Completion::Eager)
    }

    fn with_completion(
        config: &str,
        capacity: u64,
        completion: Completion,
    ) -> Result<Device, Box<dyn std::error::Error>> {
        let fake = Arc::new(
            FakeDriver::builder()
                .capacity(capacity)
                .completion(completion)
                .build(),
        );
        register_fake_kernels(&fake);
        let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
        let allocators =
            DeviceAllocators::new(fake.clone(), AllocatorConfig::parse(config)?, Caching::On);
        allocators.install(&rt);
        let module = Module::from_cuda_source(&rt, D0, "graph_fake", KERNELS)?;
        Ok(Device {
            scale: module.function("scale_f32")?,
            fake,
            rt,
            allocators,
        })
    }

    fn alloc(&self) -> Result<&CachingAllocator, Box<dyn std::error::Error>> {
        Ok(self.allocators.device(D0)?)
    }

    /// `y[..N] = a * x[..N]` on `stream`.
    fn scale(
        &self,
        stream: &Stream,
        y: &DeviceBuffer<f32>,
        x: &DeviceBuffer<f32>,
        a: f32,
    ) -> TestResult {
        let n = N as u32;
        let args = [y.arg(), x.arg(), KernelArg::value(&a), KernelArg::value(&n)];
        Ok(stream.launch(&self.scale, &LaunchConfig::for_elements(N, 256), &args)?)
    }

    fn capture_with_freed_temporary(&self) -> Result<Captured, Box<dyn std::error::Error>> {
        let graph = CudaGraph::new(self.rt.clone(), self.allocators.clone(), D0)?;
        let input = DeviceBuffer::filled(&self.rt, D0, N, 1.0f32)?;
        let capture = graph.capture(None, None, CaptureMode::ThreadLocal)?;
        let stream = capture.stream().clone();
        let temporary = DeviceBuffer::<f32>::uninit(&self.rt, D0, FOUR_MIB)?;
        self.scale(&stream, &temporary, &input, 2.0)?;
        let output = DeviceBuffer::<f32>::uninit(&self.rt, D0, N)?;
        self.scale(&stream, &output, &temporary, 3.0)?;
        drop(temporary);
        capture.end()?;
        let pool = graph.pool().ok_or("a captured graph holds a pool")?;
        let free_segment = self
            .alloc()?
            .pool_blocks(pool)
            .iter()
            .any(|b| !b.allocated && b.size == 20 * MIB);
        assert!(
            free_segment,
            "the capture left a free 20 MiB private segment"
        );
        Ok(Captured {
            graph,
            pool,
            input,
            output,
        })
    }
}

impl Captured {
    /// Replays twice with new inputs and checks the output, that the user's buffer still
    /// holds `canary`, and that the pool kept its free segment.
    fn replay_and_check(&self, d: &Device, user: &DeviceBuffer<f32>, canary: f32) -> TestResult {
        let current = d.rt.current_stream(D0)?;
        for v in [3.0f32, 5.0] {
            self.input.copy_from_host(&vec![v; N])?;
            self.graph.replay(&current)?;
            current.synchronize()?;
            let out = self.output.to_host()?;
            assert!(out.iter().all(|&o| o == 6.0 * v), "replay output for {v}");
            let kept = user.to_host()?;
            let overwritten = kept.iter().position(|&u| u != canary);
            assert_eq!(overwritten, None, "the replay overwrote the user's buffer");
        }
        let segments = d.alloc()?.pool_blocks(self.pool);
        assert!(
            segments.iter().any(|b| b.size == 20 * MIB),
            "the live graph's pool kept its segment"
        );
        d.alloc()?.check_invariants()?;
        Ok(())
    }
}

/// Garbage collection (with a memory fraction, as in PyTorch) runs for an eager 4 MiB
/// request while a live graph's pool holds a free 20 MiB segment: it must not free it.
#[test]
fn garbage_collection_keeps_a_live_graphs_segment() -> TestResult {
    let d = Device::new("garbage_collection_threshold:0.2", 64 * MIB)?;
    d.alloc()?.set_memory_fraction(0.9)?;
    let captured = d.capture_with_freed_temporary()?;
    let user = DeviceBuffer::filled(&d.rt, D0, FOUR_MIB, 7.0f32)?;
    assert!(
        d.alloc()?.stats().reserved_bytes.all.current as u64 > 12 * MIB,
        "reserved memory is above the collection threshold, so collection ran"
    );
    captured.replay_and_check(&d, &user, 7.0)
}

/// With `max_split_size_mb:20`, an eager 40 MiB request that cannot fit runs the oversize
/// release and the release of the whole cache, then fails: the live graph's free segment
/// stays (PyTorch runs out of memory and keeps the pool).
#[test]
fn oversize_release_keeps_a_live_graphs_segment() -> TestResult {
    let d = Device::new("max_split_size_mb:20", 64 * MIB)?;
    let captured = d.capture_with_freed_temporary()?;
    let user = DeviceBuffer::filled(&d.rt, D0, FOUR_MIB, 7.0f32)?;
    let big = DeviceBuffer::<u8>::uninit(&d.rt, D0, (40 * MIB) as usize);
    assert!(
        big.is_err(),
        "40 MiB does not fit beside the pool and the user's buffer"
    );
    assert!(
        d.alloc()?.stats().num_alloc_retries >= 1,
        "the cache was released"
    );
    captured.replay_and_check(&d, &user, 7.0)
}

/// With `cross_stream_reuse:True`, an eager 4 MiB request on the default stream must not
/// take the live graph's free segment (cached by the capture stream): the next replay
/// would write into the user's buffer.
#[test]
fn cross_stream_reuse_keeps_a_live_graphs_segment() -> TestResult {
    let d = Device::new("cross_stream_reuse:True", 64 * MIB)?;
    let captured = d.capture_with_freed_temporary()?;
    let user = DeviceBuffer::filled(&d.rt, D0, FOUR_MIB, 7.0f32)?;
    captured.replay_and_check(&d, &user, 7.0)
}

/// A block used on the capture stream (`record_stream`) and freed by another thread at
/// `moment`, a driver call made while the capture starts or ends. Its end-of-life event
/// must not be recorded into the capture (it would never complete): after the capture the
/// block is free again, and the next request of its size gets it back. In manual completion
/// nothing completes by itself: the event must have been recorded before the stream's work
/// is waited for (by the capture's end, the first allocator call with no capture underway).
fn free_racing_the_capture(
    completion: Completion,
    moment: impl FnOnce(&Arc<FakeDriver>, Box<dyn FnOnce() + Send>),
) -> TestResult {
    let d = Device::with_completion("", 1 << 30, completion)?;
    let g = CudaGraph::new(d.rt.clone(), d.allocators.clone(), D0)?;
    let stream = d.rt.new_stream(D0, 0)?;
    let x = DeviceBuffer::filled(&d.rt, D0, N, 1.0f32)?;
    let used = DeviceBuffer::<f32>::uninit(&d.rt, D0, N)?;
    d.scale(&stream, &used, &x, 2.0)?;
    used.record_stream(&stream)?;
    let address = used.ptr();
    let free_elsewhere = Box::new(move || {
        let freed = std::thread::spawn(move || drop(used)).join();
        assert!(freed.is_ok(), "the freeing thread panicked");
    });
    moment(&d.fake, free_elsewhere);
    let capture = g.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    let out = DeviceBuffer::<f32>::uninit(&d.rt, D0, N)?;
    d.scale(&stream, &out, &x, 3.0)?;
    capture.end()?;
    g.replay(&stream)?;
    stream.synchronize()?;
    assert_eq!(out.to_host()?, vec![3.0; N]);
    let again = DeviceBuffer::<f32>::uninit(&d.rt, D0, N)?;
    let pending = d
        .alloc()?
        .blocks()
        .iter()
        .filter(|b| b.pending_events)
        .count();
    assert_eq!(
        pending, 0,
        "no block waits for an event recorded into the capture"
    );
    assert_eq!(again.ptr(), address, "the freed block is reused");
    d.alloc()?.check_invariants()?;
    Ok(())
}

/// Another thread frees the block just after the stream capture began: the allocator must
/// already treat the capture as underway (PyTorch's `CUDAGraph::capture_begin` calls
/// `beginAllocateToPool` before `cudaStreamBeginCapture`).
#[test]
fn a_free_as_the_capture_begins_is_deferred() -> TestResult {
    free_racing_the_capture(Completion::Eager, free_as_the_capture_begins)
}

/// Another thread frees the block as the stream capture ends: the allocator must still
/// treat the capture as underway (PyTorch's `CUDAGraph::capture_end` calls
/// `cudaStreamEndCapture` before `endAllocateToPool`).
#[test]
fn a_free_as_the_capture_ends_is_deferred() -> TestResult {
    free_racing_the_capture(Completion::Eager, free_as_the_capture_ends)
}

/// As `a_free_as_the_capture_begins_is_deferred`, in manual completion: once the capture
/// ended and the stream's work completed, the very next request gets the block back (the
/// deferred event was recorded when the capture's route ended, not at that request).
#[test]
fn a_free_as_the_capture_begins_comes_back_once_the_stream_is_done() -> TestResult {
    free_racing_the_capture(Completion::Manual, free_as_the_capture_begins)
}

/// As `a_free_as_the_capture_ends_is_deferred`, in manual completion.
#[test]
fn a_free_as_the_capture_ends_comes_back_once_the_stream_is_done() -> TestResult {
    free_racing_the_capture(Completion::Manual, free_as_the_capture_ends)
}

/// Runs `free` just after `cuStreamBeginCapture`, at the capture's first status query.
fn free_as_the_capture_begins(fake: &Arc<FakeDriver>, free: Box<dyn FnOnce() + Send>) {
    let after_begin = fake.clone();
    fake.before_next(Call::BeginCapture, move || {
        // The next capture-status query is the one made once the capture has begun.
        after_begin.before_next(Call::CaptureStatus, free);
    });
}

/// Runs `free` just before `cuStreamEndCapture`.
fn free_as_the_capture_ends(fake: &Arc<FakeDriver>, free: Box<dyn FnOnce() + Send>) {
    fake.before_next(Call::EndCapture, free);
}

/// A capture whose temporary was tied to a side stream by `record_stream` defers its free
/// until the capture ends. `empty_cache` right after (no allocation in between) must record
/// those deferred events and free the block, as PyTorch's `synchronize_and_free_events`
/// does (it calls `insert_events_deferred_until_no_capture` first): the dropped graph's
/// pool then goes back to the driver.
#[test]
fn empty_cache_after_a_capture_frees_its_deferred_blocks() -> TestResult {
    let d = Device::new("", 1 << 30)?;
    let g = CudaGraph::new(d.rt.clone(), d.allocators.clone(), D0)?;
    let side = d.rt.new_stream(D0, 0)?;
    let x = DeviceBuffer::filled(&d.rt, D0, N, 1.0f32)?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let temporary = DeviceBuffer::<f32>::uninit(&d.rt, D0, N)?;
    d.scale(&stream, &temporary, &x, 2.0)?;
    side.wait_stream(&stream)?;
    d.scale(&side, &x, &temporary, 1.0)?;
    temporary.record_stream(&side)?;
    drop(temporary);
    stream.wait_stream(&side)?;
    capture.end()?;
    drop(g);
    d.rt.synchronize(D0)?;
    let before = d.alloc()?.stats().reserved_bytes.all.current;
    d.alloc()?.empty_cache();
    let after = d.alloc()?.stats().reserved_bytes.all.current;
    assert_eq!(
        before - after,
        2 * MIB as i64,
        "the pool's segment went back"
    );
    Ok(())
}

/// Re-capturing in a loop on the fake device in manual completion, where nothing completes
/// until it is waited for and a kernel touching memory given back to the driver fails: each
/// round makes a graph and a generator registered with it, captures a kernel writing a
/// fresh 4 MiB output (a private segment) and a draw, ends the capture, replays,
/// synchronizes, then drops the output, the graph and the generator. Every replay writes
/// what it should, and the device's memory is flat: reserved bytes, the driver's live
/// allocations and its free memory after round 100 are those after round 2.
#[test]
fn recapturing_in_a_loop_stays_flat_in_manual_completion() -> TestResult {
    // (Reading 4 MiB back every round would make the loop slow on the fake device.)
    let read_back = |round: u32| round < 3 || round % 10 == 9;
    let d = Device::with_completion("", 1 << 30, Completion::Manual)?;
    let fill =
        Module::from_cuda_source(&d.rt, D0, "graph_fake_fill", KERNELS)?.function("fill_f32")?;
    let current = d.rt.current_stream(D0)?;
    let mut after_round_2 = None;
    for round in 0..100u32 {
        let g = CudaGraph::new(d.rt.clone(), d.allocators.clone(), D0)?;
        let generator = PhiloxGenerator::new(&d.rt, D0, u64::from(round))?;
        g.register_generator(&generator)?;
        let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
        let stream = capture.stream().clone();
        let output = DeviceBuffer::<f32>::uninit(&d.rt, D0, FOUR_MIB)?;
        let drawn = DeviceBuffer::<f32>::uninit(&d.rt, D0, N)?;
        let (value, n) = (round as f32, FOUR_MIB as u32);
        let args = [output.arg(), KernelArg::value(&value), KernelArg::value(&n)];
        stream.launch(&fill, &LaunchConfig::for_elements(FOUR_MIB, 256), &args)?;
        generator.uniform(&drawn, &stream)?;
        capture.end()?;
        g.replay(&current)?;
        current.synchronize()?;
        if read_back(round) {
            let written = output.to_host()?;
            assert!(
                written.iter().all(|&v| v == value),
                "round {round}: the replay's output"
            );
            assert!(drawn.to_host()?.iter().all(|v| (0.0..1.0).contains(v)));
        }
        drop((output, drawn));
        drop(g);
        drop(generator);
        let now = (
            d.alloc()?.stats().reserved_bytes.all.current,
            d.fake.calls(Call::Malloc) - d.fake.calls(Call::Free),
            d.rt.mem_get_info(D0)?.0,
        );
        match after_round_2 {
            None if round == 1 => after_round_2 = Some(now),
            None => {}
            Some(expected) => assert_eq!(
                now, expected,
                "round {round}: (reserved bytes, live driver allocations, free bytes) as after round 2"
            ),
        }
    }
    d.alloc()?.check_invariants()?;
    Ok(())
}
