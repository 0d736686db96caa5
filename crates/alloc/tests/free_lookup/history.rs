//! Memory history: the trace's request entries and their frames, against a model.
use crate::common::{LEGACY, MIB, Rng, new_stream};
use crate::device;
use ferrocuda_alloc::CachingAllocator;
use ferrocuda_alloc::history::HistoryOptions;
use ferrocuda_types::{DevicePtr, Frame};
use std::hint::black_box;

// Call sites the frames must name (bodies differ, so that no two are merged).
#[inline(never)]
fn site_a1(a: &CachingAllocator, n: u64) -> u64 {
    black_box(a.allocate(n + black_box(0), LEGACY).unwrap().ptr.0)
}
#[inline(never)]
fn site_a2(a: &CachingAllocator, n: u64) -> u64 {
    black_box(a.allocate(n | black_box(0), LEGACY).unwrap().ptr.0)
}
#[inline(never)]
fn site_f1(a: &CachingAllocator, p: u64) {
    a.free(DevicePtr(p + black_box(0))).unwrap();
}
#[inline(never)]
fn site_f2(a: &CachingAllocator, p: u64) {
    a.free(DevicePtr(p | black_box(0))).unwrap();
}

const SITES: [&str; 4] = ["site_a1", "site_a2", "site_f1", "site_f2"];
const CONTEXTS: [Option<&str>; 4] = [None, Some("state"), Some("alloc"), Some("all")];

/// The one site `frames` name ("none" if none), if there are frames.
fn site(frames: &Option<Vec<Frame>>) -> Option<&'static str> {
    let f = frames.as_ref()?;
    let mut found = SITES
        .iter()
        .filter(|s| f.iter().any(|x| x.name.contains(*s)));
    let first = found.next().copied();
    assert!(found.next().is_none(), "one site per stack: {f:?}");
    Some(first.unwrap_or("none"))
}

/// An expected request entry: action, address, requested bytes, the site its frames name
/// (`None`: no frames; `Some("any")`: not checked).
type Entry = (&'static str, u64, u64, Option<&'static str>);

/// PyTorch's trace (`record_trace`): `alloc` at each allocation; `free_requested` then at
/// once `free_completed` at each free (recorded before `free_block`'s merges, which record
/// nothing), or, for a block used on another stream, `free_completed` when its events are
/// processed (the next allocation or `empty_cache`), before that allocation's entry.
/// Frames (`context ? context : context_when_allocated`, kept from "alloc" up): the
/// allocation's stack on `alloc`; on frees the free's own with "all", else the stack the
/// block was allocated with (kept from "state" up), if any. Live blocks show theirs in the
/// snapshot. The context changes while blocks live; merges must lose or move none of it.
#[test]
fn request_entries_and_frames_follow_the_requests_in_order() {
    let (fake, a) = device("");
    let side = new_stream(&fake).unwrap();
    let mut rng = Rng::new(0x415);
    let (mut want, mut pending) = (Vec::<Entry>::new(), Vec::<Entry>::new());
    let (mut live, mut deferred) = (Vec::new(), 0);
    for rank in [0, 1, 2, 3, 2, 1, 0, 3, 0] {
        let options = HistoryOptions::parse(Some("all"), CONTEXTS[rank], 1 << 20);
        a.record_memory_history(options.unwrap());
        for _ in 0..500 {
            let roll = rng.below(100);
            if live.is_empty() || roll < 50 {
                let most = if rng.pct(10) { 7 * MIB } else { 40_000 };
                let n = 1 + rng.below(most);
                let one = rng.pct(50);
                let p = if one { site_a1(&a, n) } else { site_a2(&a, n) };
                let at = SITES[usize::from(!one)];
                want.append(&mut pending);
                want.push(("alloc", p, n, (rank >= 2).then_some(at)));
                live.push((p, n, (rank >= 1).then_some(at)));
            } else if roll < 97 {
                let (p, n, at) = live.swap_remove(rng.below(live.len() as u64) as usize);
                let uses = rng.pct(15);
                if uses {
                    a.record_stream(DevicePtr(p), side).unwrap();
                }
                let one = rng.pct(50);
                if one {
                    site_f1(&a, p)
                } else {
                    site_f2(&a, p)
                }
                let by = [None, None, at, Some(SITES[2 + usize::from(!one)])][rank];
                want.push(("free_requested", p, n, by));
                // (A deferred free's stack: ferrocuda keeps the block's; PyTorch passes the
                // context of the call that processes the events. Not checked here.)
                if uses {
                    deferred += 1;
                    pending.push(("free_completed", p, n, Some("any")));
                } else {
                    want.push(("free_completed", p, n, by));
                }
            } else {
                a.empty_cache();
                want.append(&mut pending);
            }
        }
    }
    let (segments, trace) = a.snapshot();
    let requests = ["alloc", "free_requested", "free_completed"];
    let got: Vec<Entry> = (trace.iter())
        .filter_map(|e| {
            let action = requests.into_iter().find(|x| *x == e.action)?;
            Some((action, e.addr, e.size, site(&e.frames)))
        })
        .collect();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let same = (g.0, g.1, g.2) == (w.0, w.1, w.2) && (w.3 == Some("any") || g.3 == w.3);
        assert!(same, "entry {i}: got {g:?}, want {w:?}");
    }
    assert_eq!(got.len(), want.len(), "entries");
    assert!(deferred > 100, "{deferred} frees waited for another stream");
    // The live blocks' stacks in the snapshot: those allocated from "state" up.
    let blocks: Vec<_> = segments.iter().flat_map(|s| &s.blocks).collect();
    for b in &blocks {
        let l = live.iter().find(|l| l.0 == b.address);
        let at = l.and_then(|l| l.2);
        let named = at.is_some_and(|at| b.frames.iter().any(|f| f.name.contains(at)));
        let (ptr, frames) = (b.address, &b.frames);
        assert_eq!(named, at.is_some(), "block {ptr:#x}: {frames:?}");
        assert_eq!(
            frames.is_empty(),
            at.is_none(),
            "block {ptr:#x}: {frames:?}"
        );
        assert!(l.is_none_or(|l| l.1 == b.requested_size), "{ptr:#x}");
    }
    let allocated = blocks.iter().filter(|b| b.state == "active_allocated");
    assert_eq!(allocated.count(), live.len(), "live blocks in the snapshot");
    // For a comparison of builds: FREE_LOOKUP_DUMP=path writes every entry (times left out).
    if let Ok(path) = std::env::var("FREE_LOOKUP_DUMP") {
        let line = |e: &ferrocuda_types::TraceEntry| {
            let frames = e.frames.iter().flatten().map(|f| (&f.name, f.line));
            let frames: Vec<_> = frames.collect();
            format!(
                "{} {:#x} {} {} {frames:?}\n",
                e.action, e.addr, e.size, e.stream
            )
        };
        std::fs::write(path, trace.iter().map(line).collect::<String>()).unwrap();
    }
}
