//! PyTorch 2.11's autocast lists, as what changed since (`tables` holds 2.15's): 2.11 still
//! registers the `Dimname` overloads of the set-opt-dtype ops and of `norm` on every device
//! but CPU (MPS registers the former as plain fp32), and CPU's `cholesky`, `qr`,
//! `prod.dim_Dimname` (fp32) and `index_copy.dimname` (promote); it does not register
//! `rms_norm` (fp32 in a later release) or `linalg_matrix_sqrth` (new in 2.15).
//!
//! The membership per device is checked against what PyTorch 2.11 registers under each
//! Autocast dispatch key (`crates/amp/tests/data/autocast_registrations_2.11.json`, dumped
//! from the installed 2.11); the policies are 2.11's `autocast_mode.h`/`.cpp` (the
//! `Dimname` ops give fp32 results and keep an explicit dtype under CUDA autocast in 2.11,
//! and CPU's `cholesky`, `qr`, `prod.dim_Dimname` give fp32 under bf16 autocast, checked on
//! the GPU machine).
use super::device::DeviceKind;
use super::tables::{CPU, CUDA, CastPolicy, DeviceRules, MPS, Rule, SHARED_WITH_BAN};

/// The `Dimname` overloads `AT_FORALL_FP32_SET_OPT_DTYPE` lists in 2.11.
const DIMNAME_SET_OPT_DTYPE: &[&str] = &[
    "prod.dim_Dimname",
    "softmax.Dimname",
    "log_softmax.Dimname",
    "cumprod.dimname",
    "cumsum.dimname",
    "sum.dim_DimnameList",
];

/// What 2.11's shared lists have that 2.15's do not.
const SHARED_DIMNAME: &[Rule] = &[
    Rule::Add(CastPolicy::Fp32SetOptDtype, DIMNAME_SET_OPT_DTYPE),
    // AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE
    Rule::Add(
        CastPolicy::Fp32AppendDtype {
            redispatch: "norm.names_ScalarOpt_dim_dtype",
        },
        &["norm.names_ScalarOpt_dim"],
    ),
];

/// XPU, MTIA and MAIA (123 each).
const SHARED_WITH_BAN_2_11: &[Rule] = &[
    Rule::Include(SHARED_WITH_BAN),
    Rule::Remove(&["rms_norm"]),
    Rule::Include(SHARED_DIMNAME),
];

/// `AutocastCUDA` (126).
const CUDA_2_11: &[Rule] = &[
    Rule::Include(CUDA),
    Rule::Remove(&["rms_norm", "linalg_matrix_sqrth"]),
    Rule::Include(SHARED_DIMNAME),
];

/// `AutocastCPU` (129).
const CPU_2_11: &[Rule] = &[
    Rule::Include(CPU),
    Rule::Remove(&["linalg_matrix_sqrth"]),
    Rule::Add(CastPolicy::Fp32, &["cholesky", "qr", "prod.dim_Dimname"]),
    Rule::Add(CastPolicy::Promote, &["index_copy.dimname"]),
];

/// `AutocastMPS` (101).
const MPS_2_11: &[Rule] = &[
    Rule::Include(MPS),
    Rule::Add(CastPolicy::Fp32, DIMNAME_SET_OPT_DTYPE),
];

/// Every device kind with a table in the stock 2.11 build.
pub(crate) const DEVICES_2_11: &[DeviceRules] = &[
    DeviceRules {
        device: DeviceKind::Cuda,
        rules: CUDA_2_11,
    },
    DeviceRules {
        device: DeviceKind::Cpu,
        rules: CPU_2_11,
    },
    DeviceRules {
        device: DeviceKind::Xpu,
        rules: SHARED_WITH_BAN_2_11,
    },
    DeviceRules {
        device: DeviceKind::Mtia,
        rules: SHARED_WITH_BAN_2_11,
    },
    DeviceRules {
        device: DeviceKind::Maia,
        rules: SHARED_WITH_BAN_2_11,
    },
    DeviceRules {
        device: DeviceKind::Mps,
        rules: MPS_2_11,
    },
];
