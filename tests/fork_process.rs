//! Forks, as Python's `multiprocessing` "fork" start method makes them, on the fake device
//! (which models a CUDA process, so CI checks what the real driver does).
//!
//! A child forked after CUDA was initialised gets PyTorch's error ("Cannot re-initialize
//! CUDA in forked subprocess. ...") on its first CUDA call, on both backends; a child forked
//! before works; the NVML-based availability check keeps the process fork-safe.
//!
//! A fork is only sound in a single-threaded process, and each scenario needs a fresh one
//! (the mark of a bad fork, and the global runtime, are per process). So this test has no
//! harness: run without `FERROCUDA_FORK_SCENARIO`, it runs itself once per scenario with that
//! variable (and the scenario's environment) set; with it, it runs the one scenario on its
//! only thread. Arguments that do not start with `-` select scenarios by substring.
#![forbid(unsafe_code)]
use ferrocuda::driver::fork::{fork_and_wait, in_bad_fork};
use ferrocuda::driver::{CudaDriver, Driver, DriverError, FakeDriver};
use ferrocuda::stream::{AvailabilityCheck, DeviceBuffer, KernelCache, Runtime, StreamError};
use ferrocuda::types::DeviceIndex;
use std::process::ExitCode;
use std::sync::Arc;

use ferrocuda_testkit::fresh_process::{Outcome, Runner, Scenario, ensure};

const D0: DeviceIndex = DeviceIndex(0);
const PYTORCH_TEXT: &str = "Cannot re-initialize CUDA in forked subprocess. To use CUDA with \
                            multiprocessing, you must use the 'spawn' start method";

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "a_child_forked_before_initialisation_works",
        env: &[],
        run: forked_before_initialisation,
    },
    Scenario {
        name: "a_child_forked_after_initialisation_gets_pytorchs_error",
        env: &[],
        run: forked_after_initialisation,
    },
    Scenario {
        name: "the_driver_check_makes_a_later_fork_bad",
        env: &[],
        run: driver_check_then_fork,
    },
    Scenario {
        name: "the_nvml_check_keeps_the_process_fork_safe",
        env: &[],
        run: nvml_check_then_fork,
    },
    Scenario {
        name: "global_nvml_check_without_nvml_falls_back_to_the_driver",
        env: &[
            ("FERROCUDA_BACKEND", "fake"),
            ("PYTORCH_NVML_BASED_CUDA_CHECK", "1"),
        ],
        run: global_fallback,
    },
    Scenario {
        name: "global_nvml_check_reads_cuda_visible_devices_and_initialises_nothing",
        env: &[
            ("FERROCUDA_BACKEND", "fake"),
            ("PYTORCH_NVML_BASED_CUDA_CHECK", "1"),
            ("CUDA_VISIBLE_DEVICES", ""),
        ],
        run: global_nvml_no_visible_device,
    },
    Scenario {
        name: "global_ferrocuda_variable_wins_over_pytorchs",
        env: &[
            ("FERROCUDA_BACKEND", "fake"),
            ("FERROCUDA_NVML_BASED_CUDA_CHECK", "0"),
            ("PYTORCH_NVML_BASED_CUDA_CHECK", "1"),
            ("CUDA_VISIBLE_DEVICES", ""),
        ],
        run: global_ferrocuda_variable_wins,
    },
    Scenario {
        name: "a_cuda_ipc_counter_is_decremented_by_another_process",
        env: &[],
        run: counter_across_processes,
    },
];

/// Runs `child` in a forked child; its failure, panic or refusal to fork is this outcome's.
fn in_child(child: impl FnOnce() -> Outcome) -> Outcome {
    let code = fork_and_wait(|| match child() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("in the child: {e}");
            1
        }
    })
    .map_err(|e| format!("fork: {e}"))?;
    ensure(code == 0, format!("the child exited with {code}"))
}

fn fake_runtime(nvml: Option<usize>) -> (Arc<FakeDriver>, Arc<Runtime>) {
    let builder = FakeDriver::builder();
    let fake = Arc::new(match nvml {
        Some(n) => builder.nvml(Ok(n)).build(),
        None => builder.build(),
    });
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    (fake, rt)
}

/// Device memory written and read back on `rt`: CUDA works here.
fn round_trip(rt: &Arc<Runtime>) -> Outcome {
    let x = DeviceBuffer::from_slice(rt, D0, &[1.0f32, 2.0, 3.0]).map_err(|e| e.to_string())?;
    let back = x.to_host().map_err(|e| e.to_string())?;
    ensure(back == [1.0, 2.0, 3.0], format!("read back {back:?}"))
}

/// The error a bad fork must give: PyTorch's, typed.
fn is_bad_fork(result: Result<impl std::fmt::Debug, StreamError>, call: &str) -> Outcome {
    match result {
        Err(e @ StreamError::BadFork) if e.to_string() == PYTORCH_TEXT => Ok(()),
        other => Err(format!("{call} gave {other:?}, not PyTorch's bad-fork error").into()),
    }
}

fn forked_before_initialisation() -> Outcome {
    let (fake, rt) = fake_runtime(None);
    in_child(|| {
        ensure(!in_bad_fork(), "marked a bad fork")?;
        round_trip(&rt)?;
        ensure(
            fake.is_initialized() && rt.is_initialized(),
            "not initialised",
        )
    })?;
    ensure(
        !fake.is_initialized(),
        "the child's use initialised the parent",
    )?;
    round_trip(&rt)
}

fn forked_after_initialisation() -> Outcome {
    let (_fake, rt) = fake_runtime(None);
    round_trip(&rt)?;
    in_child(|| {
        ensure(in_bad_fork(), "not marked a bad fork")?;
        ensure(!rt.is_initialized(), "is_initialized() in a bad fork")?;
        // As PyTorch's, the driver check answers what was known before the fork.
        ensure(rt.is_available(), "is_available() changed its answer")?;
        is_bad_fork(rt.current_stream(D0), "current_stream")?;
        is_bad_fork(DeviceBuffer::from_slice(&rt, D0, &[1.0f32]), "from_slice")?;
        is_bad_fork(rt.init(), "init")?;
        // Both backends refuse before doing anything, even new drivers.
        let fresh = FakeDriver::default();
        ensure(
            fresh.device_count() == Err(DriverError::BAD_FORK),
            "a new fake driver works in a bad fork",
        )?;
        let cuda = CudaDriver::new();
        ensure(
            cuda.device_count() == Err(DriverError::BAD_FORK),
            "the CUDA driver did not refuse a bad fork",
        )?;
        ensure(
            DriverError::BAD_FORK.to_string() == PYTORCH_TEXT,
            "driver error text",
        )
    })?;
    ensure(!in_bad_fork(), "the parent is marked")?;
    round_trip(&rt)
}

fn driver_check_then_fork() -> Outcome {
    let (_fake, rt) = fake_runtime(Some(1));
    ensure(
        rt.is_available_by(AvailabilityCheck::Driver),
        "not available",
    )?;
    ensure(
        !rt.is_initialized(),
        "counting devices set is_initialized()",
    )?;
    in_child(|| is_bad_fork(rt.current_stream(D0), "current_stream"))
}

fn nvml_check_then_fork() -> Outcome {
    let (fake, rt) = fake_runtime(Some(1));
    ensure(rt.is_available_by(AvailabilityCheck::Nvml), "not available")?;
    ensure(!fake.is_initialized(), "the NVML check initialised CUDA")?;
    in_child(|| {
        ensure(!in_bad_fork(), "marked a bad fork")?;
        round_trip(&rt)
    })
}

fn global_fallback() -> Outcome {
    ensure(
        ferrocuda::is_available(),
        "the fake device is not available",
    )?;
    ensure(
        !ferrocuda::is_initialized(),
        "counting devices set is_initialized()",
    )?;
    ensure(ferrocuda::device_count() == 1, "device count")?;
    in_child(|| is_bad_fork(ferrocuda::runtime().current_stream(D0), "current_stream"))
}

/// `CUDA_VISIBLE_DEVICES=""` hides every device: PyTorch's NVML count is 0 without asking
/// NVML, so CUDA is left alone. (The fake device itself ignores the variable, so a child,
/// never poisoned, initialises it and finds its device.)
fn global_nvml_no_visible_device() -> Outcome {
    ensure(
        !ferrocuda::is_available(),
        "available with no visible device",
    )?;
    ensure(!ferrocuda::is_initialized(), "the check initialised CUDA")?;
    in_child(|| {
        ensure(!in_bad_fork(), "marked a bad fork")?;
        ferrocuda::init().map_err(|e| e.to_string())?;
        ensure(ferrocuda::is_initialized(), "not initialised")
    })
}

fn global_ferrocuda_variable_wins() -> Outcome {
    ensure(ferrocuda::is_available(), "the driver check was not used")?;
    ensure(
        !ferrocuda::is_initialized(),
        "counting devices set is_initialized()",
    )?;
    // As PyTorch's `memory_stats` after `is_available()`: empty, initialising nothing.
    let stats = ferrocuda::memory::memory_stats(D0).map_err(|e| e.to_string())?;
    ensure(
        stats.is_empty(),
        format!("statistics before init: {stats:?}"),
    )?;
    ensure(!ferrocuda::is_initialized(), "memory_stats initialised")?;
    // The driver's check ran `cuInit` (NVML's would not have): a later fork is bad.
    in_child(|| is_bad_fork(ferrocuda::runtime().current_stream(D0), "current_stream"))
}

/// The counter file of a CUDA IPC send, opened by name in another process (what a
/// consumer's close does) and decremented there; the last mapping closed removes the name.
fn counter_across_processes() -> Outcome {
    use ferrocuda::driver::shared_counters::SharedCounters;
    use std::sync::atomic::Ordering;
    let name = format!("/torch_{}_fork_test", std::process::id());
    let file = SharedCounters::create(&name, 10_000).map_err(|e| e.to_string())?;
    let counter = file.counter(9_999).ok_or("the last counter")?;
    counter.store(1, Ordering::SeqCst);
    in_child(|| {
        let file = SharedCounters::open(&name, 10_000).map_err(|e| e.to_string())?;
        let counter = file.counter(9_999).ok_or("the last counter")?;
        ensure(
            counter.fetch_sub(1, Ordering::SeqCst) == 1,
            "the child reads 1",
        )
    })?;
    ensure(counter.load(Ordering::SeqCst) == 0, "the parent sees 0")?;
    ensure(file.counter(10_000).is_none(), "no counter past the last")?;
    ensure(
        SharedCounters::create(&name, 10).is_err(),
        "a name is created once",
    )?;
    let shm = std::path::Path::new("/dev/shm").join(name.trim_start_matches('/'));
    ensure(shm.exists(), "the name exists while mapped")?;
    drop(file);
    ensure(!shm.exists(), "the last mapping closed removes the name")?;
    ensure(
        SharedCounters::open(&name, 10).is_err(),
        "a name that is gone does not open",
    )
}

fn main() -> ExitCode {
    Runner {
        variable: "FERROCUDA_FORK_SCENARIO",
        // Variables a scenario's process starts without, unless the scenario sets them.
        cleared: &[
            "FERROCUDA_BACKEND",
            "FERROCUDA_NVML_BASED_CUDA_CHECK",
            "PYTORCH_NVML_BASED_CUDA_CHECK",
            "CUDA_VISIBLE_DEVICES",
        ],
        per_backend: false,
    }
    .main(SCENARIOS)
}
