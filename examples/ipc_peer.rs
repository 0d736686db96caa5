//! Two processes sharing allocator blocks through CUDA IPC, as `torch.multiprocessing`
//! shares CUDA tensors. Either side may be PyTorch: a message is the eight values of
//! `storage._share_cuda_()`, one JSON line each.
//!
//! ```sh
//! cargo build --release --example ipc_peer
//! # a ferrocuda consumer of a ferrocuda producer (the consumer starts the producer):
//! target/release/examples/ipc_peer consume "" -- target/release/examples/ipc_peer produce ""
//! # the same with expandable segments (page descriptors fetched from the producer):
//! target/release/examples/ipc_peer consume expandable_segments:True -- \
//!     target/release/examples/ipc_peer produce expandable_segments:True
//! # PyTorch on either side: xtask/torch/ipc_torch.py target/release/examples/ipc_peer
//! # two GPUs: the consumer reads the blocks from GPU 1 through peer access
//! IPC_PEER_DEVICE=1 target/release/examples/ipc_peer consume "" -- \
//!     target/release/examples/ipc_peer produce ""
//! ```
//! The producer shares two blocks of one segment (1 MiB counting bytes, 4 KiB of 0x5A),
//! frees the first before sending (it waits in the limbo for the consumer), and after
//! the consumer's "closed" checks that the consumer's writes (0xC3 over the second) arrived
//! and that both blocks came back. Run without arguments, it is both: on a GPU a consumer
//! starting itself as the producer, for both kinds of segment; without one, both roles in
//! this process on the fake device (the fake has no other process).
use ferrocuda::alloc::{Caching, CachingAllocator, SharedMessage};
use ferrocuda::driver::{Driver, FakeDriver};
use ferrocuda::types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamHandle};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;
const D0: DeviceIndex = DeviceIndex(0);
const S: StreamHandle = StreamHandle::legacy(D0);
const FIRST: u64 = 1 << 20;
const SECOND: u64 = 4096;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("produce") => produce(arg(&args, 1)),
        Some("consume") => consume(arg(&args, 1), &args[args.len().min(3)..]),
        None if gpu_driver().is_ok() => ours_to_ours(),
        None => in_one_process(),
        Some(other) => Err(format!("unknown role {other:?}: produce, consume or none").into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ipc_peer: {e}");
            ExitCode::FAILURE
        }
    }
}

fn arg(args: &[String], i: usize) -> &str {
    args.get(i).map_or("", String::as_str)
}

/// The GPU's driver (this example shares between processes of a real device).
fn gpu_driver() -> Result<Arc<dyn Driver>> {
    let rt = ferrocuda::runtime();
    if rt.driver().backend() != "cuda" || !rt.is_available() {
        return Err("no GPU: run without arguments for the fake device".into());
    }
    Ok(rt.driver().clone())
}

fn allocator(driver: Arc<dyn Driver>, conf: &str) -> Result<CachingAllocator> {
    Ok(CachingAllocator::new(
        driver,
        D0,
        AllocatorConfig::parse(conf)?,
        Caching::On,
    )?)
}

fn counting(bytes: u64) -> Vec<u8> {
    (0..bytes).map(|i| (i % 251) as u8).collect()
}

fn read(driver: &dyn Driver, ptr: DevicePtr, bytes: u64) -> Result<Vec<u8>> {
    let mut out = vec![0; bytes as usize];
    driver.memcpy_dtoh(&mut out, ptr, S)?;
    Ok(out)
}

/// The producer's side up to the messages: two blocks written, shared, the first freed.
fn send(a: &CachingAllocator, driver: &dyn Driver) -> Result<[(DevicePtr, SharedMessage); 2]> {
    let first = a.allocate(FIRST, S)?;
    let second = a.allocate(SECOND, S)?;
    driver.memcpy_htod_async(first.ptr, &counting(FIRST), S)?;
    driver.memcpy_htod_async(second.ptr, &[0x5A; SECOND as usize], S)?;
    let m1 = a.share(first.ptr, FIRST, S)?;
    let m2 = a.share(second.ptr, SECOND, S)?;
    Ok([(first.ptr, m1), (second.ptr, m2)])
}

/// The producer's side after the consumer closed: its writes arrived, both blocks return.
fn check_returned(a: &CachingAllocator, driver: &dyn Driver, second: DevicePtr) -> Result<()> {
    if read(driver, second, SECOND)? != [0xC3; SECOND as usize] {
        return Err("the consumer's writes did not arrive".into());
    }
    if !a.ipc_collect() {
        return Err("the first block did not come back from the limbo".into());
    }
    a.free(second)?;
    let (ipc, stats) = (a.ipc_stats(), a.stats());
    if ipc.shared_blocks != 0 || stats.allocated_bytes.all.current != 0 {
        return Err(format!("blocks still held: {ipc:?}").into());
    }
    Ok(())
}

/// Reads `bytes` at `ptr` (memory of device 0) from `peer` through peer access: a copy on
/// a stream of `peer` into memory of `peer`, then back to the host.
fn read_from_peer(
    driver: &dyn Driver,
    peer: DeviceIndex,
    ptr: DevicePtr,
    bytes: u64,
) -> Result<Vec<u8>> {
    let dst = driver.malloc(peer, bytes)?;
    let stream = StreamHandle::legacy(peer);
    driver.memcpy_dtod_async(dst, ptr, bytes, stream)?;
    let mut out = vec![0; bytes as usize];
    driver.memcpy_dtoh(&mut out, dst, stream)?;
    driver.free(peer, dst)?;
    Ok(out)
}

/// The device the consumer reads the blocks from (`IPC_PEER_DEVICE`), if not their own.
fn peer_device() -> Result<Option<DeviceIndex>> {
    match std::env::var("IPC_PEER_DEVICE") {
        Ok(v) => Ok(Some(DeviceIndex(v.parse()?))),
        Err(_) => Ok(None),
    }
}

/// The consumer's side: opens both, checks the data (from `peer` if given), writes the
/// second, closes.
fn receive(
    a: &CachingAllocator,
    driver: &dyn Driver,
    messages: &[SharedMessage],
    peer: Option<DeviceIndex>,
) -> Result<()> {
    let [m1, m2] = messages else {
        return Err(format!("{} messages, not 2", messages.len()).into());
    };
    if let Some(peer) = peer {
        // The peer's context may access device 0, and pages imported from now on are
        // mapped with access for it (PyTorch's `addPeerAccess`).
        driver.enable_peer_access(peer, D0)?;
        a.add_peer_access(peer)?;
    }
    let (r1, r2) = (a.open_shared(m1, S)?, a.open_shared(m2, S)?);
    if a.ipc_stats().opened_handles != 1 {
        return Err("two blocks of one segment should open one handle".into());
    }
    let reader = |ptr, bytes| match peer {
        Some(peer) => read_from_peer(driver, peer, ptr, bytes),
        None => read(driver, ptr, bytes),
    };
    if reader(r1.ptr(), FIRST)? != counting(FIRST) {
        return Err("the first block's bytes differ".into());
    }
    if reader(r2.ptr(), SECOND)? != [0x5A; SECOND as usize] {
        return Err("the second block's bytes differ".into());
    }
    driver.memcpy_htod_async(r2.ptr(), &[0xC3; SECOND as usize], S)?;
    r1.close()?;
    r2.close()?;
    if a.ipc_stats().opened_handles != 0 {
        return Err("the handle is still open".into());
    }
    Ok(())
}

fn produce(conf: &str) -> Result<()> {
    let driver = gpu_driver()?;
    let a = allocator(driver.clone(), conf)?;
    let [(first, m1), (second, m2)] = send(&a, &*driver)?;
    // Freed before the consumer has the message: it must wait in the limbo.
    a.free(first)?;
    if a.ipc_stats().limbo_blocks != 1 || a.ipc_collect() {
        return Err("the freed block should wait in the limbo".into());
    }
    for m in [&m1, &m2] {
        println!("{}", serde_json::to_string(m)?);
    }
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    if line.trim() != "closed" {
        return Err(format!("expected \"closed\", got {line:?}").into());
    }
    check_returned(&a, &*driver, second)?;
    eprintln!("producer ok ({conf:?}): the consumer's writes arrived, both blocks returned");
    Ok(())
}

fn consume(conf: &str, producer: &[String]) -> Result<()> {
    let driver = gpu_driver()?;
    let a = allocator(driver.clone(), conf)?;
    let [program, args @ ..] = producer else {
        return Err("consume CONF -- PRODUCER ARGS...".into());
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("the producer's stdout")?;
    let mut messages = Vec::new();
    for line in BufReader::new(stdout).lines().take(2) {
        messages.push(serde_json::from_str::<SharedMessage>(&line?)?);
    }
    let received = receive(&a, &*driver, &messages, peer_device()?);
    let mut stdin = child.stdin.take().ok_or("the producer's stdin")?;
    writeln!(
        stdin,
        "{}",
        if received.is_ok() { "closed" } else { "failed" }
    )?;
    drop(stdin);
    let status = child.wait()?;
    received?;
    if !status.success() {
        return Err(format!("the producer failed: {status}").into());
    }
    let from = peer_device()?.map_or(String::new(), |p| format!(" from GPU {}", p.0));
    println!(
        "consumer ok ({conf:?}, handle kind {:?}): data read{from}, written and given back",
        messages[0].handle.get(1).map(|&k| k as char)
    );
    Ok(())
}

/// This program as the consumer of itself, for both kinds of segment.
fn ours_to_ours() -> Result<()> {
    let me = std::env::current_exe()?.display().to_string();
    for conf in ["", "expandable_segments:True"] {
        let producer = [me.clone(), "produce".into(), conf.into()];
        consume(conf, &producer)?;
    }
    println!("ipc_peer: two processes on the GPU shared blocks both kinds of segment");
    Ok(())
}

/// Both roles on one fake device, for a run without a GPU.
fn in_one_process() -> Result<()> {
    for conf in ["", "expandable_segments:True"] {
        for peer in [None, Some(DeviceIndex(1))] {
            let fake: Arc<dyn Driver> = Arc::new(FakeDriver::builder().devices(2).build());
            let producer = allocator(fake.clone(), conf)?;
            let consumer = allocator(fake.clone(), conf)?;
            let [(first, m1), (second, m2)] = send(&producer, &*fake)?;
            producer.free(first)?;
            receive(&consumer, &*fake, &[m1, m2], peer)?;
            check_returned(&producer, &*fake, second)?;
            let from = peer.map_or(String::new(), |p| format!(" from device {}", p.0));
            println!("fake device ({conf:?}): shared, read{from}, written and given back");
        }
    }
    Ok(())
}
