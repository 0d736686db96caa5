//! `ferrocuda replay`'s configuration options, refused before the trace is read: the
//! `backend:cudaMallocAsync` backend (the replay drives the caching allocator block by
//! block), and allocator configuration variables that are not valid UTF-8. Each refusal is
//! one line on stderr and exit code 1, whatever the trace (here, a file that does not
//! exist: reading it would be a different error).
use std::ffi::OsStr;
use std::process::{Command, Output};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const EXE: &str = env!("CARGO_BIN_EXE_ferrocuda");

/// A trace path that does not exist: a replay that got as far as reading it would say so.
fn missing_trace() -> String {
    std::env::temp_dir()
        .join(format!(
            "ferrocuda-replay-options-{}-no-such-trace.pickle",
            std::process::id()
        ))
        .display()
        .to_string()
}

/// Runs the command with the allocator configuration variables `env` only.
fn ferrocuda(args: &[&str], env: &[(&str, &OsStr)]) -> Result<Output, std::io::Error> {
    Command::new(EXE)
        .args(args)
        .env_remove("FERROCUDA_ALLOC_CONF")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("PYTORCH_ALLOC_CONF")
        .envs(env.iter().copied())
        .output()
}

/// Exit code 1 and one line on stderr, starting `ferrocuda: ` and containing `wanted`, and
/// nothing about the trace file.
fn assert_refused(out: &Output, wanted: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("ferrocuda: "), "{err}");
    assert!(!err.contains("no-such-trace"), "the trace was read: {err}");
    for w in wanted {
        assert!(err.contains(w), "{w:?} not in {err}");
    }
}

const WHY: &str = "replay drives the caching allocator (backend:native) block by block; \
                   backend:cudaMallocAsync has no block-level replay";

#[test]
fn the_async_backend_is_refused_before_the_trace_is_read() -> TestResult {
    let trace = missing_trace();
    let out = ferrocuda(
        &["replay", &trace, "--conf", "backend:cudaMallocAsync"],
        &[],
    )?;
    assert_refused(&out, &["--conf \"backend:cudaMallocAsync\"", WHY]);
    // Among other configurations, and with PyTorch's other keys beside it.
    let out = ferrocuda(
        &[
            "replay",
            &trace,
            "--conf",
            "default",
            "--conf",
            "backend:cudaMallocAsync,max_split_size_mb:100",
        ],
        &[],
    )?;
    assert_refused(&out, &[WHY]);
    // From the environment.
    let out = ferrocuda(
        &["replay", &trace],
        &[(
            "PYTORCH_CUDA_ALLOC_CONF",
            OsStr::new("backend:cudaMallocAsync"),
        )],
    )?;
    assert_refused(
        &out,
        &["PYTORCH_CUDA_ALLOC_CONF=\"backend:cudaMallocAsync\"", WHY],
    );
    // backend:native is a configuration like any other: it gets as far as the trace.
    let out = ferrocuda(&["replay", &trace, "--conf", "backend:native"], &[])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no-such-trace"), "{err}");
    Ok(())
}

/// An allocator configuration variable that is not valid UTF-8 is an error naming it, not
/// a variable passed over for the next one.
#[cfg(unix)]
#[test]
fn a_configuration_variable_that_is_not_utf8_is_refused() -> TestResult {
    use std::os::unix::ffi::OsStrExt;
    let trace = missing_trace();
    for flags in [&[][..], &["--conf", "default"][..]] {
        let mut args = vec!["replay", trace.as_str()];
        args.extend_from_slice(flags);
        let out = ferrocuda(
            &args,
            &[
                (
                    "FERROCUDA_ALLOC_CONF",
                    OsStr::from_bytes(b"max_split_size_mb:\xff"),
                ),
                (
                    "PYTORCH_CUDA_ALLOC_CONF",
                    OsStr::new("expandable_segments:True"),
                ),
            ],
        )?;
        assert_refused(
            &out,
            &["environment variable FERROCUDA_ALLOC_CONF is set but its value is not valid UTF-8"],
        );
    }
    Ok(())
}
