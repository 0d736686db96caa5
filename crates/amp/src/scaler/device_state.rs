//! The scaler's device-resident state: one small allocation made once, whose words keep
//! their addresses for the scaler's life, so that optimizer kernels can read `found_inf`
//! and `inv_scale` on the device and a CUDA graph can capture a whole iteration
//! (PyTorch allocates `found_inf` and `inv_scale` afresh in every `unscale_`).
use super::abi::word;
use super::error::ScalerError;
use super::kernels::word_ptr;
use super::reference;
use ferrocuda_stream::{DeviceBuffer, Event, Runtime, Stream};
use ferrocuda_types::{
    DeviceIndex, DevicePtr, Element, EventFlags, HostPtr, KernelArg, MemsetValue,
};
use std::marker::PhantomData;
use std::sync::Arc;

/// The address of one scalar of type `T` on a device: what a kernel takes to read (or
/// write) a scaler value without a host round trip.
#[derive(Debug)]
pub struct DeviceScalar<T> {
    device: DeviceIndex,
    ptr: DevicePtr,
    _element: PhantomData<fn() -> T>,
}

impl<T> Clone for DeviceScalar<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DeviceScalar<T> {}
impl<T> PartialEq for DeviceScalar<T> {
    fn eq(&self, other: &Self) -> bool {
        (self.device, self.ptr) == (other.device, other.ptr)
    }
}
impl<T> Eq for DeviceScalar<T> {}

impl<T: Element> DeviceScalar<T> {
    fn at(device: DeviceIndex, ptr: DevicePtr) -> DeviceScalar<T> {
        DeviceScalar {
            device,
            ptr,
            _element: PhantomData,
        }
    }

    /// The first element of `buffer`.
    pub fn of(buffer: &DeviceBuffer<T>) -> DeviceScalar<T> {
        DeviceScalar::at(buffer.device(), buffer.ptr())
    }

    /// The device that holds it.
    pub fn device(&self) -> DeviceIndex {
        self.device
    }

    /// Its address.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// It as a kernel argument (a pointer that knows its device).
    pub fn arg(&self) -> KernelArg<'static> {
        KernelArg::Ptr {
            device: self.device,
            ptr: self.ptr,
        }
    }
}

/// What the update kernel has counted since the scaler's state was made.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Scale updates run on the device.
    pub updates: u32,
    /// Of those, updates after an iteration with a non-finite gradient (skipped steps).
    pub skipped: u32,
    /// Skipped steps in a row up to the last update (a scale stuck in backoff shows here).
    pub consecutive_skipped: u32,
    /// Whether the last update's iteration was skipped.
    pub last_skipped: bool,
}

impl StepStats {
    fn from_words(w: &[u32]) -> StepStats {
        let at = |i: u64| w.get((i - word::UPDATES) as usize).copied().unwrap_or(0);
        StepStats {
            updates: at(word::UPDATES),
            skipped: at(word::SKIPPED),
            consecutive_skipped: at(word::CONSECUTIVE_SKIPPED),
            last_skipped: at(word::LAST_SKIPPED) != 0,
        }
    }
}

const STATS_WORDS: usize = (word::LAST_SKIPPED - word::UPDATES + 1) as usize;

/// The scaler's words on its device: scale, inverse scale, combined found_inf, the growth
/// tracker and the skip counters ([`StepStats`]).
#[derive(Debug)]
pub struct ScalerDeviceState {
    runtime: Arc<Runtime>,
    words: DeviceBuffer<i32>,
}

impl ScalerDeviceState {
    /// Allocates and fills the state on the current stream of `device`.
    pub(crate) fn new(
        runtime: &Arc<Runtime>,
        device: DeviceIndex,
        scale: f32,
        growth_tracker: i32,
    ) -> Result<ScalerDeviceState, ScalerError> {
        let mut w = [0i32; word::COUNT];
        let mut put = |i: u64, bits: u32| w[i as usize] = bits as i32;
        put(word::SCALE, scale.to_bits());
        put(word::INV_SCALE, reference::inv_scale(scale).to_bits());
        put(word::ONE, 1.0f32.to_bits());
        put(word::GROWTH_TRACKER, growth_tracker as u32);
        Ok(ScalerDeviceState {
            runtime: runtime.clone(),
            words: DeviceBuffer::from_slice(runtime, device, &w)?,
        })
    }

    fn scalar<T: Element>(&self, index: u64) -> DeviceScalar<T> {
        DeviceScalar::at(self.words.device(), word_ptr(self.words.ptr(), index))
    }

    /// The device.
    pub fn device(&self) -> DeviceIndex {
        self.words.device()
    }
    /// The scale (what the loss is multiplied by; a fused optimizer's `grad_scale`).
    pub fn scale(&self) -> DeviceScalar<f32> {
        self.scalar(word::SCALE)
    }
    /// `float(1 / double(scale))`, kept current by every update.
    pub fn inv_scale(&self) -> DeviceScalar<f32> {
        self.scalar(word::INV_SCALE)
    }
    /// The iteration's combined found_inf (0.0, or 1.0 once any gradient was non-finite).
    pub fn found_inf(&self) -> DeviceScalar<f32> {
        self.scalar(word::FOUND_INF)
    }
    /// The growth tracker (clean steps in a row since the last growth or backoff).
    pub fn growth_tracker(&self) -> DeviceScalar<i32> {
        self.scalar(word::GROWTH_TRACKER)
    }
    /// A constant 1.0: the inverse scale of a check-only pass.
    pub(crate) fn one(&self) -> DeviceScalar<f32> {
        self.scalar(word::ONE)
    }
    /// A found_inf nobody reads.
    pub(crate) fn scratch(&self) -> DeviceScalar<f32> {
        self.scalar(word::SCRATCH)
    }
    /// The state as a kernel argument (the update kernel takes all of it).
    pub(crate) fn arg(&self) -> KernelArg<'static> {
        self.words.arg()
    }

    /// Sets `*found` to 0.0 on `stream` (a memset node when captured).
    pub(crate) fn zero(
        &self,
        found: DeviceScalar<f32>,
        stream: &Stream,
    ) -> Result<(), ScalerError> {
        Ok(self.runtime.driver().memset_async(
            found.ptr,
            MemsetValue::U32(0),
            1,
            stream.handle(),
        )?)
    }

    /// All words, after the work enqueued on `stream` (a host sync).
    pub(crate) fn read(&self, stream: &Stream) -> Result<[u32; word::COUNT], ScalerError> {
        let mut w = [0u32; word::COUNT];
        self.runtime.driver().memcpy_dtoh(
            bytemuck::cast_slice_mut(&mut w),
            self.words.ptr(),
            stream.handle(),
        )?;
        Ok(w)
    }

    /// The skip counters, after the work enqueued on `stream` (a host sync).
    pub(crate) fn stats(&self, stream: &Stream) -> Result<StepStats, ScalerError> {
        let w = self.read(stream)?;
        Ok(StepStats::from_words(&w[word::UPDATES as usize..]))
    }

    /// Writes a scale (and its inverse) from the host, in `stream` order.
    pub(crate) fn write_scale(&self, scale: f32, stream: &Stream) -> Result<(), ScalerError> {
        let pair = [scale.to_bits(), reference::inv_scale(scale).to_bits()];
        self.write_words(word::SCALE, &pair, stream)
    }

    /// Writes the growth tracker from the host, in `stream` order.
    pub(crate) fn write_growth_tracker(
        &self,
        tracker: i32,
        stream: &Stream,
    ) -> Result<(), ScalerError> {
        self.write_words(word::GROWTH_TRACKER, &[tracker as u32], stream)
    }

    fn write_words(&self, first: u64, values: &[u32], stream: &Stream) -> Result<(), ScalerError> {
        // Pageable source: the driver stages it before returning, so a local is fine.
        Ok(self.runtime.driver().memcpy_htod_async(
            word_ptr(self.words.ptr(), first),
            bytemuck::cast_slice(values),
            stream.handle(),
        )?)
    }
}

/// A page-locked copy of the skip counters, filled on request and read when its copy has
/// completed: "was the last step skipped?" without making the hot path wait (PyTorch can only
/// answer it with `found_inf.item()`).
#[derive(Debug)]
pub(crate) struct StatsMirror {
    runtime: Arc<Runtime>,
    host: HostPtr,
    done: Event,
}

impl StatsMirror {
    pub(crate) fn new(runtime: &Arc<Runtime>) -> Result<StatsMirror, ScalerError> {
        let host = runtime.driver().host_alloc((STATS_WORDS * 4) as u64)?;
        Ok(StatsMirror {
            runtime: runtime.clone(),
            host,
            done: runtime.new_event(EventFlags::default())?,
        })
    }

    /// Enqueues the copy of the counters on `stream`.
    pub(crate) fn request(
        &self,
        state: &ScalerDeviceState,
        stream: &Stream,
    ) -> Result<(), ScalerError> {
        self.runtime.driver().memcpy_dtoh_pinned_async(
            (self.host, 0),
            word_ptr(state.words.ptr(), word::UPDATES),
            (STATS_WORDS * 4) as u64,
            stream.handle(),
        )?;
        Ok(self.done.record(stream)?)
    }

    /// The counters of the last request, once its copy completed; `None` before.
    pub(crate) fn poll(&self) -> Result<Option<StepStats>, ScalerError> {
        if !self.done.query()? {
            return Ok(None);
        }
        let mut w = [0u32; STATS_WORDS];
        self.runtime
            .driver()
            .host_read(self.host, 0, bytemuck::cast_slice_mut(&mut w))?;
        Ok(Some(StepStats::from_words(&w)))
    }
}

impl Drop for StatsMirror {
    fn drop(&mut self) {
        // A pending copy must not land in freed memory; nothing to report a failure to.
        let _ = self.done.synchronize();
        let _ = self.runtime.driver().host_free(self.host);
    }
}
