use super::*;
use ferrocuda_alloc::history::HistoryOptions;

#[test]
fn history_and_snapshot_follow_pytorch() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let opts = HistoryOptions::parse(Some("all"), Some("all"), 100).map_err(|e| e.to_string())?;
    a.record_memory_history(opts);
    let s1 = new_stream(&fake)?;
    let x = a.allocate(1000, LEGACY)?;
    let y = a.allocate(3 * MIB, LEGACY)?;
    fake.memset_async(y.ptr, MemsetValue::U8(1), 16, s1)?;
    a.record_stream(y.ptr, s1)?;
    a.free(y.ptr)?;
    let (segments, trace) = a.snapshot();
    assert_eq!(segments.len(), 2);
    let small = &segments[0];
    assert_eq!(
        (
            small.segment_type.as_str(),
            small.total_size,
            small.allocated_size,
            small.requested_size
        ),
        ("small", 2 * MIB, 1024, 1000)
    );
    assert_eq!(small.blocks[0].state, "active_allocated");
    let first = small.blocks[0]
        .frames
        .first()
        .map(|f| f.name.as_str())
        .unwrap_or_default();
    assert!(
        first.contains("history_and_snapshot_follow_pytorch"),
        "the caller comes first: {first}"
    );
    let large = &segments[1];
    assert_eq!(
        large.blocks[0].state, "active_pending_free",
        "waiting for s1"
    );
    assert_eq!(
        large.blocks.iter().map(|b| b.size).sum::<u64>(),
        large.total_size
    );
    let actions: Vec<&str> = trace.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(
        actions,
        [
            "segment_alloc",
            "alloc",
            "segment_alloc",
            "alloc",
            "free_requested"
        ],
        "a snapshot's own entry shows in the next one only"
    );
    assert_eq!(
        (trace[1].size, trace[1].addr),
        (1000, x.ptr.0),
        "alloc entries carry the requested size"
    );
    assert!(
        trace[4].frames.as_ref().is_some_and(|f| !f.is_empty()),
        "context=all records free stacks"
    );
    fake.advance(s1, None)?;
    a.free(x.ptr)?;
    a.empty_cache();
    let (segments, trace) = a.snapshot();
    assert!(segments.is_empty());
    let tail: Vec<&str> = trace
        .iter()
        .rev()
        .take(5)
        .map(|e| e.action.as_str())
        .collect();
    assert!(
        tail.contains(&"free_completed") && tail.contains(&"segment_free"),
        "{tail:?}"
    );
    assert_eq!(trace[5].action, "snapshot", "the first snapshot's entry");
    // The ring buffer keeps the newest entries; state mode keeps one; off clears.
    a.record_memory_history(
        HistoryOptions::parse(Some("all"), None, 3).map_err(|e| e.to_string())?,
    );
    assert_eq!(a.snapshot().1.len(), 3);
    a.record_memory_history(HistoryOptions::parse(None, None, 3).map_err(|e| e.to_string())?);
    assert!(a.snapshot().1.is_empty());
    assert!(HistoryOptions::parse(Some("everything"), None, 1).is_err());
    assert!(
        HistoryOptions::parse(Some("all"), Some("some"), 1)
            .is_err_and(|e| e.contains("'state', 'alloc', 'all', or None"))
    );
    Ok(())
}

/// Alone, the allocator skips only its own frames (and the backtrace crate's): which
/// frames of the layers above are plumbing is theirs to say (the facade passes them).
/// No test in this file passes `skip_frames`: lists given are merged process-wide.
#[test]
fn alone_the_allocator_skips_only_its_own_frames() -> TestResult {
    use ferrocuda_alloc::DeviceAllocators;
    use ferrocuda_stream::{DeviceBuffer, KernelCache, Runtime};
    let fake = Arc::new(FakeDriver::default());
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    let allocators = DeviceAllocators::new(fake, AllocatorConfig::default(), Caching::On);
    allocators.install(&rt);
    allocators
        .device(D0)?
        .record_memory_history(HistoryOptions::parse(Some("all"), Some("all"), 100)?);
    let buffer = DeviceBuffer::<f32>::uninit(&rt, D0, 10)?;
    let (segments, _) = allocators.device(D0)?.snapshot();
    let frames = &segments[0].blocks[0].frames;
    assert_eq!(segments[0].blocks[0].address, buffer.ptr().0);
    let names: Vec<&str> = frames.iter().map(|f| f.name.as_str()).collect();
    // The stream layer's frame, by its name, or (inlined in an optimized build, where
    // the debug info names it without its path, `uninit<f32>`) by its file.
    let stream_layers = |f: &ferrocuda_types::Frame| {
        f.name.starts_with("ferrocuda_stream::buffer::DeviceBuffer")
            || f.filename
                .replace('\\', "/")
                .ends_with("crates/stream/src/buffer.rs")
    };
    assert!(
        frames.first().is_some_and(stream_layers),
        "the stream layer's frame is not the allocator's to skip: {frames:?}"
    );
    assert!(
        names
            .iter()
            .any(|n| n.contains("alone_the_allocator_skips_only_its_own_frames")),
        "{names:?}"
    );
    Ok(())
}

#[test]
fn expandable_snapshot_has_one_segment_per_mapped_run_and_map_events() -> TestResult {
    let (_, a) = setup(80 * GIB, "expandable_segments:True", Completion::Eager);
    a.record_memory_history(
        HistoryOptions::parse(Some("all"), None, 1000).map_err(|e| e.to_string())?,
    );
    let xs: Vec<_> = (0..3)
        .map(|_| a.allocate(40 * MIB, LEGACY))
        .collect::<Result<_, _>>()?;
    a.free(xs[1].ptr)?;
    a.empty_cache();
    let (segments, trace) = a.snapshot();
    assert_eq!(
        segments.len(),
        2,
        "the unmapped hole splits the range in two"
    );
    assert!(segments.iter().all(|s| s.is_expandable));
    let actions: Vec<&str> = trace.iter().map(|e| e.action.as_str()).collect();
    assert!(
        actions.contains(&"segment_map") && actions.contains(&"segment_unmap"),
        "{actions:?}"
    );
    Ok(())
}
