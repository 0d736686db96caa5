//! A tour of ferrocuda's foundation: devices, streams, events, a kernel compiled at run
//! time, and a device buffer. Runs on the GPU when one is present (and
//! `FERROCUDA_BACKEND=fake` does not ask for the fake device) and on the fake device
//! otherwise, and says which. The allocator takes its configuration from the environment
//! (`FERROCUDA_ALLOC_CONF`, else `PYTORCH_CUDA_ALLOC_CONF`) on both.
//!
//! `cargo run --release --example tour`
use ferrocuda::alloc::{DeviceAllocators, caching_from_env};
use ferrocuda::driver::FakeDriver;
use ferrocuda::stream::{DeviceBuffer, Module, Runtime};
use ferrocuda::types::{AllocatorConfig, DeviceIndex, EventFlags, KernelArg, LaunchConfig};
use std::process::ExitCode;
use std::sync::Arc;

const SAXPY: &str = r#"
extern "C" __global__ void saxpy(float* y, const float* x, float a, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

/// The allocator configuration from the environment, as the global runtime reads it, and
/// which variable gave it; a malformed one is an error with the parser's message.
fn env_config() -> Result<(AllocatorConfig, String), String> {
    let config = AllocatorConfig::from_env().map_err(|e| e.to_string())?;
    let source = match AllocatorConfig::source(|k| std::env::var(k)).map_err(|e| e.to_string())? {
        Some((name, value)) => format!("{name}={value}"),
        None => {
            "default (FERROCUDA_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF unset)"
                .into()
        }
    };
    Ok((config, source))
}

/// The fake device runs kernels as host functions registered under the kernel's name.
fn fake_runtime(config: AllocatorConfig) -> Result<Arc<Runtime>, String> {
    let fake = FakeDriver::default();
    fake.register_kernel("saxpy", |k| {
        let (y, x, a, n) = (
            k.arg(0)?,
            k.arg(1)?,
            k.arg::<f32>(2)?,
            k.arg::<u32>(3)? as usize,
        );
        let (xs, ys) = (k.read::<f32>(x, n)?, k.read::<f32>(y, n)?);
        let out: Vec<f32> = xs.iter().zip(&ys).map(|(x, y)| a * x + y).collect();
        k.write(y, &out)
    });
    let fake = Arc::new(fake);
    let rt = Runtime::new(fake.clone());
    let caching = caching_from_env(|k| std::env::var(k)).map_err(|e| e.to_string())?;
    DeviceAllocators::new(fake, config, caching).install(&rt);
    Ok(rt)
}

fn main() -> ExitCode {
    match tour() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tour: {e}");
            ExitCode::FAILURE
        }
    }
}

fn tour() -> Result<(), Box<dyn std::error::Error>> {
    let (config, source) = env_config()?;
    println!("allocator configuration: {source}");
    let gpu = ferrocuda::try_runtime()?;
    let rt = if gpu.is_available() && gpu.driver().backend() == "cuda" {
        gpu.clone()
    } else {
        let why = if gpu.driver().backend() == "fake" {
            "FERROCUDA_BACKEND=fake".to_owned()
        } else {
            let e = gpu.driver().device_count().err();
            format!(
                "no usable GPU: {}",
                e.map_or("no device".into(), |e| e.to_string())
            )
        };
        println!("{why}: running on the fake device");
        fake_runtime(config)?
    };
    let dev = DeviceIndex(0);
    let props = rt.device_properties(dev)?;
    println!(
        "backend: {} | {} devices | cuda:0 = {} (sm_{}{}, {} SMs, {:.1} GiB)",
        rt.driver().backend(),
        rt.device_count(),
        props.name,
        props.major,
        props.minor,
        props.multi_processor_count,
        props.total_memory as f64 / (1u64 << 30) as f64
    );

    let module = Module::from_cuda_source(&rt, dev, "tour_saxpy", SAXPY)?;
    println!(
        "kernel: saxpy ({:?} in the kernel cache)",
        module.cache_outcome()
    );
    let saxpy = module.function("saxpy")?;

    let n = 1 << 20;
    let xs: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let x = DeviceBuffer::from_slice(&rt, dev, &xs)?;
    let y = DeviceBuffer::filled(&rt, dev, n, 1.0f32)?;

    // Work on a side stream, ordered after the current stream's uploads, timed with events.
    let side = rt.stream_from_pool(dev, false)?;
    side.wait_stream(&rt.current_stream(dev)?)?;
    let timing = EventFlags {
        timing: true,
        ..EventFlags::default()
    };
    let (start, end) = (rt.new_event(timing)?, rt.new_event(timing)?);
    {
        let _on_side = rt.stream_guard(&side)?;
        let s = rt.current_stream(dev)?;
        start.record(&s)?;
        let (a, len) = (2.0f32, n as u32);
        let args = [
            y.arg(),
            x.arg(),
            KernelArg::value(&a),
            KernelArg::value(&len),
        ];
        s.launch(&saxpy, &LaunchConfig::for_elements(n, 256), &args)?;
        end.record(&s)?;
    }
    rt.current_stream(dev)?.wait_stream(&side)?;
    let out = y.to_host()?;
    let wrong = out
        .iter()
        .enumerate()
        .filter(|(i, v)| **v != 2.0 * *i as f32 + 1.0)
        .count();
    println!(
        "saxpy over {n} floats: {} wrong, {:.3} ms between events",
        wrong,
        start.elapsed_time(&end)?
    );
    let (free, total) = rt.mem_get_info(dev)?;
    println!(
        "memory: {:.1} GiB free of {:.1} GiB",
        free as f64 / (1u64 << 30) as f64,
        total as f64 / (1u64 << 30) as f64
    );
    if wrong > 0 {
        return Err(format!("{wrong} wrong results").into());
    }
    let place = if rt.driver().backend() == "cuda" {
        "the GPU"
    } else {
        "the fake device"
    };
    println!("tour done on {place}");
    Ok(())
}
