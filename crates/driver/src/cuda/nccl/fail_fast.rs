//! Communicators that fail instead of hanging: non-blocking creation
//! (`ncclCommInitRankConfig` with `blocking = 0`), the asynchronous error
//! (`ncclCommGetAsyncError`) and `ncclCommAbort`, which PyTorch's `ProcessGroupNCCL`
//! watchdog uses to turn a dead or stuck peer into an error
//! (`TORCH_NCCL_ASYNC_ERROR_HANDLING`). Both may be called from another thread while a
//! call is in progress on the communicator.
use super::super::CudaDriver;
use super::{NcclComm, NcclError, UniqueId, available, c_int, check, version};
use cudarc::nccl::sys;
use ferrocuda_types::DeviceIndex;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// `NCCL_CONFIG_UNDEF_INT`: a field left to NCCL's default.
const UNDEF: i32 = i32::MIN;

/// `NCCL_CONFIG_INITIALIZER` with `blocking` set: every other field left to NCCL. The
/// version is the loaded library's (never newer than it), the size the bindings'.
fn config(blocking: bool, loaded: i32) -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: loaded.max(0) as u32,
        blocking: i32::from(blocking),
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

impl NcclComm {
    /// Rank `rank` of `size` on `dev`, made non-blocking (`ncclCommInitRankConfig` with
    /// `blocking = 0`): the creation is waited for up to `timeout` (the peers must call too),
    /// then aborted ([`NcclError::Timeout`]) instead of blocking for ever. Later calls that
    /// NCCL takes in progress are waited for up to `timeout` as well.
    pub fn init_rank_nonblocking(
        driver: &Arc<CudaDriver>,
        dev: DeviceIndex,
        size: usize,
        id: &UniqueId,
        rank: usize,
        timeout: Duration,
    ) -> Result<NcclComm, NcclError> {
        available()?;
        if rank >= size {
            return Err(NcclError::InvalidArgument("rank must be below size"));
        }
        let (n, r) = (c_int(size, "size")?, c_int(rank, "rank")?);
        let mut cfg = config(false, version()?);
        driver.bind(dev)?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: the library is present; `dev`'s context is current; `cfg` is a valid
        // config that outlives the call; writes through a valid pointer.
        let r = unsafe { sys::ncclCommInitRankConfig(&mut comm, n, id.raw(), r, &mut cfg) };
        if r != sys::ncclResult_t::ncclInProgress {
            check(r)?;
        }
        let mut made = NcclComm::adopt(driver, comm, dev, rank, size);
        made.nonblocking = Some(timeout);
        made.wait_ready("communicator creation", timeout)?;
        Ok(made)
    }

    /// The communicator's asynchronous error (`ncclCommGetAsyncError`): `Ok` while none
    /// (or an operation still in progress), [`NcclError::Aborted`] once aborted.
    pub fn async_error(&self) -> Result<(), NcclError> {
        match self.async_state()? {
            sys::ncclResult_t::ncclInProgress => Ok(()),
            r => check(r),
        }
    }

    fn async_state(&self) -> Result<sys::ncclResult_t, NcclError> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(NcclError::Aborted);
        }
        let mut state = sys::ncclResult_t::ncclSuccess;
        let comm = self.raw.load(Ordering::Acquire) as sys::ncclComm_t;
        // SAFETY: a live communicator (not aborted); NCCL allows this from any thread.
        check(unsafe { sys::ncclCommGetAsyncError(comm, &mut state) })?;
        Ok(state)
    }

    /// Waits until the communicator is no longer in progress (a non-blocking creation or
    /// call), for at most `timeout`; past it, or on an error, aborts it.
    pub(super) fn wait_ready(
        &self,
        what: &'static str,
        timeout: Duration,
    ) -> Result<(), NcclError> {
        const SPIN: Duration = Duration::from_millis(1);
        let start = Instant::now();
        loop {
            match self.async_state()? {
                sys::ncclResult_t::ncclSuccess => return Ok(()),
                // A call in progress usually ends within microseconds: yield for the first
                // millisecond (a sleep here would be paid by every collective), then sleep.
                sys::ncclResult_t::ncclInProgress if start.elapsed() < SPIN.min(timeout) => {
                    std::thread::yield_now();
                }
                sys::ncclResult_t::ncclInProgress if start.elapsed() < timeout => {
                    std::thread::sleep(Duration::from_micros(200));
                }
                sys::ncclResult_t::ncclInProgress => {
                    let _ = self.abort();
                    return Err(NcclError::Timeout {
                        what,
                        after: timeout,
                    });
                }
                r => {
                    let e = check(r);
                    let _ = self.abort();
                    return e;
                }
            }
        }
    }

    /// Aborts the communicator (`ncclCommAbort`): its kernels in flight return, its
    /// resources go, and every later call is [`NcclError::Aborted`]. May be called from any
    /// thread, while a call is in progress too; the first call aborts, later ones do
    /// nothing.
    pub fn abort(&self) -> Result<(), NcclError> {
        if self.aborted.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let comm = self.raw.load(Ordering::Acquire) as sys::ncclComm_t;
        // SAFETY: a communicator NCCL made, aborted once (the flag above); it is never
        // used again (every call checks the flag, and drop skips the destroy).
        check(unsafe { sys::ncclCommAbort(comm) })
    }

    /// Whether [`NcclComm::abort`] ran.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }
}
