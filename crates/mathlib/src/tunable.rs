//! GEMM tuning compatible with PyTorch's TunableOp (`aten/src/ATen/cuda/tunable/`): the
//! switches, the signatures and the results file.
//!
//! - **Switches**: `PYTORCH_TUNABLEOP_ENABLED=1` (or ours, `FERROCUDA_TUNABLEOP_ENABLED`,
//!   which wins when set) turns it on; `PYTORCH_TUNABLEOP_TUNING=0` uses the results
//!   without tuning new signatures; `PYTORCH_TUNABLEOP_FILENAME` names the file
//!   (`tunableop_results.csv` by default, the device ordinal inserted before the extension:
//!   `tunableop_results0.csv`, as PyTorch names it).
//! - **Signatures as PyTorch writes them**: `GemmTunableOp_<type>_<NN|NT|TN|TT>` and
//!   `GemmStridedBatchedTunableOp_...`; parameters `nt_<m>_<n>_<k>_ld_<lda>_<ldb>_<ldc>`,
//!   with `_B_<batch>` before `_ld` for a batch (recorded from PyTorch 2.11:
//!   `tests/data/tunableop_results0_pytorch_2.11.csv`).
//! - **The file**: `Validator,<key>,<value>` lines, then `OpSig,ParamSig,Solution,ms` rows,
//!   read by PyTorch's rules (`TuningResultsValidator::ValidateAll` in `Tunable.cpp`): the
//!   validators must be exactly PyTorch 2.11's on CUDA (`PT_VERSION`, 2.11.0, the version
//!   whose format this is); a mismatch, or a validator PyTorch does not know, rejects the
//!   whole file. Its solutions are `Default` (the classic cuBLAS call, the only one PyTorch
//!   2.11 has on CUDA).
//! - **Our choices beside it**: ours, `Gemm_Cublaslt_<rank>` (the heuristic's candidate of
//!   that rank), are valid only with the cuBLASLt they were tuned with, and PyTorch can use
//!   neither them nor a line saying which cuBLASLt (measured on the H200 with 2.11: an extra
//!   validator rejects the file with "Unmatched validator", and a row naming a solution it
//!   does not have fails the matmul). So they go to a file of their own,
//!   [`ferrocuda_file`]`(path)`, with `Validator,FERROCUDA_CUBLASLT_VERSION,<version>`;
//!   it is read after the main file, and dropped under another cuBLASLt.
use crate::MathLibError;
use ferrocuda_types::DType;
use rustc_hash::FxHashMap;

/// The PyTorch version whose TunableOp file this reads and writes.
pub const PT_VERSION: &str = "2.11.0";
/// Our validator: the cuBLASLt version our solutions were tuned with.
pub const CUBLASLT_VALIDATOR: &str = "FERROCUDA_CUBLASLT_VERSION";
/// PyTorch's solution for the untuned call.
pub const DEFAULT_SOLUTION: &str = "Default";
const LT_PREFIX: &str = "Gemm_Cublaslt_";

/// A tuned solution.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Solution {
    /// The classic cuBLAS call (PyTorch's `Default`).
    Default,
    /// cuBLASLt with the heuristic's candidate of this rank.
    CublasLt(usize),
}

impl Solution {
    /// Its name in the results file.
    pub fn name(self) -> String {
        match self {
            Solution::Default => DEFAULT_SOLUTION.to_string(),
            Solution::CublasLt(i) => format!("{LT_PREFIX}{i}"),
        }
    }

    fn parse(name: &str) -> Option<Solution> {
        if name == DEFAULT_SOLUTION {
            return Some(Solution::Default);
        }
        name.strip_prefix(LT_PREFIX)?
            .parse()
            .ok()
            .map(Solution::CublasLt)
    }
}

/// One row of the results file.
#[derive(Clone, Debug, PartialEq)]
pub struct TunedGemm {
    /// `GemmTunableOp_float_NN` and the like.
    pub op_sig: String,
    /// `nn_64_64_64_ld_64_64_64` and the like.
    pub param_sig: String,
    /// The fastest solution found.
    pub solution: Solution,
    /// Its time, in milliseconds.
    pub ms: f64,
}

/// What a GEMM's TunableOp signature says of it, as plain data (a hash-map key).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GemmShape {
    pub(crate) dtype: DType,
    pub(crate) trans: (bool, bool),
    pub(crate) mnk: (usize, usize, usize),
    pub(crate) lds: [usize; 3],
    pub(crate) batch: Option<usize>,
}

impl GemmShape {
    pub(crate) fn signatures(&self) -> Result<(String, String), MathLibError> {
        signatures(self.dtype, self.trans, self.mnk, self.lds, self.batch)
    }
}

/// The signatures PyTorch's TunableOp gives a GEMM.
pub fn signatures(
    dtype: DType,
    (transa, transb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    lds: [usize; 3],
    batch: Option<usize>,
) -> Result<(String, String), MathLibError> {
    let type_name = match dtype {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::F16 => "Half",
        DType::BF16 => "BFloat16",
        other => return Err(MathLibError::UnsupportedDtype(other)),
    };
    let letter = |t: bool| if t { 't' } else { 'n' };
    let ops: String = [letter(transa), letter(transb)].iter().collect();
    let op = if batch.is_some() {
        "GemmStridedBatchedTunableOp"
    } else {
        "GemmTunableOp"
    };
    let batch_part = batch.map_or(String::new(), |b| format!("_B_{b}"));
    Ok((
        format!("{op}_{type_name}_{}", ops.to_uppercase()),
        format!(
            "{ops}_{m}_{n}_{k}{batch_part}_ld_{}_{}_{}",
            lds[0], lds[1], lds[2]
        ),
    ))
}

/// A results file's contents.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ResultsFile {
    /// `Validator` lines, in order.
    pub validators: Vec<(String, String)>,
    /// The rows.
    pub rows: Vec<TunedGemm>,
}

impl ResultsFile {
    /// Reads a file's text: every line a validator or a row (blank lines skipped); a line
    /// that is neither is an error naming it.
    pub fn parse(text: &str) -> Result<ResultsFile, MathLibError> {
        let mut file = ResultsFile::default();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() {
                continue;
            }
            let parts: Vec<&str> = line.split(',').collect();
            let bad = || {
                MathLibError::TunableOp(format!(
                    "line {}: {line:?} is neither a validator nor a result",
                    i + 1
                ))
            };
            match parts.as_slice() {
                ["Validator", key, value] => {
                    file.validators.push((key.to_string(), value.to_string()))
                }
                [op, param, solution, ms] => {
                    let solution = Solution::parse(solution).ok_or_else(bad)?;
                    let ms = ms.trim().parse::<f64>().map_err(|_| bad())?;
                    file.rows.push(TunedGemm {
                        op_sig: op.to_string(),
                        param_sig: param.to_string(),
                        solution,
                        ms,
                    });
                }
                _ => return Err(bad()),
            }
        }
        Ok(file)
    }

    /// The file's text: validators, then rows (times as C++ streams print a double: six
    /// significant digits).
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (k, v) in &self.validators {
            out.push_str(&format!("Validator,{k},{v}\n"));
        }
        for r in &self.rows {
            out.push_str(&format!(
                "{},{},{},{}\n",
                r.op_sig,
                r.param_sig,
                r.solution.name(),
                six_digits(r.ms)
            ));
        }
        out
    }

    /// A validator's value: its last line, as PyTorch keeps the last value of a key.
    fn validator(&self, key: &str) -> Option<&str> {
        self.validators
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn check_pt_version(&self) -> Result<(), MathLibError> {
        match self.validator("PT_VERSION") {
            Some(PT_VERSION) => Ok(()),
            found => Err(MathLibError::TunableOp(format!(
                "the results file's PT_VERSION is {}, not {PT_VERSION}: the file is rejected",
                found.unwrap_or("missing")
            ))),
        }
    }

    /// The rows of PyTorch's file usable here, by PyTorch's rules: `PT_VERSION` must match
    /// and no other validator may be present (else the whole file is rejected, with
    /// PyTorch's warning for an unknown one); rows of our solutions are dropped (a PyTorch
    /// file cannot say which cuBLASLt they were tuned with).
    pub fn pytorch_rows(&self) -> Result<Vec<TunedGemm>, MathLibError> {
        self.check_pt_version()?;
        if let Some((key, _)) = self.validators.iter().find(|(k, _)| k != "PT_VERSION") {
            return Err(MathLibError::TunableOp(format!(
                "Unmatched validator: \"{key}\" is provided, but pytorch is unable to consume it: the file is rejected"
            )));
        }
        Ok(self
            .rows
            .iter()
            .filter(|r| r.solution == Solution::Default)
            .cloned()
            .collect())
    }

    /// The rows of our file ([`ferrocuda_file`]) usable under `cublaslt_version`: its
    /// `PT_VERSION` must match, and its cuBLASLt version too (else it is rejected: its rows
    /// were tuned with another cuBLASLt).
    pub fn ferrocuda_rows(&self, cublaslt_version: &str) -> Result<Vec<TunedGemm>, MathLibError> {
        self.check_pt_version()?;
        match self.validator(CUBLASLT_VALIDATOR) {
            Some(v) if v == cublaslt_version => Ok(self.rows.clone()),
            found => Err(MathLibError::TunableOp(format!(
                "the results were tuned with cuBLASLt {}, not {cublaslt_version}: they are not used",
                found.unwrap_or("(not said)")
            ))),
        }
    }
}

/// The file beside PyTorch's results file `path` that holds our solutions: `<path>.ferrocuda`.
pub fn ferrocuda_file(path: &str) -> String {
    format!("{path}.ferrocuda")
}

/// `ms` as `std::ostream << double` prints it (`%g`: six significant digits, no trailing
/// zeros, exponent form below 1e-4).
fn six_digits(ms: f64) -> String {
    if ms == 0.0 || !ms.is_finite() {
        return format!("{ms}");
    }
    // Rounded to six significant digits first: the exponent of the rounded value picks the
    // style (999999.5 prints 1e+06, 9.999995e-05 prints 0.0001).
    let rounded = format!("{ms:.5e}");
    let (mant, e) = rounded.split_once('e').unwrap_or((&rounded, "0"));
    let exp: i32 = e.parse().unwrap_or(0);
    let trim = |s: &str| -> String {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s.to_string()
        }
    };
    if !(-4..6).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{}e{sign}{:02}", trim(mant), exp.abs());
    }
    let decimals = (5 - exp).max(0) as usize;
    trim(&format!("{ms:.decimals$}"))
}

/// The TunableOp settings and results of one device.
#[derive(Debug, Clone)]
pub struct TunableState {
    /// Whether GEMMs look their signature up (and tune new ones if `tuning`).
    pub enabled: bool,
    /// Whether a signature not in the results is tuned (else the default call runs).
    pub tuning: bool,
    /// The file's name before the device ordinal is inserted.
    pub filename: String,
    /// How many cuBLASLt candidates a tuning tries besides the default call.
    pub max_candidates: usize,
    pub(crate) results: FxHashMap<(String, String), (Solution, f64)>,
    pub(crate) order: Vec<(String, String)>,
    /// Solutions by the GEMM's shape, filled at lookups: a hit formats no signature.
    pub(crate) by_shape: FxHashMap<GemmShape, Solution>,
    pub(crate) file_read: bool,
    /// Messages a PyTorch user would see as warnings (a rejected file).
    pub warnings: Vec<String>,
}

impl TunableState {
    /// From the environment, through `var`.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> TunableState {
        let on = |v: Option<String>| v.is_some_and(|v| v == "1");
        let enabled = match var("FERROCUDA_TUNABLEOP_ENABLED") {
            Some(v) => v == "1",
            None => on(var("PYTORCH_TUNABLEOP_ENABLED")),
        };
        TunableState {
            enabled,
            tuning: var("PYTORCH_TUNABLEOP_TUNING").is_none_or(|v| v != "0"),
            filename: var("PYTORCH_TUNABLEOP_FILENAME")
                .unwrap_or_else(|| "tunableop_results.csv".into()),
            max_candidates: 8,
            results: FxHashMap::default(),
            order: Vec::new(),
            by_shape: FxHashMap::default(),
            file_read: false,
            warnings: Vec::new(),
        }
    }

    /// The file of device `ordinal`: the ordinal inserted before the extension.
    pub fn filename_for(&self, ordinal: u16) -> String {
        match self.filename.rsplit_once('.') {
            Some((stem, ext)) if !stem.is_empty() && !ext.contains('/') => {
                format!("{stem}{ordinal}.{ext}")
            }
            _ => format!("{}{ordinal}", self.filename),
        }
    }

    pub(crate) fn insert(&mut self, key: (String, String), solution: Solution, ms: f64) {
        self.by_shape.clear();
        if self.results.insert(key.clone(), (solution, ms)).is_none() {
            self.order.push(key);
        }
    }

    /// The results, in the order they were found or read.
    pub fn results(&self) -> Vec<TunedGemm> {
        self.order
            .iter()
            .filter_map(|k| {
                self.results.get(k).map(|&(solution, ms)| TunedGemm {
                    op_sig: k.0.clone(),
                    param_sig: k.1.clone(),
                    solution,
                    ms,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RECORDED: &str = include_str!("../tests/data/tunableop_results0_pytorch_2.11.csv");

    #[test]
    fn pytorch_2_11_file_reads_and_writes_back_the_same() {
        let f = ResultsFile::parse(RECORDED).unwrap_or_default();
        assert_eq!(
            f.validators,
            [("PT_VERSION".to_string(), "2.11.0".to_string())]
        );
        assert_eq!(f.rows.len(), 18);
        assert_eq!(f.render(), RECORDED);
        assert_eq!(f.pytorch_rows().map(|r| r.len()).ok(), Some(18));
    }

    #[test]
    fn signatures_as_pytorch_writes_them() {
        let f = ResultsFile::parse(RECORDED).unwrap_or_default();
        let sig = |dtype, t, mnk, lds, batch| signatures(dtype, t, mnk, lds, batch).ok();
        let want = |op: &str, param: &str| Some((op.to_string(), param.to_string()));
        assert_eq!(
            sig(DType::F32, (false, false), (64, 64, 64), [64, 64, 64], None),
            want("GemmTunableOp_float_NN", "nn_64_64_64_ld_64_64_64")
        );
        assert_eq!(
            sig(
                DType::F16,
                (false, true),
                (256, 128, 512),
                [256, 128, 256],
                None
            ),
            want("GemmTunableOp_Half_NT", "nt_256_128_512_ld_256_128_256")
        );
        assert_eq!(
            sig(
                DType::BF16,
                (false, false),
                (256, 128, 512),
                [256, 512, 256],
                Some(3)
            ),
            want(
                "GemmStridedBatchedTunableOp_BFloat16_NN",
                "nn_256_128_512_B_3_ld_256_512_256"
            )
        );
        for (op, param) in [
            sig(DType::F32, (false, false), (64, 64, 64), [64, 64, 64], None),
            sig(
                DType::BF16,
                (false, false),
                (256, 128, 512),
                [256, 512, 256],
                Some(3),
            ),
        ]
        .into_iter()
        .flatten()
        {
            assert!(
                f.rows
                    .iter()
                    .any(|r| r.op_sig == op && r.param_sig == param),
                "{op} {param} in the recording"
            );
        }
        assert!(signatures(DType::I32, (false, false), (1, 1, 1), [1, 1, 1], None).is_err());
    }

    #[test]
    fn validators_reject_or_drop() {
        let other = RECORDED.replace("2.11.0", "2.10.0");
        let err = ResultsFile::parse(&other)
            .and_then(|f| f.pytorch_rows())
            .err();
        assert!(matches!(err, Some(MathLibError::TunableOp(m)) if m.contains("2.10.0")));
        let ours = "Validator,PT_VERSION,2.11.0\nValidator,FERROCUDA_CUBLASLT_VERSION,130100\nGemmTunableOp_float_NN,nn_8_8_8_ld_8_8_8,Gemm_Cublaslt_2,0.01\nGemmTunableOp_float_NT,nt_8_8_8_ld_8_8_8,Default,0.02\n";
        let f = ResultsFile::parse(ours).unwrap_or_default();
        assert_eq!(f.rows[0].solution, Solution::CublasLt(2));
        assert_eq!(f.ferrocuda_rows("130100").map(|r| r.len()).ok(), Some(2));
        assert!(
            f.ferrocuda_rows("130200").is_err(),
            "another cuBLASLt: its rows are refused"
        );
        let err = f
            .pytorch_rows()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("Unmatched validator: \"FERROCUDA_CUBLASLT_VERSION\""),
            "PyTorch rejects a file with our validator: {err}"
        );
        let mixed = ResultsFile {
            validators: vec![("PT_VERSION".into(), PT_VERSION.into())],
            rows: f.rows.clone(),
        };
        assert_eq!(
            mixed.pytorch_rows().map(|r| r.len()).ok(),
            Some(1),
            "our solutions in PyTorch's file are dropped"
        );
        assert!(ResultsFile::parse("GemmTunableOp_float_NN,nn,NoSuchSolution,1\n").is_err());
        assert!(ResultsFile::parse("a,b\n").is_err());
    }

    #[test]
    fn times_print_as_cpp_streams_do() {
        for (v, s) in [
            (0.0157971, "0.0157971"),
            (0.01, "0.01"),
            (1.5, "1.5"),
            (123456.7, "123457"),
            (0.00001234567, "1.23457e-05"),
            (2.0, "2"),
        ] {
            assert_eq!(six_digits(v), s);
        }
    }

    #[test]
    fn switches_and_file_names() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let s = TunableState::from_env(env(&[("PYTORCH_TUNABLEOP_ENABLED", "1")]));
        assert!(s.enabled && s.tuning);
        assert_eq!(s.filename_for(0), "tunableop_results0.csv");
        let s = TunableState::from_env(env(&[
            ("PYTORCH_TUNABLEOP_ENABLED", "1"),
            ("FERROCUDA_TUNABLEOP_ENABLED", "0"),
            ("PYTORCH_TUNABLEOP_TUNING", "0"),
            ("PYTORCH_TUNABLEOP_FILENAME", "/tmp/x/res.csv"),
        ]));
        assert!(!s.enabled && !s.tuning);
        assert_eq!(s.filename_for(3), "/tmp/x/res3.csv");
        assert!(!TunableState::from_env(env(&[])).enabled);
    }
}
