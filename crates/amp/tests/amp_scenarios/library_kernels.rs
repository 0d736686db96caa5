//! The scaler's and the optimizers' kernels on a fake device nobody registered anything on:
//! the crate provides their host twins when it loads them, keeps a twin a test registered
//! itself, and refuses a stream of another runtime.
use ferrocuda_amp::optim::{DeviceOptimizer, OptimError, Param, Sgd, SgdConfig};
use ferrocuda_amp::scaler::OptimizerId;
use ferrocuda_amp::{GradScaler, GradScalerConfig, ScaledStep, ScalerError, StepError, TensorView};
use ferrocuda_driver::FakeDriver;
use ferrocuda_stream::{DeviceBuffer, Runtime, StreamError};
use ferrocuda_types::{DeviceIndex, DevicePtr};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);

/// A runtime over a fake device with nothing registered on it.
fn bare() -> (Arc<FakeDriver>, Arc<Runtime>) {
    let fake = Arc::new(FakeDriver::default());
    (fake.clone(), Runtime::new(fake))
}

fn view(b: &DeviceBuffer<f32>) -> TensorView {
    TensorView::of(b)
}

#[test]
fn a_scaler_step_runs_on_a_bare_fake_device() -> TestResult {
    let (fake, rt) = bare();
    let mut scaler = GradScaler::new(&rt, D0, GradScalerConfig::default())?;
    let loss = DeviceBuffer::from_slice(&rt, D0, &[0.5f32])?;
    scaler.scale_in_place(&view(&loss))?;
    assert_eq!(loss.to_host()?, vec![0.5 * 65536.0]);
    let grad = DeviceBuffer::from_slice(&rt, D0, &[65536.0f32, -131072.0])?;
    let opt = OptimizerId::fresh();
    let stepped = scaler.step(opt, &[view(&grad)], || "stepped")?;
    assert_eq!(stepped, Some("stepped"));
    assert_eq!(grad.to_host()?, vec![1.0, -2.0], "unscaled");
    scaler.update()?;
    assert_eq!(scaler.growth_tracker()?, 1);
    assert!(fake.has_kernel("amp_check_unscale") && fake.has_kernel("amp_update_scale"));
    Ok(())
}

#[test]
fn an_optimizer_steps_on_a_bare_fake_device() -> TestResult {
    let (_, rt) = bare();
    let p = DeviceBuffer::from_slice(&rt, D0, &[1.0f32, 2.0])?;
    let g = DeviceBuffer::from_slice(&rt, D0, &[0.5f32, -0.5])?;
    let params = [Param {
        param: view(&p),
        grad: view(&g),
    }];
    let config = SgdConfig {
        lr: 0.5,
        ..SgdConfig::default()
    };
    let mut sgd = Sgd::new(&rt, &params, config)?;
    let stream = rt.current_stream(D0)?;
    sgd.step(&stream, None)?;
    assert_eq!(p.to_host()?, vec![0.75, 2.25]);
    assert_eq!(sgd.counts(&stream)?.taken, 1);
    Ok(())
}

#[test]
fn a_twin_the_test_registered_is_kept() -> TestResult {
    let (fake, rt) = bare();
    // A check that finds an overflow in every list, whatever it holds.
    fake.register_kernel("amp_check_unscale", |k| {
        let (found, all) = (k.arg::<DevicePtr>(2)?, k.arg::<DevicePtr>(3)?);
        k.write(found, &[1.0f32])?;
        k.write(all, &[1.0f32])
    });
    let mut scaler = GradScaler::new(&rt, D0, GradScalerConfig::default())?;
    let loss = DeviceBuffer::from_slice(&rt, D0, &[1.0f32])?;
    scaler.scale_in_place(&view(&loss))?;
    let grad = DeviceBuffer::from_slice(&rt, D0, &[1.0f32])?;
    let stepped = scaler.step(OptimizerId::fresh(), &[view(&grad)], || ())?;
    assert_eq!(stepped, None, "the test's twin ran, not the library's");
    Ok(())
}

#[test]
fn another_runtimes_stream_is_refused() -> TestResult {
    let (_, rt) = bare();
    let (_, other) = bare();
    let foreign = other.new_stream(D0, 0)?;
    assert_eq!(foreign.handle(), rt.new_stream(D0, 0)?.handle());
    let refused = |e: &StreamError| {
        matches!(e, StreamError::OtherRuntime { expected, found, .. }
            if *expected == rt.id() && *found == other.id())
    };
    let p = DeviceBuffer::from_slice(&rt, D0, &[1.0f32])?;
    let g = DeviceBuffer::from_slice(&rt, D0, &[1.0f32])?;
    let grads = vec![view(&g)];
    let mut scaler = GradScaler::new(&rt, D0, GradScalerConfig::default())?;
    for r in [
        scaler.prepare_device(&foreign, &grads),
        scaler.unscale_device(&foreign, &grads),
        scaler.update_device(&foreign),
        scaler.request_step_stats(&foreign),
    ] {
        assert!(
            matches!(&r, Err(ScalerError::Stream(e)) if refused(e)),
            "{r:?}"
        );
    }
    let params = [Param {
        param: view(&p),
        grad: view(&g),
    }];
    let mut sgd = Sgd::new(&rt, &params, SgdConfig::default())?;
    for r in [
        sgd.step(&foreign, None),
        sgd.set_lr(&foreign, 0.1),
        sgd.counts(&foreign).map(drop),
    ] {
        assert!(
            matches!(&r, Err(OptimError::Stream(e)) if refused(e)),
            "{r:?}"
        );
    }
    let mine = rt.current_stream(D0)?;
    let mut step = ScaledStep::new(scaler, sgd, grads, &mine)?;
    let r = step.run(&foreign);
    assert!(
        matches!(&r, Err(StepError::Scaler(ScalerError::Stream(e))) if refused(e)),
        "{r:?}"
    );
    step.run(&mine)?;
    assert_eq!(g.to_host()?[0].to_bits(), (1.0f32 / 65536.0).to_bits());
    Ok(())
}
