//! The seam under the cuFFT plan cache: [`FftBackend`], one cuFFT act at a time, with
//! [`CudaFft`] over the real library (`ferrocuda_driver::cufft`) and
//! [`FakeFft`](crate::FakeFft) on the fake device.
use crate::MathLibError;
use ferrocuda_driver::CudaDriver;
use ferrocuda_driver::cufft::{FftDesc, FftPlan};
use ferrocuda_types::{DeviceIndex, DevicePtr, StreamHandle};
use std::sync::Arc;

/// One cuFFT act at a time: plans are owned values ([`FftBackend::Plan`]), destroyed when
/// dropped; which are kept is the caller's policy.
pub trait FftBackend: Send + Sync + std::fmt::Debug {
    /// A plan, destroyed when dropped.
    type Plan: Send + std::fmt::Debug;
    /// Makes the plan for `desc` on `device`, without cuFFT's own work area; returns it
    /// with the bytes of work area each execution needs.
    fn make_plan(
        &self,
        device: DeviceIndex,
        desc: &FftDesc,
    ) -> Result<(Self::Plan, u64), MathLibError>;
    /// Bytes of work area each execution of `plan` needs.
    fn work_size(&self, plan: &Self::Plan) -> u64;
    /// Enqueues `plan` on `stream` with `work` as its work area.
    fn execute(
        &self,
        plan: &Self::Plan,
        stream: StreamHandle,
        work: DevicePtr,
        io: (DevicePtr, DevicePtr),
        inverse: bool,
    ) -> Result<(), MathLibError>;
}

/// The real cuFFT, on a [`CudaDriver`]'s devices.
#[derive(Debug)]
pub struct CudaFft {
    driver: Arc<CudaDriver>,
}

impl CudaFft {
    /// cuFFT on `driver`'s devices. Fails with [`MathLibError::Fft`] (`Unavailable`) when
    /// libcufft cannot be found (see [`ferrocuda_driver::LIBRARY_PATH_VAR`]).
    pub fn new(driver: Arc<CudaDriver>) -> Result<CudaFft, MathLibError> {
        ferrocuda_driver::cufft::available()?;
        Ok(CudaFft { driver })
    }
}

impl FftBackend for CudaFft {
    type Plan = FftPlan;

    fn make_plan(
        &self,
        device: DeviceIndex,
        desc: &FftDesc,
    ) -> Result<(FftPlan, u64), MathLibError> {
        let plan = FftPlan::create(&self.driver, device, desc)?;
        let work = plan.work_size();
        Ok((plan, work))
    }

    fn work_size(&self, plan: &FftPlan) -> u64 {
        plan.work_size()
    }

    fn execute(
        &self,
        plan: &FftPlan,
        stream: StreamHandle,
        work: DevicePtr,
        io: (DevicePtr, DevicePtr),
        inverse: bool,
    ) -> Result<(), MathLibError> {
        Ok(plan.execute(stream, work, io.0, io.1, inverse)?)
    }
}
