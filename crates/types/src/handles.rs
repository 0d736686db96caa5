//! Ids and opaque handles.
use serde::{Deserialize, Serialize};
use std::fmt;

/// Index of a CUDA device, as `torch.cuda` numbers them (after `CUDA_VISIBLE_DEVICES`).
#[derive(
    Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct DeviceIndex(pub u16);

impl DeviceIndex {
    /// The index as a `usize`, for indexing per-device tables.
    #[inline]
    pub fn as_usize(self) -> usize {
        usize::from(self.0)
    }
}

impl fmt::Display for DeviceIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cuda:{}", self.0)
    }
}

/// A device address. Transparent over `u64` so it can be a kernel argument as is.
#[derive(
    Copy,
    Clone,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    bytemuck::Pod,
    bytemuck::Zeroable,
)]
#[repr(transparent)]
#[serde(transparent)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The address `bytes` past this one.
    #[inline]
    pub fn offset(self, bytes: u64) -> DevicePtr {
        DevicePtr(self.0 + bytes)
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A page-locked host allocation made by the driver (`cuMemHostAlloc`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct HostPtr {
    /// The host address (real driver) or a fake address (fake driver).
    pub raw: u64,
    /// Its size in bytes.
    pub bytes: u64,
}

/// A reserved range of device virtual addresses (`cuMemAddressReserve`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct VaRange {
    /// The device the range was reserved for.
    pub device: DeviceIndex,
    /// First address.
    pub base: DevicePtr,
    /// Length in bytes.
    pub bytes: u64,
}

macro_rules! device_handle {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub struct $name {
            /// The device (context) the object belongs to.
            pub device: DeviceIndex,
            /// The backend's raw value: a CUDA pointer or a fake table key.
            pub raw: u64,
        }
    };
}

device_handle!(
    /// A stream. `raw == 0` is the device's legacy default stream.
    StreamHandle
);
device_handle!(
    /// An event.
    EventHandle
);
device_handle!(
    /// A loaded module.
    ModuleHandle
);
device_handle!(
    /// A kernel inside a loaded module.
    FunctionHandle
);
device_handle!(
    /// A captured or built graph (`CUgraph`).
    GraphHandle
);
device_handle!(
    /// An instantiated graph (`CUgraphExec`).
    GraphExecHandle
);
device_handle!(
    /// Physical device memory created for the virtual-memory API (`cuMemCreate`).
    PhysHandle
);

impl StreamHandle {
    /// The legacy default stream of `device`.
    pub const fn legacy(device: DeviceIndex) -> StreamHandle {
        StreamHandle { device, raw: 0 }
    }

    /// Whether this names the legacy default stream.
    pub const fn is_legacy(&self) -> bool {
        self.raw == 0
    }
}

/// A memory pool id, as PyTorch's `MempoolId_t`: `(0, 0)` is the default pool, `(n, 0)` a
/// pool made for one graph capture, `(0, n)` a pool handle (`graph_pool_handle()`).
#[derive(
    Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct PoolId(pub u64, pub u64);

impl PoolId {
    /// The default pool.
    pub const DEFAULT: PoolId = PoolId(0, 0);

    /// A new pool id for one capture: `(n, 0)`, process-wide unique.
    pub fn for_capture() -> PoolId {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        PoolId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed), 0)
    }

    /// A new pool handle to share between captures: `(0, n)` (`graph_pool_handle()`).
    pub fn handle() -> PoolId {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        PoolId(0, NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// Whether this is the default pool (without a branch: every allocation asks).
    #[inline]
    pub fn is_default(self) -> bool {
        (self.0 | self.1) == 0
    }

    /// Whether `self == other`, without a branch per field (the allocator's hot path
    /// compares pool ids on every request).
    #[inline]
    pub fn same(self, other: PoolId) -> bool {
        ((self.0 ^ other.0) | (self.1 ^ other.1)) == 0
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.0, self.1)
    }
}

/// The 64 opaque bytes by which CUDA names device memory or an event to another process
/// (`CUipcMemHandle`, `CUipcEventHandle`; PyTorch sends them as Python `bytes`).
#[derive(Copy, Clone, PartialEq, Eq, Hash)]
pub struct IpcHandle(pub [u8; 64]);

impl IpcHandle {
    /// The handle in `bytes`, which must be exactly 64 long.
    pub fn from_slice(bytes: &[u8]) -> Option<IpcHandle> {
        bytes.try_into().ok().map(IpcHandle)
    }
}

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcHandle(")?;
        self.0[..16].iter().try_for_each(|b| write!(f, "{b:02x}"))?;
        write!(f, "…)")
    }
}
