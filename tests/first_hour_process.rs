//! What a newcomer meets in the first hour, on the global runtime with
//! `FERROCUDA_BACKEND=fake` (each test re-runs this binary as a child with
//! `FERROCUDA_FIRST_HOUR_SCENARIO=<name>`, the global runtime being once per process): the
//! library's kernels run with nothing registered, a program registers its own through the
//! facade, a stream of another runtime is refused, and every per-device memory query on a
//! device that does not exist is PyTorch's "Invalid device argument" once CUDA is
//! initialised (before, the statistics are PyTorch's empty ones for any index).
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use ferrocuda::alloc::AllocError;
use ferrocuda::amp::scaler::OptimizerId;
use ferrocuda::amp::{GradScaler, GradScalerConfig, TensorView};
use ferrocuda::graph::PhiloxGenerator;
use ferrocuda::memory as mem;
use ferrocuda::stream::{DeviceBuffer, Module, StreamError};
use ferrocuda::types::{DeviceIndex, KernelArg, LaunchConfig};
use std::sync::Arc;

type R = Result<(), Box<dyn std::error::Error>>;
const D0: DeviceIndex = DeviceIndex(0);
const D7: DeviceIndex = DeviceIndex(7);

/// Runs `name` in a child process with the global fake runtime and `env`; returns whether
/// the test body should run here (true in the child).
fn in_child(name: &str, env: &[(&str, &str)]) -> Result<bool, Box<dyn std::error::Error>> {
    if std::env::var("FERROCUDA_FIRST_HOUR_SCENARIO").as_deref() == Ok(name) {
        return Ok(true);
    }
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env("FERROCUDA_FIRST_HOUR_SCENARIO", name)
        .env("FERROCUDA_BACKEND", "fake");
    for var in [
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
        "FERROCUDA_ALLOC_CONF",
        "PYTORCH_NO_CUDA_MEMORY_CACHING",
        "FERROCUDA_NO_CUDA_MEMORY_CACHING",
        "CUDA_VISIBLE_DEVICES",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "child {name} failed:\n{text}"
    );
    Ok(false)
}

#[test]
fn the_global_fake_runtime_runs_the_librarys_kernels() -> R {
    if !in_child("the_global_fake_runtime_runs_the_librarys_kernels", &[])? {
        return Ok(());
    }
    let rt = ferrocuda::runtime();
    let mut scaler = GradScaler::new(rt, D0, GradScalerConfig::default())?;
    let loss = DeviceBuffer::from_slice(rt, D0, &[1.0f32])?;
    scaler.scale_in_place(&TensorView::of(&loss))?;
    let grad = DeviceBuffer::from_slice(rt, D0, &[2.0f32 * 65536.0])?;
    let stepped = scaler.step(OptimizerId::fresh(), &[TensorView::of(&grad)], || ())?;
    assert_eq!(stepped, Some(()));
    assert_eq!(grad.to_host()?, vec![2.0]);
    scaler.update()?;
    let out = DeviceBuffer::<f32>::uninit(rt, D0, 16)?;
    PhiloxGenerator::new(rt, D0, 3)?.uniform(&out, &rt.current_stream(D0)?)?;
    assert!(out.to_host()?.iter().all(|v| (0.0..1.0).contains(v)));
    Ok(())
}

#[test]
fn a_program_registers_its_kernel_on_the_global_runtime() -> R {
    if !in_child("a_program_registers_its_kernel_on_the_global_runtime", &[])? {
        return Ok(());
    }
    let rt = ferrocuda::runtime();
    let src = r#"extern "C" __global__ void negate(float* x, unsigned n)
        { unsigned i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] = -x[i]; }"#;
    let module = Module::from_cuda_source(rt, D0, "negate", src)?;
    // Before: the error names the kernel.
    let missing = module.function("negate").err().map(|e| e.to_string());
    assert!(
        missing.as_deref().is_some_and(|t| t.contains("`negate`")),
        "{missing:?}"
    );
    assert!(ferrocuda::register_fake_kernel("negate", |k| {
        let (x, n) = (k.arg(0)?, k.arg::<u32>(1)? as usize);
        let v: Vec<f32> = k.read::<f32>(x, n)?.iter().map(|v| -v).collect();
        k.write(x, &v)
    }));
    let negate = module.function("negate")?;
    let x = DeviceBuffer::from_slice(rt, D0, &[1.0f32, -2.0])?;
    let n = 2u32;
    rt.current_stream(D0)?.launch(
        &negate,
        &LaunchConfig::for_elements(2, 32),
        &[x.arg(), KernelArg::value(&n)],
    )?;
    assert_eq!(x.to_host()?, vec![-1.0, 2.0]);
    Ok(())
}

#[test]
fn the_global_runtime_refuses_another_runtimes_stream() -> R {
    if !in_child("the_global_runtime_refuses_another_runtimes_stream", &[])? {
        return Ok(());
    }
    let rt = ferrocuda::runtime();
    let other = ferrocuda::Backend::Fake.runtime();
    let foreign = other.new_stream(D0, 0)?;
    assert_eq!(foreign.handle(), rt.new_stream(D0, 0)?.handle());
    let refused = |e: &StreamError| {
        matches!(e, StreamError::OtherRuntime { expected, found, .. }
            if *expected == rt.id() && *found == other.id())
    };
    let guard = rt.stream_guard(&foreign).map(drop);
    assert!(matches!(&guard, Err(e) if refused(e)), "{guard:?}");
    let alloc = mem::caching_allocator_alloc(512, D0, Some(&foreign));
    assert!(
        matches!(&alloc, Err(AllocError::Stream(e)) if refused(e)),
        "{alloc:?}"
    );
    let buf = DeviceBuffer::<f32>::filled(rt, D0, 8, 0.0)?;
    let recorded = buf.record_stream(&foreign);
    assert!(matches!(&recorded, Err(e) if refused(e)), "{recorded:?}");
    drop(Arc::clone(&other));
    Ok(())
}

/// Every per-device query and setter of `ferrocuda::memory` on device 7 of 1.
fn all_refuse_device_7(when: &str) {
    let no_such = |r: Result<(), AllocError>, what: &str| match r {
        Err(AllocError::NoSuchDevice {
            device: 7,
            count: 1,
        }) => {}
        other => panic!("{what} {when}: {other:?}"),
    };
    no_such(mem::memory_allocated(D7).map(drop), "memory_allocated");
    no_such(
        mem::max_memory_allocated(D7).map(drop),
        "max_memory_allocated",
    );
    no_such(mem::memory_reserved(D7).map(drop), "memory_reserved");
    no_such(
        mem::max_memory_reserved(D7).map(drop),
        "max_memory_reserved",
    );
    no_such(mem::memory_stats(D7).map(drop), "memory_stats");
    no_such(mem::memory_summary(D7, false).map(drop), "memory_summary");
    no_such(mem::reset_peak_memory_stats(D7), "reset_peak_memory_stats");
    no_such(
        mem::reset_accumulated_memory_stats(D7),
        "reset_accumulated_memory_stats",
    );
    no_such(
        mem::get_per_process_memory_fraction(D7).map(drop),
        "get_per_process_memory_fraction",
    );
    no_such(
        mem::set_per_process_memory_fraction(0.5, D7),
        "set_per_process_memory_fraction",
    );
    assert_eq!(
        mem::memory_allocated(D7).err().map(|e| e.to_string()),
        Some("Invalid device argument 7: did you call init?".into())
    );
}

#[test]
fn memory_queries_refuse_a_device_that_does_not_exist() -> R {
    if !in_child("memory_queries_refuse_a_device_that_does_not_exist", &[])? {
        return Ok(());
    }
    // Before CUDA is initialised the statistics of every device index are PyTorch's empty
    // ones (`memory_stats_as_nested_dict` returns {} until `is_initialized()`), device 7
    // included, and asking initialises nothing.
    for dev in [D0, D7] {
        assert!(mem::memory_stats(dev)?.is_empty());
        assert_eq!(mem::memory_allocated(dev)?, 0);
        assert_eq!(mem::max_memory_allocated(dev)?, 0);
        assert_eq!(mem::memory_reserved(dev)?, 0);
        assert_eq!(mem::max_memory_reserved(dev)?, 0);
    }
    assert!(!ferrocuda::is_initialized(), "a query initialised CUDA");
    ferrocuda::init()?;
    all_refuse_device_7("after init");
    assert!(mem::memory_stats(D0)?.contains_key("allocated_bytes.all.current"));
    Ok(())
}

#[test]
fn memory_queries_refuse_a_device_that_does_not_exist_under_cuda_malloc_async() -> R {
    let name = "memory_queries_refuse_a_device_that_does_not_exist_under_cuda_malloc_async";
    if !in_child(
        name,
        &[("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")],
    )? {
        return Ok(());
    }
    assert_eq!(mem::get_allocator_backend(), "cudaMallocAsync");
    let check = |when: &str| {
        for (r, what) in [
            (mem::memory_allocated(D7).map(drop), "memory_allocated"),
            (mem::memory_reserved(D7).map(drop), "memory_reserved"),
            (mem::memory_stats(D7).map(drop), "memory_stats"),
            (mem::reset_peak_memory_stats(D7), "reset_peak_memory_stats"),
            (
                mem::set_per_process_memory_fraction(0.5, D7),
                "set_per_process_memory_fraction",
            ),
        ] {
            assert!(
                matches!(
                    &r,
                    Err(e @ AllocError::AsyncNoSuchDevice {
                        device: 7,
                        count: 1
                    }) if e.to_string() == "Invalid device argument."
                ),
                "{what} {when}: {r:?}"
            );
        }
    };
    // Before initialisation the statistics are PyTorch's empty ones, whatever the backend.
    assert!(mem::memory_stats(D7)?.is_empty());
    assert_eq!(mem::memory_reserved(D7)?, 0);
    ferrocuda::init()?;
    check("after init");
    Ok(())
}
