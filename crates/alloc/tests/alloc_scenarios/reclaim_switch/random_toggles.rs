use super::*;

#[derive(Clone, Copy, Debug)]
enum Op {
    Alloc(u64, usize),
    Free(usize),
    FreeLate(usize),
    FreeElsewhere(usize),
    Write(usize),
    Advance(usize, usize),
    Drain,
    Reclaim(bool),
    Expandable(bool),
    EmptyCache,
    /// `expandable_segments_page_mb` (new segments only).
    PageMb(u64),
}

fn gen_ops(seed: u64, n: usize, nstreams: usize, with_expandable: bool) -> Vec<Op> {
    let mut r = Rng(seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
    (0..n)
        .map(|_| match r.below(100) {
            0..=39 => {
                let bytes = match r.below(4) {
                    0 => (1 + r.below(1024)) * 1024,
                    1 => (1 + r.below(8)) * 2 * MIB,
                    _ => (1 + r.below(40)) * MIB - 512 * r.below(3),
                };
                Op::Alloc(bytes, r.below(nstreams as u64) as usize)
            }
            40..=45 => Op::Free(r.next() as usize),
            46..=57 => Op::FreeLate(r.next() as usize),
            58..=60 => Op::FreeElsewhere(r.next() as usize),
            61..=68 => Op::Write(r.next() as usize),
            69..=80 => Op::Advance(r.below(nstreams as u64) as usize, r.below(40) as usize),
            81..=86 => Op::Drain,
            87..=94 => Op::Reclaim(r.below(3) != 0),
            95..=97 if with_expandable => Op::Expandable(r.below(3) != 0),
            95..=97 => Op::PageMb([2, 4, 20][r.below(3) as usize]),
            _ => Op::EmptyCache,
        })
        .collect()
}

fn run_toggle(conf: &str, capacity: u64, nstreams: usize, ops: &[Op]) -> R<()> {
    run_toggle_counted(conf, capacity, nstreams, ops).map(|_| ())
}

/// Returns how many growths moved pages without a synchronization (reclaims).
fn run_toggle_counted(conf: &str, capacity: u64, nstreams: usize, ops: &[Op]) -> R<u64> {
    let mut t = H::new(capacity, conf, Completion::Manual, nstreams);
    let mut reclaims = 0;
    for (i, op) in ops.iter().enumerate() {
        let n = t.live.len();
        let res = match *op {
            Op::Alloc(b, s) => {
                let (unmaps, syncs) = (t.fake.calls(Call::VmUnmap), t.syncs());
                let r = t.alloc(b, t.streams[s]).map(|_| ());
                if t.fake.calls(Call::VmUnmap) > unmaps && t.syncs() == syncs {
                    reclaims += 1;
                }
                r
            }
            Op::Free(p) if n > 0 => t.free_at(p % n, false),
            Op::FreeLate(p) if n > 0 => t.free_at(p % n, true),
            Op::FreeElsewhere(p) if n > 0 && t.streams.len() > 1 => t.free_elsewhere(p % n),
            Op::Write(p) if n > 0 => {
                t.retag(p % n);
                Ok(())
            }
            Op::Advance(s, k) => t
                .fake
                .advance(t.streams[s], Some(k))
                .map(|_| ())
                .map_err(|e| format!("{e:?}")),
            Op::Drain => {
                t.fake.advance_all();
                Ok(())
            }
            Op::Reclaim(on) => {
                t.a.update_config(&format!("expandable_segments_reclaim:{}", py(on)))
                    .map_err(|e| e.to_string())
            }
            Op::Expandable(on) => {
                t.a.update_config(&format!("expandable_segments:{}", py(on)))
                    .map_err(|e| e.to_string())
            }
            Op::EmptyCache => {
                t.a.empty_cache();
                Ok(())
            }
            Op::PageMb(mb) => {
                t.a.update_config(&format!("expandable_segments_page_mb:{mb}"))
                    .map_err(|e| e.to_string())
            }
            _ => Ok(()),
        };
        res.and_then(|()| t.inv())
            .map_err(|e| format!("step {i} {op:?}: {e}"))?;
    }
    t.finish().map_err(|e| format!("at the end: {e}"))?;
    Ok(reclaims)
}

fn toggle_seeds(
    conf: &str,
    capacity: u64,
    nstreams: usize,
    expandable: bool,
    seeds: std::ops::Range<u64>,
    len: usize,
) {
    let seeds = scaled(seeds);
    let mut reclaims = 0;
    for seed in seeds {
        let ops = gen_ops(seed, len, nstreams, expandable);
        let r = run_toggle_counted(conf, capacity, nstreams, &ops);
        if let Ok(k) = r {
            reclaims += k;
        }
        if let Err(e) = r {
            let min = shrink(&ops, |o| run_toggle(conf, capacity, nstreams, o).is_err());
            let why = run_toggle(conf, capacity, nstreams, &min).unwrap_err();
            panic!(
                "seed {seed}: {e}\nminimal ({} ops): {min:?}\n=> {why}",
                min.len()
            );
        }
    }
    eprintln!(
        "{conf} cap {} MiB: {reclaims} growths reclaimed pages",
        capacity / MIB
    );
    assert!(reclaims > 20, "coverage: only {reclaims} reclaims");
}

#[test]
fn toggle_random_start_off_3_streams() {
    toggle_seeds(PLAIN, 16 * GIB, 3, false, 0..60, 150);
}

#[test]
fn toggle_random_start_on_3_streams() {
    toggle_seeds(RECLAIM, 16 * GIB, 3, false, 100..160, 150);
}

#[test]
fn toggle_random_with_expandable_switch() {
    toggle_seeds(PLAIN, 16 * GIB, 2, true, 200..260, 150);
}

#[test]
fn toggle_random_small_device_oom() {
    toggle_seeds(PLAIN, 160 * MIB, 2, true, 300..360, 150);
    toggle_seeds(RECLAIM, 96 * MIB, 2, false, 400..460, 150);
}

#[test]
fn toggle_random_single_lock() {
    toggle_seeds(
        &format!("{PLAIN},thread_cache:False"),
        16 * GIB,
        3,
        true,
        500..560,
        150,
    );
    toggle_seeds(
        &format!("{RECLAIM},thread_cache:False"),
        128 * MIB,
        2,
        false,
        600..660,
        150,
    );
}
