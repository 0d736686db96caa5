//! Parsing a PyTorch device string (`cuda`, `cuda:1`, `meta`) into the [`DeviceKind`] whose
//! autocast policy applies, with PyTorch's errors for what is not one.
use std::str::FromStr;

use super::device::DeviceKind;
use super::error::AutocastError;

/// Device types PyTorch parses but has no autocast key for.
const NOT_AUTOCAST_DEVICES: &[&str] = &[
    "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga", "lazy", "vulkan", "meta",
];

impl FromStr for DeviceKind {
    type Err = AutocastError;

    /// Parses a device string as `torch.amp.is_autocast_available` does: the type part of
    /// `type[:index]`; a known type without an autocast key is
    /// [`AutocastError::UnsupportedDevice`], anything else [`AutocastError::InvalidDevice`].
    fn from_str(s: &str) -> Result<DeviceKind, AutocastError> {
        let (kind, index) = match s.split_once(':') {
            Some((kind, index)) => (kind, Some(index)),
            None => (s, None),
        };
        let invalid = || AutocastError::InvalidDevice {
            given: s.to_owned(),
        };
        if index.is_some_and(|i| i.is_empty() || !i.bytes().all(|b| b.is_ascii_digit())) {
            return Err(invalid());
        }
        if let Some(found) = DeviceKind::ALL.iter().find(|d| d.name() == kind) {
            return Ok(*found);
        }
        if NOT_AUTOCAST_DEVICES.contains(&kind) {
            return Err(AutocastError::UnsupportedDevice {
                device: kind.to_owned(),
            });
        }
        Err(invalid())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_index_matches_all() -> Result<(), AutocastError> {
        for (i, d) in DeviceKind::ALL.iter().enumerate() {
            assert_eq!(d.index(), i);
            assert_eq!(d.name().parse::<DeviceKind>()?, *d);
            assert_eq!(format!("{d}:3").parse::<DeviceKind>()?, *d);
        }
        Ok(())
    }

    #[test]
    fn parse_errors_follow_pytorch() {
        let e = "not a real device".parse::<DeviceKind>();
        assert!(
            matches!(&e, Err(e) if e.to_string() == "Invalid device string: 'not a real device'")
        );
        let e = "meta".parse::<DeviceKind>();
        assert!(matches!(&e, Err(e) if e.to_string()
            == "User specified an unsupported autocast device_type 'meta'"));
        assert!("cuda:".parse::<DeviceKind>().is_err());
        assert!("cuda:x".parse::<DeviceKind>().is_err());
    }
}
