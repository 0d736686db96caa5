//! Streams and events against PyTorch's `torch.cuda` (written by an independent audit, on
//! the fake device): error texts of c10/cuda/CUDAEvent.h, pools of c10/cuda/CUDAStream.cpp.
use ferrocuda_driver::{FakeDriver, fake::Completion};
use ferrocuda_stream::{KernelCache, Runtime, STREAMS_PER_POOL};
use ferrocuda_types::{DeviceIndex, EventFlags};
use std::sync::Arc;

const D0: DeviceIndex = DeviceIndex(0);
const D1: DeviceIndex = DeviceIndex(1);

fn fake(devices: usize, completion: Completion) -> (Arc<FakeDriver>, Arc<Runtime>) {
    let fake = Arc::new(
        FakeDriver::builder()
            .devices(devices)
            .completion(completion)
            .build(),
    );
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    (fake, rt)
}
fn timing() -> EventFlags {
    EventFlags {
        timing: true,
        ..Default::default()
    }
}

// c10/cuda/CUDAEvent.h query(): !is_created_ -> true
#[test]
fn a01_unrecorded_event_query_true_sync_ok_wait_noop() {
    let (_f, rt) = fake(1, Completion::Manual);
    let e = rt.new_event(EventFlags::default()).unwrap();
    assert!(e.query().unwrap());
    e.synchronize().unwrap();
    let s = rt.stream_from_pool(D0, false).unwrap();
    e.wait(&s).unwrap();
    assert_eq!(e.device(), None);
}

// CUDAEvent.h elapsed_time: TORCH_CHECK_VALUE timing first, exact text.
#[test]
fn a02_elapsed_time_timing_disabled_text() {
    let (_f, rt) = fake(1, Completion::Eager);
    let a = rt.new_event(EventFlags::default()).unwrap();
    let b = rt.new_event(EventFlags::default()).unwrap();
    let err = a.elapsed_time(&b).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Both events must be created with argument 'enable_timing=True'."
    );
}

// Order: timing check precedes recorded check (unrecorded + no timing -> timing message).
#[test]
fn a03_elapsed_time_check_order() {
    let (_f, rt) = fake(1, Completion::Eager);
    let a = rt.new_event(timing()).unwrap();
    let b = rt.new_event(EventFlags::default()).unwrap();
    let err = a.elapsed_time(&b).unwrap_err();
    assert!(
        matches!(err, ferrocuda_stream::StreamError::TimingDisabled),
        "{err:?}"
    );
}

#[test]
fn a04_elapsed_time_unrecorded_text() {
    let (_f, rt) = fake(1, Completion::Eager);
    let a = rt.new_event(timing()).unwrap();
    let b = rt.new_event(timing()).unwrap();
    let err = a.elapsed_time(&b).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Both events must be recorded before calculating elapsed time."
    );
}

// CUDAEvent.h: TORCH_CHECK(query() && other.query(), "Both events must be completed before calculating elapsed time.")
#[test]
fn a05_elapsed_time_pending_text() {
    let (_f, rt) = fake(1, Completion::Manual);
    let s = rt.stream_from_pool(D0, false).unwrap();
    let a = rt.new_event(timing()).unwrap();
    let b = rt.new_event(timing()).unwrap();
    a.record(&s).unwrap();
    b.record(&s).unwrap();
    assert!(!b.query().unwrap());
    let err = a.elapsed_time(&b).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Both events must be completed before calculating elapsed time."
    );
}

// elapsed_time in ms, non-negative, after completion.
#[test]
fn a06_elapsed_time_ok() {
    let (f, rt) = fake(1, Completion::Manual);
    let s = rt.stream_from_pool(D0, false).unwrap();
    let a = rt.new_event(timing()).unwrap();
    let b = rt.new_event(timing()).unwrap();
    a.record(&s).unwrap();
    b.record(&s).unwrap();
    f.advance(s.handle(), None).unwrap();
    assert!(a.query().unwrap() && b.query().unwrap());
    let ms = a.elapsed_time(&b).unwrap();
    assert!((0.0..1000.0).contains(&ms), "{ms}");
}

// CUDAEvent.h record: "Event device 0 does not match recording stream's device 1."
#[test]
fn a07_record_other_device_text() {
    let (_f, rt) = fake(2, Completion::Eager);
    let e = rt.new_event(EventFlags::default()).unwrap();
    e.record(&rt.default_stream(D0).unwrap()).unwrap();
    let err = e.record(&rt.default_stream(D1).unwrap()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Event device 0 does not match recording stream's device 1."
    );
    assert_eq!(e.device(), Some(D0));
}

// getStreamFromPool(bool): high priority = -max_stream_priorities + 1, max = min(range,4).
// Fake range (0,-5) -> range 6 -> max 4 -> high priority -3.
#[test]
fn a08_high_priority_pool_value() {
    let (_f, rt) = fake(1, Completion::Eager);
    assert_eq!(rt.priority_range(D0).unwrap(), (0, -5));
    let lo = rt.stream_from_pool(D0, false).unwrap();
    let hi = rt.stream_from_pool(D0, true).unwrap();
    assert_eq!(lo.priority(), 0);
    assert_eq!(hi.priority(), -3);
}

// Round robin of 32 per priority (get_idx: counter++ % kStreamsPerPool).
#[test]
fn a09_pool_round_robin() {
    let (_f, rt) = fake(1, Completion::Eager);
    assert_eq!(STREAMS_PER_POOL, 32);
    let v: Vec<_> = (0..33)
        .map(|_| rt.stream_from_pool(D0, false).unwrap())
        .collect();
    for i in 0..32 {
        for j in (i + 1)..32 {
            assert_ne!(v[i], v[j]);
        }
    }
    assert_eq!(v[0], v[32]);
    let h = rt.stream_from_pool(D0, true).unwrap();
    assert!(v.iter().all(|s| *s != h));
    assert_ne!(v[0], rt.default_stream(D0).unwrap());
    // independent counters per device
    let (_f2, rt2) = fake(2, Completion::Eager);
    let a = rt2.stream_from_pool(D0, false).unwrap();
    let b = rt2.stream_from_pool(D1, false).unwrap();
    assert_ne!(a, b);
    assert_eq!(b.device(), D1);
}

// Stream.__eq__: same (device, id); clones equal; default stream equal to itself.
#[test]
fn a10_stream_eq_and_defaults() {
    let (_f, rt) = fake(2, Completion::Eager);
    let d0 = rt.default_stream(D0).unwrap();
    assert_eq!(d0, rt.default_stream(D0).unwrap());
    assert_ne!(d0, rt.default_stream(D1).unwrap());
    assert!(d0.is_default());
    assert_eq!(d0.priority(), 0);
    assert_eq!(rt.current_stream(D0).unwrap(), d0);
}

// set_stream sets device too (THCPModule_setStream_wrap); stream context restores both.
#[test]
fn a11_set_stream_and_context() {
    let (_f, rt) = fake(2, Completion::Eager);
    let s1 = rt.stream_from_pool(D1, false).unwrap();
    assert_eq!(rt.current_device(), D0);
    {
        let _g = rt.stream_guard(&s1).unwrap();
        assert_eq!(rt.current_device(), D1);
        assert_eq!(rt.current_stream(D1).unwrap(), s1);
        assert_eq!(
            rt.current_stream(D0).unwrap(),
            rt.default_stream(D0).unwrap()
        );
    }
    assert_eq!(rt.current_device(), D0);
    assert_eq!(
        rt.current_stream(D1).unwrap(),
        rt.default_stream(D1).unwrap()
    );
    rt.set_stream(&s1).unwrap();
    assert_eq!(rt.current_device(), D1);
    assert_eq!(rt.current_stream(D1).unwrap(), s1);
}

// Nested stream contexts on the same device restore in order.
#[test]
fn a12_nested_stream_guards() {
    let (_f, rt) = fake(1, Completion::Eager);
    let a = rt.stream_from_pool(D0, false).unwrap();
    let b = rt.stream_from_pool(D0, false).unwrap();
    {
        let _ga = rt.stream_guard(&a).unwrap();
        {
            let _gb = rt.stream_guard(&b).unwrap();
            assert_eq!(rt.current_stream(D0).unwrap(), b);
        }
        assert_eq!(rt.current_stream(D0).unwrap(), a);
    }
    assert_eq!(
        rt.current_stream(D0).unwrap(),
        rt.default_stream(D0).unwrap()
    );
}

#[test]
fn a15_device_guard_restores() {
    let (_f, rt) = fake(2, Completion::Eager);
    {
        let g = rt.device_guard(D1).unwrap();
        assert_eq!(g.previous(), D0);
        assert_eq!(rt.current_device(), D1);
    }
    assert_eq!(rt.current_device(), D0);
    assert!(rt.device_guard(DeviceIndex(9)).is_err());
    assert_eq!(rt.current_device(), D0);
    assert_eq!(rt.device_count(), 2);
}

// query/synchronize on streams with pending work (Manual).
#[test]
fn a16_stream_query_sync() {
    let (_f, rt) = fake(1, Completion::Manual);
    let s = rt.stream_from_pool(D0, false).unwrap();
    assert!(s.query().unwrap());
    let e = s.record_event(None).unwrap();
    assert!(!s.query().unwrap());
    assert!(!e.query().unwrap());
    assert_eq!(e.flags(), EventFlags::default());
    s.synchronize().unwrap();
    assert!(s.query().unwrap());
    assert!(e.query().unwrap());
}

// wait_stream: later work on s waits for work on o.
#[test]
fn a17_wait_stream_orders() {
    let (f, rt) = fake(1, Completion::Manual);
    let o = rt.stream_from_pool(D0, false).unwrap();
    let s = rt.stream_from_pool(D0, false).unwrap();
    let pending = o.record_event(None).unwrap();
    s.wait_stream(&o).unwrap();
    let after = s.record_event(None).unwrap();
    f.advance(s.handle(), None).unwrap();
    assert!(!after.query().unwrap(), "s must still wait for o");
    f.advance(o.handle(), None).unwrap();
    f.advance_all();
    assert!(pending.query().unwrap());
    assert!(after.query().unwrap());
}

// synchronize(invalid) -> with torch.cuda.device(5) -> invalid device ordinal
#[test]
fn a19_synchronize_invalid_and_current_stream_invalid() {
    let (_f, rt) = fake(2, Completion::Eager);
    assert!(rt.synchronize(DeviceIndex(7)).is_err());
    assert!(rt.current_stream(DeviceIndex(7)).is_err());
    assert!(rt.default_stream(DeviceIndex(7)).is_err());
    assert!(rt.stream_from_pool(DeviceIndex(7), false).is_err());
    rt.synchronize(D1).unwrap();
}

// Event re-record moves the marker; query reflects the latest record.
#[test]
fn a20_rerecord() {
    let (f, rt) = fake(1, Completion::Manual);
    let s = rt.stream_from_pool(D0, false).unwrap();
    let e = rt.new_event(EventFlags::default()).unwrap();
    e.record(&s).unwrap();
    f.advance(s.handle(), None).unwrap();
    assert!(e.query().unwrap());
    e.record(&s).unwrap();
    assert!(!e.query().unwrap());
    e.synchronize().unwrap();
    assert!(e.query().unwrap());
}

// elapsed_time across devices: PyTorch has no own check; lib returns DeviceMismatch (informational)
#[test]
fn a21_elapsed_cross_device_info() {
    let (_f, rt) = fake(2, Completion::Eager);
    let a = rt.new_event(timing()).unwrap();
    let b = rt.new_event(timing()).unwrap();
    a.record(&rt.default_stream(D0).unwrap()).unwrap();
    b.record(&rt.default_stream(D1).unwrap()).unwrap();
    let err = a.elapsed_time(&b).unwrap_err();
    eprintln!("a21 cross-device elapsed: {err}");
}

// Event wait on a stream of another device works in PyTorch (cudaStreamWaitEvent cross-device allowed).
#[test]
fn a22_wait_cross_device() {
    let (_f, rt) = fake(2, Completion::Eager);
    let e = rt.new_event(EventFlags::default()).unwrap();
    e.record(&rt.default_stream(D0).unwrap()).unwrap();
    let s1 = rt.stream_from_pool(D1, false).unwrap();
    s1.wait_event(&e).unwrap();
    s1.wait_stream(&rt.default_stream(D0).unwrap()).unwrap();
}
