use super::*;

fn round(n: u64) -> u64 {
    (n.max(1) + 511) & !511
}

/// The block `get_free_block` should pick, from a settled snapshot.
fn predict(
    blocks: &[BlockInfo],
    bytes: u64,
    stream: StreamHandle,
    expandable_on: bool,
    tail_only: bool,
) -> Option<u64> {
    let size = round(bytes);
    let kind = if size <= MIB {
        PoolKind::Small
    } else {
        PoolKind::Large
    };
    // growth of block i: the unmapped block after it in its segment
    let grow = |i: usize| -> u64 {
        let b = &blocks[i];
        match blocks.get(i + 1) {
            Some(n) if n.segment == b.segment && !n.mapped => {
                let last = blocks.get(i + 2).is_none_or(|m| m.segment != n.segment);
                if tail_only && !last { 0 } else { n.size }
            }
            _ => 0,
        }
    };
    let mut cands: Vec<usize> = (0..blocks.len())
        .filter(|&i| {
            let b = &blocks[i];
            b.mapped
                && !b.allocated
                && !b.pending_events
                && b.stream == stream
                && b.pool == kind
                && b.pool_id == PoolId::DEFAULT
                && b.size >= size
        })
        .collect();
    cands.sort_by_key(|&i| (blocks[i].size, blocks[i].ptr.0));
    let mut it = 0;
    let first = *cands.first()?;
    if !blocks[first].expandable {
        return Some(blocks[first].ptr.0);
    }
    if !expandable_on {
        return cands
            .iter()
            .find(|&&i| !blocks[i].expandable)
            .map(|&i| blocks[i].ptr.0);
    }
    let es = |i: usize| blocks[i].size + grow(i);
    while blocks[cands[it]].expandable && it + 1 < cands.len() && es(cands[it + 1]) < es(cands[it])
    {
        it += 1;
    }
    Some(blocks[cands[it]].ptr.0)
}

#[derive(Clone, Copy, Debug)]
enum BOp {
    Alloc(u64, usize),
    Free(usize),
    Write(usize),
    Drain,
    Advance(usize, usize),
    EmptyCache,
    Reclaim(bool),
}

fn gen_bops(seed: u64, n: usize, toggles: bool) -> Vec<BOp> {
    let mut r = Rng(seed.wrapping_mul(0xD1B54A32D192ED03) | 1);
    (0..n)
        .map(|_| match r.below(100) {
            0..=44 => {
                let bytes = match r.below(5) {
                    0 => (1 + r.below(1024)) * 1024,
                    1 | 2 => (1 + r.below(6)) * 2 * MIB,
                    _ => (1 + r.below(24)) * MIB - 512 * r.below(2),
                };
                BOp::Alloc(bytes, r.below(2) as usize)
            }
            45..=79 => BOp::Free(r.next() as usize),
            80..=86 => BOp::Write(r.next() as usize),
            87..=90 => BOp::Advance(r.below(2) as usize, r.below(8) as usize),
            91..=93 => BOp::Drain,
            94..=97 if toggles => BOp::Reclaim(r.below(2) == 0),
            _ => BOp::EmptyCache,
        })
        .collect()
}

/// Runs `ops`, checking every allocation that best fit serves against the model.
/// Returns (checked predictions, predictions where the two rules disagree).
fn run_model(conf: &str, completion: Completion, ops: &[BOp]) -> R<(u64, u64)> {
    let mut t = H::new(16 * GIB, conf, completion, 2);
    let (mut checked, mut differ) = (0, 0);
    for (i, op) in ops.iter().enumerate() {
        let n = t.live.len();
        let res: R<()> = match *op {
            BOp::Alloc(b, s) => {
                let stream = t.streams[s];
                let cfg = t.a.config();
                let blocks = t.a.blocks();
                let tail_only = cfg.expandable.reclaim;
                let want = predict(&blocks, b, stream, cfg.expandable.enabled, tail_only);
                let other = predict(&blocks, b, stream, cfg.expandable.enabled, !tail_only);
                match t.alloc(b, stream)? {
                    Some(x) => match want {
                        Some(p) if p != x.ptr.0 => Err(format!(
                            "best fit for {b} on stream {s} (tail_only {tail_only}) gave {:#x}, model {:#x} (other rule {:x?})",
                            x.ptr.0, p, other
                        )),
                        Some(_) => {
                            checked += 1;
                            differ += u64::from(want != other);
                            Ok(())
                        }
                        None => Ok(()),
                    },
                    None => Ok(()),
                }
            }
            BOp::Free(p) if n > 0 => t.free_at(p % n, true),
            BOp::Write(p) if n > 0 => {
                t.retag(p % n);
                Ok(())
            }
            BOp::Drain => {
                t.fake.advance_all();
                Ok(())
            }
            BOp::Advance(s, k) => {
                t.fake.advance(t.streams[s], Some(k)).unwrap();
                Ok(())
            }
            BOp::EmptyCache => {
                t.a.empty_cache();
                Ok(())
            }
            BOp::Reclaim(on) => {
                t.a.update_config(&format!("expandable_segments_reclaim:{}", py(on)))
                    .map_err(|e| e.to_string())
            }
            _ => Ok(()),
        };
        res.and_then(|()| t.inv())
            .map_err(|e| format!("step {i} {op:?}: {e}"))?;
    }
    t.finish()?;
    Ok((checked, differ))
}

fn model_seeds(
    conf: &str,
    completion: Completion,
    toggles: bool,
    seeds: std::ops::Range<u64>,
) -> (u64, u64) {
    let seeds = scaled(seeds);
    let (mut c, mut d) = (0, 0);
    for seed in seeds {
        let ops = gen_bops(seed, 160, toggles);
        match run_model(conf, completion, &ops) {
            Ok((a, b)) => {
                c += a;
                d += b;
            }
            Err(e) => {
                let min = shrink(&ops, |o| run_model(conf, completion, o).is_err());
                let why = run_model(conf, completion, &min).unwrap_err();
                panic!(
                    "{conf} seed {seed}: {e}\nminimal ({} ops): {min:?}\n=> {why}",
                    min.len()
                );
            }
        }
    }
    eprintln!("{conf} {completion:?}: {c} predictions checked, {d} where the rules differ");
    (c, d)
}

#[test]
fn best_fit_plain_follows_pytorch_rule() {
    let (c, d) = model_seeds(PLAIN, Completion::Eager, false, 0..40);
    assert!(c > 1000 && d > 0, "coverage: {c} checked, {d} differing");
}

#[test]
fn best_fit_reclaim_eager_tail_only() {
    let (c, d) = model_seeds(RECLAIM, Completion::Eager, false, 0..40);
    assert!(c > 1000 && d > 0, "coverage: {c} checked, {d} differing");
}

#[test]
fn best_fit_reclaim_manual_and_toggles() {
    let (c, _) = model_seeds(RECLAIM, Completion::Manual, true, 0..30);
    let (c2, _) = model_seeds(PLAIN, Completion::Manual, true, 30..60);
    assert!(c > 500 && c2 > 500);
}
