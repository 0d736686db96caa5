//! Where the host allocator's bytes come from and go back to (PyTorch's
//! `allocate_host_memory` / `free_block` in aten/src/ATen/cuda/CachingHostAllocator.cpp):
//! the reserve segment first, else `cudaHostAlloc`, or `malloc` + pre-fault +
//! `cudaHostRegister` with `pinned_use_cuda_host_register` (the pre-fault split over
//! `pinned_num_register_threads`), each timed into `host_alloc_time` / `host_free_time`.
//! Every driver call here is made without the allocator's lock.
use super::HostAllocator;
use super::state::{Block, Source};
use crate::AllocError;
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{CaptureMode, HostPtr, HostRange};
use parking_lot::Mutex;
use std::sync::OnceLock;
use std::time::Instant;

/// The page the register path pre-faults by (PyTorch's 4 KiB `pageSize`), and the
/// granularity of the reserve segment's bump allocation.
pub(crate) const HOST_PAGE: u64 = 4096;

/// The reserve segment (`pinned_reserve_segment_size_mb`): one pinned slab taken at the
/// first slow-path allocation, served bump-pointer style in 4 KiB steps, never given back.
#[derive(Debug)]
pub(crate) struct Slab {
    base: HostPtr,
    /// How the slab was made (so it goes back the same way).
    source: Source,
    used: Mutex<u64>,
}

impl Slab {
    /// A piece of `size` bytes (taking `size` rounded up to 4 KiB), if it still fits.
    fn take(&self, size: u64) -> Option<HostRange> {
        let step = size.checked_next_multiple_of(HOST_PAGE)?;
        let mut used = self.used.lock();
        let end = used.checked_add(step).filter(|&e| e <= self.base.bytes)?;
        let range = HostRange {
            base: self.base,
            offset: *used,
            bytes: size,
        };
        *used = end;
        Some(range)
    }
}

/// The reserve segment's state: decided once, at the first slow-path allocation, from the
/// configuration then (PyTorch's function-local static).
#[derive(Debug, Default)]
pub(crate) struct Reserve {
    slab: OnceLock<Option<Slab>>,
    /// Held while the slab is being made, so that two first allocations make one.
    making: Mutex<()>,
}

/// The byte ranges the register path's pre-fault threads take: PyTorch's
/// `mapPagesForRegister` split of `[0, size)` into `threads` parts, the last one running to
/// the end. One part when `threads` is 1 or the allocation is smaller than a page per thread.
pub(crate) fn prefault_parts(size: u64, threads: u64) -> Vec<(u64, u64)> {
    if threads <= 1 || size < HOST_PAGE.saturating_mul(threads) {
        return vec![(0, size)];
    }
    (0..threads)
        .map(|i| {
            let start = (u128::from(size) * u128::from(i) / u128::from(threads)) as u64;
            let end = if i == threads - 1 {
                size
            } else {
                start + size / threads
            };
            (start, end - start)
        })
        .collect()
}

/// `malloc`, pre-fault (split across threads), `cudaHostRegister`; on failure what was
/// taken is given back.
fn registered(driver: &dyn Driver, size: u64, threads: u64) -> Result<HostPtr, DriverError> {
    let ptr = driver.host_malloc(size)?;
    let parts = prefault_parts(size, threads);
    let faulted = if parts.len() == 1 {
        driver.host_prefault(ptr, 0, size, HOST_PAGE)
    } else {
        std::thread::scope(|s| {
            let workers: Vec<_> = parts
                .iter()
                .map(|&(offset, bytes)| {
                    s.spawn(move || driver.host_prefault(ptr, offset, bytes, HOST_PAGE))
                })
                .collect();
            workers
                .into_iter()
                .try_for_each(|w| w.join().unwrap_or(Err(DriverError::OPERATING_SYSTEM)))
        })
    };
    match faulted.and_then(|()| driver.host_register(ptr)) {
        Ok(()) => Ok(ptr),
        Err(e) => {
            let _ = driver.host_mfree(ptr);
            Err(e)
        }
    }
}

impl HostAllocator {
    /// `allocate_host_memory`: a piece of the reserve segment if there is one and it has
    /// room, else new memory from the driver.
    pub(crate) fn new_memory(&self, size: u64) -> Result<(HostRange, Source), AllocError> {
        if let Some(range) = self.reserve_slab()?.and_then(|slab| slab.take(size)) {
            return Ok((range, Source::Reserve));
        }
        let (ptr, source) = self.driver_memory(size)?;
        Ok((
            HostRange {
                base: ptr,
                offset: 0,
                bytes: size,
            },
            source,
        ))
    }

    /// The reserve segment, made (or decided against) at the first call.
    fn reserve_slab(&self) -> Result<Option<&Slab>, AllocError> {
        if let Some(slab) = self.reserve.slab.get() {
            return Ok(slab.as_ref());
        }
        let _making = self.reserve.making.lock();
        if let Some(slab) = self.reserve.slab.get() {
            return Ok(slab.as_ref());
        }
        let size = self.state.lock().config.reserve_segment_size;
        let slab = if size == 0 {
            None
        } else {
            let (base, source) = self.driver_memory(size)?;
            Some(Slab {
                base,
                source,
                used: Mutex::new(0),
            })
        };
        Ok(self.reserve.slab.get_or_init(|| slab).as_ref())
    }

    /// `allocate_host_memory_slowpath`: `cudaHostAlloc`, or the register path, in relaxed
    /// capture mode (a capture on this thread must not refuse it); timed.
    fn driver_memory(&self, size: u64) -> Result<(HostPtr, Source), AllocError> {
        let (use_register, threads) = {
            let c = &self.state.lock().config;
            (c.use_cuda_host_register, c.num_register_threads)
        };
        let driver = &*self.driver;
        let start = Instant::now();
        let previous = driver.exchange_capture_mode(CaptureMode::Relaxed)?;
        let made = if use_register {
            registered(driver, size, threads).map(|p| (p, Source::Register))
        } else {
            driver.host_alloc(size).map(|p| (p, Source::HostAlloc))
        };
        let restored = driver.exchange_capture_mode(previous);
        let elapsed = start.elapsed().as_micros() as i64;
        let made = made?;
        self.state.lock().stats.host_alloc_time.increase(elapsed);
        if let Err(e) = restored {
            let _ = self.give_back(made.0, made.1);
            return Err(e.into());
        }
        Ok(made)
    }

    /// `free_block`: the block's memory back to where it came from (reserve pieces stay in
    /// the slab, untimed, as PyTorch's).
    pub(crate) fn release(&self, block: Block) -> Result<(), AllocError> {
        if block.source == Source::Reserve {
            return Ok(());
        }
        let start = Instant::now();
        let done = self.give_back(block.range.base, block.source);
        let elapsed = start.elapsed().as_micros() as i64;
        self.state.lock().stats.host_free_time.increase(elapsed);
        Ok(done?)
    }

    /// The reserve segment's slab back to the driver (the allocator is going and no piece
    /// of it is in use).
    pub(crate) fn release_slab(&mut self) -> Result<(), DriverError> {
        match self.reserve.slab.take().flatten() {
            Some(slab) => self.give_back(slab.base, slab.source),
            None => Ok(()),
        }
    }

    fn give_back(&self, ptr: HostPtr, source: Source) -> Result<(), DriverError> {
        match source {
            Source::HostAlloc => self.driver.host_free(ptr),
            Source::Register => {
                self.driver.host_unregister(ptr)?;
                self.driver.host_mfree(ptr)
            }
            Source::Reserve => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefault_parts_follow_map_pages_for_register() {
        assert_eq!(prefault_parts(1 << 20, 1), vec![(0, 1 << 20)]);
        // Smaller than a page per thread: one part.
        assert_eq!(
            prefault_parts(8 * HOST_PAGE - 1, 8),
            vec![(0, 8 * HOST_PAGE - 1)]
        );
        let parts = prefault_parts(10_000_001, 8);
        assert_eq!(parts.len(), 8);
        assert_eq!(parts[0], (0, 1_250_000));
        assert_eq!(parts[1], (1_250_000, 1_250_000));
        // The last part runs to the end.
        let (start, len) = parts[7];
        assert_eq!((start, start + len), (8_750_000, 10_000_001));
        assert_eq!(prefault_parts(u64::MAX, 128).len(), 128);
    }
}
