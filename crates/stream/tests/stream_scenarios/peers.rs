//! Several devices on the fake driver: `can_device_access_peer`, PyTorch's `get_p2p_access`
//! (cached, enabled once, "already enabled" tolerated, the memory resource told), copies
//! between devices with Copy.cu's two-way barrier on the right streams, and device guards
//! that restore across devices.
use ferrocuda_driver::{Call, Completion, Driver, FakeDriver, PeerCopies};
use ferrocuda_stream::{DeviceBuffer, MemoryResource, Result, Runtime, StreamError};
use ferrocuda_types::{DeviceIndex, DevicePtr, StreamHandle};
use parking_lot::Mutex;
use std::sync::Arc;

type TestResult = std::result::Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);
const D1: DeviceIndex = DeviceIndex(1);
const D2: DeviceIndex = DeviceIndex(2);
const D3: DeviceIndex = DeviceIndex(3);

/// Four devices; device 0 cannot reach device 3.
fn four_devices() -> Arc<FakeDriver> {
    Arc::new(
        FakeDriver::builder()
            .devices(4)
            .no_peer_access(D0, D3)
            .build(),
    )
}

/// `cuMemAlloc` memory that remembers which peer accesses it was told about.
#[derive(Debug)]
struct Recording {
    driver: Arc<FakeDriver>,
    peers: Mutex<Vec<(DeviceIndex, DeviceIndex)>>,
}

impl MemoryResource for Recording {
    fn allocate(&self, dev: DeviceIndex, bytes: u64, _: StreamHandle) -> Result<DevicePtr> {
        Ok(self.driver.malloc(dev, bytes)?)
    }
    fn free(&self, dev: DeviceIndex, ptr: DevicePtr) -> Result<()> {
        Ok(self.driver.free(dev, ptr)?)
    }
    fn record_stream(&self, _: DeviceIndex, _: DevicePtr, _: StreamHandle) -> Result<()> {
        Ok(())
    }
    fn add_peer_access(&self, dev: DeviceIndex, dev_to_access: DeviceIndex) -> Result<()> {
        self.peers.lock().push((dev, dev_to_access));
        Ok(())
    }
}

fn runtime_with_recording(fake: &Arc<FakeDriver>) -> (Arc<Runtime>, Arc<Recording>) {
    let rt = Runtime::new(fake.clone());
    let rec = Arc::new(Recording {
        driver: fake.clone(),
        peers: Mutex::new(Vec::new()),
    });
    rt.set_memory(rec.clone());
    (rt, rec)
}

#[test]
fn can_device_access_peer_checks_both_devices_and_enables_nothing() -> TestResult {
    let fake = four_devices();
    let rt = Runtime::new(fake.clone());
    assert!(rt.can_device_access_peer(D0, D1)?);
    assert!(!rt.can_device_access_peer(D0, D3)?);
    assert!(!rt.can_device_access_peer(D2, D2)?);
    assert_eq!(
        rt.can_device_access_peer(D0, DeviceIndex(4)),
        Err(StreamError::InvalidDevice { index: 4, count: 4 })
    );
    assert_eq!(
        rt.can_device_access_peer(DeviceIndex(7), D0),
        Err(StreamError::InvalidDevice { index: 7, count: 4 })
    );
    assert_eq!(fake.calls(Call::EnablePeerAccess), 0);
    Ok(())
}

#[test]
fn get_p2p_access_enables_once_per_ordered_pair_and_tells_the_memory() -> TestResult {
    let fake = four_devices();
    let (rt, rec) = runtime_with_recording(&fake);
    assert!(rt.get_p2p_access(D0, D1)?);
    assert!(rt.get_p2p_access(D0, D1)?, "cached");
    assert!(fake.peer_access_enabled(D0, D1));
    assert!(!fake.peer_access_enabled(D1, D0));
    assert_eq!(fake.calls(Call::EnablePeerAccess), 1);
    assert_eq!(fake.calls(Call::DeviceCanAccessPeer), 1);
    assert_eq!(*rec.peers.lock(), vec![(D0, D1)]);

    assert!(rt.get_p2p_access(D2, D2)?, "a device and itself");
    assert!(!rt.get_p2p_access(D0, D3)?, "a pair that cannot");
    assert!(!rt.get_p2p_access(D0, D3)?);
    assert_eq!(
        fake.calls(Call::EnablePeerAccess),
        1,
        "nothing enabled for them"
    );
    assert_eq!(fake.calls(Call::DeviceCanAccessPeer), 2);
    assert_eq!(
        rt.get_p2p_access(D0, DeviceIndex(9)),
        Err(StreamError::InvalidDevice { index: 9, count: 4 })
    );
    Ok(())
}

#[test]
fn access_already_enabled_behind_our_back_is_not_an_error() -> TestResult {
    let fake = four_devices();
    let (rt, rec) = runtime_with_recording(&fake);
    fake.enable_peer_access(D1, D2)?;
    assert!(rt.get_p2p_access(D1, D2)?);
    assert_eq!(
        *rec.peers.lock(),
        vec![(D1, D2)],
        "the memory is still told"
    );
    Ok(())
}

#[test]
fn a_failed_enable_is_returned_and_not_cached() -> TestResult {
    let fake = four_devices();
    let rt = Runtime::new(fake.clone());
    fake.fail_nth(
        Call::EnablePeerAccess,
        1,
        ferrocuda_driver::DriverError::INVALID_CONTEXT,
    );
    assert_eq!(
        rt.get_p2p_access(D0, D1),
        Err(StreamError::Driver(
            ferrocuda_driver::DriverError::INVALID_CONTEXT
        ))
    );
    assert!(rt.get_p2p_access(D0, D1)?, "tried again");
    assert!(fake.peer_access_enabled(D0, D1));
    Ok(())
}

#[test]
fn a_copy_between_devices_runs_on_the_source_stream_between_two_barriers() -> TestResult {
    let fake = four_devices();
    let rt = Runtime::new(fake.clone());
    let src = DeviceBuffer::from_slice(&rt, D0, &[1i32, 2, 3, 4])?;
    let dst = DeviceBuffer::<i32>::filled(&rt, D1, 4, 0)?;
    let (s0, s1) = (rt.current_stream(D0)?, rt.current_stream(D1)?);
    fake.set_completion(Completion::Manual);
    dst.fill(7)?; // pending on device 1's current stream
    dst.copy_from(&src)?;
    dst.fill(9)?; // must wait for the copy
    assert_eq!(fake.calls(Call::MemcpyPeer), 1);
    assert_eq!(
        fake.pending(s0.handle())?,
        3,
        "wait, copy, record on the source stream"
    );
    assert_eq!(
        fake.advance(s0.handle(), None)?,
        0,
        "the copy waits for device 1's fill"
    );
    assert_eq!(
        fake.advance(s1.handle(), None)?,
        2,
        "fill, record; then the wait blocks"
    );
    assert_eq!(fake.advance(s0.handle(), None)?, 3);
    assert_eq!(fake.advance(s1.handle(), None)?, 2, "wait, the second fill");
    fake.set_completion(Completion::Eager);
    assert_eq!(
        dst.to_host()?,
        vec![9; 4],
        "the last fill came after the copy"
    );
    assert_eq!(
        fake.peer_copies(),
        PeerCopies {
            direct: 1,
            staged: 0
        }
    );
    assert!(
        fake.peer_access_enabled(D0, D1),
        "source to destination, as Copy.cu"
    );
    Ok(())
}

#[test]
fn without_peer_access_the_copy_is_staged_and_still_right() -> TestResult {
    let fake = four_devices();
    let rt = Runtime::new(fake.clone());
    let src = DeviceBuffer::from_slice(&rt, D0, &[5u8; 100])?;
    let dst = DeviceBuffer::<u8>::filled(&rt, D3, 100, 0)?;
    dst.copy_from(&src)?;
    assert_eq!(dst.to_host()?, vec![5; 100]);
    assert_eq!(
        fake.peer_copies(),
        PeerCopies {
            direct: 0,
            staged: 1
        }
    );
    assert_eq!(fake.calls(Call::EnablePeerAccess), 0);
    Ok(())
}

#[test]
fn a_copy_honours_each_devices_current_stream_and_leaves_the_current_device() -> TestResult {
    let fake = four_devices();
    let rt = Runtime::new(fake.clone());
    let src = DeviceBuffer::from_slice(&rt, D2, &[3i32; 8])?;
    let dst = DeviceBuffer::<i32>::filled(&rt, D1, 8, 0)?;
    let side = rt.new_stream(D2, 0)?;
    let _guard = rt.stream_guard(&side)?;
    let _dev = rt.device_guard(D3)?;
    fake.set_completion(Completion::Manual);
    dst.copy_from(&src)?;
    assert_eq!(
        fake.pending(side.handle())?,
        3,
        "the copy went to device 2's current stream"
    );
    assert_eq!(rt.current_device(), D3);
    fake.set_completion(Completion::Eager);
    fake.advance_all();
    assert_eq!(dst.to_host()?, vec![3; 8]);
    Ok(())
}

#[test]
fn device_guards_restore_across_devices() -> TestResult {
    let fake = four_devices();
    let rt = Runtime::new(fake);
    rt.set_device(D1)?;
    {
        let g2 = rt.device_guard(D2)?;
        assert_eq!(g2.previous(), D1);
        {
            let _g3 = rt.device_guard(D3)?;
            let _g0 = rt.device_guard(D0)?;
            assert_eq!(rt.current_device(), D0);
            assert!(rt.device_guard(DeviceIndex(4)).is_err());
            assert_eq!(rt.current_device(), D0, "a refused guard changes nothing");
        }
        assert_eq!(rt.current_device(), D2);
        let other = std::thread::scope(|s| s.spawn(|| rt.current_device()).join());
        assert_eq!(other.ok(), Some(D0), "another thread has its own device");
    }
    assert_eq!(rt.current_device(), D1);
    Ok(())
}
