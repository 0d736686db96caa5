//! Sharing with "other processes" on the fake device: IPC handles of `malloc`ed memory and
//! of interprocess events, and chunks exported as descriptors and imported again.
//!
//! The fake lives in one process, so another process is modelled by another user of the
//! same fake (a second allocator, a second runtime): an opened handle maps the very chunk
//! again at a fresh address, an opened event starts as a copy of the event's last record
//! (what a wait right after opening needs), an import is a second handle of the chunk.
//! A handle made by another fake is refused, as one from another machine would be; unlike
//! libcuda, the fake lets a process open its own handles (it has no other process).
use super::{Call, FakeDriver, FakeEvent};
use crate::DriverError;
use ferrocuda_types::{DeviceIndex, DevicePtr, EventHandle, IpcHandle, PhysHandle};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// The first bytes of every fake IPC handle.
const MAGIC: &[u8; 8] = b"fcfakeIP";
/// Fake descriptors are numbered from here (far from a real process's).
const FIRST_FD: i32 = 1 << 20;

static INSTANCES: AtomicU64 = AtomicU64::new(1);

/// A fresh fake's instance number.
pub(super) fn next_instance() -> u64 {
    INSTANCES.fetch_add(1, Ordering::Relaxed)
}

/// Chunks exported as (fake) descriptors.
#[derive(Default)]
pub(super) struct Exports {
    by_chunk: HashMap<u64, i32>,
    by_fd: HashMap<i32, u64>,
    next_fd: i32,
}

fn handle(instance: u64, what: u64, dev: DeviceIndex) -> IpcHandle {
    let mut h = [0u8; 64];
    h[..8].copy_from_slice(MAGIC);
    h[8..16].copy_from_slice(&instance.to_le_bytes());
    h[16..24].copy_from_slice(&what.to_le_bytes());
    h[24..26].copy_from_slice(&dev.0.to_le_bytes());
    IpcHandle(h)
}

/// What a handle made by this fake names, or `INVALID_VALUE`.
fn parse(driver: &FakeDriver, h: &IpcHandle) -> Result<u64, DriverError> {
    let word = |at: usize| u64::from_le_bytes(h.0[at..at + 8].try_into().unwrap_or_default());
    if &h.0[..8] != MAGIC || word(8) != driver.instance {
        return Err(DriverError::INVALID_VALUE);
    }
    Ok(word(16))
}

pub(super) fn ipc_mem_handle(
    driver: &FakeDriver,
    dev: DeviceIndex,
    ptr: DevicePtr,
) -> Result<IpcHandle, DriverError> {
    let st = driver.enter(Call::IpcMemHandle)?;
    st.check_device(dev)?;
    let chunk = st.memory.malloc_chunk(dev, ptr);
    Ok(handle(
        driver.instance,
        chunk.ok_or(DriverError::INVALID_VALUE)?,
        dev,
    ))
}

pub(super) fn ipc_open_mem(
    driver: &FakeDriver,
    dev: DeviceIndex,
    h: &IpcHandle,
) -> Result<DevicePtr, DriverError> {
    let mut st = driver.enter(Call::IpcOpenMem)?;
    st.check_device(dev)?;
    let at = st.memory.map_shared(dev, parse(driver, h)?)?;
    st.ipc_opened.insert((dev.0, at.0));
    Ok(at)
}

pub(super) fn ipc_close_mem(
    driver: &FakeDriver,
    dev: DeviceIndex,
    ptr: DevicePtr,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::IpcCloseMem)?;
    if !st.ipc_opened.remove(&(dev.0, ptr.0)) {
        return Err(DriverError::INVALID_VALUE);
    }
    st.memory.unmap_shared(dev, ptr)
}

pub(super) fn ipc_event_handle(
    driver: &FakeDriver,
    event: EventHandle,
) -> Result<IpcHandle, DriverError> {
    let st = driver.enter(Call::IpcEventHandle)?;
    if !st.event(event)?.flags.interprocess {
        return Err(DriverError::INVALID_VALUE);
    }
    Ok(handle(driver.instance, event.raw, event.device))
}

pub(super) fn ipc_open_event(
    driver: &FakeDriver,
    dev: DeviceIndex,
    h: &IpcHandle,
) -> Result<EventHandle, DriverError> {
    let mut st = driver.enter(Call::IpcOpenEvent)?;
    st.check_device(dev)?;
    let source = st.events.get(&parse(driver, h)?);
    let source = source.ok_or(DriverError::INVALID_VALUE)?;
    let copy = FakeEvent {
        device: dev,
        flags: source.flags,
        recorded: source.recorded.clone(),
        generation: source.generation,
    };
    let raw = st.id();
    st.events.insert(raw, copy);
    Ok(EventHandle { device: dev, raw })
}

pub(super) fn vm_export(driver: &FakeDriver, chunk: PhysHandle) -> Result<i32, DriverError> {
    let mut st = driver.enter(Call::VmExport)?;
    if st.memory.chunk_device(chunk.raw) != Some(chunk.device) {
        return Err(DriverError::INVALID_HANDLE);
    }
    let exports = &mut st.exports;
    if let Some(&fd) = exports.by_chunk.get(&chunk.raw) {
        return Ok(fd);
    }
    let fd = FIRST_FD + exports.next_fd;
    exports.next_fd += 1;
    exports.by_chunk.insert(chunk.raw, fd);
    exports.by_fd.insert(fd, chunk.raw);
    Ok(fd)
}

/// Forgets the descriptor of a chunk being destroyed (the real driver closes it).
pub(super) fn forget_export(exports: &mut Exports, chunk: u64) {
    if let Some(fd) = exports.by_chunk.remove(&chunk) {
        exports.by_fd.remove(&fd);
    }
}

pub(super) fn vm_import(
    driver: &FakeDriver,
    dev: DeviceIndex,
    pid: u32,
    fd: i32,
    bytes: u64,
) -> Result<PhysHandle, DriverError> {
    let mut st = driver.enter(Call::VmImport)?;
    st.check_device(dev)?;
    // The fake's descriptors live in this process only.
    let exported = st.exports.by_fd.get(&fd).copied();
    let chunk = match exported {
        Some(chunk) if pid == std::process::id() => chunk,
        _ => return Err(DriverError::OPERATING_SYSTEM),
    };
    if st.memory.chunk_device(chunk) != Some(dev) || st.memory.chunk_bytes(chunk) != Some(bytes) {
        return Err(DriverError::INVALID_VALUE);
    }
    let raw = st.memory.alias_chunk(chunk)?;
    Ok(PhysHandle { device: dev, raw })
}
