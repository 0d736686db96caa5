//! The exported functions' safe halves (`ferrocuda_driver::c_export::*`, what each C shim
//! calls after converting its arguments) over a [`TorchBackend`] on the fake device.
#![allow(clippy::panic)]
use ferrocuda::alloc::{Caching, CachingAllocator, DeviceAllocators};
use ferrocuda::driver::fake::Completion;
use ferrocuda::driver::{Call, Driver, FakeDriver, ForeignStream};
use ferrocuda::types::{
    AllocatorConfig, CaptureMode, DeviceIndex, DevicePtr, MemsetValue, PoolId, Snapshot,
    StreamHandle,
};
use ferrocuda_driver::c_export::{self as c, ExportError, MempoolId, TorchAllocator};
use ferrocuda_torch::TorchBackend;
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;
const MIB: usize = 1 << 20;
const D0: DeviceIndex = DeviceIndex(0);

fn setup_with(config: &str, fake: FakeDriver) -> (Arc<FakeDriver>, TorchBackend) {
    let fake = Arc::new(fake);
    let config = AllocatorConfig::parse(config).unwrap_or_else(|e| panic!("{e}"));
    let allocators = DeviceAllocators::new(fake.clone(), config, Caching::On);
    (fake.clone(), TorchBackend::new(fake, allocators))
}

fn setup(config: &str) -> (Arc<FakeDriver>, TorchBackend) {
    setup_with(config, FakeDriver::default())
}

/// The legacy default stream, as PyTorch passes it (null).
fn legacy() -> ForeignStream {
    ForeignStream::legacy(D0)
}

/// A stream PyTorch made ("another library" on the fake device), and the handle the test,
/// playing PyTorch, issues its own work with (having adopted it too).
fn torch_stream(
    fake: &FakeDriver,
) -> Result<(ForeignStream, StreamHandle), Box<dyn std::error::Error>> {
    let foreign = fake.foreign_stream(D0)?;
    let handle = fake.stream_adopt(&foreign)?;
    Ok((foreign, handle))
}

fn allocator(b: &TorchBackend) -> &CachingAllocator {
    b.allocators().device(D0).unwrap_or_else(|e| panic!("{e}"))
}

fn stat(b: &TorchBackend, key: &str) -> i64 {
    let json = c::memory_stats_json(b, 0).unwrap_or_else(|e| panic!("{e}"));
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}"));
    map[key]
        .as_i64()
        .unwrap_or_else(|| panic!("{key} is not a number"))
}

fn pool(id: PoolId) -> MempoolId {
    MempoolId {
        first: id.0,
        second: id.1,
    }
}

#[test]
fn alloc_and_free_serve_pytorch_and_count_in_the_statistics() -> TestResult {
    let (fake, b) = setup("");
    let (s, _) = torch_stream(&fake)?;
    let x = c::malloc(&b, 3 * MIB, 0, &s)?;
    let y = c::malloc(&b, 1000, 0, &legacy())?;
    assert_eq!(stat(&b, "allocation.all.current"), 2);
    assert_eq!(
        stat(&b, "requested_bytes.all.current"),
        3 * MIB as i64 + 1000
    );
    assert_eq!(
        allocator(&b)
            .blocks()
            .iter()
            .find(|k| k.ptr == x)
            .map(|k| k.stream.raw),
        Some(s.raw()),
        "the block is tied to PyTorch's stream"
    );
    c::free(&b, x, 3 * MIB, 0, &s)?;
    c::free(&b, y, 1000, 0, &legacy())?;
    assert_eq!(stat(&b, "allocation.all.current"), 0);
    assert_eq!(
        c::malloc(&b, 0, 0, &legacy())?,
        DevicePtr(0),
        "zero bytes: null"
    );
    allocator(&b).check_invariants()?;
    Ok(())
}

/// PyTorch frees with the metadata it kept; a pointer that is not ours (or freed twice) is
/// an error with PyTorch's wording, nothing is freed, and the books stay right.
#[test]
fn a_pointer_not_allocated_here_is_an_error_not_a_panic() -> TestResult {
    let (_fake, b) = setup("");
    let x = c::malloc(&b, MIB, 0, &legacy())?;
    for bad in [DevicePtr(0x1234), x.offset(512)] {
        let e = c::free(&b, bad, MIB, 0, &legacy()).err().ok_or("freed")?;
        assert!(
            matches!(e, ExportError::Backend { call: "free", .. }),
            "{e}"
        );
        assert!(
            e.to_string()
                .contains("Trying to free a pointer not allocated here"),
            "{e}"
        );
    }
    c::free(&b, x, MIB, 0, &legacy())?;
    assert!(c::free(&b, x, MIB, 0, &legacy()).is_err(), "a double free");
    assert_eq!(stat(&b, "allocation.all.current"), 0);
    allocator(&b).check_invariants()?;
    Ok(())
}

#[test]
fn bad_arguments_are_typed_errors() -> TestResult {
    let (fake, b) = setup_with("", FakeDriver::builder().devices(2).build());
    let invalid_device =
        |r: Result<_, ExportError>| matches!(r, Err(ExportError::InvalidDevice { value: -1, .. }));
    assert!(invalid_device(
        c::malloc(&b, MIB, -1, &legacy()).map(|_| ())
    ));
    assert!(invalid_device(c::free(&b, DevicePtr(1), 1, -1, &legacy())));
    assert!(invalid_device(c::memory_fraction(&b, 0.5, -1)));
    assert!(invalid_device(c::init(&b, -1)));
    let no_device = c::malloc(&b, MIB, 3, &legacy()).err().ok_or("allocated")?;
    assert!(
        no_device.to_string().contains("Invalid device argument"),
        "{no_device}"
    );
    // A stream of another device, and one nobody made.
    let other = fake.foreign_stream(DeviceIndex(1))?;
    let e = c::malloc(&b, MIB, 0, &other).err().ok_or("allocated")?;
    assert!(e.to_string().contains("CUDA_ERROR_INVALID_HANDLE"), "{e}");
    let forgotten = fake.foreign_stream(D0)?.for_device(DeviceIndex(1));
    let e = c::malloc(&b, MIB, 1, &forgotten).err().ok_or("allocated")?;
    assert!(e.to_string().contains("CUDA_ERROR_INVALID_HANDLE"), "{e}");
    assert!(c::memory_fraction(&b, 1.5, 0).is_err());
    let unknown = pool(PoolId::for_capture());
    assert!(c::end_allocate_to_pool(&b, 0, unknown).is_err());
    assert!(c::release_pool(&b, 0, unknown).is_err());
    assert_eq!(fake.calls(Call::Malloc), 0);
    Ok(())
}

/// `Tensor.record_stream`: the block is not reused until the work the other stream had
/// when it was freed has completed.
#[test]
fn record_stream_holds_a_block_until_the_other_stream_is_done() -> TestResult {
    let (fake, b) = setup_with(
        "",
        FakeDriver::builder().completion(Completion::Manual).build(),
    );
    let ((e1, _), (e2, s2)) = (torch_stream(&fake)?, torch_stream(&fake)?);
    let x = c::malloc(&b, MIB, 0, &e1)?;
    // PyTorch does not say the device: the shim names the stream for device 0.
    c::record_stream(&b, x, &e2.for_device(D0))?;
    fake.memset_async(x, MemsetValue::U8(1), 16, s2)?;
    c::free(&b, x, MIB, 0, &e1)?;
    let y = c::malloc(&b, MIB, 0, &e1)?;
    assert_ne!(x, y, "held back by the event on s2");
    fake.advance_all();
    c::free(&b, y, MIB, 0, &e1)?;
    assert_eq!(c::malloc(&b, MIB, 0, &e1)?, x, "free once s2 is done");
    let e = c::record_stream(&b, DevicePtr(0x999), &e2)
        .err()
        .ok_or("recorded")?;
    assert!(e.to_string().contains("not allocated here"), "{e}");
    Ok(())
}

/// What `torch.cuda.graph` does, in PyTorch's order: `beginAllocateToPool` before
/// `cudaStreamBeginCapture`, allocations during the capture from the graph's private pool
/// (reused in capture order), `cudaStreamEndCapture`, `endAllocateToPool`; the graph's
/// output stays valid after the graph is gone, and the pool's memory goes back at the first
/// `empty_cache` after `releasePool`.
#[test]
fn a_cuda_graph_capture_in_pytorchs_order_uses_a_private_pool() -> TestResult {
    let (fake, b) = setup("");
    let (es, s) = torch_stream(&fake)?;
    let before = c::malloc(&b, MIB, 0, &legacy())?; // a default-pool block
    let graph_pool = PoolId::for_capture();
    c::reset(&b)?; // `torch.cuda.graph` empties the cache first
    c::begin_allocate_to_pool(&b, 0, pool(graph_pool))?;
    fake.stream_begin_capture(s, CaptureMode::Global)?;
    let tmp = c::malloc(&b, 4 * MIB, 0, &es)?;
    c::free(&b, tmp, 4 * MIB, 0, &es)?;
    let out = c::malloc(&b, 4 * MIB, 0, &es)?;
    assert_eq!(out, tmp, "reused in capture order");
    c::reset(&b)?; // nothing is freed during a capture
    assert_eq!(fake.calls(Call::Free), 0);
    let graph = fake.stream_end_capture(s)?;
    c::end_allocate_to_pool(&b, 0, pool(graph_pool))?;
    assert!(
        allocator(&b)
            .pool_blocks(graph_pool)
            .iter()
            .any(|k| k.ptr == out && k.allocated)
    );
    assert_eq!(allocator(&b).pool_use_count(graph_pool), Some(1));
    fake.graph_destroy(graph)?;
    c::release_pool(&b, 0, pool(graph_pool))?; // CUDAGraph::reset
    let reserved = stat(&b, "reserved_bytes.all.current");
    c::free(&b, out, 4 * MIB, 0, &es)?; // the output outlived the graph
    c::reset(&b)?;
    assert!(stat(&b, "reserved_bytes.all.current") < reserved);
    assert!(allocator(&b).pool_blocks(graph_pool).is_empty());
    c::free(&b, before, MIB, 0, &legacy())?;
    allocator(&b).check_invariants()?;
    Ok(())
}

#[test]
fn the_memory_fraction_caps_what_is_reserved() -> TestResult {
    let (_fake, b) = setup_with("", FakeDriver::builder().capacity(8 << 30).build());
    c::memory_fraction(&b, 0.25, 0)?;
    let e = c::malloc(&b, 3 << 30, 0, &legacy())
        .err()
        .ok_or("allocated")?;
    assert!(e.to_string().contains("out of memory"), "{e}");
    let x = c::malloc(&b, 1 << 30, 0, &legacy())?;
    c::free(&b, x, 1 << 30, 0, &legacy())?;
    Ok(())
}

#[test]
fn base_alloc_gives_the_segment_except_for_expandable_segments() -> TestResult {
    let (_fake, b) = setup("");
    let x = c::malloc(&b, 1000, 0, &legacy())?;
    let y = c::malloc(&b, 1000, 0, &legacy())?;
    assert_eq!(
        c::base_alloc(&b, y)?,
        (x, 2 * MIB as u64),
        "one 2 MiB small segment"
    );
    assert!(c::base_alloc(&b, DevicePtr(7)).is_err());
    let (_fake, b) = setup("expandable_segments:True");
    let z = c::malloc(&b, 1000, 0, &legacy())?;
    let e = c::base_alloc(&b, z).err().ok_or("shared")?;
    assert!(
        e.to_string().contains("cannot be shared between processes"),
        "{e}"
    );
    Ok(())
}

#[test]
fn statistics_settings_history_and_snapshot() -> TestResult {
    let (_fake, b) = setup("ferrocuda_recommended:True");
    let settings = c::allocator_settings(&b)?;
    assert!(settings.contains("expandable_segments:True"), "{settings}");
    c::record_memory_history(&b, true, 1000)?;
    let x = c::malloc(&b, 5 * MIB, 0, &legacy())?;
    c::free(&b, x, 5 * MIB, 0, &legacy())?;
    assert_eq!(stat(&b, "allocation.all.allocated"), 1);
    assert!(stat(&b, "reserved_bytes.all.peak") >= 5 * MIB as i64);
    c::reset_peak_memory_stats(&b, 0)?;
    assert_eq!(stat(&b, "allocated_bytes.all.peak"), 0);
    let dir = std::env::temp_dir().join(format!("ferrocuda-torch-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("snapshot.pickle");
    c::dump_snapshot(&b, &path)?;
    let snapshot = Snapshot::from_pickle(&std::fs::read(&path)?)?;
    assert!(
        snapshot.device_traces[0].len() >= 2,
        "the alloc and the free are in the trace"
    );
    std::fs::remove_dir_all(&dir)?;
    let e = c::dump_snapshot(&b, &dir.join("missing").join("s.pickle"))
        .err()
        .ok_or("written")?;
    assert!(e.to_string().contains("cannot write"), "{e}");
    Ok(())
}

#[test]
fn init_checks_pytorchs_device_count() -> TestResult {
    let (fake, b) = setup("");
    c::init(&b, 1)?;
    assert_eq!(
        fake.calls(Call::MemGetInfo),
        0,
        "no allocator (no context) made"
    );
    let e = c::init(&b, 2).err().ok_or("accepted")?;
    assert!(e.to_string().contains("PyTorch counts 2 devices"), "{e}");
    Ok(())
}

/// A stream is adopted once per thread: the hot path asks the driver nothing.
#[test]
fn each_thread_adopts_a_stream_once() -> TestResult {
    let (fake, b) = setup("");
    let s = fake.foreign_stream(D0)?;
    for _ in 0..3 {
        let x = c::malloc(&b, MIB, 0, &s)?;
        c::free(&b, x, MIB, 0, &s)?;
    }
    assert_eq!(fake.adoptions(&s), Some(1));
    std::thread::scope(|t| t.spawn(|| c::malloc(&b, MIB, 0, &s)).join())
        .map_err(|_| "the thread panicked")??;
    assert_eq!(fake.adoptions(&s), Some(2));
    assert_eq!(fake.calls(Call::StreamAdopt), 2);
    Ok(())
}

/// A backend that panics: the panic is caught and reported, never unwinds into C.
#[derive(Debug)]
struct Panics;

type R<T> = Result<T, c::BackendError>;

impl TorchAllocator for Panics {
    fn init(&self, _: usize) -> R<()> {
        panic!("init")
    }
    fn allocate(&self, _: u64, _: DeviceIndex, _: &ForeignStream) -> R<DevicePtr> {
        panic!("allocate {}", 42)
    }
    fn free(&self, _: DevicePtr, _: u64, _: DeviceIndex, _: &ForeignStream) -> R<()> {
        panic!("free")
    }
    fn record_stream(&self, _: DevicePtr, _: &ForeignStream) -> R<()> {
        panic!("record_stream")
    }
    fn empty_cache(&self) -> R<()> {
        panic!("empty_cache")
    }
    fn set_memory_fraction(&self, _: f64, _: DeviceIndex) -> R<()> {
        panic!("set_memory_fraction")
    }
    fn base_allocation(&self, _: DevicePtr) -> R<(DevicePtr, u64)> {
        panic!("base_allocation")
    }
    fn begin_allocate_to_pool(&self, _: DeviceIndex, _: PoolId) -> R<()> {
        panic!("begin")
    }
    fn end_allocate_to_pool(&self, _: DeviceIndex, _: PoolId) -> R<()> {
        panic!("end")
    }
    fn release_pool(&self, _: DeviceIndex, _: PoolId) -> R<()> {
        panic!("release")
    }
    fn memory_stats_json(&self, _: DeviceIndex) -> R<String> {
        panic!("stats")
    }
    fn reset_peak_memory_stats(&self, _: DeviceIndex) -> R<()> {
        panic!("reset peak")
    }
    fn allocator_settings(&self) -> R<String> {
        panic!("settings")
    }
    fn record_memory_history(&self, _: bool, _: usize) -> R<()> {
        panic!("history")
    }
    fn dump_snapshot(&self, _: &std::path::Path) -> R<()> {
        panic!("snapshot")
    }
    fn create_sleepable_pool(&self, _: DeviceIndex, _: PoolId) -> R<()> {
        panic!("sleepable")
    }
    fn sleep(&self, _: DeviceIndex, _: PoolId, _: c::SleepRequest) -> R<()> {
        panic!("sleep")
    }
    fn wake(&self, _: DeviceIndex, _: PoolId) -> R<()> {
        panic!("wake")
    }
}

#[test]
fn a_panic_in_the_backend_is_caught_and_reported() {
    let b = Panics;
    let e = c::malloc(&b, 1, 0, &legacy()).err();
    assert!(
        matches!(&e, Some(ExportError::Panicked { call: "alloc", message }) if message == "allocate 42"),
        "{e:?}"
    );
    let caught = [
        c::free(&b, DevicePtr(1), 1, 0, &legacy()),
        c::init(&b, 1),
        c::reset(&b),
        c::record_stream(&b, DevicePtr(1), &legacy()),
        c::memory_fraction(&b, 0.5, 0),
        c::begin_allocate_to_pool(&b, 0, pool(PoolId(1, 0))),
        c::end_allocate_to_pool(&b, 0, pool(PoolId(1, 0))),
        c::release_pool(&b, 0, pool(PoolId(1, 0))),
        c::reset_peak_memory_stats(&b, 0),
        c::record_memory_history(&b, true, 1),
        c::dump_snapshot(&b, std::path::Path::new("x")),
        c::create_sleepable_pool(&b, 0, pool(PoolId(0, 2))),
        c::sleep(&b, 0, pool(PoolId(0, 2)), 1),
        c::wake(&b, 0, pool(PoolId(0, 2))),
    ];
    assert!(
        caught
            .iter()
            .all(|r| matches!(r, Err(ExportError::Panicked { .. })))
    );
}

mod differential {
    //! A random program through the shims' safe halves and straight into the allocator:
    //! same pointers, same statistics.
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Alloc { bytes: usize, on_side: bool },
        Free(usize),
        RecordStream(usize),
        EmptyCache,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (prop_oneof![1usize..4096, 4096usize..(4 * MIB), (4 * MIB)..(40 * MIB)], any::<bool>())
                .prop_map(|(bytes, on_side)| Op::Alloc { bytes, on_side }),
            3 => any::<usize>().prop_map(Op::Free),
            1 => any::<usize>().prop_map(Op::RecordStream),
            1 => Just(Op::EmptyCache),
        ]
    }

    fn run(config: &str, program: &[Op]) -> TestResult {
        let (fake, b) = setup(config);
        let direct_fake = Arc::new(FakeDriver::default());
        let direct = CachingAllocator::new(
            direct_fake.clone(),
            D0,
            AllocatorConfig::parse(config)?,
            Caching::On,
        )?;
        // The direct allocator exists from the start; so does the shims' (PyTorch makes
        // every device's at init: a first `empty_cache` counts a sync either way).
        let _ = allocator(&b);
        let (side, side_direct) = (torch_stream(&fake)?.0, torch_stream(&direct_fake)?.1);
        assert_eq!(side.raw(), side_direct.raw);
        let mut live: Vec<(DevicePtr, usize, bool)> = Vec::new();
        for op in program {
            match *op {
                Op::Alloc { bytes, on_side } => {
                    let (ext, handle) = if on_side {
                        (side.clone(), side_direct)
                    } else {
                        (legacy(), StreamHandle::legacy(D0))
                    };
                    let ours = c::malloc(&b, bytes, 0, &ext)?;
                    assert_eq!(ours, direct.allocate(bytes as u64, handle)?.ptr);
                    live.push((ours, bytes, on_side));
                }
                Op::Free(i) if !live.is_empty() => {
                    let (ptr, bytes, on_side) = live.swap_remove(i % live.len());
                    let ext = if on_side { side.clone() } else { legacy() };
                    c::free(&b, ptr, bytes, 0, &ext)?;
                    direct.free(ptr)?;
                }
                Op::RecordStream(i) if !live.is_empty() => {
                    let ptr = live[i % live.len()].0;
                    c::record_stream(&b, ptr, &side)?;
                    direct.record_stream(ptr, side_direct)?;
                }
                Op::EmptyCache => {
                    c::reset(&b)?;
                    direct.empty_cache();
                }
                Op::Free(_) | Op::RecordStream(_) => {}
            }
        }
        let (ours, theirs) = (allocator(&b).stats().to_map(), direct.stats().to_map());
        let differ: Vec<_> = ours
            .iter()
            .filter(|(k, v)| theirs.get(*k) != Some(v))
            .map(|(k, v)| (k, v, theirs.get(k)))
            .collect();
        assert!(differ.is_empty(), "statistics differ: {differ:?}");
        allocator(&b).check_invariants()?;
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn the_shims_are_the_allocator(program in proptest::collection::vec(op(), 1..80)) {
            run("", &program).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }

        #[test]
        fn the_shims_are_the_allocator_recommended(program in proptest::collection::vec(op(), 1..80)) {
            run("ferrocuda_recommended:True", &program).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
    }
}
