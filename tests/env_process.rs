//! Configuration variables set to values that are not valid UTF-8: the global runtime reads
//! each as an error naming it, never as an unset variable that lets the next one in the
//! order (or the default) win.
//!
//! The runtime reads the environment once per process, so each case runs this test binary
//! again (`--exact` its own name) with the variables set, and checks there.
#![forbid(unsafe_code)]
#![cfg(unix)]
use ferrocuda::alloc::AllocError;
use ferrocuda::stream::DeviceBuffer;
use ferrocuda::types::{DeviceIndex, EnvError};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::process::Command;

const CHILD: &str = "FERROCUDA_ENV_CONFIG_CHILD";
const D0: DeviceIndex = DeviceIndex(0);

/// Runs the test `name` of this binary in a child with `env` set (and the configuration
/// variables not named there removed); its outcome is the child's.
fn in_child(name: &str, env: &[(&str, &[u8])]) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1");
    for var in [
        "FERROCUDA_BACKEND",
        "FERROCUDA_ALLOC_CONF",
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
        "FERROCUDA_NO_CUDA_MEMORY_CACHING",
        "PYTORCH_NO_CUDA_MEMORY_CACHING",
    ] {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, OsStr::from_bytes(v));
    }
    let out = cmd.output().map_err(|e| e.to_string())?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if out.status.success() && text.contains("1 passed") {
        Ok(())
    } else {
        Err(format!("the child failed:\n{text}"))
    }
}

fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// `FERROCUDA_BACKEND` that is not UTF-8: `try_runtime` says so, and the global runtime's
/// memory functions and allocations fail with it (the runtime is the real driver's, never
/// silently the fake device).
#[test]
fn backend_not_utf8() -> Result<(), String> {
    if !is_child() {
        return in_child(
            "backend_not_utf8",
            &[
                ("FERROCUDA_BACKEND", b"fa\xffke"),
                ("FERROCUDA_ALLOC_CONF", b"expandable_segments:True"),
            ],
        );
    }
    match ferrocuda::try_runtime() {
        Err(EnvError::NotUnicode { name, value }) => {
            assert_eq!(name, "FERROCUDA_BACKEND");
            assert_eq!(value, r#""fa\xFFke""#);
        }
        other => return Err(format!("try_runtime: {:?}", other.map(drop))),
    }
    // The memory functions (and every allocation, once a device is there) answer with it.
    let e = ferrocuda::memory::allocators()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.starts_with(
            "environment variable FERROCUDA_BACKEND is set but its value is not valid UTF-8"
        ),
        "{e}"
    );
    assert_eq!(
        ferrocuda::runtime().driver().backend(),
        "cuda",
        "not the fake device"
    );
    Ok(())
}

/// `FERROCUDA_ALLOC_CONF` that is not UTF-8 beside a valid `PYTORCH_CUDA_ALLOC_CONF`: an
/// error naming `FERROCUDA_ALLOC_CONF` (it used to be passed over, and the PyTorch
/// variable's configuration used).
#[test]
fn alloc_conf_not_utf8() -> Result<(), String> {
    if !is_child() {
        return in_child(
            "alloc_conf_not_utf8",
            &[
                ("FERROCUDA_BACKEND", b"fake"),
                ("FERROCUDA_ALLOC_CONF", b"expandable_segments:\xff"),
                ("PYTORCH_CUDA_ALLOC_CONF", b"expandable_segments:True"),
            ],
        );
    }
    let e = DeviceBuffer::<f32>::uninit(ferrocuda::runtime(), D0, 10)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains(
            "environment variable FERROCUDA_ALLOC_CONF is set but its value is not valid UTF-8"
        ),
        "{e}"
    );
    Ok(())
}

/// `PYTORCH_NO_CUDA_MEMORY_CACHING` that is not UTF-8: an error naming it.
#[test]
fn caching_variable_not_utf8() -> Result<(), String> {
    if !is_child() {
        return in_child(
            "caching_variable_not_utf8",
            &[
                ("FERROCUDA_BACKEND", b"fake"),
                ("PYTORCH_NO_CUDA_MEMORY_CACHING", b"\xfe"),
            ],
        );
    }
    match ferrocuda::memory::allocators() {
        Err(AllocError::Env(EnvError::NotUnicode { name, .. })) => {
            assert_eq!(name, "PYTORCH_NO_CUDA_MEMORY_CACHING");
        }
        other => return Err(format!("{:?}", other.map(drop))),
    }
    Ok(())
}
