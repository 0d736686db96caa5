//! The consumer's calls: opening a handle once however many blocks use it (PyTorch's
//! `getIpcDevPtr` and `MemHandleCacheEntry`; expandable pages as
//! `ExpandableSegment::fromShared`), and a received block's close.
use super::{
    HANDLE_VERSION, IpcError, KIND_CUDA_MALLOC, KIND_EXPANDABLE, REF_COUNTER_FILE_SIZE,
    SHARE_HEADER, SharedMessage,
};
use crate::{AllocError, CachingAllocator};
use ferrocuda_driver::shared_counters::SharedCounters;
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{DeviceIndex, DevicePtr, IpcHandle, PhysHandle, StreamHandle, VaRange};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// Open handles by their bytes; an entry lives while a block uses it.
pub(crate) type OpenedCache = Mutex<HashMap<Vec<u8>, Weak<OpenedHandle>>>;

/// What an opened handle mapped here.
enum Mapped {
    /// Another process's `cudaMalloc` segment (`cuIpcOpenMemHandle`).
    Segment(DevicePtr),
    /// Another process's pages, imported and mapped into a range of ours.
    Pages { va: VaRange, pages: Vec<PhysHandle> },
}

/// Another process's memory mapped into this one; unmapped when the last block using it
/// is closed.
pub struct OpenedHandle {
    driver: Arc<dyn Driver>,
    device: DeviceIndex,
    mapped: Mapped,
    bytes: u64,
    opened_handles: Arc<AtomicU64>,
    opened_bytes: Arc<AtomicU64>,
}

impl std::fmt::Debug for OpenedHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedHandle")
            .field("base", &self.base())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl OpenedHandle {
    /// Where the handle's memory starts here (a message's offset counts from it).
    pub fn base(&self) -> DevicePtr {
        match &self.mapped {
            Mapped::Segment(ptr) => *ptr,
            Mapped::Pages { va, .. } => va.base,
        }
    }
}

impl Drop for OpenedHandle {
    /// Unmaps (PyTorch's deleter warns and goes on when the driver fails here).
    fn drop(&mut self) {
        let driver = &self.driver;
        match &self.mapped {
            Mapped::Segment(ptr) => {
                let _ = driver.ipc_close_mem(self.device, *ptr);
            }
            Mapped::Pages { va, pages } => {
                let _ = driver.vm_unmap(self.device, va.base, va.bytes);
                for &page in pages {
                    let _ = driver.vm_destroy(page);
                }
                let _ = driver.vm_release(*va);
            }
        }
        self.opened_handles.fetch_sub(1, Ordering::Relaxed);
        self.opened_bytes.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A block another process sent, open here. Close it ([`ReceivedBlock::close`], or drop
/// it) when done: the producer's block stays allocated until then.
pub struct ReceivedBlock {
    ptr: DevicePtr,
    size: u64,
    stream: StreamHandle,
    opened: Option<Arc<OpenedHandle>>,
    counter: (String, u64),
}

impl std::fmt::Debug for ReceivedBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceivedBlock")
            .field("ptr", &self.ptr)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl ReceivedBlock {
    /// The block's address in this process.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Its bytes (the message's `size_bytes`).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Waits for this process's work on the block's stream, unmaps the handle if no other
    /// block uses it, and gives the block back to its producer (decrements the send's
    /// counter). A producer that is gone is not an error (PyTorch's deleter ignores it). If
    /// the wait fails, the block is not given back (the error is returned): work of this
    /// process may still touch it, and the producer keeps it rather than reuse it under
    /// that work (PyTorch's deleter would throw there, out of a destructor).
    pub fn close(mut self) -> Result<(), AllocError> {
        self.finish()
    }

    fn finish(&mut self) -> Result<(), AllocError> {
        let Some(opened) = self.opened.take() else {
            return Ok(());
        };
        let synced = opened.driver.stream_synchronize(self.stream);
        drop(opened);
        synced?;
        let (name, slot) = &self.counter;
        if let Ok(file) = SharedCounters::open(name, REF_COUNTER_FILE_SIZE)
            && let Some(counter) = file.counter(*slot as usize)
        {
            counter.fetch_sub(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

impl Drop for ReceivedBlock {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

impl CachingAllocator {
    /// Opens a block another process sent (PyTorch's `UntypedStorage._new_shared_cuda`):
    /// `stream` waits for the producer's work up to the send, the handle is opened (once
    /// for every block that shares it), and the block is this process's until it is
    /// closed.
    pub fn open_shared(
        &self,
        message: &SharedMessage,
        stream: StreamHandle,
    ) -> Result<ReceivedBlock, AllocError> {
        let dev = self.engine.device;
        if message.device != dev.0 {
            return Err(IpcError::WrongDevice {
                message: message.device,
                allocator: dev.0,
            }
            .into());
        }
        let driver = &self.engine.driver;
        if message.event_sync_required {
            let handle = IpcHandle::from_slice(&message.event_handle)
                .ok_or_else(|| bad("an event handle is 64 bytes"))?;
            let event = driver.ipc_open_event(dev, &handle)?;
            let waited = driver.stream_wait_event(stream, event);
            let _ = driver.event_destroy(event);
            waited?;
        }
        let opened = self.open_ipc_handle(&message.handle)?;
        Ok(ReceivedBlock {
            ptr: DevicePtr(opened.base().0 + message.offset_bytes),
            size: message.size_bytes,
            stream,
            opened: Some(opened),
            counter: (
                message.ref_counter_handle.clone(),
                message.ref_counter_offset,
            ),
        })
    }

    /// The memory a handle names, mapped here: the one already open for these bytes, or
    /// a new mapping (PyTorch's `getIpcDevPtr`).
    pub fn open_ipc_handle(&self, handle: &[u8]) -> Result<Arc<OpenedHandle>, AllocError> {
        let mut cache = self.ipc.opened.lock();
        if let Some(open) = cache.get(handle).and_then(Weak::upgrade) {
            return Ok(open);
        }
        let (mapped, bytes) = self.map_handle(handle)?;
        let open = Arc::new(OpenedHandle {
            driver: Arc::clone(&self.engine.driver),
            device: self.engine.device,
            mapped,
            bytes,
            opened_handles: Arc::clone(&self.ipc.opened_handles),
            opened_bytes: Arc::clone(&self.ipc.opened_bytes),
        });
        self.ipc.opened_handles.fetch_add(1, Ordering::Relaxed);
        self.ipc.opened_bytes.fetch_add(bytes, Ordering::Relaxed);
        cache.retain(|_, w| w.strong_count() > 0);
        cache.insert(handle.to_vec(), Arc::downgrade(&open));
        Ok(open)
    }

    /// Maps what `handle` names (PyTorch's `MemHandleCacheEntry`): a 64-byte handle as an
    /// older PyTorch sends it, or a versioned one.
    fn map_handle(&self, handle: &[u8]) -> Result<(Mapped, u64), AllocError> {
        let (kind, rest) = match handle {
            h if h.len() == 64 => (KIND_CUDA_MALLOC, h),
            [version, kind, rest @ ..] if *version <= HANDLE_VERSION => (*kind, rest),
            _ => return Err(bad("unknown version or length")),
        };
        let dev = self.engine.device;
        let driver = &self.engine.driver;
        match kind {
            KIND_CUDA_MALLOC => {
                let h = IpcHandle::from_slice(rest)
                    .ok_or_else(|| bad("a memory handle is 64 bytes"))?;
                Ok((Mapped::Segment(driver.ipc_open_mem(dev, &h)?), 0))
            }
            KIND_EXPANDABLE => self.import_pages(rest),
            _ => Err(bad("unknown kind")),
        }
    }

    /// Imports another process's pages and maps them, in order, into a range of ours
    /// with access for this device and its peers (`ExpandableSegment::fromShared`).
    fn import_pages(&self, bytes: &[u8]) -> Result<(Mapped, u64), AllocError> {
        let word = |at: usize| -> Option<u64> {
            Some(u64::from_ne_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
        };
        let header = bytes.get(..4).zip(word(8)).zip(word(16));
        let ((pid, page), count) = header.ok_or_else(|| bad("short expandable header"))?;
        let pid = i32::from_ne_bytes([pid[0], pid[1], pid[2], pid[3]]);
        let fds: Vec<i32> = bytes[SHARE_HEADER..]
            .chunks(4)
            .map(|c| c.try_into().map(i32::from_ne_bytes))
            .collect::<Result<_, _>>()
            .map_err(|_| bad("a descriptor is 4 bytes"))?;
        if pid <= 0 || page == 0 || count == 0 || fds.len() as u64 != count {
            return Err(bad("expandable header and descriptors disagree"));
        }
        let dev = self.engine.device;
        let driver = &self.engine.driver;
        let va = driver.vm_reserve(dev, page * count)?;
        let mut pages = Vec::with_capacity(fds.len());
        let mapped = (|| -> Result<(), DriverError> {
            for (i, &fd) in fds.iter().enumerate() {
                let chunk = driver.vm_import(dev, pid as u32, fd, page)?;
                pages.push(chunk);
                driver.vm_map(DevicePtr(va.base.0 + i as u64 * page), chunk)?;
            }
            driver.vm_set_access(dev, va.base, va.bytes)?;
            for &peer in self.engine.peers.read().iter() {
                driver.vm_set_access(peer, va.base, va.bytes)?;
            }
            Ok(())
        })();
        if let Err(e) = mapped {
            let _ = driver.vm_unmap(dev, va.base, page * pages.len() as u64);
            for &p in &pages {
                let _ = driver.vm_destroy(p);
            }
            let _ = driver.vm_release(va);
            return Err(e.into());
        }
        Ok((Mapped::Pages { va, pages }, va.bytes))
    }
}

fn bad(why: &str) -> AllocError {
    IpcError::BadHandle(why.to_owned()).into()
}
