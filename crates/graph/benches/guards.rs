//! Guard evaluation on the hot path: one entry over 8 inputs of rank 2-4 with the global
//! state read and compared (issue 14's target: 50 ns), its parts, and a cache lookup that
//! hits the 3rd of 4 entries.
use std::convert::Infallible;
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use ferrocuda_graph::guards::{
    CacheConfig, GlobalState, GuardSet, GuardedCache, LibraryState, Specialization, TensorGuard,
    TensorMeta,
};
use ferrocuda_types::{DType, DeviceIndex};

/// Sizes and strides of 8 contiguous inputs of rank 2, 3 and 4, with a batch dim `batch`.
fn shapes(batch: i64) -> Vec<(Vec<i64>, Vec<i64>)> {
    let dims: [&[i64]; 8] = [
        &[batch, 512],
        &[batch, 8, 64],
        &[batch, 8, 16, 64],
        &[512, 512],
        &[batch, 512],
        &[batch, 8, 64],
        &[batch, 8, 16, 64],
        &[512, 2048],
    ];
    dims.iter()
        .map(|d| {
            let mut strides = vec![1; d.len()];
            for i in (0..d.len().saturating_sub(1)).rev() {
                strides[i] = strides[i + 1] * d[i + 1];
            }
            (d.to_vec(), strides)
        })
        .collect()
}

fn metas(shapes: &[(Vec<i64>, Vec<i64>)]) -> Vec<TensorMeta<'_>> {
    shapes
        .iter()
        .enumerate()
        .filter_map(|(i, (s, st))| {
            let dtype = if i % 2 == 0 { DType::F16 } else { DType::F32 };
            TensorMeta::new(dtype, DeviceIndex(0), i == 3, s, st).ok()
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let lib = LibraryState::default();
    let globals = GlobalState::current(lib);
    let shapes8 = shapes(8);
    let inputs = metas(&shapes8);
    let spec = Specialization::new(inputs.iter().map(TensorGuard::exact).collect(), globals);
    let flat = GuardSet::new(&spec);

    let mut g = c.benchmark_group("guards");
    g.bench_function("entry_8_inputs_with_global_read", |b| {
        b.iter(|| {
            let now = GlobalState::current(black_box(lib));
            black_box(flat.check(black_box(&inputs), &now))
        })
    });
    g.bench_function("entry_8_inputs_global_given", |b| {
        b.iter(|| black_box(flat.check(black_box(&inputs), black_box(&globals))))
    });
    g.bench_function("global_state_read", |b| {
        b.iter(|| black_box(GlobalState::current(black_box(lib))))
    });

    // Four entries at batch 1, 2, 4, 8, inserted in that order.
    let batches = [1, 2, 4, 8];
    let all: Vec<_> = batches.iter().map(|b| shapes(*b)).collect();
    let config = CacheConfig {
        automatic_dynamic_shapes: false,
        ..CacheConfig::default()
    };
    let mut cache: GuardedCache<u32> = GuardedCache::new("step", config);
    for (n, s) in all.iter().enumerate() {
        let _ = cache.call(&metas(s), &globals, |_| Ok::<_, Infallible>(n as u32));
    }
    // MRU order is [8, 4, 2, 1]; hitting the 3rd (2) gives [2, 8, 4, 1], then the 3rd is 4:
    // [4, 2, 8, 1], then 8: [8, 4, 2, 1] again. So the cycle 2, 4, 8 always hits the 3rd.
    let cycle: Vec<Vec<TensorMeta<'_>>> = [1, 2, 3].iter().map(|i| metas(&all[*i])).collect();
    let order = |cache: &GuardedCache<u32>| {
        cache
            .entries()
            .filter_map(|e| cache.value(e).copied())
            .collect::<Vec<_>>()
    };
    let before = order(&cache);
    for metas in &cycle {
        let third = cache.entries().nth(2);
        assert_eq!(cache.lookup(metas, &globals).map(|(e, _)| e), third);
    }
    assert_eq!(order(&cache), before);
    let mut k = 2;
    g.bench_function("lookup_hits_3rd_of_4", |b| {
        b.iter(|| {
            k = (k + 1) % 3;
            let now = GlobalState::current(black_box(lib));
            black_box(cache.lookup(black_box(&cycle[k]), &now).map(|(e, _)| e))
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
