//! The c10d `TCPStore` protocol, server and client, on one machine: every operation through
//! our client and our server; the server's answers to queries written byte by byte as
//! PyTorch's client writes them (`torch/csrc/distributed/c10d/TCPStore.cpp`), so that a
//! mistake shared by our client and server cannot hide; and bad input (a port nobody
//! listens on, a server that never answers, a key never set, a value that is not a number,
//! oversized keys, a port in use) giving typed errors within the timeout.
use ferrocuda_dist::{StoreError, TcpStore, TcpStoreServer};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

type TestResult = Result<(), Box<dyn std::error::Error>>;
const T: Duration = Duration::from_secs(10);

fn pair() -> Result<(TcpStoreServer, TcpStore), StoreError> {
    let server = TcpStoreServer::bind(0)?;
    let client = TcpStore::connect("127.0.0.1", server.port(), T)?;
    Ok((server, client))
}

#[test]
fn every_operation_round_trips() -> TestResult {
    let (server, s) = pair()?;
    s.set("a", b"one")?;
    assert_eq!(s.get("a")?, b"one");
    assert_eq!(s.add("n", 5)?, 5);
    assert_eq!(s.add("n", -2)?, 3);
    assert_eq!(s.get("n")?, b"3", "add stores decimal text");
    assert!(s.check(&["a", "n"])?);
    assert!(!s.check(&["a", "missing"])?);
    s.wait(&["a", "n"], None)?;
    // compare_set: equal → swapped; unequal → the value now; missing with empty expected
    // → set; missing with non-empty expected → expected back, nothing set.
    assert_eq!(s.compare_set("a", b"one", b"two")?, b"two");
    assert_eq!(s.compare_set("a", b"one", b"three")?, b"two");
    assert_eq!(s.compare_set("fresh", b"", b"x")?, b"x");
    assert_eq!(s.compare_set("ghost", b"y", b"z")?, b"y");
    assert!(!s.check(&["ghost"])?);
    s.append("log", b"ab")?;
    s.append("log", b"cd")?;
    assert_eq!(s.get("log")?, b"abcd");
    s.multi_set(&["m1", "m2"], &[b"1", b""])?;
    assert_eq!(s.multi_get(&["m1", "m2", "a"])?, [&b"1"[..], b"", b"two"]);
    // a, n, fresh, log, m1, m2.
    assert_eq!(s.num_keys()?, 6);
    assert_eq!(server.num_keys(), 6);
    assert!(s.delete_key("a")?);
    assert!(!s.delete_key("a")?);
    assert_eq!(s.num_keys()?, 5);
    Ok(())
}

#[test]
fn a_get_waits_for_another_clients_set() -> TestResult {
    let (server, s) = pair()?;
    let port = server.port();
    let setter = std::thread::spawn(move || -> Result<(), StoreError> {
        let other = TcpStore::connect("127.0.0.1", port, T)?;
        std::thread::sleep(Duration::from_millis(100));
        other.set("late", b"here")
    });
    assert_eq!(s.get("late")?, b"here");
    setter.join().map_err(|_| "setter panicked")??;
    // Many waiters on one key, woken by one set.
    let waiters: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || -> Result<Vec<u8>, StoreError> {
                TcpStore::connect("127.0.0.1", port, T)?.get("shared")
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    s.set("shared", b"v")?;
    for w in waiters {
        assert_eq!(w.join().map_err(|_| "waiter panicked")??, b"v");
    }
    Ok(())
}

#[test]
fn a_wait_past_its_timeout_is_an_error_and_the_store_goes_on() -> TestResult {
    let (_server, s) = pair()?;
    s.set("here", b"1")?;
    let t0 = Instant::now();
    let e = s
        .wait(&["here", "never"], Some(Duration::from_millis(200)))
        .unwrap_err();
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    assert!(
        matches!(e, StoreError::Timeout { what: "wait", .. }),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "wait timeout after 200ms, keys: /here, /never"
    );
    // The wait was cancelled on the server: setting the key later sends nothing stray, and
    // the next calls read their own answers.
    s.set("never", b"now")?;
    assert_eq!(s.get("here")?, b"1");
    assert_eq!(s.add("k", 1)?, 1);
    Ok(())
}

#[test]
fn no_server_and_a_silent_server_fail_within_the_timeout() -> TestResult {
    // A port nobody listens on: take a free one and close it.
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let t0 = Instant::now();
    let e = TcpStore::connect("127.0.0.1", port, Duration::from_millis(300)).unwrap_err();
    assert!(matches!(e, StoreError::Connect { .. }), "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    // A server that accepts and never answers: the ping times out.
    let silent = TcpListener::bind("127.0.0.1:0")?;
    let port = silent.local_addr()?.port();
    let keep = std::thread::spawn(move || silent.accept().map(|(s, _)| s));
    let t0 = Instant::now();
    let e = TcpStore::connect("127.0.0.1", port, Duration::from_millis(300)).unwrap_err();
    assert!(
        matches!(e, StoreError::Timeout { what: "ping", .. }),
        "{e:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(3));
    drop(keep.join());
    Ok(())
}

#[test]
fn bad_values_and_sizes_are_typed_errors() -> TestResult {
    let (server, s) = pair()?;
    // A port in use.
    assert!(matches!(
        TcpStoreServer::bind(server.port()),
        Err(StoreError::Bind { .. })
    ));
    // Oversized keys and values are refused before sending: the store goes on.
    let long = "k".repeat(9000);
    assert!(matches!(
        s.set(&long, b""),
        Err(StoreError::TooLarge { what: "key", .. })
    ));
    let big = vec![0u8; 8 * 1024 * 1024 + 1];
    assert!(matches!(
        s.set("k", &big),
        Err(StoreError::TooLarge { what: "value", .. })
    ));
    assert!(matches!(
        s.multi_set(&["a"], &[]),
        Err(StoreError::Protocol(_))
    ));
    s.set("text", b"not a number")?;
    // PyTorch's server closes the connection on an add to text; so does ours.
    assert!(matches!(s.add("text", 1), Err(StoreError::Closed { .. })));
    assert!(matches!(s.get("text"), Err(StoreError::Broken(_))));
    // Other clients are not affected.
    let other = TcpStore::connect("127.0.0.1", server.port(), T)?;
    assert_eq!(other.get("text")?, b"not a number");
    Ok(())
}

#[test]
fn the_store_that_serves_waits_for_its_workers() -> TestResult {
    let t0 = Instant::now();
    let e = TcpStore::serve(0, Some(2), Duration::from_millis(300)).unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::WorkersTimeout {
                joined: 1,
                world_size: 2,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(3));
    // With the other worker counting itself in, it returns.
    let free = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let worker = std::thread::spawn(move || -> Result<(), StoreError> {
        TcpStore::connect("127.0.0.1", free, T)?.wait_for_workers(2)
    });
    let master = TcpStore::serve(free, Some(2), T)?;
    worker.join().map_err(|_| "worker panicked")??;
    assert_eq!(master.server_port(), Some(free));
    assert_eq!(master.num_keys()?, 1, "init/ alone");
    Ok(())
}

/// A raw connection that writes queries as PyTorch's client writes them.
struct Raw(TcpStream);

impl Raw {
    fn open(port: u16) -> Result<Raw, Box<dyn std::error::Error>> {
        let s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(T))?;
        Ok(Raw(s))
    }
    fn send(&mut self, parts: &[&[u8]]) -> std::io::Result<()> {
        self.0.write_all(&parts.concat())
    }
    fn read(&mut self, n: usize) -> std::io::Result<Vec<u8>> {
        let mut b = vec![0; n];
        self.0.read_exact(&mut b)?;
        Ok(b)
    }
}

fn s(bytes: &[u8]) -> Vec<u8> {
    [&(bytes.len() as u64).to_le_bytes()[..], bytes].concat()
}

#[test]
fn the_server_answers_pytorchs_bytes() -> TestResult {
    let server = TcpStoreServer::bind(0)?;
    let mut c = Raw::open(server.port())?;
    // VALIDATE 0x3C85F7CE, then PING with a nonce that comes back.
    c.send(&[&[0], &0x3C85_F7CEu32.to_le_bytes()])?;
    c.send(&[&[13], &77u32.to_le_bytes()])?;
    assert_eq!(c.read(4)?, 77u32.to_le_bytes());
    // SET "/k" = "vv" (no answer), GET "/k" → u64 length + bytes.
    c.send(&[&[1], &s(b"/k"), &s(b"vv")])?;
    c.send(&[&[3], &s(b"/k")])?;
    assert_eq!(c.read(10)?, s(b"vv"));
    // ADD "/n" 7 → i64 7; ADD -10 → -3.
    c.send(&[&[4], &s(b"/n"), &7i64.to_le_bytes()])?;
    assert_eq!(c.read(8)?, 7i64.to_le_bytes());
    c.send(&[&[4], &s(b"/n"), &(-10i64).to_le_bytes()])?;
    assert_eq!(c.read(8)?, (-3i64).to_le_bytes());
    // CHECK 2 keys → READY (0) / NOT_READY (1).
    c.send(&[&[5], &2u64.to_le_bytes(), &s(b"/k"), &s(b"/n")])?;
    assert_eq!(c.read(1)?, [0]);
    c.send(&[&[5], &1u64.to_le_bytes(), &s(b"/x")])?;
    assert_eq!(c.read(1)?, [1]);
    // WAIT for a set key → STOP_WAITING (0) at once; for a missing key, nothing until
    // CANCEL_WAIT (12) → WAIT_CANCELED (1).
    c.send(&[&[6], &1u64.to_le_bytes(), &s(b"/k")])?;
    assert_eq!(c.read(1)?, [0]);
    c.send(&[&[6], &1u64.to_le_bytes(), &s(b"/x")])?;
    c.send(&[&[12]])?;
    assert_eq!(c.read(1)?, [1]);
    // WAIT answered by another client's SET.
    c.send(&[&[6], &1u64.to_le_bytes(), &s(b"/y")])?;
    let mut other = Raw::open(server.port())?;
    other.send(&[
        &[0],
        &0x3C85_F7CEu32.to_le_bytes(),
        &[1],
        &s(b"/y"),
        &s(b"1"),
    ])?;
    assert_eq!(c.read(1)?, [0]);
    // GETNUMKEYS → i64; DELETE_KEY → i64 count.
    c.send(&[&[7]])?;
    assert_eq!(c.read(8)?, 3i64.to_le_bytes());
    c.send(&[&[8], &s(b"/k")])?;
    assert_eq!(c.read(8)?, 1i64.to_le_bytes());
    // COMPARE_SET → the value now.
    c.send(&[&[2], &s(b"/n"), &s(b"-3"), &s(b"4")])?;
    assert_eq!(c.read(9)?, s(b"4"));
    // APPEND, MULTI_SET (i64 count), MULTI_GET (one vector per key).
    c.send(&[&[9], &s(b"/n"), &s(b"2")])?;
    c.send(&[&[11], &1i64.to_le_bytes(), &s(b"/m"), &s(b"z")])?;
    c.send(&[&[10], &2u64.to_le_bytes(), &s(b"/n"), &s(b"/m")])?;
    assert_eq!(c.read(19)?, [s(b"42"), s(b"z")].concat());
    // QUEUE_PUSH, QUEUE_LEN, QUEUE_POP (length before the pop, then the value).
    c.send(&[&[14], &s(b"q"), &s(b"a")])?;
    c.send(&[&[16], &s(b"q")])?;
    assert_eq!(c.read(8)?, 1i64.to_le_bytes());
    c.send(&[&[15], &s(b"q")])?;
    assert_eq!(c.read(17)?, [&1i64.to_le_bytes()[..], &s(b"a")].concat());
    c.send(&[&[15], &s(b"q")])?;
    assert_eq!(c.read(8)?, 0i64.to_le_bytes());
    Ok(())
}

#[test]
fn a_client_that_does_not_validate_is_closed() -> TestResult {
    let server = TcpStoreServer::bind(0)?;
    let mut c = Raw::open(server.port())?;
    c.send(&[&[13], &1u32.to_le_bytes()])?;
    let mut b = [0u8; 1];
    assert_eq!(c.0.read(&mut b)?, 0, "closed without an answer");
    let mut c = Raw::open(server.port())?;
    c.send(&[&[0], &1u32.to_le_bytes()])?;
    assert_eq!(c.0.read(&mut b)?, 0, "a wrong magic number closes too");
    // A key longer than the server's limit closes the connection (PyTorch's check).
    let mut c = Raw::open(server.port())?;
    c.send(&[
        &[0],
        &0x3C85_F7CEu32.to_le_bytes(),
        &[3],
        &(9000u64).to_le_bytes(),
    ])?;
    assert_eq!(c.0.read(&mut b)?, 0);
    Ok(())
}
