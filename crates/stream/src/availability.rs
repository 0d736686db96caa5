//! How [`Runtime::is_available`](crate::Runtime::is_available) decides: PyTorch's
//! `PYTORCH_NVML_BASED_CUDA_CHECK`.

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

#[cfg(test)]
mod tests {
    use super::*;

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
