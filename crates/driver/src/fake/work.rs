//! Work items of fake streams and graphs, and the kernels they run.
use crate::DriverError;
use crate::fake::device_memory::Memory;
use ferrocuda_types::{DeviceIndex, DevicePtr, LaunchConfig, MemsetValue};
use std::sync::Arc;

/// A fake kernel: a host function that plays a CUDA kernel on fake device memory.
pub type HostKernel = dyn Fn(&mut KernelContext<'_>) -> Result<(), String> + Send + Sync;

/// What a fake kernel sees: its launch configuration, its arguments, and device memory.
pub struct KernelContext<'a> {
    /// Grid and block of the launch.
    pub config: LaunchConfig,
    /// The device the kernel runs on.
    pub device: DeviceIndex,
    args: &'a [Vec<u8>],
    memory: &'a mut Memory,
}

impl std::fmt::Debug for KernelContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelContext")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl KernelContext<'_> {
    /// Argument `index`, read as a `T` (its bytes must be exactly `T`'s size).
    pub fn arg<T: bytemuck::Pod>(&self, index: usize) -> Result<T, String> {
        let bytes = self
            .args
            .get(index)
            .ok_or_else(|| format!("no argument {index}"))?;
        bytemuck::try_pod_read_unaligned(bytes).map_err(|_| {
            format!(
                "argument {index} has {} bytes, not {}",
                bytes.len(),
                size_of::<T>()
            )
        })
    }

    /// Reads `n` elements at `ptr`.
    pub fn read<T: bytemuck::Pod>(&self, ptr: DevicePtr, n: usize) -> Result<Vec<T>, String> {
        let mut out = vec![T::zeroed(); n];
        self.memory
            .read(ptr, bytemuck::cast_slice_mut(&mut out))
            .map_err(|e| format!("read of {n} elements at {ptr}: {e}"))?;
        Ok(out)
    }

    /// Writes `values` at `ptr`.
    pub fn write<T: bytemuck::Pod>(&mut self, ptr: DevicePtr, values: &[T]) -> Result<(), String> {
        self.memory
            .write(ptr, bytemuck::cast_slice(values))
            .map_err(|e| format!("write of {} elements at {ptr}: {e}", values.len()))
    }
}

/// One unit of stream work (or one graph node).
#[derive(Clone)]
pub(crate) enum Work {
    Memset {
        dst: DevicePtr,
        value: MemsetValue,
        count: u64,
    },
    HostToDevice {
        dst: DevicePtr,
        bytes: Arc<[u8]>,
    },
    DeviceToDevice {
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
    },
    PinnedToDevice {
        dst: DevicePtr,
        host: u64,
        offset: u64,
        bytes: u64,
    },
    DeviceToPinned {
        host: u64,
        offset: u64,
        src: DevicePtr,
        bytes: u64,
    },
    Kernel {
        name: Arc<str>,
        kernel: Arc<HostKernel>,
        config: LaunchConfig,
        device: DeviceIndex,
        args: Arc<[Vec<u8>]>,
    },
    Graph(Arc<[Node]>),
    /// Stamps the completion time of an event's record number `generation`.
    Record {
        event: u64,
        generation: u64,
    },
    /// Waits until stream `stream` has completed `seq` items.
    Wait {
        stream: (u16, u64),
        seq: u64,
    },
    /// A graph memory node: `cuMemAllocAsync` (`alloc`) or `cuMemFreeAsync` captured.
    /// The memory stays mapped for the process, as CUDA's graph memory pool keeps it, so
    /// running the node touches nothing; launching the graph marks the allocation live or
    /// freed (see `mem_pool::launch_graph_memory`).
    GraphMemory {
        device: DeviceIndex,
        ptr: DevicePtr,
        alloc: bool,
    },
}

impl Work {
    /// A short label for DOT dumps.
    pub(crate) fn label(&self) -> String {
        match self {
            Work::Memset { count, .. } => format!("memset x{count}"),
            Work::HostToDevice { bytes, .. } => format!("memcpy HtoD {} B", bytes.len()),
            Work::DeviceToDevice { bytes, .. } => format!("memcpy DtoD {bytes} B"),
            Work::PinnedToDevice { bytes, .. } => format!("memcpy HtoD pinned {bytes} B"),
            Work::DeviceToPinned { bytes, .. } => format!("memcpy DtoH pinned {bytes} B"),
            Work::Kernel { name, .. } => format!("kernel {name}"),
            Work::Graph(nodes) => format!("graph of {}", nodes.len()),
            Work::Record { .. } => "event record".into(),
            Work::Wait { .. } => "event wait".into(),
            Work::GraphMemory { alloc: true, .. } => "mem alloc".into(),
            Work::GraphMemory { alloc: false, .. } => "mem free".into(),
        }
    }
}

/// A node of a captured graph: its work and the nodes it depends on.
#[derive(Clone)]
pub(crate) struct Node {
    pub(crate) work: Work,
    pub(crate) deps: Vec<usize>,
}

/// Runs work that touches only memory (not `Record`/`Wait`, which the scheduler handles).
pub(crate) fn execute(
    work: &Work,
    memory: &mut Memory,
    hosts: &mut std::collections::HashMap<u64, Vec<u8>>,
) -> Result<(), DriverError> {
    match work {
        Work::Memset { dst, value, count } => memory.fill(*dst, &value.element_bytes(), *count),
        Work::HostToDevice { dst, bytes } => memory.write(*dst, bytes),
        Work::DeviceToDevice { dst, src, bytes } => {
            let mut tmp = vec![0u8; *bytes as usize];
            memory.read(*src, &mut tmp)?;
            memory.write(*dst, &tmp)
        }
        Work::PinnedToDevice {
            dst,
            host,
            offset,
            bytes,
        } => {
            let h = hosts.get(host).ok_or(DriverError::ILLEGAL_ADDRESS)?;
            let range = *offset as usize..(*offset + *bytes) as usize;
            memory.write(*dst, h.get(range).ok_or(DriverError::ILLEGAL_ADDRESS)?)
        }
        Work::DeviceToPinned {
            host,
            offset,
            src,
            bytes,
        } => {
            let h = hosts.get_mut(host).ok_or(DriverError::ILLEGAL_ADDRESS)?;
            let range = *offset as usize..(*offset + *bytes) as usize;
            memory.read(*src, h.get_mut(range).ok_or(DriverError::ILLEGAL_ADDRESS)?)
        }
        Work::Kernel {
            kernel,
            config,
            device,
            args,
            ..
        } => {
            let mut ctx = KernelContext {
                config: *config,
                device: *device,
                args,
                memory,
            };
            kernel(&mut ctx).map_err(|_| DriverError::LAUNCH_FAILED)
        }
        Work::Graph(nodes) => nodes
            .iter()
            .try_for_each(|n| execute(&n.work, memory, hosts)),
        Work::Record { .. } | Work::Wait { .. } | Work::GraphMemory { .. } => Ok(()),
    }
}
