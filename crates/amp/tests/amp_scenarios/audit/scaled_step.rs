//! Defect 1: a step on gradients that were never unscaled. PyTorch's `GradScaler.step`
//! unscales the optimizer's own gradients and asserts "No inf checks were recorded for this
//! optimizer." when there were none (`torch/amp/grad_scaler.py`, `step`); here the gradient
//! list is an argument, so a list that is empty or is not the optimizer's must be refused
//! before anything steps.
use super::{D0, Owned, TestResult, harness, live_scaler};
use ferrocuda_amp::optim::{DeviceOptimizer, Sgd, SgdConfig};
use ferrocuda_amp::scaler::{OptimizerId, Stage};
use ferrocuda_amp::{GradScaler, GradScalerConfig, ScaledStep, ScalerError, StepError, TensorView};

fn sgd() -> SgdConfig {
    SgdConfig {
        lr: 0.5,
        ..SgdConfig::default()
    }
}

#[test]
fn scaled_step_refuses_an_empty_gradient_list() -> TestResult {
    let h = harness();
    let stream = h.rt.current_stream(D0)?;
    let p = Owned::new(&h, 4, 1.0, 1024.0)?;
    let optimizer = Sgd::new(&h.rt, &[p.param()], sgd())?;
    let scaler = live_scaler(&h, 1024.0)?;
    let err = ScaledStep::new(scaler, optimizer, Vec::new(), &stream)
        .expect_err("an empty list is refused");
    assert!(
        matches!(err, StepError::Scaler(ScalerError::NoInfChecksForOptimizer)),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "No inf checks were recorded for this optimizer."
    );
    assert_eq!(p.param.to_host()?, [1.0; 4], "nothing stepped");
    Ok(())
}

#[test]
fn scaled_step_refuses_gradients_that_are_not_the_optimizers() -> TestResult {
    let h = harness();
    let stream = h.rt.current_stream(D0)?;
    let (a, b) = (
        Owned::new(&h, 4, 1.0, 1024.0)?,
        Owned::new(&h, 8, 1.0, 1024.0)?,
    );
    let stranger = Owned::new(&h, 4, 0.0, 1024.0)?;
    let mine = [TensorView::of(&a.grad), TensorView::of(&b.grad)];
    let lists: [Vec<TensorView>; 4] = [
        vec![mine[0]],
        vec![mine[1], mine[0]],
        vec![TensorView::of(&stranger.grad), mine[1]],
        vec![mine[0], mine[1], mine[1]],
    ];
    for enabled in [true, false] {
        for grads in &lists {
            let optimizer = Sgd::new(&h.rt, &[a.param(), b.param()], sgd())?;
            let scaler = GradScaler::new(
                &h.rt,
                D0,
                GradScalerConfig {
                    enabled,
                    ..GradScalerConfig::default()
                },
            )?;
            let err =
                ScaledStep::new(scaler, optimizer, grads.clone(), &stream).expect_err("refused");
            assert!(
                matches!(err, StepError::GradsMismatch { given, expected: 2 } if given == grads.len()),
                "{err:?}"
            );
        }
        // The optimizer's own list, in parameter order, is accepted and steps.
        let optimizer = Sgd::new(&h.rt, &[a.param(), b.param()], sgd())?;
        assert_eq!(optimizer.grads(), mine);
        let scaler = GradScaler::new(
            &h.rt,
            D0,
            GradScalerConfig {
                init_scale: 1024.0,
                enabled,
                ..GradScalerConfig::default()
            },
        )?;
        let mut step = ScaledStep::new(scaler, optimizer, mine.to_vec(), &stream)?;
        step.run(&stream)?;
        stream.synchronize()?;
        // Enabled: the gradient 1024 is unscaled to 1, so p = 1 - 0.5 * 1; disabled: used as is.
        let want = if enabled { 0.5 } else { 1.0 - 0.5 * 1024.0 };
        assert_eq!(a.param.to_host()?, [want; 4]);
        a.param.copy_from_host(&[1.0; 4])?;
        a.grad.copy_from_host(&[1024.0; 4])?;
        b.grad.copy_from_host(&[1024.0; 8])?;
    }
    Ok(())
}

/// The sync-free pieces on their own: an empty list records no inf check, so PyTorch's
/// update would refuse; here the unscale refuses it at once.
#[test]
fn sync_free_unscale_refuses_an_empty_list() -> TestResult {
    let h = harness();
    let stream = h.rt.current_stream(D0)?;
    let mut s = live_scaler(&h, 8.0)?;
    assert_eq!(
        s.unscale_device(&stream, &[]).err(),
        Some(ScalerError::NoInfChecksForOptimizer)
    );
    assert_eq!(
        s.prepare_device(&stream, &[]).err(),
        Some(ScalerError::NoInfChecksForOptimizer)
    );
    // Disabled, both are no-ops whatever the list.
    let mut off = GradScaler::new(
        &h.rt,
        D0,
        GradScalerConfig {
            enabled: false,
            ..GradScalerConfig::default()
        },
    )?;
    off.unscale_device(&stream, &[])?;
    off.prepare_device(&stream, &[])?;
    Ok(())
}

/// PyTorch's generic step with no gradients: `unscale_` runs (stage UNSCALED) and the
/// assertion fires; the optimizer does not step.
#[test]
fn generic_step_with_no_gradients_is_pytorchs_assertion() -> TestResult {
    let h = harness();
    let mut s = live_scaler(&h, 8.0)?;
    let opt = OptimizerId::fresh();
    let mut ran = false;
    assert_eq!(
        s.step(opt, &[], || ran = true).err(),
        Some(ScalerError::NoInfChecksForOptimizer)
    );
    assert!(!ran);
    assert_eq!(s.stage(opt), Stage::Unscaled);
    assert_eq!(
        s.step(opt, &[], || ran = true).err(),
        Some(ScalerError::NoInfChecksForOptimizer),
        "again from Unscaled"
    );
    assert!(!ran);
    Ok(())
}

/// `unscale_` then `step` with another list: the second list was never unscaled, so the
/// step (generic or fused) is refused and does not run.
#[test]
fn step_after_unscale_needs_the_same_gradients() -> TestResult {
    let h = harness();
    let (a, b) = (Owned::new(&h, 4, 1.0, 8.0)?, Owned::new(&h, 4, 1.0, 8.0)?);
    let (va, vb) = ([TensorView::of(&a.grad)], [TensorView::of(&b.grad)]);
    let mut s = live_scaler(&h, 8.0)?;
    let opt = OptimizerId::fresh();
    s.unscale(opt, &va)?;
    let mut ran = false;
    assert_eq!(
        s.step(opt, &vb, || ran = true).err(),
        Some(ScalerError::GradsChanged)
    );
    assert_eq!(
        s.step_fused(opt, &vb, |_| ran = true).err(),
        Some(ScalerError::GradsChanged)
    );
    assert_eq!(
        s.step(opt, &[], || ran = true).err(),
        Some(ScalerError::GradsChanged)
    );
    assert!(!ran);
    assert_eq!(s.stage(opt), Stage::Unscaled);
    assert_eq!(s.step(opt, &va, || 7)?, Some(7), "the unscaled list steps");
    assert_eq!(b.grad.to_host()?, [8.0; 4], "b was never unscaled");
    s.update()?;
    // An empty unscale_ then a step with gradients: those were not unscaled either.
    s.unscale(opt, &[])?;
    assert_eq!(
        s.step_fused(opt, &va, |_| ran = true).err(),
        Some(ScalerError::GradsChanged)
    );
    assert!(!ran);
    Ok(())
}
