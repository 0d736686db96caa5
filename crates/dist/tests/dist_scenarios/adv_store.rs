//! Adversarial checks of the store, the rendezvous and the watchdog, written from their
//! contracts and PyTorch's behaviour: a model-checked random run of every store operation,
//! races between waits, cancels and sets, many clients at once, limits at their edges,
//! servers that stall, close or go away; several ranks as threads meeting at a store and
//! checking every collective against NCCL's definitions; watchdog timing and teardown.
use ferrocuda_dist::{
    DistEnv, DistError, FakeGroup, ProcessGroup, ReduceOp, StoreError, TcpStore, TcpStoreServer,
    rendezvous,
};
use ferrocuda_driver::FakeDriver;
use ferrocuda_driver::fake::Completion;
use ferrocuda_stream::{DeviceBuffer, Runtime};
use ferrocuda_types::{DeviceIndex, Element};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

type TestResult = Result<(), Box<dyn std::error::Error>>;
const T: Duration = Duration::from_secs(10);
const SHORT: Duration = Duration::from_millis(300);
const BOUND: Duration = Duration::from_secs(10);

/// splitmix64: seeded, reproducible.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max + 1);
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn pair(timeout: Duration) -> Result<(TcpStoreServer, TcpStore), StoreError> {
    let server = TcpStoreServer::bind(0)?;
    let client = TcpStore::connect("127.0.0.1", server.port(), timeout)?;
    Ok((server, client))
}

fn closed_or_broken(e: &StoreError) -> bool {
    matches!(e, StoreError::Closed { .. } | StoreError::Broken(_))
}

/// Runs `f` on a thread and gives its result, or `None` if it has not returned in `within`
/// (a hang).
fn bounded<R: Send + 'static>(
    within: Duration,
    f: impl FnOnce() -> R + Send + 'static,
) -> Option<R> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || drop(tx.send(f())));
    rx.recv_timeout(within).ok()
}

#[test]
fn adv_store_random_ops_match_a_model() -> TestResult {
    let (server, a) = pair(T)?;
    let b = TcpStore::connect("127.0.0.1", server.port(), T)?;
    let mut rng = Rng(0x5EED_0001);
    let mut model: HashMap<String, Vec<u8>> = HashMap::new();
    let bytes_keys: Vec<String> = (0..6).map(|i| format!("b/{i}")).collect();
    let num_keys: Vec<String> = (0..3).map(|i| format!("n{i}")).collect();
    for step in 0..600 {
        let s = if rng.below(2) == 0 { &a } else { &b };
        let k = bytes_keys[rng.below(6) as usize].clone();
        let ctx = format!("step {step} key {k}");
        match rng.below(10) {
            0 => {
                let v = rng.bytes(40);
                s.set(&k, &v)?;
                s.num_keys()?; // no answer: a round trip orders it
                model.insert(k, v);
            }
            1 => {
                if let Some(v) = model.get(&k) {
                    assert_eq!(&s.get(&k)?, v, "{ctx}");
                } else {
                    assert!(!s.check(&[&k])?, "{ctx}");
                }
            }
            2 => {
                let n = &num_keys[rng.below(3) as usize];
                let d = rng.below(2001) as i64 - 1000;
                let now = model.get(n).map_or(0, |v| {
                    std::str::from_utf8(v).unwrap().parse::<i64>().unwrap()
                }) + d;
                assert_eq!(s.add(n, d)?, now, "{ctx} add {d}");
                model.insert(n.clone(), now.to_string().into_bytes());
            }
            3 => {
                let v = rng.bytes(10);
                s.append(&k, &v)?;
                s.num_keys()?;
                model.entry(k).or_default().extend_from_slice(&v);
            }
            4 => {
                // Expected: the current value, empty, or something else, at random.
                let cur = model.get(&k).cloned();
                let expected = match rng.below(3) {
                    0 => cur.clone().unwrap_or_default(),
                    1 => Vec::new(),
                    _ => rng.bytes(3),
                };
                let desired = rng.bytes(8);
                let want = match &cur {
                    None if expected.is_empty() => {
                        model.insert(k.clone(), desired.clone());
                        desired.clone()
                    }
                    None => expected.clone(),
                    Some(c) if *c == expected => {
                        model.insert(k.clone(), desired.clone());
                        desired.clone()
                    }
                    Some(c) => c.clone(),
                };
                assert_eq!(
                    s.compare_set(&k, &expected, &desired)?,
                    want,
                    "{ctx} cas {cur:?} {expected:?}"
                );
            }
            5 => assert_eq!(s.delete_key(&k)?, model.remove(&k).is_some(), "{ctx}"),
            6 => assert_eq!(s.num_keys()?, model.len() as i64, "{ctx}"),
            7 => {
                let ks: Vec<&str> = bytes_keys
                    .iter()
                    .filter(|_| rng.below(2) == 0)
                    .map(String::as_str)
                    .collect();
                let all = ks.iter().all(|k| model.contains_key(*k));
                assert_eq!(s.check(&ks)?, all, "{ctx} check {ks:?}");
                if all {
                    let got = s.multi_get(&ks)?;
                    let want: Vec<Vec<u8>> = ks.iter().map(|k| model[*k].clone()).collect();
                    assert_eq!(got, want, "{ctx}");
                    s.wait(&ks, Some(SHORT))?;
                }
            }
            _ => {
                let n = rng.below(4) as usize;
                let ks: Vec<&str> = (0..n)
                    .map(|_| bytes_keys[rng.below(6) as usize].as_str())
                    .collect();
                let vs: Vec<Vec<u8>> = (0..n).map(|_| rng.bytes(12)).collect();
                let refs: Vec<&[u8]> = vs.iter().map(Vec::as_slice).collect();
                s.multi_set(&ks, &refs)?;
                s.num_keys()?;
                for (k, v) in ks.iter().zip(vs) {
                    model.insert(k.to_string(), v);
                }
            }
        }
    }
    // Set, append and multi_set have no answer: a round trip on each client orders them.
    a.num_keys()?;
    b.num_keys()?;
    assert_eq!(server.num_keys(), model.len());
    Ok(())
}

#[test]
fn adv_store_concurrent_adds_and_appends_are_atomic() -> TestResult {
    let (server, _s) = pair(T)?;
    let port = server.port();
    let (n, k) = (8usize, 150usize);
    let results: Vec<Result<Vec<i64>, StoreError>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|t| {
                sc.spawn(move || -> Result<Vec<i64>, StoreError> {
                    let c = TcpStore::connect("127.0.0.1", port, T)?;
                    let mut seen = Vec::new();
                    for _ in 0..k {
                        seen.push(c.add("ctr", 1)?);
                        c.append("log", &[t as u8])?;
                    }
                    Ok(seen)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut all = Vec::new();
    for r in results {
        let seen = r?;
        assert!(
            seen.windows(2).all(|w| w[0] < w[1]),
            "one client's adds increase"
        );
        all.extend(seen);
    }
    all.sort_unstable();
    assert_eq!(
        all,
        (1..=(n * k) as i64).collect::<Vec<_>>(),
        "every add saw a distinct sum"
    );
    let c = TcpStore::connect("127.0.0.1", port, T)?;
    assert_eq!(c.get("ctr")?, (n * k).to_string().into_bytes());
    let log = c.get("log")?;
    assert_eq!(log.len(), n * k);
    for t in 0..n as u8 {
        assert_eq!(log.iter().filter(|b| **b == t).count(), k);
    }
    Ok(())
}

#[test]
fn adv_store_add_parses_as_stoll_and_creates_from_zero() -> TestResult {
    let (server, s) = pair(T)?;
    assert_eq!(s.add("z", 0)?, 0);
    assert_eq!(s.get("z")?, b"0", "add 0 on a missing key stores 0");
    s.set("neg", b"-41")?;
    assert_eq!(s.add("neg", -1)?, -42);
    assert_eq!(s.get("neg")?, b"-42");
    s.set("ws", b"  +7xyz")?;
    assert_eq!(
        s.add("ws", 3)?,
        10,
        "std::stoll skips blanks, takes a sign, stops at junk"
    );
    assert_eq!(s.get("ws")?, b"10");
    for bad in [&b""[..], b"abc", b"-", b"99999999999999999999"] {
        let c = TcpStore::connect("127.0.0.1", server.port(), T)?;
        c.set("bad", bad)?;
        let e = c.add("bad", 1).unwrap_err();
        assert!(matches!(e, StoreError::Closed { .. }), "{bad:?}: {e:?}");
        assert!(matches!(c.num_keys(), Err(StoreError::Broken(_))));
        assert_eq!(s.get("bad")?, bad, "the value is left alone");
    }
    Ok(())
}

#[test]
fn adv_store_compare_set_on_present_empty_values() -> TestResult {
    let (_server, s) = pair(T)?;
    s.set("e", b"")?;
    assert_eq!(
        s.compare_set("e", b"", b"full")?,
        b"full",
        "present and equal to empty: swapped"
    );
    assert_eq!(
        s.compare_set("e", b"", b"again")?,
        b"full",
        "present, unequal: current"
    );
    assert_eq!(s.compare_set("e", b"full", b"")?, b"", "swapped to empty");
    assert!(s.check(&["e"])?, "a key set to empty is still there");
    assert_eq!(s.compare_set("m", b"x", b"")?, b"x");
    assert!(!s.check(&["m"])?);
    Ok(())
}

#[test]
fn adv_store_limits_at_their_edges() -> TestResult {
    let (_server, s) = pair(T)?;
    // A key of 8 KiB less the prefix fits on the wire.
    let k = "k".repeat(8191);
    s.set(&k, b"v")?;
    assert_eq!(s.get(&k)?, b"v");
    // 8 KiB exactly: either refused before sending or accepted; never a broken store.
    let k8 = "q".repeat(8192);
    match s.set(&k8, b"v") {
        Ok(()) | Err(StoreError::TooLarge { .. }) => {}
        Err(e) => panic!("8 KiB key: {e:?}"),
    }
    assert_eq!(s.add("alive", 1)?, 1, "the store survives an 8 KiB key");
    let big = "x".repeat(8193);
    for r in [
        s.check(&[&big]).map(drop),
        s.wait(&[&big], None),
        s.multi_get(&["a", &big]).map(drop),
        s.append(&big, b""),
    ] {
        assert!(
            matches!(r, Err(StoreError::TooLarge { what: "key", .. })),
            "{r:?}"
        );
    }
    // A value of 8 MiB exactly round-trips; one byte more is refused everywhere.
    let mut rng = Rng(7);
    let v: Vec<u8> = (0..8 << 20).map(|_| rng.next() as u8).collect();
    s.set("big", &v)?;
    assert!(s.get("big")? == v, "8 MiB value round-trips");
    let over = vec![1u8; (8 << 20) + 1];
    for r in [
        s.append("a", &over),
        s.multi_set(&["a"], &[&over]),
        s.compare_set("a", b"", &over).map(drop),
        s.compare_set("a", &over, b"").map(drop),
    ] {
        assert!(
            matches!(r, Err(StoreError::TooLarge { what: "value", .. })),
            "{r:?}"
        );
    }
    // 131072 keys per query, not one more.
    let names: Vec<String> = (0..131_073).map(|i| format!("{i}")).collect();
    let keys: Vec<&str> = names.iter().map(String::as_str).collect();
    let vals: Vec<&[u8]> = vec![b"1"; 131_073];
    for r in [
        s.check(&keys).map(drop),
        s.wait(&keys, None),
        s.multi_get(&keys).map(drop),
        s.multi_set(&keys, &vals),
    ] {
        assert!(matches!(r, Err(StoreError::TooLarge { .. })), "{r:?}");
    }
    s.multi_set(&keys[..131_072], &vals[..131_072])?;
    assert!(s.check(&keys[..131_072])?);
    assert_eq!(s.multi_get(&keys[..131_072])?.len(), 131_072);
    assert_eq!(s.add("alive", 1)?, 2);
    Ok(())
}

#[test]
fn adv_store_timed_out_waits_never_confuse_later_answers() -> TestResult {
    let (server, s) = pair(T)?;
    let setter = TcpStore::connect("127.0.0.1", server.port(), T)?;
    let mut rng = Rng(0xC0FFEE);
    for i in 0..60u64 {
        let key = format!("race{i}");
        let delay = Duration::from_millis(rng.below(40));
        let h = {
            let (key, port) = (key.clone(), server.port());
            std::thread::spawn(move || -> Result<(), StoreError> {
                let c = TcpStore::connect("127.0.0.1", port, T)?;
                std::thread::sleep(delay);
                c.set(&key, b"1")
            })
        };
        match s.wait(&[&key], Some(Duration::from_millis(20))) {
            Ok(()) | Err(StoreError::Timeout { .. }) => {}
            Err(e) => panic!("iteration {i}: {e:?}"),
        }
        h.join().map_err(|_| "setter panicked")??;
        // Whatever crossed, the next answers are this call's own.
        assert_eq!(s.add("seq", 1)?, i as i64 + 1, "iteration {i}");
        setter.set("echo", &i.to_le_bytes())?;
        setter.check(&["echo"])?; // a set has no answer: order it before the get
        assert_eq!(s.get("echo")?, i.to_le_bytes(), "iteration {i}");
        let e = s
            .wait(&["never"], Some(Duration::from_millis(5)))
            .unwrap_err();
        assert!(
            matches!(e, StoreError::Timeout { .. }),
            "iteration {i}: {e:?}"
        );
    }
    // A get of a key never set is a timeout naming it, and the store goes on (as PyTorch's).
    let (_server2, s2) = pair(SHORT)?;
    let t0 = Instant::now();
    let e = s2.get("nokey").unwrap_err();
    assert!(t0.elapsed() < BOUND);
    assert!(
        matches!(&e, StoreError::Timeout { keys, .. } if keys == &["/nokey".to_string()]),
        "{e:?}"
    );
    assert!(matches!(
        s2.multi_get(&["nokey"]),
        Err(StoreError::Timeout { .. })
    ));
    s2.set("nokey", b"ok")?;
    assert_eq!(s2.get("nokey")?, b"ok", "usable after a get timed out");
    Ok(())
}

#[test]
fn adv_store_waiters_wake_exactly_when_all_their_keys_are_set() -> TestResult {
    let (server, s) = pair(T)?;
    let port = server.port();
    let spawn_wait = |keys: &'static [&'static str]| {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let r = TcpStore::connect("127.0.0.1", port, T).and_then(|c| c.wait(keys, None));
            drop(tx.send(r));
        });
        rx
    };
    let ab = spawn_wait(&["a", "b"]);
    let dup = spawn_wait(&["d", "d"]);
    let ms = spawn_wait(&["x", "y", "z"]);
    let get = {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            drop(tx.send(TcpStore::connect("127.0.0.1", port, T).and_then(|c| c.get("ap"))))
        });
        rx
    };
    // Raw waiters that disconnect mid-wait must not disturb anyone.
    for _ in 0..4 {
        let mut raw = std::net::TcpStream::connect(("127.0.0.1", port))?;
        let key = b"/a";
        let mut q = vec![0u8];
        q.extend_from_slice(&0x3C85_F7CEu32.to_le_bytes());
        q.push(6);
        q.extend_from_slice(&1u64.to_le_bytes());
        q.extend_from_slice(&(key.len() as u64).to_le_bytes());
        q.extend_from_slice(key);
        raw.write_all(&q)?;
    }
    std::thread::sleep(Duration::from_millis(150));
    s.set("a", b"1")?;
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        ab.try_recv().is_err(),
        "a wait for a and b returned after a alone"
    );
    s.add("b", 5)?;
    ab.recv_timeout(BOUND)??;
    s.append("d", b"q")?;
    dup.recv_timeout(BOUND)??;
    s.multi_set(&["x", "y", "z"], &[b"1", b"2", b"3"])?;
    ms.recv_timeout(BOUND)??;
    s.append("ap", b"tail")?;
    assert_eq!(get.recv_timeout(BOUND)??, b"tail");
    assert_eq!(s.num_keys()?, 7, "a b d x y z ap");
    Ok(())
}

/// A server that validates and answers the ping, then does `then` with the connection.
fn fake_server(then: fn(std::net::TcpStream)) -> Result<u16, std::io::Error> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let port = l.local_addr()?.port();
    std::thread::spawn(move || {
        if let Ok((mut c, _)) = l.accept() {
            let mut b = [0u8; 10];
            if c.read_exact(&mut b).is_ok() && c.write_all(&b[6..10]).is_ok() {
                then(c);
            }
        }
    });
    Ok(port)
}

#[test]
fn adv_store_misbehaving_servers_fail_within_the_timeout() -> TestResult {
    // Silent after the ping: every answered call times out, then the store is broken.
    let silent = |mut c: std::net::TcpStream| {
        let mut sink = [0u8; 4096];
        while matches!(c.read(&mut sink), Ok(n) if n > 0) {}
    };
    for op in 0..4 {
        let port = fake_server(silent)?;
        let r = bounded(BOUND, move || -> Result<StoreError, StoreError> {
            let s = TcpStore::connect("127.0.0.1", port, SHORT)?;
            let e = match op {
                0 => s.add("k", 1).map(drop),
                1 => s.wait(&["k"], Some(Duration::from_millis(100))),
                2 => s.get("k").map(drop),
                _ => s.num_keys().map(drop),
            };
            assert!(
                s.check(&["k"]).is_err(),
                "op {op}: a call after a stalled one"
            );
            Ok(e.unwrap_err())
        });
        let e = r.ok_or(format!("op {op} hung on a silent server"))??;
        assert!(matches!(e, StoreError::Timeout { .. }), "op {op}: {e:?}");
    }
    // Closed after the ping: Closed, then Broken.
    let port = fake_server(drop)?;
    let s = TcpStore::connect("127.0.0.1", port, SHORT)?;
    let e = s.add("k", 1).unwrap_err();
    assert!(matches!(e, StoreError::Closed { .. }), "{e:?}");
    assert!(matches!(s.add("k", 1), Err(StoreError::Broken(_))));
    // Half an answer, then silence.
    let port = fake_server(|mut c| {
        let mut b = [0u8; 64];
        if c.read(&mut b).is_ok() && c.write_all(&[5, 0, 0]).is_ok() {
            std::thread::sleep(Duration::from_secs(5));
        }
    })?;
    let s = TcpStore::connect("127.0.0.1", port, SHORT)?;
    let t0 = Instant::now();
    assert!(matches!(s.add("k", 1), Err(StoreError::Timeout { .. })));
    assert!(t0.elapsed() < Duration::from_secs(4));
    assert!(matches!(s.add("k", 1), Err(StoreError::Broken(_))));
    Ok(())
}

#[test]
fn adv_store_dropping_the_server_ends_every_call() -> TestResult {
    let (server, idle) = pair(Duration::from_secs(60))?;
    let port = server.port();
    let waiters: Vec<_> = (0..4)
        .map(|i| {
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let r =
                    TcpStore::connect("127.0.0.1", port, Duration::from_secs(60)).and_then(|c| {
                        if i % 2 == 0 {
                            c.get("never").map(drop)
                        } else {
                            c.wait(&["never"], None)
                        }
                    });
                drop(tx.send(r));
            });
            rx
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    bounded(BOUND, move || drop(server)).ok_or("dropping the server hung")?;
    for w in waiters {
        let e = w
            .recv_timeout(BOUND)
            .map_err(|_| "a waiter hung")?
            .unwrap_err();
        assert!(closed_or_broken(&e), "{e:?}");
    }
    let e = idle.add("k", 1).unwrap_err();
    assert!(closed_or_broken(&e), "idle client: {e:?}");
    assert!(t0.elapsed() < BOUND);
    Ok(())
}

type R<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn free_port() -> R<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn dist_env(rank: usize, world: usize, port: u16, agent: bool, restart: u64) -> R<DistEnv> {
    let mut vars: HashMap<&str, String> = HashMap::new();
    for (k, v) in [("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank)] {
        vars.insert(k, v.to_string());
    }
    vars.insert("LOCAL_WORLD_SIZE", world.to_string());
    vars.insert("MASTER_ADDR", "127.0.0.1".into());
    vars.insert("MASTER_PORT", port.to_string());
    vars.insert("TORCHELASTIC_RESTART_COUNT", restart.to_string());
    if agent {
        vars.insert("TORCHELASTIC_USE_AGENT_STORE", "True".into());
    }
    Ok(DistEnv::from_vars(|k| vars.get(k).cloned())?)
}

fn fake_runtime(devices: usize) -> Arc<Runtime> {
    Runtime::new(Arc::new(FakeDriver::builder().devices(devices).build()))
}

/// A value the tests can build from small integers and compare exactly.
trait Num: Element + Copy + PartialEq + std::fmt::Debug {
    const FLOAT: bool;
    fn of(v: f64) -> Self;
}
macro_rules! num {
    ($($t:ty => $f:expr),*) => {$(impl Num for $t {
        const FLOAT: bool = $f;
        fn of(v: f64) -> Self { v as $t }
    })*};
}
num!(f32 => true, f64 => true, i32 => false, i64 => false);

/// Rank `r`'s input of step `step`: small integers from the seed, the same on every rank.
fn input(seed: u64, step: u64, r: usize, len: usize) -> Vec<f64> {
    let mut rng = Rng(seed ^ (step << 20) ^ (r as u64) << 8);
    (0..len).map(|_| rng.below(9) as f64 - 4.0).collect()
}

/// One round of every collective in `T`, checked against NCCL's definitions.
fn round<T: Num>(g: &ProcessGroup, rt: &Arc<Runtime>, seed: u64, step: u64, len: usize) -> R {
    let (r, n, dev) = (g.rank(), g.size(), g.device());
    let buf = |v: &[f64]| {
        DeviceBuffer::from_slice(rt, dev, &v.iter().map(|x| T::of(*x)).collect::<Vec<_>>())
    };
    let host = |v: &[f64]| v.iter().map(|x| T::of(*x)).collect::<Vec<T>>();
    let all: Vec<Vec<f64>> = (0..n).map(|q| input(seed, step, q, len)).collect();
    let fold = |f: fn(f64, f64) -> f64| -> Vec<f64> {
        (0..len)
            .map(|i| all.iter().skip(1).fold(all[0][i], |a, v| f(a, v[i])))
            .collect()
    };
    let ctx = format!(
        "rank {r} step {step} len {len} {:?}",
        std::any::type_name::<T>()
    );
    let mut ops = vec![
        (ReduceOp::Sum, fold(|a, b| a + b)),
        (ReduceOp::Product, fold(|a, b| a * b)),
        (ReduceOp::Max, fold(f64::max)),
        (ReduceOp::Min, fold(f64::min)),
    ];
    if T::FLOAT {
        ops.push((
            ReduceOp::Avg,
            fold(|a, b| a + b).iter().map(|s| s / n as f64).collect(),
        ));
    }
    for (op, want) in ops {
        let x = buf(&all[r])?;
        let w = g.all_reduce(&x, op)?;
        if step.is_multiple_of(2) {
            w.wait()?
        } else {
            w.synchronize()?
        }
        assert_eq!(x.to_host()?, host(&want), "{ctx} all_reduce {op:?}");
    }
    let root = (step as usize) % n;
    let x = buf(&all[r])?;
    g.broadcast(&x, root)?.wait()?;
    assert_eq!(
        x.to_host()?,
        host(&all[root]),
        "{ctx} broadcast from {root}"
    );
    let out = buf(&vec![99.0; len * n])?;
    g.all_gather(&out, &buf(&all[r])?)?.wait()?;
    assert_eq!(out.to_host()?, host(&all.concat()), "{ctx} all_gather");
    // reduce_scatter: rank q's input is n blocks of len; block r of the sum lands on r.
    let big: Vec<Vec<f64>> = (0..n)
        .map(|q| input(seed, step + 1000, q, len * n))
        .collect();
    let out = buf(&vec![99.0; len])?;
    g.reduce_scatter(&out, &buf(&big[r])?, ReduceOp::Sum)?
        .wait()?;
    let want: Vec<f64> = (0..len)
        .map(|i| big.iter().map(|v| v[r * len + i]).sum())
        .collect();
    assert_eq!(out.to_host()?, host(&want), "{ctx} reduce_scatter");
    // A ring: even ranks send first, odd ranks receive first.
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let (x, got) = (buf(&all[r])?, buf(&vec![99.0; len])?);
    if r.is_multiple_of(2) {
        g.send(&x, next)?.wait()?;
        g.recv(&got, prev)?.wait()?;
    } else {
        g.recv(&got, prev)?.wait()?;
        g.send(&x, next)?.wait()?;
    }
    assert_eq!(got.to_host()?, host(&all[prev]), "{ctx} recv from {prev}");
    Ok(())
}

fn rounds(g: &ProcessGroup, rt: &Arc<Runtime>, seed: u64, steps: u64) -> R {
    let mut rng = Rng(seed);
    for step in 0..steps {
        let len = if step == 0 {
            0
        } else {
            rng.below(24) as usize + 1
        };
        match step % 4 {
            0 => round::<f32>(g, rt, seed, step, len)?,
            1 => round::<f64>(g, rt, seed, step, len)?,
            2 => round::<i32>(g, rt, seed, step, len)?,
            _ => round::<i64>(g, rt, seed, step, len)?,
        }
    }
    Ok(())
}

#[test]
fn adv_rdzv_rank0_store_ranks_agree_on_every_collective() {
    let (n, port) = (4, free_port().unwrap());
    std::thread::scope(|sc| {
        for r in 0..n {
            sc.spawn(move || {
                let rt = fake_runtime(n);
                let g = ProcessGroup::from_dist_env(
                    rt.clone(),
                    &dist_env(r, n, port, false, 0).unwrap(),
                    T,
                )
                .unwrap();
                assert_eq!(
                    (g.rank(), g.size(), g.device()),
                    (r, n, DeviceIndex(r as u16))
                );
                rounds(&g, &rt, 0xAB, 6).unwrap();
                // The job's store stays with the group (PyTorch's default store): the ranks
                // meet through it after their collectives.
                let store = g.store().expect("the group keeps the job's store");
                store.set(&format!("after/{r}"), b"done").unwrap();
                let keys: Vec<String> = (0..n).map(|i| format!("after/{i}")).collect();
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                store.wait(&keys, Some(T)).unwrap();
            });
        }
    });
}

#[test]
fn adv_rdzv_two_attempts_at_once_on_an_agent_store() -> TestResult {
    let server = TcpStoreServer::bind(0)?;
    let (n, port) = (3, server.port());
    std::thread::scope(|sc| {
        for r in 0..n {
            sc.spawn(move || {
                let rt = fake_runtime(n);
                let g0 = ProcessGroup::from_dist_env(
                    rt.clone(),
                    &dist_env(r, n, port, true, 0).unwrap(),
                    T,
                )
                .unwrap();
                let g1 = ProcessGroup::from_dist_env(
                    rt.clone(),
                    &dist_env(r, n, port, true, 1).unwrap(),
                    T,
                )
                .unwrap();
                for i in 0..3 {
                    rounds(&g0, &rt, 100 + i, 2).unwrap();
                    rounds(&g1, &rt, 200 + i, 2).unwrap();
                }
            });
        }
    });
    // A third attempt after both are gone, every earlier key still in the store.
    assert!(server.num_keys() > 0);
    std::thread::scope(|sc| {
        for r in 0..n {
            sc.spawn(move || {
                let rt = fake_runtime(n);
                let g = ProcessGroup::from_dist_env(
                    rt.clone(),
                    &dist_env(r, n, port, true, 2).unwrap(),
                    T,
                )
                .unwrap();
                rounds(&g, &rt, 300, 4).unwrap();
            });
        }
    });
    Ok(())
}

#[test]
fn adv_rdzv_restart_on_rank0s_port_again() {
    let (n, port) = (2, free_port().unwrap());
    for attempt in 0..2 {
        std::thread::scope(|sc| {
            for r in 0..n {
                sc.spawn(move || {
                    let rt = fake_runtime(n);
                    let env = dist_env(r, n, port, false, attempt).unwrap();
                    let g = ProcessGroup::from_dist_env(rt.clone(), &env, T)
                        .unwrap_or_else(|e| panic!("attempt {attempt} rank {r}: {e:?}"));
                    rounds(&g, &rt, attempt, 2).unwrap();
                });
            }
        });
    }
}

#[test]
fn adv_rdzv_a_duplicate_rank_fails_alone() -> TestResult {
    let server = TcpStoreServer::bind(0)?;
    let port = server.port();
    // World 3, rank 1 claimed twice: one claimer gets DuplicateRank, the rest meet.
    let results: Vec<(usize, Result<(), DistError>)> = std::thread::scope(|sc| {
        let hs: Vec<_> = [0, 1, 1, 2]
            .into_iter()
            .map(|r| {
                sc.spawn(move || {
                    (
                        r,
                        rendezvous(
                            &dist_env(r, 3, port, true, 0).unwrap(),
                            Duration::from_secs(5),
                        )
                        .map(drop),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let dups = results
        .iter()
        .filter(|(_, r)| matches!(r, Err(DistError::DuplicateRank { rank: 1 })))
        .count();
    let oks = results.iter().filter(|(_, r)| r.is_ok()).count();
    assert_eq!((dups, oks), (1, 3), "{results:?}");
    Ok(())
}

#[test]
fn adv_rdzv_missing_ranks_are_named_in_time() -> TestResult {
    let server = TcpStoreServer::bind(0)?;
    let port = server.port();
    let t0 = Instant::now();
    let results: Vec<Result<(), DistError>> = std::thread::scope(|sc| {
        let hs: Vec<_> = [1, 2]
            .into_iter()
            .map(|r| {
                sc.spawn(move || {
                    rendezvous(
                        &dist_env(r, 5, port, true, 0).unwrap(),
                        Duration::from_millis(800),
                    )
                    .map(drop)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t0.elapsed() < BOUND, "{:?}", t0.elapsed());
    for r in results {
        match r {
            Err(DistError::RanksMissing {
                missing,
                world_size: 5,
                ..
            }) => assert_eq!(missing, [0, 3, 4]),
            other => panic!("{other:?}"),
        }
    }
    // Rank 0 holding the store, alone of three.
    let t0 = Instant::now();
    match rendezvous(
        &dist_env(0, 3, free_port().unwrap(), false, 0).unwrap(),
        Duration::from_millis(800),
    ) {
        Err(DistError::RanksMissing { missing, .. }) => assert_eq!(missing, [1, 2]),
        other => panic!("{other:?}"),
    }
    assert!(t0.elapsed() < BOUND, "{:?}", t0.elapsed());
    Ok(())
}

type OneRank = (Arc<FakeDriver>, Arc<Runtime>, ProcessGroup);

fn one_rank() -> Result<OneRank, Box<dyn std::error::Error>> {
    let fake = Arc::new(FakeDriver::builder().build());
    let rt = Runtime::new(fake.clone());
    let rank = FakeGroup::ranks(fake.clone(), &[DeviceIndex(0)])?
        .pop()
        .ok_or("no rank")?;
    let g = ProcessGroup::new(rt.clone(), Box::new(rank))?;
    Ok((fake, rt, g))
}

#[test]
fn adv_watchdog_counts_from_issue_and_spares_work_completed_late_but_in_time() -> TestResult {
    let (fake, rt, g) = one_rank()?;
    let g = g.with_timeout(Duration::from_millis(400))?;
    let x = DeviceBuffer::from_slice(&rt, DeviceIndex(0), &[1.0f64; 4])?;
    std::thread::sleep(Duration::from_millis(800)); // idle longer than the timeout
    fake.set_completion(Completion::Manual);
    let w = g.all_reduce(&x, ReduceOp::Sum)?;
    std::thread::sleep(Duration::from_millis(50));
    fake.advance_all();
    w.synchronize()?;
    // Many collectives issued without waiting, all complete: nothing trips.
    fake.set_completion(Completion::Eager);
    let ws: Vec<_> = (0..30)
        .map(|_| g.all_reduce(&x, ReduceOp::Max))
        .collect::<Result<_, _>>()?;
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(g.error(), None);
    assert!(ws.iter().all(|w| w.is_completed().unwrap_or(false)));
    // 1 + 30 completed, the next stuck: it is number 32, and it ran the timeout.
    fake.set_completion(Completion::Manual);
    let stuck = g.broadcast(&x, 0)?;
    let e = bounded(BOUND, move || stuck.synchronize())
        .ok_or("synchronize hung")?
        .unwrap_err();
    match &e {
        DistError::CollectiveTimeout {
            seq,
            what,
            after,
            timeout,
        } => {
            assert_eq!(*timeout, Duration::from_millis(400));
            assert_eq!((*seq, what.as_str()), (32, "BROADCAST"));
            assert!(*after >= Duration::from_millis(400), "{after:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        g.all_gather(&x, &x),
        Err(DistError::Aborted { .. })
    ));
    assert!(matches!(g.abort(), Ok(()) | Err(DistError::Aborted { .. })));
    assert_eq!(g.error(), Some(e));
    fake.set_completion(Completion::Eager);
    fake.advance_all();
    Ok(())
}

#[test]
fn adv_watchdog_replaced_timeout_abort_in_flight_and_drop() -> TestResult {
    // A longer watchdog replaces a shorter one.
    let (fake, rt, g) = one_rank()?;
    let g = g
        .with_timeout(Duration::from_millis(100))?
        .with_timeout(Duration::from_secs(60))?;
    let x = DeviceBuffer::from_slice(&rt, DeviceIndex(0), &[3i32; 8])?;
    fake.set_completion(Completion::Manual);
    let works: Vec<_> = (0..3)
        .map(|_| g.all_reduce(&x, ReduceOp::Sum))
        .collect::<Result<_, _>>()?;
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(
        g.error(),
        None,
        "the replaced 100 ms watchdog still watches"
    );
    // Abort with work in flight: every synchronize returns instead of hanging.
    let g = Arc::new(g);
    let waits: Vec<_> = works
        .into_iter()
        .map(|w| {
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || drop(tx.send(w.synchronize())));
            rx
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    g.abort()?;
    for rx in waits {
        let r = rx
            .recv_timeout(BOUND)
            .map_err(|_| "synchronize hung after abort")?;
        assert!(matches!(r, Err(DistError::Aborted { .. })), "{r:?}");
    }
    assert!(matches!(g.error(), Some(DistError::Aborted { .. })));
    // Dropping watched groups, idle or with stuck work, returns well before their timeout.
    let (fake2, rt2, g2) = one_rank()?;
    let g2 = g2.with_timeout(Duration::from_secs(600))?;
    let y = DeviceBuffer::from_slice(&rt2, DeviceIndex(0), &[1i64; 2])?;
    fake2.set_completion(Completion::Manual);
    let _w = g2.all_reduce(&y, ReduceOp::Sum)?;
    let (_f3, _rt3, g3) = one_rank()?;
    let g3 = g3.with_timeout(Duration::from_secs(600))?;
    let t0 = Instant::now();
    bounded(BOUND, move || {
        drop(g3);
        drop(g2);
        drop(g);
    })
    .ok_or("dropping a watched group hung")?;
    assert!(t0.elapsed() < BOUND);
    fake.set_completion(Completion::Eager);
    fake.advance_all();
    Ok(())
}
