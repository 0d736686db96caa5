//! The global runtime under `backend:cudaMallocAsync` (from `FERROCUDA_ALLOC_CONF`): its
//! buffers and every `ferrocuda::memory` function behave as PyTorch's do under that backend
//! (c10/cuda/CUDAMallocAsyncAllocator.cpp).
//!
//! The configuration is read once per process, so each scenario runs in a fresh one: this
//! test has no harness. Run without `FERROCUDA_ASYNC_SCENARIO`, it runs itself once per
//! scenario and backend with that variable set: on the fake device always, on the real
//! driver too when `FERROCUDA_REQUIRE_GPU=1` (the GPU bundle; reported as ignored
//! otherwise). Arguments that do not start with `-` select scenarios by substring.
#![forbid(unsafe_code)]
use ferrocuda::alloc::AllocError;
use ferrocuda::graph::{CaptureMemory, CaptureMode, CudaGraph};
use ferrocuda::memory::{self, MemPool};
use ferrocuda::stream::DeviceBuffer;
use ferrocuda::types::DeviceIndex;
use std::process::ExitCode;

use ferrocuda_testkit::fresh_process::{Outcome, Runner, Scenario, ensure};

const D0: DeviceIndex = DeviceIndex(0);
const MIB: u64 = 1 << 20;

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "the_memory_functions_follow_the_async_backend",
        env: &[("FERROCUDA_ALLOC_CONF", "backend:cudaMallocAsync")],
        run: memory_functions,
    },
    Scenario {
        name: "pytorchs_native_options_beside_the_async_backend_are_ignored_with_its_warning",
        env: &[(
            "FERROCUDA_ALLOC_CONF",
            "backend:cudaMallocAsync,max_split_size_mb:100,garbage_collection_threshold:0.6,\
             roundup_power2_divisions:4,release_lock_on_cudamalloc:True,\
             pinned_num_register_threads:2",
        )],
        run: native_option_ignored,
    },
    Scenario {
        name: "a_ferrocuda_option_beside_the_async_backend_is_an_error",
        env: &[(
            "FERROCUDA_ALLOC_CONF",
            "backend:cudaMallocAsync,expandable_segments_reclaim:True",
        )],
        run: ferrocuda_option_refused,
    },
    Scenario {
        name: "a_graph_captures_through_the_async_backend",
        env: &[("FERROCUDA_ALLOC_CONF", "backend:cudaMallocAsync")],
        run: graph_capture,
    },
    Scenario {
        name: "capture_memory_is_the_native_allocators_by_default",
        env: &[],
        run: native_capture_memory,
    },
];

fn stat(key: &str) -> Result<i64, AllocError> {
    Ok(memory::memory_stats(D0)?[key])
}

fn memory_functions() -> Outcome {
    let rt = ferrocuda::runtime();
    ensure(
        memory::get_allocator_backend() == "cudaMallocAsync",
        "get_allocator_backend",
    )?;
    let values: Vec<f32> = (0..(MIB as usize)).map(|i| i as f32).collect();
    let buf = DeviceBuffer::from_slice(rt, D0, &values)?;
    ensure(buf.to_host()? == values, "a buffer's contents come back")?;
    let allocated = memory::memory_allocated(D0)?;
    ensure(allocated >= 4 * MIB, format!("allocated {allocated}"))?;
    ensure(
        memory::memory_reserved(D0)? >= allocated,
        "reserved covers allocated",
    )?;
    for key in [
        "allocation.all.current",
        "segment.all.current",
        "num_alloc_retries",
    ] {
        ensure(stat(key)? == 0, format!("{key} is zero under this backend"))?;
    }
    // A buffer used on a side stream is freed after that stream's work (record_stream).
    let side = rt.stream_from_pool(D0, false)?;
    let shared = DeviceBuffer::<f32>::filled(rt, D0, 1000, 2.0)?;
    shared.record_stream(&side)?;
    drop(shared);
    drop(buf);
    rt.synchronize(D0)?;
    ensure(memory::memory_allocated(D0)? == 0, "freed")?;
    ensure(
        memory::memory_reserved(D0)? > 0,
        "the pool keeps freed memory (release threshold u64::MAX)",
    )?;
    memory::empty_cache()?;
    ensure(
        memory::memory_reserved(D0)? == 0,
        "empty_cache trims the pool",
    )?;

    // The memory fraction, by the allocator's own count, with PyTorch's text.
    let (_, total) = memory::mem_get_info(D0)?;
    memory::set_per_process_memory_fraction(0.25, D0)?;
    let e = memory::caching_allocator_alloc(total / 2, D0, None)
        .err()
        .ok_or("half the device passed a quarter's limit")?;
    ensure(
        e.to_string()
            .starts_with("Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently allocated     : 0 bytes\n"),
        format!("the fraction's error: {e}"),
    )?;
    let p = memory::caching_allocator_alloc(MIB, D0, None)?;
    memory::caching_allocator_delete(p)?;
    memory::set_per_process_memory_fraction(1.0, D0)?;

    // Peaks follow the pool; accumulated statistics have no form here.
    memory::reset_peak_memory_stats(D0)?;
    ensure(memory::max_memory_allocated(D0)? == 0, "peak reset")?;
    memory::reset_accumulated_memory_stats(D0)?;

    // What this backend has no form of: PyTorch's errors.
    let unsupported = |f: &str| {
        format!(
            "cudaMallocAsync does not yet support {f}. If you need it, please file an issue describing your use case."
        )
    };
    ensure(
        memory::memory_snapshot().map(drop).map_err(|e| e.to_string())
            == Err("Calling snapshot with backend:cudaMallocAsync is not meaningful. (For backend:native, snapshot returns a detailed summary of all blocks tracked by the allocator, but the cudaMallocAsync backend does not track individual blocks.)".into()),
        "snapshot",
    )?;
    ensure(
        memory::record_memory_history(Some("all"), None, "python", 100).map_err(|e| e.to_string())
            == Err(unsupported("recordHistory")),
        "history",
    )?;
    ensure(
        MemPool::new(None).map(drop).map_err(|e| e.to_string())
            == Err(unsupported("createOrIncrefPool")),
        "MemPool",
    )?;
    ensure(
        memory::get_per_process_memory_fraction(D0).map_err(|e| e.to_string())
            == Err(unsupported("getMemoryFraction")),
        "getMemoryFraction",
    )?;

    // Settings at run time keep the backend.
    memory::set_allocator_settings("backend:cudaMallocAsync")?;
    ensure(
        matches!(
            memory::set_allocator_settings("backend:native"),
            Err(AllocError::WrongBackend)
        ),
        "switching backends at run time",
    )?;
    // A caching-allocator option at run time: accepted and ignored, with PyTorch's warning;
    // a pinned option reaches the pinned host allocator.
    let a = memory::async_allocator().ok_or("no async allocator")?;
    a.take_warnings();
    memory::set_allocator_settings("max_split_size_mb:100,pinned_max_cached_size_mb:8")?;
    let warnings = a.take_warnings();
    ensure(
        warnings == [ferrocuda::alloc::ASYNC_IGNORES_WARNING],
        format!("a native option at run time: {warnings:?}"),
    )?;
    ensure(
        memory::host_allocator()?.config().max_cached_size == Some(8 * MIB),
        "the pinned option reached the host allocator",
    )?;
    ensure(
        matches!(
            memory::set_allocator_settings("thread_cache:False"),
            Err(AllocError::AsyncFerrocudaOnly { .. })
        ),
        "a ferrocuda-only option at run time",
    )?;
    Ok(())
}

/// PyTorch accepts these beside the backend and warns (CUDAAllocatorConfig::parseArgs);
/// the backend serves, the pinned key configures the host allocator.
fn native_option_ignored() -> Outcome {
    let buf = DeviceBuffer::<f32>::filled(ferrocuda::runtime(), D0, 10, 1.5)?;
    ensure(buf.to_host()? == vec![1.5; 10], "the buffer's contents")?;
    ensure(
        memory::get_allocator_backend() == "cudaMallocAsync",
        "get_allocator_backend",
    )?;
    let warnings = memory::async_allocator()
        .ok_or("no async allocator")?
        .take_warnings();
    ensure(
        warnings
            == [
                "backend:cudaMallocAsync ignores max_split_size_mb,roundup_power2_divisions, and garbage_collect_threshold.",
            ],
        format!("the warnings: {warnings:?}"),
    )?;
    ensure(
        memory::host_allocator()?.config().num_register_threads == 2,
        "the pinned option configures the host allocator",
    )
}

/// A key PyTorch does not know does nothing with this backend: every allocation fails.
fn ferrocuda_option_refused() -> Outcome {
    let e = DeviceBuffer::<f32>::uninit(ferrocuda::runtime(), D0, 10)
        .err()
        .ok_or("the allocation succeeded")?;
    ensure(
        e.to_string().contains(
            "backend:cudaMallocAsync has no use for expandable_segments_reclaim, an option of ferrocuda's caching allocator",
        ),
        format!("the error: {e}"),
    )
}

/// `memory::capture_memory()` under the key: a graph captures through the async backend,
/// its output in graph memory filled by the replay; freeing it afterwards is PyTorch's
/// uncaptured free of a captured allocation.
fn graph_capture() -> Outcome {
    let rt = ferrocuda::runtime();
    let capture_memory = memory::capture_memory()?;
    ensure(
        matches!(capture_memory, CaptureMemory::Async { .. }),
        "capture_memory is the async backend's",
    )?;
    let g = CudaGraph::new(rt.clone(), capture_memory, D0)?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let out = DeviceBuffer::<f32>::uninit(rt, D0, 1024)?;
    out.fill(3.0)?;
    capture.end()?;
    let stream = rt.current_stream(D0)?;
    g.replay(&stream)?;
    stream.synchronize()?;
    ensure(
        out.to_host()? == vec![3.0; 1024],
        "the replay filled graph memory",
    )?;
    g.reset()?;
    drop(out);
    let warnings = memory::async_allocator()
        .ok_or("no async allocator")?
        .take_warnings();
    ensure(
        warnings.len() == 1 && warnings[0].starts_with("Attempting uncaptured free"),
        format!("warnings {warnings:?}"),
    )
}

fn native_capture_memory() -> Outcome {
    ensure(
        matches!(memory::capture_memory()?, CaptureMemory::Native(_)),
        "capture_memory is the caching allocators'",
    )
}

fn main() -> ExitCode {
    Runner {
        variable: "FERROCUDA_ASYNC_SCENARIO",
        cleared: &["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"],
        per_backend: true,
    }
    .main(SCENARIOS)
}
