//! `cast_inputs` per op call: the policy lookup plus the per-argument decision, with the
//! op resolved to an `OpId` once (the intended use) and by name.
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use ferrocuda_amp::autocast::{
    Autocast, AutocastArg, DeviceKind, OpId, cast_inputs, cast_inputs_by_name,
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

criterion_group!(benches, bench);
criterion_main!(benches);
