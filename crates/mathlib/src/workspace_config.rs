//! How big cuBLAS's and cuBLASLt's workspaces are: `CUBLAS_WORKSPACE_CONFIG`,
//! `CUBLASLT_WORKSPACE_SIZE` and `TORCH_CUBLASLT_UNIFIED_WORKSPACE`, read as PyTorch 2.11
//! reads them (`parseChosenWorkspaceSize`, `parseCUDABlasLtWorkspaceSize` and
//! `getCUDABlasLtWorkspaceSize` in `aten/src/ATen/cuda/CublasHandlePool.cpp`), with the
//! overrides of its newer setters (`setChosenWorkspaceSize`, `setCUDABlasLtWorkspaceSize`).
//!
//! - `CUBLAS_WORKSPACE_CONFIG`: every `:SIZE:COUNT` found in the string (SIZE in KiB), summed
//!   (`:4096:8` is 32 MiB, `:16:8:4096:2` is 8 519 680 bytes; text around them is ignored, as
//!   PyTorch's regular expression search ignores it). None found: PyTorch's warning and the
//!   default, 32 MiB on compute capability 9.x, 10.x and 12.x (Hopper and Blackwell), else
//!   `:4096:2:16:8` (8 519 680 bytes).
//! - `TORCH_CUBLASLT_UNIFIED_WORKSPACE`: unset or `1` unifies the two (cuBLASLt uses the
//!   cuBLAS workspace of the same stream); `0` keeps them apart; another value is warned
//!   about and ignored (`c10::utils::check_env`).
//! - `CUBLASLT_WORKSPACE_SIZE`: KiB, read as `std::stoi` reads it (leading blanks and a sign,
//!   then digits; what follows is ignored); no digits or out of `int` range: PyTorch's
//!   warning and the default (the cuBLAS size when unified, else 1 024 KiB). A negative
//!   size, which PyTorch turns into an enormous one, is an error here. When unified, a
//!   cuBLASLt size above the cuBLAS size is limited to it, with PyTorch's warning.
use crate::MathLibError;

/// The environment variables read, in the order read.
pub const WORKSPACE_VARS: [&str; 3] = [
    "CUBLAS_WORKSPACE_CONFIG",
    "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
    "CUBLASLT_WORKSPACE_SIZE",
];

/// The workspace sizes a process uses, and the warnings PyTorch gives while reading them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkspaceSizes {
    /// Bytes of each cuBLAS workspace (one per handle and stream).
    pub cublas: u64,
    /// Bytes of each cuBLASLt workspace, as parsed (before the unified limit).
    pub cublaslt: u64,
    /// Whether cuBLASLt uses the cuBLAS workspace of the same stream.
    pub unified: bool,
    /// PyTorch's warnings, in order, word for word.
    pub warnings: Vec<String>,
}

/// cuBLAS's default workspace on a device of compute capability major `sm_major`.
pub fn default_cublas_workspace(sm_major: u32) -> u64 {
    if matches!(sm_major, 9 | 10 | 12) {
        4096 * 8 * 1024
    } else {
        4096 * 1024 * 2 + 16 * 1024 * 8
    }
}

impl WorkspaceSizes {
    /// Reads the variables through `var` (`std::env::var` in a process; a map in tests)
    /// for a device of compute capability major `sm_major`.
    pub fn from_env(
        var: impl Fn(&str) -> Option<String>,
        sm_major: u32,
    ) -> Result<WorkspaceSizes, MathLibError> {
        let mut warnings = Vec::new();
        let default = default_cublas_workspace(sm_major);
        let cublas = match var("CUBLAS_WORKSPACE_CONFIG") {
            None => default,
            Some(config) => match parse_workspace_config(&config)? {
                Some(bytes) => bytes,
                None => {
                    warnings.push(format!(
                        "Could not parse CUBLAS_WORKSPACE_CONFIG, using default workspace size of {default} bytes."
                    ));
                    default
                }
            },
        };
        let unified = match var("TORCH_CUBLASLT_UNIFIED_WORKSPACE").as_deref() {
            Some("0") => false,
            None | Some("1") => true,
            Some(other) => {
                warnings.push(format!(
                    "Ignoring invalid value for boolean flag TORCH_CUBLASLT_UNIFIED_WORKSPACE: {other}valid values are 0 or 1."
                ));
                true
            }
        };
        let default_kib = if unified { cublas / 1024 } else { 1024 };
        let kib = match var("CUBLASLT_WORKSPACE_SIZE") {
            None => default_kib,
            Some(v) => match stoi(&v) {
                Stoi::Value(n) if n < 0 => {
                    return Err(MathLibError::WorkspaceConfig(format!(
                        "CUBLASLT_WORKSPACE_SIZE={v}: a size in KiB cannot be negative"
                    )));
                }
                Stoi::Value(n) => n.unsigned_abs(),
                Stoi::NoDigits => {
                    warnings.push(format!(
                        "invalid CUBLASLT_WORKSPACE_SIZE, using default workspace size of {default_kib} KiB."
                    ));
                    default_kib
                }
                Stoi::OutOfRange => {
                    warnings.push(format!(
                        "CUBLASLT_WORKSPACE_SIZE out of range, using default workspace size of {default_kib} KiB."
                    ));
                    default_kib
                }
            },
        };
        Ok(WorkspaceSizes {
            cublas,
            cublaslt: kib * 1024,
            unified,
            warnings,
        })
    }

    /// The cuBLASLt workspace's bytes given the cuBLAS size in force (`cublas`, overrides
    /// applied) and the cuBLASLt size in force (`lt`): when unified, at most the cuBLAS size,
    /// with PyTorch's warning (`getCUDABlasLtWorkspaceSize`).
    pub fn effective_lt(unified: bool, cublas: u64, lt: u64) -> (u64, Option<String>) {
        if unified && cublas < lt {
            let warning = format!(
                "Requested unified CUBLASLT workspace size of {lt} bytes exceeds CUBLAS workspace size of {cublas} bytes. Please increase CUBLAS workspace size via CUBLAS_WORKSPACE_CONFIG or decrease requested CUBLASLT_WORKSPACE_SIZE. Otherwise CUBLASLT workspace size will be limited to the CUBLAS workspace size."
            );
            (cublas, Some(warning))
        } else {
            (lt, None)
        }
    }
}

/// The sum of every `:SIZE:COUNT` in `config` (SIZE in KiB), found left to right without
/// overlap as `std::regex(":([0-9]+):([0-9]+)")` finds them; `None` when there is none. A
/// number or product past 64 bits is an error (PyTorch's `std::stoull` throws).
pub fn parse_workspace_config(config: &str) -> Result<Option<u64>, MathLibError> {
    let bytes = config.as_bytes();
    let digits_from = |i: usize| bytes[i..].iter().take_while(|b| b.is_ascii_digit()).count();
    let too_big = || {
        MathLibError::WorkspaceConfig(format!(
            "CUBLAS_WORKSPACE_CONFIG={config}: a size or count is too large"
        ))
    };
    let (mut total, mut found, mut i) = (0u64, false, 0);
    while i < bytes.len() {
        let size_len = if bytes[i] == b':' {
            digits_from(i + 1)
        } else {
            0
        };
        let colon = i + 1 + size_len;
        let count_len = if size_len > 0 && bytes.get(colon) == Some(&b':') {
            digits_from(colon + 1)
        } else {
            0
        };
        if count_len == 0 {
            i += 1;
            continue;
        }
        let number = |from: usize, len: usize| config[from..from + len].parse::<u64>();
        let size = number(i + 1, size_len).map_err(|_| too_big())?;
        let count = number(colon + 1, count_len).map_err(|_| too_big())?;
        let bytes_here = size
            .checked_mul(1024)
            .and_then(|b| b.checked_mul(count))
            .ok_or_else(too_big)?;
        total = total.checked_add(bytes_here).ok_or_else(too_big)?;
        found = true;
        i = colon + 1 + count_len;
    }
    Ok(found.then_some(total))
}

/// What `std::stoi` makes of a string.
#[derive(Debug, PartialEq, Eq)]
enum Stoi {
    Value(i64),
    NoDigits,
    OutOfRange,
}

/// `std::stoi`: leading white space, an optional sign, then as many digits as there are.
fn stoi(s: &str) -> Stoi {
    let t = s.trim_start_matches([' ', '\t', '\n', '\x0b', '\x0c', '\r']);
    let (negative, rest) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    if digits.is_empty() {
        return Stoi::NoDigits;
    }
    let value = digits
        .parse::<i64>()
        .ok()
        .map(|v| if negative { -v } else { v });
    match value {
        Some(v) if i32::try_from(v).is_ok() => Stoi::Value(v),
        _ => Stoi::OutOfRange,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(vars: &[(&str, &str)], sm: u32) -> WorkspaceSizes {
        let map: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        WorkspaceSizes::from_env(
            |k| map.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()),
            sm,
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn defaults_by_architecture() {
        assert_eq!(sizes(&[], 9).cublas, 33_554_432);
        assert_eq!(sizes(&[], 10).cublas, 33_554_432);
        assert_eq!(sizes(&[], 12).cublas, 33_554_432);
        assert_eq!(sizes(&[], 8).cublas, 8_519_680);
        let s = sizes(&[], 9);
        assert!(s.unified && s.warnings.is_empty());
        assert_eq!(s.cublaslt, 33_554_432, "unified: the cuBLAS size");
        assert_eq!(
            sizes(&[("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")], 9).cublaslt,
            1 << 20
        );
    }

    /// The strings measured on PyTorch 2.11 (H200): summed, junk around matches ignored,
    /// none found warned about.
    #[test]
    fn pytorch_workspace_config_strings() {
        let cases: [(&str, Option<u64>); 9] = [
            (":16:8:4096:2", Some(8_519_680)),
            (":4096:8", Some(33_554_432)),
            (":4096:8x", Some(33_554_432)),
            ("abc:16:8def", Some(131_072)),
            ("::16:8", Some(131_072)),
            (":16:8:", Some(131_072)),
            ("abc", None),
            ("", None),
            (":16:", None),
        ];
        for (config, want) in cases {
            assert_eq!(
                parse_workspace_config(config).ok(),
                Some(want),
                "{config:?}"
            );
        }
        let s = sizes(&[("CUBLAS_WORKSPACE_CONFIG", "abc")], 9);
        assert_eq!(s.cublas, 33_554_432);
        assert_eq!(
            s.warnings,
            [
                "Could not parse CUBLAS_WORKSPACE_CONFIG, using default workspace size of 33554432 bytes."
            ]
        );
        assert!(parse_workspace_config(":99999999999999999999:1").is_err());
        assert!(parse_workspace_config(":18014398509481984:1024").is_err());
    }

    #[test]
    fn cublaslt_size_as_stoi_reads_it() {
        let lt = |v: &str| sizes(&[("CUBLASLT_WORKSPACE_SIZE", v)], 9);
        assert_eq!(lt("2048").cublaslt, 2 << 20);
        assert_eq!(lt("  64kib").cublaslt, 64 << 10);
        assert_eq!(lt("+8").cublaslt, 8 << 10);
        let bad = lt("big");
        assert_eq!(bad.cublaslt, 33_554_432);
        assert_eq!(
            bad.warnings,
            ["invalid CUBLASLT_WORKSPACE_SIZE, using default workspace size of 32768 KiB."]
        );
        let huge = lt("99999999999");
        assert_eq!(
            huge.warnings,
            ["CUBLASLT_WORKSPACE_SIZE out of range, using default workspace size of 32768 KiB."]
        );
        let negative = WorkspaceSizes::from_env(
            |k| (k == "CUBLASLT_WORKSPACE_SIZE").then(|| "-4".to_string()),
            9,
        );
        assert!(matches!(negative, Err(MathLibError::WorkspaceConfig(_))));
    }

    #[test]
    fn unified_flag_and_limit() {
        let s = sizes(&[("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "yes")], 9);
        assert!(s.unified);
        assert_eq!(s.warnings.len(), 1);
        let (lt, warning) = WorkspaceSizes::effective_lt(true, 1 << 20, 4 << 20);
        assert_eq!(lt, 1 << 20);
        assert!(warning.is_some_and(|w| w.starts_with("Requested unified CUBLASLT workspace size of 4194304 bytes exceeds CUBLAS workspace size of 1048576 bytes.")));
        assert_eq!(
            WorkspaceSizes::effective_lt(false, 1 << 20, 4 << 20),
            (4 << 20, None)
        );
    }
}
