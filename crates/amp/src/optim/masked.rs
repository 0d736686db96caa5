//! The masked fallback: any [`DeviceOptimizer`] made to skip itself on the device, for
//! optimizers that have no fused kernel reading `found_inf`.
//!
//! A step enqueues (1) `masked_copy` snapshotting every parameter and state array into
//! preallocated scratch, (2) the inner optimizer's step, told never to skip, (3)
//! `masked_copy` copying the snapshot back. Both copies read `found_inf` first and return at
//! once when it is zero, so a clean step costs two empty launches; a skipped step costs one
//! read and one write of every byte the step can change, twice (and the inner step's own
//! work, which the restore undoes). Scratch memory: the bytes of the parameters plus the
//! inner optimizer's state (see [`Masked::scratch_bytes`]). No host sync, no allocation per
//! step, so it captures like the fused optimizers.
//!
//! The inner optimizer must keep all of its state on the device and list it in
//! [`DeviceOptimizer::state_tensors`]: host-side state would drift on skipped steps, and
//! its step must not write `found_inf`.
use super::{DeviceBytes, DeviceOptimizer, LaunchTable, OptimError, load_kernel, optional_ptr};
use crate::TensorView;
use ferrocuda_stream::{DeviceBuffer, Function, Runtime, Stream};
use ferrocuda_types::{DeviceIndex, DevicePtr, KernelArg};
use std::sync::Arc;

/// An optimizer wrapped so that a set `found_inf` leaves everything it writes unchanged.
#[derive(Debug)]
pub struct Masked<O> {
    inner: O,
    table: LaunchTable,
    scratch: DeviceBuffer<u8>,
    copy: Function,
}

impl<O: DeviceOptimizer> Masked<O> {
    /// Wraps `inner`, allocating scratch for its parameters and state.
    pub fn new(rt: &Arc<Runtime>, inner: O) -> Result<Masked<O>, OptimError> {
        let device = inner.device();
        let mut within = DeviceBytes::of(rt, device)?;
        let (mut rows, mut lens, mut offset) = (Vec::new(), Vec::new(), 0u64);
        let views = inner.params().into_iter().chain(inner.state_tensors());
        for (index, view) in views.enumerate() {
            if view.device != device {
                return Err(OptimError::DeviceMismatch {
                    index,
                    what: "parameter or state array",
                    expected: device,
                    found: view.device,
                });
            }
            view.check_range()?;
            within.add(&view)?;
            rows.extend([view.ptr.0, view.bytes(), offset]);
            lens.push(view.bytes());
            // No overflow: the views' bytes are within the device's memory.
            offset += view.bytes();
        }
        let masked = Masked {
            table: LaunchTable::new(rt, device, &rows, &lens)?,
            scratch: DeviceBuffer::uninit(rt, device, offset as usize)?,
            copy: load_kernel(rt, device, "masked_copy")?,
            inner,
        };
        rt.current_stream(device)?.synchronize()?;
        Ok(masked)
    }

    /// The wrapped optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The device bytes the fallback adds: scratch plus its launch tables.
    pub fn scratch_bytes(&self) -> u64 {
        self.scratch.bytes() + self.table.bytes()
    }

    /// Enqueues one `masked_copy`: snapshot, or restore when `restore`.
    fn copy(&self, stream: &Stream, found_inf: DevicePtr, restore: bool) -> Result<(), OptimError> {
        let device = self.inner.device();
        let restore = u32::from(restore);
        let args = [
            optional_ptr(device, Some(found_inf)),
            self.scratch.arg(),
            KernelArg::value(&restore),
        ];
        self.table.launch(stream, &self.copy, &args)
    }
}

impl<O: DeviceOptimizer> DeviceOptimizer for Masked<O> {
    fn device(&self) -> DeviceIndex {
        self.inner.device()
    }

    fn params(&self) -> Vec<TensorView> {
        self.inner.params()
    }

    fn grads(&self) -> Vec<TensorView> {
        self.inner.grads()
    }

    fn state_tensors(&self) -> Vec<TensorView> {
        self.inner.state_tensors()
    }

    fn step(&mut self, stream: &Stream, found_inf: Option<DevicePtr>) -> Result<(), OptimError> {
        let Some(found_inf) = found_inf else {
            return self.inner.step(stream, None);
        };
        self.copy(stream, found_inf, false)?;
        self.inner.step(stream, None)?;
        self.copy(stream, found_inf, true)
    }
}
