//! Streams: the current stream and its guard, the stream pool, priorities, and ordering across streams with `wait_stream` and `wait_event`.
use super::*;

pub fn current_stream_and_stream_guard(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let default = rt.default_stream(DEV)?;
    assert!(default.is_default());
    assert_eq!(rt.current_stream(DEV)?, default);
    let s = rt.new_stream(DEV, 0)?;
    {
        let _g = rt.stream_guard(&s)?;
        assert_eq!(rt.current_stream(DEV)?, s);
        let s2 = rt.stream_from_pool(DEV, false)?;
        {
            let _g2 = rt.stream_guard(&s2)?;
            assert_eq!(rt.current_stream(DEV)?, s2);
        }
        assert_eq!(rt.current_stream(DEV)?, s);
        let other_thread = std::thread::scope(|sc| sc.spawn(|| rt.current_stream(DEV)).join());
        assert_eq!(
            other_thread.expect("thread")?,
            default,
            "current streams are per thread"
        );
    }
    assert_eq!(rt.current_stream(DEV)?, default);
    rt.set_stream(&s)?;
    assert_eq!(rt.current_stream(DEV)?, s);
    rt.set_stream(&default)?;
    let external = rt.external_stream(s.handle())?;
    assert_eq!(external, s);
    let bogus = StreamHandle {
        device: DEV,
        raw: 0xdead_0000,
    };
    assert!(rt.external_stream(bogus).is_err());
    Ok(())
}

pub fn stream_pool_round_robin(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let low: Vec<_> = (0..ferrocuda_stream::STREAMS_PER_POOL)
        .map(|_| rt.stream_from_pool(DEV, false))
        .collect::<Result<_, _>>()?;
    for (i, a) in low.iter().enumerate() {
        assert!(
            low[i + 1..].iter().all(|b| a != b),
            "pool streams are distinct"
        );
    }
    assert_eq!(
        rt.stream_from_pool(DEV, false)?,
        low[0],
        "the 33rd wraps around"
    );
    let high = rt.stream_from_pool(DEV, true)?;
    assert!(low.iter().all(|s| *s != high));
    assert!(
        high.priority() < low[0].priority(),
        "high priority is a lower number"
    );
    Ok(())
}

pub fn stream_priorities(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let (least, greatest) = rt.priority_range(DEV)?;
    assert!(greatest <= -1 && least == 0, "range {least}..{greatest}");
    assert_eq!(rt.new_stream(DEV, -1)?.priority(), -1);
    assert_eq!(rt.new_stream(DEV, -100)?.priority(), greatest);
    assert_eq!(rt.new_stream(DEV, 100)?.priority(), least);
    Ok(())
}

/// The torch.cuda docs' side-stream example, fixed with `wait_stream`.
pub fn side_stream_fixed_with_wait_stream(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let m = module(h)?;
    let (fill, scale) = (m.function("fill_f32")?, m.function("scale_f32")?);
    let n = 4096u32;
    let a = DeviceBuffer::<f32>::uninit(rt, DEV, n as usize)?;
    let b = DeviceBuffer::<f32>::uninit(rt, DEV, n as usize)?;
    let current = rt.current_stream(DEV)?;
    launch_spin(h, &current, 20)?;
    current.launch(
        &fill,
        &elementwise(n as usize),
        &[a.arg(), KernelArg::value(&3.0f32), KernelArg::value(&n)],
    )?;
    let side = rt.stream_from_pool(DEV, false)?;
    side.wait_stream(&current)?;
    {
        let _g = rt.stream_guard(&side)?;
        let s = rt.current_stream(DEV)?;
        s.launch(
            &scale,
            &elementwise(n as usize),
            &[
                b.arg(),
                a.arg(),
                KernelArg::value(&2.0f32),
                KernelArg::value(&n),
            ],
        )?;
    }
    rt.synchronize(DEV)?;
    assert!(b.to_host()?.iter().all(|&v| v == 6.0));
    Ok(())
}

pub fn cross_stream_wait_event(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let m = module(h)?;
    let n = 1000u32;
    let x = DeviceBuffer::<f32>::filled(rt, DEV, n as usize, 1.0)?;
    let y = DeviceBuffer::<f32>::uninit(rt, DEV, n as usize)?;
    rt.synchronize(DEV)?;
    let (producer, consumer) = (rt.new_stream(DEV, 0)?, rt.new_stream(DEV, 0)?);
    launch_spin(h, &producer, 20)?;
    producer.launch(
        &m.function("add_one_f32")?,
        &elementwise(n as usize),
        &[x.arg(), KernelArg::value(&n)],
    )?;
    let done = producer.record_event(None)?;
    consumer.wait_event(&done)?;
    consumer.launch(
        &m.function("scale_f32")?,
        &elementwise(n as usize),
        &[
            y.arg(),
            x.arg(),
            KernelArg::value(&10.0f32),
            KernelArg::value(&n),
        ],
    )?;
    consumer.synchronize()?;
    assert!(
        done.query()?,
        "the awaited event completed before the consumer"
    );
    assert!(y.to_host()?.iter().all(|&v| v == 20.0));
    Ok(())
}

// ---- events ----------------------------------------------------------------------------
