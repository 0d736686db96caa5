//! The gradient scaler on both backends: written once, run on the fake device in CI and on a
//! GPU in the bundle (`ferrocuda_testkit::both_backends!`). PyTorch's scaler tests in spirit
//! (test_cuda.py: test_grad_scaling_unscale, _update_scale, _state_dict, _run_scaling_case).
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use ferrocuda_amp::scaler::{
    DeviceScalar, OptimizerId, ScalerStateDict, Stage, StepStats, reference,
};
use ferrocuda_amp::{GradScaler, GradScalerConfig, ScalerError, TensorView};
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_testkit::Harness;
use ferrocuda_types::{CaptureMode, DType};
use half::{bf16, f16};
use support::*;

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

ferrocuda_testkit::both_backends!(
    kernels_match_the_reference_on_every_dtype,
    check_only_pass_and_found_inf_is_never_cleared,
    update_follows_pytorch_over_scripted_infs,
    clamps_floor_backoff_and_cap_growth,
    state_machine_and_its_errors,
    two_optimizers_skip_independently,
    fused_step_checks_without_unscaling,
    checkpoint_round_trip,
    disabled_scaler_is_a_pass_through,
    bf16_compute_dtype_scales_by_one_and_still_skips,
    scale_in_place_rounds_as_pytorch,
    sync_free_iteration_captures_and_replays,
);

/// Hundreds of tensors of mixed sizes (0, 1, odd, over 1 Mi) and dtypes, some unaligned,
/// with inf/NaN at random places in some: one launch each for several inverse scales, every
/// element compared with the reference.
pub fn kernels_match_the_reference_on_every_dtype(h: &Harness) -> TestResult {
    let mut scaler = scaler(h, GradScalerConfig::default())?;
    let stream = h.rt.current_stream(DEV)?;
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    for (round, inv) in [1.0 / 65536.0, (1.0f64 / 3.0) as f32, 3.7f32]
        .into_iter()
        .enumerate()
    {
        let with_inf = round != 1;
        let grads = HostGrads::random(&mut rng, 320, with_inf);
        let dev = grads.upload(h)?;
        let found = DeviceBuffer::<f32>::filled(&h.rt, DEV, 1, 0.0)?;
        let inv_buf = DeviceBuffer::<f32>::filled(&h.rt, DEV, 1, inv)?;
        scaler.foreach_non_finite_check_and_unscale(
            &stream,
            &dev.views,
            DeviceScalar::of(&found),
            DeviceScalar::of(&inv_buf),
        )?;
        let mut want = grads.clone();
        let want_found = want.unscale(inv);
        assert_eq!(want_found, with_inf, "the generator placed infs as asked");
        assert_eq!(found.to_host()?[0], if want_found { 1.0 } else { 0.0 });
        dev.assert_equals(&want, &format!("inv {inv}"))?;
    }
    Ok(())
}

/// `inv_scale == 1.0` writes nothing back (bit-exact, NaN payloads included) and a found_inf
/// that is already non-zero stays as it is (quirk 7).
pub fn check_only_pass_and_found_inf_is_never_cleared(h: &Harness) -> TestResult {
    let mut scaler = scaler(h, GradScalerConfig::default())?;
    let stream = h.rt.current_stream(DEV)?;
    let mut rng = Rng(77);
    let grads = HostGrads::random(&mut rng, 40, true);
    let dev = grads.upload(h)?;
    let found = DeviceBuffer::<f32>::filled(&h.rt, DEV, 1, 0.0)?;
    let one = DeviceBuffer::<f32>::filled(&h.rt, DEV, 1, 1.0)?;
    let args = (DeviceScalar::of(&found), DeviceScalar::of(&one));
    scaler.foreach_non_finite_check_and_unscale(&stream, &dev.views, args.0, args.1)?;
    assert_eq!(found.to_host()?, [1.0]);
    dev.assert_bits_unchanged(&grads)?;
    found.fill(5.0)?;
    let clean = HostGrads::random(&mut rng, 10, false);
    let clean_dev = clean.upload(h)?;
    scaler.foreach_non_finite_check_and_unscale(&stream, &clean_dev.views, args.0, args.1)?;
    assert_eq!(
        found.to_host()?,
        [5.0],
        "found_inf is never cleared by the kernel"
    );
    Ok(())
}

/// PyTorch's `_amp_update_scale_`, transcribed from the spec, independent of the crate's.
fn pytorch_update(
    scale: f32,
    tracker: i32,
    found: bool,
    g: f64,
    b: f64,
    interval: i32,
) -> (f32, i32) {
    if found {
        return ((scale as f64 * b) as f32, 0);
    }
    let s = tracker + 1;
    if s == interval {
        let grown = (scale as f64 * g) as f32;
        (if grown.is_finite() { grown } else { scale }, 0)
    } else {
        (scale, s)
    }
}

/// Growth and backoff over a scripted sequence of clean and overflowing iterations through
/// the sync-free path, compared after each update with PyTorch's rule; `inv_scale` and the
/// skip counters follow.
pub fn update_follows_pytorch_over_scripted_infs(h: &Harness) -> TestResult {
    for (init, g, b, interval) in [
        (4.0, 2.0, 0.25, 2),
        (65536.0, 2.0, 0.5, 3),
        (1e38, 16.0, 0.5, 1),
    ] {
        let config = GradScalerConfig {
            init_scale: init,
            growth_factor: g,
            backoff_factor: b,
            growth_interval: interval,
            ..GradScalerConfig::default()
        };
        let mut scaler = scaler(h, config)?;
        let stream = h.rt.current_stream(DEV)?;
        let grad = DeviceBuffer::<f32>::filled(&h.rt, DEV, 1000, 1.0)?;
        let views = [TensorView::of(&grad)];
        let script = [
            false, false, true, false, false, false, true, true, false, false, false,
        ];
        let (mut scale, mut tracker) = (init as f32, 0);
        let mut skipped = 0;
        for (i, &inf) in script.iter().enumerate() {
            let mut values = vec![0.5f32; 1000];
            if inf {
                values[(i * 97) % 1000] = if i % 2 == 0 { f32::INFINITY } else { f32::NAN };
            }
            grad.copy_from_host(&values)?;
            scaler.unscale_device(&stream, &views)?;
            scaler.update_device(&stream)?;
            (scale, tracker) = pytorch_update(scale, tracker, inf, g, b, interval);
            skipped += u32::from(inf);
            assert_eq!(scaler.scale()?, f64::from(scale), "iteration {i}");
            assert_eq!(scaler.growth_tracker()?, tracker, "iteration {i}");
            let state = scaler.device_state()?.expect("enabled");
            let inv = read_scalar(h, state.inv_scale())?;
            assert_eq!(inv, reference::inv_scale(scale), "inv_scale refreshed");
            let stats = scaler.step_stats()?;
            let consecutive = script[..=i].iter().rev().take_while(|&&x| x).count() as u32;
            assert_eq!(
                stats,
                StepStats {
                    updates: i as u32 + 1,
                    skipped,
                    consecutive_skipped: consecutive,
                    last_skipped: inf
                }
            );
        }
    }
    Ok(())
}

/// The optional clamps: backoff stops at `min_scale`, growth at `max_scale`.
pub fn clamps_floor_backoff_and_cap_growth(h: &Harness) -> TestResult {
    let config = GradScalerConfig {
        init_scale: 4.0,
        growth_interval: 1,
        min_scale: Some(1.0),
        max_scale: Some(16.0),
        ..GradScalerConfig::default()
    };
    let mut s = scaler(h, config)?;
    let stream = h.rt.current_stream(DEV)?;
    let grad = DeviceBuffer::<f32>::filled(&h.rt, DEV, 8, f32::INFINITY)?;
    let views = [TensorView::of(&grad)];
    let mut seen = Vec::new();
    for _ in 0..4 {
        s.unscale_device(&stream, &views)?;
        s.update_device(&stream)?;
        seen.push(s.scale()?);
    }
    grad.fill(1.0)?;
    for _ in 0..6 {
        s.unscale_device(&stream, &views)?;
        s.update_device(&stream)?;
        seen.push(s.scale()?);
    }
    assert_eq!(seen, [2.0, 1.0, 1.0, 1.0, 2.0, 4.0, 8.0, 16.0, 16.0, 16.0]);
    let bad = GradScalerConfig {
        min_scale: Some(2.0),
        max_scale: Some(1.0),
        ..GradScalerConfig::default()
    };
    assert_eq!(
        GradScaler::new(&h.rt, DEV, bad).err(),
        Some(ScalerError::ScaleClamps { min: 2.0, max: 1.0 })
    );
    Ok(())
}

/// PyTorch's per-optimizer state machine and each of its errors, with PyTorch's messages.
pub fn state_machine_and_its_errors(h: &Harness) -> TestResult {
    for (config, err) in [
        (
            GradScalerConfig {
                growth_factor: 1.0,
                ..Default::default()
            },
            ScalerError::GrowthFactor,
        ),
        (
            GradScalerConfig {
                backoff_factor: 1.0,
                ..Default::default()
            },
            ScalerError::BackoffFactor,
        ),
    ] {
        assert_eq!(GradScaler::new(&h.rt, DEV, config).err(), Some(err));
    }
    assert_eq!(
        ScalerError::GrowthFactor.to_string(),
        "The growth factor must be > 1.0."
    );
    let mut s = scaler(
        h,
        GradScalerConfig {
            init_scale: 8.0,
            ..Default::default()
        },
    )?;
    let opt = OptimizerId::fresh();
    let grad = DeviceBuffer::<f32>::from_slice(&h.rt, DEV, &[8.0, -16.0, 4.0])?;
    let grads = [TensorView::of(&grad)];
    let err = s.unscale(opt, &grads).expect_err("before any scale");
    assert_eq!(err, ScalerError::NotInitialized { op: "unscale_" });
    assert!(
        err.to_string()
            .starts_with("Attempted unscale_ but _scale is None.  This may")
    );
    assert_eq!(
        s.update().err(),
        Some(ScalerError::NotInitialized { op: "update" })
    );
    s.device_state()?;
    assert_eq!(s.update().err(), Some(ScalerError::NoInfChecksBeforeUpdate));
    assert_eq!(
        ScalerError::NoInfChecksBeforeUpdate.to_string(),
        "No inf checks were recorded prior to update."
    );

    s.unscale(opt, &grads)?;
    assert_eq!(s.stage(opt), Stage::Unscaled);
    assert_eq!(grad.to_host()?, [1.0, -2.0, 0.5], "unscaled by 1/8");
    let again = s.unscale(opt, &grads).expect_err("twice");
    assert_eq!(
        again.to_string(),
        "unscale_() has already been called on this optimizer since the last update()."
    );
    let mut ran = 0;
    assert_eq!(
        s.step(opt, &grads, || {
            ran += 1;
            42
        })?,
        Some(42)
    );
    assert_eq!((ran, s.stage(opt)), (1, Stage::Stepped));
    assert_eq!(
        grad.to_host()?,
        [1.0, -2.0, 0.5],
        "step does not unscale twice"
    );
    let twice = s.step(opt, &grads, || ()).expect_err("step twice");
    assert_eq!(
        twice.to_string(),
        "step() has already been called since the last update()."
    );
    assert_eq!(
        s.unscale(opt, &grads).err(),
        Some(ScalerError::UnscaleAfterStep)
    );
    assert_eq!(
        ScalerError::UnscaleAfterStep.to_string(),
        "unscale_() is being called after step()."
    );
    s.update()?;
    assert_eq!(s.stage(opt), Stage::Ready);

    step!("an inf skips the step and backs off");
    grad.copy_from_host(&[1.0, f32::INFINITY, 2.0])?;
    assert_eq!(
        s.step(opt, &grads, || panic!("must be skipped"))?,
        None::<()>
    );
    s.update()?;
    assert_eq!(s.scale()?, 4.0);

    step!("no gradients, fp16, integers");
    let frozen = OptimizerId::fresh();
    let no_checks = s.step(frozen, &[], || ()).expect_err("no grads");
    assert_eq!(
        no_checks.to_string(),
        "No inf checks were recorded for this optimizer."
    );
    let half_grad = DeviceBuffer::<f16>::filled(&h.rt, DEV, 4, f16::ONE)?;
    let fp16 = OptimizerId::fresh();
    let e = s
        .unscale(fp16, &[TensorView::of(&half_grad)])
        .expect_err("fp16");
    assert_eq!(e.to_string(), "Attempting to unscale FP16 gradients.");
    assert_eq!(
        s.stage(fp16),
        Stage::Ready,
        "a refused unscale_ changes nothing"
    );
    let ints = DeviceBuffer::<i64>::filled(&h.rt, DEV, 4, 1)?;
    let e = s
        .unscale(fp16, &[TensorView::of(&ints)])
        .expect_err("int64");
    assert_eq!(e, ScalerError::UnsupportedDtype { dtype: DType::I64 });
    assert!(e.to_string().contains("not implemented for 'I64'"));
    Ok(())
}

/// test_grad_scaling_multiple in spirit: two optimizers share one scale; an inf in one skips
/// only that one's step, and the update backs off once.
pub fn two_optimizers_skip_independently(h: &Harness) -> TestResult {
    let mut s = scaler(
        h,
        GradScalerConfig {
            init_scale: 128.0,
            growth_interval: 1,
            ..Default::default()
        },
    )?;
    s.device_state()?;
    let (a, b) = (OptimizerId::fresh(), OptimizerId::fresh());
    let ga = DeviceBuffer::<f32>::filled(&h.rt, DEV, 100, 128.0)?;
    let gb = DeviceBuffer::<bf16>::filled(&h.rt, DEV, 100, bf16::from_f32(256.0))?;
    let (va, vb) = ([TensorView::of(&ga)], [TensorView::of(&gb)]);
    let mut steps = Vec::new();
    for iteration in 0..4 {
        if iteration == 2 {
            gb.copy_from_host(&[bf16::NAN; 100])?;
        } else {
            gb.fill(bf16::from_f32(256.0))?;
        }
        ga.fill(128.0)?;
        s.unscale(a, &va)?;
        if s.step(a, &va, || ())?.is_some() {
            steps.push(('a', iteration));
        }
        if s.step(b, &vb, || ())?.is_some() {
            steps.push(('b', iteration));
        }
        s.update()?;
    }
    let b_skipped = !steps.contains(&('b', 2));
    assert!(b_skipped && steps.contains(&('a', 2)), "{steps:?}");
    assert_eq!(steps.len(), 7);
    // 128 · 2 · 2 · 0.5 · 2 (growth interval 1).
    assert_eq!(s.scale()?, 128.0 * 2.0 * 2.0 * 0.5 * 2.0);
    Ok(())
}

/// The `_step_supports_amp_scaling` path: from Ready the gradients are only checked (fp16
/// allowed) and the optimizer gets the scale to divide by; after `unscale_` it gets none.
pub fn fused_step_checks_without_unscaling(h: &Harness) -> TestResult {
    let mut s = scaler(
        h,
        GradScalerConfig {
            init_scale: 1024.0,
            ..Default::default()
        },
    )?;
    let state_scale = s.device_state()?.expect("enabled").scale();
    let opt = OptimizerId::fresh();
    let g = DeviceBuffer::<f16>::filled(&h.rt, DEV, 64, f16::from_f32(2048.0))?;
    let views = [TensorView::of(&g)];
    let args = s.step_fused(opt, &views, |a| a.copied())?.expect("enabled");
    assert_eq!(args.grad_scale, Some(state_scale));
    assert_eq!(read_scalar(h, args.found_inf)?, 0.0);
    assert!(
        g.to_host()?.iter().all(|&v| v == f16::from_f32(2048.0)),
        "not unscaled"
    );
    assert_eq!(
        s.step_fused(opt, &views, |_| ()).err(),
        Some(ScalerError::StepAlreadyCalled)
    );
    s.update()?;
    g.copy_from_host(&[f16::INFINITY; 64])?;
    let args = s.step_fused(opt, &views, |a| a.copied())?.expect("enabled");
    assert_eq!(read_scalar(h, args.found_inf)?, 1.0);
    s.update()?;
    assert_eq!(s.scale()?, 512.0);
    let f32_grad = DeviceBuffer::<f32>::filled(&h.rt, DEV, 8, 512.0)?;
    let fviews = [TensorView::of(&f32_grad)];
    s.unscale(opt, &fviews)?;
    let args = s
        .step_fused(opt, &fviews, |a| a.copied())?
        .expect("enabled");
    assert_eq!(args.grad_scale, None, "already unscaled");
    assert_eq!(f32_grad.to_host()?, [1.0; 8]);
    Ok(())
}

/// test_grad_scaling_state_dict: a round trip through JSON with PyTorch's keys, into a
/// scaler with other values, before and after its lazy init; and the enabled/disabled rules.
pub fn checkpoint_round_trip(h: &Harness) -> TestResult {
    for lazy_init_b in [false, true] {
        let config = GradScalerConfig {
            init_scale: 3.0,
            growth_factor: 4.0,
            backoff_factor: 0.5,
            growth_interval: 2,
            ..Default::default()
        };
        let mut a = scaler(h, config)?;
        let mut b = scaler(
            h,
            GradScalerConfig {
                init_scale: 2.0,
                growth_factor: 3.0,
                backoff_factor: 0.75,
                growth_interval: 1,
                ..Default::default()
            },
        )?;
        if lazy_init_b {
            b.device_state()?;
        }
        let json = serde_json::to_string(&a.state_dict()?)?;
        assert_eq!(
            json,
            r#"{"scale":3.0,"growth_factor":4.0,"backoff_factor":0.5,"growth_interval":2,"_growth_tracker":0}"#
        );
        b.load_state_dict(&serde_json::from_str(&json)?)?;
        assert_eq!(
            (b.scale()?, b.growth_factor(), b.backoff_factor()),
            (3.0, 4.0, 0.5)
        );
        assert_eq!((b.growth_interval(), b.growth_tracker()?), (2, 0));
        // After one clean iteration the tracker is 1 and travels too.
        let grad = DeviceBuffer::<f32>::filled(&h.rt, DEV, 4, 1.0)?;
        let stream = h.rt.current_stream(DEV)?;
        a.unscale_device(&stream, &[TensorView::of(&grad)])?;
        a.update_device(&stream)?;
        b.load_state_dict(&a.state_dict()?)?;
        assert_eq!((b.scale()?, b.growth_tracker()?), (3.0, 1));
        b.device_state()?;
        assert_eq!(
            b.growth_tracker()?,
            1,
            "loaded before init: the state starts from it"
        );
    }
    let mut disabled = scaler(
        h,
        GradScalerConfig {
            enabled: false,
            ..Default::default()
        },
    )?;
    let empty = disabled.state_dict()?;
    assert_eq!(serde_json::to_string(&empty)?, "{}");
    let mut enabled = scaler(h, GradScalerConfig::default())?;
    let err = enabled.load_state_dict(&empty).expect_err("empty");
    assert!(
        err.to_string()
            .starts_with("The source state dict is empty, possibly because")
    );
    disabled.load_state_dict(&enabled.state_dict()?)?;
    assert_eq!(disabled.scale()?, 1.0, "a disabled scaler ignores a load");
    let partial: ScalerStateDict = serde_json::from_str(r#"{"scale":2.0}"#)?;
    assert_eq!(
        enabled.load_state_dict(&partial).err(),
        Some(ScalerError::MissingKey {
            key: "growth_factor"
        })
    );
    Ok(())
}

/// `enabled=False`: nothing is checked, scaled, unscaled or allocated; steps always run.
pub fn disabled_scaler_is_a_pass_through(h: &Harness) -> TestResult {
    let config = GradScalerConfig {
        enabled: false,
        growth_factor: 0.5,
        ..Default::default()
    };
    let mut s = scaler(h, config)?;
    assert!(!s.is_enabled());
    let g = DeviceBuffer::<f32>::from_slice(&h.rt, DEV, &[3.0, f32::INFINITY])?;
    let views = [TensorView::of(&g)];
    let opt = OptimizerId::fresh();
    s.scale_in_place(&views[0])?;
    s.unscale(opt, &views)?;
    s.unscale(opt, &views)?;
    assert_eq!(s.step(opt, &views, || 7)?, Some(7));
    assert!(s.step_fused(opt, &views, |a| a.is_none())?);
    s.update()?;
    s.update_to(5.0)?;
    let stream = h.rt.current_stream(DEV)?;
    s.unscale_device(&stream, &views)?;
    s.update_device(&stream)?;
    assert_eq!(g.to_host()?, [3.0, f32::INFINITY]);
    assert_eq!((s.scale()?, s.growth_tracker()?), (1.0, 0));
    assert!(s.device_state()?.is_none());
    Ok(())
}

/// A bf16 compute dtype: the scale is 1.0 whatever `init_scale` says and never moves, the
/// loss and the gradients are left alone, and an inf still skips the step (W4).
pub fn bf16_compute_dtype_scales_by_one_and_still_skips(h: &Harness) -> TestResult {
    let config = GradScalerConfig {
        compute_dtype: DType::BF16,
        growth_interval: 1,
        ..Default::default()
    };
    let mut s = scaler(h, config)?;
    assert!(s.is_bf16_noop() && s.scale()? == 1.0);
    let loss = DeviceBuffer::<bf16>::filled(&h.rt, DEV, 1, bf16::from_f32(0.75))?;
    s.scale_in_place(&TensorView::of(&loss))?;
    assert_eq!(loss.to_host()?, [bf16::from_f32(0.75)]);
    let values: Vec<bf16> = (0..300)
        .map(|i| bf16::from_f32(i as f32 * 0.37 - 20.0))
        .collect();
    let g = DeviceBuffer::<bf16>::from_slice(&h.rt, DEV, &values)?;
    let opt = OptimizerId::fresh();
    let views = [TensorView::of(&g)];
    assert_eq!(s.step(opt, &views, || 1)?, Some(1));
    s.update()?;
    assert_eq!(g.to_host()?, values, "unscaling by 1.0 changes nothing");
    let mut bad = values.clone();
    bad[123] = bf16::INFINITY;
    g.copy_from_host(&bad)?;
    assert_eq!(s.step(opt, &views, || 1)?, None);
    s.update()?;
    assert_eq!(s.scale()?, 1.0, "no backoff, no growth");
    assert_eq!(s.step_stats()?.skipped, 1);
    Ok(())
}

/// `scale(loss)`: fp32, fp16 and bf16 losses times the scale, rounded as PyTorch's
/// `outputs * scale` (computed in fp32).
pub fn scale_in_place_rounds_as_pytorch(h: &Harness) -> TestResult {
    let mut s = scaler(
        h,
        GradScalerConfig {
            init_scale: 3.0,
            ..Default::default()
        },
    )?;
    let xs: Vec<f32> = (0..1001).map(|i| (i as f32 - 500.0) * 0.0137).collect();
    let l32 = DeviceBuffer::<f32>::from_slice(&h.rt, DEV, &xs)?;
    s.scale_in_place(&TensorView::of(&l32))?;
    assert_eq!(
        l32.to_host()?,
        xs.iter().map(|x| x * 3.0).collect::<Vec<_>>()
    );
    let h16: Vec<f16> = xs.iter().map(|&x| f16::from_f32(x)).collect();
    let l16 = DeviceBuffer::<f16>::from_slice(&h.rt, DEV, &h16)?;
    s.scale_in_place(&TensorView::of(&l16))?;
    let want: Vec<f16> = h16
        .iter()
        .map(|x| f16::from_f32(x.to_f32() * 3.0))
        .collect();
    assert_eq!(l16.to_host()?, want);
    let b16: Vec<bf16> = xs.iter().map(|&x| bf16::from_f32(x)).collect();
    let lb = DeviceBuffer::<bf16>::from_slice(&h.rt, DEV, &b16)?;
    s.scale_in_place(&TensorView::of(&lb))?;
    let want: Vec<bf16> = b16
        .iter()
        .map(|x| bf16::from_f32(x.to_f32() * 3.0))
        .collect();
    assert_eq!(lb.to_host()?, want);
    Ok(())
}

/// The sync-free pieces captured into one graph (zero found_inf, check + unscale, update):
/// replays with clean and overflowing gradients move the scale as eager calls do, and the
/// skip counters are read lazily after the fact.
pub fn sync_free_iteration_captures_and_replays(h: &Harness) -> TestResult {
    let d = h.rt.driver();
    let config = GradScalerConfig {
        init_scale: 4.0,
        growth_interval: 2,
        ..Default::default()
    };
    let mut s = scaler(h, config)?;
    let stream = h.rt.new_stream(DEV, 0)?;
    let _guard = h.rt.stream_guard(&stream)?;
    let grad = DeviceBuffer::<f32>::filled(&h.rt, DEV, 5000, 1.0)?;
    let views = [TensorView::of(&grad)];
    step!("warm-up: the state and the chunk table exist before capture");
    s.unscale_device(&stream, &views)?;
    s.update_device(&stream)?;
    let (mut scale, mut tracker) = pytorch_update(4.0, 0, false, 2.0, 0.5, 2);
    stream.synchronize()?;
    d.stream_begin_capture(stream.handle(), CaptureMode::Global)?;
    s.unscale_device(&stream, &views)?;
    s.update_device(&stream)?;
    let graph = d.stream_end_capture(stream.handle())?;
    let exec = d.graph_instantiate(graph)?;
    for (i, inf) in [false, true, false, false, true, false]
        .into_iter()
        .enumerate()
    {
        let mut values = vec![scale; 5000];
        if inf {
            values[4999 - i] = f32::NEG_INFINITY;
        }
        grad.copy_from_host(&values)?;
        d.graph_launch(exec, stream.handle())?;
        (scale, tracker) = pytorch_update(scale, tracker, inf, 2.0, 0.5, 2);
        s.request_step_stats(&stream)?;
        stream.synchronize()?;
        assert_eq!(
            (s.scale()?, s.growth_tracker()?),
            (f64::from(scale), tracker),
            "replay {i}"
        );
        let stats = s.poll_step_stats()?.expect("the copy completed");
        assert_eq!((stats.updates, stats.last_skipped), (i as u32 + 2, inf));
        if !inf {
            let host = grad.to_host()?;
            assert!(
                host.iter().all(|&v| v == 1.0),
                "replay {i} unscaled by the device inv_scale"
            );
        }
    }
    d.graph_exec_destroy(exec)?;
    d.graph_destroy(graph)?;
    Ok(())
}
