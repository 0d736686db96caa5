//! [`FakeFft`]: cuFFT played on the fake device. Plans remember their transform and count
//! themselves (made, destroyed, executed, with the work area each execution got); the
//! arithmetic is a direct DFT on the host in f64, a reference rather than a model of
//! cuFFT's rounding. Like [`FakeBlas`](crate::FakeBlas), an execution reads and writes in
//! stream order with synchronous copies.
use crate::MathLibError;
use crate::fft_backend::FftBackend;
use ferrocuda_driver::cufft::{FftDesc, FftError, FftKind, FftLayout};
use ferrocuda_driver::{Driver, DriverError, FakeDriver};
use ferrocuda_types::{DeviceIndex, DevicePtr, StreamHandle};
use half::f16;
use parking_lot::Mutex;
use std::sync::Arc;

/// What the fake cuFFT has done.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FakeFftCounts {
    /// Plans made.
    pub made: u64,
    /// Plans destroyed.
    pub destroyed: u64,
    /// Executions, with the work area each got (address, the plan's work size).
    pub executions: Vec<(DevicePtr, u64)>,
}

/// A fake plan: its transform and work size; counted as destroyed when dropped.
#[derive(Debug)]
pub struct FakePlan {
    desc: FftDesc,
    work: u64,
    counts: Arc<Mutex<FakeFftCounts>>,
}

impl Drop for FakePlan {
    fn drop(&mut self) {
        self.counts.lock().destroyed += 1;
    }
}

/// cuFFT on a [`FakeDriver`].
#[derive(Debug)]
pub struct FakeFft {
    fake: Arc<FakeDriver>,
    counts: Arc<Mutex<FakeFftCounts>>,
}

impl FakeFft {
    /// cuFFT on `fake`.
    pub fn new(fake: Arc<FakeDriver>) -> FakeFft {
        FakeFft {
            fake,
            counts: Arc::default(),
        }
    }

    /// What it has done so far.
    pub fn counts(&self) -> FakeFftCounts {
        self.counts.lock().clone()
    }
}

/// The fake's work size: 16 bytes per element of the batch's signals (cuFFT's own sizes
/// vary by transform; tests need only that it is not zero).
fn fake_work_size(desc: &FftDesc) -> u64 {
    let n = desc
        .sizes
        .iter()
        .fold(desc.batch.max(1), |a, &s| a.saturating_mul(s.max(1)));
    (n as u64).saturating_mul(16)
}

impl FftBackend for FakeFft {
    type Plan = FakePlan;

    fn make_plan(
        &self,
        device: DeviceIndex,
        desc: &FftDesc,
    ) -> Result<(FakePlan, u64), MathLibError> {
        self.fake
            .device_properties(device)
            .map_err(FftError::from)?;
        let rank = desc.sizes.len();
        if !(1..=3).contains(&rank)
            || desc.input.embed.len() != rank
            || desc.output.embed.len() != rank
        {
            return Err(FftError::InvalidArgument(
                "a transform has 1 to 3 dimensions, its layouts as many",
            )
            .into());
        }
        if desc.sizes.iter().any(|&n| n < 1) || desc.batch < 1 {
            return Err(FftError::Cufft {
                code: 8,
                name: "CUFFT_INVALID_SIZE",
            }
            .into());
        }
        if desc.kind.real_bytes() == 2 && desc.sizes.iter().any(|&n| n.count_ones() != 1) {
            return Err(FftError::Cufft {
                code: 16,
                name: "CUFFT_NOT_SUPPORTED",
            }
            .into());
        }
        self.counts.lock().made += 1;
        let work = fake_work_size(desc);
        Ok((
            FakePlan {
                desc: desc.clone(),
                work,
                counts: self.counts.clone(),
            },
            work,
        ))
    }

    fn work_size(&self, plan: &FakePlan) -> u64 {
        plan.work
    }

    fn execute(
        &self,
        plan: &FakePlan,
        stream: StreamHandle,
        work: DevicePtr,
        io: (DevicePtr, DevicePtr),
        inverse: bool,
    ) -> Result<(), MathLibError> {
        if plan.work > 0 && work.0 == 0 {
            return Err(FftError::Cufft {
                code: 13,
                name: "CUFFT_NO_WORKSPACE",
            }
            .into());
        }
        host_fft(&*self.fake, stream, &plan.desc, io, inverse).map_err(FftError::from)?;
        self.counts.lock().executions.push((work, plan.work));
        Ok(())
    }
}

/// Whether the kind's input (and output) is complex, and its precision in bytes per real.
fn sides(kind: FftKind) -> (bool, bool, usize) {
    let (cin, cout) = kind.complex_sides();
    (cin, cout, kind.real_bytes())
}

/// The storage offsets (in elements) of every element of a signal of `shape`, batch `b`.
fn offsets(layout: &FftLayout, shape: &[i64], b: i64) -> Vec<i64> {
    let mut out = vec![b * layout.dist];
    for (d, &n) in shape.iter().enumerate() {
        let inner: i64 = layout.embed[d + 1..].iter().product();
        out = out
            .iter()
            .flat_map(|&o| (0..n).map(move |x| o + x * inner * layout.stride))
            .collect();
    }
    out
}

fn read(
    d: &dyn Driver,
    stream: StreamHandle,
    at: DevicePtr,
    complex: bool,
    real: usize,
    offs: &[i64],
) -> Result<Vec<(f64, f64)>, DriverError> {
    let elem = if complex { 2 * real } else { real };
    let span = offs.iter().max().map_or(0, |&m| (m as usize + 1) * elem);
    let mut raw = vec![0u8; span];
    d.memcpy_dtoh(&mut raw, at, stream)?;
    let num = |i: usize| -> f64 {
        match real {
            2 => f16::from_le_bytes([raw[i], raw[i + 1]]).to_f64(),
            4 => f64::from(f32::from_le_bytes(
                raw[i..i + 4].try_into().unwrap_or([0; 4]),
            )),
            _ => f64::from_le_bytes(raw[i..i + 8].try_into().unwrap_or([0; 8])),
        }
    };
    Ok(offs
        .iter()
        .map(|&o| {
            let i = o as usize * elem;
            (num(i), if complex { num(i + real) } else { 0.0 })
        })
        .collect())
}

fn write(
    d: &dyn Driver,
    stream: StreamHandle,
    at: DevicePtr,
    complex: bool,
    real: usize,
    offs: &[i64],
    values: &[(f64, f64)],
) -> Result<(), DriverError> {
    let elem = if complex { 2 * real } else { real };
    let span = offs.iter().max().map_or(0, |&m| (m as usize + 1) * elem);
    let mut raw = vec![0u8; span];
    d.memcpy_dtoh(&mut raw, at, stream)?;
    for (&o, &(re, im)) in offs.iter().zip(values) {
        let i = o as usize * elem;
        let parts: &[f64] = if complex { &[re, im] } else { &[re] };
        for (j, &v) in parts.iter().enumerate() {
            let at = i + j * real;
            match real {
                2 => raw[at..at + 2].copy_from_slice(&f16::from_f64(v).to_le_bytes()),
                4 => raw[at..at + 4].copy_from_slice(&(v as f32).to_le_bytes()),
                _ => raw[at..at + 8].copy_from_slice(&v.to_le_bytes()),
            }
        }
    }
    d.memcpy_htod_async(at, &raw, stream)
}

/// The DFT of a dense row-major signal of `shape`, one dimension at a time: radix-2 for
/// power-of-two lengths, a direct sum otherwise.
pub(crate) fn dft(x: &[(f64, f64)], shape: &[i64], inverse: bool) -> Vec<(f64, f64)> {
    let sign = if inverse { 1.0 } else { -1.0 };
    let mut cur = x.to_vec();
    for d in 0..shape.len() {
        let n = shape[d] as usize;
        let inner: usize = shape[d + 1..].iter().product::<i64>() as usize;
        let outer = cur.len() / (n * inner);
        let mut line = vec![(0.0, 0.0); n];
        for o in 0..outer {
            for i in 0..inner {
                for (j, v) in line.iter_mut().enumerate() {
                    *v = cur[(o * n + j) * inner + i];
                }
                let out = dft_1d(&line, sign);
                for (k, v) in out.into_iter().enumerate() {
                    cur[(o * n + k) * inner + i] = v;
                }
            }
        }
    }
    cur
}

fn dft_1d(x: &[(f64, f64)], sign: f64) -> Vec<(f64, f64)> {
    let n = x.len();
    let twiddle =
        |k: usize, m: usize| (sign * 2.0 * std::f64::consts::PI * k as f64 / m as f64).sin_cos();
    if n <= 1 || !n.is_power_of_two() {
        return (0..n)
            .map(|k| {
                x.iter()
                    .enumerate()
                    .fold((0.0, 0.0), |(ar, ai), (j, &(re, im))| {
                        let (s, c) = twiddle(j * k % n, n);
                        (ar + re * c - im * s, ai + re * s + im * c)
                    })
            })
            .collect();
    }
    // Iterative radix 2: bit-reversed order, then butterflies.
    let bits = n.trailing_zeros();
    let mut a: Vec<(f64, f64)> = (0..n)
        .map(|i| x[i.reverse_bits() >> (usize::BITS - bits)])
        .collect();
    let mut len = 2;
    while len <= n {
        for start in (0..n).step_by(len) {
            for k in 0..len / 2 {
                let (s, c) = twiddle(k, len);
                let (ur, ui) = a[start + k];
                let (vr, vi) = a[start + k + len / 2];
                let (tr, ti) = (vr * c - vi * s, vr * s + vi * c);
                a[start + k] = (ur + tr, ui + ti);
                a[start + k + len / 2] = (ur - tr, ui - ti);
            }
        }
        len *= 2;
    }
    a
}

/// The transform on the host, signal by signal.
fn host_fft(
    d: &dyn Driver,
    stream: StreamHandle,
    desc: &FftDesc,
    io: (DevicePtr, DevicePtr),
    inverse: bool,
) -> Result<(), DriverError> {
    let (cin, cout, real) = sides(desc.kind);
    let shape = &desc.sizes;
    let last = shape.len() - 1;
    let mut half = shape.clone();
    half[last] = shape[last] / 2 + 1;
    let (in_shape, out_shape) = match (cin, cout) {
        (true, true) => (shape.clone(), shape.clone()),
        (false, true) => (shape.clone(), half.clone()),
        _ => (half.clone(), shape.clone()),
    };
    for b in 0..desc.batch {
        let in_offs = offsets(&desc.input, &in_shape, b);
        let out_offs = offsets(&desc.output, &out_shape, b);
        let x = read(d, stream, io.0, cin, real, &in_offs)?;
        let y = match (cin, cout) {
            (true, true) => dft(&x, shape, inverse),
            (false, true) => keep_half(&dft(&x, shape, false), shape),
            _ => dft(&hermitian_full(&x, shape), shape, true)
                .into_iter()
                .map(|(re, _)| (re, 0.0))
                .collect(),
        };
        write(d, stream, io.1, cout, real, &out_offs, &y)?;
    }
    Ok(())
}

/// The first `n/2 + 1` of the last dimension of a full spectrum.
fn keep_half(full: &[(f64, f64)], shape: &[i64]) -> Vec<(f64, f64)> {
    let n_last = shape[shape.len() - 1] as usize;
    let h = n_last / 2 + 1;
    full.chunks(n_last)
        .flat_map(|row| row[..h].to_vec())
        .collect()
}

/// The full spectrum of a real signal from its first `n/2 + 1` of the last dimension.
fn hermitian_full(half: &[(f64, f64)], shape: &[i64]) -> Vec<(f64, f64)> {
    let n: usize = shape.iter().product::<i64>() as usize;
    let n_last = shape[shape.len() - 1] as usize;
    let h = n_last / 2 + 1;
    let outer: Vec<usize> = shape[..shape.len() - 1]
        .iter()
        .map(|&v| v as usize)
        .collect();
    let flat = |idx: &[usize], k: usize| -> usize {
        idx.iter().zip(&outer).fold(0, |a, (&i, &m)| a * m + i) * h + k
    };
    (0..n)
        .map(|i| {
            let k = i % n_last;
            let mut rest = i / n_last;
            let mut idx = vec![0; outer.len()];
            for dd in (0..outer.len()).rev() {
                idx[dd] = rest % outer[dd];
                rest /= outer[dd];
            }
            if k < h {
                half[flat(&idx, k)]
            } else {
                let neg: Vec<usize> = idx.iter().zip(&outer).map(|(&i, &m)| (m - i) % m).collect();
                let (re, im) = half[flat(&neg, n_last - k)];
                (re, -im)
            }
        })
        .collect()
}
