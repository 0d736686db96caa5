//! The fake's pageable host memory and its registration (`malloc`, the pre-fault, and
//! `cuMemHostRegister` / `cuMemHostUnregister`): the register path of the pinned host
//! allocator. The bytes live in the fake's host table beside `cuMemHostAlloc`'s, so the host
//! methods and pinned copies read and write them alike.
use super::State;
use crate::DriverError;
use ferrocuda_types::HostPtr;
use std::collections::HashMap;

/// glibc's `malloc` returns large blocks 16 bytes past a page boundary; the fake does too,
/// so the pre-fault's rounding to pages is exercised as on a real host.
const MALLOC_OFFSET: u64 = 16;

#[derive(Debug, Default)]
struct Region {
    registered: bool,
    /// Pages touched by the pre-fault so far.
    prefaulted_pages: u64,
}

/// Allocations from `host_malloc`, by address.
#[derive(Debug, Default)]
pub(super) struct Mallocs {
    regions: HashMap<u64, Region>,
}

impl Mallocs {
    /// Whether `ptr` came from `host_malloc` (and is not freed).
    pub(super) fn contains(&self, ptr: HostPtr) -> bool {
        self.regions.contains_key(&ptr.raw)
    }
}

/// `bytes` of zeroed host memory, or out of memory when the host cannot give them (a real
/// host refuses such a request; the fake must not abort the process). The pages are
/// touched only when written, as a real allocation's.
pub(super) fn host_bytes(bytes: u64) -> Result<Vec<u8>, DriverError> {
    let len = usize::try_from(bytes).map_err(|_| DriverError::OUT_OF_MEMORY)?;
    // Asks first, fallibly (an infallible allocation that fails aborts); the zeroed
    // allocation that follows is lazily backed.
    Vec::<u8>::new()
        .try_reserve_exact(len)
        .map_err(|_| DriverError::OUT_OF_MEMORY)?;
    Ok(vec![0; len])
}

pub(super) fn malloc(st: &mut State, bytes: u64) -> Result<HostPtr, DriverError> {
    let data = host_bytes(bytes)?;
    let raw = st.next_host + MALLOC_OFFSET;
    st.next_host += (bytes.max(1) + MALLOC_OFFSET).div_ceil(4096) * 4096;
    st.hosts.insert(raw, data);
    st.mallocs.regions.insert(raw, Region::default());
    Ok(HostPtr { raw, bytes })
}

pub(super) fn prefault(
    st: &mut State,
    ptr: HostPtr,
    offset: u64,
    bytes: u64,
    page: u64,
) -> Result<(), DriverError> {
    if !page.is_power_of_two() || !st.mallocs.contains(ptr) {
        return Err(DriverError::INVALID_VALUE);
    }
    st.host_range(ptr, offset, bytes)?;
    let start = (ptr.raw + offset).next_multiple_of(page);
    let end = ptr.raw + offset + bytes;
    let buf = st
        .hosts
        .get_mut(&ptr.raw)
        .ok_or(DriverError::INVALID_VALUE)?;
    let mut touched = 0;
    for at in (start..end).step_by(page as usize) {
        buf[(at - ptr.raw) as usize] = 0;
        touched += 1;
    }
    if let Some(r) = st.mallocs.regions.get_mut(&ptr.raw) {
        r.prefaulted_pages += touched;
    }
    Ok(())
}

/// `cuMemHostRegister` (`on`) or `cuMemHostUnregister`: refused during a capture as the
/// driver's other memory calls are.
pub(super) fn register(st: &mut State, ptr: HostPtr, on: bool) -> Result<(), DriverError> {
    st.check_unsafe_call()?;
    let region = st
        .mallocs
        .regions
        .get_mut(&ptr.raw)
        .ok_or(DriverError::INVALID_VALUE)?;
    match (region.registered, on) {
        (true, true) => Err(DriverError::HOST_MEMORY_ALREADY_REGISTERED),
        (false, false) => Err(DriverError::HOST_MEMORY_NOT_REGISTERED),
        _ => {
            region.registered = on;
            Ok(())
        }
    }
}

pub(super) fn mfree(st: &mut State, ptr: HostPtr) -> Result<(), DriverError> {
    match st.mallocs.regions.get(&ptr.raw) {
        None => Err(DriverError::INVALID_VALUE),
        // Freeing registered memory would leave the driver a dangling registration.
        Some(r) if r.registered => Err(DriverError::INVALID_VALUE),
        Some(_) => {
            st.mallocs.regions.remove(&ptr.raw);
            st.hosts.remove(&ptr.raw);
            Ok(())
        }
    }
}

impl super::FakeDriver {
    /// Whether host memory from `host_malloc` is registered now (`None`: not such memory).
    pub fn host_registered(&self, ptr: HostPtr) -> Option<bool> {
        let st = self.state.lock();
        st.mallocs.regions.get(&ptr.raw).map(|r| r.registered)
    }

    /// Pages of host memory from `host_malloc` the pre-fault touched so far (`None`: not
    /// such memory).
    pub fn host_prefaulted_pages(&self, ptr: HostPtr) -> Option<u64> {
        let st = self.state.lock();
        st.mallocs.regions.get(&ptr.raw).map(|r| r.prefaulted_pages)
    }
}
