//! The Philox generator on a fake device nobody registered anything on, and graphs refusing
//! a stream of another runtime.
use ferrocuda_alloc::{Caching, DeviceAllocators};
use ferrocuda_driver::FakeDriver;
use ferrocuda_graph::{CaptureMode, CudaGraph, GraphError, PhiloxGenerator};
use ferrocuda_stream::{DeviceBuffer, Runtime, StreamError};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);

/// A runtime over a fake device with nothing registered on it, its allocators installed.
fn bare() -> (Arc<FakeDriver>, Arc<Runtime>, Arc<DeviceAllocators>) {
    let fake = Arc::new(FakeDriver::default());
    let rt = Runtime::new(fake.clone());
    let allocators = DeviceAllocators::new(fake.clone(), AllocatorConfig::default(), Caching::On);
    allocators.install(&rt);
    (fake, rt, allocators)
}

#[test]
fn philox_draws_on_a_bare_fake_device() -> TestResult {
    let (fake, rt, _) = bare();
    let generator = PhiloxGenerator::new(&rt, D0, 42)?;
    let out = DeviceBuffer::<f32>::uninit(&rt, D0, 64)?;
    generator.uniform(&out, &rt.current_stream(D0)?)?;
    let drawn = out.to_host()?;
    assert!(drawn.iter().all(|v| (0.0..1.0).contains(v)));
    assert!(drawn.windows(2).any(|w| w[0] != w[1]), "{drawn:?}");
    assert!(fake.has_kernel("philox_uniform_f32"));
    // The same seed on another bare device draws the same numbers.
    let (_, rt2, _) = bare();
    let again = DeviceBuffer::<f32>::uninit(&rt2, D0, 64)?;
    PhiloxGenerator::new(&rt2, D0, 42)?.uniform(&again, &rt2.current_stream(D0)?)?;
    assert_eq!(again.to_host()?, drawn);
    Ok(())
}

#[test]
fn a_philox_twin_the_test_registered_is_kept() -> TestResult {
    let (fake, rt, _) = bare();
    fake.register_kernel("philox_uniform_f32", |k| {
        let (out, n) = (k.arg::<DevicePtr>(0)?, k.arg::<u32>(1)? as usize);
        k.write(out, &vec![0.25f32; n])
    });
    let out = DeviceBuffer::<f32>::uninit(&rt, D0, 4)?;
    PhiloxGenerator::new(&rt, D0, 7)?.uniform(&out, &rt.current_stream(D0)?)?;
    assert_eq!(out.to_host()?, vec![0.25; 4]);
    Ok(())
}

#[test]
fn graphs_refuse_another_runtimes_stream() -> TestResult {
    let (_, rt, allocators) = bare();
    let (_, other, _) = bare();
    let mine = rt.new_stream(D0, 0)?;
    let foreign = other.new_stream(D0, 0)?;
    assert_eq!(
        mine.handle(),
        foreign.handle(),
        "same number, other runtime"
    );
    let refused = |r: Result<(), GraphError>| {
        matches!(r, Err(GraphError::Stream(StreamError::OtherRuntime { expected, found, .. }))
            if expected == rt.id() && found == other.id())
    };
    let graph = CudaGraph::new(rt.clone(), &allocators, D0)?;
    assert!(refused(graph.capture_begin(
        &foreign,
        None,
        CaptureMode::ThreadLocal
    )));
    assert!(refused(
        graph
            .capture(Some(&foreign), None, CaptureMode::ThreadLocal)
            .map(drop)
    ));
    let generator = PhiloxGenerator::new(&rt, D0, 1)?;
    let out = DeviceBuffer::<f32>::uninit(&rt, D0, 8)?;
    assert!(refused(generator.uniform(&out, &foreign)));
    graph.register_generator(&generator)?;
    {
        let capture = graph.capture(Some(&mine), None, CaptureMode::ThreadLocal)?;
        generator.uniform(&out, capture.stream())?;
        capture.end()?;
    }
    assert!(refused(graph.replay(&foreign)));
    assert!(refused(graph.upload(&foreign)));
    graph.replay(&mine)?;
    Ok(())
}
