//! Graph-safe Philox random numbers.
use crate::{BoxError, D0, N, Setup, TestResult};
use ferrocuda_graph::{CaptureMode, GraphError, PhiloxGenerator};
use ferrocuda_stream::{DeviceBuffer, Stream};
use ferrocuda_testkit::Harness;

fn draw(s: &Setup, generator: &PhiloxGenerator, stream: &Stream) -> Result<Vec<f32>, BoxError> {
    let out = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    generator.uniform(&out, stream)?;
    stream.synchronize()?;
    Ok(out.to_host()?)
}

/// Graph-safe Philox: replays draw exactly what eager calls from the same seed draw, in
/// sequence with eager draws between them; capture does not move the offset, each replay
/// moves it by the captured total; several generators advance independently.
pub(crate) fn rng_replays_match_eager(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let current = s.h.rt.current_stream(D0)?;
    let reference = PhiloxGenerator::new(&s.h.rt, D0, 42)?;
    let eager: Vec<Vec<f32>> = (0..4)
        .map(|_| draw(&s, &reference, &current))
        .collect::<Result<_, _>>()?;
    assert!(eager[0] != eager[1], "consecutive draws differ");
    assert!(
        eager.iter().flatten().all(|v| (0.0..1.0).contains(v)),
        "uniform in [0, 1)"
    );
    assert!(
        eager[0].iter().any(|&v| v != eager[0][0]),
        "a draw is not constant"
    );
    assert_eq!(reference.offset(), 16, "4 offset units per draw");

    let generator = PhiloxGenerator::new(&s.h.rt, D0, 42)?;
    let unregistered = PhiloxGenerator::new(&s.h.rt, D0, 1)?;
    let g = s.graph()?;
    g.register_generator(&generator)?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let out = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    generator.uniform(&out, &stream)?;
    assert!(
        matches!(g.register_generator(&generator), Err(GraphError::Rng(_))),
        "no registration while capturing"
    );
    assert!(
        matches!(generator.manual_seed(7), Err(GraphError::Rng(_))),
        "no reseeding while capturing"
    );
    generator.manual_seed(42)?;
    assert!(matches!(
        unregistered.uniform(&out, &stream),
        Err(GraphError::Rng(_))
    ));
    capture.end()?;
    assert_eq!(generator.offset(), 0, "capture does not move the offset");
    for (i, expected) in [(0, &eager[0]), (1, &eager[1])] {
        g.replay(&stream)?;
        stream.synchronize()?;
        assert!(
            out.to_host()? == *expected,
            "replay {i} draws the eager numbers"
        );
    }
    assert_eq!(generator.offset(), 8);
    assert!(
        draw(&s, &generator, &current)? == eager[2],
        "an eager draw between replays"
    );
    g.replay(&stream)?;
    stream.synchronize()?;
    assert!(
        out.to_host()? == eager[3],
        "the replay after it continues the sequence"
    );

    // A generator records into one capture at a time; the refused capture leaves the
    // other one intact.
    let (g_a, g_b) = (s.graph()?, s.graph()?);
    g_a.register_generator(&generator)?;
    g_b.register_generator(&generator)?;
    let side = s.h.rt.new_stream(D0, 0)?;
    g_a.capture_begin(&stream, None, CaptureMode::ThreadLocal)?;
    assert!(matches!(
        g_b.capture_begin(&side, None, CaptureMode::ThreadLocal),
        Err(GraphError::Rng(_))
    ));
    assert_eq!(g_b.pool(), None);
    generator.uniform(&out, &stream)?;
    g_a.capture_end()?;
    g_a.replay(&stream)?;
    assert_eq!(generator.offset(), 20, "16 before g_a, +4 by its replay");
    let (a, b) = (
        PhiloxGenerator::new(&s.h.rt, D0, 5)?,
        PhiloxGenerator::new(&s.h.rt, D0, 6)?,
    );
    let g2 = s.graph()?;
    g2.register_generator(&a)?;
    g2.register_generator(&b)?;
    let capture = g2.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    let draws: Vec<DeviceBuffer<f32>> = (0..3)
        .map(|_| DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N))
        .collect::<Result<_, _>>()?;
    a.uniform(&draws[0], &stream)?;
    a.uniform(&draws[1], &stream)?;
    b.uniform(&draws[2], &stream)?;
    capture.end()?;
    g2.replay(&stream)?;
    assert_eq!((a.offset(), b.offset()), (8, 4));
    g2.replay(&stream)?;
    assert_eq!((a.offset(), b.offset()), (16, 8));
    Ok(())
}
