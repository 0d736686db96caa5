//! Device names (`"cuda:1"`, `"cpu"`) and properties.
use crate::DeviceIndex;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The kind of a [`Device`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DeviceKind {
    /// Host memory and the CPU.
    Cpu,
    /// A CUDA device.
    Cuda,
}

/// A device name as `torch.device` takes it: `"cpu"`, `"cuda"` (the current device) or
/// `"cuda:N"`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Device {
    /// CPU or CUDA.
    pub kind: DeviceKind,
    /// The index, or `None` for "the current one".
    pub index: Option<DeviceIndex>,
}

impl Device {
    /// The CPU.
    pub const CPU: Device = Device {
        kind: DeviceKind::Cpu,
        index: None,
    };

    /// CUDA device `index`.
    pub const fn cuda(index: u16) -> Device {
        Device {
            kind: DeviceKind::Cuda,
            index: Some(DeviceIndex(index)),
        }
    }
}

/// Why a device string did not parse. The message quotes the input, as PyTorch's does.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceParseError {
    /// The part before `:` is not `cpu` or `cuda`.
    #[error("expected one of cpu, cuda device type at start of device string: {input:?}")]
    UnknownType {
        /// The whole input.
        input: String,
    },
    /// The index is not a whole number, is negative, has leading zeros, or is too large.
    #[error("invalid device index {index:?} in device string {input:?}: {why}")]
    BadIndex {
        /// The whole input.
        input: String,
        /// The text after `:`.
        index: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

impl FromStr for Device {
    type Err = DeviceParseError;

    fn from_str(input: &str) -> Result<Device, DeviceParseError> {
        let (kind_text, index_text) = match input.split_once(':') {
            Some((k, i)) => (k, Some(i)),
            None => (input, None),
        };
        let kind = match kind_text {
            "cpu" => DeviceKind::Cpu,
            "cuda" => DeviceKind::Cuda,
            _ => {
                return Err(DeviceParseError::UnknownType {
                    input: input.to_owned(),
                });
            }
        };
        let Some(text) = index_text else {
            return Ok(Device { kind, index: None });
        };
        let bad = |why| DeviceParseError::BadIndex {
            input: input.to_owned(),
            index: text.to_owned(),
            why,
        };
        if text.is_empty() {
            return Err(bad("empty"));
        }
        if text.starts_with('-') {
            return Err(bad("device index must not be negative"));
        }
        if !text.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad("not a whole number"));
        }
        if text.len() > 1 && text.starts_with('0') {
            return Err(bad("device index must not have leading zeros"));
        }
        let index = text.parse::<u16>().map_err(|_| bad("too large"))?;
        Ok(Device {
            kind,
            index: Some(DeviceIndex(index)),
        })
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        };
        match self.index {
            Some(i) => write!(f, "{kind}:{}", i.0),
            None => f.write_str(kind),
        }
    }
}

/// What `torch.cuda.get_device_properties` reports, as far as the driver tells it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceProperties {
    /// Marketing name, e.g. `"NVIDIA H100 80GB HBM3"`.
    pub name: String,
    /// Compute capability major version.
    pub major: u32,
    /// Compute capability minor version.
    pub minor: u32,
    /// Device memory in bytes.
    pub total_memory: u64,
    /// Streaming multiprocessors.
    pub multi_processor_count: u32,
    /// Threads a multiprocessor can hold.
    pub max_threads_per_multi_processor: u32,
    /// Warp width in threads.
    pub warp_size: u32,
    /// L2 cache in bytes.
    pub l2_cache_size: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_torch_device_accepts() {
        assert_eq!("cpu".parse::<Device>(), Ok(Device::CPU));
        assert_eq!(
            "cuda".parse::<Device>(),
            Ok(Device {
                kind: DeviceKind::Cuda,
                index: None
            })
        );
        assert_eq!("cuda:0".parse::<Device>(), Ok(Device::cuda(0)));
        assert_eq!("cuda:13".parse::<Device>(), Ok(Device::cuda(13)));
        assert_eq!(Device::cuda(3).to_string(), "cuda:3");
    }

    #[test]
    fn rejects_what_torch_device_rejects() {
        for bad in [
            "gpu",
            "cuda:",
            "cuda:-1",
            "cuda:01",
            "cuda:x",
            "cuda:1:2",
            " cuda",
            "CUDA",
            "cuda:99999",
        ] {
            assert!(bad.parse::<Device>().is_err(), "{bad:?} parsed");
        }
        let msg = "cuda:-1"
            .parse::<Device>()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            msg.contains("must not be negative") && msg.contains("cuda:-1"),
            "{msg}"
        );
    }
}
