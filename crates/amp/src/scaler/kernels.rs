//! The scaler's device kernels (CUDA C++ compiled by NVRTC through the runtime's kernel
//! cache) and how they are launched.
//!
//! - `amp_check_unscale`: PyTorch's `_amp_foreach_non_finite_check_and_unscale_` over any
//!   number of fp32 / fp16 / bf16 / fp64 tensors in one launch. The tensor list becomes a
//!   device table of chunks (address, length, dtype) of at most 64 KiB each, built once per
//!   list and kept while the list is unchanged ([`ChunkTable`]); each block walks chunks
//!   grid-stride and reads 16-byte vectors, four in flight per thread. A check-only pass
//!   (`inv_scale == 1.0`) writes nothing back.
//! - `amp_update_scale`: PyTorch's `_amp_update_scale_` on one thread, which also refreshes
//!   `inv_scale` (so no `unscale_` computes it again) and counts skipped steps.
//!
//! The fake device runs the host twins in [`super::host_twins`].
use super::abi::dtype_code;
use super::error::ScalerError;
use super::reference::UpdateParams;
use crate::TensorView;
use ferrocuda_stream::{DeviceBuffer, Function, Module, Runtime, Stream};
use ferrocuda_types::{DeviceIndex, DevicePtr, KernelArg, LaunchConfig, StreamHandle};
use std::sync::Arc;

/// The scaler's kernels, as CUDA C++.
pub const SCALER_KERNELS: &str = r#"
struct AmpChunk { unsigned long long ptr; unsigned int len; unsigned int dtype; };

__device__ __forceinline__ float amp_h2f(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short amp_f2h(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float amp_b2f(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
// Round to nearest even; a NaN keeps its high bits and is made quiet.
__device__ __forceinline__ unsigned short amp_f2b(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
    unsigned int up = ((x & 0x8000u) != 0u && (x & 0x17fffu) != 0u) ? 1u : 0u;
    return (unsigned short)((x >> 16) + up);
}

struct AmpF32 {
    typedef unsigned int B; enum { VEC = 4 };
    static __device__ __forceinline__ bool bad(B b) { return (b & 0x7f800000u) == 0x7f800000u; }
    static __device__ __forceinline__ B mul(B b, float inv) {
        return __float_as_uint(__uint_as_float(b) * inv);
    }
};
struct AmpF16 {
    typedef unsigned short B; enum { VEC = 8 };
    static __device__ __forceinline__ bool bad(B b) { return (b & 0x7c00u) == 0x7c00u; }
    static __device__ __forceinline__ B mul(B b, float inv) { return amp_f2h(amp_h2f(b) * inv); }
};
struct AmpBF16 {
    typedef unsigned short B; enum { VEC = 8 };
    static __device__ __forceinline__ bool bad(B b) { return (b & 0x7f80u) == 0x7f80u; }
    static __device__ __forceinline__ B mul(B b, float inv) { return amp_f2b(amp_b2f(b) * inv); }
};
struct AmpF64 {
    typedef unsigned long long B; enum { VEC = 2 };
    static __device__ __forceinline__ bool bad(B b) {
        return (b & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
    }
    static __device__ __forceinline__ B mul(B b, float inv) {
        return (B)__double_as_longlong(__longlong_as_double((long long)b) * (double)inv);
    }
};

#define AMP_UNROLL 4
template <typename T>
__device__ __forceinline__ bool amp_chunk(unsigned long long addr, unsigned int len,
                                          float inv, bool write) {
    typedef typename T::B B;
    union V { uint4 v; B e[T::VEC]; };
    bool bad = false;
    unsigned int done = 0;
    if ((addr & 15ull) == 0ull) {
        uint4* vp = (uint4*)addr;
        const unsigned int nvec = len / T::VEC;
        for (unsigned int base = threadIdx.x; base < nvec; base += blockDim.x * AMP_UNROLL) {
            V r[AMP_UNROLL];
            #pragma unroll
            for (int u = 0; u < AMP_UNROLL; ++u) {
                unsigned int j = base + u * blockDim.x;
                if (j < nvec) r[u].v = vp[j];
            }
            #pragma unroll
            for (int u = 0; u < AMP_UNROLL; ++u) {
                unsigned int j = base + u * blockDim.x;
                if (j < nvec) {
                    #pragma unroll
                    for (int k = 0; k < T::VEC; ++k) {
                        bad |= T::bad(r[u].e[k]);
                        if (write) r[u].e[k] = T::mul(r[u].e[k], inv);
                    }
                    if (write) vp[j] = r[u].v;
                }
            }
        }
        done = nvec * T::VEC;
    }
    B* p = (B*)addr;
    for (unsigned int i = done + threadIdx.x; i < len; i += blockDim.x) {
        B b = p[i];
        bad |= T::bad(b);
        if (write) p[i] = T::mul(b, inv);
    }
    return bad;
}

extern "C" __global__ void amp_check_unscale(const AmpChunk* chunks, unsigned int n_chunks,
                                             float* found_inf, float* found_inf_all,
                                             const float* inv_scale) {
    const float inv = *inv_scale;
    const bool write = inv != 1.0f;
    bool bad = false;
    for (unsigned int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const AmpChunk ch = chunks[c];
        switch (ch.dtype) {
            case 0: bad |= amp_chunk<AmpF32>(ch.ptr, ch.len, inv, write); break;
            case 1: bad |= amp_chunk<AmpF16>(ch.ptr, ch.len, inv, write); break;
            case 2: bad |= amp_chunk<AmpBF16>(ch.ptr, ch.len, inv, write); break;
            default: bad |= amp_chunk<AmpF64>(ch.ptr, ch.len, inv, write); break;
        }
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) {
        *found_inf = 1.0f;
        *found_inf_all = 1.0f;
    }
}

// state: [scale, inv_scale, found_inf, one, growth_tracker, updates, skipped, consecutive,
// last_skipped, scratch] as 32-bit words.
extern "C" __global__ void amp_update_scale(float* state, const float* found_inf,
                                            double growth_factor, double backoff_factor,
                                            int growth_interval, float min_scale,
                                            float max_scale, int clamp) {
    int* words = (int*)state;
    float scale = state[0];
    int tracker = words[4];
    const bool found = *found_inf != 0.0f;
    if (found) {
        scale = (float)((double)scale * backoff_factor);
        if (clamp & 1) scale = fmaxf(scale, min_scale);
        tracker = 0;
    } else {
        const int successful = (int)((unsigned int)tracker + 1u);
        if (successful == growth_interval) {
            float grown = (float)((double)scale * growth_factor);
            if (clamp & 2) grown = fminf(grown, max_scale);
            if ((__float_as_uint(grown) & 0x7f800000u) != 0x7f800000u) scale = grown;
            tracker = 0;
        } else {
            tracker = successful;
        }
    }
    state[0] = scale;
    state[1] = (float)(1.0 / (double)scale);
    words[4] = tracker;
    words[5] += 1;
    if (found) { words[6] += 1; words[7] += 1; words[8] = 1; }
    else { words[7] = 0; words[8] = 0; }
}
"#;

/// Bytes of gradient one chunk covers at most.
pub(crate) const CHUNK_BYTES: u64 = 64 << 10;
/// Threads per block of the check-and-unscale kernel.
const THREADS: u32 = 256;

/// The most bytes a gradient list on `device` may hold: the device's memory (no list of
/// real views is larger), and no more than one chunk table addresses.
pub(crate) fn list_limit(runtime: &Runtime, device: DeviceIndex) -> Result<u64, ScalerError> {
    let memory = runtime.device_properties(device)?.total_memory;
    Ok(memory.min(CHUNK_BYTES * u64::from(u32::MAX)))
}

/// Checks `views` before any table is built: each on `device`, of a dtype the kernel
/// takes, inside the address space; all together at most `limit` bytes and 2^32 chunks.
/// Returns the number of chunks.
pub(crate) fn check_views(
    device: DeviceIndex,
    views: &[TensorView],
    limit: u64,
) -> Result<u64, ScalerError> {
    let (mut bytes, mut chunks) = (0u64, 0u64);
    for v in views {
        if v.device != device {
            return Err(ScalerError::WrongDevice {
                expected: device,
                found: v.device,
            });
        }
        dtype_code(v.dtype)?;
        v.check_range()?;
        bytes = bytes.saturating_add(v.bytes());
        chunks = chunks.saturating_add(v.bytes().div_ceil(CHUNK_BYTES));
        // Refused at the first view past the limit: no later view is even looked at.
        if bytes > limit || chunks > u64::from(u32::MAX) {
            return Err(ScalerError::TooLarge { bytes, limit });
        }
    }
    Ok(chunks)
}

/// The chunk table of `views` (checked by [`check_views`] against `limit`) as the kernel
/// reads it: two 64-bit words per chunk, the address, then the length (low half) and the
/// dtype code (high half).
pub(crate) fn plan_chunks(
    device: DeviceIndex,
    views: &[TensorView],
    limit: u64,
) -> Result<Vec<i64>, ScalerError> {
    let chunks = check_views(device, views, limit)?;
    let mut words = Vec::with_capacity(2 * chunks as usize);
    for v in views {
        let code = dtype_code(v.dtype)?;
        let per_chunk = CHUNK_BYTES / v.dtype.size() as u64;
        let mut start = 0u64;
        while start < v.len {
            let len = per_chunk.min(v.len - start);
            let addr = v.ptr.0 + start * v.dtype.size() as u64;
            words.push(addr as i64);
            words.push((len | (u64::from(code) << 32)) as i64);
            start += len;
        }
    }
    Ok(words)
}

/// The chunk table of one gradient list on the device, kept while the list is unchanged so
/// that an iteration uploads nothing (and a captured one replays the same table).
#[derive(Debug)]
pub struct ChunkTable {
    views: Vec<TensorView>,
    table: DeviceBuffer<i64>,
    chunks: u32,
    /// Streams the table was used on (recorded with the allocator, so that dropping it
    /// never frees memory a pending launch reads).
    streams: Vec<StreamHandle>,
}

impl ChunkTable {
    /// Builds the table of `views` on `device`, uploaded on `stream`. Refuses, before
    /// building anything, a view on another device, of another dtype than f32, f16, bf16
    /// and f64, or past the end of the address space, and a list larger than the device's
    /// memory ([`ScalerError::TooLarge`]).
    pub fn new(
        runtime: &Arc<Runtime>,
        device: DeviceIndex,
        views: &[TensorView],
        stream: &Stream,
    ) -> Result<ChunkTable, ScalerError> {
        let limit = list_limit(runtime, device)?;
        let words = plan_chunks(device, views, limit)?;
        // At most 2^32 - 1 chunks: checked by `plan_chunks`.
        let chunks = u32::try_from(words.len() / 2).map_err(|_| ScalerError::TooLarge {
            bytes: views
                .iter()
                .map(TensorView::bytes)
                .fold(0, u64::saturating_add),
            limit,
        })?;
        let table = DeviceBuffer::<i64>::uninit(runtime, device, words.len())?;
        if !words.is_empty() {
            runtime.driver().memcpy_htod_async(
                table.ptr(),
                bytemuck::cast_slice(&words),
                stream.handle(),
            )?;
        }
        let mut table = ChunkTable {
            views: views.to_vec(),
            table,
            chunks,
            streams: Vec::new(),
        };
        table.used_on(stream)?;
        Ok(table)
    }

    /// Notes that `stream` reads the table.
    fn used_on(&mut self, stream: &Stream) -> Result<(), ScalerError> {
        if !self.streams.contains(&stream.handle()) {
            self.table.record_stream(stream)?;
            self.streams.push(stream.handle());
        }
        Ok(())
    }

    /// Whether this is the table of `views`.
    pub fn describes(&self, views: &[TensorView]) -> bool {
        self.views == views
    }

    /// The chunks in the table.
    pub fn chunks(&self) -> u32 {
        self.chunks
    }
}

/// The table of `views` in `slot`, rebuilt only when the list changed.
pub(crate) fn cached_table<'a>(
    slot: &'a mut Option<ChunkTable>,
    runtime: &Arc<Runtime>,
    device: DeviceIndex,
    views: &[TensorView],
    stream: &Stream,
) -> Result<&'a mut ChunkTable, ScalerError> {
    if slot.as_ref().is_some_and(|t| !t.describes(views)) {
        // The list changed: the old table goes (after its last launch, as recorded).
        *slot = None;
    }
    match *slot {
        Some(ref mut table) => Ok(table),
        None => Ok(slot.insert(ChunkTable::new(runtime, device, views, stream)?)),
    }
}

/// The loaded kernels of one device.
#[derive(Clone, Debug)]
pub(crate) struct ScalerKernels {
    check_unscale: Function,
    update_scale: Function,
}

impl ScalerKernels {
    /// Compiles (or loads from the kernel cache) the kernels for `device`.
    pub(crate) fn load(
        runtime: &Runtime,
        device: DeviceIndex,
    ) -> Result<ScalerKernels, ScalerError> {
        if let Some(fake) = runtime.fake() {
            super::host_twins::provide(fake);
        }
        let module = Module::from_cuda_source(runtime, device, "amp_scaler", SCALER_KERNELS)?;
        Ok(ScalerKernels {
            check_unscale: module.function("amp_check_unscale")?,
            update_scale: module.function("amp_update_scale")?,
        })
    }

    /// Checks and unscales every chunk of `table` by `*inv_scale`, setting `*found_inf` and
    /// `*found_inf_all` to 1.0 if any element was non-finite.
    pub(crate) fn check_unscale(
        &self,
        stream: &Stream,
        table: &mut ChunkTable,
        found_inf: KernelArg<'_>,
        found_inf_all: KernelArg<'_>,
        inv_scale: KernelArg<'_>,
    ) -> Result<(), ScalerError> {
        if table.chunks == 0 {
            return Ok(());
        }
        table.used_on(stream)?;
        let config = LaunchConfig {
            grid: (table.chunks, 1, 1),
            block: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            table.table.arg(),
            KernelArg::value(&table.chunks),
            found_inf,
            found_inf_all,
            inv_scale,
        ];
        Ok(stream.launch(&self.check_unscale, &config, &args)?)
    }

    /// Updates the scale state at `state` from `*found_inf`.
    pub(crate) fn update_scale(
        &self,
        stream: &Stream,
        state: KernelArg<'_>,
        found_inf: KernelArg<'_>,
        p: &UpdateParams,
    ) -> Result<(), ScalerError> {
        let clamp = i32::from(p.min_scale.is_some()) | (i32::from(p.max_scale.is_some()) << 1);
        let (min, max) = (p.min_scale.unwrap_or(0.0), p.max_scale.unwrap_or(0.0));
        let args = [
            state,
            found_inf,
            KernelArg::value(&p.growth_factor),
            KernelArg::value(&p.backoff_factor),
            KernelArg::value(&p.growth_interval),
            KernelArg::value(&min),
            KernelArg::value(&max),
            KernelArg::value(&clamp),
        ];
        Ok(stream.launch(&self.update_scale, &LaunchConfig::for_elements(1, 1), &args)?)
    }
}

/// The address of word `index` of a state at `base`.
pub(crate) fn word_ptr(base: DevicePtr, index: u64) -> DevicePtr {
    base.offset(index * 4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scaler::abi::code_dtype;
    use ferrocuda_types::DType;

    fn view(dtype: DType, len: u64, device: u16) -> TensorView {
        TensorView {
            device: DeviceIndex(device),
            ptr: DevicePtr(0x1000),
            len,
            dtype,
        }
    }

    #[test]
    fn chunks_cover_each_tensor_in_64_kib_pieces() -> Result<(), ScalerError> {
        let views = [
            view(DType::F32, 40_000, 0),
            view(DType::BF16, 0, 0),
            view(DType::F16, 1, 0),
        ];
        let words = plan_chunks(DeviceIndex(0), &views, u64::MAX)?;
        let chunks: Vec<(u64, u64, DType)> = words
            .chunks_exact(2)
            .map(|c| {
                (
                    c[0] as u64,
                    c[1] as u64 & 0xffff_ffff,
                    code_dtype((c[1] as u64 >> 32) as u32),
                )
            })
            .collect();
        assert_eq!(
            chunks,
            [
                (0x1000, 16384, DType::F32),
                (0x1000 + 65536, 16384, DType::F32),
                (0x1000 + 131072, 40_000 - 32768, DType::F32),
                (0x1000, 1, DType::F16),
            ]
        );
        assert_eq!(
            plan_chunks(DeviceIndex(0), &[view(DType::F32, 1, 1)], u64::MAX),
            Err(ScalerError::WrongDevice {
                expected: DeviceIndex(0),
                found: DeviceIndex(1)
            })
        );
        assert_eq!(
            plan_chunks(DeviceIndex(0), &[view(DType::I32, 1, 0)], u64::MAX),
            Err(ScalerError::UnsupportedDtype { dtype: DType::I32 })
        );
        let two = [view(DType::F32, 1000, 0), view(DType::F32, 1000, 0)];
        assert_eq!(
            plan_chunks(DeviceIndex(0), &two, 8000).map(|w| w.len()),
            Ok(4)
        );
        assert_eq!(
            plan_chunks(DeviceIndex(0), &two, 7999),
            Err(ScalerError::TooLarge {
                bytes: 8000,
                limit: 7999
            })
        );
        Ok(())
    }
}
