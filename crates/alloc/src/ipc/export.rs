//! The producer's calls: a block's handle, a send, the free of a shared block and the
//! collection of the limbo.
use super::sent::Send;
use super::{
    HANDLE_VERSION, IpcError, IpcStats, KIND_CUDA_MALLOC, KIND_EXPANDABLE, ShareableHandle,
    SharedMessage,
};
use crate::{AllocError, CachingAllocator};
use ferrocuda_types::{DevicePtr, EventFlags, StreamHandle};

impl CachingAllocator {
    /// The handle another process opens the live allocation at `ptr` with, and its offset
    /// there (PyTorch's `shareIpcHandle`; see the [module docs](crate::ipc)).
    pub fn share_ipc_handle(&self, ptr: DevicePtr) -> Result<ShareableHandle, AllocError> {
        Ok(self.handle_and_size(ptr)?.0)
    }

    /// [`CachingAllocator::share_ipc_handle`], and the block's size, read under one lock.
    fn handle_and_size(&self, ptr: DevicePtr) -> Result<(ShareableHandle, u64), AllocError> {
        // Freed already (it waits in the limbo for its consumers): not a live allocation.
        if self.ipc.in_limbo(ptr.0) {
            return Err(AllocError::InvalidPointer(ptr));
        }
        let driver = &self.engine.driver;
        let dev = self.engine.device;
        let mut out = vec![HANDLE_VERSION];
        if !self.caching {
            // Without caching, every allocation is its own `cudaMalloc`.
            let bytes = self.uncached.lock().get(&ptr.0).map(|&(bytes, _)| bytes);
            let bytes = bytes.ok_or(AllocError::InvalidPointer(ptr))?;
            out.push(KIND_CUDA_MALLOC);
            out.extend_from_slice(&driver.ipc_mem_handle(dev, ptr)?.0);
            let handle = ShareableHandle {
                offset: 0,
                handle: out,
            };
            return Ok((handle, bytes));
        }
        let st = self.engine.lock();
        let id = st
            .blocks
            .allocated_at(ptr.0)
            .ok_or(AllocError::InvalidPointer(ptr))?;
        let (start, size) = (st.blocks[id].ptr, st.blocks[id].size);
        let Some(segment) = st.expandable.segment_of(&st.blocks, id) else {
            let mut base = id;
            while let Some(prev) = st.blocks[base].prev.get() {
                base = prev;
            }
            let base = st.blocks[base].ptr;
            out.push(KIND_CUDA_MALLOC);
            out.extend_from_slice(&driver.ipc_mem_handle(dev, DevicePtr(base))?.0);
            let handle = ShareableHandle {
                offset: ptr.0 - base,
                handle: out,
            };
            return Ok((handle, size));
        };
        // The pages under the block (`ExpandableSegment::share`); an allocated block is
        // never empty.
        let (first, last) = (
            segment.page_index(start),
            segment.page_index(start + size - 1),
        );
        out.push(KIND_EXPANDABLE);
        out.extend_from_slice(&std::process::id().to_ne_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&segment.page.to_ne_bytes());
        out.extend_from_slice(&((last - first + 1) as u64).to_ne_bytes());
        for page in first..=last {
            let handle = segment.handles.get(page).copied().flatten();
            let handle = handle.ok_or(AllocError::InvalidPointer(ptr))?;
            out.extend_from_slice(&driver.vm_export(handle)?.to_ne_bytes());
        }
        let handle = ShareableHandle {
            offset: start - (segment.va.base.0 + first as u64 * segment.page),
            handle: out,
        };
        Ok((handle, size))
    }

    /// Sends the live allocation at `ptr` (`bytes` long, in use on `stream`) to another
    /// process: PyTorch's `storage._share_cuda_()`. The block is not reused until every
    /// consumer of every send has closed it, even after this process frees it (then it
    /// waits in the limbo, see [`CachingAllocator::ipc_collect`]).
    pub fn share(
        &self,
        ptr: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<SharedMessage, AllocError> {
        let (handle, block_bytes) = self.handle_and_size(ptr)?;
        let (file, slot) = self.ipc.take_counter()?;
        let driver = &self.engine.driver;
        let mut event_handle = vec![0; 64];
        let event = if self.ipc.take_event_slot() {
            let flags = EventFlags {
                timing: false,
                blocking: true,
                interprocess: true,
            };
            let event = driver.event_create(self.engine.device, flags)?;
            let recorded = driver
                .event_record(event, stream)
                .and_then(|()| driver.ipc_event_handle(event));
            match recorded {
                Ok(h) => event_handle = h.0.to_vec(),
                Err(e) => {
                    let _ = driver.event_destroy(event);
                    self.ipc.return_events(1);
                    return Err(e.into());
                }
            }
            Some(event)
        } else {
            driver.stream_synchronize(stream)?;
            None
        };
        let message = SharedMessage {
            device: self.engine.device.0,
            handle: handle.handle,
            size_bytes: bytes,
            offset_bytes: handle.offset,
            ref_counter_handle: file.name().to_owned(),
            ref_counter_offset: slot as u64,
            event_sync_required: event.is_some(),
            event_handle,
        };
        self.ipc
            .add_send(ptr.0, block_bytes, Send { file, slot, event });
        Ok(message)
    }

    /// The free of a shared block (PyTorch's `CudaIPCSentDataDelete`): `true` when it went
    /// to the limbo (a consumer holds it), `false` when the free goes on (collecting the
    /// limbo either way). A block in the limbo was freed already: freeing it again is
    /// [`AllocError::InvalidPointer`], as any double free.
    pub(crate) fn ipc_hold_back(&self, ptr: DevicePtr) -> Result<bool, AllocError> {
        let Some(freed) = self.ipc.on_free(ptr.0) else {
            return Ok(false);
        };
        let (held, finished) = freed.ok_or(AllocError::InvalidPointer(ptr))?;
        self.finish_sends(finished);
        self.ipc_collect();
        Ok(held)
    }

    fn finish_sends(&self, sends: Vec<Send>) {
        let events = sends.iter().filter_map(|s| s.event).collect::<Vec<_>>();
        for &event in &events {
            // A failure leaves the event to the driver's teardown, as PyTorch's destructor
            // ignores it.
            let _ = self.engine.driver.event_destroy(event);
        }
        self.ipc.return_events(events.len());
    }

    /// Frees the blocks of the limbo whose consumers all closed them (`torch.cuda.
    /// ipc_collect()`); whether any was. Once nothing is shared, the counter file is let go.
    pub fn ipc_collect(&self) -> bool {
        let done = self.ipc.take_collectable();
        let freed = !done.is_empty();
        for (ptr, block) in done {
            self.finish_sends(block.sends);
            // Already checked as a live allocation when it was shared and kept allocated
            // since: this free cannot fail on its pointer.
            let _ = self.free(DevicePtr(ptr));
        }
        self.ipc.clean_current_file();
        freed
    }

    /// What this allocator shares and has opened.
    pub fn ipc_stats(&self) -> IpcStats {
        self.ipc.stats()
    }
}

impl From<IpcError> for AllocError {
    fn from(e: IpcError) -> AllocError {
        AllocError::Ipc(e)
    }
}
