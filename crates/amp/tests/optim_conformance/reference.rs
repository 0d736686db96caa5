//! CPU references of PyTorch's optimizer formulas, written from `torch/optim/sgd.py`
//! (`_single_tensor_sgd`) and the fused AdamW kernel (`aten/src/ATen/native/cuda/
//! fused_adam_utils.cuh` `adam_math`, ADAMW mode) in plain f32 scalar code, per tensor, with
//! PyTorch's per-tensor state (`momentum_buffer` is `None` until the first step, one step
//! count per parameter), and a small deterministic random source.
use ferrocuda_amp::optim::{AdamWConfig, SgdConfig};

/// xorshift64*: deterministic random numbers without a dependency.
#[derive(Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    pub(crate) fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `n` values uniform in [-scale, scale).
    pub(crate) fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// An optimizer's reference: steps the host copies of the parameters, and reports its state
/// flattened as the device optimizer lays it out (`state_tensors` order, counters excluded).
pub(crate) trait Reference {
    fn step(&mut self, params: &mut [Vec<f32>], grads: &[Vec<f32>]);
    fn state(&self, lens: &[usize]) -> Vec<Vec<f32>>;
    /// Steps applied (every parameter's count is the same here).
    fn steps(&self) -> u64;
}

/// Flattens per-tensor state, `None` reading as the device's zero initialisation.
fn flat(state: &[Option<Vec<f32>>], lens: &[usize]) -> Vec<f32> {
    state
        .iter()
        .zip(lens)
        .flat_map(|(s, &n)| s.clone().unwrap_or_else(|| vec![0.0; n]))
        .collect()
}

/// `torch.optim.SGD`.
#[derive(Debug)]
pub(crate) struct RefSgd {
    pub(crate) cfg: SgdConfig,
    momentum_buffer: Vec<Option<Vec<f32>>>,
    steps: u64,
}

impl RefSgd {
    pub(crate) fn new(cfg: SgdConfig, tensors: usize) -> RefSgd {
        RefSgd {
            cfg,
            momentum_buffer: vec![None; tensors],
            steps: 0,
        }
    }
}

impl Reference for RefSgd {
    fn step(&mut self, params: &mut [Vec<f32>], grads: &[Vec<f32>]) {
        let c = self.cfg;
        self.steps += 1;
        for (i, (param, grad)) in params.iter_mut().zip(grads).enumerate() {
            // grad = grad if not maximize else -grad; grad = grad.add(param, alpha=wd)
            let mut d: Vec<f32> = grad
                .iter()
                .zip(param.iter())
                .map(|(&g, &p)| {
                    let g = if c.maximize { -g } else { g };
                    if c.weight_decay != 0.0 {
                        g + c.weight_decay * p
                    } else {
                        g
                    }
                })
                .collect();
            if c.momentum != 0.0 {
                let buf = match self.momentum_buffer[i].take() {
                    None => d.clone(),
                    // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                    Some(b) => b
                        .iter()
                        .zip(&d)
                        .map(|(&b, &g)| b * c.momentum + (1.0 - c.dampening) * g)
                        .collect(),
                };
                d = if c.nesterov {
                    d.iter()
                        .zip(&buf)
                        .map(|(&g, &b)| g + c.momentum * b)
                        .collect()
                } else {
                    buf.clone()
                };
                self.momentum_buffer[i] = Some(buf);
            }
            // param.add_(grad, alpha=-lr)
            for (p, g) in param.iter_mut().zip(&d) {
                *p += -c.lr * g;
            }
        }
    }

    fn state(&self, lens: &[usize]) -> Vec<Vec<f32>> {
        if self.cfg.momentum == 0.0 {
            return Vec::new();
        }
        vec![flat(&self.momentum_buffer, lens)]
    }

    fn steps(&self) -> u64 {
        self.steps
    }
}

/// `beta^n` in f64 by repeated squaring (the documented form of the bias corrections).
fn pow_steps(beta: f32, n: u64) -> f64 {
    let (mut base, mut n, mut r) = (f64::from(beta), n, 1.0f64);
    while n > 0 {
        if n % 2 == 1 {
            r *= base;
        }
        base *= base;
        n /= 2;
    }
    r
}

/// `torch.optim.AdamW(fused=True)`, in f32.
#[derive(Debug)]
pub(crate) struct RefAdamW {
    pub(crate) cfg: AdamWConfig,
    exp_avg: Vec<Option<Vec<f32>>>,
    exp_avg_sq: Vec<Option<Vec<f32>>>,
    max_exp_avg_sq: Vec<Option<Vec<f32>>>,
    step: Vec<u64>,
}

impl RefAdamW {
    pub(crate) fn new(cfg: AdamWConfig, tensors: usize) -> RefAdamW {
        RefAdamW {
            cfg,
            exp_avg: vec![None; tensors],
            exp_avg_sq: vec![None; tensors],
            max_exp_avg_sq: vec![None; tensors],
            step: vec![0; tensors],
        }
    }
}

impl Reference for RefAdamW {
    fn step(&mut self, params: &mut [Vec<f32>], grads: &[Vec<f32>]) {
        let c = self.cfg;
        let (beta1, beta2) = c.betas;
        for (i, (param, grad)) in params.iter_mut().zip(grads).enumerate() {
            let n = param.len();
            self.step[i] += 1;
            let step = self.step[i];
            let bias_correction1 = (1.0 - pow_steps(beta1, step)) as f32;
            let bias_correction2_sqrt = (1.0 - pow_steps(beta2, step)).sqrt() as f32;
            let step_size = c.lr / bias_correction1;
            let m = self.exp_avg[i].get_or_insert_with(|| vec![0.0; n]);
            let v = self.exp_avg_sq[i].get_or_insert_with(|| vec![0.0; n]);
            let vmax = self.max_exp_avg_sq[i].get_or_insert_with(|| vec![0.0; n]);
            for j in 0..n {
                let g = if c.maximize { -grad[j] } else { grad[j] };
                let mut p = param[j];
                if c.weight_decay != 0.0 {
                    p -= c.lr * c.weight_decay * p;
                }
                m[j] = beta1 * m[j] + (1.0 - beta1) * g;
                v[j] = beta2 * v[j] + (1.0 - beta2) * g * g;
                let second = if c.amsgrad {
                    vmax[j] = if vmax[j] < v[j] { v[j] } else { vmax[j] };
                    vmax[j]
                } else {
                    v[j]
                };
                let denom = second.sqrt() / bias_correction2_sqrt + c.eps;
                param[j] = p - step_size * m[j] / denom;
            }
        }
    }

    fn state(&self, lens: &[usize]) -> Vec<Vec<f32>> {
        let mut out = vec![flat(&self.exp_avg, lens), flat(&self.exp_avg_sq, lens)];
        if self.cfg.amsgrad {
            out.push(flat(&self.max_exp_avg_sq, lens));
        }
        out
    }

    fn steps(&self) -> u64 {
        self.step.first().copied().unwrap_or(0)
    }
}
