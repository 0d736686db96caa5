//! The store against PyTorch's own `torch.distributed.TCPStore` (GPU bundle: the GPU
//! machine has PyTorch; `#[ignore]`d in CI, where it does not): PyTorch's client does every
//! operation on our server, and our client every operation on PyTorch's server, each side
//! reading what the other wrote.
#![forbid(unsafe_code)]
use ferrocuda_dist::{StoreError, TcpStore, TcpStoreServer};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

type TestResult = Result<(), Box<dyn std::error::Error>>;
const T: Duration = Duration::from_secs(30);

/// PyTorch's client on our server (port in argv[1]): reads what we set, writes its own,
/// and goes through every operation.
const TORCH_CLIENT: &str = r#"
import datetime, sys
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
             timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
assert s.get("from_rust") == b"hello rust", s.get("from_rust")
assert s.add("counter", 5) == 12
s.set("from_torch", b"\x00\xff torch")
assert s.compare_set("cs", "", "x") == b"x"
assert s.compare_set("cs", "x", "y") == b"y"
assert s.compare_set("cs", "nope", "z") == b"y"
assert s.check(["from_rust", "cs"]) and not s.check(["never"])
s.wait(["from_rust"])
try:
    s.wait(["never"], datetime.timedelta(milliseconds=200))
    raise SystemExit("a wait for a key never set returned")
except SystemExit:
    raise
except Exception as e:
    assert "timeout" in str(e).lower(), e
s.append("app", b"a"); s.append("app", b"b")
assert s.get("app") == b"ab"
s.multi_set(["m1", "m2"], [b"1", b"2"])
assert s.multi_get(["m1", "m2"]) == [b"1", b"2"]
n = s.num_keys()
assert s.delete_key("m1") and not s.delete_key("m1")
assert s.num_keys() == n - 1
if hasattr(s, "queue_push"):
    s.queue_push("q", b"v")
    assert s.queue_len("q") == 1
    assert s.queue_pop("q") == b"v"
print("torch client ok", n)
"#;

/// PyTorch's server: prints its port, sets a key, waits for ours, checks what we wrote.
const TORCH_SERVER: &str = r#"
import datetime, sys
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30),
             wait_for_workers=False)
s.set("from_torch", b"hello from torch")
print(s.port, flush=True)
s.wait(["rust_done"])
assert s.get("from_rust") == b"\x01\x02 rust"
assert s.get("counter") == b"7"
assert s.get("app") == b"xy"
assert s.get("cs") == b"new"
assert s.get("m2") == b"two"
assert not s.check(["deleted"])
s.set("torch_done", b"1")
print("torch server ok", flush=True)
"#;

fn python(script: &str, args: &[&str]) -> Command {
    let mut c = Command::new("python3");
    c.arg("-c").arg(script).args(args);
    c
}

#[test]
#[ignore = "needs PyTorch: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn pytorchs_client_on_our_server() -> TestResult {
    let server = TcpStoreServer::bind(0)?;
    let ours = TcpStore::connect("127.0.0.1", server.port(), T)?;
    ours.set("from_rust", b"hello rust")?;
    ours.add("counter", 7)?;
    let out = python(TORCH_CLIENT, &[&server.port().to_string()]).output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "PyTorch's client failed:\n{text}");
    assert!(text.contains("torch client ok"), "{text}");
    assert_eq!(ours.get("from_torch")?, b"\x00\xff torch");
    assert_eq!(ours.get("counter")?, b"12");
    assert_eq!(ours.get("cs")?, b"y");
    assert_eq!(ours.get("app")?, b"ab");
    assert!(!ours.check(&["m1"])?);
    assert_eq!(ours.get("m2")?, b"2");
    println!("{text}");
    Ok(())
}

#[test]
#[ignore = "needs PyTorch: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn our_client_on_pytorchs_server() -> TestResult {
    let mut child = python(TORCH_SERVER, &[])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    let port: u16 = lines
        .next()
        .ok_or("PyTorch's server printed no port")??
        .trim()
        .parse()?;
    let s = TcpStore::connect("127.0.0.1", port, T)?;
    assert_eq!(s.get("from_torch")?, b"hello from torch");
    s.set("from_rust", b"\x01\x02 rust")?;
    assert_eq!(s.add("counter", 3)?, 3);
    assert_eq!(s.add("counter", 4)?, 7);
    assert_eq!(s.compare_set("cs", b"", b"old")?, b"old");
    assert_eq!(s.compare_set("cs", b"old", b"new")?, b"new");
    assert_eq!(s.compare_set("cs", b"zzz", b"other")?, b"new");
    assert_eq!(s.compare_set("missing", b"e", b"d")?, b"e");
    s.append("app", b"x")?;
    s.append("app", b"y")?;
    s.multi_set(&["m1", "m2"], &[b"one", b"two"])?;
    assert_eq!(s.multi_get(&["m1", "m2"])?, [&b"one"[..], b"two"]);
    assert!(s.check(&["from_torch", "m1"])? && !s.check(&["nope"])?);
    s.set("deleted", b"1")?;
    assert!(s.delete_key("deleted")? && !s.delete_key("deleted")?);
    let n = s.num_keys()?;
    assert!(n >= 7, "{n} keys");
    let e = s
        .wait(&["never"], Some(Duration::from_millis(200)))
        .unwrap_err();
    assert!(matches!(e, StoreError::Timeout { .. }), "{e:?}");
    // The wait was cancelled on PyTorch's server: the store goes on.
    s.set("rust_done", b"1")?;
    assert_eq!(s.get("torch_done")?, b"1");
    // PyTorch's server closes the connection on an add to text, as ours does.
    assert!(matches!(
        s.add("from_rust", 1),
        Err(StoreError::Closed { .. })
    ));
    let status = child.wait()?;
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        std::io::Read::read_to_string(&mut e, &mut err)?;
    }
    assert!(status.success(), "PyTorch's server failed: {rest:?}\n{err}");
    assert!(
        rest.iter().any(|l| l.contains("torch server ok")),
        "{rest:?}\n{err}"
    );
    Ok(())
}
