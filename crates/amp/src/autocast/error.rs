//! Autocast's errors: PyTorch's texts where PyTorch raises, and clear typed errors where
//! PyTorch fails obscurely or disables itself with a warning.
use ferrocuda_types::DType;

use super::device::DeviceKind;

/// What autocast refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AutocastError {
    /// The op may not run under autocast (`binary_cross_entropy` on CUDA, XPU, MTIA, MAIA);
    /// the message is PyTorch's, verbatim.
    #[error("{message}")]
    Banned {
        /// The op.
        op: &'static str,
        /// PyTorch's message.
        message: &'static str,
    },
    /// A promote op got a lower-precision tensor other than the region's dtype (for example
    /// fp16 under a bf16 region). PyTorch raises the opaque "Unexpected floating ScalarType in
    /// at::autocast::prioritize"; this names the op and the dtypes.
    #[error(
        "autocast cannot promote the inputs of `{op}` on {device}: found a {found:?} tensor \
         while the {device} autocast dtype is {autocast_dtype:?} (only {autocast_dtype:?}, \
         float32 and float64 mix under autocast); cast it explicitly \
         (PyTorch: Unexpected floating ScalarType in at::autocast::prioritize)"
    )]
    MixedLowerPrecision {
        /// The op.
        op: &'static str,
        /// The device whose policy ran.
        device: DeviceKind,
        /// The region's lower-precision dtype.
        autocast_dtype: DType,
        /// The dtype that does not fit.
        found: DType,
    },
    /// An enabled region asked for a dtype the device cannot autocast to. PyTorch warns and
    /// disables autocast for the region (CPU, XPU, MPS, ... ) or accepts it (CUDA); here
    /// entering the region fails instead, so nothing is silently disabled.
    #[error(
        "In {upper} autocast, but the target dtype is not supported ({dtype:?}). \
         {upper} Autocast only supports dtypes of torch.bfloat16, torch.float16 currently."
    )]
    UnsupportedDtype {
        /// The device.
        device: DeviceKind,
        /// Its name upper-cased, as PyTorch writes it.
        upper: String,
        /// The dtype asked for.
        dtype: DType,
    },
    /// A device string that is not a device (PyTorch's text).
    #[error("Invalid device string: '{given}'")]
    InvalidDevice {
        /// The string given.
        given: String,
    },
    /// A real device type without autocast (PyTorch's text).
    #[error("User specified an unsupported autocast device_type '{device}'")]
    UnsupportedDevice {
        /// The device type given.
        device: String,
    },
}
