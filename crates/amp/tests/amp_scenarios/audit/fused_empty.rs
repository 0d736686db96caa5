//! Defect 4: `step_fused` with no gradients raised. On PyTorch's
//! `_step_supports_amp_scaling` path (`torch/amp/grad_scaler.py`, `step`) an optimizer with
//! no gradients gets `found_inf = sum([]) = 0` and the scale, steps (a no-op: its fused
//! kernel has no tensors), and becomes STEPPED; nothing was recorded, so a later `update()`
//! with no other optimizer checked is "No inf checks were recorded prior to update.".
use super::{D0, Owned, TestResult, harness, live_scaler};
use ferrocuda_amp::scaler::{OptimizerId, Stage};
use ferrocuda_amp::{ScalerError, TensorView};

fn read(
    h: &ferrocuda_testkit::Harness,
    s: ferrocuda_amp::scaler::DeviceScalar<f32>,
) -> Result<f32, Box<dyn std::error::Error>> {
    let mut b = [0u8; 4];
    let stream = h.rt.current_stream(D0)?;
    h.rt.driver()
        .memcpy_dtoh(&mut b, s.ptr(), stream.handle())?;
    Ok(f32::from_le_bytes(b))
}

#[test]
fn fused_step_with_no_gradients_steps_with_nothing_found() -> TestResult {
    let h = harness();
    let mut s = live_scaler(&h, 64.0)?;
    let scale = s.device_state()?.expect("enabled").scale();
    let opt = OptimizerId::fresh();
    let args = s.step_fused(opt, &[], |a| a.copied())?.expect("enabled");
    assert_eq!(
        args.grad_scale,
        Some(scale),
        "from Ready: the scale, as PyTorch"
    );
    assert_eq!(read(&h, args.found_inf)?, 0.0, "sum of no flags");
    assert_eq!(s.stage(opt), Stage::Stepped);
    assert_eq!(
        s.step_fused(opt, &[], |_| ()).err(),
        Some(ScalerError::StepAlreadyCalled)
    );
    assert_eq!(
        s.update().err(),
        Some(ScalerError::NoInfChecksBeforeUpdate),
        "nothing was recorded"
    );
    assert_eq!(s.scale()?, 64.0);
    Ok(())
}

#[test]
fn fused_step_with_no_gradients_after_unscale_gets_no_scale() -> TestResult {
    let h = harness();
    let mut s = live_scaler(&h, 64.0)?;
    let opt = OptimizerId::fresh();
    s.unscale(opt, &[])?;
    let args = s.step_fused(opt, &[], |a| a.copied())?.expect("enabled");
    assert_eq!(args.grad_scale, None);
    assert_eq!(read(&h, args.found_inf)?, 0.0);
    assert_eq!(s.stage(opt), Stage::Stepped);
    Ok(())
}

/// Another optimizer's inf check makes the update go on; the empty one does not back the
/// scale off, and is Ready again after it.
#[test]
fn fused_step_with_no_gradients_beside_another_optimizer() -> TestResult {
    let h = harness();
    let mut s = live_scaler(&h, 64.0)?;
    let (empty, full) = (OptimizerId::fresh(), OptimizerId::fresh());
    let g = Owned::new(&h, 4, 0.0, 64.0)?;
    let grads = [TensorView::of(&g.grad)];
    s.set_growth_interval(1);
    assert!(s.step_fused(empty, &[], |a| a.is_some())?);
    assert!(s.step_fused(full, &grads, |a| a.is_some())?);
    s.update()?;
    assert_eq!(s.scale()?, 128.0, "a clean iteration grows the scale");
    assert_eq!(
        (s.stage(empty), s.stage(full)),
        (Stage::Ready, Stage::Ready)
    );
    Ok(())
}
