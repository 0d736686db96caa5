//! [`Fft`]: cuFFT transforms through a per-device plan cache, as PyTorch runs them
//! (`exec_cufft_plan` in `aten/src/ATen/native/cuda/SpectralOps.cpp`, the cache of
//! `CuFFTPlanCache.h`).
//!
//! - **Plans are cached** by their whole transform (kind and precision, sizes, batch, both
//!   layouts): least recently used first out, at most `max_size` (PyTorch's 4 096 by
//!   default; 0 keeps none: each call makes a plan and destroys it).
//! - **Work areas come from the caching allocator**, one per execution on its stream, freed
//!   as soon as the transform is queued (stream order keeps it until the transform ran), as
//!   PyTorch's `at::empty` of the work size does: they show in the allocator's statistics
//!   and never outlive the call. Plans are made with cuFFT's own allocation turned off.
//! - **Beyond PyTorch** (its issue 94893: a cache of 4 096 plans can hold gigabytes that
//!   `empty_cache` never returns, since cuFFT keeps device memory per plan):
//!   [`Fft::set_plan_cache_max_work_bytes`] bounds the work areas of the kept plans (a
//!   plan's work size is what cuFFT reports, the best measure it gives of what a plan
//!   holds), and [`Fft::clear_plan_cache`] destroys every plan, returning what cuFFT held.
use crate::MathLibError;
use crate::device_memory::DeviceMemory;
use crate::fft_backend::FftBackend;
use crate::plan_cache::{Lookup, PlanCache};
use ferrocuda_driver::cufft::{FftDesc, FftError};
use ferrocuda_types::{DeviceIndex, DevicePtr, StreamHandle};
use parking_lot::Mutex;

/// cuFFT on one device, with its plan cache (see the module's text).
#[derive(Debug)]
pub struct Fft<B: FftBackend> {
    backend: B,
    memory: DeviceMemory,
    device: DeviceIndex,
    cache: Mutex<PlanCache<FftDesc, B::Plan>>,
}

impl<B: FftBackend> Fft<B> {
    /// Transforms on the device of `memory`'s allocator, work areas from that allocator (an
    /// `Arc<CachingAllocator>`, or `(Arc<DeviceAllocators>, device)`).
    pub fn new(backend: B, memory: impl Into<DeviceMemory>) -> Result<Fft<B>, MathLibError> {
        let memory = memory.into();
        Ok(Fft {
            backend,
            device: memory.allocator()?.device(),
            memory,
            cache: Mutex::new(PlanCache::new()),
        })
    }

    /// The backend (for its own counters).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Enqueues the transform `desc` of `input` into `output` on `stream` (`inverse` picks
    /// the direction of complex-to-complex transforms; like cuFFT, unnormalised). A
    /// complex-to-real transform may overwrite its input (cuFFT's rule; PyTorch clones it).
    pub fn execute(
        &self,
        stream: StreamHandle,
        desc: &FftDesc,
        input: DevicePtr,
        output: DevicePtr,
        inverse: bool,
    ) -> Result<(), MathLibError> {
        check_desc(desc)?;
        let mut evicted = Vec::new();
        let result = {
            let mut cache = self.cache.lock();
            let found = cache.lookup(
                desc,
                || self.backend.make_plan(self.device, desc),
                &mut evicted,
            )?;
            match found {
                Lookup::Kept(plan) => self.run(plan, stream, input, output, inverse),
                Lookup::Once(plan) => {
                    let r = self.run(&plan, stream, input, output, inverse);
                    evicted.push(plan);
                    r
                }
            }
        };
        drop(evicted);
        result
    }

    /// One execution with a work area of its own from the allocator.
    fn run(
        &self,
        plan: &B::Plan,
        stream: StreamHandle,
        input: DevicePtr,
        output: DevicePtr,
        inverse: bool,
    ) -> Result<(), MathLibError> {
        let work = self.backend.work_size(plan);
        let allocator = self.memory.allocator()?;
        let area = if work > 0 {
            Some(allocator.allocate(work, stream)?)
        } else {
            None
        };
        let at = area.as_ref().map_or(DevicePtr(0), |a| a.ptr);
        let result = self
            .backend
            .execute(plan, stream, at, (input, output), inverse);
        if let Some(a) = area {
            allocator.free(a.ptr)?;
        }
        result
    }

    /// `torch.backends.cuda.cufft_plan_cache[device].max_size`.
    pub fn plan_cache_max_size(&self) -> usize {
        self.cache.lock().max_size()
    }

    /// Sets it, destroying the least recently used plans beyond it.
    pub fn set_plan_cache_max_size(&self, max_size: usize) {
        let mut evicted = Vec::new();
        self.cache.lock().set_max_size(max_size, &mut evicted);
    }

    /// `torch.backends.cuda.cufft_plan_cache[device].size`: plans kept now.
    pub fn plan_cache_size(&self) -> usize {
        self.cache.lock().len()
    }

    /// `torch.backends.cuda.cufft_plan_cache[device].clear()`: destroys every kept plan.
    pub fn clear_plan_cache(&self) {
        let mut evicted = Vec::new();
        self.cache.lock().clear(&mut evicted);
    }

    /// ferrocuda's budget on the kept plans' work sizes (`None`, the default: no limit).
    pub fn plan_cache_max_work_bytes(&self) -> Option<u64> {
        self.cache.lock().max_work_bytes()
    }

    /// Sets it, destroying the least recently used plans until the rest fit; a plan whose
    /// work size alone is larger is then made for its call and destroyed after it.
    pub fn set_plan_cache_max_work_bytes(&self, bytes: Option<u64>) {
        let mut evicted = Vec::new();
        self.cache.lock().set_max_work_bytes(bytes, &mut evicted);
    }

    /// The work sizes of the kept plans, summed.
    pub fn plan_cache_work_bytes(&self) -> u64 {
        self.cache.lock().work_bytes()
    }

    /// The kept transforms, most recently used first.
    pub fn plan_cache_keys(&self) -> Vec<FftDesc> {
        self.cache.lock().keys()
    }
}

/// Refuses, before any library call, a transform cuFFT cannot describe: 1 to 3 dimensions
/// with layouts of the same rank, sizes, batch, embeds, strides and distances of at least 1,
/// and element counts that fit in 64 bits.
fn check_desc(desc: &FftDesc) -> Result<(), MathLibError> {
    let bad = |what: &'static str| -> Result<(), MathLibError> {
        Err(FftError::InvalidArgument(what).into())
    };
    let rank = desc.sizes.len();
    if !(1..=3).contains(&rank) || desc.input.embed.len() != rank || desc.output.embed.len() != rank
    {
        return bad("a transform has 1 to 3 dimensions, and its layouts as many");
    }
    let positive = |v: &[i64]| v.iter().all(|&x| x >= 1);
    if !positive(&desc.sizes) || desc.batch < 1 {
        return bad("sizes and batch must be at least 1");
    }
    for l in [&desc.input, &desc.output] {
        if !positive(&l.embed) || l.stride < 1 || l.dist < 1 {
            return bad("embeds, strides and distances must be at least 1");
        }
        let span = l
            .embed
            .iter()
            .try_fold(l.stride, |a, &e| a.checked_mul(e))
            .and_then(|s| s.checked_add(l.dist.checked_mul(desc.batch)?));
        if span.is_none() {
            return bad("a layout's extent does not fit in 64 bits");
        }
    }
    if desc
        .sizes
        .iter()
        .try_fold(desc.batch, |a, &n| a.checked_mul(n))
        .is_none()
    {
        return bad("the transform's element count does not fit in 64 bits");
    }
    // PyTorch's check before a half-precision plan (`CuFFTPlanCache.h`). Its other one,
    // compute capability 5.3 or more, every device CUDA 13 supports has.
    if desc.kind.real_bytes() == 2 && desc.sizes.iter().any(|&n| n.count_ones() != 1) {
        return Err(FftError::HalfSizeNotPowerOfTwo(desc.sizes.clone()).into());
    }
    Ok(())
}
