//! Defect 3: absurd view lengths reached the table builders. A view (or a list of views)
//! larger than its device's memory cannot be real: every public path that takes views now
//! refuses it before building anything (`TooLarge`), as it refuses one whose bytes run past
//! the end of the address space (`ViewOutOfRange`). The device here has 1 GiB, so a 16 GiB
//! view passed every old check and had its chunk tables built and launched.
use super::{D0, Owned, TestResult, view};
use ferrocuda_amp::optim::{
    AdamW, AdamWConfig, DeviceOptimizer, Masked, OptimError, Param, Sgd, SgdConfig,
    register_fake_optim_kernels,
};
use ferrocuda_amp::scaler::{ChunkTable, DeviceScalar, OptimizerId, register_fake_amp_kernels};
use ferrocuda_amp::{GradScaler, GradScalerConfig, ScaledStep, ScalerError, StepError, TensorView};
use ferrocuda_driver::{Completion, FakeDriver};
use ferrocuda_stream::{KernelCache, Runtime, Stream};
use ferrocuda_testkit::{Harness, temp_dir};
use ferrocuda_types::{DType, DevicePtr};
use std::sync::Arc;

const GIB: u64 = 1 << 30;

/// A fake device of 1 GiB with the crate's kernels.
fn small_device() -> Harness {
    let fake = Arc::new(
        FakeDriver::builder()
            .completion(Completion::Manual)
            .capacity(GIB)
            .build(),
    );
    register_fake_amp_kernels(&fake);
    register_fake_optim_kernels(&fake);
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(Some(temp_dir("kernels"))));
    Harness::new(rt, Some(fake))
}

/// Gradient lists no device of 1 GiB holds: one 16 GiB view, 2^50 elements, u64::MAX
/// elements, a view running past the end of the address space, and 64 views of 256 MiB.
fn absurd_lists() -> Vec<Vec<TensorView>> {
    let mut lists: Vec<Vec<TensorView>> = [
        view(0x1000, 1 << 32, DType::F32),
        view(0x1000, 1 << 50, DType::F32),
        view(0x1000, u64::MAX, DType::F32),
        view(u64::MAX - 8, 4, DType::F32),
    ]
    .into_iter()
    .map(|v| vec![v])
    .collect();
    lists.push(
        (0..64)
            .map(|i| view(0x1000 + i * (GIB / 4), 1 << 26, DType::F32))
            .collect(),
    );
    lists
}

fn refused(e: &ScalerError) -> bool {
    matches!(
        e,
        ScalerError::TooLarge { .. } | ScalerError::ViewOutOfRange(_)
    )
}

fn assert_refused<T>(what: &str, grads: &[TensorView], r: Result<T, ScalerError>) {
    match r {
        Err(e) if refused(&e) => {}
        Err(e) => panic!("{what} {grads:?}: refused with {e:?}, not TooLarge / ViewOutOfRange"),
        Ok(_) => panic!("{what} {grads:?}: accepted"),
    }
}

fn scaler(h: &Harness, compute_dtype: DType) -> Result<GradScaler, ScalerError> {
    let mut s = GradScaler::new(
        &h.rt,
        D0,
        GradScalerConfig {
            compute_dtype,
            ..GradScalerConfig::default()
        },
    )?;
    s.device_state()?;
    Ok(s)
}

#[test]
fn every_scaler_path_refuses_absurd_views() -> TestResult {
    let h = small_device();
    let stream: Stream = h.rt.current_stream(D0)?;
    let flag = Owned::new(&h, 1, 0.0, 1.0)?;
    let (found, one) = (DeviceScalar::of(&flag.param), DeviceScalar::of(&flag.grad));
    for grads in absurd_lists() {
        let g = grads.as_slice();
        let mut s = scaler(&h, DType::F16)?;
        if let [single] = g {
            assert_refused("scale_in_place", g, s.scale_in_place(single));
            let mut bf16 = scaler(&h, DType::BF16)?;
            assert_refused("scale_in_place (bf16)", g, bf16.scale_in_place(single));
        }
        assert_refused("unscale_device", g, s.unscale_device(&stream, g));
        assert_refused("prepare_device", g, s.prepare_device(&stream, g));
        assert_refused(
            "foreach_non_finite_check_and_unscale_",
            g,
            s.foreach_non_finite_check_and_unscale(&stream, g, found, one),
        );
        assert_refused("unscale_", g, s.unscale(OptimizerId::fresh(), g));
        assert_refused("step", g, s.step(OptimizerId::fresh(), g, || ()));
        assert_refused(
            "step_fused",
            g,
            s.step_fused(OptimizerId::fresh(), g, |_| ()),
        );
        assert_refused("ChunkTable::new", g, ChunkTable::new(&h.rt, D0, g, &stream));
    }
    Ok(())
}

fn optim_refused(e: &OptimError) -> bool {
    matches!(
        e,
        OptimError::TooLarge { .. }
            | OptimError::TooLargeForDevice { .. }
            | OptimError::ViewOutOfRange(_)
    )
}

#[test]
fn optimizer_constructors_refuse_absurd_views() -> TestResult {
    let h = small_device();
    for grads in absurd_lists() {
        let params: Vec<Param> = grads
            .iter()
            .map(|g| Param {
                param: TensorView {
                    ptr: DevicePtr(g.ptr.0),
                    ..*g
                },
                grad: *g,
            })
            .collect();
        let sgd = Sgd::new(&h.rt, &params, SgdConfig::default()).err();
        assert!(
            sgd.as_ref().is_some_and(optim_refused),
            "Sgd {grads:?}: {sgd:?}"
        );
        let adamw = AdamW::new(&h.rt, &params, AdamWConfig::default()).err();
        assert!(
            adamw.as_ref().is_some_and(optim_refused),
            "AdamW {grads:?}: {adamw:?}"
        );
        let masked = Masked::new(&h.rt, Liar(grads.clone())).err();
        assert!(
            masked.as_ref().is_some_and(optim_refused),
            "Masked {grads:?}: {masked:?}"
        );
    }
    Ok(())
}

/// A sum of parameters each under the device's size but together over it is refused too.
#[test]
fn parameters_that_add_up_past_the_device_are_refused() -> TestResult {
    let h = small_device();
    let quarter = |i: u64| view(0x1000 + i * GIB / 2, GIB / 8, DType::F32); // 512 MiB each
    let params: Vec<Param> = (0..3)
        .map(|i| Param {
            param: quarter(2 * i),
            grad: quarter(2 * i + 1),
        })
        .collect();
    let e = Sgd::new(&h.rt, &params, SgdConfig::default()).err();
    assert!(
        matches!(e, Some(OptimError::TooLargeForDevice { bytes, limit }) if bytes == 3 * GIB / 2 && limit == GIB),
        "{e:?}"
    );
    Ok(())
}

/// A `ScaledStep` over an optimizer that reports absurd gradients refuses them.
#[test]
fn scaled_step_refuses_absurd_views() -> TestResult {
    let h = small_device();
    let stream = h.rt.current_stream(D0)?;
    for grads in absurd_lists() {
        let s = scaler(&h, DType::F16)?;
        let r = ScaledStep::new(s, Liar(grads.clone()), grads.clone(), &stream);
        assert!(
            matches!(&r, Err(StepError::Scaler(e)) if refused(e)),
            "{grads:?}: {:?}",
            r.err()
        );
    }
    Ok(())
}

/// An optimizer whose parameters and gradients are whatever views it was given.
#[derive(Debug)]
struct Liar(Vec<TensorView>);

impl DeviceOptimizer for Liar {
    fn device(&self) -> ferrocuda_types::DeviceIndex {
        D0
    }
    fn params(&self) -> Vec<TensorView> {
        self.0.clone()
    }
    fn grads(&self) -> Vec<TensorView> {
        self.0.clone()
    }
    fn state_tensors(&self) -> Vec<TensorView> {
        Vec::new()
    }
    fn step(&mut self, _: &Stream, _: Option<DevicePtr>) -> Result<(), OptimError> {
        Ok(())
    }
}
