//! Autocast through its public API, in the spirit of PyTorch's `test/test_autocast.py`,
//! `test/test_cuda.py` autocast tests and the verified quirks of PyTorch 2.15.
use std::cell::Cell;
use std::error::Error;

use ferrocuda_amp::autocast::{
    Autocast, AutocastArg, AutocastError, BINARY_CROSS_ENTROPY_BANNED, CastPlan, CastPolicy,
    DeviceKind, OpId, cast_inputs_by_name, is_eligible, listed_ops, policy_by_name,
};
use ferrocuda_types::DType;

type TestResult = Result<(), Box<dyn Error>>;

use DType::{BF16, F16, F32, F64, I32, I64};
use DeviceKind::{Cpu, Cuda, Maia, Mps, Mtia, Xla, Xpu};

/// A tensor as autocast sees it.
#[derive(Clone, Debug)]
struct T {
    dtype: DType,
    device: DeviceKind,
    param: bool,
    id: u64,
    version: Cell<u64>,
}

fn t(dtype: DType, device: DeviceKind) -> T {
    T {
        dtype,
        device,
        param: false,
        id: 0,
        version: Cell::new(0),
    }
}

impl AutocastArg for T {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn device_kind(&self) -> DeviceKind {
        self.device
    }
    fn is_leaf_requiring_grad(&self) -> bool {
        self.param
    }
    fn identity(&self) -> u64 {
        self.id
    }
    fn version(&self) -> u64 {
        self.version.get()
    }
}

fn targets(plan: &CastPlan, args: &[T]) -> Vec<Option<DType>> {
    plan.targets(args).collect()
}

fn plan(device: DeviceKind, op: &str, args: &[T]) -> Result<CastPlan, AutocastError> {
    cast_inputs_by_name(device, op, args)
}

#[test]
fn op_counts_per_device_are_pytorch_2_15() {
    let count = |d| listed_ops(d).count();
    assert_eq!(count(Cuda), 121);
    assert_eq!(count(Cpu), 126);
    assert_eq!(count(Xpu), 117);
    assert_eq!(count(Mtia), 117);
    assert_eq!(count(Maia), 117);
    assert_eq!(count(Mps), 95);
    for d in [
        DeviceKind::Hpu,
        Xla,
        DeviceKind::Ipu,
        DeviceKind::PrivateUse1,
    ] {
        assert_eq!(count(d), 0, "{d} registers out of tree");
    }
    let by_policy = |d, name: &str| listed_ops(d).filter(|(_, p)| p.name() == name).count();
    let cuda: Vec<usize> = [
        "lower_precision_fp",
        "fp32",
        "fp32_set_opt_dtype",
        "fp32_append_dtype",
        "promote",
        "cudnn_rnn_fp16",
        "banned",
    ]
    .iter()
    .map(|k| by_policy(Cuda, k))
    .collect();
    assert_eq!(cuda, [35, 60, 11, 2, 11, 1, 1]);
    assert_eq!(by_policy(Cpu, "lower_precision_fp"), 24);
    assert_eq!(by_policy(Cpu, "fp32"), 99);
    assert_eq!(by_policy(Cpu, "promote"), 3);
    assert_eq!(by_policy(Mps, "lower_precision_fp"), 27);
    assert_eq!(by_policy(Mps, "fp32"), 58);
    assert_eq!(by_policy(Mps, "promote"), 10);
}

#[test]
fn xpu_mtia_maia_share_one_list_and_cuda_adds_five() {
    let xpu: Vec<_> = listed_ops(Xpu).collect();
    assert_eq!(listed_ops(Mtia).collect::<Vec<_>>(), xpu);
    assert_eq!(listed_ops(Maia).collect::<Vec<_>>(), xpu);
    let extra: Vec<&str> = listed_ops(Cuda)
        .filter(|op| !xpu.contains(op))
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        extra,
        [
            "_cudnn_rnn",
            "cudnn_convolution",
            "cudnn_convolution_transpose",
            "linalg_matrix_sqrth"
        ]
    );
    assert!(xpu.iter().all(|op| listed_ops(Cuda).any(|c| c == *op)));
}

#[test]
fn policy_per_op_and_device() {
    use CastPolicy::*;
    let banned = Banned {
        message: BINARY_CROSS_ENTROPY_BANNED,
    };
    let cases: &[(&str, DeviceKind, Option<CastPolicy>)] = &[
        ("mm", Cuda, Some(LowerPrecision)),
        ("mm", Cpu, Some(LowerPrecision)),
        ("conv1d.padding", Cpu, Some(LowerPrecision)),
        ("conv1d.padding", Cuda, None),
        ("_mps_convolution", Mps, Some(LowerPrecision)),
        ("softmax.int", Cuda, Some(Fp32SetOptDtype)),
        ("softmax.int", Cpu, None),
        ("softmax.int", Mps, Some(Fp32)),
        ("layer_norm", Cpu, None),
        ("prod", Cpu, Some(Fp32)),
        ("rms_norm", Cuda, Some(Fp32)),
        ("rms_norm", Mps, None),
        ("upsample_nearest2d", Xpu, Some(Fp32)),
        ("upsample_nearest2d", Mps, None),
        ("batch_norm", Mps, Some(Fp32)),
        ("batch_norm", Cuda, None),
        (
            "norm.Scalar",
            Cuda,
            Some(Fp32AppendDtype {
                redispatch: "norm.ScalarOpt_dtype",
            }),
        ),
        (
            "norm.ScalarOpt_dim",
            Maia,
            Some(Fp32AppendDtype {
                redispatch: "norm.ScalarOpt_dim_dtype",
            }),
        ),
        ("norm.ScalarOpt_dtype", Cuda, None),
        ("norm.Scalar", Mps, None),
        ("cat", Cpu, Some(Promote)),
        ("cat", Cuda, None),
        ("vdot", Cuda, Some(Promote)),
        ("vdot", Mps, None),
        ("binary_cross_entropy", Cuda, Some(banned)),
        ("binary_cross_entropy", Mtia, Some(banned)),
        ("binary_cross_entropy", Cpu, Some(Fp32)),
        ("binary_cross_entropy", Mps, None),
        ("_cudnn_rnn", Cuda, Some(CudnnRnnFp16)),
        ("linalg_matrix_sqrth", Cuda, Some(Fp32)),
        ("linalg_matrix_sqrth", Cpu, Some(Fp32)),
        ("linalg_matrix_sqrth", Xpu, None),
        ("_scaled_mm", Cuda, None),
        ("_grouped_mm", Cuda, None),
        ("addmm_", Cuda, None),
        ("no_such_op", Cuda, None),
    ];
    for (op, d, expected) in cases {
        assert_eq!(policy_by_name(*d, op), *expected, "{op} on {d}");
    }
}

#[test]
fn pytorch_docs_lists_drift_is_pinned() -> TestResult {
    use ferrocuda_amp::autocast::{DocsClass, docs_drift};
    let drift = docs_drift();
    let find = |d: DeviceKind, c: DocsClass| drift.iter().find(|x| x.device == d && x.class == c);
    let cuda_lp = find(Cuda, DocsClass::LowerPrecision).ok_or("no CUDA docs list")?;
    assert_eq!(
        cuda_lp.docs_only,
        ["GRUCell", "LSTMCell", "RNNCell", "__matmul__", "multi_dot"]
    );
    assert_eq!(
        cuda_lp.source_only,
        [
            "_convolution",
            "_convolution.deprecated",
            "_cudnn_rnn",
            "_scaled_dot_product_flash_attention",
            "_thnn_fused_gru_cell",
            "_thnn_fused_lstm_cell",
            "conv_tbc",
            "convolution",
            "cudnn_convolution",
            "cudnn_convolution_transpose",
            "einsum",
            "gru_cell",
            "linalg_multi_dot",
            "linalg_vecdot",
            "lstm_cell",
            "rnn_relu_cell",
            "rnn_tanh_cell",
            "scaled_dot_product_attention",
        ]
    );
    let check = |d, c, docs_only: &[&str], source_only: &[&str], twice: &[&str]| {
        let Some(x) = find(d, c) else {
            return Some(format!("no docs list for {d} {c:?}"));
        };
        (x.docs_only != docs_only || x.source_only != source_only || x.docs_duplicates != twice)
            .then(|| format!("{d} {c:?}: {x:?}"))
    };
    let problems: Vec<String> = [
        check(
            Cuda,
            DocsClass::Fp32,
            &[
                "__pow__",
                "__rdiv__",
                "__rpow__",
                "__rtruediv__",
                "cross_entropy",
                "normalize",
                "softmin",
            ],
            &[
                "_upsample_bicubic2d_aa",
                "_upsample_bilinear2d_aa",
                "_upsample_nearest_exact1d",
                "_upsample_nearest_exact2d",
                "_upsample_nearest_exact3d",
                "frobenius_norm.dim",
                "huber_loss",
                "linalg_matrix_norm",
                "linalg_matrix_norm.str_ord",
                "linalg_matrix_sqrth",
                "linalg_vector_norm",
                "logsumexp",
                "native_layer_norm",
                "nll_loss2d",
                "nuclear_norm",
                "nuclear_norm.dim",
                "rms_norm",
                "upsample_bicubic2d",
                "upsample_bilinear2d",
                "upsample_linear1d",
                "upsample_nearest1d",
                "upsample_nearest2d",
                "upsample_nearest3d",
                "upsample_trilinear3d",
            ],
            &[],
        ),
        check(
            Cuda,
            DocsClass::Promote,
            &["grid_sample"],
            &["grid_sampler", "vdot"],
            &[],
        ),
        check(
            Cpu,
            DocsClass::LowerPrecision,
            // The docs spell the op `onednn_rnn_layer`; the `.padding` overloads match by name.
            &["onednn_rnn_layer"],
            &["_addmm_activation", "mkldnn_rnn_layer"],
            &[],
        ),
        check(
            Cpu,
            DocsClass::Fp32,
            // `cholesky` and `qr` were deleted in 2.15; the docs also forget `smooth_l1_loss`.
            &["cholesky", "qr"],
            &["linalg_matrix_sqrth", "smooth_l1_loss"],
            &["inverse"],
        ),
        check(Cpu, DocsClass::Promote, &[], &[], &[]),
    ]
    .into_iter()
    .flatten()
    .collect();
    assert_eq!(problems, Vec::<String>::new());
    let xpu_fp32 = find(Xpu, DocsClass::Fp32).ok_or("no XPU docs list")?;
    // The docs' XPU lists are a subset; the source runs the full shared lists.
    for op in ["acos", "expm1", "rms_norm", "logsumexp", "cumprod", "prod"] {
        assert!(
            xpu_fp32.source_only.iter().any(|s| s.starts_with(op)),
            "{op}"
        );
    }
    Ok(())
}

#[test]
fn lower_precision_casts_eligible_args_only() -> TestResult {
    let _r = Autocast::new(Cuda).enter()?;
    let args = [
        t(F32, Cuda),
        t(F16, Cuda),
        t(F64, Cuda),
        t(I64, Cuda),
        t(F32, Cpu),
        t(F32, Xla),
        t(BF16, Cuda),
    ];
    let p = plan(Cuda, "mm", &args)?;
    assert_eq!(
        targets(&p, &args),
        [Some(F16), None, None, None, None, Some(F16), Some(F16)]
    );
    for (a, tgt) in args.iter().zip(targets(&p, &args)) {
        assert_eq!(is_eligible(Cuda, a) && a.dtype != F16, tgt.is_some());
    }
    Ok(())
}

#[test]
fn fp16_under_bf16_lower_precision_becomes_bf16() -> TestResult {
    let _r = Autocast::new(Cpu).dtype(BF16).enter()?;
    let args = [t(F16, Cpu), t(F16, Cpu)];
    assert_eq!(targets(&plan(Cpu, "mm", &args)?, &args), [Some(BF16); 2]);
    Ok(())
}

#[test]
fn nothing_happens_when_disabled_or_unlisted() -> TestResult {
    let args = [t(F32, Cuda)];
    assert_eq!(plan(Cuda, "mm", &args)?, CastPlan::RunAsIs);
    assert_eq!(
        plan(Cuda, "binary_cross_entropy", &args)?,
        CastPlan::RunAsIs
    );
    let _r = Autocast::new(Cuda).enter()?;
    assert_eq!(plan(Cpu, "mm", &[t(F32, Cpu)])?, CastPlan::RunAsIs);
    for op in ["add", "addmm_", "_scaled_mm", "eq"] {
        assert_eq!(plan(Cuda, op, &args)?, CastPlan::RunAsIs, "{op}");
    }
    Ok(())
}

#[test]
fn fp32_policy_upcasts_lower_precision_and_leaves_fp64() -> TestResult {
    let _r = Autocast::new(Cuda).enter()?;
    let args = [t(F16, Cuda), t(F32, Cuda), t(F64, Cuda), t(I32, Cuda)];
    let p = plan(Cuda, "cdist", &args)?;
    assert_eq!(targets(&p, &args), [Some(F32), None, None, None]);
    Ok(())
}

#[test]
fn set_opt_dtype_fills_only_an_unset_dtype_of_an_eligible_first_arg() -> TestResult {
    let _r = Autocast::new(Cuda).enter()?;
    let p = plan(Cuda, "softmax.int", &[t(F16, Cuda)])?;
    assert_eq!(p, CastPlan::SetOptDtype { dtype: F32 });
    assert_eq!(targets(&p, &[t(F16, Cuda)]), [None]);
    assert_eq!(p.dtype_arg(None), Some(F32));
    assert_eq!(p.dtype_arg(Some(F16)), Some(F16), "an explicit dtype wins");
    for first in [t(F64, Cuda), t(I64, Cuda), t(F16, Cpu)] {
        let p = plan(Cuda, "sum", &[first])?;
        assert_eq!(p, CastPlan::RunAsIs);
        assert_eq!(p.dtype_arg(None), None);
    }
    let _c = Autocast::new(Cpu).enter()?;
    assert_eq!(
        plan(Cpu, "softmax.int", &[t(BF16, Cpu)])?,
        CastPlan::RunAsIs
    );
    Ok(())
}

#[test]
fn append_dtype_redispatches_with_fp32_or_the_first_dtype() -> TestResult {
    let _r = Autocast::new(Cuda).enter()?;
    let p = plan(Cuda, "norm.Scalar", &[t(F16, Cuda)])?;
    assert_eq!(
        p,
        CastPlan::AppendDtype {
            dtype: F32,
            redispatch: "norm.ScalarOpt_dtype"
        }
    );
    let p = plan(Cuda, "norm.ScalarOpt_dim", &[t(F64, Cuda)])?;
    assert_eq!(
        p,
        CastPlan::AppendDtype {
            dtype: F64,
            redispatch: "norm.ScalarOpt_dim_dtype"
        }
    );
    Ok(())
}

#[test]
fn promote_takes_the_widest_and_ignores_ints_and_doubles() -> TestResult {
    let _r = Autocast::new(Cuda).enter()?;
    let mixed = [t(F16, Cuda), t(F32, Cuda), t(I64, Cuda)];
    assert_eq!(
        targets(&plan(Cuda, "index_put", &mixed)?, &mixed),
        [Some(F32), None, None]
    );
    let low = [t(F16, Cuda), t(F16, Cuda)];
    assert_eq!(targets(&plan(Cuda, "dot", &low)?, &low), [None, None]);
    let _c = Autocast::new(Cpu).enter()?;
    let with_int = [t(I64, Cpu), t(BF16, Cpu)];
    assert_eq!(
        plan(Cpu, "cat", &with_int)?,
        CastPlan::Cast {
            device: Cpu,
            to: BF16,
            cacheable: true
        }
    );
    let with_double = [t(F64, Cpu), t(BF16, Cpu)];
    assert_eq!(
        targets(&plan(Cpu, "cat", &with_double)?, &with_double),
        [None, None]
    );
    Ok(())
}

#[test]
fn mixed_lower_precision_promote_names_op_and_dtypes() -> TestResult {
    let _r = Autocast::new(Cpu).dtype(BF16).enter()?;
    let e = plan(Cpu, "cat", &[t(F16, Cpu), t(F16, Cpu)]);
    assert_eq!(
        e,
        Err(AutocastError::MixedLowerPrecision {
            op: "cat",
            device: Cpu,
            autocast_dtype: BF16,
            found: F16
        })
    );
    let msg = e.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        msg.contains("`cat`") && msg.contains("F16") && msg.contains("BF16"),
        "{msg}"
    );
    // PyTorch's fold is order-dependent: once fp32 is seen, fp16 no longer matters.
    assert!(plan(Cpu, "cat", &[t(F32, Cpu), t(F16, Cpu)]).is_ok());
    assert!(plan(Cpu, "cat", &[t(F16, Cpu), t(F32, Cpu)]).is_err());
    Ok(())
}

/// PyTorch's `prioritize` + `cached_cast` as written in `autocast_mode.h`, for a
/// differential test on random argument lists.
fn reference_promote(dev: DeviceKind, lp: DType, args: &[T]) -> Option<Vec<Option<DType>>> {
    let floating = |d: DType| matches!(d, F16 | BF16 | F32 | F64);
    let on = |a: &T| a.device == dev || (dev == Cuda && a.device == Xla);
    let mut cur = lp;
    for a in args {
        if on(a) && floating(a.dtype) {
            if a.dtype == F64 {
                continue;
            } else if cur == F32 || a.dtype == F32 {
                cur = F32;
            } else if cur == lp && a.dtype == lp {
            } else {
                return None;
            }
        }
    }
    Some(
        args.iter()
            .map(|a| {
                (on(a) && floating(a.dtype) && a.dtype != F64 && a.dtype != cur).then_some(cur)
            })
            .collect(),
    )
}

#[test]
fn promote_matches_pytorch_fold_on_random_arguments() -> TestResult {
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % n) as usize
    };
    let dtypes = [F16, BF16, F32, F64, I64, I32];
    let devices = [Cuda, Cpu, Xla];
    for lp in [F16, BF16] {
        let _r = Autocast::new(Cuda).dtype(lp).enter()?;
        for _ in 0..2000 {
            let n = 1 + next(5);
            let args: Vec<T> = (0..n)
                .map(|_| t(dtypes[next(6)], devices[next(3)]))
                .collect();
            let got = plan(Cuda, "addcmul", &args).map(|p| targets(&p, &args));
            assert_eq!(got.ok(), reference_promote(Cuda, lp, &args), "{args:?}");
        }
    }
    Ok(())
}

#[test]
fn banned_op_raises_pytorch_message_only_under_autocast() -> TestResult {
    let args = [t(F32, Cuda)];
    let _r = Autocast::new(Cuda).enter()?;
    let e = plan(Cuda, "binary_cross_entropy", &args);
    let Err(e) = e else {
        return Err("binary_cross_entropy ran under CUDA autocast".into());
    };
    assert_eq!(e.to_string(), BINARY_CROSS_ENTROPY_BANNED);
    assert_eq!(e.to_string().lines().count(), 5);
    assert!(e.to_string().starts_with(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast."
    ));
    let _c = Autocast::new(Cpu).enter()?;
    let cpu = [t(BF16, Cpu)];
    assert_eq!(
        targets(&plan(Cpu, "binary_cross_entropy", &cpu)?, &cpu),
        [Some(F32)]
    );
    Ok(())
}

#[test]
fn cudnn_rnn_is_fp16_even_under_bf16() -> TestResult {
    let _r = Autocast::new(Cuda).dtype(BF16).enter()?;
    let args = [t(F32, Cuda), t(BF16, Cuda)];
    assert_eq!(
        targets(&plan(Cuda, "_cudnn_rnn", &args)?, &args),
        [Some(F16); 2]
    );
    Ok(())
}

#[test]
fn op_ids_give_the_same_plans_as_names() -> TestResult {
    let _r = Autocast::new(Cuda).enter()?;
    let args = [t(F32, Cuda), t(F16, Cuda)];
    for (name, _) in listed_ops(Cuda) {
        let id = OpId::resolve(name).ok_or("listed op without id")?;
        assert_eq!(
            ferrocuda_amp::autocast::cast_inputs(Cuda, id, &args),
            plan(Cuda, name, &args)
        );
    }
    Ok(())
}
