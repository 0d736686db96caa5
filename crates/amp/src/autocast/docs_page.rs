//! The op-policy docs page (`docs/amp_op_policies.md`), generated from the tables so that it
//! cannot drift from them (PyTorch's hand-written lists do, see [`docs_drift`]).
use std::fmt::Write;

use super::device::DeviceKind;
use super::docs_lists::{DocsDrift, docs_drift};
use super::policy::{CastPolicy, OpId, all_listed_ops, listed_ops, policy};

/// The device kinds with a table, in the page's column order.
const COLUMNS: [DeviceKind; 6] = [
    DeviceKind::Cuda,
    DeviceKind::Cpu,
    DeviceKind::Xpu,
    DeviceKind::Mtia,
    DeviceKind::Maia,
    DeviceKind::Mps,
];

const LEGEND: &str = "\
| policy | what autocast does with the op's tensor arguments |
| --- | --- |
| `lower_precision_fp` | casts every eligible argument to the region's dtype (fp16 or bf16) |
| `fp32` | casts every eligible argument to fp32 |
| `fp32_set_opt_dtype` | casts nothing; if the first argument is eligible and the caller gave no `dtype`, passes `dtype=float32` |
| `fp32_append_dtype` | calls the named dtype-taking overload with fp32 (first argument eligible) or the first argument's dtype appended |
| `promote` | casts every eligible argument to the widest floating type among them (fp32 if any is fp32, else the region's dtype) |
| `cudnn_rnn_fp16` | casts every eligible argument to fp16 whatever the region's dtype (PyTorch's `_cudnn_rnn` wrapper hard-codes it) |
| `banned` | refuses to run under autocast, with PyTorch's message |

Eligible = floating point, not float64, on the region's device (XLA tensors count for CUDA).
Ops not listed run as their inputs are.
";

/// The whole page, as committed in `docs/amp_op_policies.md`.
pub fn op_policy_page() -> String {
    let mut page = String::new();
    page.push_str(
        "# Autocast op policies per device\n\n\
         <!-- Generated from crates/amp/src/autocast/tables.rs; do not edit. Regenerate with\n\
         `FERROCUDA_BLESS=1 cargo test -p ferrocuda-amp --test amp_scenarios op_policy_page`. -->\n\n\
         PyTorch 2.15's autocast registrations (`aten/src/ATen/autocast_mode.{h,cpp}`,\n\
         `aten/src/ATen/mps/MPSAutocast.cpp`, `aten/src/ATen/cudnn/AutocastRNN.cpp`) as\n\
         `ferrocuda::amp::autocast` applies them. HPU, XLA, IPU and PrivateUse1 register no ops\n\
         in the stock build (their out-of-tree packages bring their own lists).\n\n",
    );
    page.push_str("## Policies\n\n");
    page.push_str(LEGEND);
    write_counts(&mut page);
    write_ops(&mut page);
    write_drift(&mut page, &docs_drift());
    page
}

fn write_counts(page: &mut String) {
    const KINDS: [&str; 7] = [
        "lower_precision_fp",
        "fp32",
        "fp32_set_opt_dtype",
        "fp32_append_dtype",
        "promote",
        "cudnn_rnn_fp16",
        "banned",
    ];
    page.push_str("\n## Counts\n\n| device | ops |");
    for k in KINDS {
        let _ = write!(page, " `{k}` |");
    }
    page.push_str("\n| --- | ---: |");
    page.push_str(&" ---: |".repeat(KINDS.len()));
    page.push('\n');
    for d in COLUMNS {
        let ops: Vec<CastPolicy> = listed_ops(d).map(|(_, p)| p).collect();
        let _ = write!(page, "| {d} | {} |", ops.len());
        for k in KINDS {
            let _ = write!(page, " {} |", ops.iter().filter(|p| p.name() == k).count());
        }
        page.push('\n');
    }
}

fn cell(p: Option<CastPolicy>) -> String {
    match p {
        None => "·".to_owned(),
        Some(CastPolicy::Fp32AppendDtype { redispatch }) => {
            format!("fp32_append_dtype → `{redispatch}`")
        }
        Some(p) => p.name().to_owned(),
    }
}

fn write_ops(page: &mut String) {
    page.push_str("\n## Every op\n\n`·` = not listed on that device (runs as is).\n\n| op |");
    for d in COLUMNS {
        let _ = write!(page, " {d} |");
    }
    page.push_str("\n| --- |");
    page.push_str(&" --- |".repeat(COLUMNS.len()));
    page.push('\n');
    for name in all_listed_ops() {
        let _ = write!(page, "| `{name}` |");
        for d in COLUMNS {
            let p = OpId::resolve(name).and_then(|op| policy(d, op));
            let _ = write!(page, " {} |", cell(p));
        }
        page.push('\n');
    }
}

fn write_drift(page: &mut String, drift: &[DocsDrift]) {
    page.push_str(
        "\n## Where PyTorch's documentation lists differ\n\n\
         PyTorch's `docs/source/amp.md` lists Python-facing names and leaves out overloads\n\
         and internal ops. Names are compared without the overload; `fp32` includes the\n\
         set-opt-dtype and append-dtype policies. MTIA, MAIA and MPS have no doc lists.\n\n\
         | device | docs section | only in the docs | only in the source | listed twice in the docs |\n\
         | --- | --- | --- | --- | --- |\n",
    );
    let list = |names: &[&str]| {
        if names.is_empty() {
            "—".to_owned()
        } else {
            names
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    for d in drift {
        let _ = writeln!(
            page,
            "| {} | {:?} | {} | {} | {} |",
            d.device,
            d.class,
            list(&d.docs_only),
            list(&d.source_only),
            list(&d.docs_duplicates)
        );
    }
}
