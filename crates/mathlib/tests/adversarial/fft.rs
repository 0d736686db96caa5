//! Adversarial scenarios: the FFT rig, the plan cache against a model LRU, FFT results and bad descriptors.
use super::*;

// ---------------------------------------------------------------------------------------
// FFT rig
// ---------------------------------------------------------------------------------------

struct FftRig {
    fake: Arc<FakeDriver>,
    alloc: Arc<CachingAllocator>,
    fft: Fft<FakeFft>,
    stream: StreamHandle,
}

impl FftRig {
    fn new() -> FftRig {
        let fake = Arc::new(FakeDriver::default());
        let alloc = Arc::new(
            CachingAllocator::new(fake.clone(), DEV, AllocatorConfig::default(), Caching::On)
                .unwrap(),
        );
        let stream = fake.stream_create(DEV, StreamFlags::default()).unwrap();
        FftRig {
            fft: Fft::new(FakeFft::new(fake.clone()), alloc.clone()).expect("fft"),
            fake,
            alloc,
            stream,
        }
    }
    fn upload(&self, values: &[f64], f64s: bool) -> DevicePtr {
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|&v| {
                if f64s {
                    v.to_le_bytes().to_vec()
                } else {
                    (v as f32).to_le_bytes().to_vec()
                }
            })
            .collect();
        let a = self
            .alloc
            .allocate(bytes.len().max(1) as u64, self.stream)
            .unwrap();
        self.fake
            .memcpy_htod_async(a.ptr, &bytes, self.stream)
            .unwrap();
        a.ptr
    }
    fn download(&self, ptr: DevicePtr, n: usize, f64s: bool) -> Vec<f64> {
        let w = if f64s { 8 } else { 4 };
        let mut bytes = vec![0u8; n * w];
        self.fake.memcpy_dtoh(&mut bytes, ptr, self.stream).unwrap();
        bytes
            .chunks_exact(w)
            .map(|c| {
                if f64s {
                    f64::from_le_bytes(c.try_into().unwrap())
                } else {
                    f64::from(f32::from_le_bytes(c.try_into().unwrap()))
                }
            })
            .collect()
    }
    fn counts(&self) -> (u64, u64) {
        let c = self.fft.backend().counts();
        (c.made, c.destroyed)
    }
}

fn dense(shape: &[i64]) -> FftLayout {
    FftLayout {
        embed: shape.to_vec(),
        stride: 1,
        // Wrapping: the overflow tests build descriptors whose product is past 64 bits.
        dist: shape.iter().fold(1i64, |a, &b| a.wrapping_mul(b)),
    }
}

fn desc(kind: FftKind, sizes: &[i64], batch: i64) -> FftDesc {
    let mut half = sizes.to_vec();
    if let Some(last) = half.last_mut() {
        *last = *last / 2 + 1;
    }
    let (i, o) = match kind {
        FftKind::R2C | FftKind::D2Z => (sizes.to_vec(), half),
        FftKind::C2R | FftKind::Z2D => (half, sizes.to_vec()),
        _ => (sizes.to_vec(), sizes.to_vec()),
    };
    FftDesc {
        kind,
        sizes: sizes.to_vec(),
        batch,
        input: dense(&i),
        output: dense(&o),
    }
}

/// Dense row-major DFT, separable, in f64 (`sign` -1 forward).
fn dft(x: &[(f64, f64)], shape: &[usize], inverse: bool) -> Vec<(f64, f64)> {
    let sign = if inverse { 1.0 } else { -1.0 };
    let mut cur = x.to_vec();
    for d in 0..shape.len() {
        let n = shape[d];
        let inner: usize = shape[d + 1..].iter().product();
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

fn interleave(x: &[(f64, f64)]) -> Vec<f64> {
    x.iter().flat_map(|&(r, i)| [r, i]).collect()
}

fn pairs(v: &[f64]) -> Vec<(f64, f64)> {
    v.chunks_exact(2).map(|c| (c[0], c[1])).collect()
}

// ---------------------------------------------------------------------------------------
// Rule 3: the plan cache
// ---------------------------------------------------------------------------------------

/// PyTorch's `CuFFTParamsLRUCache` as a model: most recent first; a miss at capacity evicts
/// the last; lowering max evicts from the back; 0 keeps nothing (made and destroyed).
/// With a work budget (ours): a miss evicts from the back until the new plan fits; a plan
/// alone over the budget is made and destroyed and leaves the others in place.
struct ModelLru {
    keys: VecDeque<usize>,
    max: usize,
    budget: Option<u64>,
    made: u64,
    destroyed: u64,
    /// Coverage: misses alone over the budget, and budget evictions on a miss.
    alone_over: u64,
    budget_evictions: u64,
}

impl ModelLru {
    fn work(&self, works: &[u64]) -> u64 {
        self.keys.iter().map(|&k| works[k]).sum()
    }
    fn trim(&mut self, works: &[u64]) {
        while self.keys.len() > self.max {
            self.keys.pop_back();
            self.destroyed += 1;
        }
        if let Some(b) = self.budget {
            while self.work(works) > b {
                self.keys.pop_back();
                self.destroyed += 1;
            }
        }
    }
    fn lookup(&mut self, key: usize, works: &[u64]) {
        if let Some(pos) = self.keys.iter().position(|&k| k == key) {
            self.keys.remove(pos);
            self.keys.push_front(key);
            return;
        }
        self.made += 1;
        let alone_over = self.budget.is_some_and(|b| works[key] > b);
        if self.max == 0 || alone_over {
            self.alone_over += u64::from(alone_over && self.max > 0);
            self.destroyed += 1;
            return;
        }
        while self.keys.len() >= self.max {
            self.keys.pop_back();
            self.destroyed += 1;
        }
        if let Some(b) = self.budget {
            while self.work(works) + works[key] > b {
                self.keys.pop_back();
                self.destroyed += 1;
                self.budget_evictions += 1;
            }
        }
        self.keys.push_front(key);
    }
    fn clear(&mut self) {
        self.destroyed += self.keys.len() as u64;
        self.keys.clear();
    }
}

fn c2c_keys() -> Vec<FftDesc> {
    let mut strided = desc(FftKind::C2C, &[4], 1);
    strided.input.stride = 2;
    strided.output.stride = 2;
    strided.input.dist = 8;
    strided.output.dist = 8;
    vec![
        desc(FftKind::C2C, &[2], 1),
        desc(FftKind::C2C, &[3], 1),
        desc(FftKind::C2C, &[4], 1),
        desc(FftKind::C2C, &[5], 1),
        desc(FftKind::C2C, &[6], 1),
        desc(FftKind::C2C, &[4], 2), // the batch differs
        desc(FftKind::Z2Z, &[4], 1), // the precision differs
        strided,                     // the layout differs
        desc(FftKind::C2C, &[2, 2], 1),
    ]
}

fn run_program(rig: &FftRig, keys: &[FftDesc], works: &[u64], seed: u64, budgets: bool) {
    let buf = rig.upload(&vec![0.0; 1 << 16], true);
    // A fresh start: nothing kept, PyTorch's default size, no budget.
    rig.fft.clear_plan_cache();
    rig.fft.set_plan_cache_max_size(4096);
    rig.fft.set_plan_cache_max_work_bytes(None);
    let mut model = ModelLru {
        keys: VecDeque::new(),
        max: rig.fft.plan_cache_max_size(),
        budget: None,
        made: 0,
        destroyed: 0,
        alone_over: 0,
        budget_evictions: 0,
    };
    let mut rng = Rng(seed);
    let (made0, destroyed0) = rig.counts();
    for step in 0..400 {
        let r = rng.below(100);
        let what;
        if r < 78 {
            let k = rng.below(keys.len() as u64) as usize;
            what = format!("execute key {k}");
            rig.fft
                .execute(rig.stream, &keys[k], buf, buf, rng.below(2) == 1)
                .unwrap_or_else(|e| panic!("step {step} {what}: {e}"));
            model.lookup(k, works);
        } else if r < 90 {
            let m = rng.below(6) as usize;
            what = format!("set_max_size({m})");
            rig.fft.set_plan_cache_max_size(m);
            model.max = m;
            model.trim(works);
        } else if r < 92 {
            what = "clear".into();
            rig.fft.clear_plan_cache();
            model.clear();
        } else if r < 95 {
            what = "set_max_size(4096)".into();
            rig.fft.set_plan_cache_max_size(4096);
            model.max = 4096;
        } else if budgets {
            let total: u64 = works.iter().sum();
            let b = if rng.below(4) == 0 {
                None
            } else {
                Some(rng.below(total + 2))
            };
            what = format!("set_max_work_bytes({b:?})");
            rig.fft.set_plan_cache_max_work_bytes(b);
            model.budget = b;
            model.trim(works);
        } else {
            what = "nothing".into();
        }
        let want: Vec<FftDesc> = model.keys.iter().map(|&k| keys[k].clone()).collect();
        let got = rig.fft.plan_cache_keys();
        if got != want {
            let idx = |d: &FftDesc| keys.iter().position(|k| k == d);
            panic!(
                "step {step} after {what}: keys {:?}, model {:?} (max {}, budget {:?})",
                got.iter().map(idx).collect::<Vec<_>>(),
                model.keys,
                model.max,
                model.budget
            );
        }
        assert_eq!(
            rig.fft.plan_cache_size(),
            want.len(),
            "step {step} {what}: size"
        );
        assert_eq!(
            rig.fft.plan_cache_work_bytes(),
            model.work(works),
            "step {step} {what}: work bytes"
        );
        if let Some(b) = rig.fft.plan_cache_max_work_bytes() {
            assert!(
                rig.fft.plan_cache_work_bytes() <= b,
                "step {step}: over budget"
            );
        }
        let (made, destroyed) = rig.counts();
        assert_eq!(
            (made - made0, destroyed - destroyed0),
            (model.made, model.destroyed),
            "step {step} after {what}: plans made, destroyed"
        );
    }
    if budgets {
        assert!(
            model.alone_over > 0 && model.budget_evictions > 0,
            "the program exercised the budget: {} alone over, {} evictions",
            model.alone_over,
            model.budget_evictions
        );
    }
}

#[test]
fn plan_cache_is_an_lru_against_a_model() {
    let rig = FftRig::new();
    assert_eq!(rig.fft.plan_cache_max_size(), 4096);
    assert_eq!(rig.fft.plan_cache_max_work_bytes(), None);
    let keys = c2c_keys();
    // Work sizes are irrelevant without a budget; the model still sums them, so measure.
    let works = measure_works(&keys);
    run_program(&rig, &keys, &works, 0x0123_4567_89ab_cdef, false);
    run_program(&rig, &keys, &works, 0xfeed_beef_dead_0042, false);
}

fn measure_works(keys: &[FftDesc]) -> Vec<u64> {
    keys.iter()
        .map(|k| {
            let rig = FftRig::new();
            let buf = rig.upload(&vec![0.0; 1 << 16], true);
            rig.fft.execute(rig.stream, k, buf, buf, false).unwrap();
            assert_eq!(rig.fft.plan_cache_size(), 1);
            rig.fft.plan_cache_work_bytes()
        })
        .collect()
}

#[test]
fn plan_cache_with_a_work_budget_against_a_model() {
    let keys: Vec<FftDesc> = [
        (8, 1),
        (16, 1),
        (32, 2),
        (64, 1),
        (128, 2),
        (12, 3),
        (30, 1),
    ]
    .iter()
    .map(|&(n, b)| desc(FftKind::C2C, &[n], b))
    .collect();
    let works = measure_works(&keys);
    assert!(
        works.iter().filter(|&&w| w > 0).count() >= 3,
        "the fake reports work sizes for these transforms: {works:?}"
    );
    let rig = FftRig::new();
    run_program(&rig, &keys, &works, 0x1357_9bdf_2468_ace0, true);
    run_program(&rig, &keys, &works, 0x0bad_cafe_f00d_0001, true);
}

/// The default capacity: the 4 097th distinct plan evicts the first. (Distinct by stride,
/// so that each execution stays two elements long.)
#[test]
fn plan_cache_default_capacity_is_4096() {
    let strided = |s: i64| {
        let mut d = desc(FftKind::C2C, &[2], 1);
        for l in [&mut d.input, &mut d.output] {
            l.stride = s;
            l.dist = 2 * s;
        }
        d
    };
    let rig = FftRig::new();
    let buf = rig.upload(&vec![0.0; 2 * 2 * 4098], false);
    for s in 1..=4097 {
        rig.fft
            .execute(rig.stream, &strided(s), buf, buf, false)
            .unwrap();
    }
    assert_eq!(rig.fft.plan_cache_size(), 4096);
    assert_eq!(rig.counts(), (4097, 1));
    let keys = rig.fft.plan_cache_keys();
    assert_eq!(keys[0], strided(4097));
    assert_eq!(keys[4095], strided(2));
    assert!(!keys.contains(&strided(1)));
}

// ---------------------------------------------------------------------------------------
// Rule 4: FFT results
// ---------------------------------------------------------------------------------------

#[test]
fn c2c_forward_then_inverse_is_n_times_x() {
    let mut rng = Rng(0x00ab_cdef_0123_4567);
    let shapes: &[&[i64]] = &[
        &[2],
        &[3],
        &[5],
        &[7],
        &[8],
        &[12],
        &[17],
        &[64],
        &[97],
        &[3, 5],
        &[4, 6],
        &[2, 3, 5],
        &[7, 1, 3],
    ];
    let rig = FftRig::new();
    let mut failures = Vec::new();
    for f64s in [false, true] {
        for &shape in shapes {
            let kind = if f64s { FftKind::Z2Z } else { FftKind::C2C };
            let batch = 2;
            let n: i64 = shape.iter().product();
            let x: Vec<(f64, f64)> = (0..n * batch).map(|_| (rng.unit(), rng.unit())).collect();
            let d = desc(kind, shape, batch);
            let (xin, mid, out) = (
                rig.upload(&interleave(&x), f64s),
                rig.upload(&vec![0.0; 2 * (n * batch) as usize], f64s),
                rig.upload(&vec![0.0; 2 * (n * batch) as usize], f64s),
            );
            let r = rig
                .fft
                .execute(rig.stream, &d, xin, mid, false)
                .and_then(|()| rig.fft.execute(rig.stream, &d, mid, out, true));
            if let Err(e) = r {
                failures.push(format!("{kind:?} {shape:?}: {e}"));
                continue;
            }
            let xf = pairs(&rig.download(mid, 2 * (n * batch) as usize, f64s));
            let y = pairs(&rig.download(out, 2 * (n * batch) as usize, f64s));
            let ushape: Vec<usize> = shape.iter().map(|&s| s as usize).collect();
            let tol = if f64s { 1e-10 } else { 2e-4 } * n as f64;
            for b in 0..batch as usize {
                let sig = &x[b * n as usize..(b + 1) * n as usize];
                let want_f = dft(sig, &ushape, false);
                for i in 0..n as usize {
                    let (g, w) = (xf[b * n as usize + i], want_f[i]);
                    if (g.0 - w.0).abs() > tol || (g.1 - w.1).abs() > tol {
                        failures.push(format!(
                            "{kind:?} {shape:?} batch {b} forward bin {i}: {g:?} vs {w:?}"
                        ));
                        break;
                    }
                    let (g, w) = (y[b * n as usize + i], sig[i]);
                    let w = (w.0 * n as f64, w.1 * n as f64);
                    if (g.0 - w.0).abs() > tol || (g.1 - w.1).abs() > tol {
                        failures.push(format!(
                            "{kind:?} {shape:?} batch {b} round trip element {i}: {g:?} vs n·x {w:?}"
                        ));
                        break;
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn r2c_is_the_first_half_of_the_full_dft_and_c2r_inverts_it() {
    let mut rng = Rng(0x7777_1234_5678_9999);
    let shapes: &[&[i64]] = &[
        &[2],
        &[3],
        &[7],
        &[8],
        &[15],
        &[16],
        &[3, 5],
        &[4, 4],
        &[2, 3, 4],
    ];
    let rig = FftRig::new();
    let mut failures = Vec::new();
    for f64s in [false, true] {
        let (r2c, c2r) = if f64s {
            (FftKind::D2Z, FftKind::Z2D)
        } else {
            (FftKind::R2C, FftKind::C2R)
        };
        for &shape in shapes {
            let batch = 3i64;
            let n: i64 = shape.iter().product();
            let last = *shape.last().unwrap();
            let h = last / 2 + 1;
            let nh = n / last * h;
            let x: Vec<f64> = (0..n * batch).map(|_| rng.unit()).collect();
            let (xin, spec, back) = (
                rig.upload(&x, f64s),
                rig.upload(&vec![0.0; 2 * (nh * batch) as usize], f64s),
                rig.upload(&vec![0.0; (n * batch) as usize], f64s),
            );
            if let Err(e) = rig
                .fft
                .execute(rig.stream, &desc(r2c, shape, batch), xin, spec, false)
            {
                failures.push(format!("{r2c:?} {shape:?}: {e}"));
                continue;
            }
            let got = pairs(&rig.download(spec, 2 * (nh * batch) as usize, f64s));
            let ushape: Vec<usize> = shape.iter().map(|&s| s as usize).collect();
            let tol = if f64s { 1e-10 } else { 2e-4 } * n as f64;
            'batch: for b in 0..batch as usize {
                let sig: Vec<(f64, f64)> = x[b * n as usize..(b + 1) * n as usize]
                    .iter()
                    .map(|&r| (r, 0.0))
                    .collect();
                let full = dft(&sig, &ushape, false);
                let want: Vec<(f64, f64)> = full
                    .chunks(last as usize)
                    .flat_map(|row| row[..h as usize].to_vec())
                    .collect();
                for (i, w) in want.iter().enumerate() {
                    let g = got[b * nh as usize + i];
                    if (g.0 - w.0).abs() > tol || (g.1 - w.1).abs() > tol {
                        failures.push(format!(
                            "{r2c:?} {shape:?} batch {b} bin {i}: {g:?} vs {w:?}"
                        ));
                        break 'batch;
                    }
                }
            }
            if let Err(e) = rig
                .fft
                .execute(rig.stream, &desc(c2r, shape, batch), spec, back, false)
            {
                failures.push(format!("{c2r:?} {shape:?}: {e}"));
                continue;
            }
            let y = rig.download(back, (n * batch) as usize, f64s);
            for (i, (&g, &w)) in y.iter().zip(&x).enumerate() {
                if (g - w * n as f64).abs() > tol {
                    failures.push(format!(
                        "{c2r:?} {shape:?} element {i}: {g} vs n·x {}",
                        w * n as f64
                    ));
                    break;
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A transform of length 1 is the identity (cuFFT accepts it); a typed refusal is tolerated,
/// a panic is not.
#[test]
fn length_one_transform_is_identity_or_a_typed_error() {
    let rig = FftRig::new();
    let x = [0.25, -0.5, 1.0, 2.0];
    let (i, o) = (rig.upload(&x, false), rig.upload(&[0.0; 4], false));
    let r = no_panic("C2C [1] batch 2", || {
        rig.fft
            .execute(rig.stream, &desc(FftKind::C2C, &[1], 2), i, o, false)
    });
    if r.is_ok() {
        assert_eq!(rig.download(o, 4, false), x);
    }
}

#[test]
fn bad_fft_descriptors_are_typed_errors() {
    let rig = FftRig::new();
    let buf = rig.upload(&vec![0.0; 4096], false);
    let good = desc(FftKind::C2C, &[8, 8], 1);
    let mut cases: Vec<(&str, FftDesc)> = vec![
        ("rank 0", desc(FftKind::C2C, &[], 1)),
        ("size 0", desc(FftKind::C2C, &[0], 1)),
        ("size 0 inner", desc(FftKind::C2C, &[4, 0], 1)),
        ("size 0 outer", desc(FftKind::C2C, &[0, 4, 4], 1)),
        ("r2c size 0", desc(FftKind::R2C, &[0], 1)),
        ("negative size", desc(FftKind::C2C, &[-4], 1)),
        ("rank 4", desc(FftKind::C2C, &[2, 2, 2, 2], 1)),
        ("rank 4 r2c", desc(FftKind::R2C, &[2, 2, 2, 2], 1)),
        ("rank 5", desc(FftKind::Z2Z, &[2, 2, 2, 2, 2], 1)),
        ("negative batch", desc(FftKind::C2C, &[8], -1)),
        ("batch 0", desc(FftKind::C2C, &[8], 0)),
    ];
    let mut d = good.clone();
    d.input.embed = vec![64];
    cases.push(("input embed rank 1 for rank 2", d));
    let mut d = good.clone();
    d.output.embed = vec![2, 4, 8];
    cases.push(("output embed rank 3 for rank 2", d));
    let mut d = good.clone();
    d.input.embed = vec![];
    cases.push(("empty input embed", d));
    let mut d = desc(FftKind::R2C, &[8], 1);
    d.output.embed = vec![1, 5];
    cases.push(("r2c output embed rank 2 for rank 1", d));
    let mut failures = Vec::new();
    for (name, d) in &cases {
        match catch(|| rig.fft.execute(rig.stream, d, buf, buf, false)) {
            Ok(Ok(())) => failures.push(format!("{name}: accepted {d:?}")),
            Ok(Err(_)) => {}
            Err(panic) => failures.push(format!("{name}: PANIC {panic}")),
        }
    }
    let kept = rig.fft.plan_cache_keys();
    if !kept.is_empty() {
        failures.push(format!("plans kept for bad transforms: {kept:?}"));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Layouts that are odd (negative or zero strides and distances, embeds smaller than the
/// signal, which cuFFT does not check for rank 1): any answer but a panic.
#[test]

fn odd_fft_layouts_never_panic() {
    let rig = FftRig::new();
    let buf = rig.upload(&vec![0.0; 4096], false);
    let mut cases: Vec<(&str, FftDesc)> = Vec::new();
    let base = || desc(FftKind::C2C, &[8], 2);
    let mut d = base();
    d.input.stride = 0;
    cases.push(("input stride 0", d));
    let mut d = base();
    d.input.stride = -1;
    cases.push(("input stride -1", d));
    let mut d = base();
    d.output.stride = -1;
    cases.push(("output stride -1", d));
    let mut d = base();
    d.output.dist = -8;
    cases.push(("output dist -8", d));
    let mut d = base();
    d.input.dist = 0;
    cases.push(("input dist 0", d));
    let mut d = base();
    d.input.embed = vec![-8];
    cases.push(("input embed -8", d));
    let mut d = desc(FftKind::C2C, &[8], 1);
    d.input.embed = vec![4];
    cases.push(("input embed [4] for [8]", d));
    let mut d = desc(FftKind::C2C, &[4, 8], 1);
    d.input.embed = vec![4, 4];
    cases.push(("input embed [4, 4] for [4, 8]", d));
    let mut d = desc(FftKind::R2C, &[8], 1);
    d.output.embed = vec![4];
    cases.push(("r2c output embed [4] for 8/2+1", d));
    let mut d = desc(FftKind::C2R, &[8], 1);
    d.input.embed = vec![4];
    cases.push(("c2r input embed [4] for 8/2+1", d));
    let mut panics = Vec::new();
    for (name, d) in &cases {
        match catch(|| rig.fft.execute(rig.stream, d, buf, buf, false)) {
            Ok(r) => eprintln!("odd layout {name}: {r:?}"),
            Err(panic) => panics.push(format!("{name}: PANIC {panic}")),
        }
    }
    assert!(panics.is_empty(), "{}", panics.join("\n"));
}

/// Sizes whose product is past 64 bits, or absurdly large: a typed error, never a panic
/// (and no attempt to touch that much memory).
#[test]

fn overflowing_fft_sizes_are_typed_errors() {
    let rig = FftRig::new();
    let buf = rig.upload(&vec![0.0; 64], false);
    let cases: Vec<(&str, FftDesc)> = vec![
        ("[i64::MAX]", desc(FftKind::C2C, &[i64::MAX], 1)),
        ("[2^40, 2^40]", desc(FftKind::C2C, &[1 << 40, 1 << 40], 1)),
        ("[2^32] batch 2^40", desc(FftKind::C2C, &[1 << 32], 1 << 40)),
        ("[2^45]", desc(FftKind::C2C, &[1 << 45], 1)),
        ("[2^40] batch 2^20", desc(FftKind::C2C, &[1 << 40], 1 << 20)),
    ];
    let mut failures = Vec::new();
    for (name, d) in &cases {
        match catch(|| rig.fft.execute(rig.stream, d, buf, buf, false)) {
            Ok(Ok(())) => failures.push(format!("{name}: accepted")),
            Ok(Err(e)) => eprintln!("{name}: {e}"),
            Err(panic) => failures.push(format!("{name}: PANIC {panic}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// After a descriptor that fails (typed error or, where the fake panics, a panic), the same
/// `Fft` still runs a good transform correctly and its cache is consistent.
#[test]
fn fft_still_works_after_a_failing_descriptor() {
    let rig = FftRig::new();
    let x: Vec<(f64, f64)> = (0..8)
        .map(|i| (f64::from(i), -0.5 * f64::from(i)))
        .collect();
    let good = desc(FftKind::Z2Z, &[8], 1);
    let (i, o) = (
        rig.upload(&interleave(&x), true),
        rig.upload(&[0.0; 16], true),
    );
    for bad in [
        desc(FftKind::C2C, &[0], 1),
        desc(FftKind::C2C, &[2, 2, 2, 2], 1),
        desc(FftKind::C2C, &[i64::MAX], 1),
    ] {
        let r = catch(|| rig.fft.execute(rig.stream, &bad, i, o, false));
        eprintln!("{:?}: {r:?}", bad.sizes);
        rig.fft.execute(rig.stream, &good, i, o, false).unwrap();
        let got = pairs(&rig.download(o, 16, true));
        let want = dft(&x, &[8], false);
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g.0 - w.0).abs() < 1e-9 && (g.1 - w.1).abs() < 1e-9,
                "{got:?}"
            );
        }
        assert_eq!(rig.fft.plan_cache_keys(), std::slice::from_ref(&good));
        if r.is_ok() {
            let (made, destroyed) = rig.counts();
            assert_eq!(
                made - destroyed,
                1,
                "one live plan (made {made}, destroyed {destroyed})"
            );
        }
    }
}
