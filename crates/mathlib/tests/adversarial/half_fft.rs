//! Adversarial scenarios: cuFFT in half precision (`FftKind::{C2CHalf, R2CHalf, C2RHalf}`)
//! through `Fft::execute` on the fake device.
//!
//! Rules: IEEE binary16 data, complex interleaved; power-of-two signal sizes only (1 is
//! 2^0), anything else refused before any plan with PyTorch's message word for word;
//! unnormalised transforms; half and fp32 plans cached apart; fp32/fp64 unchanged.
use super::*;

type R<T = ()> = Result<T, Box<dyn std::error::Error>>;
type C = (f64, f64);

struct Rig {
    fake: Arc<FakeDriver>,
    alloc: Arc<CachingAllocator>,
    fft: Fft<FakeFft>,
    stream: StreamHandle,
}

impl Rig {
    fn new() -> Rig {
        let fake = Arc::new(FakeDriver::default());
        let alloc = Arc::new(
            CachingAllocator::new(fake.clone(), DEV, AllocatorConfig::default(), Caching::On)
                .unwrap(),
        );
        let stream = fake.stream_create(DEV, StreamFlags::default()).unwrap();
        Rig {
            fft: Fft::new(FakeFft::new(fake.clone()), alloc.clone()).unwrap(),
            fake,
            alloc,
            stream,
        }
    }

    fn upload(&self, values: &[f64], width: usize) -> DevicePtr {
        let bytes = to_bytes(values, width);
        let a = self
            .alloc
            .allocate(bytes.len().max(1) as u64, self.stream)
            .unwrap();
        // The allocation (Copy, freed explicitly) is kept for the rig's life.
        self.fake
            .memcpy_htod_async(a.ptr, &bytes, self.stream)
            .unwrap();
        a.ptr
    }

    fn download(&self, ptr: DevicePtr, n: usize, width: usize) -> Vec<f64> {
        let mut bytes = vec![0u8; n * width];
        self.fake.memcpy_dtoh(&mut bytes, ptr, self.stream).unwrap();
        from_bytes(&bytes, width)
    }

    fn made(&self) -> u64 {
        self.fft.backend().counts().made
    }

    /// Runs `desc` over `signals` (dense, of the input's logical shape) placed in the input
    /// layout; returns the output signals (dense, of the output's logical shape).
    fn run(&self, desc: &FftDesc, signals: &[Vec<C>], inverse: bool) -> R<Vec<Vec<C>>> {
        let input = self.place(desc, signals)?;
        self.run_at(desc, input, None, inverse)
    }

    /// The input buffer of `desc` holding `signals`.
    fn place(&self, desc: &FftDesc, signals: &[Vec<C>]) -> R<DevicePtr> {
        let (cin, _) = desc.kind.complex_sides();
        let width = desc.kind.real_bytes();
        let (in_shape, _) = shapes(desc);
        let offs = offsets(&in_shape, &desc.input);
        let len = extent(desc.batch, &desc.input, &offs);
        let per = if cin { 2 } else { 1 };
        let mut host = vec![0.0; len * per];
        for (b, sig) in signals.iter().enumerate() {
            for (i, &(re, im)) in sig.iter().enumerate() {
                let at = (b * desc.input.dist as usize + offs[i]) * per;
                host[at] = re;
                if cin {
                    host[at + 1] = im;
                }
            }
        }
        Ok(self.upload(&host, width))
    }

    /// Executes from `input` into `output` (a new zeroed buffer when `None`).
    fn run_at(
        &self,
        desc: &FftDesc,
        input: DevicePtr,
        output: Option<DevicePtr>,
        inverse: bool,
    ) -> R<Vec<Vec<C>>> {
        let (_, cout) = desc.kind.complex_sides();
        let width = desc.kind.real_bytes();
        let (_, out_shape) = shapes(desc);
        let offs = offsets(&out_shape, &desc.output);
        let len = extent(desc.batch, &desc.output, &offs);
        let per = if cout { 2 } else { 1 };
        let out = output.unwrap_or_else(|| self.upload(&vec![0.0; len * per], width));
        self.fft.execute(self.stream, desc, input, out, inverse)?;
        let got = self.download(out, len * per, width);
        Ok((0..desc.batch as usize)
            .map(|b| {
                offs.iter()
                    .map(|&o| {
                        let at = (b * desc.output.dist as usize + o) * per;
                        (got[at], if cout { got[at + 1] } else { 0.0 })
                    })
                    .collect()
            })
            .collect())
    }
}

fn to_bytes(values: &[f64], width: usize) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match width {
            2 => f16::from_f64(v).to_le_bytes().to_vec(),
            4 => (v as f32).to_le_bytes().to_vec(),
            _ => v.to_le_bytes().to_vec(),
        })
        .collect()
}

fn from_bytes(bytes: &[u8], width: usize) -> Vec<f64> {
    bytes
        .chunks_exact(width)
        .map(|c| match width {
            2 => f16::from_le_bytes([c[0], c[1]]).to_f64(),
            4 => f64::from(f32::from_le_bytes(c.try_into().unwrap())),
            _ => f64::from_le_bytes(c.try_into().unwrap()),
        })
        .collect()
}

/// `v` as fp16 holds it.
fn h(v: f64) -> f64 {
    f16::from_f64(v).to_f64()
}

/// The logical shapes of the input and the output of `desc`.
fn shapes(desc: &FftDesc) -> (Vec<i64>, Vec<i64>) {
    let mut half = desc.sizes.clone();
    if let Some(l) = half.last_mut() {
        *l = l.wrapping_div(2).wrapping_add(1);
    }
    match desc.kind.complex_sides() {
        (false, true) => (desc.sizes.clone(), half),
        (true, false) => (half, desc.sizes.clone()),
        _ => (desc.sizes.clone(), desc.sizes.clone()),
    }
}

/// Element offsets, within one signal, of a dense row-major walk of `shape` in `layout`.
fn offsets(shape: &[i64], layout: &FftLayout) -> Vec<usize> {
    let n: i64 = shape.iter().product();
    let rank = shape.len();
    (0..n)
        .map(|flat| {
            let mut rest = flat;
            let mut off = 0i64;
            let mut pitch = 1i64;
            for d in (0..rank).rev() {
                let idx = rest % shape[d];
                rest /= shape[d];
                off += idx * pitch;
                pitch *= layout.embed[d];
            }
            (off * layout.stride) as usize
        })
        .collect()
}

fn extent(batch: i64, layout: &FftLayout, offs: &[usize]) -> usize {
    (batch as usize - 1) * layout.dist as usize + offs.iter().max().map_or(0, |m| m + 1)
}

fn dense(shape: &[i64]) -> FftLayout {
    FftLayout {
        embed: shape.to_vec(),
        stride: 1,
        // Wrapping: the degenerate cases' products are past 64 bits.
        dist: shape.iter().fold(1i64, |a, &b| a.wrapping_mul(b)),
    }
}

/// A dense descriptor of `kind` over `sizes`.
fn desc(kind: FftKind, sizes: &[i64], batch: i64) -> FftDesc {
    let mut d = FftDesc {
        kind,
        sizes: sizes.to_vec(),
        batch,
        input: dense(sizes),
        output: dense(sizes),
    };
    let (i, o) = shapes(&d);
    d.input = dense(&i);
    d.output = dense(&o);
    d
}

/// Dense row-major DFT, separable, in f64 (`inverse`: sign +1), unnormalised.
fn dft(x: &[C], shape: &[i64], inverse: bool) -> Vec<C> {
    let sign = if inverse { 1.0 } else { -1.0 };
    let mut cur = x.to_vec();
    for d in 0..shape.len() {
        let n = shape[d] as usize;
        let inner: usize = shape[d + 1..].iter().product::<i64>() as usize;
        let outer = cur.len() / (n * inner);
        let mut next = vec![(0.0, 0.0); cur.len()];
        for o in 0..outer {
            for i in 0..inner {
                for k in 0..n {
                    let mut acc = (0.0, 0.0);
                    for j in 0..n {
                        let (re, im) = cur[(o * n + j) * inner + i];
                        let a = sign * 2.0 * std::f64::consts::PI * ((j * k) % n) as f64 / n as f64;
                        acc.0 += re * a.cos() - im * a.sin();
                        acc.1 += re * a.sin() + im * a.cos();
                    }
                    next[(o * n + k) * inner + i] = acc;
                }
            }
        }
        cur = next;
    }
    cur
}

/// The half spectrum (last dimension `n/2 + 1`) of a full one.
fn halve(full: &[C], shape: &[i64]) -> Vec<C> {
    let last = *shape.last().unwrap() as usize;
    full.chunks(last)
        .flat_map(|r| r[..last / 2 + 1].to_vec())
        .collect()
}

/// For each signal of `desc`'s input (of fp16 values): what the transform must give.
/// C2R inputs are the half spectra of real signals, whose output is that signal times n.
fn signals_and_expected(
    desc: &FftDesc,
    rng: &mut Rng,
    inverse: bool,
) -> (Vec<Vec<C>>, Vec<Vec<C>>) {
    let shape = &desc.sizes;
    let n: i64 = shape.iter().product();
    let (cin, cout) = desc.kind.complex_sides();
    // Values the input's precision holds exactly.
    let width = desc.kind.real_bytes();
    let h = |v: f64| from_bytes(&to_bytes(&[v], width), width)[0];
    let mut ins = Vec::new();
    let mut outs = Vec::new();
    for _ in 0..desc.batch {
        let x: Vec<C> = (0..n)
            .map(|_| (h(rng.unit()), if cin && cout { h(rng.unit()) } else { 0.0 }))
            .collect();
        match (cin, cout) {
            (true, true) => {
                outs.push(dft(&x, shape, inverse));
                ins.push(x);
            }
            (false, true) => {
                outs.push(halve(&dft(&x, shape, false), shape));
                ins.push(x);
            }
            _ => {
                let spec: Vec<C> = halve(&dft(&x, shape, false), shape)
                    .into_iter()
                    .map(|(a, b)| (h(a), h(b)))
                    .collect();
                ins.push(spec);
                outs.push(x.iter().map(|&(re, _)| (re * n as f64, 0.0)).collect());
            }
        }
    }
    (ins, outs)
}

/// Every output within `tol` (times the signal's magnitude, at least 1) of the expected.
fn assert_close(what: &str, got: &[Vec<C>], want: &[Vec<C>], ins: &[Vec<C>], tol: f64) {
    for (b, (g, w)) in got.iter().zip(want).enumerate() {
        let scale = ins[b]
            .iter()
            .map(|(r, i)| r.abs() + i.abs())
            .sum::<f64>()
            .max(1.0);
        for (i, (gv, wv)) in g.iter().zip(w).enumerate() {
            assert!(
                (gv.0 - wv.0).abs() <= tol * scale && (gv.1 - wv.1).abs() <= tol * scale,
                "{what}: signal {b} element {i}: got {gv:?}, want {wv:?} (tol {})",
                tol * scale
            );
        }
    }
}

const HALF_KINDS: [FftKind; 3] = [FftKind::C2CHalf, FftKind::R2CHalf, FftKind::C2RHalf];

fn pytorch_message(sizes: &[i64]) -> String {
    format!(
        "cuFFT only supports dimensions whose sizes are powers of two when computing in half \
         precision, but got a signal size of{sizes:?}"
    )
}

// ---------------------------------------------------------------------------------------
// Which sizes
// ---------------------------------------------------------------------------------------

/// 1 is 2^0 (PyTorch's `is_pow_of_two(1)` is true): sizes of 1, alone or beside powers of
/// two, are accepted for every half kind and give the DFT.
#[test]
fn half_sizes_of_one_are_powers_of_two() {
    let rig = Rig::new();
    let mut rng = Rng(0x1234_5678);
    let shapes: [&[i64]; 6] = [&[1], &[1, 8], &[8, 1], &[1, 1, 1], &[2, 1, 4], &[1, 1, 2]];
    let mut failures = Vec::new();
    for kind in HALF_KINDS {
        for shape in shapes {
            let d = desc(kind, shape, 3);
            let (ins, want) = signals_and_expected(&d, &mut rng, false);
            match no_panic(&format!("{kind:?} {shape:?}"), || rig.run(&d, &ins, false)) {
                Ok(got) => assert_close(&format!("{kind:?} {shape:?}"), &got, &want, &ins, 4e-3),
                Err(e) => failures.push(format!("{kind:?} {shape:?}: {e}")),
            }
        }
    }
    assert!(failures.is_empty(), "refused:\n{}", failures.join("\n"));
}

/// Every size list with a size that is not a power of two, for every half kind, is refused
/// with PyTorch's message (sizes printed as a Vec, no space before `[`), before any plan is
/// made and without touching the plan cache.
#[test]
fn half_sizes_not_powers_of_two_are_refused_with_pytorchs_message_before_any_plan() {
    let rig = Rig::new();
    // Fill the cache with one plan, to see it untouched.
    let ok = desc(FftKind::C2CHalf, &[8], 1);
    let buf = rig.upload(&vec![0.0; 1 << 16], 2);
    rig.fft.execute(rig.stream, &ok, buf, buf, false).unwrap();
    let cases: &[&[i64]] = &[
        &[3],
        &[6],
        &[12],
        &[80, 80],
        &[8, 12],
        &[12, 8],
        &[1, 3],
        &[3, 1],
        &[2, 4, 6],
        &[6, 4, 2],
        &[1024, 96],
        &[65536 + 2],
        &[7, 7, 7],
    ];
    let mut failures = Vec::new();
    for kind in HALF_KINDS {
        for &sizes in cases {
            let d = desc(kind, sizes, 2);
            let made = rig.made();
            let keys = rig.fft.plan_cache_keys();
            let allocated = rig.alloc.stats().allocated_bytes.all.allocated;
            let executions = rig.fft.backend().counts().executions.len();
            let got = no_panic(&format!("{kind:?} {sizes:?}"), || {
                rig.fft.execute(rig.stream, &d, buf, buf, false)
            });
            let want = pytorch_message(sizes);
            match got {
                Ok(()) => failures.push(format!("{kind:?} {sizes:?}: accepted")),
                Err(e) if e.to_string() != want => {
                    failures.push(format!("{kind:?} {sizes:?}: {e:?}, want {want:?}"))
                }
                Err(_) => {}
            }
            if rig.made() != made {
                failures.push(format!("{kind:?} {sizes:?}: a plan was made"));
            }
            if rig.fft.plan_cache_keys() != keys {
                failures.push(format!("{kind:?} {sizes:?}: the cache changed"));
            }
            if rig.alloc.stats().allocated_bytes.all.allocated != allocated {
                failures.push(format!("{kind:?} {sizes:?}: a work area was allocated"));
            }
            if rig.fft.backend().counts().executions.len() != executions {
                failures.push(format!("{kind:?} {sizes:?}: something ran"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Only the signal sizes must be powers of two: a batch of 3, a `dist` of 9 or 11, an
/// `embed` of 10 or 5 around a signal of 8 or 4 are all fine (C2R's input is `n/2 + 1`).
#[test]
fn half_layouts_that_are_not_powers_of_two_are_fine() {
    let rig = Rig::new();
    let mut rng = Rng(99);
    for kind in HALF_KINDS {
        for inverse in [false, true] {
            let mut d = desc(kind, &[4, 8], 3);
            let (i, o) = shapes(&d);
            let pad = |s: &Vec<i64>, extra: i64, stride: i64| {
                let embed = vec![s[0] + 1, s[1] + extra];
                FftLayout {
                    dist: embed.iter().product::<i64>() * stride + 3,
                    embed,
                    stride,
                }
            };
            d.input = pad(&i, 2, 2);
            d.output = pad(&o, 1, 1);
            let (ins, want) = signals_and_expected(&d, &mut rng, inverse);
            let what = format!("{kind:?} inverse {inverse}: {d:?}");
            let got = rig
                .run(&d, &ins, inverse)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_close(&what, &got, &want, &ins, 4e-3);
        }
    }
}

/// Zero, negative and huge sizes: typed errors, never panics.
#[test]
fn half_degenerate_sizes_are_errors_not_panics() {
    let rig = Rig::new();
    let buf = rig.upload(&vec![0.0; 64], 2);
    for kind in HALF_KINDS {
        for sizes in [
            vec![0],
            vec![-8],
            vec![-3],
            vec![8, 0],
            vec![1 << 62],
            vec![1 << 62, 1 << 62],
            vec![i64::MIN],
            vec![i64::MAX],
            vec![8, i64::MIN],
            vec![],
            vec![2, 2, 2, 2],
        ] {
            let d = desc(kind, &sizes, 1);
            let got = no_panic(&format!("{kind:?} {sizes:?}"), || {
                rig.fft.execute(rig.stream, &d, buf, buf, false)
            });
            assert!(got.is_err(), "{kind:?} {sizes:?}: accepted");
        }
        for batch in [0, -1, i64::MIN] {
            let d = desc(kind, &[8], batch);
            let got = no_panic(&format!("{kind:?} batch {batch}"), || {
                rig.fft.execute(rig.stream, &d, buf, buf, false)
            });
            if batch != 0 {
                assert!(got.is_err(), "{kind:?} batch {batch}: accepted");
            }
        }
    }
}

/// A NaN in a half signal spreads to every output of its transform, as IEEE arithmetic
/// does; the other signal of the batch is untouched by it.
#[test]
fn half_nan_spreads_within_its_signal_only() {
    let rig = Rig::new();
    let d = desc(FftKind::C2CHalf, &[8], 2);
    let mut a: Vec<C> = (0..8).map(|i| (i as f64, 0.0)).collect();
    a[3].0 = f64::NAN;
    let b: Vec<C> = (0..8).map(|i| (h(0.25 * i as f64), 0.0)).collect();
    let got = rig.run(&d, &[a, b.clone()], false).unwrap();
    assert!(
        got[0].iter().all(|v| v.0.is_nan() || v.1.is_nan()),
        "a NaN input: {:?}",
        got[0]
    );
    let want = dft(&b, &[8], false);
    assert_close("the other signal", &got[1..], &[want], &[b], 2e-3);
}

// ---------------------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------------------

/// Random power-of-two shapes, ranks 1 to 3, batches, strides: within fp16's tolerance of
/// a CPU DFT (a tighter bound than the conformance suite's).
#[test]
fn half_transforms_match_a_cpu_dft_tightly() {
    let rig = Rig::new();
    let mut rng = Rng(0xfeed_f00d);
    for round in 0..30 {
        let kind = HALF_KINDS[round % 3];
        let rank = 1 + round / 3 % 3;
        let shape: Vec<i64> = (0..rank)
            .map(|_| 1 << rng.below(if rank == 1 { 9 } else { 4 }))
            .collect();
        let mut d = desc(kind, &shape, 1 + rng.below(3) as i64);
        if round % 2 == 1 {
            d.input.stride = 2;
            d.input.dist = d.input.dist * 2 + 1;
        }
        let inverse = round % 4 >= 2;
        let (ins, want) = signals_and_expected(&d, &mut rng, inverse);
        let what = format!("round {round} {kind:?} {shape:?} inverse {inverse}");
        let got = rig
            .run(&d, &ins, inverse)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_close(&what, &got, &want, &ins, 2e-3);
    }
}

/// Forward then inverse (C2C, and R2C then C2R) gives n·x within fp16's tolerance: the
/// transforms are unnormalised in both directions.
#[test]
fn half_round_trips_give_n_times_the_signal() {
    let rig = Rig::new();
    let mut rng = Rng(7);
    for shape in [vec![16i64], vec![4, 8], vec![2, 2, 4], vec![256], vec![1]] {
        let n: i64 = shape.iter().product();
        let c2c = desc(FftKind::C2CHalf, &shape, 2);
        let xs: Vec<Vec<C>> = (0..2)
            .map(|_| (0..n).map(|_| (h(rng.unit()), h(rng.unit()))).collect())
            .collect();
        let spec = rig.run(&c2c, &xs, false).unwrap();
        let back = rig.run(&c2c, &spec, true).unwrap();
        let want: Vec<Vec<C>> = xs
            .iter()
            .map(|x| {
                x.iter()
                    .map(|&(a, b)| (a * n as f64, b * n as f64))
                    .collect()
            })
            .collect();
        assert_close(&format!("C2C {shape:?}"), &back, &want, &xs, 4e-3);
        let r2c = desc(FftKind::R2CHalf, &shape, 2);
        let c2r = desc(FftKind::C2RHalf, &shape, 2);
        let reals: Vec<Vec<C>> = (0..2)
            .map(|_| (0..n).map(|_| (h(rng.unit()), 0.0)).collect())
            .collect();
        let half_spec = rig.run(&r2c, &reals, false).unwrap();
        let back = rig.run(&c2r, &half_spec, false).unwrap();
        let want: Vec<Vec<C>> = reals
            .iter()
            .map(|x| x.iter().map(|&(a, _)| (a * n as f64, 0.0)).collect())
            .collect();
        assert_close(&format!("R2C/C2R {shape:?}"), &back, &want, &reals, 4e-3);
    }
}

/// Values near fp16's range: outputs up to 60000 come out finite and right; an output past
/// 65504 is +inf (IEEE binary16); subnormal inputs give subnormal outputs, not zeros.
#[test]
fn half_values_near_the_ends_of_fp16s_range() {
    let rig = Rig::new();
    let d = desc(FftKind::C2CHalf, &[4], 1);
    // X0 = 60000, the others 0: within range.
    let x = vec![
        (15000.0, 0.0),
        (15000.0, 0.0),
        (15000.0, 0.0),
        (15000.0, 0.0),
    ];
    let got = rig.run(&d, std::slice::from_ref(&x), false).unwrap();
    assert_eq!(got[0][0], (60000.0, 0.0), "large but in range: {got:?}");
    for v in &got[0][1..] {
        assert!(v.0.abs() <= 64.0 && v.1.abs() <= 64.0, "{got:?}");
    }
    let near = vec![(65504.0, 0.0), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)];
    let got = rig.run(&d, &[near], false).unwrap();
    assert!(
        got[0].iter().all(|&v| v == (65504.0, 0.0)),
        "the largest fp16 through a delta: {got:?}"
    );
    let over = vec![(40000.0, 0.0), (40000.0, 0.0), (0.0, 0.0), (0.0, 0.0)];
    let got = rig.run(&d, &[over], false).unwrap();
    assert_eq!(got[0][0].0, f64::INFINITY, "80000 in fp16: {got:?}");
    let tiny = h(6.0e-8); // The smallest subnormal.
    let sub = vec![(tiny * 4.0, 0.0), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)];
    let got = rig.run(&d, &[sub], false).unwrap();
    assert!(
        got[0].iter().all(|&v| v == (tiny * 4.0, 0.0)),
        "a subnormal delta: {got:?}"
    );
}

/// In place (input and output one buffer) gives what out of place gives, as in fp32.
#[test]
fn half_in_place_c2c_equals_out_of_place() {
    let rig = Rig::new();
    let mut rng = Rng(5);
    for kind in [FftKind::C2CHalf, FftKind::C2C] {
        let d = desc(kind, &[4, 8], 2);
        let (ins, want) = signals_and_expected(&d, &mut rng, false);
        let input = rig.place(&d, &ins).unwrap();
        let got = rig.run_at(&d, input, Some(input), false).unwrap();
        assert_close(&format!("{kind:?} in place"), &got, &want, &ins, 4e-3);
    }
}

// ---------------------------------------------------------------------------------------
// The plan cache, and fp32/fp64 unchanged
// ---------------------------------------------------------------------------------------

/// Half and fp32 transforms of the same sizes and layouts are two plans, each reused by its
/// own kind, and each gives its own precision's result.
#[test]
fn half_and_fp32_plans_of_the_same_sizes_are_cached_apart() {
    let rig = Rig::new();
    let mut rng = Rng(11);
    let pairs = [
        (FftKind::C2CHalf, FftKind::C2C),
        (FftKind::R2CHalf, FftKind::R2C),
        (FftKind::C2RHalf, FftKind::C2R),
    ];
    let mut expected_plans = 0;
    for round in 0..2 {
        for (hk, fk) in pairs {
            for kind in [hk, fk, FftKind::Z2Z] {
                let d = desc(kind, &[8, 4], 2);
                let (ins, want) = signals_and_expected(&d, &mut rng, false);
                let got = rig.run(&d, &ins, false).unwrap();
                let tol = if kind.real_bytes() == 2 { 4e-3 } else { 1e-5 };
                assert_close(&format!("{kind:?} round {round}"), &got, &want, &ins, tol);
            }
            if round == 0 {
                expected_plans += 2;
            }
        }
    }
    // Z2Z once, each pair twice.
    assert_eq!(rig.made(), expected_plans + 1, "plans made");
    assert_eq!(rig.fft.plan_cache_size() as u64, expected_plans + 1);
    let keys: Vec<FftKind> = rig.fft.plan_cache_keys().iter().map(|k| k.kind).collect();
    for (hk, fk) in pairs {
        assert!(keys.contains(&hk) && keys.contains(&fk), "{keys:?}");
    }
}

/// fp32/fp64 transforms of sizes that are not powers of two are still accepted and right.
#[test]
fn fp32_and_fp64_keep_any_size() {
    let rig = Rig::new();
    let mut rng = Rng(13);
    let cases: &[(FftKind, &[i64])] = &[
        (FftKind::C2C, &[80]),
        (FftKind::C2C, &[6, 10]),
        (FftKind::R2C, &[12]),
        (FftKind::C2R, &[10]),
        (FftKind::C2R, &[3, 5]),
        (FftKind::Z2Z, &[3, 5, 7]),
        (FftKind::D2Z, &[7]),
        (FftKind::Z2D, &[9]),
        (FftKind::Z2D, &[1]),
    ];
    for &(kind, sizes) in cases {
        let d = desc(kind, sizes, 2);
        let (ins, want) = signals_and_expected(&d, &mut rng, false);
        let what = format!("{kind:?} {sizes:?}");
        let got = rig
            .run(&d, &ins, false)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let tol = if kind.real_bytes() == 8 { 1e-9 } else { 2e-5 };
        assert_close(&what, &got, &want, &ins, tol);
    }
}
