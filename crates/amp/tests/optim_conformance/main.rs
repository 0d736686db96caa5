//! The sync-free optimizers, written once over a backend: the fake device in CI, the real
//! driver in the GPU bundle (`#[ignore]`d without a GPU). SGD and AdamW against CPU
//! references of PyTorch's formulas over several steps, some skipped by `found_inf`, bit for
//! bit on both backends (the kernels round every operation once); a captured step replays
//! as the eager one; the masked fallback; a small MLP trained eager and captured, and in
//! mixed precision with the gradient scaler through `ScaledStep` (f16) and without (bf16).
#![forbid(unsafe_code)]
mod mlp;
mod reference;

use ferrocuda_alloc::{Caching, DeviceAllocators};
use ferrocuda_amp::optim::{
    AdamW, AdamWConfig, DeviceOptimizer, Masked, OptimError, Param, Sgd, SgdConfig,
    register_fake_optim_kernels,
};
use ferrocuda_amp::scaler::register_fake_amp_kernels;
use ferrocuda_amp::{GradScaler, GradScalerConfig, ScaledStep, TensorView};
use ferrocuda_graph::{CaptureMode, CudaGraph};
use ferrocuda_stream::{DeviceBuffer, Runtime};
use ferrocuda_testkit::Harness;
use ferrocuda_types::{AllocatorConfig, DeviceIndex};
use half::{bf16, f16};
use reference::{RefAdamW, RefSgd, Reference, Rng};
use std::sync::Arc;

type BoxError = Box<dyn std::error::Error>;
type TestResult = Result<(), BoxError>;
const D0: DeviceIndex = DeviceIndex(0);

/// Lengths of the parameter tensors: single elements, one chunk exactly, several chunks.
const LENS: [usize; 5] = [1, 7, 4096, 9000, 33];
/// Steps per run, and the ones `found_inf` skips (the first one included, so that the
/// momentum buffer is initialised by the first *applied* step).
const STEPS: usize = 7;
const SKIPPED: [usize; 3] = [0, 3, 4];

/// Registers the crate's host kernels when the backend is the fake one.
fn prepare(h: &Harness) {
    if let Some(fake) = &h.fake {
        register_fake_optim_kernels(fake);
        register_fake_amp_kernels(fake);
        mlp::register_fake_mlp_kernels(fake);
    }
}

/// A gradient buffer of one of the three dtypes the optimizers take.
enum Grad {
    F32(DeviceBuffer<f32>),
    F16(DeviceBuffer<f16>),
    Bf16(DeviceBuffer<bf16>),
}

impl Grad {
    fn new(rt: &Arc<Runtime>, kind: usize, n: usize) -> Result<Grad, BoxError> {
        Ok(match kind % 3 {
            0 => Grad::F32(DeviceBuffer::filled(rt, D0, n, 0.0)?),
            1 => Grad::F16(DeviceBuffer::filled(rt, D0, n, f16::ZERO)?),
            _ => Grad::Bf16(DeviceBuffer::filled(rt, D0, n, bf16::ZERO)?),
        })
    }

    fn view(&self) -> TensorView {
        match self {
            Grad::F32(b) => TensorView::of(b),
            Grad::F16(b) => TensorView::of(b),
            Grad::Bf16(b) => TensorView::of(b),
        }
    }

    /// Writes `values` rounded to the buffer's dtype; returns what the kernel will read.
    fn write(&self, values: &[f32]) -> Result<Vec<f32>, BoxError> {
        Ok(match self {
            Grad::F32(b) => {
                b.copy_from_host(values)?;
                values.to_vec()
            }
            Grad::F16(b) => {
                let v: Vec<f16> = values.iter().map(|&x| f16::from_f32(x)).collect();
                b.copy_from_host(&v)?;
                v.iter().map(|x| x.to_f32()).collect()
            }
            Grad::Bf16(b) => {
                let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
                b.copy_from_host(&v)?;
                v.iter().map(|x| x.to_f32()).collect()
            }
        })
    }
}

/// Parameters (f32) and gradients (f32, f16, bf16 in turn) on device 0, with `found_inf`.
struct Fixture {
    rt: Arc<Runtime>,
    params: Vec<DeviceBuffer<f32>>,
    grads: Vec<Grad>,
    found_inf: DeviceBuffer<f32>,
}

impl Fixture {
    fn new(h: &Harness, seed: u64) -> Result<Fixture, BoxError> {
        let rt = h.rt.clone();
        let mut rng = Rng::new(seed);
        let params = LENS
            .iter()
            .map(|&n| DeviceBuffer::from_slice(&rt, D0, &rng.vec(n, 1.0)))
            .collect::<Result<Vec<_>, _>>()?;
        let grads = LENS
            .iter()
            .enumerate()
            .map(|(i, &n)| Grad::new(&rt, i, n))
            .collect::<Result<Vec<_>, _>>()?;
        let found_inf = DeviceBuffer::filled(&rt, D0, 1, 0.0)?;
        Ok(Fixture {
            rt,
            params,
            grads,
            found_inf,
        })
    }

    fn param_list(&self) -> Vec<Param> {
        self.params
            .iter()
            .zip(&self.grads)
            .map(|(p, g)| Param {
                param: TensorView::of(p),
                grad: g.view(),
            })
            .collect()
    }

    /// Writes step `step`'s gradients and flag (on the current stream); returns the
    /// gradients as the kernels read them, and whether the step is skipped.
    fn set_step(&self, seed: u64, step: usize) -> Result<(Vec<Vec<f32>>, bool), BoxError> {
        let mut rng = Rng::new(seed * 1000 + step as u64);
        let grads = self
            .grads
            .iter()
            .zip(LENS)
            .map(|(g, n)| g.write(&rng.vec(n, 2.0)))
            .collect::<Result<Vec<_>, _>>()?;
        let skip = SKIPPED.contains(&step);
        self.found_inf
            .copy_from_host(&[f32::from(u8::from(skip))])?;
        Ok((grads, skip))
    }

    fn host_params(&self) -> Result<Vec<Vec<f32>>, BoxError> {
        Ok(self
            .params
            .iter()
            .map(|p| p.to_host())
            .collect::<Result<_, _>>()?)
    }
}

/// A device array's contents as f32, after the current stream's work.
fn read_view(rt: &Runtime, view: TensorView) -> Result<Vec<f32>, BoxError> {
    let mut out = vec![0.0f32; view.len as usize];
    let stream = rt.current_stream(view.device)?;
    rt.driver().memcpy_dtoh(
        bytemuck::cast_slice_mut(&mut out),
        view.ptr,
        stream.handle(),
    )?;
    Ok(out)
}

/// Bit-for-bit equality of two runs of floats, with the first difference named.
fn assert_bits(what: &str, got: &[f32], want: &[f32]) -> TestResult {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, expected {}", got.len(), want.len()).into());
    }
    match got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        None => Ok(()),
        Some(i) => Err(format!("{what}: element {i} is {}, expected {}", got[i], want[i]).into()),
    }
}

/// The device state of `opt` (counters excluded) and its step count.
fn device_state(rt: &Runtime, opt: &dyn DeviceOptimizer) -> Result<(Vec<Vec<f32>>, f32), BoxError> {
    let mut views = opt.state_tensors();
    let counters = views
        .pop()
        .ok_or("the counters are the last state tensor")?;
    let state = views
        .into_iter()
        .map(|v| read_view(rt, v))
        .collect::<Result<_, _>>()?;
    Ok((state, read_view(rt, counters)?[0]))
}

type MakeOptimizer<'a> =
    dyn Fn(&Arc<Runtime>, &[Param]) -> Result<Box<dyn DeviceOptimizer>, OptimError> + 'a;

/// Steps `make`'s optimizer and `reference` side by side on the same random gradients,
/// some steps skipped by `found_inf`; compares parameters, state and step count bit for bit.
fn run_against_reference(
    h: &Harness,
    seed: u64,
    make: &MakeOptimizer<'_>,
    mut reference: Box<dyn Reference>,
) -> TestResult {
    let f = Fixture::new(h, seed)?;
    let mut opt = make(&f.rt, &f.param_list())?;
    let mut params = f.host_params()?;
    let stream = f.rt.current_stream(D0)?;
    for step in 0..STEPS {
        let (grads, skip) = f.set_step(seed, step)?;
        opt.step(&stream, Some(f.found_inf.ptr()))?;
        if !skip {
            reference.step(&mut params, &grads);
        }
        stream.synchronize()?;
        for (i, (got, want)) in f.host_params()?.iter().zip(&params).enumerate() {
            assert_bits(&format!("seed {seed} step {step} param {i}"), got, want)?;
        }
        let (state, steps) = device_state(&f.rt, opt.as_ref())?;
        for (k, (got, want)) in state.iter().zip(reference.state(&LENS)).enumerate() {
            assert_bits(&format!("seed {seed} step {step} state {k}"), got, &want)?;
        }
        assert_eq!(
            steps as u64,
            reference.steps(),
            "step count after step {step}"
        );
    }
    assert!(
        f.host_params()? != Fixture::new(h, seed)?.host_params()?,
        "the applied steps moved the parameters"
    );
    Ok(())
}

fn sgd_configs() -> [SgdConfig; 3] {
    [
        SgdConfig {
            lr: 0.1,
            ..SgdConfig::default()
        },
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            ..SgdConfig::default()
        },
        SgdConfig {
            lr: 0.05,
            momentum: 0.8,
            weight_decay: 0.001,
            nesterov: true,
            maximize: true,
            ..SgdConfig::default()
        },
    ]
}

fn adamw_configs() -> [AdamWConfig; 3] {
    [
        AdamWConfig {
            lr: 1e-2,
            ..AdamWConfig::default()
        },
        AdamWConfig {
            lr: 3e-3,
            betas: (0.8, 0.99),
            eps: 1e-6,
            weight_decay: 0.1,
            amsgrad: true,
            maximize: true,
        },
        AdamWConfig {
            lr: 1e-2,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        },
    ]
}

/// Fused SGD equals the reference over steps with skips, for each configuration.
fn sgd_matches_reference_with_skips(h: &Harness) -> TestResult {
    prepare(h);
    for (seed, cfg) in sgd_configs().into_iter().enumerate() {
        let make: &MakeOptimizer<'_> = &|rt, p| Ok(Box::new(Sgd::new(rt, p, cfg)?));
        run_against_reference(h, seed as u64, make, Box::new(RefSgd::new(cfg, LENS.len())))?;
    }
    Ok(())
}

/// Fused AdamW equals the reference over steps with skips, for each configuration.
fn adamw_matches_reference_with_skips(h: &Harness) -> TestResult {
    prepare(h);
    for (seed, cfg) in adamw_configs().into_iter().enumerate() {
        let make: &MakeOptimizer<'_> = &|rt, p| Ok(Box::new(AdamW::new(rt, p, cfg)?));
        let reference = Box::new(RefAdamW::new(cfg, LENS.len()));
        run_against_reference(h, 10 + seed as u64, make, reference)?;
    }
    Ok(())
}

/// The masked fallback around optimizers stepped without `found_inf` equals the reference:
/// skipped steps leave parameters, state and step count as they were.
fn masked_fallback_matches_reference(h: &Harness) -> TestResult {
    prepare(h);
    let sgd = sgd_configs()[1];
    let make: &MakeOptimizer<'_> = &|rt, p| Ok(Box::new(Masked::new(rt, Sgd::new(rt, p, sgd)?)?));
    run_against_reference(h, 20, make, Box::new(RefSgd::new(sgd, LENS.len())))?;
    let adamw = adamw_configs()[1];
    let make: &MakeOptimizer<'_> =
        &|rt, p| Ok(Box::new(Masked::new(rt, AdamW::new(rt, p, adamw)?)?));
    run_against_reference(h, 21, make, Box::new(RefAdamW::new(adamw, LENS.len())))
}

/// The fused optimizers count skipped steps on the device, readable lazily.
fn skipped_steps_are_counted_on_the_device(h: &Harness) -> TestResult {
    prepare(h);
    let f = Fixture::new(h, 30)?;
    let stream = f.rt.current_stream(D0)?;
    let mut sgd = Sgd::new(&f.rt, &f.param_list(), sgd_configs()[1])?;
    let mut adamw = AdamW::new(&f.rt, &f.param_list(), adamw_configs()[0])?;
    for step in 0..STEPS {
        f.set_step(30, step)?;
        sgd.step(&stream, Some(f.found_inf.ptr()))?;
        adamw.step(&stream, Some(f.found_inf.ptr()))?;
    }
    for counts in [sgd.counts(&stream)?, adamw.counts(&stream)?] {
        assert_eq!(counts.taken as usize, STEPS - SKIPPED.len());
        assert_eq!(counts.skipped as usize, SKIPPED.len());
    }
    Ok(())
}

/// Each optimizer's step captured once into a graph, replayed once per step, gives bit for
/// bit what eager steps give, skipped steps included.
fn captured_step_replays_like_eager(h: &Harness) -> TestResult {
    prepare(h);
    let allocators = DeviceAllocators::new(
        h.rt.driver().clone(),
        AllocatorConfig::default(),
        Caching::On,
    );
    allocators.install(&h.rt);
    let sgd = sgd_configs()[2];
    let adamw = adamw_configs()[1];
    let makes: [&MakeOptimizer<'_>; 3] = [
        &|rt, p| Ok(Box::new(Sgd::new(rt, p, sgd)?)),
        &|rt, p| Ok(Box::new(AdamW::new(rt, p, adamw)?)),
        &|rt, p| Ok(Box::new(Masked::new(rt, Sgd::new(rt, p, sgd)?)?)),
    ];
    for (k, make) in makes.into_iter().enumerate() {
        let seed = 40 + k as u64;
        let (eager, captured) = (Fixture::new(h, seed)?, Fixture::new(h, seed)?);
        let mut eager_opt = make(&h.rt, &eager.param_list())?;
        let mut captured_opt = make(&h.rt, &captured.param_list())?;
        let graph = CudaGraph::new(h.rt.clone(), allocators.clone(), D0)?;
        let capture = graph.capture(None, None, CaptureMode::ThreadLocal)?;
        captured_opt.step(capture.stream(), Some(captured.found_inf.ptr()))?;
        capture.end()?;
        let current = h.rt.current_stream(D0)?;
        for step in 0..STEPS {
            eager.set_step(seed, step)?;
            captured.set_step(seed, step)?;
            eager_opt.step(&current, Some(eager.found_inf.ptr()))?;
            graph.replay(&current)?;
            current.synchronize()?;
            let pairs = eager
                .host_params()?
                .into_iter()
                .zip(captured.host_params()?);
            for (i, (want, got)) in pairs.enumerate() {
                assert_bits(&format!("optimizer {k} step {step} param {i}"), &got, &want)?;
            }
            let (want, want_steps) = device_state(&h.rt, eager_opt.as_ref())?;
            let (got, got_steps) = device_state(&h.rt, captured_opt.as_ref())?;
            for (s, (got, want)) in got.iter().zip(&want).enumerate() {
                assert_bits(&format!("optimizer {k} step {step} state {s}"), got, want)?;
            }
            assert_eq!(got_steps, want_steps, "optimizer {k} step count");
        }
    }
    Ok(())
}

/// Constructors refuse what PyTorch refuses, with its messages, and what the kernels cannot
/// take, with typed errors.
fn constructors_check_their_inputs(h: &Harness) -> TestResult {
    prepare(h);
    let f = Fixture::new(h, 50)?;
    let params = f.param_list();
    let message = |r: Result<Sgd, OptimError>| r.err().map(|e| e.to_string());
    let sgd = |cfg| message(Sgd::new(&f.rt, &params, cfg));
    assert_eq!(
        sgd(SgdConfig {
            lr: -0.5,
            ..SgdConfig::default()
        })
        .as_deref(),
        Some("Invalid learning rate: -0.5")
    );
    assert_eq!(
        sgd(SgdConfig {
            nesterov: true,
            ..SgdConfig::default()
        })
        .as_deref(),
        Some("Nesterov momentum requires a momentum and zero dampening")
    );
    let adamw = |cfg| AdamW::new(&f.rt, &params, cfg).err().map(|e| e.to_string());
    assert_eq!(
        adamw(AdamWConfig {
            betas: (0.9, 1.0),
            ..AdamWConfig::default()
        })
        .as_deref(),
        Some("Invalid beta parameter at index 1: 1.0")
    );
    assert!(matches!(
        Sgd::new(&f.rt, &[], SgdConfig::default()),
        Err(OptimError::NoParameters)
    ));
    let mut bad = params.clone();
    bad[1].grad.len += 1;
    assert!(matches!(
        Sgd::new(&f.rt, &bad, SgdConfig::default()),
        Err(OptimError::LengthMismatch { index: 1, .. })
    ));
    let mut bad = params;
    bad[0].param.dtype = ferrocuda_types::DType::F16;
    assert!(matches!(
        Sgd::new(&f.rt, &bad, SgdConfig::default()),
        Err(OptimError::UnsupportedDtype { index: 0, .. })
    ));
    Ok(())
}

/// The MLP's kernels give what its host functions give, for f32, f16 and bf16 activations,
/// with and without a loss scale seeding the backward pass.
fn mlp_gradients_match_host(h: &Harness) -> TestResult {
    prepare(h);
    let scale = DeviceBuffer::filled(&h.rt, D0, 1, 256.0f32)?;
    for lp in mlp::Precision::ALL {
        for scaled in [false, true] {
            let mut model = mlp::Mlp::new(&h.rt, lp, 60)?;
            model.set_loss_scale(scaled.then(|| scale.ptr()));
            let stream = h.rt.current_stream(D0)?;
            model.forward_backward(&stream)?;
            let got_loss = model.loss(&stream)?;
            let (loss, grads) = model.host_forward_backward(if scaled { 256.0 } else { 1.0 })?;
            let what = format!("{lp:?} scaled {scaled}");
            assert_bits(&format!("{what} loss"), &[got_loss], &[loss])?;
            for (i, (got, want)) in model.grads_to_host()?.iter().zip(&grads).enumerate() {
                assert_bits(&format!("{what} gradient {i}"), got, want)?;
            }
            assert!(
                grads.iter().flatten().any(|&g| g != 0.0),
                "{what}: gradients flow"
            );
        }
    }
    Ok(())
}

/// The MLP trains with fused SGD, eager and captured (the whole iteration in one graph),
/// for f32, f16 and bf16 activations: equal losses and parameters, loss going down, and a
/// step skipped by `found_inf` leaving the next loss unchanged.
fn mlp_trains_eager_and_captured(h: &Harness) -> TestResult {
    prepare(h);
    let allocators = DeviceAllocators::new(
        h.rt.driver().clone(),
        AllocatorConfig::default(),
        Caching::On,
    );
    allocators.install(&h.rt);
    let cfg = SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        ..SgdConfig::default()
    };
    const ITERS: usize = 40;
    const SKIP: usize = 5;
    for lp in mlp::Precision::ALL {
        let mut runs = Vec::new();
        for captured in [false, true] {
            let model = mlp::Mlp::new(&h.rt, lp, 70)?;
            let mut opt = Sgd::new(&h.rt, &model.params(), cfg)?;
            let found_inf = DeviceBuffer::filled(&h.rt, D0, 1, 0.0f32)?;
            // The scaler's place: here found_inf is scripted from the host instead.
            let mut hooks = mlp::Hooks {
                before: Box::new(|i| {
                    Ok(found_inf.copy_from_host(&[f32::from(u8::from(i == SKIP))])?)
                }),
                unscale_and_check: Box::new(|_| Ok(Some(found_inf.ptr()))),
                after_step: Box::new(|_| Ok(())),
            };
            let losses = if captured {
                let graph = CudaGraph::new(h.rt.clone(), allocators.clone(), D0)?;
                mlp::train_captured(&graph, &model, &mut opt, ITERS, &mut hooks)?
            } else {
                let stream = h.rt.current_stream(D0)?;
                mlp::train_eager(&model, &mut opt, &stream, ITERS, &mut hooks)?
            };
            runs.push((losses, model.params_to_host()?));
        }
        let (losses, params) = &runs[0];
        assert_bits(&format!("{lp:?} captured losses"), &runs[1].0, losses)?;
        for (i, (got, want)) in runs[1].1.iter().zip(params).enumerate() {
            assert_bits(&format!("{lp:?} captured param {i}"), got, want)?;
        }
        assert_eq!(
            losses[SKIP].to_bits(),
            losses[SKIP + 1].to_bits(),
            "{lp:?}: the skipped step left the parameters as they were"
        );
        let (first, last) = (losses[0], losses[ITERS - 1]);
        assert!(
            last < 0.3 * first,
            "{lp:?}: the loss goes down ({first} -> {last}): {losses:?}"
        );
    }
    Ok(())
}

/// Mixed precision end to end through [`ScaledStep`]: the MLP with f16 activations and the
/// gradient scaler (a first scale so large that the first iterations overflow, skip their
/// step and back the scale off), and with bf16 activations and no scaler; each trained eager
/// and captured whole (forward, backward, unscale and check, step, scale update in one
/// graph). Losses, parameters, the scale and the scaler's step statistics are equal between
/// the two; f16 skips at least one step and takes most; the loss goes down.
fn mlp_trains_with_the_scaler_eager_and_captured(h: &Harness) -> TestResult {
    prepare(h);
    let allocators = DeviceAllocators::new(
        h.rt.driver().clone(),
        AllocatorConfig::default(),
        Caching::On,
    );
    allocators.install(&h.rt);
    const ITERS: usize = 60;
    for (lp, scaled) in [(mlp::Precision::F16, true), (mlp::Precision::Bf16, false)] {
        let mut runs = Vec::new();
        for captured in [false, true] {
            let mut model = mlp::Mlp::new(&h.rt, lp, 71)?;
            let params = model.params();
            let sgd = SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                ..SgdConfig::default()
            };
            let optimizer = Sgd::new(&h.rt, &params, sgd)?;
            let scaler = GradScaler::new(
                &h.rt,
                D0,
                GradScalerConfig {
                    init_scale: f64::from(1u32 << 24),
                    enabled: scaled,
                    ..GradScalerConfig::default()
                },
            )?;
            let stream = h.rt.current_stream(D0)?;
            let grads = params.iter().map(|p| p.grad).collect();
            let mut step = ScaledStep::new(scaler, optimizer, grads, &stream)?;
            if let Some(state) = step.scaler_mut().device_state()? {
                model.set_loss_scale(Some(state.scale().ptr()));
            }
            stream.synchronize()?;
            let mut losses = Vec::with_capacity(ITERS);
            if captured {
                let graph = CudaGraph::new(h.rt.clone(), allocators.clone(), D0)?;
                let capture = graph.capture(None, None, CaptureMode::ThreadLocal)?;
                let on = capture.stream().clone();
                model.forward_backward(&on)?;
                step.run(&on)?;
                capture.end()?;
                for _ in 0..ITERS {
                    graph.replay(&stream)?;
                    losses.push(model.loss(&stream)?);
                }
            } else {
                for _ in 0..ITERS {
                    model.forward_backward(&stream)?;
                    step.run(&stream)?;
                    losses.push(model.loss(&stream)?);
                }
            }
            let stats = if scaled {
                Some(step.scaler().step_stats()?)
            } else {
                None
            };
            let scale = step.scaler().scale()?;
            runs.push((losses, model.params_to_host()?, scale, stats));
        }
        let (losses, params, scale, stats) = &runs[0];
        assert_bits(&format!("{lp:?} captured losses"), &runs[1].0, losses)?;
        for (i, (got, want)) in runs[1].1.iter().zip(params).enumerate() {
            assert_bits(&format!("{lp:?} captured param {i}"), got, want)?;
        }
        assert_eq!((runs[1].2, runs[1].3), (*scale, *stats), "{lp:?}: scaler");
        if let Some(stats) = stats {
            assert_eq!(stats.updates as usize, ITERS, "{lp:?}: one update a step");
            assert!(
                stats.skipped >= 1 && (stats.skipped as usize) < ITERS / 2,
                "{lp:?}: the first scale overflows f16 and backs off: {stats:?}, scale {scale}"
            );
            assert!(
                *scale < f64::from(1u32 << 24),
                "{lp:?}: backed off: {scale}"
            );
        }
        let (first, last) = (losses[0], losses[ITERS - 1]);
        assert!(
            last < 0.3 * first,
            "{lp:?}: the loss goes down ({first} -> {last}): {losses:?}"
        );
    }
    Ok(())
}

/// The f16 and bf16 rounding of the MLP's kernels is round-to-nearest-even, as `half`'s.
#[test]
fn mlp_rounding_matches_half() {
    mlp::check_rounding_against_half();
}

ferrocuda_testkit::both_backends!(
    sgd_matches_reference_with_skips,
    adamw_matches_reference_with_skips,
    masked_fallback_matches_reference,
    skipped_steps_are_counted_on_the_device,
    captured_step_replays_like_eager,
    constructors_check_their_inputs,
    mlp_gradients_match_host,
    mlp_trains_eager_and_captured,
    mlp_trains_with_the_scaler_eager_and_captured,
);
