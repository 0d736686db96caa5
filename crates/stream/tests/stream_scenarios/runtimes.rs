//! Two runtimes in one process, on the fake device: a stream, event, kernel or buffer of one
//! is refused by the other with [`StreamError::OtherRuntime`], never used as the object of
//! the same number that the other runtime has. And kernels on the fake device: registered
//! through the runtime, and a missing one named in its error.
use ferrocuda_driver::{CudaDriver, FakeDriver};
use ferrocuda_stream::{DeviceBuffer, Module, PinnedBuffer, Runtime, Stream, StreamError};
use ferrocuda_types::{DeviceIndex, EventFlags, KernelArg, LaunchConfig};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);

const ADD_ONE: &str = r#"
extern "C" __global__ void add_one(float* x, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
"#;

/// A runtime over a fresh fake device, with `add_one` registered.
fn runtime() -> Arc<Runtime> {
    let rt = Runtime::new(Arc::new(FakeDriver::default()));
    rt.register_fake_kernel("add_one", |k| {
        let (x, n) = (k.arg(0)?, k.arg::<u32>(1)? as usize);
        let v: Vec<f32> = k.read::<f32>(x, n)?.iter().map(|v| v + 1.0).collect();
        k.write(x, &v)
    });
    rt
}

/// Whether `r` is the refusal of an object of runtime `b` used with runtime `a`.
fn refused<T: std::fmt::Debug>(r: Result<T, StreamError>, a: &Runtime, b: &Runtime) -> bool {
    matches!(
        r,
        Err(StreamError::OtherRuntime { expected, found, .. })
            if expected == a.id() && found == b.id()
    )
}

/// The case the check exists for: both runtimes have a stream with the same number, so
/// the other runtime's stream would silently become this one's.
fn same_numbered_streams() -> Result<(Arc<Runtime>, Arc<Runtime>, Stream, Stream), StreamError> {
    let (a, b) = (runtime(), runtime());
    let (sa, sb) = (a.new_stream(D0, 0)?, b.new_stream(D0, 0)?);
    assert_eq!(sa.handle(), sb.handle(), "the fakes number streams alike");
    assert_ne!(a.id(), b.id());
    Ok((a, b, sa, sb))
}

#[test]
fn stream_guard_and_set_stream_refuse_another_runtimes_stream() -> TestResult {
    let (a, b, _sa, sb) = same_numbered_streams()?;
    let before = a.current_stream(D0)?;
    assert!(refused(a.stream_guard(&sb).map(drop), &a, &b));
    assert!(refused(a.set_stream(&sb), &a, &b));
    assert_eq!(a.current_stream(D0)?, before, "nothing changed");
    let text = a.set_stream(&sb).err().map(|e| e.to_string());
    assert_eq!(
        text.as_deref(),
        Some(&*format!(
            "the stream belongs to another runtime (runtime {}) than the one it is used \
                 with (runtime {})",
            b.id(),
            a.id()
        ))
    );
    // Its own streams are fine, pool and default ones included.
    drop(a.stream_guard(&a.stream_from_pool(D0, false)?)?);
    a.set_stream(&a.default_stream(D0)?)?;
    Ok(())
}

#[test]
fn two_runtimes_over_one_driver_are_still_two() -> TestResult {
    let fake = Arc::new(FakeDriver::default());
    let (a, b) = (Runtime::new(fake.clone()), Runtime::new(fake));
    let sb = b.new_stream(D0, 0)?;
    assert!(refused(a.stream_guard(&sb).map(drop), &a, &b));
    assert!(refused(a.check_stream(&sb), &a, &b));
    a.check_stream(&a.current_stream(D0)?)?;
    Ok(())
}

#[test]
fn record_stream_refuses_another_runtimes_stream() -> TestResult {
    let (a, b, _sa, sb) = same_numbered_streams()?;
    let buf = DeviceBuffer::<f32>::filled(&a, D0, 16, 0.0)?;
    assert!(refused(buf.record_stream(&sb), &a, &b));
    let empty = DeviceBuffer::<f32>::uninit(&a, D0, 0)?;
    assert!(refused(empty.record_stream(&sb), &a, &b), "empty too");
    assert!(refused(buf.lend(&sb).map(drop), &a, &b));
    buf.record_stream(&a.new_stream(D0, 0)?)?;
    Ok(())
}

#[test]
fn waits_refuse_another_runtimes_stream_or_event() -> TestResult {
    let (a, b, sa, sb) = same_numbered_streams()?;
    let eb = b.new_event(EventFlags::default())?;
    eb.record(&sb)?;
    let ea = a.new_event(EventFlags::default())?;
    ea.record(&sa)?;
    // A stream waits for an event (the event is what is refused: the stream's runtime is
    // the one it is used with).
    assert!(refused(sa.wait_event(&eb), &a, &b));
    assert!(refused(eb.wait(&sa), &a, &b));
    // An event waited for on a stream, recorded or not.
    let unrecorded = b.new_event(EventFlags::default())?;
    assert!(refused(unrecorded.wait(&sa), &a, &b));
    // A stream waits for a stream.
    assert!(refused(sa.wait_stream(&sb), &a, &b));
    // Recording.
    assert!(refused(ea.record(&sb), &b, &a));
    assert!(refused(sb.record_event(Some(&ea)).map(drop), &b, &a));
    assert!(a.check_event(&eb).is_err() && a.check_event(&ea).is_ok());
    // Timing across runtimes.
    let timing = EventFlags {
        timing: true,
        ..EventFlags::default()
    };
    let (ta, tb) = (a.new_event(timing)?, b.new_event(timing)?);
    ta.record(&sa)?;
    tb.record(&sb)?;
    assert!(refused(ta.elapsed_time(&tb), &a, &b));
    // The same calls within one runtime work.
    sa.wait_event(&ea)?;
    sa.wait_stream(&a.current_stream(D0)?)?;
    let _ = sa.record_event(None)?;
    Ok(())
}

#[test]
fn launches_refuse_another_runtimes_kernel() -> TestResult {
    let (a, b, sa, sb) = same_numbered_streams()?;
    let fa = Module::from_cuda_source(&a, D0, "add_one", ADD_ONE)?.function("add_one")?;
    let buf = DeviceBuffer::<f32>::filled(&b, D0, 4, 1.0)?;
    let n = 4u32;
    let args = [buf.arg(), KernelArg::value(&n)];
    let config = LaunchConfig::for_elements(4, 32);
    assert!(refused(sb.launch(&fa, &config, &args), &b, &a));
    let fb = Module::from_cuda_source(&b, D0, "add_one", ADD_ONE)?.function("add_one")?;
    sb.launch(&fb, &config, &args)?;
    assert_eq!(buf.to_host()?, vec![2.0; 4]);
    drop(sa);
    Ok(())
}

#[test]
fn copies_refuse_another_runtimes_buffer() -> TestResult {
    let (a, b) = (runtime(), runtime());
    let (xa, xb) = (
        DeviceBuffer::<f32>::filled(&a, D0, 4, 1.0)?,
        DeviceBuffer::<f32>::filled(&b, D0, 4, 2.0)?,
    );
    assert!(refused(xa.copy_from(&xb), &a, &b));
    let pinned = PinnedBuffer::<f32>::from_slice(&a, &[3.0; 4])?;
    assert!(refused(pinned.copy_to_device(&xb, false), &a, &b));
    assert!(refused(pinned.copy_from_device(&xb, true), &a, &b));
    assert!(refused(pinned.record_event(&b.current_stream(D0)?), &a, &b));
    assert_eq!(xb.to_host()?, vec![2.0; 4], "untouched");
    pinned.copy_to_device(&xa, false)?;
    assert_eq!(xa.to_host()?, vec![3.0; 4]);
    Ok(())
}

#[test]
fn a_kernel_without_a_host_function_names_itself() -> TestResult {
    let rt = Runtime::new(Arc::new(FakeDriver::default()));
    let m = Module::from_cuda_source(&rt, D0, "add_one", ADD_ONE)?;
    let err = m.function("add_one").err();
    assert_eq!(
        err,
        Some(StreamError::KernelNotRegistered {
            name: "add_one".into()
        })
    );
    let text = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(text.contains("`add_one`"), "{text}");
    // Registered through the runtime, the same module finds it.
    assert!(rt.register_fake_kernel("add_one", |_| Ok(())));
    assert!(rt.fake().is_some_and(|f| f.has_kernel("add_one")));
    m.function("add_one")?;
    Ok(())
}

#[test]
fn registering_a_fake_kernel_on_the_real_driver_registers_nothing() {
    let rt = Runtime::new(Arc::new(CudaDriver::new()));
    assert!(rt.fake().is_none());
    assert!(!rt.register_fake_kernel("add_one", |_| Ok(())));
}
