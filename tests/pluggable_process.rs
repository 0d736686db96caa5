//! The global runtime's allocator swapped for a pluggable one
//! (`torch.cuda.memory.change_current_allocator`), and `MemPool(allocator=…)`, against the
//! fixture library cargo builds beside this test.
//!
//! Swapping is allowed once per process and only before the allocator is initialised, so
//! each scenario needs a fresh process: this test has no harness. Run without
//! `FERROCUDA_SWAP_SCENARIO`, it runs itself once per scenario and backend with that variable
//! set: on the fake device always, on the real driver too when `FERROCUDA_REQUIRE_GPU=1`
//! (the GPU bundle; reported as ignored otherwise). Arguments that do not start with `-`
//! select scenarios by substring.
#![forbid(unsafe_code)]
use ferrocuda::Backend;
use ferrocuda::alloc::{AllocError, PluggableAllocator};
use ferrocuda::driver::{Hook, PluggableLibrary};
use ferrocuda::memory::{self, MemPool};
use ferrocuda::stream::DeviceBuffer;
use ferrocuda::types::DeviceIndex;
use ferrocuda_pluggable_fixture::{Event, Probe, path};
use std::process::ExitCode;

use ferrocuda_testkit::fresh_process::{Outcome, Runner, Scenario, ensure};

const D0: DeviceIndex = DeviceIndex(0);
const MIB: u64 = 1 << 20;

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "a_pluggable_allocator_serves_the_runtime_once_swapped_in",
        env: &[],
        run: swapped_in,
    },
    Scenario {
        name: "an_initialised_runtime_refuses_the_swap",
        env: &[],
        run: refused_after_init,
    },
    Scenario {
        name: "an_allocation_initialises_the_caching_allocator",
        env: &[],
        run: refused_after_allocation,
    },
    Scenario {
        name: "statistics_before_cuda_is_initialised_are_empty_and_initialise_nothing",
        env: &[],
        run: statistics_before_init,
    },
    Scenario {
        name: "a_raw_allocation_or_a_fraction_first_initialises_the_pluggable_allocator",
        env: &[],
        run: first_calls_initialise,
    },
    Scenario {
        name: "a_mem_pool_takes_its_segments_from_a_pluggable_allocator",
        env: &[],
        run: mem_pool,
    },
];

/// The fixture's functions for the backend: host memory on the fake device (which only
/// does arithmetic on these addresses), `cuMemAlloc` on the GPU.
fn library() -> Result<PluggableLibrary, Box<dyn std::error::Error>> {
    let (alloc, free) = match Backend::from_env()? {
        Backend::Cuda => ("fixture_cuda_alloc", "fixture_cuda_free"),
        Backend::Fake => ("fixture_host_alloc", "fixture_host_free"),
    };
    Ok(PluggableLibrary::load(path(), alloc, free)?)
}

/// Buffer contents survive a round trip (only where the addresses are device memory).
fn round_trip(buf: &DeviceBuffer<f32>) -> Outcome {
    if Backend::from_env()? == Backend::Cuda {
        let values: Vec<f32> = (0..buf.len()).map(|i| i as f32).collect();
        buf.copy_from_host(&values)?;
        ensure(buf.to_host()? == values, "the buffer's contents came back")?;
    }
    Ok(())
}

fn swapped_in() -> Outcome {
    let probe = Probe::open()?;
    ensure(memory::get_allocator_backend() == "native", "native first")?;
    let lib = library()?
        .with_hook(Hook::Init, "fixture_init")?
        .with_hook(Hook::Reset, "fixture_reset")?
        .with_hook(Hook::MemoryFraction, "fixture_memory_fraction")?
        .with_hook(Hook::RecordStream, "fixture_record_stream")?;
    let a = PluggableAllocator::new(lib);
    memory::change_current_allocator(&a)?;
    ensure(memory::get_allocator_backend() == "pluggable", "backend")?;
    let again = memory::change_current_allocator(&PluggableAllocator::new(library()?));
    ensure(
        again.as_ref().map_err(ToString::to_string)
            == Err("Can't swap an already initialized allocator".into()),
        format!("a second swap: {again:?}"),
    )?;

    let rt = ferrocuda::runtime();
    let buf = DeviceBuffer::<f32>::uninit(rt, D0, 1000)?;
    let count = rt.device_count() as i32;
    let events = probe.events();
    ensure(
        events.first() == Some(&Event::Init(count)),
        format!("init with the device count at the first allocation: {events:?}"),
    )?;
    ensure(
        matches!(events.get(1), Some(Event::Alloc { size: 4000, device: 0, ptr, .. }) if *ptr == buf.ptr().0),
        format!("the buffer is the library's: {events:?}"),
    )?;
    round_trip(&buf)?;
    ferrocuda::init()?;
    let stream = rt.stream_from_pool(D0, false)?;
    buf.record_stream(&stream)?;
    let ptr = buf.ptr().0;
    drop(buf);
    memory::empty_cache()?;
    memory::set_per_process_memory_fraction(0.5, D0)?;
    let bad = memory::set_per_process_memory_fraction(1.5, D0);
    ensure(
        bad == Err(AllocError::FractionOutOfRange(1.5)),
        format!("{bad:?}"),
    )?;
    let tail: Vec<Event> = probe.events().split_off(2);
    let s = stream.handle().raw;
    ensure(
        tail == [
            Event::RecordStream { ptr, stream: s },
            Event::Free {
                ptr,
                size: 4000,
                device: 0,
                stream: 0,
            },
            Event::Reset,
            Event::MemoryFraction {
                fraction: 0.5,
                device: 0,
            },
        ],
        format!("record_stream, free, empty_cache, fraction (no second init): {tail:?}"),
    )?;

    let raw = memory::caching_allocator_alloc(256, D0, None)?;
    memory::caching_allocator_delete(raw)?;
    let twice = memory::caching_allocator_delete(raw).map_err(|e| e.to_string());
    ensure(
        twice == Err("Trying to free a pointer not allocated here".into()),
        format!("{twice:?}"),
    )?;
    let unsupported = [
        ("getDeviceStats", memory::memory_stats(D0).map(drop)),
        ("getDeviceStats", memory::memory_allocated(D0).map(drop)),
        ("resetPeakStats", memory::reset_peak_memory_stats(D0)),
        (
            "resetAccumulatedStats",
            memory::reset_accumulated_memory_stats(D0),
        ),
        (
            "getMemoryFraction",
            memory::get_per_process_memory_fraction(D0).map(drop),
        ),
        (
            "recordHistory",
            memory::record_memory_history(Some("all"), None, "python", 10),
        ),
        ("snapshot", memory::memory_snapshot().map(drop)),
        ("createOrIncrefPool", MemPool::new(None).map(drop)),
    ];
    for (what, result) in unsupported {
        let text = format!(
            "CUDAPluggableAllocator does not yet support {what}. If you need it, please file \
             an issue describing your use case."
        );
        ensure(
            result.as_ref().map_err(ToString::to_string) == Err(text),
            format!("{what}: {result:?}"),
        )?;
    }
    ensure(probe.live() == 0, "everything went back")
}

/// PyTorch's `memory_stats_as_nested_dict`: `if not is_initialized(): return {}`; the
/// figures read from it are 0, and asking initialises nothing (so the swap stays allowed).
fn statistics_before_init() -> Outcome {
    ensure(
        memory::memory_stats(D0)?.is_empty(),
        "memory_stats is empty",
    )?;
    ensure(memory::memory_allocated(D0)? == 0, "memory_allocated is 0")?;
    ensure(
        memory::max_memory_reserved(D0)? == 0,
        "max_memory_reserved is 0",
    )?;
    ensure(!ferrocuda::is_initialized(), "nothing was initialised")?;
    memory::change_current_allocator(&PluggableAllocator::new(library()?))?;
    Ok(())
}

/// PyTorch's `caching_allocator_alloc` and `set_per_process_memory_fraction` run CUDA's
/// lazy initialisation first (`current_device()`, `_lazy_init()`), so a pluggable
/// allocator's `init` hook comes before the first call it sees; a device that does not
/// exist is refused before the library is asked (`with torch.cuda.device(device)`),
/// whatever stream is given.
fn first_calls_initialise() -> Outcome {
    let probe = Probe::open()?;
    let lib = library()?
        .with_hook(Hook::Init, "fixture_init")?
        .with_hook(Hook::MemoryFraction, "fixture_memory_fraction")?;
    memory::change_current_allocator(&PluggableAllocator::new(lib))?;
    let rt = ferrocuda::runtime();
    memory::set_per_process_memory_fraction(0.5, D0)?;
    let count = rt.device_count() as i32;
    ensure(
        probe.events()
            == [
                Event::Init(count),
                Event::MemoryFraction {
                    fraction: 0.5,
                    device: 0,
                },
            ],
        format!("init, then the fraction: {:?}", probe.events()),
    )?;
    let stream = rt.current_stream(D0)?;
    let missing = ferrocuda::types::DeviceIndex(count as u16 + 4);
    let refused = memory::caching_allocator_alloc(1024, missing, Some(&stream));
    ensure(
        refused.is_err() && probe.events().len() == 2,
        format!(
            "a missing device: {refused:?}, library saw {:?}",
            probe.events()
        ),
    )?;
    let raw = memory::caching_allocator_alloc(256, D0, Some(&stream))?;
    memory::caching_allocator_delete(raw)?;
    ensure(
        probe
            .events()
            .iter()
            .filter(|e| matches!(e, Event::Init(_)))
            .count()
            == 1,
        format!("one init: {:?}", probe.events()),
    )
}

fn refused_after_init() -> Outcome {
    let _probe = Probe::open()?;
    ferrocuda::init()?;
    let e = memory::change_current_allocator(&PluggableAllocator::new(library()?));
    ensure(e == Err(AllocError::AlreadyInitialized), format!("{e:?}"))?;
    ensure(memory::get_allocator_backend() == "native", "still native")
}

fn refused_after_allocation() -> Outcome {
    let _probe = Probe::open()?;
    let rt = ferrocuda::runtime();
    ensure(!rt.is_initialized(), "nothing initialised yet")?;
    let buf = DeviceBuffer::<u8>::uninit(rt, D0, 16)?;
    let e = memory::change_current_allocator(&PluggableAllocator::new(library()?));
    ensure(e == Err(AllocError::AlreadyInitialized), format!("{e:?}"))?;
    ensure(
        memory::memory_allocated(D0)? == 512,
        "the caching allocator serves",
    )?;
    drop(buf);
    Ok(())
}

fn mem_pool() -> Outcome {
    let probe = Probe::open()?;
    let rt = ferrocuda::runtime();
    let a = PluggableAllocator::new(library()?);
    let pool = MemPool::new(Some(a.clone()))?;
    ensure(pool.use_count()? == 1, "the pool object's own use")?;
    let (inside, outside) = {
        let _routing = memory::use_mem_pool(&pool)?;
        ensure(pool.use_count()? == 2, "and the routing's")?;
        (
            DeviceBuffer::<f32>::uninit(rt, D0, (1 << 18) + 128)?,
            DeviceBuffer::<f32>::uninit(rt, D0, 100)?,
        )
    };
    let after = DeviceBuffer::<f32>::uninit(rt, D0, 100)?;
    ensure(pool.use_count()? == 1, "routing ended")?;
    let segments: Vec<(u64, u64)> = probe
        .events()
        .iter()
        .filter_map(|e| match *e {
            Event::Alloc { size, ptr, .. } => Some((ptr, size)),
            _ => None,
        })
        .collect();
    ensure(
        segments.iter().map(|s| s.1).collect::<Vec<_>>() == [20 * MIB, 2 * MIB],
        format!("a large and a small segment from the library: {segments:?}"),
    )?;
    ensure(
        inside.ptr().0 == segments[0].0 && outside.ptr().0 == segments[1].0,
        "the routed buffers are cut from them",
    )?;
    ensure(
        !segments.iter().any(|s| s.0 == after.ptr().0),
        "a later buffer is the driver's",
    )?;
    round_trip(&inside)?;
    ensure(
        memory::memory_reserved(D0)? == 24 * MIB,
        "the caching allocator counts the pool's segments (and the driver's one)",
    )?;
    drop((inside, outside));
    ensure(a.live() == 2, "cached in the pool")?;
    drop(pool);
    ensure(a.live() == 0, "given back when the pool goes")?;
    ensure(
        memory::memory_reserved(D0)? == 2 * MIB,
        "the driver's segment stays",
    )?;
    drop(after);
    Ok(())
}

fn main() -> ExitCode {
    Runner {
        variable: "FERROCUDA_SWAP_SCENARIO",
        cleared: &[
            "FERROCUDA_ALLOC_CONF",
            "PYTORCH_CUDA_ALLOC_CONF",
            "PYTORCH_ALLOC_CONF",
        ],
        per_backend: true,
    }
    .main(SCENARIOS)
}
