//! Counters in a shared-memory file that several processes map: PyTorch's CUDA IPC
//! reference counters (`CudaIPCRefCountersFile` in `torch/csrc/CudaIPCTypes.cpp`).
//!
//! The layout is PyTorch's `RefcountedMapAllocator` (`aten/src/ATen/MapAllocator.cpp`) over
//! a POSIX shared-memory object: 64 bytes of header whose first 4 hold how many mappings
//! are open (the last to close unlinks the name), then the `i64` counters. A producer
//! creates the file (`ALLOCATOR_MAPPED_SHAREDMEM | ALLOCATOR_MAPPED_EXCLUSIVE`), a consumer
//! opens it by name (`ALLOCATOR_MAPPED_NOCREATE`) and decrements its counter, so a PyTorch
//! process and a ferrocuda process read each other's counters.
use std::ffi::CString;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, AtomicI64, Ordering};

/// Bytes before the counters (PyTorch's `map_alloc_alignment`).
const HEADER: usize = 64;

/// A mapped counter file. Dropping it closes this process's mapping; the last one closed
/// anywhere removes the name.
pub struct SharedCounters {
    name: CString,
    base: NonNull<u8>,
    len: usize,
    slots: usize,
}

// SAFETY: the mapping is shared memory touched only through atomics; the pointer stays
// valid until `drop`, which needs exclusive access.
unsafe impl Send for SharedCounters {}
// SAFETY: as above: every access through `&self` is atomic.
unsafe impl Sync for SharedCounters {}

impl std::fmt::Debug for SharedCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedCounters")
            .field("name", &self.name)
            .field("slots", &self.slots)
            .finish()
    }
}

impl SharedCounters {
    /// Creates the file `name` (`/torch_…`, a POSIX shared-memory name) with `slots`
    /// counters, all 0; an existing name is an error.
    pub fn create(name: &str, slots: usize) -> io::Result<SharedCounters> {
        let flags = libc::O_RDWR | libc::O_CREAT | libc::O_EXCL;
        let counters = Self::map(name, slots, flags)?;
        counters.header().store(1, Ordering::SeqCst);
        Ok(counters)
    }

    /// Opens the file `name` another process created with at least `slots` counters.
    pub fn open(name: &str, slots: usize) -> io::Result<SharedCounters> {
        let counters = Self::map(name, slots, libc::O_RDWR)?;
        counters.header().fetch_add(1, Ordering::SeqCst);
        Ok(counters)
    }

    fn map(name: &str, slots: usize, flags: i32) -> io::Result<SharedCounters> {
        let c_name = CString::new(name).map_err(|_| io::ErrorKind::InvalidInput)?;
        let len = HEADER + slots * 8;
        // SAFETY: a NUL-terminated name; the descriptor is closed below on every path.
        let fd = unsafe { libc::shm_open(c_name.as_ptr(), flags, 0o600) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let result = Self::map_fd(fd, len, flags & libc::O_CREAT != 0);
        // SAFETY: `fd` is ours and open; the mapping (if any) does not need it.
        unsafe { libc::close(fd) };
        let base = match result {
            Ok(base) => base,
            Err(e) => {
                if flags & libc::O_CREAT != 0 {
                    // SAFETY: a NUL-terminated name we just created.
                    unsafe { libc::shm_unlink(c_name.as_ptr()) };
                }
                return Err(e);
            }
        };
        Ok(SharedCounters {
            name: c_name,
            base,
            len,
            slots,
        })
    }

    fn map_fd(fd: i32, len: usize, created: bool) -> io::Result<NonNull<u8>> {
        if created {
            // SAFETY: `fd` is an open shared-memory object of ours.
            if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
                return Err(io::Error::last_os_error());
            }
        } else {
            // SAFETY: a zeroed `stat` is a valid out-parameter.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: `fd` is open; writes through a valid pointer.
            if unsafe { libc::fstat(fd, &mut st) } != 0 {
                return Err(io::Error::last_os_error());
            }
            if (st.st_size as usize) < len {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "the counter file is smaller than its counters",
                ));
            }
        }
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: a fresh shared mapping of `len` bytes of an object at least that long.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        NonNull::new(p.cast::<u8>()).ok_or_else(|| io::ErrorKind::Other.into())
    }

    fn header(&self) -> &AtomicI32 {
        // SAFETY: the mapping is page-aligned, at least HEADER bytes long and lives as long
        // as `self`; every process touches these bytes only atomically.
        unsafe { &*self.base.as_ptr().cast::<AtomicI32>() }
    }

    /// Counter `slot`, or `None` past the last.
    pub fn counter(&self, slot: usize) -> Option<&AtomicI64> {
        if slot >= self.slots {
            return None;
        }
        // SAFETY: in bounds (checked), 8-byte aligned (page-aligned base, 64-byte header),
        // valid as long as `self`; every process touches counters only atomically (PyTorch's
        // plain `int64_t` decrement is one aligned store on x86-64 and aarch64).
        Some(unsafe {
            &*self
                .base
                .as_ptr()
                .add(HEADER + slot * 8)
                .cast::<AtomicI64>()
        })
    }

    /// How many counters the file holds.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The file's shared-memory name.
    pub fn name(&self) -> &str {
        self.name.to_str().unwrap_or_default()
    }
}

impl Drop for SharedCounters {
    fn drop(&mut self) {
        if self.header().fetch_sub(1, Ordering::SeqCst) == 1 {
            // SAFETY: a NUL-terminated name; unlinking a name already gone is harmless.
            unsafe { libc::shm_unlink(self.name.as_ptr()) };
        }
        // SAFETY: the mapping made in `map`, unmapped once; no reference outlives `self`.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// Process `pid`'s open descriptor `fd`, duplicated into this process (`pidfd_open`,
/// `pidfd_getfd`; Linux 5.6+, and the right to trace `pid`, as PyTorch's
/// `ExpandableSegment::fromShared` needs).
pub(crate) fn descriptor_of_process(
    pid: u32,
    fd: i32,
) -> Result<std::os::fd::OwnedFd, crate::DriverError> {
    use std::os::fd::FromRawFd;
    // (`EPERM` from `pidfd_getfd` means this process may not trace `pid`: see
    // `/proc/sys/kernel/yama/ptrace_scope`.)
    let os_error = |_: &str| crate::DriverError::OPERATING_SYSTEM;
    // SAFETY: plain system calls with integer arguments.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(os_error("pidfd_open"));
    }
    // SAFETY: `pidfd` is a descriptor we just opened; owned from here on.
    let pidfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(pidfd as i32) };
    use std::os::fd::AsRawFd;
    // SAFETY: plain system call with integer arguments.
    let local = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if local < 0 {
        return Err(os_error("pidfd_getfd"));
    }
    // SAFETY: a descriptor the kernel just made for us.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(local as i32) })
}
