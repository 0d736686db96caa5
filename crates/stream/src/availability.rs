//! How [`Runtime::is_available`](crate::Runtime::is_available) decides (PyTorch's
//! `PYTORCH_NVML_BASED_CUDA_CHECK`), and NVML's device count as PyTorch's `device_count`
//! reads it before CUDA is initialised, with `CUDA_VISIBLE_DEVICES` applied.
use ferrocuda_driver::NvmlError;

/// How availability is checked (`torch.cuda.is_available()`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AvailabilityCheck {
    /// Initialise CUDA and ask the driver how many devices it has (PyTorch's default,
    /// `cudaGetDeviceCount`). A child forked afterwards cannot use CUDA.
    Driver,
    /// Ask NVML first, leaving CUDA uninitialised and a later fork safe; when NVML fails,
    /// fall back to [`AvailabilityCheck::Driver`] (PyTorch with
    /// `PYTORCH_NVML_BASED_CUDA_CHECK=1`).
    Nvml,
}

impl AvailabilityCheck {
    /// The variables read by [`AvailabilityCheck::from_env`], in order: the first one set
    /// decides.
    pub const VARIABLES: [&str; 2] = [
        "FERROCUDA_NVML_BASED_CUDA_CHECK",
        "PYTORCH_NVML_BASED_CUDA_CHECK",
    ];

    /// [`AvailabilityCheck::Nvml`] when the first of [`AvailabilityCheck::VARIABLES`] that
    /// is set is exactly `1` (PyTorch compares with `"1"`), else
    /// [`AvailabilityCheck::Driver`].
    pub fn from_env() -> AvailabilityCheck {
        AvailabilityCheck::from_vars(|k| std::env::var(k).ok())
    }

    /// [`AvailabilityCheck::from_env`] over any variable lookup.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> AvailabilityCheck {
        match AvailabilityCheck::VARIABLES.into_iter().find_map(var) {
            Some(v) if v == "1" => AvailabilityCheck::Nvml,
            _ => AvailabilityCheck::Driver,
        }
    }
}

/// PyTorch's `_device_count_nvml`: NVML's device count with `CUDA_VISIBLE_DEVICES` (`visible`)
/// applied, or `None` where PyTorch's is negative and the caller falls back to the driver:
/// NVML failed, or the variable names devices by UUID (`GPU-...`, `MIG-...`; PyTorch
/// resolves `GPU-` UUIDs through NVML, ferrocuda falls back instead). A variable that makes
/// no device visible (empty, `-1`, a repeated device) gives 0 without asking NVML.
pub(crate) fn nvml_visible_count(
    visible: Option<&str>,
    nvml: impl FnOnce() -> Result<usize, NvmlError>,
) -> Option<usize> {
    let ordinals = match visible_devices(visible) {
        Visible::Uuids(0) => return Some(0),
        Visible::Uuids(_) => return None,
        Visible::Ordinals(o) if o.is_empty() => return Some(0),
        Visible::Ordinals(o) => o,
    };
    let raw = nvml().ok()? as u64;
    // The list is cut at the first device NVML does not have.
    Some(
        ordinals
            .iter()
            .position(|&o| o >= raw)
            .unwrap_or(ordinals.len()),
    )
}

/// `CUDA_VISIBLE_DEVICES` as PyTorch's `_parse_visible_devices` reads it.
#[derive(Debug, PartialEq, Eq)]
enum Visible {
    /// Device ordinals, in order.
    Ordinals(Vec<u64>),
    /// How many UUIDs of the variable's prefix (`GPU-` or `MIG-`) lead the list.
    Uuids(usize),
}

fn visible_devices(var: Option<&str>) -> Visible {
    let Some(var) = var else {
        return Visible::Ordinals((0..64).collect());
    };
    if let Some(prefix) = ["GPU-", "MIG-"].into_iter().find(|p| var.starts_with(p)) {
        let mut uuids: Vec<&str> = Vec::new();
        for elem in var.split(',') {
            if uuids.contains(&elem) {
                return Visible::Uuids(0);
            }
            if !elem.starts_with(prefix) {
                break;
            }
            uuids.push(elem);
        }
        return Visible::Uuids(uuids.len());
    }
    let mut ordinals = Vec::new();
    for elem in var.split(',') {
        // A negative value ends the list, a repeated one empties it.
        let Ok(x) = u64::try_from(strtoul(elem.trim())) else {
            break;
        };
        if ordinals.contains(&x) {
            return Visible::Ordinals(Vec::new());
        }
        ordinals.push(x);
    }
    Visible::Ordinals(ordinals)
}

/// PyTorch's `_strtoul`: the integer `s` starts with (a sign, then digits), else -1. (A lone
/// sign is -1 here; PyTorch raises `ValueError` on it.)
fn strtoul(s: &str) -> i64 {
    let end = s
        .bytes()
        .enumerate()
        .take_while(|&(i, c)| c.is_ascii_digit() || (i == 0 && (c == b'+' || c == b'-')))
        .count();
    s[..end].parse().unwrap_or(-1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PyTorch's own cases (`test/test_cuda_nvml_based_avail.py`, `TestVisibleDeviceParses`),
    /// then the empty and hidden ones.
    #[test]
    fn cuda_visible_devices_parses_as_pytorch_parses_it() {
        let ordinals = |v: &str| visible_devices(Some(v));
        let list = |l: &[u64]| Visible::Ordinals(l.to_vec());
        assert_eq!(ordinals("1gpu2,2ampere"), list(&[1, 2]));
        assert_eq!(ordinals("0, 1, 2, -1, 3"), list(&[0, 1, 2]));
        assert_eq!(ordinals("0, 1, 2, 1"), list(&[]));
        assert_eq!(ordinals("2, +3, -0, 5"), list(&[2, 3, 0, 5]));
        assert_eq!(ordinals("one,two,3,4"), list(&[]));
        assert_eq!(ordinals("4,3,two,one"), list(&[4, 3]));
        assert_eq!(ordinals(""), list(&[]));
        assert_eq!(ordinals("-1"), list(&[]));
        assert_eq!(ordinals("GPU-9e8d35e3"), Visible::Uuids(1));
        assert_eq!(ordinals("GPU-123, 2"), Visible::Uuids(1));
        assert_eq!(ordinals("MIG-89c850dc"), Visible::Uuids(1));
        assert_eq!(ordinals("MIG-89c850dc,MIG-89c850dc"), Visible::Uuids(0));
        assert_eq!(visible_devices(None), Visible::Ordinals((0..64).collect()));
    }

    #[test]
    fn nvml_count_applies_the_visible_devices() {
        let count = |visible, raw: usize| nvml_visible_count(visible, || Ok(raw));
        // PyTorch's `test_ordinal_parse_visible_devices`, NVML reporting 2 devices.
        assert_eq!(count(Some("1, 0"), 2), Some(2));
        assert_eq!(count(Some("1, 5, 0"), 2), Some(1));
        assert_eq!(count(None, 8), Some(8));
        assert_eq!(count(None, 100), Some(64), "PyTorch looks at 64 at most");
        assert_eq!(count(Some("0,1,2,3"), 2), Some(2));
        assert_eq!(
            count(Some("1,0,5,2"), 4),
            Some(2),
            "cut at the first missing"
        );
        assert_eq!(count(Some("4,3"), 8), Some(2));
        assert_eq!(count(None, 0), Some(0), "NVML's zero is believed");
        assert_eq!(
            count(Some("GPU-9e8d35e3"), 1),
            None,
            "UUIDs: the driver decides"
        );
        assert_eq!(count(Some("MIG-89c850dc"), 1), None);
        let failed = || {
            Err(NvmlError::LibraryNotFound(
                "libnvidia-ml.so.1: cannot open shared object file".into(),
            ))
        };
        assert_eq!(nvml_visible_count(None, failed), None);
        for hidden in ["", "-1", "0,0", "GPU-1,GPU-1"] {
            assert_eq!(
                nvml_visible_count(Some(hidden), || panic!("NVML asked for {hidden:?}")),
                Some(0)
            );
        }
    }

    fn check(vars: &[(&str, &str)]) -> AvailabilityCheck {
        AvailabilityCheck::from_vars(|k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn the_ferrocuda_variable_wins_when_set() {
        use AvailabilityCheck::{Driver, Nvml};
        assert_eq!(check(&[]), Driver);
        assert_eq!(check(&[("PYTORCH_NVML_BASED_CUDA_CHECK", "1")]), Nvml);
        assert_eq!(check(&[("FERROCUDA_NVML_BASED_CUDA_CHECK", "1")]), Nvml);
        let both = |ours, theirs| {
            check(&[
                ("FERROCUDA_NVML_BASED_CUDA_CHECK", ours),
                ("PYTORCH_NVML_BASED_CUDA_CHECK", theirs),
            ])
        };
        assert_eq!(both("0", "1"), Driver);
        assert_eq!(both("", "1"), Driver, "set, even empty, it decides");
        assert_eq!(both("1", "0"), Nvml);
        for other in ["true", "yes", " 1", "1 ", "01"] {
            assert_eq!(
                check(&[("PYTORCH_NVML_BASED_CUDA_CHECK", other)]),
                Driver,
                "{other:?}"
            );
        }
    }
}
