//! The device kinds autocast knows (one per PyTorch autocast dispatch key), their default
//! lower-precision dtypes and the dtypes an autocast region may ask for.
use std::fmt;

use ferrocuda_types::DType;

/// A device type with an autocast dispatch key (`_AUTOCAST_SUPPORTED_DEVICES` in
/// `torch/amp/autocast_mode.py`). A typed value where PyTorch passes strings.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceKind {
    /// `cpu` (`AutocastCPU`).
    Cpu,
    /// `cuda` (`AutocastCUDA`).
    Cuda,
    /// `xpu` (`AutocastXPU`).
    Xpu,
    /// `mps` (`AutocastMPS`).
    Mps,
    /// `mtia` (`AutocastMTIA`).
    Mtia,
    /// `maia` (`AutocastMAIA`).
    Maia,
    /// `hpu` (`AutocastHPU`).
    Hpu,
    /// `xla` (`AutocastXLA`).
    Xla,
    /// `ipu` (`AutocastIPU`).
    Ipu,
    /// `privateuseone` (`AutocastPrivateUse1`).
    PrivateUse1,
}

impl DeviceKind {
    /// Every kind, in the order of the per-thread state arrays.
    pub const ALL: [DeviceKind; 10] = [
        DeviceKind::Cpu,
        DeviceKind::Cuda,
        DeviceKind::Xpu,
        DeviceKind::Mps,
        DeviceKind::Mtia,
        DeviceKind::Maia,
        DeviceKind::Hpu,
        DeviceKind::Xla,
        DeviceKind::Ipu,
        DeviceKind::PrivateUse1,
    ];

    /// The number of kinds.
    pub const COUNT: usize = DeviceKind::ALL.len();

    /// The position of this kind in [`DeviceKind::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// PyTorch's device-type string.
    pub const fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Xpu => "xpu",
            DeviceKind::Mps => "mps",
            DeviceKind::Mtia => "mtia",
            DeviceKind::Maia => "maia",
            DeviceKind::Hpu => "hpu",
            DeviceKind::Xla => "xla",
            DeviceKind::Ipu => "ipu",
            DeviceKind::PrivateUse1 => "privateuseone",
        }
    }

    /// The default lower-precision dtype of a new thread (`autocast_dtype` initialiser in
    /// `aten/src/ATen/autocast_mode.cpp`, 2.15).
    pub const fn default_dtype(self) -> DType {
        match self {
            DeviceKind::Cpu | DeviceKind::Maia | DeviceKind::Hpu | DeviceKind::Xla => DType::BF16,
            DeviceKind::Cuda
            | DeviceKind::Xpu
            | DeviceKind::Mps
            | DeviceKind::Mtia
            | DeviceKind::Ipu
            | DeviceKind::PrivateUse1 => DType::F16,
        }
    }

    /// Whether an enabled autocast region may use `dtype` on this device: fp16 and bf16
    /// (`torch.amp.autocast.__init__`; a PrivateUse1 backend's own list is not modelled).
    pub const fn supports_dtype(self, dtype: DType) -> bool {
        matches!(dtype, DType::F16 | DType::BF16)
    }

    /// Whether a tensor on `other` is autocast-eligible for this device: same kind, and
    /// for CUDA also XLA tensors (`is_autocast_eligible` in `autocast_mode.h`).
    pub const fn accepts(self, other: DeviceKind) -> bool {
        self as usize == other as usize
            || matches!((self, other), (DeviceKind::Cuda, DeviceKind::Xla))
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_dtypes_are_pytorch_2_15() {
        use DeviceKind::*;
        for d in [Cpu, Maia, Hpu, Xla] {
            assert_eq!(d.default_dtype(), DType::BF16, "{d}");
        }
        for d in [Cuda, Xpu, Mps, Mtia, Ipu, PrivateUse1] {
            assert_eq!(d.default_dtype(), DType::F16, "{d}");
        }
    }

    #[test]
    fn only_cuda_accepts_a_foreign_kind() {
        for a in DeviceKind::ALL {
            for b in DeviceKind::ALL {
                let expected = a == b || (a == DeviceKind::Cuda && b == DeviceKind::Xla);
                assert_eq!(a.accepts(b), expected, "{a} {b}");
            }
        }
    }
}
