//! How a [`FakeDriver`] is configured before it starts: devices and their memory, when work
//! completes, NVML's answers, recorded address plans, pairs of devices without peer access.
use super::addresses::AddressPlan;
use super::device_memory::Memory;
use super::{Completion, FakeDriver, FakeStream, State, busy, host_register, peer};
use crate::NvmlError;
use crate::malloc_log::MallocLog;
use crate::nvml::GpuProcess;
use ferrocuda_types::{DeviceIndex, StreamFlags};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};

/// Configures a [`FakeDriver`].
#[derive(Debug, Clone)]
pub struct FakeDriverBuilder {
    pub(super) devices: usize,
    pub(super) capacity: u64,
    pub(super) completion: Completion,
    pub(super) backing: bool,
    pub(super) launch_blocking: bool,
    pub(super) nvml: Result<usize, NvmlError>,
    pub(super) processes: Vec<GpuProcess>,
    pub(super) plans: Vec<(DeviceIndex, AddressPlan)>,
    pub(super) no_peer: Vec<(u16, u16)>,
}

impl Default for FakeDriverBuilder {
    fn default() -> Self {
        FakeDriverBuilder {
            devices: 1,
            capacity: 80 << 30,
            completion: Completion::Eager,
            backing: true,
            launch_blocking: std::env::var("CUDA_LAUNCH_BLOCKING").is_ok_and(|v| v == "1"),
            processes: Vec::new(),
            nvml: Err(NvmlError::LibraryNotFound(
                "the fake device has no NVML (FakeDriverBuilder::nvml gives it one)".into(),
            )),
            plans: Vec::new(),
            no_peer: Vec::new(),
        }
    }
}

impl FakeDriverBuilder {
    /// Number of devices (default 1).
    pub fn devices(mut self, n: usize) -> Self {
        self.devices = n.min(usize::from(u16::MAX));
        self
    }
    /// Memory per device in bytes (default 80 GiB): what `mem_get_info` and the device
    /// properties report as total, so a memory fraction means what it means on a GPU of
    /// that size, and the limit above which `malloc` runs out of memory.
    pub fn capacity(mut self, bytes: u64) -> Self {
        self.capacity = bytes;
        self
    }
    /// When work completes (default eager).
    pub fn completion(mut self, c: Completion) -> Self {
        self.completion = c;
        self
    }
    /// Whether written device bytes are kept (default true). Off, writes are dropped and
    /// reads give zeros: for replays that only need addresses.
    pub fn backing(mut self, on: bool) -> Self {
        self.backing = on;
        self
    }
    /// Kernel launches complete before `launch` returns, as with `CUDA_LAUNCH_BLOCKING=1`
    /// (the default follows that variable).
    pub fn launch_blocking(mut self, on: bool) -> Self {
        self.launch_blocking = on;
        self
    }
    /// What NVML answers ([`Driver::nvml_device_count`](crate::Driver::nvml_device_count)). The default is no NVML, as on a
    /// machine without an NVIDIA driver (CI).
    pub fn nvml(mut self, answer: Result<usize, NvmlError>) -> Self {
        self.nvml = answer;
        self
    }

    /// The compute processes NVML lists on every device ([`Driver::gpu_processes`](crate::Driver::gpu_processes)); none
    /// by default.
    pub fn gpu_processes(mut self, processes: Vec<GpuProcess>) -> Self {
        self.processes = processes;
        self
    }

    /// Address mode for device `dev`: its successful `malloc`s take `plan`'s addresses in
    /// order (moved into the device's span, see [`AddressPlan`]). Replaces an earlier plan
    /// for `dev`; a plan for a device the driver does not have is never used.
    pub fn address_plan(mut self, dev: DeviceIndex, plan: AddressPlan) -> Self {
        self.plans.retain(|(d, _)| *d != dev);
        self.plans.push((dev, plan));
        self
    }

    /// The driver.
    pub fn build(self) -> FakeDriver {
        let mut memory = Memory::new(self.devices, self.capacity, self.backing);
        for (dev, plan) in &self.plans {
            memory.set_plan(*dev, plan);
        }
        let streams = (0..self.devices as u16)
            .map(|d| {
                (
                    (d, 0),
                    FakeStream::new(DeviceIndex(d), StreamFlags::default()),
                )
            })
            .collect();
        FakeDriver {
            calls: std::array::from_fn(|_| AtomicU64::new(0)),
            launch_blocking: self.launch_blocking,
            nvml: self.nvml,
            processes: self.processes,
            initialized: AtomicBool::new(false),
            hooks: Mutex::new(Vec::new()),
            hooked: AtomicBool::new(false),
            mallocs: MallocLog::default(),
            instance: super::ipc::next_instance(),
            state: Mutex::new(State {
                devices: self.devices,
                completion: self.completion,
                memory,
                streams,
                events: HashMap::new(),
                modules: HashMap::new(),
                functions: HashMap::new(),
                kernels: HashMap::new(),
                graphs: HashMap::new(),
                execs: HashMap::new(),
                hosts: HashMap::new(),
                mallocs: host_register::Mallocs::default(),
                next_host: 0x1000_0000,
                next_id: 1,
                captures: HashMap::new(),
                sticky: vec![None; self.devices],
                failures: Vec::new(),
                foreign: HashMap::new(),
                pools: Vec::new(),
                peers: peer::Peers::new(&self.no_peer),
                exports: Default::default(),
                ipc_opened: Default::default(),
                busy: busy::Busy::default(),
            }),
        }
    }
}
