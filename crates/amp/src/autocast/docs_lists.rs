//! PyTorch's documented autocast op lists (`docs/source/amp.md`, "Autocast Op Reference")
//! and how they differ from what the source registers. The docs name Python-facing
//! functions (`__matmul__`, `GRUCell`, `multi_dot`) and omit overloads and internal ops, so
//! they drift from the tables; the drift is computed here, shown on the generated page and
//! pinned by a test. CUDA, XPU and CPU have doc lists; MTIA, MAIA and MPS have none.
use std::collections::BTreeSet;

use super::device::DeviceKind;
use super::policy::{CastPolicy, listed_ops};

/// The three behaviours the docs list per device.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DocsClass {
    /// "Ops that can autocast to float16 / bfloat16".
    LowerPrecision,
    /// "Ops that can autocast to float32".
    Fp32,
    /// "Ops that promote to the widest input type".
    Promote,
}

impl DocsClass {
    /// The class a policy is documented under (`None` for banned ops, which the docs
    /// describe in prose).
    pub fn of(policy: CastPolicy) -> Option<DocsClass> {
        match policy {
            CastPolicy::LowerPrecision | CastPolicy::CudnnRnnFp16 => {
                Some(DocsClass::LowerPrecision)
            }
            CastPolicy::Fp32 | CastPolicy::Fp32SetOptDtype | CastPolicy::Fp32AppendDtype { .. } => {
                Some(DocsClass::Fp32)
            }
            CastPolicy::Promote => Some(DocsClass::Promote),
            CastPolicy::Banned { .. } => None,
        }
    }
}

/// One documented list.
#[derive(Debug)]
pub(crate) struct DocsList {
    pub(crate) device: DeviceKind,
    pub(crate) class: DocsClass,
    pub(crate) names: &'static [&'static str],
}

const CUDA_LOWER: &[&str] = &[
    "__matmul__",
    "addbmm",
    "addmm",
    "addmv",
    "addr",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "multi_dot",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "GRUCell",
    "linear",
    "LSTMCell",
    "matmul",
    "mm",
    "mv",
    "prelu",
    "RNNCell",
];

const CUDA_FP32: &[&str] = &[
    "__pow__",
    "__rdiv__",
    "__rpow__",
    "__rtruediv__",
    "acos",
    "asin",
    "binary_cross_entropy_with_logits",
    "cosh",
    "cosine_embedding_loss",
    "cdist",
    "cosine_similarity",
    "cross_entropy",
    "cumprod",
    "cumsum",
    "dist",
    "erfinv",
    "exp",
    "expm1",
    "group_norm",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "layer_norm",
    "log",
    "log_softmax",
    "log10",
    "log1p",
    "log2",
    "margin_ranking_loss",
    "mse_loss",
    "multilabel_margin_loss",
    "multi_margin_loss",
    "nll_loss",
    "norm",
    "normalize",
    "pdist",
    "poisson_nll_loss",
    "pow",
    "prod",
    "reciprocal",
    "rsqrt",
    "sinh",
    "smooth_l1_loss",
    "soft_margin_loss",
    "softmax",
    "softmin",
    "softplus",
    "sum",
    "renorm",
    "tan",
    "triplet_margin_loss",
];

const CUDA_PROMOTE: &[&str] = &[
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "grid_sample",
    "index_put",
    "scatter_add",
    "tensordot",
];

const XPU_LOWER: &[&str] = &[
    "addbmm",
    "addmm",
    "addmv",
    "addr",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "multi_dot",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "GRUCell",
    "linear",
    "LSTMCell",
    "matmul",
    "mm",
    "mv",
    "RNNCell",
];

const XPU_FP32: &[&str] = &[
    "__pow__",
    "__rdiv__",
    "__rpow__",
    "__rtruediv__",
    "binary_cross_entropy_with_logits",
    "cosine_embedding_loss",
    "cosine_similarity",
    "cumsum",
    "dist",
    "exp",
    "group_norm",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "layer_norm",
    "log",
    "log_softmax",
    "margin_ranking_loss",
    "nll_loss",
    "normalize",
    "poisson_nll_loss",
    "pow",
    "reciprocal",
    "rsqrt",
    "soft_margin_loss",
    "softmax",
    "softmin",
    "sum",
    "triplet_margin_loss",
];

const XPU_PROMOTE: &[&str] = &[
    "bilinear",
    "cross",
    "grid_sample",
    "index_put",
    "scatter_add",
    "tensordot",
];

const CPU_LOWER: &[&str] = &[
    "conv1d",
    "conv2d",
    "conv3d",
    "bmm",
    "mm",
    "linalg_vecdot",
    "baddbmm",
    "addmm",
    "addbmm",
    "linear",
    "matmul",
    "_convolution",
    "conv_tbc",
    "onednn_rnn_layer",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "prelu",
    "scaled_dot_product_attention",
    "_native_multi_head_attention",
];

const CPU_FP32: &[&str] = &[
    "avg_pool3d",
    "binary_cross_entropy",
    "grid_sampler",
    "grid_sampler_2d",
    "_grid_sampler_2d_cpu_fallback",
    "grid_sampler_3d",
    "polar",
    "prod",
    "quantile",
    "nanquantile",
    "stft",
    "cdist",
    "trace",
    "view_as_complex",
    "cholesky",
    "cholesky_inverse",
    "cholesky_solve",
    "inverse",
    "lu_solve",
    "orgqr",
    "inverse",
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
    "cross_entropy_loss",
    "l1_loss",
    "huber_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "ctc_loss",
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
    "linalg_matrix_rank",
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
    "qr",
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
];

/// Every documented list.
pub(crate) const DOCS_LISTS: &[DocsList] = &[
    DocsList {
        device: DeviceKind::Cuda,
        class: DocsClass::LowerPrecision,
        names: CUDA_LOWER,
    },
    DocsList {
        device: DeviceKind::Cuda,
        class: DocsClass::Fp32,
        names: CUDA_FP32,
    },
    DocsList {
        device: DeviceKind::Cuda,
        class: DocsClass::Promote,
        names: CUDA_PROMOTE,
    },
    DocsList {
        device: DeviceKind::Xpu,
        class: DocsClass::LowerPrecision,
        names: XPU_LOWER,
    },
    DocsList {
        device: DeviceKind::Xpu,
        class: DocsClass::Fp32,
        names: XPU_FP32,
    },
    DocsList {
        device: DeviceKind::Xpu,
        class: DocsClass::Promote,
        names: XPU_PROMOTE,
    },
    DocsList {
        device: DeviceKind::Cpu,
        class: DocsClass::LowerPrecision,
        names: CPU_LOWER,
    },
    DocsList {
        device: DeviceKind::Cpu,
        class: DocsClass::Fp32,
        names: CPU_FP32,
    },
    DocsList {
        device: DeviceKind::Cpu,
        class: DocsClass::Promote,
        names: &["cat", "stack", "index_copy"],
    },
];

/// How one documented list differs from the table. Ops are compared by name without the
/// overload (`pow.Scalar` matches the docs' `pow`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DocsDrift {
    /// The device.
    pub device: DeviceKind,
    /// The documented behaviour.
    pub class: DocsClass,
    /// Names the docs list that no op of this class on this device has.
    pub docs_only: Vec<&'static str>,
    /// Ops of this class on this device whose name the docs do not list.
    pub source_only: Vec<&'static str>,
    /// Names the docs list more than once.
    pub docs_duplicates: Vec<&'static str>,
}

/// The drift of every documented list from the tables.
pub fn docs_drift() -> Vec<DocsDrift> {
    DOCS_LISTS.iter().map(drift_of).collect()
}

fn drift_of(list: &DocsList) -> DocsDrift {
    let base = |op: &'static str| op.split_once('.').map_or(op, |(b, _)| b);
    let ops: Vec<&'static str> = listed_ops(list.device)
        .filter(|(_, p)| DocsClass::of(*p) == Some(list.class))
        .map(|(op, _)| op)
        .collect();
    let bases: BTreeSet<&str> = ops.iter().map(|op| base(op)).collect();
    let mut seen = BTreeSet::new();
    let mut docs_duplicates: Vec<&'static str> = list
        .names
        .iter()
        .copied()
        .filter(|n| !seen.insert(*n))
        .collect();
    docs_duplicates.dedup();
    let docs: BTreeSet<&'static str> = list.names.iter().copied().collect();
    DocsDrift {
        device: list.device,
        class: list.class,
        docs_only: docs
            .iter()
            .copied()
            .filter(|n| !bases.contains(n))
            .collect(),
        source_only: ops
            .into_iter()
            .filter(|op| !docs.contains(base(op)))
            .collect(),
        docs_duplicates,
    }
}
