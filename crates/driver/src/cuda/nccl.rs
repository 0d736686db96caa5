//! NCCL through cudarc's bindings (`cudarc::nccl::sys`, loaded at run time): communicators
//! on the real driver's devices and the collectives PyTorch's `ProcessGroupNCCL` issues,
//! on this driver's streams and device memory.
//!
//! - **A missing library is data.** cudarc's loader panics when libnccl or one of its
//!   symbols is missing; [`available`] looks for the library (its usual names, then the
//!   folders of [`LIBRARY_PATH_VAR`](super::libraries::LIBRARY_PATH_VAR)) and every symbol
//!   used here once, before any call reaches cudarc, so every function here returns
//!   [`NcclError::Unavailable`] instead.
//! - **Streams are checked** against the driver's registry (a stream of another device than
//!   the communicator's is [`NcclError::DeviceMismatch`]); device addresses are not
//!   dereferenced on the host (a wrong one faults on the device, as with a copy), so the
//!   layer above passes memory it owns.
//! - **One call at a time per communicator**: NCCL communicators are not thread-safe, so a
//!   [`NcclComm`] serialises its calls with a lock.
use super::CudaDriver;
use super::libraries;
use crate::DriverError;
use cudarc::nccl::sys;
use ferrocuda_types::{DType, DeviceIndex, DevicePtr, StreamHandle};
use parking_lot::Mutex;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

mod fail_fast;

/// What can go wrong with NCCL.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// libnccl (or a function this crate needs) could not be loaded.
    #[error("NCCL is not available: {0}")]
    Unavailable(String),
    /// An NCCL call failed.
    #[error("NCCL error {code} ({name})")]
    Nccl {
        /// `ncclResult_t`.
        code: u32,
        /// Its name.
        name: &'static str,
    },
    /// A driver call around NCCL failed (binding a context, finding a stream).
    #[error("CUDA driver error: {0}")]
    Driver(#[from] DriverError),
    /// NCCL has no type for this element type (`torch.int16`, `torch.bool`).
    #[error("NCCL has no data type for {0:?}")]
    UnsupportedType(DType),
    /// A stream of another device than the communicator's.
    #[error("the stream is on device {found} but the communicator on device {expected}")]
    DeviceMismatch {
        /// The communicator's device.
        expected: DeviceIndex,
        /// The stream's.
        found: DeviceIndex,
    },
    /// A count, rank or size out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// The communicator was aborted ([`NcclComm::abort`]): no call runs on it any more.
    #[error("the NCCL communicator was aborted")]
    Aborted,
    /// A non-blocking communicator's operation (its creation, or a call NCCL took in
    /// progress) did not finish within its timeout; the communicator was aborted.
    #[error("NCCL {what} did not finish within {}ms; the communicator was aborted", after.as_millis())]
    Timeout {
        /// The operation.
        what: &'static str,
        /// The timeout.
        after: std::time::Duration,
    },
}

/// The functions used here: all must be present before the first call.
const SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommInitAll",
    "ncclCommDestroy",
    "ncclCommInitRankConfig",
    "ncclCommAbort",
    "ncclCommGetAsyncError",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclReduceScatter",
    "ncclAllGather",
    "ncclSend",
    "ncclRecv",
];

/// Whether libnccl and every function used here can be loaded (looked for once).
pub fn available() -> Result<(), NcclError> {
    static FOUND: OnceLock<Result<(), NcclError>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            libraries::find(
                "nccl",
                &[],
                // SAFETY: only tries to open the library by its usual names.
                || unsafe { sys::is_culib_present() },
                // SAFETY: called once the library was found, so cudarc's loader opens it.
                || unsafe { sys::culib() },
                SYMBOLS,
            )
            .map_err(NcclError::Unavailable)
        })
        .clone()
}

fn check(r: sys::ncclResult_t) -> Result<(), NcclError> {
    use sys::ncclResult_t as R;
    let name = match r {
        R::ncclSuccess => return Ok(()),
        R::ncclUnhandledCudaError => "ncclUnhandledCudaError",
        R::ncclSystemError => "ncclSystemError",
        R::ncclInternalError => "ncclInternalError",
        R::ncclInvalidArgument => "ncclInvalidArgument",
        R::ncclInvalidUsage => "ncclInvalidUsage",
        R::ncclRemoteError => "ncclRemoteError",
        R::ncclInProgress => "ncclInProgress",
        R::ncclTimeout => "ncclTimeout",
        R::ncclNumResults => "ncclNumResults",
    };
    Err(NcclError::Nccl {
        code: r as u32,
        name,
    })
}

/// The loaded NCCL's version (`ncclGetVersion`, e.g. 22703 for 2.27.3).
pub fn version() -> Result<i32, NcclError> {
    available()?;
    let mut v = 0;
    // SAFETY: the library and symbol are present (available); writes through a valid pointer.
    check(unsafe { sys::ncclGetVersion(&mut v) })?;
    Ok(v)
}

/// NCCL's element type for `dtype`.
fn data_type(dtype: DType) -> Result<sys::ncclDataType_t, NcclError> {
    use sys::ncclDataType_t as T;
    Ok(match dtype {
        DType::U8 => T::ncclUint8,
        DType::I8 => T::ncclInt8,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        other => return Err(NcclError::UnsupportedType(other)),
    })
}

/// A reduction (`torch.distributed.ReduceOp`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Product,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Mean (NCCL's `ncclAvg`).
    Avg,
}

impl ReduceOp {
    fn raw(self) -> sys::ncclRedOp_t {
        use sys::ncclRedOp_t as O;
        match self {
            ReduceOp::Sum => O::ncclSum,
            ReduceOp::Product => O::ncclProd,
            ReduceOp::Max => O::ncclMax,
            ReduceOp::Min => O::ncclMin,
            ReduceOp::Avg => O::ncclAvg,
        }
    }
}

/// What one collective call does beyond its buffers, count and element type: the NCCL
/// function it is, and that function's operation, root or peer.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CollectiveOp {
    /// `count` elements of `send` reduced over all ranks into `recv`.
    AllReduce(ReduceOp),
    /// `count` elements of rank `root`'s `send` into every rank's `recv`.
    Broadcast {
        /// The rank whose data is copied.
        root: usize,
    },
    /// `size * count` elements of `send` reduced over ranks; rank `r` keeps block `r` in
    /// `recv`.
    ReduceScatter(ReduceOp),
    /// Every rank's `count` elements of `send`, by rank, into every rank's `recv`.
    AllGather,
    /// `count` elements of `send` to rank `peer`.
    Send {
        /// The receiving rank.
        peer: usize,
    },
    /// `count` elements from rank `peer` into `recv`.
    Recv {
        /// The sending rank.
        peer: usize,
    },
}

impl CollectiveOp {
    /// PyTorch's `OpType` name of the call (`ALLREDUCE`, `BROADCAST`, …), as its watchdog
    /// names a collective.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce(_) => "ALLREDUCE",
            CollectiveOp::Broadcast { .. } => "BROADCAST",
            CollectiveOp::ReduceScatter(_) => "REDUCE_SCATTER",
            CollectiveOp::AllGather => "ALLGATHER",
            CollectiveOp::Send { .. } => "SEND",
            CollectiveOp::Recv { .. } => "RECV",
        }
    }

    /// The rank this call names, if it is out of range for rank `rank` of a group of `size`:
    /// a broadcast's root must be a rank, a peer another rank than the caller.
    pub fn bad_rank(self, rank: usize, size: usize) -> Option<usize> {
        match self {
            CollectiveOp::Broadcast { root } if root >= size => Some(root),
            CollectiveOp::Send { peer } | CollectiveOp::Recv { peer }
                if peer >= size || peer == rank =>
            {
                Some(peer)
            }
            _ => None,
        }
    }
}

/// One rank's part of a collective call. Buffers are device addresses the caller keeps
/// alive until the stream has run the call; a send leaves `recv` unused, a receive `send`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CollectiveCall {
    /// What the call does.
    pub op: CollectiveOp,
    /// The input.
    pub send: DevicePtr,
    /// The output.
    pub recv: DevicePtr,
    /// Elements per rank as NCCL counts them (reduce-scatter's output, all-gather's input).
    pub count: usize,
    /// The element type.
    pub dtype: DType,
}

/// The 128 bytes that name a communicator across processes (`ncclUniqueId`): made by one
/// rank ([`UniqueId::new`]) and passed to the others by the caller.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct UniqueId(pub [u8; 128]);

impl UniqueId {
    /// A fresh id (`ncclGetUniqueId`).
    pub fn new() -> Result<UniqueId, NcclError> {
        available()?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: the library is present; writes through a valid pointer.
        check(unsafe { sys::ncclGetUniqueId(&mut id) })?;
        Ok(UniqueId(id.internal.map(|c| c as u8)))
    }

    fn raw(&self) -> sys::ncclUniqueId {
        sys::ncclUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

/// One rank of an NCCL communicator, on one device of a [`CudaDriver`]. Destroyed
/// (`ncclCommDestroy`) when dropped.
pub struct NcclComm {
    driver: Arc<CudaDriver>,
    /// The `ncclComm_t`, as an address (raw pointers are not `Sync`); the lock serialises
    /// calls, which NCCL requires per communicator.
    comm: Mutex<usize>,
    /// The same address, for what must not wait for a call in progress: `ncclCommAbort`
    /// and `ncclCommGetAsyncError` (NCCL allows both from another thread).
    raw: AtomicUsize,
    aborted: AtomicBool,
    /// Made non-blocking: calls may come back in progress, and are then waited for up to
    /// this long.
    nonblocking: Option<Duration>,
    device: DeviceIndex,
    rank: usize,
    size: usize,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("device", &self.device)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

fn c_int(v: usize, what: &'static str) -> Result<i32, NcclError> {
    i32::try_from(v).map_err(|_| NcclError::InvalidArgument(what))
}

impl NcclComm {
    /// Rank `rank` of `size` on `dev` (`ncclCommInitRank`): every rank calls this with the
    /// same `id`, each from its own thread or process; it returns when all have joined.
    pub fn init_rank(
        driver: &Arc<CudaDriver>,
        dev: DeviceIndex,
        size: usize,
        id: &UniqueId,
        rank: usize,
    ) -> Result<NcclComm, NcclError> {
        available()?;
        if rank >= size {
            return Err(NcclError::InvalidArgument("rank must be below size"));
        }
        let (n, r) = (c_int(size, "size")?, c_int(rank, "rank")?);
        driver.bind(dev)?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: the library is present; `dev`'s context is current (NCCL takes the current
        // device); writes through a valid pointer.
        check(unsafe { sys::ncclCommInitRank(&mut comm, n, id.raw(), r) })?;
        Ok(NcclComm::adopt(driver, comm, dev, rank, size))
    }

    /// One communicator per device of `devices`, rank `i` on `devices[i]`, all in this
    /// process (`ncclCommInitAll`).
    pub fn init_all(
        driver: &Arc<CudaDriver>,
        devices: &[DeviceIndex],
    ) -> Result<Vec<NcclComm>, NcclError> {
        available()?;
        let size = devices.len();
        let ids: Vec<i32> = devices.iter().map(|d| i32::from(d.0)).collect();
        for &d in devices {
            driver.bind(d)?;
        }
        let mut comms = vec![std::ptr::null_mut(); size];
        // SAFETY: the library is present; `comms` has room for one communicator per device
        // and `ids` lists that many device ordinals, each with its primary context retained.
        check(unsafe {
            sys::ncclCommInitAll(comms.as_mut_ptr(), c_int(size, "size")?, ids.as_ptr())
        })?;
        Ok(comms
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, (c, &d))| NcclComm::adopt(driver, c, d, rank, size))
            .collect())
    }

    fn adopt(
        driver: &Arc<CudaDriver>,
        comm: sys::ncclComm_t,
        device: DeviceIndex,
        rank: usize,
        size: usize,
    ) -> NcclComm {
        NcclComm {
            driver: driver.clone(),
            comm: Mutex::new(comm as usize),
            raw: AtomicUsize::new(comm as usize),
            aborted: AtomicBool::new(false),
            nonblocking: None,
            device,
            rank,
            size,
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The device of this rank.
    pub fn device(&self) -> DeviceIndex {
        self.device
    }

    /// Runs `f` with the communicator and the raw stream, after checking the stream.
    fn call(
        &self,
        stream: StreamHandle,
        f: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> Result<(), NcclError> {
        if stream.device != self.device {
            return Err(NcclError::DeviceMismatch {
                expected: self.device,
                found: stream.device,
            });
        }
        let s = self.driver.stream(stream)? as sys::cudaStream_t;
        let comm = self.comm.lock();
        if self.aborted.load(Ordering::Acquire) {
            return Err(NcclError::Aborted);
        }
        match (f(*comm as sys::ncclComm_t, s), self.nonblocking) {
            (sys::ncclResult_t::ncclInProgress, Some(timeout)) => {
                drop(comm);
                self.wait_ready("call", timeout)
            }
            (r, _) => check(r),
        }
    }

    /// Enqueues this rank's part of `call` on `stream` (`ncclAllReduce`, in place when the
    /// buffers are equal; `ncclBroadcast`, `ncclReduceScatter`, `ncclAllGather`, `ncclSend`,
    /// `ncclRecv`).
    pub fn collective(&self, call: &CollectiveCall, stream: StreamHandle) -> Result<(), NcclError> {
        let t = data_type(call.dtype)?;
        let other = match call.op {
            CollectiveOp::Broadcast { root } if root >= self.size => {
                return Err(NcclError::InvalidArgument("root must be a rank"));
            }
            CollectiveOp::Broadcast { root } => c_int(root, "root")?,
            CollectiveOp::Send { peer } | CollectiveOp::Recv { peer } => {
                if call.op.bad_rank(self.rank, self.size).is_some() {
                    return Err(NcclError::InvalidArgument("peer must be another rank"));
                }
                c_int(peer, "peer")?
            }
            CollectiveOp::AllReduce(_)
            | CollectiveOp::ReduceScatter(_)
            | CollectiveOp::AllGather => 0,
        };
        let (send, recv, n) = (
            call.send.0 as *const c_void,
            call.recv.0 as *mut c_void,
            call.count,
        );
        // SAFETY: a live communicator and a registered stream of its device; device
        // addresses are only dereferenced on the device.
        self.call(stream, |c, s| unsafe {
            match call.op {
                CollectiveOp::AllReduce(op) => sys::ncclAllReduce(send, recv, n, t, op.raw(), c, s),
                CollectiveOp::Broadcast { .. } => sys::ncclBroadcast(send, recv, n, t, other, c, s),
                CollectiveOp::ReduceScatter(op) => {
                    sys::ncclReduceScatter(send, recv, n, t, op.raw(), c, s)
                }
                CollectiveOp::AllGather => sys::ncclAllGather(send, recv, n, t, c, s),
                CollectiveOp::Send { .. } => sys::ncclSend(send, n, t, other, c, s),
                CollectiveOp::Recv { .. } => sys::ncclRecv(recv, n, t, other, c, s),
            }
        })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::Acquire) {
            // `ncclCommAbort` freed it.
            return;
        }
        // SAFETY: the communicator was created by NCCL and is destroyed once, here.
        // Nothing to report a failure to.
        let _ = unsafe { sys::ncclCommDestroy(*self.comm.get_mut() as sys::ncclComm_t) };
    }
}

/// Runs `f` between `ncclGroupStart` and `ncclGroupEnd`: the calls `f` makes (send and
/// recv pairs, or collectives of several communicators of this thread) are issued together.
/// The group is ended even when `f` fails; `f`'s error comes first.
pub fn group<R>(f: impl FnOnce() -> Result<R, NcclError>) -> Result<R, NcclError> {
    available()?;
    // SAFETY: the library is present.
    check(unsafe { sys::ncclGroupStart() })?;
    let out = f();
    // SAFETY: pairs with the start above.
    let end = check(unsafe { sys::ncclGroupEnd() });
    let out = out?;
    end.map(|()| out)
}
