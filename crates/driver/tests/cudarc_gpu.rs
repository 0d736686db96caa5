//! A ferrocuda buffer as a kernel argument of cudarc's launch builder, on the real driver:
//! the kernel runs on cudarc's stream (not ferrocuda's current one) and ferrocuda reads its
//! result without synchronising, the order kept by the lending. Here rather than beside the
//! other cudarc tests (crates/stream/tests/cudarc_scenarios.rs) because cudarc's launch is
//! `unsafe`, which only this crate may use. Ignored (skipped, with the reason) without a
//! GPU; the GPU bundle runs it with `--include-ignored`, where a missing GPU fails it.
use ferrocuda_driver::CudaDriver;
use ferrocuda_driver::interop::cudarc;
use ferrocuda_stream::{DeviceBuffer, Runtime};
use ferrocuda_types::DeviceIndex;
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const ADD_ONE: &str = r#"extern "C" __global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}"#;

#[test]
#[ignore = "needs a GPU: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn gpu_cudarcs_launch_builder_takes_a_ferrocuda_buffer() -> TestResult {
    use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
    let driver = Arc::new(CudaDriver::new());
    if let Some(reason) = driver.unavailable_reason() {
        return Err(format!("no usable CUDA device ({reason}): this test needs a GPU").into());
    }
    let rt = Runtime::new(driver);
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let ptx = cudarc::nvrtc::compile_ptx(ADD_ONE)?;
    let add_one = ctx.load_module(ptx)?.load_function("add_one")?;
    let n: usize = (1 << 20) + 3;
    let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let x = DeviceBuffer::from_slice(&rt, DeviceIndex(0), &values)?;
    let count = n as i32;
    let cfg = LaunchConfig::for_num_elems(n as u32);
    {
        let mut view = x.cudarc(&stream)?;
        let mut launch = stream.launch_builder(&add_one);
        launch.arg(&mut view).arg(&count);
        // SAFETY: `add_one` takes (float*, int) and touches `count` floats, which the
        // buffer holds.
        unsafe { launch.launch(cfg) }?;
        let shared = x.cudarc(&stream)?;
        let mut again = stream.launch_builder(&add_one);
        again.arg(&shared).arg(&count);
        // SAFETY: as above (a shared borrow passes the same address).
        unsafe { again.launch(cfg) }?;
    }
    let after = x.to_host()?;
    assert!(
        after.iter().zip(&values).all(|(a, b)| *a == b + 2.0),
        "both launches ran before ferrocuda's read"
    );
    ctx.check_err()?;
    assert!(
        rt.driver()
            .stream_query(rt.current_stream(DeviceIndex(0))?.handle())?
    );
    Ok(())
}
