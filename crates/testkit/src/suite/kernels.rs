//! Kernels: `CUDA_LAUNCH_BLOCKING`, the compiled-kernel cache, compile errors with their log.
use super::*;

/// `CUDA_LAUNCH_BLOCKING=1`: checked in a child process, because drivers read it at start.
pub fn launch_blocking(h: &Harness) -> TestResult {
    const CHILD: &str = "FERROCUDA_CONFORMANCE_CHILD";
    let s = h.rt.new_stream(DEV, 0)?;
    launch_spin(h, &s, 50)?;
    if std::env::var(CHILD).is_ok_and(|v| v == "launch_blocking") {
        assert!(
            s.query()?,
            "with CUDA_LAUNCH_BLOCKING=1 a launch returns after the kernel"
        );
        return Ok(());
    }
    assert!(
        !s.query()?,
        "without it a 50 ms kernel is still running after launch"
    );
    s.synchronize()?;
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "launch_blocking",
            "--include-ignored",
            "--test-threads=1",
            "--nocapture",
        ])
        .env("CUDA_LAUNCH_BLOCKING", "1")
        .env(CHILD, "launch_blocking")
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "child run failed:\n{text}"
    );
    Ok(())
}

// ---- kernels ---------------------------------------------------------------------------

pub fn kernel_cache_hits_and_repairs(h: &Harness) -> TestResult {
    let dir = temp_dir("cache-test");
    let driver = h.rt.driver().clone();
    let rt = Runtime::with_kernel_cache(driver.clone(), KernelCache::at(Some(dir.clone())));
    let load = || Module::from_cuda_source(&rt, DEV, "cache_test", KERNELS);
    assert_eq!(load()?.cache_outcome(), CacheOutcome::Miss);
    assert_eq!(load()?.cache_outcome(), CacheOutcome::Hit);
    let entries: Vec<_> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .collect();
    assert_eq!(entries.len(), 1, "one entry: {entries:?}");
    std::fs::write(&entries[0], b"not a kernel")?;
    assert_eq!(
        load()?.cache_outcome(),
        CacheOutcome::Repaired,
        "a damaged entry is recompiled"
    );
    assert_eq!(load()?.cache_outcome(), CacheOutcome::Hit, "and rewritten");
    // A well-formed entry whose image the driver refuses.
    use sha2::{Digest, Sha256};
    let junk = b"this is not PTX".to_vec();
    std::fs::write(
        &entries[0],
        [b"FCKERN01".as_slice(), &Sha256::digest(&junk), &junk].concat(),
    )?;
    let m = load()?;
    assert_eq!(m.cache_outcome(), CacheOutcome::Repaired);
    let x = DeviceBuffer::<f32>::filled(&rt, DEV, 10, 1.0)?;
    let s = rt.current_stream(DEV)?;
    s.launch(
        &m.function("add_one_f32")?,
        &elementwise(10),
        &[x.arg(), KernelArg::value(&10u32)],
    )?;
    assert!(x.to_host()?.iter().all(|&v| v == 2.0));
    let uncached = Runtime::with_kernel_cache(driver, KernelCache::at(None));
    assert_eq!(
        Module::from_cuda_source(&uncached, DEV, "c", KERNELS)?.cache_outcome(),
        CacheOutcome::Disabled
    );
    assert_eq!(
        m.function("no_such_kernel").err(),
        Some(StreamError::Driver(DriverError::NOT_FOUND))
    );
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

pub fn compile_error_carries_the_log(h: &Harness) -> TestResult {
    let src = "extern \"C\" __global__ void k() {}\n#error boom from the suite\n";
    match Module::from_cuda_source(&h.rt, DEV, "bad_kernel", src) {
        Err(StreamError::Compile(ferrocuda_driver::CompileError::Rejected { log })) => {
            assert!(log.contains("boom from the suite"), "log: {log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    Ok(())
}

// ---- buffers ---------------------------------------------------------------------------
