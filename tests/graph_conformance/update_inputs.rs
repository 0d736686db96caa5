//! `update_inputs`: repointing a captured graph at new buffers.
use crate::{D0, N, Setup, TestResult};
use ferrocuda::driver::{Call, DriverError};
use ferrocuda::graph::{CaptureMode, GraphError, InputUpdate};
use ferrocuda::stream::DeviceBuffer;
use ferrocuda::stream::conformance::Harness;

/// `update_inputs` repoints a captured graph at other buffers without copying: replays
/// then read the new inputs, untouched arguments stay, and the old buffers are unused.
pub(crate) fn update_inputs_patches_pointers(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let g = s.graph()?;
    let (x, other) = (s.buffer(1.0)?, s.buffer(0.0)?);
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &y, &x, 2.0)?;
    s.add_one(&stream, &other)?;
    capture.end()?;
    g.replay(&stream)?;
    s.expect(&stream, &y, 2.0, "before the update")?;
    let (x2, y2) = (s.buffer(21.0)?, s.buffer(0.0)?);
    s.h.rt.current_stream(D0)?.synchronize()?;
    assert_eq!(
        g.update_inputs(&[(&x, &x2), (&y, &y2)])?,
        InputUpdate::InPlace { arguments: 2 }
    );
    x.copy_from_host(&vec![-1.0; N])?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    g.replay(&stream)?;
    s.expect(&stream, &y2, 42.0, "the replay reads x2 and writes y2")?;
    s.expect(&stream, &y, 2.0, "the old output is no longer written")?;
    s.expect(&stream, &other, 2.0, "the unpatched node still runs")?;
    assert!(matches!(
        g.update_inputs(&[(&x2, &s.buffer(0.0)?)]),
        Ok(InputUpdate::InPlace { arguments: 1 })
    ));
    let short = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, 1)?;
    assert!(matches!(
        g.update_inputs(&[(&x2, &short)]),
        Err(GraphError::Stream(_))
    ));
    let empty = s.graph()?;
    assert_eq!(
        empty.update_inputs(&[(&x, &x2)]),
        Err(GraphError::NothingCaptured)
    );
    Ok(())
}

/// When the driver refuses the in-place update, `update_inputs` instantiates the patched
/// graph again (fake device: the refusal is injected).
#[test]
fn update_inputs_reinstantiates_when_refused() -> TestResult {
    let h = ferrocuda::stream::conformance::fake_harness();
    let fake = h.fake.clone().ok_or("the fake harness has a fake driver")?;
    let s = Setup::new(&h)?;
    let g = s.graph()?;
    let (x, x2) = (s.buffer(1.0)?, s.buffer(4.0)?);
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &y, &x, 2.0)?;
    capture.end()?;
    let instantiated = fake.calls(Call::GraphInstantiate);
    fake.fail_nth(
        Call::GraphExecUpdate,
        1,
        DriverError::GRAPH_EXEC_UPDATE_FAILURE,
    );
    s.h.rt.current_stream(D0)?.synchronize()?;
    assert_eq!(
        g.update_inputs(&[(&x, &x2)])?,
        InputUpdate::Reinstantiated { arguments: 1 }
    );
    assert_eq!(fake.calls(Call::GraphInstantiate), instantiated + 1);
    g.replay(&stream)?;
    s.expect(&stream, &y, 8.0, "the new instance reads x2")
}
