//! Streams another library made, adopted by the fake driver as the real one adopts cudarc's:
//! refused until adopted, usable while adopted (counted), refused again once every adoption
//! is forgotten, and never destroyed by the driver.
use ferrocuda_driver::{Call, Driver, DriverError, FakeDriver};
use ferrocuda_types::{DeviceIndex, MemsetValue, StreamHandle};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);

#[test]
fn a_foreign_stream_is_usable_only_while_adopted() -> TestResult {
    let fake = FakeDriver::default();
    let foreign = fake.foreign_stream(D0)?;
    let raw = StreamHandle {
        device: D0,
        raw: foreign.raw(),
    };
    assert_eq!(fake.stream_query(raw), Err(DriverError::INVALID_HANDLE));
    assert_eq!(fake.adoptions(&foreign), Some(0));

    let a = fake.stream_adopt(&foreign)?;
    let b = fake.stream_adopt(&foreign)?;
    assert_eq!((a, b), (raw, raw), "the handle is the stream's own name");
    assert_eq!(fake.adoptions(&foreign), Some(2));
    let ptr = fake.malloc(D0, 64)?;
    fake.memset_async(ptr, MemsetValue::U8(7), 64, a)?;
    let mut out = [0u8; 64];
    fake.memcpy_dtoh(&mut out, ptr, a)?;
    assert_eq!(out, [7; 64], "work runs on an adopted stream");
    assert_eq!(
        fake.stream_destroy(a),
        Err(DriverError::INVALID_HANDLE),
        "its maker destroys it, not the driver"
    );

    fake.stream_forget(a)?;
    assert!(fake.stream_query(a)?, "one adoption is left");
    fake.stream_forget(a)?;
    assert_eq!(fake.stream_query(a), Err(DriverError::INVALID_HANDLE));
    assert_eq!(fake.stream_forget(a), Err(DriverError::INVALID_HANDLE));
    assert_eq!(fake.adoptions(&foreign), Some(0), "it still exists");
    assert_eq!(
        fake.calls(Call::StreamDestroy),
        1,
        "only the refused attempt"
    );
    assert_eq!(
        (
            fake.calls(Call::StreamAdopt),
            fake.calls(Call::StreamForget)
        ),
        (2, 3)
    );
    Ok(())
}

#[test]
fn a_stream_of_another_driver_or_device_is_refused() -> TestResult {
    let fake = FakeDriver::default();
    let other = FakeDriver::default();
    let theirs = other.foreign_stream(D0)?;
    // Made by `other`: unknown here.
    assert_eq!(fake.stream_adopt(&theirs), Err(DriverError::INVALID_HANDLE));
    assert_eq!(
        fake.foreign_stream(DeviceIndex(3)).map(|_| ()),
        Err(DriverError::INVALID_DEVICE)
    );
    let own = fake.stream_create(D0, Default::default())?;
    assert_eq!(
        fake.stream_forget(own),
        Err(DriverError::INVALID_HANDLE),
        "a stream the driver made is not adopted"
    );
    Ok(())
}
