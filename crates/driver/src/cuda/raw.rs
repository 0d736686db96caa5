//! The raw baselines the benchmarks measure ferrocuda against: a kernel launch and a graph
//! launch through cudarc with nothing of ferrocuda's in between.
use super::{CudaDriver, capture_mode, check};
use crate::{Driver, DriverError};
use cudarc::driver::sys;
use ferrocuda_types::{
    CaptureMode, DeviceIndex, LaunchConfig, ModuleHandle, StreamFlags, StreamHandle,
};
use std::ffi::c_void;
use std::sync::Arc;

/// The raw baseline for launch-overhead benchmarks: one kernel launch prepared once and
/// issued through `cudarc::driver::result::launch_kernel` with no validation and no
/// allocation, as a hand-written cudarc program would. It owns its module and stream, so
/// nothing it launches on can be destroyed under it.
pub struct RawLaunch {
    driver: Arc<CudaDriver>,
    module: ModuleHandle,
    stream: StreamHandle,
    function: sys::CUfunction,
    config: LaunchConfig,
    /// The argument values; `params` points into this boxed slice (stable addresses).
    _args: Box<[u64]>,
    params: Box<[*mut c_void]>,
}

impl std::fmt::Debug for RawLaunch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawLaunch")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RawLaunch {
    /// Loads `image` on `dev`, looks up `kernel` (whose parameters must all be 8 bytes
    /// wide, e.g. pointers) and prepares its launch with `args` on a new stream.
    pub fn new(
        driver: Arc<CudaDriver>,
        dev: DeviceIndex,
        image: &[u8],
        kernel: &str,
        config: LaunchConfig,
        args: &[u64],
    ) -> Result<RawLaunch, DriverError> {
        let module = driver.module_load(dev, image)?;
        let function = driver.module_function(module, kernel)?;
        let stream = driver.stream_create(
            dev,
            StreamFlags {
                non_blocking: true,
                priority: 0,
            },
        )?;
        let mut args: Box<[u64]> = args.into();
        let params = args
            .iter_mut()
            .map(|a| a as *mut u64 as *mut c_void)
            .collect();
        Ok(RawLaunch {
            driver,
            module,
            stream,
            function: function.raw as sys::CUfunction,
            config,
            _args: args,
            params,
        })
    }

    /// The stream the launches go to.
    pub fn stream(&self) -> StreamHandle {
        self.stream
    }

    /// Issues the launch.
    pub fn launch(&mut self) -> Result<(), DriverError> {
        let c = &self.config;
        // SAFETY: the function and stream belong to this object and live until it drops;
        // `params` points at `_args`, also owned here. The caller's device pointers can at
        // worst fault on the device, never on the host.
        unsafe {
            cudarc::driver::result::launch_kernel(
                self.function,
                c.grid,
                c.block,
                c.shared_mem_bytes,
                self.stream.raw as sys::CUstream,
                &mut self.params,
            )
        }
        .map_err(|e| DriverError::from_code(e.0 as i32))
    }
}

impl RawLaunch {
    /// `launches` copies of this launch captured into a graph and instantiated, with raw
    /// driver calls: the baseline that graph replays are measured against.
    pub fn capture_chain(&mut self, launches: usize) -> Result<RawGraph, DriverError> {
        let stream = self.stream.raw as sys::CUstream;
        let mode = capture_mode(CaptureMode::ThreadLocal);
        // SAFETY: the stream belongs to this object and is live.
        check(unsafe { sys::cuStreamBeginCapture_v2(stream, mode) })?;
        let launched = (0..launches).try_for_each(|_| self.launch());
        let mut graph = std::ptr::null_mut();
        // SAFETY: the stream is capturing; writes through a valid pointer.
        let ended = check(unsafe { sys::cuStreamEndCapture(stream, &mut graph) });
        let instantiated = launched.and(ended).and_then(|()| {
            let mut exec = std::ptr::null_mut();
            // SAFETY: the capture succeeded, so `graph` is a live graph.
            check(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }).map(|()| exec)
        });
        if !graph.is_null() {
            // SAFETY: the graph is ours; the instantiated executable does not need it.
            unsafe { sys::cuGraphDestroy(graph) };
        }
        Ok(RawGraph {
            exec: instantiated?,
        })
    }

    /// Launches `graph` on this object's stream with bare `cuGraphLaunch`.
    pub fn launch_graph(&self, graph: &RawGraph) -> Result<(), DriverError> {
        // SAFETY: the stream belongs to this object and is live; the executable is owned by
        // `graph`, which is borrowed for the call.
        check(unsafe { sys::cuGraphLaunch(graph.exec, self.stream.raw as sys::CUstream) })
    }
}

/// An instantiated graph from [`RawLaunch::capture_chain`], launched with
/// [`RawLaunch::launch_graph`] (benchmark baseline).
pub struct RawGraph {
    exec: sys::CUgraphExec,
}

impl std::fmt::Debug for RawGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawGraph").finish_non_exhaustive()
    }
}

impl Drop for RawGraph {
    fn drop(&mut self) {
        // In a child forked after CUDA was initialised, libcuda must not be touched (the
        // driver's own calls refuse there; this one bypasses them).
        if crate::fork::in_bad_fork() {
            return;
        }
        // SAFETY: owned and destroyed once; launches in flight finish first.
        unsafe { sys::cuGraphExecDestroy(self.exec) };
    }
}

impl Drop for RawLaunch {
    fn drop(&mut self) {
        let _ = self.driver.stream_synchronize(self.stream);
        let _ = self.driver.stream_destroy(self.stream);
        let _ = self.driver.module_unload(self.module);
    }
}
