//! A two-layer MLP training step, captured whole and in part.
use crate::{BoxError, D0, Setup, TestResult};
use ferrocuda_graph::CaptureMode;
use ferrocuda_stream::{DeviceBuffer, Function, Module, Stream};
use ferrocuda_testkit::Harness;
use ferrocuda_types::{KernelArg, LaunchConfig};

/// A two-layer MLP step: `h = relu(W1 x + b1)`, `y = W2 h + b2`, then `b2 -= lr * y`.
const MLP_KERNELS: &str = r#"
extern "C" __global__ void linear_f32(float* y, const float* w, const float* x, const float* b,
                                      unsigned int n_in, unsigned int n_out, unsigned int relu) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_out) return;
    float acc = b[i];
    for (unsigned int j = 0; j < n_in; ++j) acc += w[i * n_in + j] * x[j];
    y[i] = (relu && acc < 0.0f) ? 0.0f : acc;
}
extern "C" __global__ void sgd_f32(float* p, const float* g, float lr, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] -= lr * g[i];
}
"#;

const MLP: (usize, usize, usize) = (16, 32, 8);

pub(crate) fn register_fake_mlp(h: &Harness) {
    let Some(fake) = &h.fake else { return };
    fake.register_kernel("linear_f32", |k| {
        let (y, w, x, b) = (k.arg(0)?, k.arg(1)?, k.arg(2)?, k.arg(3)?);
        let (n_in, n_out, relu) = (
            k.arg::<u32>(4)? as usize,
            k.arg::<u32>(5)? as usize,
            k.arg::<u32>(6)? != 0,
        );
        let (w, x, b) = (
            k.read::<f32>(w, n_in * n_out)?,
            k.read::<f32>(x, n_in)?,
            k.read::<f32>(b, n_out)?,
        );
        let out: Vec<f32> = (0..n_out)
            .map(|i| {
                let acc = (0..n_in).fold(b[i], |acc, j| acc + w[i * n_in + j] * x[j]);
                if relu && acc < 0.0 { 0.0 } else { acc }
            })
            .collect();
        k.write(y, &out)
    });
    fake.register_kernel("sgd_f32", |k| {
        let (p, g, lr, n) = (
            k.arg(0)?,
            k.arg(1)?,
            k.arg::<f32>(2)?,
            k.arg::<u32>(3)? as usize,
        );
        let (pv, gv) = (k.read::<f32>(p, n)?, k.read::<f32>(g, n)?);
        let out: Vec<f32> = pv.iter().zip(&gv).map(|(p, g)| p - lr * g).collect();
        k.write(p, &out)
    });
}

/// The MLP's parameters and its input, deterministic.
struct Mlp {
    w1: DeviceBuffer<f32>,
    b1: DeviceBuffer<f32>,
    w2: DeviceBuffer<f32>,
    b2: DeviceBuffer<f32>,
    x: DeviceBuffer<f32>,
    linear: Function,
    sgd: Function,
}

impl Mlp {
    fn new(s: &Setup) -> Result<Mlp, BoxError> {
        register_fake_mlp(s.h);
        let module = Module::from_cuda_source(&s.h.rt, D0, "graph_mlp", MLP_KERNELS)?;
        let (i, h, o) = MLP;
        let values = |n: usize, scale: f32| -> Vec<f32> {
            (0..n)
                .map(|k| ((k * 37 % 19) as f32 - 9.0) * scale)
                .collect()
        };
        let rt = &s.h.rt;
        let mlp = Mlp {
            w1: DeviceBuffer::from_slice(rt, D0, &values(h * i, 0.05))?,
            b1: DeviceBuffer::from_slice(rt, D0, &values(h, 0.1))?,
            w2: DeviceBuffer::from_slice(rt, D0, &values(o * h, 0.03))?,
            b2: DeviceBuffer::from_slice(rt, D0, &values(o, 0.2))?,
            x: DeviceBuffer::from_slice(rt, D0, &values(i, 1.0))?,
            linear: module.function("linear_f32")?,
            sgd: module.function("sgd_f32")?,
        };
        // The uploads ran on the current stream; the steps run on another.
        rt.current_stream(D0)?.synchronize()?;
        Ok(mlp)
    }

    /// The forward pass on `stream`, into buffers allocated here (from the graph's pool
    /// when capturing).
    fn forward(&self, s: &Setup, stream: &Stream) -> Result<DeviceBuffer<f32>, BoxError> {
        let (i, h, o) = MLP;
        let hidden = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, h)?;
        let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, o)?;
        for (out, w, x, b, n_in, n_out, relu) in [
            (&hidden, &self.w1, &self.x, &self.b1, i, h, 1u32),
            (&y, &self.w2, &hidden, &self.b2, h, o, 0),
        ] {
            let (n_in, n_out) = (n_in as u32, n_out as u32);
            let args = [
                out.arg(),
                w.arg(),
                x.arg(),
                b.arg(),
                KernelArg::value(&n_in),
                KernelArg::value(&n_out),
                KernelArg::value(&relu),
            ];
            stream.launch(
                &self.linear,
                &LaunchConfig::for_elements(n_out as usize, 32),
                &args,
            )?;
        }
        Ok(y)
    }

    /// `b2 -= 0.1 * y` on `stream`.
    fn update(&self, stream: &Stream, y: &DeviceBuffer<f32>) -> TestResult {
        let (lr, n) = (0.1f32, MLP.2 as u32);
        let args = [
            self.b2.arg(),
            y.arg(),
            KernelArg::value(&lr),
            KernelArg::value(&n),
        ];
        Ok(stream.launch(
            &self.sgd,
            &LaunchConfig::for_elements(n as usize, 32),
            &args,
        )?)
    }

    fn state(&self, stream: &Stream) -> Result<Vec<f32>, BoxError> {
        stream.synchronize()?;
        Ok(self.b2.to_host()?)
    }
}

/// Whole-step capture of an MLP training step, and partial capture (forward only, update
/// eager): replays give bit for bit what eager steps give.
pub(crate) fn mlp_step_whole_and_partial_capture(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let stream = s.h.rt.new_stream(D0, 0)?;
    let eager = Mlp::new(&s)?;
    let mut expected = Vec::new();
    for _ in 0..3 {
        let y = eager.forward(&s, &stream)?;
        eager.update(&stream, &y)?;
        expected.push(eager.state(&stream)?);
    }
    assert!(
        expected[0] != expected[1],
        "the step changes the parameters"
    );

    let whole = Mlp::new(&s)?;
    let g = s.graph()?;
    let capture = g.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    let y = whole.forward(&s, &stream)?;
    whole.update(&stream, &y)?;
    capture.end()?;
    for (step, want) in expected.iter().enumerate() {
        g.replay(&stream)?;
        let got = whole.state(&stream)?;
        assert!(
            got == *want,
            "whole-step replay {step} equals the eager step: {got:?} vs {want:?}"
        );
    }

    let partial = Mlp::new(&s)?;
    let forward = s.graph()?;
    let capture = forward.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    let y = partial.forward(&s, &stream)?;
    capture.end()?;
    for (step, want) in expected.iter().enumerate() {
        forward.replay(&stream)?;
        partial.update(&stream, &y)?;
        assert!(
            partial.state(&stream)? == *want,
            "partial capture step {step} equals the eager step"
        );
    }
    Ok(())
}
