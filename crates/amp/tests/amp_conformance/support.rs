//! The scaler's conformance tests' own pieces: a scaler on the harness's device (with
//! the fake kernels registered on the fake backend), random gradient lists with inf/NaN at
//! random places, and their comparison with the reference.
#![allow(unreachable_pub)]

use ferrocuda_amp::scaler::reference::{self, GradElement};
use ferrocuda_amp::scaler::{DeviceScalar, register_fake_amp_kernels};
use ferrocuda_amp::{GradScaler, GradScalerConfig, ScalerError, TensorView};
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_testkit::Harness;
use ferrocuda_types::{DType, DeviceIndex};
use half::{bf16, f16};

pub const DEV: DeviceIndex = DeviceIndex(0);

/// Names the step under way, so that a failure on a GPU run says where it stopped.
#[macro_export]
macro_rules! step {
    ($($t:tt)*) => { eprintln!("step: {}", format_args!($($t)*)) };
}

/// A scaler on device 0 of `h`.
pub fn scaler(h: &Harness, config: GradScalerConfig) -> Result<GradScaler, ScalerError> {
    if let Some(fake) = &h.fake {
        register_fake_amp_kernels(fake);
    }
    GradScaler::new(&h.rt, DEV, config)
}

/// One device scalar, read back (a sync).
pub fn read_scalar(h: &Harness, s: DeviceScalar<f32>) -> Result<f32, Box<dyn std::error::Error>> {
    let mut b = [0u8; 4];
    let stream = h.rt.current_stream(DEV)?;
    h.rt.driver()
        .memcpy_dtoh(&mut b, s.ptr(), stream.handle())?;
    Ok(f32::from_le_bytes(b))
}

/// xorshift64*: reproducible without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// A value of random sign and magnitude `m · 2^e`, `e` in `[lo, hi)`.
    pub fn value(&mut self, lo: i32, hi: i32) -> f32 {
        let m = 1.0 + (self.below(1 << 23) as f32) / (1 << 23) as f32;
        let e = lo + self.below((hi - lo) as u64) as i32;
        let s = if self.below(2) == 0 { 1.0 } else { -1.0 };
        s * m * 2f32.powi(e)
    }
}

/// One gradient on the host.
#[derive(Clone, Debug, PartialEq)]
pub enum HostGrad {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F64(Vec<f64>),
}

impl HostGrad {
    fn len(&self) -> usize {
        match self {
            HostGrad::F32(v) => v.len(),
            HostGrad::F16(v) => v.len(),
            HostGrad::BF16(v) => v.len(),
            HostGrad::F64(v) => v.len(),
        }
    }
    fn dtype(&self) -> DType {
        match self {
            HostGrad::F32(_) => DType::F32,
            HostGrad::F16(_) => DType::F16,
            HostGrad::BF16(_) => DType::BF16,
            HostGrad::F64(_) => DType::F64,
        }
    }
    fn bytes(&self) -> Vec<u8> {
        match self {
            HostGrad::F32(v) => bytemuck::cast_slice(v).to_vec(),
            HostGrad::F16(v) => bytemuck::cast_slice(v).to_vec(),
            HostGrad::BF16(v) => bytemuck::cast_slice(v).to_vec(),
            HostGrad::F64(v) => bytemuck::cast_slice(v).to_vec(),
        }
    }
    fn set(&mut self, i: usize, x: f32) {
        match self {
            HostGrad::F32(v) => v[i] = x,
            HostGrad::F16(v) => v[i] = f16::from_f32(x),
            HostGrad::BF16(v) => v[i] = bf16::from_f32(x),
            HostGrad::F64(v) => v[i] = f64::from(x),
        }
    }
    fn unscale(&mut self, inv: f32) -> bool {
        match self {
            HostGrad::F32(v) => reference::check_and_unscale(v, inv),
            HostGrad::F16(v) => reference::check_and_unscale(v, inv),
            HostGrad::BF16(v) => reference::check_and_unscale(v, inv),
            HostGrad::F64(v) => reference::check_and_unscale(v, inv),
        }
    }
    /// The first element of `got` that differs from this (bits, or NaN for NaN).
    fn first_difference(&self, got: &[u8]) -> Option<usize> {
        match self {
            HostGrad::F32(v) => first_difference(v, got),
            HostGrad::F16(v) => first_difference(v, got),
            HostGrad::BF16(v) => first_difference(v, got),
            HostGrad::F64(v) => first_difference(v, got),
        }
    }
}

/// NaN payloads differ between CPUs and GPUs (and between PyTorch's own CUDA paths); every
/// other value must match bit for bit.
fn first_difference<T: GradElement + PartialOrd>(want: &[T], got: &[u8]) -> Option<usize> {
    let got: Vec<T> = got
        .chunks_exact(size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect();
    if got.len() != want.len() {
        return Some(0);
    }
    let nan = |x: &T| x.partial_cmp(x).is_none();
    want.iter()
        .zip(&got)
        .position(|(w, g)| !(nan(w) && nan(g)) && bytemuck::bytes_of(w) != bytemuck::bytes_of(g))
}

/// A gradient list on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct HostGrads {
    pub grads: Vec<HostGrad>,
    /// Elements of padding before each gradient on the device (1 makes it unaligned).
    pub offsets: Vec<usize>,
}

impl HostGrads {
    /// `n` gradients of mixed dtypes (fp32, fp16, bf16, a few fp64) and sizes (0, 1, odd, 4 Ki, one over 1 Mi), a tenth of
    /// them unaligned; with `with_inf`, inf/NaN at random places in a few of them.
    pub fn random(rng: &mut Rng, n: usize, with_inf: bool) -> HostGrads {
        let mut grads = Vec::with_capacity(n);
        let mut offsets = Vec::with_capacity(n);
        for i in 0..n {
            let len = match i % 9 {
                0 => 0,
                1 => 1,
                2 => 4096,
                3 if i == 3 => (1 << 20) + 7,
                _ => 1 + 2 * rng.below(6000) as usize,
            };
            let g = match rng.below(7) {
                6 => HostGrad::F64(
                    (0..len)
                        .map(|_| f64::from(rng.value(-40, 40)) / 3.0)
                        .collect(),
                ),
                0 | 3 => HostGrad::F32((0..len).map(|_| rng.value(-40, 40)).collect()),
                1 | 4 => HostGrad::F16(
                    (0..len)
                        .map(|_| f16::from_f32(rng.value(-26, 15)))
                        .collect(),
                ),
                _ => HostGrad::BF16(
                    (0..len)
                        .map(|_| bf16::from_f32(rng.value(-40, 40)))
                        .collect(),
                ),
            };
            grads.push(g);
            offsets.push(usize::from(rng.below(10) == 0));
        }
        let mut out = HostGrads { grads, offsets };
        if with_inf {
            let bad = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
            for k in 0..6 {
                let i = 1 + rng.below(n as u64 - 1) as usize;
                let len = out.grads[i].len();
                if len > 0 {
                    out.grads[i].set(rng.below(len as u64) as usize, bad[k % 3]);
                }
            }
            // At least one, in the large tensor, near its end.
            let big = &mut out.grads[3];
            big.set(big.len() - 2, f32::NAN);
        }
        out
    }

    /// Copies to the device.
    pub fn upload(&self, h: &Harness) -> Result<DevGrads, ScalerError> {
        let mut bufs = Vec::new();
        let mut views = Vec::new();
        for (g, &off) in self.grads.iter().zip(&self.offsets) {
            let size = g.dtype().size();
            let mut bytes = vec![0xa5u8; off * size];
            bytes.extend(g.bytes());
            let buf = DeviceBuffer::<u8>::from_slice(&h.rt, DEV, &bytes)?;
            views.push(TensorView {
                device: DEV,
                ptr: buf.ptr().offset((off * size) as u64),
                len: g.len() as u64,
                dtype: g.dtype(),
            });
            bufs.push(buf);
        }
        Ok(DevGrads {
            bufs,
            views,
            offsets: self.offsets.clone(),
        })
    }

    /// The reference's unscale of every gradient; whether any was non-finite.
    pub fn unscale(&mut self, inv: f32) -> bool {
        self.grads
            .iter_mut()
            .fold(false, |found, g| g.unscale(inv) | found)
    }
}

/// A gradient list on the device.
pub struct DevGrads {
    bufs: Vec<DeviceBuffer<u8>>,
    pub views: Vec<TensorView>,
    offsets: Vec<usize>,
}

impl DevGrads {
    /// Asserts the device holds `want` (padding untouched too).
    pub fn assert_equals(
        &self,
        want: &HostGrads,
        what: &str,
    ) -> Result<(), Box<dyn std::error::Error>> {
        for (i, (buf, g)) in self.bufs.iter().zip(&want.grads).enumerate() {
            let bytes = buf.to_host()?;
            let pad = self.offsets[i] * g.dtype().size();
            assert!(
                bytes[..pad].iter().all(|&b| b == 0xa5),
                "{what}: padding of {i} written"
            );
            if let Some(at) = g.first_difference(&bytes[pad..]) {
                panic!(
                    "{what}: tensor {i} ({:?}, {} elements) differs at {at}",
                    g.dtype(),
                    g.len()
                );
            }
        }
        Ok(())
    }

    /// Asserts the device still holds exactly `was`, bit for bit (NaN payloads included).
    pub fn assert_bits_unchanged(&self, was: &HostGrads) -> Result<(), Box<dyn std::error::Error>> {
        for (i, (buf, g)) in self.bufs.iter().zip(&was.grads).enumerate() {
            let pad = self.offsets[i] * g.dtype().size();
            assert_eq!(
                &buf.to_host()?[pad..],
                &g.bytes()[..],
                "tensor {i} was written"
            );
        }
        Ok(())
    }
}
