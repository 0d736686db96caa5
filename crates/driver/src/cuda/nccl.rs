//! NCCL through cudarc's bindings (`cudarc::nccl::sys`, loaded at run time): communicators
//! on the real driver's devices and the collectives PyTorch's `ProcessGroupNCCL` issues,
//! on this driver's streams and device memory.
//!
//! - **A missing library is data.** cudarc's loader panics when libnccl or one of its
//!   symbols is missing; [`available`] looks for the library and every symbol used here
//!   once, before any call reaches cudarc, so every function here returns
//!   [`NcclError::Unavailable`] instead.
//! - **Streams are checked** against the driver's registry (a stream of another device than
//!   the communicator's is [`NcclError::DeviceMismatch`]); device addresses are not
//!   dereferenced on the host (a wrong one faults on the device, as with a copy), so the
//!   layer above passes memory it owns.
//! - **One call at a time per communicator**: NCCL communicators are not thread-safe, so a
//!   [`NcclComm`] serialises its calls with a lock.
use super::CudaDriver;
use crate::DriverError;
use cudarc::nccl::sys;
use ferrocuda_types::{DType, DeviceIndex, DevicePtr, StreamHandle};
use parking_lot::Mutex;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

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
}

/// The functions used here: all must be present before the first call.
const SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommInitAll",
    "ncclCommDestroy",
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
            // SAFETY: only tries to open the library by its usual names.
            if !unsafe { sys::is_culib_present() } {
                return Err(NcclError::Unavailable("libnccl was not found".into()));
            }
            // SAFETY: the library was just found, so cudarc's loader opens it (no panic).
            let lib = unsafe { sys::culib() };
            for name in SYMBOLS {
                // SAFETY: looks a symbol up without calling it.
                let found = unsafe { lib.get::<*const c_void>(name.as_bytes()) };
                if found.is_err() {
                    return Err(NcclError::Unavailable(format!("libnccl has no {name}")));
                }
            }
            Ok(())
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
        check(f(*comm as sys::ncclComm_t, s))
    }

    /// `count` elements of `send` reduced over all ranks into `recv` (`ncclAllReduce`); in
    /// place when they are equal. Ordered on `stream`.
    pub fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: StreamHandle,
    ) -> Result<(), NcclError> {
        let t = data_type(dtype)?;
        // SAFETY: a live communicator and a registered stream of its device; device
        // addresses are only dereferenced on the device.
        self.call(stream, |c, s| unsafe {
            sys::ncclAllReduce(
                send.0 as *const c_void,
                recv.0 as *mut c_void,
                count,
                t,
                op.raw(),
                c,
                s,
            )
        })
    }

    /// `count` elements of `send` on rank `root` copied into `recv` on every rank
    /// (`ncclBroadcast`).
    pub fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        root: usize,
        stream: StreamHandle,
    ) -> Result<(), NcclError> {
        let t = data_type(dtype)?;
        if root >= self.size {
            return Err(NcclError::InvalidArgument("root must be a rank"));
        }
        let root = c_int(root, "root")?;
        // SAFETY: as all_reduce.
        self.call(stream, |c, s| unsafe {
            sys::ncclBroadcast(
                send.0 as *const c_void,
                recv.0 as *mut c_void,
                count,
                t,
                root,
                c,
                s,
            )
        })
    }

    /// `size * recv_count` elements of `send` reduced over ranks; rank `r` keeps block `r`
    /// in `recv` (`ncclReduceScatter`).
    pub fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: StreamHandle,
    ) -> Result<(), NcclError> {
        let t = data_type(dtype)?;
        // SAFETY: as all_reduce.
        self.call(stream, |c, s| unsafe {
            sys::ncclReduceScatter(
                send.0 as *const c_void,
                recv.0 as *mut c_void,
                recv_count,
                t,
                op.raw(),
                c,
                s,
            )
        })
    }

    /// Every rank's `send_count` elements gathered, by rank, into `recv` on every rank
    /// (`ncclAllGather`).
    pub fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: DType,
        stream: StreamHandle,
    ) -> Result<(), NcclError> {
        let t = data_type(dtype)?;
        // SAFETY: as all_reduce.
        self.call(stream, |c, s| unsafe {
            sys::ncclAllGather(
                send.0 as *const c_void,
                recv.0 as *mut c_void,
                send_count,
                t,
                c,
                s,
            )
        })
    }

    /// Sends `count` elements to rank `peer` (`ncclSend`); pairs with its [`NcclComm::recv`].
    pub fn send(
        &self,
        buf: DevicePtr,
        count: usize,
        dtype: DType,
        peer: usize,
        stream: StreamHandle,
    ) -> Result<(), NcclError> {
        let (t, p) = (data_type(dtype)?, self.peer(peer)?);
        // SAFETY: as all_reduce.
        self.call(stream, |c, s| unsafe {
            sys::ncclSend(buf.0 as *const c_void, count, t, p, c, s)
        })
    }

    /// Receives `count` elements from rank `peer` (`ncclRecv`).
    pub fn recv(
        &self,
        buf: DevicePtr,
        count: usize,
        dtype: DType,
        peer: usize,
        stream: StreamHandle,
    ) -> Result<(), NcclError> {
        let (t, p) = (data_type(dtype)?, self.peer(peer)?);
        // SAFETY: as all_reduce.
        self.call(stream, |c, s| unsafe {
            sys::ncclRecv(buf.0 as *mut c_void, count, t, p, c, s)
        })
    }

    fn peer(&self, peer: usize) -> Result<i32, NcclError> {
        if peer >= self.size || peer == self.rank {
            return Err(NcclError::InvalidArgument("peer must be another rank"));
        }
        c_int(peer, "peer")
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
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
