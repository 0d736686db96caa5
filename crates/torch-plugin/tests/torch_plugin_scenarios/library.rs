//! The built library, loaded as PyTorch loads it (Python's `ctypes.CDLL`, functions by
//! name, `MempoolId_t` by value) on the fake device (`FERROCUDA_BACKEND=fake`): every
//! exported name resolves, the hooks work, and errors come back as errors.
use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::Command;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The library cargo built beside this test (`target/<profile>/deps/`).
fn library() -> Result<PathBuf, Box<dyn std::error::Error>> {
    let exe = std::env::current_exe()?;
    let deps = exe.parent().ok_or("the test has no folder")?;
    let name = format!(
        "{}ferrocuda_torch{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    [deps.join(&name), deps.join("..").join(&name)]
        .into_iter()
        .find(|p| p.exists())
        .ok_or_else(|| format!("{name} was not built beside {}", deps.display()).into())
}

/// Runs `script` with the library's path as its argument; its output if it succeeded.
fn python(script: &str, env: &[(&str, &str)]) -> Result<String, Box<dyn std::error::Error>> {
    let env: Vec<(&str, &OsStr)> = env.iter().map(|(k, v)| (*k, OsStr::new(*v))).collect();
    python_os(script, &env)
}

/// [`python`] with values of any bytes.
fn python_os(script: &str, env: &[(&str, &OsStr)]) -> Result<String, Box<dyn std::error::Error>> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(library()?)
        .env("FERROCUDA_BACKEND", "fake")
        .env_remove("FERROCUDA_ALLOC_CONF")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .envs(env.iter().copied())
        .output()
        .map_err(|e| format!("python3 is needed to load the library: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("python3 failed ({}):\n{text}", out.status).into())
    }
}

/// Declarations every script shares.
const PRELUDE: &str = r#"
import ctypes, json, os, pickle, sys, tempfile
lib = ctypes.CDLL(sys.argv[1])
P, I, Z, D = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_double
class MempoolId(ctypes.Structure):
    _fields_ = [("first", ctypes.c_uint64), ("second", ctypes.c_uint64)]
sig = {
    "ferrocuda_malloc": (P, [Z, I, P]),
    "ferrocuda_free": (None, [P, Z, I, P]),
    "ferrocuda_init": (None, [I]),
    "ferrocuda_reset": (None, []),
    "ferrocuda_memory_fraction": (None, [D, I]),
    "ferrocuda_base_alloc": (P, [P, ctypes.POINTER(ctypes.c_size_t)]),
    "ferrocuda_record_stream": (None, [P, P]),
    "ferrocuda_begin_allocate_to_pool": (None, [I, MempoolId, P]),
    "ferrocuda_end_allocate_to_pool": (None, [I, MempoolId]),
    "ferrocuda_release_pool": (None, [I, MempoolId]),
    "ferrocuda_memory_stats_json": (ctypes.c_ssize_t, [I, ctypes.c_char_p, Z]),
    "ferrocuda_reset_peak_memory_stats": (I, [I]),
    "ferrocuda_allocator_settings": (ctypes.c_ssize_t, [ctypes.c_char_p, Z]),
    "ferrocuda_record_memory_history": (I, [I, Z]),
    "ferrocuda_dump_snapshot": (I, [ctypes.c_char_p]),
    "ferrocuda_create_sleepable_pool": (I, [I, MempoolId]),
    "ferrocuda_sleep": (I, [I, MempoolId, I]),
    "ferrocuda_wake": (I, [I, MempoolId]),
    "ferrocuda_last_error": (ctypes.c_ssize_t, [ctypes.c_char_p, Z]),
    "ferrocuda_error_count": (ctypes.c_uint64, []),
}
missing = [n for n in sig if not hasattr(lib, n)]
assert not missing, f"not exported: {missing}"
for n, (res, args) in sig.items():
    f = getattr(lib, n); f.restype = res; f.argtypes = args
def text(fn, *args):
    n = fn(*args, None, 0)
    assert n >= 0, last_error()
    buf = ctypes.create_string_buffer(n + 1)
    assert fn(*args, buf, n + 1) == n
    return buf.value.decode()
def last_error():
    return text(lib.ferrocuda_last_error)
def stats():
    return json.loads(text(lib.ferrocuda_memory_stats_json, 0))
def fails(call, *args):
    before = lib.ferrocuda_error_count()
    r = call(*args)
    assert lib.ferrocuda_error_count() == before + 1, f"{call.__name__} did not fail"
    return r
"#;

#[test]
fn pytorchs_calls_through_the_built_library() -> TestResult {
    let script = format!(
        "{PRELUDE}{}",
        r#"
MIB = 1 << 20
lib.ferrocuda_init(1)
p = lib.ferrocuda_malloc(3 * MIB, 0, None)
assert p, last_error()
assert stats()["allocation.all.current"] == 1
lib.ferrocuda_record_stream(p, None)
lib.ferrocuda_free(p, 3 * MIB, 0, None)
assert stats()["allocation.all.current"] == 0
assert lib.ferrocuda_error_count() == 0, last_error()

# Foreign pointers, bad devices and streams: errors kept, no crash.
fails(lib.ferrocuda_free, 0x1234, 16, 0, None)
assert "Trying to free a pointer not allocated here" in last_error(), last_error()
assert fails(lib.ferrocuda_malloc, MIB, -1, None) is None
assert "not a device index" in last_error()
assert fails(lib.ferrocuda_malloc, MIB, 0, 0xdead) is None
assert "CUDA_ERROR_INVALID_HANDLE" in last_error(), last_error()
fails(lib.ferrocuda_record_stream, 0x1234, None)
fails(lib.ferrocuda_memory_fraction, 2.0, 0)

# The pool hooks, with MempoolId_t by value; outside a capture the route takes this
# thread's allocations (torch.cuda.use_mem_pool).
pool = MempoolId(0, 7)
lib.ferrocuda_begin_allocate_to_pool(0, pool, None)
q = lib.ferrocuda_malloc(MIB, 0, None)
lib.ferrocuda_end_allocate_to_pool(0, pool)
fails(lib.ferrocuda_end_allocate_to_pool, 0, pool)
size = ctypes.c_size_t(0)
base = lib.ferrocuda_base_alloc(q, ctypes.byref(size))
assert base == q and size.value == 2 * MIB, (base, q, size.value)
lib.ferrocuda_free(q, MIB, 0, None)
reserved = stats()["reserved_bytes.all.current"]
lib.ferrocuda_release_pool(0, pool)
lib.ferrocuda_reset()
assert stats()["reserved_bytes.all.current"] < reserved

# History and the snapshot file.
assert lib.ferrocuda_record_memory_history(1, 1000) == 0
r = lib.ferrocuda_malloc(5 * MIB, 0, None)
lib.ferrocuda_free(r, 5 * MIB, 0, None)
assert lib.ferrocuda_reset_peak_memory_stats(0) == 0
path = os.path.join(tempfile.mkdtemp(), "snapshot.pickle")
assert lib.ferrocuda_dump_snapshot(path.encode()) == 0, last_error()
snap = pickle.load(open(path, "rb"))
actions = [e["action"] for e in snap["device_traces"][0]]
# A snapshot's own entry shows in the next snapshot only (PyTorch's order).
assert actions[-3:] == ["alloc", "free_requested", "free_completed"], actions
assert lib.ferrocuda_dump_snapshot(path.encode()) == 0, last_error()
snap = pickle.load(open(path, "rb"))
assert snap["device_traces"][0][-1]["action"] == "snapshot", snap["device_traces"][0][-1]
assert fails(lib.ferrocuda_dump_snapshot, None) == -1
lib.ferrocuda_memory_fraction(0.5, 0)
print("settings:", text(lib.ferrocuda_allocator_settings))
print("errors:", lib.ferrocuda_error_count())
"#
    );
    let out = python(&script, &[])?;
    assert!(out.contains("errors: 7"), "{out}");
    Ok(())
}

/// A sleepable pool through the library: made before use, filled through the pool hooks
/// (as `torch.cuda.use_mem_pool` fills a pool), put to sleep (the device's memory back,
/// PyTorch's statistics unchanged), refusing allocations and a second sleep while asleep,
/// woken (a second wake does nothing); wrong modes, pools that are not sleepable and bad
/// devices are errors, never crashes.
#[test]
fn sleep_and_wake_through_the_built_library() -> TestResult {
    let script = format!(
        "{PRELUDE}{}",
        r#"
MIB = 1 << 20
lib.ferrocuda_init(1)
pool = MempoolId(0, 9)
assert lib.ferrocuda_create_sleepable_pool(0, pool) == 0, last_error()
lib.ferrocuda_begin_allocate_to_pool(0, pool, None)
weights = lib.ferrocuda_malloc(24 * MIB, 0, None)
assert weights, last_error()
lib.ferrocuda_end_allocate_to_pool(0, pool)
before = stats()
assert lib.ferrocuda_sleep(0, pool, 2) == 0, last_error()
assert stats()["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
fails(lib.ferrocuda_sleep, 0, pool, 2)
assert "asleep" in last_error(), last_error()
lib.ferrocuda_begin_allocate_to_pool(0, pool, None)
assert fails(lib.ferrocuda_malloc, MIB, 0, None) is None
assert "asleep" in last_error(), last_error()
lib.ferrocuda_end_allocate_to_pool(0, pool)
assert lib.ferrocuda_wake(0, pool) == 0, last_error()
assert lib.ferrocuda_wake(0, pool) == 0, last_error()  # awake already: nothing to do
assert lib.ferrocuda_sleep(0, pool, 0) == 0 and lib.ferrocuda_wake(0, pool) == 0, last_error()
fails(lib.ferrocuda_sleep, 0, pool, 7)
assert "mode 7 is not 0 (discard)" in last_error(), last_error()
fails(lib.ferrocuda_sleep, 0, MempoolId(0, 10), 0)
assert "sleepable" in last_error(), last_error()
fails(lib.ferrocuda_create_sleepable_pool, -1, pool)
lib.ferrocuda_free(weights, 24 * MIB, 0, None)
assert stats()["allocation.all.current"] == 0
print("errors:", lib.ferrocuda_error_count())
"#
    );
    let out = python(&script, &[])?;
    assert!(out.contains("errors: 5"), "{out}");
    Ok(())
}

/// A malformed `FERROCUDA_ALLOC_CONF` is never ignored: every call fails with the parse
/// error, and `alloc` returns null.
#[test]
fn a_malformed_configuration_fails_every_call() -> TestResult {
    let script = format!(
        "{PRELUDE}{}",
        r#"
assert fails(lib.ferrocuda_malloc, 1 << 20, 0, None) is None
print(last_error())
"#
    );
    let out = python(&script, &[("FERROCUDA_ALLOC_CONF", "no_such_key:1")])?;
    assert!(
        out.contains("could not be made") && out.contains("no_such_key"),
        "{out}"
    );
    Ok(())
}

/// A configuration variable set to bytes that are not UTF-8 is never taken for unset (the
/// next variable winning): every call fails with an error naming it.
#[cfg(unix)]
#[test]
fn a_configuration_variable_that_is_not_utf8_fails_every_call() -> TestResult {
    use std::os::unix::ffi::OsStrExt;
    let script = format!(
        "{PRELUDE}{}",
        r#"
assert fails(lib.ferrocuda_malloc, 1 << 20, 0, None) is None
print(last_error())
"#
    );
    let out = python_os(
        &script,
        &[
            (
                "FERROCUDA_ALLOC_CONF",
                OsStr::from_bytes(b"expandable_segments:\xff"),
            ),
            (
                "PYTORCH_CUDA_ALLOC_CONF",
                OsStr::new("expandable_segments:True"),
            ),
        ],
    )?;
    assert!(
        out.contains(
            "environment variable FERROCUDA_ALLOC_CONF is set but its value is not valid UTF-8"
        ),
        "{out}"
    );
    Ok(())
}

/// The configuration comes from `FERROCUDA_ALLOC_CONF`.
#[test]
fn the_configuration_comes_from_the_environment() -> TestResult {
    let script = format!(
        "{PRELUDE}{}",
        r#"
print(text(lib.ferrocuda_allocator_settings))
"#
    );
    let out = python(
        &script,
        &[("FERROCUDA_ALLOC_CONF", "ferrocuda_recommended:True")],
    )?;
    assert!(
        out.contains("FERROCUDA_ALLOC_CONF=ferrocuda_recommended:True")
            && out.contains("expandable_segments:True"),
        "{out}"
    );
    Ok(())
}
