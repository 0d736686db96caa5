//! [`Blas`]: cuBLAS handles and workspaces for one device, as PyTorch's
//! `CublasHandlePool.cpp` keeps them.
//!
//! - **A handle per thread** (PyTorch's `DeviceThreadHandlePool`): a thread's first call
//!   takes a handle (one a finished thread gave back, else a new one) and keeps it until the
//!   thread ends; then it goes back to the pool and its workspaces to the allocator.
//! - **Every acquisition sets** the stream, the workspace for that stream and the math mode
//!   from the precision settings (`getCurrentCUDABlasHandle`), skipping what the handle
//!   already has: PyTorch makes the three cuBLAS calls every time; the handle's state is the
//!   same either way (its thread is the only user, and `cublasSetStream`, which resets the
//!   workspace, is always followed by `cublasSetWorkspace`).
//! - **Workspaces come from the caching allocator**, one per (handle, stream), allocated on
//!   that stream, so they show in its statistics as PyTorch's do. A workspace smaller than
//!   the size now chosen is replaced. (PyTorch keeps the smaller allocation and hands cuBLAS
//!   the larger size: `setCublasWorkspace`'s `emplace` does not replace an entry.)
//! - **In a pool of the caller's** ([`Blas::set_workspace_pool`]): new workspaces are
//!   allocated in a private pool (a sleepable one, whose sleep then gives them back with the
//!   rest of a server's memory); one whose pool sleeps is refused, not bound.
//! - **Inside a CUDA graph capture** [`Blas::gemm`] binds a workspace of the capture's own,
//!   from the graph's private pool (`gemm.rs`), never the stream's: see
//!   [`Blas::acquire_with`].
//! - [`Blas::clear_workspaces`] gives every workspace back (`torch._C._cuda_clearCublasWorkspaces`;
//!   PyTorch's clears the calling thread's only, since its map is per thread).
use crate::MathLibError;
use crate::backend::LtCandidate;
use crate::backend::{BlasBackend, HandleId};
use crate::device_memory::DeviceMemory;
use crate::library_choice::{BlasLibrary, LtKey};
use crate::tunable::TunableState;
use crate::workspace_config::WorkspaceSizes;
use ferrocuda_alloc::CachingAllocator;
use ferrocuda_alloc::{AllocError, Route, SleepError};
use ferrocuda_amp::precision::{self, CublasMathMode};
use ferrocuda_driver::cublas::MathMode;
use ferrocuda_types::{DeviceIndex, DevicePtr, PoolId, StreamHandle};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Weak};

/// A workspace held for one (handle, stream).
#[derive(Copy, Clone, Debug)]
struct Workspace {
    ptr: DevicePtr,
    bytes: u64,
    /// The private pool it was allocated in ([`Blas::set_workspace_pool`]), if any.
    pool: Option<PoolId>,
}

#[derive(Debug, Default)]
struct Pool {
    /// Handles of finished threads, ready for the next thread.
    free: Vec<HandleId>,
    /// Every handle made (for [`Drop`]).
    all: Vec<HandleId>,
    workspaces: FxHashMap<(HandleId, u64), Workspace>,
    /// Where new workspaces are allocated: a private pool, or the stream's default pool.
    workspace_pool: Option<PoolId>,
}

#[derive(Debug)]
struct Shared {
    backend: Arc<dyn BlasBackend>,
    memory: DeviceMemory,
    device: DeviceIndex,
    sm_major: u32,
    sizes: WorkspaceSizes,
    /// `setChosenWorkspaceSize` / `setCUDABlasLtWorkspaceSize`: -1 is none.
    cublas_override: AtomicI64,
    cublaslt_override: AtomicI64,
    lt_limit_warned: AtomicBool,
    pool: Mutex<Pool>,
    /// TunableOp's settings and results (`tuning.rs`).
    pub(crate) tunable: Mutex<TunableState>,
    pub(crate) preferred: Mutex<BlasLibrary>,
    /// cuBLASLt's heuristic answers (`gemm.rs`).
    lt_cache: Mutex<FxHashMap<LtKey, Vec<LtCandidate>>>,
}

/// A handle set up for one call: its stream and the workspace bound to it.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Bound {
    pub(crate) handle: HandleId,
    pub(crate) stream: StreamHandle,
    /// Address and bytes.
    pub(crate) workspace: (DevicePtr, u64),
}

/// What a handle was last set to (by the only thread that uses it).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
struct HandleState {
    stream: Option<u64>,
    workspace: Option<(DevicePtr, u64)>,
    mode: Option<MathMode>,
}

/// A thread's handle from one [`Blas`], given back when the thread ends.
struct Window {
    shared: Weak<Shared>,
    handle: HandleId,
    state: HandleState,
}

impl Drop for Window {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.upgrade() {
            shared.give_back(self.handle);
        }
    }
}

thread_local! {
    static WINDOWS: RefCell<Vec<Window>> = const { RefCell::new(Vec::new()) };
}

/// cuBLAS handles and workspaces for one device (see the module's text).
#[derive(Debug, Clone)]
pub struct Blas {
    shared: Arc<Shared>,
}

impl Blas {
    /// Handles on the device of `memory`'s allocator, workspaces from that allocator
    /// (an `Arc<CachingAllocator>`, or `(Arc<DeviceAllocators>, device)` for the allocators
    /// CUDA graphs capture through), sizes from the environment
    /// ([`WorkspaceSizes::from_env`]; PyTorch's warnings in [`Blas::warnings`]).
    pub fn new(
        backend: Arc<dyn BlasBackend>,
        memory: impl Into<DeviceMemory>,
    ) -> Result<Blas, MathLibError> {
        let memory = memory.into();
        let sm_major = backend.sm_major(memory.allocator()?.device())?;
        let sizes = WorkspaceSizes::from_env(|k| std::env::var(k).ok(), sm_major)?;
        Blas::with_sizes(backend, memory, sizes)
    }

    /// As [`Blas::new`], with the sizes given rather than read from the environment.
    pub fn with_sizes(
        backend: Arc<dyn BlasBackend>,
        memory: impl Into<DeviceMemory>,
        sizes: WorkspaceSizes,
    ) -> Result<Blas, MathLibError> {
        let memory = memory.into();
        let device = memory.allocator()?.device();
        let sm_major = backend.sm_major(device)?;
        Ok(Blas {
            shared: Arc::new(Shared {
                backend,
                memory,
                device,
                sm_major,
                sizes,
                cublas_override: AtomicI64::new(-1),
                cublaslt_override: AtomicI64::new(-1),
                lt_limit_warned: AtomicBool::new(false),
                pool: Mutex::new(Pool::default()),
                tunable: Mutex::new(TunableState::from_env(|k| std::env::var(k).ok())),
                preferred: Mutex::new(BlasLibrary::default()),
                lt_cache: Mutex::new(FxHashMap::default()),
            }),
        })
    }

    /// The device.
    pub fn device(&self) -> DeviceIndex {
        self.shared.device
    }

    /// The compute capability's major version of the device.
    pub fn sm_major(&self) -> u32 {
        self.shared.sm_major
    }

    pub(crate) fn backend(&self) -> &dyn BlasBackend {
        &*self.shared.backend
    }

    pub(crate) fn shared_tunable(&self) -> &Mutex<TunableState> {
        &self.shared.tunable
    }

    pub(crate) fn shared_preferred(&self) -> &Mutex<BlasLibrary> {
        &self.shared.preferred
    }

    pub(crate) fn lt_cache(&self) -> &Mutex<FxHashMap<LtKey, Vec<LtCandidate>>> {
        &self.shared.lt_cache
    }

    pub(crate) fn allocator(&self) -> Result<&CachingAllocator, MathLibError> {
        self.shared.allocator()
    }

    /// The warnings PyTorch gives for the workspace variables read (word for word).
    pub fn warnings(&self) -> &[String] {
        &self.shared.sizes.warnings
    }

    /// Bytes of each cuBLAS workspace now (`getChosenWorkspaceSize`): the override if set,
    /// else what the environment chose.
    pub fn cublas_workspace_size(&self) -> u64 {
        u64::try_from(self.shared.cublas_override.load(Ordering::Relaxed))
            .unwrap_or(self.shared.sizes.cublas)
    }

    /// Overrides the cuBLAS workspace size for later acquisitions
    /// (`setChosenWorkspaceSize`); a workspace already held that is smaller is replaced at
    /// its next use.
    pub fn set_cublas_workspace_size(&self, bytes: u64) -> Result<(), MathLibError> {
        let v = i64::try_from(bytes)
            .map_err(|_| MathLibError::WorkspaceConfig(format!("{bytes} bytes is too large")))?;
        self.shared.cublas_override.store(v, Ordering::Relaxed);
        Ok(())
    }

    /// Back to the environment's size (`resetChosenWorkspaceSize`).
    pub fn reset_cublas_workspace_size(&self) {
        self.shared.cublas_override.store(-1, Ordering::Relaxed);
    }

    /// Bytes of each cuBLASLt workspace now (`getCUDABlasLtWorkspaceSize`): unified, at most
    /// the cuBLAS size (PyTorch's warning once, in the second value the first time).
    pub fn cublaslt_workspace_size(&self) -> (u64, Option<String>) {
        let lt = u64::try_from(self.shared.cublaslt_override.load(Ordering::Relaxed))
            .unwrap_or(self.shared.sizes.cublaslt);
        let (bytes, warning) = WorkspaceSizes::effective_lt(
            self.shared.sizes.unified,
            self.cublas_workspace_size(),
            lt,
        );
        let first = warning.filter(|_| !self.shared.lt_limit_warned.swap(true, Ordering::Relaxed));
        (bytes, first)
    }

    /// Overrides the cuBLASLt workspace size (`setCUDABlasLtWorkspaceSize`).
    pub fn set_cublaslt_workspace_size(&self, bytes: u64) -> Result<(), MathLibError> {
        let v = i64::try_from(bytes)
            .map_err(|_| MathLibError::WorkspaceConfig(format!("{bytes} bytes is too large")))?;
        self.shared.cublaslt_override.store(v, Ordering::Relaxed);
        Ok(())
    }

    /// Back to the environment's cuBLASLt size (`resetCUDABlasLtWorkspaceSize`).
    pub fn reset_cublaslt_workspace_size(&self) {
        self.shared.cublaslt_override.store(-1, Ordering::Relaxed);
    }

    /// Whether cuBLASLt shares the cuBLAS workspace of its stream.
    pub fn unified_workspaces(&self) -> bool {
        self.shared.sizes.unified
    }

    /// Bytes of workspace held now, over every handle and stream.
    pub fn workspace_bytes(&self) -> u64 {
        self.shared
            .pool
            .lock()
            .workspaces
            .values()
            .map(|w| w.bytes)
            .sum()
    }

    /// Allocates the workspaces made from now on in private pool `pool` (`None`: the
    /// stream's default pool, as PyTorch does): a sleepable pool, say, so that a server's
    /// sleep gives them back with its weights (`docs/serving_memory.md`). Workspaces held
    /// already stay where they are ([`Blas::clear_workspaces`] first to move them). While a
    /// workspace's pool sleeps, a call that would bind it fails with
    /// [`SleepError::Asleep`] instead of letting cuBLAS write to unmapped memory.
    pub fn set_workspace_pool(&self, pool: Option<PoolId>) {
        self.shared.pool.lock().workspace_pool = pool;
    }

    /// Gives every workspace back to the allocator (`_cuda_clearCublasWorkspaces`).
    pub fn clear_workspaces(&self) -> Result<(), MathLibError> {
        self.shared.clear(|_| true)
    }

    /// Gives back the workspaces of `stream` (`clearCublasWorkspacesForStream`): what a
    /// stream's owner calls before destroying it.
    pub fn clear_workspaces_for_stream(&self, stream: StreamHandle) -> Result<(), MathLibError> {
        self.shared.clear(|(_, s)| s == stream.raw)
    }

    /// This thread's handle, set up for `stream` (`getCurrentCUDABlasHandle`): its stream,
    /// its workspace for that stream, and the math mode the precision settings and this
    /// thread's [`NoTf32Guard`](precision::NoTf32Guard) give.
    ///
    /// For cuBLAS calls of your own. Inside a CUDA graph capture it binds the stream's
    /// workspace as PyTorch does (one made there stays in the graph's pool until
    /// [`Blas::clear_workspaces_for_stream`]); [`Blas::gemm`] gives each capture a
    /// workspace of its own instead.
    pub fn acquire(&self, stream: StreamHandle) -> Result<HandleId, MathLibError> {
        self.acquire_with(stream, |handle| self.workspace(handle, stream))
            .map(|bound| bound.handle)
    }

    /// [`Blas::acquire`] with the workspace `workspace` gives for the handle.
    pub(crate) fn acquire_with(
        &self,
        stream: StreamHandle,
        workspace: impl FnOnce(HandleId) -> Result<(DevicePtr, u64), MathLibError>,
    ) -> Result<Bound, MathLibError> {
        let (handle, last) = self.thread_handle()?;
        // Forgotten until every step succeeded: a failure leaves the state unknown.
        self.remember(handle, HandleState::default());
        let backend = &*self.shared.backend;
        let new_stream = last.stream != Some(stream.raw);
        if new_stream {
            backend.set_stream(handle, stream)?;
        }
        let workspace = workspace(handle)?;
        if new_stream || last.workspace != Some(workspace) {
            backend.set_workspace(handle, workspace.0, workspace.1)?;
        }
        let mode = match precision::cublas_handle_math_mode(
            &precision::global(),
            precision::reduced_precision_disabled(),
        ) {
            CublasMathMode::CUBLAS_TF32_TENSOR_OP_MATH => MathMode::Tf32TensorOp,
            CublasMathMode::CUBLAS_DEFAULT_MATH => MathMode::Default,
        };
        if last.mode != Some(mode) {
            backend.set_math_mode(handle, mode)?;
        }
        self.remember(
            handle,
            HandleState {
                stream: Some(stream.raw),
                workspace: Some(workspace),
                mode: Some(mode),
            },
        );
        Ok(Bound {
            handle,
            stream,
            workspace,
        })
    }

    /// Sets `handle`'s math mode (this thread's handle, acquired), unless it has it.
    pub(crate) fn set_math_mode(
        &self,
        handle: HandleId,
        mode: MathMode,
    ) -> Result<(), MathLibError> {
        let mut state = self.state_of(handle);
        if state.mode != Some(mode) {
            state.mode = None;
            self.remember(handle, state);
            self.shared.backend.set_math_mode(handle, mode)?;
            state.mode = Some(mode);
            self.remember(handle, state);
        }
        Ok(())
    }

    fn window<R>(&self, f: impl FnOnce(Option<&mut Window>) -> R) -> R {
        WINDOWS.with(|w| {
            let mut w = w.borrow_mut();
            f(w.iter_mut()
                .find(|win| std::ptr::eq(win.shared.as_ptr(), Arc::as_ptr(&self.shared))))
        })
    }

    fn state_of(&self, handle: HandleId) -> HandleState {
        self.window(|w| w.filter(|w| w.handle == handle).map(|w| w.state))
            .unwrap_or_default()
    }

    fn remember(&self, handle: HandleId, state: HandleState) {
        self.window(|w| {
            if let Some(w) = w.filter(|w| w.handle == handle) {
                w.state = state;
            }
        });
    }

    /// The calling thread's handle and what it was last set to: the one it holds, else one
    /// from the pool or a new one (nothing known of it).
    fn thread_handle(&self) -> Result<(HandleId, HandleState), MathLibError> {
        if let Some(held) = self.window(|w| w.map(|w| (w.handle, w.state))) {
            return Ok(held);
        }
        let reused = self.shared.pool.lock().free.pop();
        let handle = match reused {
            Some(h) => h,
            None => {
                let h = self.shared.backend.create_handle(self.shared.device)?;
                self.shared.pool.lock().all.push(h);
                h
            }
        };
        WINDOWS.with(|w| {
            let mut w = w.borrow_mut();
            w.retain(|win| win.shared.strong_count() > 0);
            w.push(Window {
                shared: Arc::downgrade(&self.shared),
                handle,
                state: HandleState::default(),
            });
        });
        Ok((handle, HandleState::default()))
    }

    /// `handle`'s workspace for `stream`, and its size now: the one held if big enough,
    /// else a new one.
    pub(crate) fn workspace(
        &self,
        handle: HandleId,
        stream: StreamHandle,
    ) -> Result<(DevicePtr, u64), MathLibError> {
        let bytes = self.cublas_workspace_size();
        let allocator = self.allocator()?;
        let mut pool = self.shared.pool.lock();
        let key = (handle, stream.raw);
        let ptr = match pool.workspaces.get(&key) {
            Some(w) if w.bytes >= bytes => {
                // A workspace in a sleeping pool has no memory under it: cuBLAS would fault.
                if let Some(p) = w.pool.filter(|&p| allocator.pool_asleep(p)) {
                    return Err(AllocError::Sleep(SleepError::Asleep(p)).into());
                }
                w.ptr
            }
            held => {
                if let Some(old) = held.copied() {
                    pool.workspaces.remove(&key);
                    allocator.free(old.ptr)?;
                }
                let into = pool.workspace_pool;
                let new = match into {
                    None => allocator.allocate(bytes, stream)?,
                    Some(p) => allocate_in_pool(allocator, p, bytes, stream)?,
                };
                pool.workspaces.insert(
                    key,
                    Workspace {
                        ptr: new.ptr,
                        bytes,
                        pool: into,
                    },
                );
                new.ptr
            }
        };
        Ok((ptr, bytes))
    }
}

/// `bytes` on `stream` from private pool `pool` (routed for this one request, as
/// `torch.cuda.use_mem_pool` routes a thread's, the pool's user count as it was).
fn allocate_in_pool(
    allocator: &CachingAllocator,
    pool: PoolId,
    bytes: u64,
    stream: StreamHandle,
) -> Result<ferrocuda_alloc::Allocation, AllocError> {
    allocator.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
    let block = allocator.allocate(bytes, stream);
    allocator.end_allocate_to_pool(pool)?;
    allocator.release_pool(pool)?;
    block
}

impl Shared {
    fn allocator(&self) -> Result<&CachingAllocator, MathLibError> {
        Ok(self.memory.allocator()?)
    }

    fn give_back(&self, handle: HandleId) {
        let _ = self.clear(|(h, _)| h == handle);
        self.pool.lock().free.push(handle);
    }

    /// Frees the workspaces whose (handle, stream raw) `which` picks.
    fn clear(&self, which: impl Fn((HandleId, u64)) -> bool) -> Result<(), MathLibError> {
        let freed: Vec<Workspace> = {
            let mut pool = self.pool.lock();
            let keys: Vec<_> = pool
                .workspaces
                .keys()
                .copied()
                .filter(|&k| which(k))
                .collect();
            keys.iter()
                .filter_map(|k| pool.workspaces.remove(k))
                .collect()
        };
        if freed.is_empty() {
            return Ok(());
        }
        let allocator = self.allocator()?;
        freed
            .iter()
            .try_for_each(|w| allocator.free(w.ptr).map_err(MathLibError::from))
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let pool = std::mem::take(self.pool.get_mut());
        if let Ok(allocator) = self.memory.allocator() {
            for w in pool.workspaces.values() {
                let _ = allocator.free(w.ptr);
            }
        }
        for h in pool.all {
            self.backend.destroy_handle(h);
        }
    }
}
