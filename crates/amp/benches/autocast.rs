//! `cast_inputs` per op call: the policy lookup plus the per-argument decision, with the
//! op resolved to an `OpId` once (the intended use) and by name; and the scope guards
//! entered and dropped in order (the common path: a region per forward, a redispatch guard
//! per listed op).
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use ferrocuda_amp::autocast::{
    Autocast, AutocastArg, DeviceKind, OpId, RedispatchGuard, cast_inputs, cast_inputs_by_name,
};
use ferrocuda_types::DType;

struct Arg(DType);

impl AutocastArg for Arg {
    fn dtype(&self) -> DType {
        self.0
    }
    fn device_kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }
    fn is_leaf_requiring_grad(&self) -> bool {
        false
    }
    fn identity(&self) -> u64 {
        0
    }
    fn version(&self) -> u64 {
        0
    }
}

fn bench(c: &mut Criterion) {
    let Ok(_region) = Autocast::new(DeviceKind::Cuda).enter() else {
        return;
    };
    let args = [Arg(DType::F32), Arg(DType::F32), Arg(DType::F16)];
    let ops: Vec<OpId> = ["addmm", "softmax.int", "cat", "addcmul", "exp", "add"]
        .iter()
        .filter_map(|n| OpId::resolve(n))
        .collect();
    let mut g = c.benchmark_group("cast_inputs");
    g.bench_function("op_id_3_args", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % ops.len();
            let plan = cast_inputs(DeviceKind::Cuda, black_box(ops[i]), &args);
            black_box(plan.map(|p| args.iter().filter_map(|a| p.target(a)).count()))
        })
    });
    g.bench_function("by_name_3_args", |b| {
        b.iter(|| {
            black_box(cast_inputs_by_name(
                DeviceKind::Cuda,
                black_box("addmm"),
                &args,
            ))
        })
    });
    g.bench_function("unlisted_by_name", |b| {
        b.iter(|| {
            black_box(cast_inputs_by_name(
                DeviceKind::Cuda,
                black_box("add"),
                &args,
            ))
        })
    });
    g.finish();
}

fn guards(c: &mut Criterion) {
    let region = Autocast::new(DeviceKind::Cuda);
    let mut g = c.benchmark_group("guards");
    g.bench_function("region_enter_drop", |b| {
        b.iter(|| black_box(region.enter().map(drop)))
    });
    g.bench_function("redispatch_new_drop", |b| {
        b.iter(|| drop(black_box(RedispatchGuard::new(black_box(DeviceKind::Cuda)))))
    });
    let Ok(_outer) = region.enter() else {
        return;
    };
    g.bench_function("redispatch_in_region_3_deep", |b| {
        b.iter(|| {
            let a = RedispatchGuard::new(DeviceKind::Cuda);
            let b = RedispatchGuard::new(DeviceKind::Cpu);
            let c = RedispatchGuard::new(DeviceKind::Cuda);
            drop(black_box(c));
            drop(black_box(b));
            drop(black_box(a));
        })
    });
    g.finish();
}

criterion_group!(benches, bench, guards);
criterion_main!(benches);
