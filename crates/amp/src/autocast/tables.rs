//! The single declarative source of every autocast op policy: PyTorch 2.15's shared lists
//! (`AT_FORALL_*` in `aten/src/ATen/autocast_mode.h`) and the per-device overlays that
//! `aten/src/ATen/autocast_mode.cpp` (CUDA, XPU, MTIA, MAIA, CPU) and
//! `aten/src/ATen/mps/MPSAutocast.cpp` (MPS) register on top of them.
//!
//! Everything else (lookup, the docs page, the count and drift tests) is derived from the
//! rules here and, for PyTorch 2.11, from the changes to them in `tables_2_11`; edit only
//! these two files to change a policy.
use super::device::DeviceKind;

/// How autocast treats one op on one device (`CastPolicy` in `aten/src/ATen/autocast_mode.h`,
/// plus the banned kernel and the `_cudnn_rnn` wrapper of `cudnn/AutocastRNN.cpp`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CastPolicy {
    /// Cast every eligible argument to the region's lower-precision dtype.
    LowerPrecision,
    /// Cast every eligible argument to fp32.
    Fp32,
    /// If the first argument is eligible, fill the op's optional `dtype` argument with fp32
    /// when the caller left it unset; never cast inputs.
    Fp32SetOptDtype,
    /// Call the dtype-taking overload `redispatch` with fp32 appended if the first argument
    /// is eligible, else with the first argument's dtype.
    Fp32AppendDtype {
        /// The overload to call instead.
        redispatch: &'static str,
    },
    /// Cast every eligible argument to the widest floating type among them.
    Promote,
    /// Cast every eligible argument to fp16 whatever the region's dtype: PyTorch's
    /// `_cudnn_rnn` wrapper hard-codes `kHalf`.
    CudnnRnnFp16,
    /// The op refuses to run under autocast, with this message.
    Banned {
        /// PyTorch's message.
        message: &'static str,
    },
}

impl CastPolicy {
    /// A short name for docs and messages (`lower_precision_fp`, `fp32`, ...).
    pub const fn name(&self) -> &'static str {
        match self {
            CastPolicy::LowerPrecision => "lower_precision_fp",
            CastPolicy::Fp32 => "fp32",
            CastPolicy::Fp32SetOptDtype => "fp32_set_opt_dtype",
            CastPolicy::Fp32AppendDtype { .. } => "fp32_append_dtype",
            CastPolicy::Promote => "promote",
            CastPolicy::CudnnRnnFp16 => "cudnn_rnn_fp16",
            CastPolicy::Banned { .. } => "banned",
        }
    }
}

/// One step of building a device's table, applied in order.
#[derive(Debug)]
pub(crate) enum Rule {
    /// Apply another rule list (the shared lists).
    Include(&'static [Rule]),
    /// Register these ops with this policy (they must not be registered yet).
    Add(CastPolicy, &'static [&'static str]),
    /// Unregister these ops (they must be registered).
    Remove(&'static [&'static str]),
    /// Change the policy of these registered ops.
    Override(CastPolicy, &'static [&'static str]),
}

/// A device's table: its rules, applied in order to an empty table.
#[derive(Debug)]
pub(crate) struct DeviceRules {
    pub(crate) device: DeviceKind,
    pub(crate) rules: &'static [Rule],
}

/// PyTorch's message for `binary_cross_entropy` under autocast (`autocast_mode.cpp`,
/// `binary_cross_entropy_banned`), five `\n`-joined lines, verbatim.
pub const BINARY_CROSS_ENTROPY_BANNED: &str = "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n\
Many models use a sigmoid layer right before the binary cross entropy layer.\n\
In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n\
or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n\
safe to autocast.";

const LP: CastPolicy = CastPolicy::LowerPrecision;
const FP32: CastPolicy = CastPolicy::Fp32;
const PROMOTE: CastPolicy = CastPolicy::Promote;
const BANNED: CastPolicy = CastPolicy::Banned {
    message: BINARY_CROSS_ENTROPY_BANNED,
};

/// `AT_FORALL_LOWER_PRECISION_FP` (33).
pub(crate) const SHARED_LOWER_PRECISION: &[&str] = &[
    "_convolution.deprecated",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
];

/// The `upsample_*` part of `AT_FORALL_FP32` (12), named separately because MPS leaves it out.
const SHARED_FP32_UPSAMPLE: &[&str] = &[
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
];

/// `AT_FORALL_FP32` (59) without `rms_norm` and the `upsample_*` ops.
const SHARED_FP32_CORE: &[&str] = &[
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
];

/// `AT_FORALL_FP32_SET_OPT_DTYPE` (11).
const SHARED_FP32_SET_OPT_DTYPE: &[&str] = &[
    "prod",
    "prod.dim_int",
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
];

/// `AT_FORALL_PROMOTE` (11) without `vdot`.
const SHARED_PROMOTE_CORE: &[&str] = &[
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
];

/// The shared lists (116 ops) that CUDA, XPU, MTIA and MAIA instantiate.
const SHARED: &[Rule] = &[
    Rule::Add(LP, SHARED_LOWER_PRECISION),
    Rule::Add(FP32, SHARED_FP32_CORE),
    Rule::Add(FP32, &["rms_norm"]),
    Rule::Add(FP32, SHARED_FP32_UPSAMPLE),
    Rule::Add(CastPolicy::Fp32SetOptDtype, SHARED_FP32_SET_OPT_DTYPE),
    // AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE
    Rule::Add(
        CastPolicy::Fp32AppendDtype {
            redispatch: "norm.ScalarOpt_dtype",
        },
        &["norm.Scalar"],
    ),
    Rule::Add(
        CastPolicy::Fp32AppendDtype {
            redispatch: "norm.ScalarOpt_dim_dtype",
        },
        &["norm.ScalarOpt_dim"],
    ),
    Rule::Add(PROMOTE, SHARED_PROMOTE_CORE),
    Rule::Add(PROMOTE, &["vdot"]),
];

/// Shared lists plus the ban, the whole of XPU, MTIA and MAIA (117 each).
pub(crate) const SHARED_WITH_BAN: &[Rule] = &[
    Rule::Include(SHARED),
    Rule::Add(BANNED, &["binary_cross_entropy"]),
];

/// `AutocastCUDA` (121).
pub(crate) const CUDA: &[Rule] = &[
    Rule::Include(SHARED_WITH_BAN),
    Rule::Add(LP, &["cudnn_convolution", "cudnn_convolution_transpose"]),
    // cudnn/AutocastRNN.cpp: `_cudnn_rnn` re-flattens its weights in fp16 (kHalf).
    Rule::Add(CastPolicy::CudnnRnnFp16, &["_cudnn_rnn"]),
    // New in 2.15: its meta function refuses lower-precision dtypes.
    Rule::Add(FP32, &["linalg_matrix_sqrth"]),
];

/// `AutocastCPU` (126): its own lists in `autocast_mode.cpp`, shared by bf16 and fp16.
pub(crate) const CPU: &[Rule] = &[
    Rule::Add(
        LP,
        &[
            "conv1d",
            "conv1d.padding",
            "conv2d",
            "conv2d.padding",
            "conv3d",
            "conv3d.padding",
            "bmm",
            "mm",
            "linalg_vecdot",
            "baddbmm",
            "addmm",
            "_addmm_activation",
            "addbmm",
            "linear",
            "_convolution.deprecated",
            "matmul",
            "conv_tbc",
            "mkldnn_rnn_layer",
            "conv_transpose1d",
            "conv_transpose2d.input",
            "conv_transpose3d.input",
            "prelu",
            "scaled_dot_product_attention",
            "_native_multi_head_attention",
        ],
    ),
    Rule::Add(FP32, CPU_FP32),
    Rule::Add(PROMOTE, &["stack", "cat", "index_copy"]),
];

/// The CPU fp32 list (99).
const CPU_FP32: &[&str] = &[
    "avg_pool3d",
    "binary_cross_entropy",
    "grid_sampler",
    "polar",
    "prod",
    "prod.dim_int",
    "quantile",
    "quantile.scalar",
    "nanquantile",
    "nanquantile.scalar",
    "stft",
    "stft.center",
    "cdist",
    "grid_sampler_2d",
    "_grid_sampler_2d_cpu_fallback",
    "grid_sampler_3d",
    "trace",
    "view_as_complex",
    "cholesky_inverse",
    "cholesky_solve",
    "inverse",
    "lu_solve",
    "orgqr",
    "ormqr",
    "pinverse",
    "max_pool3d",
    "max_unpool2d",
    "max_unpool3d",
    "adaptive_avg_pool3d",
    "reflection_pad1d",
    "reflection_pad2d",
    "replication_pad1d",
    "replication_pad2d",
    "replication_pad3d",
    "mse_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "poisson_nll_loss",
    "smooth_l1_loss",
    "cross_entropy_loss",
    "l1_loss",
    "huber_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "ctc_loss.IntList",
    "ctc_loss.Tensor",
    "kl_div",
    "multilabel_margin_loss",
    "binary_cross_entropy_with_logits",
    "fft_fft",
    "fft_ifft",
    "fft_fft2",
    "fft_ifft2",
    "fft_fftn",
    "fft_ifftn",
    "fft_rfft",
    "fft_irfft",
    "fft_rfft2",
    "fft_irfft2",
    "fft_rfftn",
    "fft_irfftn",
    "fft_hfft",
    "fft_ihfft",
    "linalg_cond",
    "linalg_cond.p_str",
    "linalg_matrix_rank",
    "linalg_matrix_rank.tol_tensor",
    "linalg_matrix_rank.atol_rtol_tensor",
    "linalg_matrix_rank.atol_rtol_float",
    "linalg_solve",
    "linalg_cholesky",
    "linalg_svdvals",
    "linalg_eigvals",
    "linalg_eigvalsh",
    "linalg_inv",
    "linalg_householder_product",
    "linalg_tensorinv",
    "linalg_tensorsolve",
    "fake_quantize_per_tensor_affine",
    "geqrf",
    "_lu_with_info",
    "svd",
    "triangular_solve",
    "fractional_max_pool2d",
    "fractional_max_pool3d",
    "adaptive_max_pool3d",
    "multilabel_margin_loss_forward",
    "linalg_qr",
    "linalg_cholesky_ex",
    "linalg_svd",
    "linalg_eig",
    "linalg_eigh",
    "linalg_lstsq",
    "linalg_inv_ex",
    "linalg_matrix_sqrth",
];

/// `AutocastMPS` (95): the shared lists minus what `MPSAutocast.cpp` does not register, its
/// own `_mps_convolution` and `batch_norm`, and the set-opt-dtype ops as plain fp32.
pub(crate) const MPS: &[Rule] = &[
    Rule::Include(SHARED),
    Rule::Remove(&[
        "linalg_vecdot",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
        "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell",
        "_scaled_dot_product_flash_attention",
        "rms_norm",
        "norm.Scalar",
        "norm.ScalarOpt_dim",
        "vdot",
    ]),
    Rule::Remove(SHARED_FP32_UPSAMPLE),
    Rule::Add(LP, &["_mps_convolution"]),
    Rule::Add(FP32, &["batch_norm"]),
    Rule::Override(FP32, SHARED_FP32_SET_OPT_DTYPE),
];

/// Every device kind with a table in the stock 2.15 build, in the order the docs list them.
/// HPU, XLA, IPU and PrivateUse1 register their lists out of tree (0 ops in the stock build).
pub(crate) const DEVICES_2_15: &[DeviceRules] = &[
    DeviceRules {
        device: DeviceKind::Cuda,
        rules: CUDA,
    },
    DeviceRules {
        device: DeviceKind::Cpu,
        rules: CPU,
    },
    DeviceRules {
        device: DeviceKind::Xpu,
        rules: SHARED_WITH_BAN,
    },
    DeviceRules {
        device: DeviceKind::Mtia,
        rules: SHARED_WITH_BAN,
    },
    DeviceRules {
        device: DeviceKind::Maia,
        rules: SHARED_WITH_BAN,
    },
    DeviceRules {
        device: DeviceKind::Mps,
        rules: MPS,
    },
];
