//! Adversarial scenarios for copies to pageable memory staged by threads
//! (`DeviceBuffer::to_host`), each against the driver's copy (0 threads) and under a time
//! limit: [`bytes_and_order`], [`captures`], [`failures_and_slots`]; the helpers they share,
//! here. A read is staged only from `STAGED_READ_MIN` bytes with `READ_MIN_THREADS` threads
//! or more: 1 thread, where a scenario compares it, must do what the driver does.
use super::support::*;
use ferrocuda_types::{DevicePtr, Element, EventFlags};

/// `values` into device memory at `ptr` by the driver's own copy, enqueued on `s` (still
/// pending under manual completion): what a read after it on `s` must return.
fn seed(fake: &FakeDriver, ptr: DevicePtr, values: &[u8], s: &Stream) -> R {
    fake.memcpy_htod_async(ptr, values, s.handle())?;
    Ok(())
}

/// `buf` read with `to_host` on `s` (made current for the read), as bytes.
fn read_on<T: Element>(
    rt: &Arc<Runtime>,
    buf: &DeviceBuffer<T>,
    s: &Stream,
) -> Result<Vec<u8>, StreamError> {
    let _g = rt.stream_guard(s)?;
    buf.to_host()
        .map(|v| bytemuck::cast_slice::<T, u8>(&v).to_vec())
}

/// Where two byte strings first differ, for messages (`None`: equal). Compares with `==`
/// first, which is fast in a debug build.
fn diff(a: &[u8], b: &[u8]) -> Option<usize> {
    if a == b { None } else { first_diff(a, b) }
}

/// Ends the capture on `s` and destroys its graph.
fn end_capture(fake: &FakeDriver, s: ferrocuda_types::StreamHandle) -> Result<(), DriverError> {
    fake.stream_end_capture(s).map(|g| {
        let _ = fake.graph_destroy(g);
    })
}

/// Makes calls of kind `call` (on a spare stream and event) until `calls(call)` reaches
/// `until`: a failure injected for a call the scenario did not reach then hits nothing else.
fn spend(fake: &FakeDriver, call: Call, until: u64) -> R {
    if fake.calls(call) >= until {
        return Ok(());
    }
    let spare = fake.stream_create(D0, StreamFlags::default())?;
    let ev = fake.event_create(D0, EventFlags::default())?;
    while fake.calls(call) < until {
        let before = fake.calls(call);
        let _ = match call {
            Call::StreamSynchronize => fake.stream_synchronize(spare),
            Call::EventQuery => fake.event_query(ev).map(drop),
            Call::EventRecord => fake.event_record(ev, spare),
            Call::EventSynchronize => fake.event_synchronize(ev),
            Call::MemcpyDtoHPinned | Call::HostRead | Call::HostAlloc | Call::EventCreate => {
                return Err(format!("spend: {call:?} not supported").into());
            }
            _ => Ok(()),
        };
        if fake.calls(call) == before {
            return Err(format!("spend: {call:?} not counted").into());
        }
    }
    fake.event_destroy(ev)?;
    fake.stream_destroy(spare)?;
    Ok(())
}

/// Slots kept now: made minus freed.
fn kept(fake: &FakeDriver) -> u64 {
    fake.calls(Call::HostAlloc) - fake.calls(Call::HostFree)
}

// ---- bytes and order -----------------------------------------------------------------------

fn typed_reads<T: Element>(
    rt: &Arc<Runtime>,
    fake: &FakeDriver,
    s: &Stream,
    source: &[u8],
    sizes: &[usize],
    threads: usize,
) -> R {
    let width = size_of::<T>();
    for &bytes in sizes {
        let n = bytes.div_ceil(width);
        let want = &source[..n * width];
        let buf = DeviceBuffer::<T>::uninit(rt, D0, n)?;
        seed(fake, buf.ptr(), want, s)?;
        let got = read_on(rt, &buf, s)?;
        assert_eq!(
            diff(&got, want),
            None,
            "{threads} threads, {} × {n} ({} bytes): first wrong byte",
            std::any::type_name::<T>(),
            n * width
        );
    }
    Ok(())
}

mod bytes_and_order;
mod captures;
mod failures_and_slots;
