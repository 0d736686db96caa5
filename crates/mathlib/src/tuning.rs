//! TunableOp on [`Blas`]: which path a GEMM takes when tuning is on, the tuning itself, the
//! results file, and the preferred library (see [`crate::tunable`] for the rules).
//!
//! A tuning times the default call and up to `max_candidates` of cuBLASLt's heuristic
//! candidates on the call's stream, each on a scratch copy of C's extent (the caller's C
//! is written once, by the winner), in interleaved rounds of a burst of about a
//! millisecond each, and keeps the fastest. The
//! default call wins unless a candidate is faster by more than 1%: a tuned GEMM is never
//! slower than the untuned one by more than the timing's noise.
use crate::MathLibError;
use crate::gemm::{Gemm, Path};
use crate::handles::{Blas, Bound};
use crate::library_choice::BlasLibrary;
use crate::tunable::{self, GemmShape, ResultsFile, Solution, TunableState};
use ferrocuda_types::DevicePtr;
use std::time::Instant;

/// Rounds of timing: each times one burst of every candidate.
const ROUNDS: usize = 5;
/// How long one burst of a candidate lasts, about.
const BURST_MS: f64 = 1.0;
/// Most calls in one burst.
const MAX_REPS: u32 = 100;

impl Blas {
    /// `torch.backends.cuda.preferred_blas_library()`.
    pub fn preferred_blas_library(&self) -> BlasLibrary {
        *self.shared_preferred().lock()
    }

    /// `torch.backends.cuda.preferred_blas_library(backend)`.
    pub fn set_preferred_blas_library(&self, library: BlasLibrary) {
        *self.shared_preferred().lock() = library;
    }

    /// TunableOp's settings and results now.
    pub fn tunable(&self) -> TunableState {
        self.shared_tunable().lock().clone()
    }

    /// Changes TunableOp's settings (`torch.cuda.tunable.enable`, `tuning_enable`,
    /// `set_filename`, ...).
    pub fn update_tunable<R>(&self, f: impl FnOnce(&mut TunableState) -> R) -> R {
        f(&mut self.shared_tunable().lock())
    }

    /// The validators of our file ([`tunable::ferrocuda_file`]): `PT_VERSION` and the
    /// cuBLASLt version. PyTorch's file has `PT_VERSION` only.
    pub fn tunable_validators(&self) -> Vec<(String, String)> {
        vec![
            ("PT_VERSION".into(), tunable::PT_VERSION.into()),
            (
                tunable::CUBLASLT_VALIDATOR.into(),
                self.backend().lt_version(),
            ),
        ]
    }

    /// `torch.cuda.tunable.read_file`: loads the usable rows of PyTorch's file `path` (by
    /// PyTorch's rules: a rejected file loads nothing and is the error), then of our file
    /// beside it, if there is one (its rows only under the cuBLASLt they were tuned with;
    /// a rejected one is a warning in [`TunableState::warnings`]); returns how many rows
    /// were loaded.
    pub fn read_tunable_file(&self, path: &str) -> Result<usize, MathLibError> {
        let read = |path: &str| {
            std::fs::read_to_string(path)
                .map_err(|e| MathLibError::TunableOp(format!("{path}: {e}")))
        };
        let mut rows = ResultsFile::parse(&read(path)?)?.pytorch_rows()?;
        let ours = tunable::ferrocuda_file(path);
        if std::path::Path::new(&ours).exists() {
            let lt = self.backend().lt_version();
            match read(&ours).and_then(|t| ResultsFile::parse(&t)?.ferrocuda_rows(&lt)) {
                Ok(more) => rows.extend(more),
                Err(e) => self.shared_tunable().lock().warnings.push(e.to_string()),
            }
        }
        let n = rows.len();
        let mut t = self.shared_tunable().lock();
        for r in rows {
            t.insert((r.op_sig, r.param_sig), r.solution, r.ms);
        }
        Ok(n)
    }

    /// Writes the results: PyTorch's file at `path` (its validator and the `Default` rows,
    /// which PyTorch reads), and our cuBLASLt choices, with the cuBLASLt version, to
    /// [`tunable::ferrocuda_file`]`(path)` (removed when there are none).
    pub fn write_tunable_file(&self, path: &str) -> Result<(), MathLibError> {
        let (default, lt): (Vec<_>, Vec<_>) = self
            .shared_tunable()
            .lock()
            .results()
            .into_iter()
            .partition(|r| r.solution == Solution::Default);
        let write = |path: &str, file: ResultsFile| {
            std::fs::write(path, file.render())
                .map_err(|e| MathLibError::TunableOp(format!("{path}: {e}")))
        };
        let pytorch = ResultsFile {
            validators: vec![("PT_VERSION".into(), tunable::PT_VERSION.into())],
            rows: default,
        };
        write(path, pytorch)?;
        let ours = tunable::ferrocuda_file(path);
        if lt.is_empty() {
            return match std::fs::remove_file(&ours) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(MathLibError::TunableOp(format!("{ours}: {e}")))
                }
                _ => Ok(()),
            };
        }
        let validators = self.tunable_validators();
        write(
            &ours,
            ResultsFile {
                validators,
                rows: lt,
            },
        )
    }

    /// The path TunableOp gives `gemm`, if it is on: the result found (the device's file is
    /// read at the first look), else a new tuning's when tuning is on and `may_tune`.
    pub(crate) fn tuned_path(
        &self,
        bound: &Bound,
        gemm: &Gemm,
        may_tune: bool,
    ) -> Result<Option<Path>, MathLibError> {
        let shape = GemmShape {
            dtype: gemm.dtype,
            trans: (gemm.transa, gemm.transb),
            mnk: (gemm.m, gemm.n, gemm.k),
            lds: [gemm.lda, gemm.ldb, gemm.ldc],
            batch: gemm.batch.map(|b| b.count),
        };
        let key = {
            let mut t = self.shared_tunable().lock();
            if !t.enabled {
                return Ok(None);
            }
            if let Some(&solution) = t.by_shape.get(&shape) {
                return Ok(Some(path_of(solution)));
            }
            if !t.file_read {
                t.file_read = true;
                let file = t.filename_for(self.device().0);
                drop(t);
                if std::path::Path::new(&file).exists()
                    && let Err(e) = self.read_tunable_file(&file)
                {
                    self.shared_tunable().lock().warnings.push(e.to_string());
                }
                t = self.shared_tunable().lock();
            }
            let key = shape.signatures()?;
            if let Some(&(solution, _)) = t.results.get(&key) {
                t.by_shape.insert(shape, solution);
                return Ok(Some(path_of(solution)));
            }
            if !t.tuning || !may_tune {
                return Ok(None);
            }
            key
        };
        let (solution, ms) = self.tune(bound, gemm)?;
        self.shared_tunable().lock().insert(key, solution, ms);
        Ok(Some(path_of(solution)))
    }

    /// Times the default call and the cuBLASLt candidates on a scratch C; the fastest.
    fn tune(&self, bound: &Bound, gemm: &Gemm) -> Result<(Solution, f64), MathLibError> {
        let bytes = (gemm.c_elements() * gemm.dtype.size()) as u64;
        let allocator = self.allocator()?;
        let scratch = allocator.allocate(bytes, bound.stream)?;
        let result = self.time_candidates(bound, gemm, scratch.ptr);
        allocator.free(scratch.ptr)?;
        let timed = result?;
        let default = timed
            .iter()
            .find(|(s, _)| *s == Solution::Default)
            .map(|&(_, ms)| ms);
        let best = timed
            .iter()
            .copied()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .ok_or_else(|| MathLibError::TunableOp("no solution ran for this GEMM".into()))?;
        Ok(match default {
            Some(d) if best.1 >= d * 0.99 => (Solution::Default, d),
            _ => best,
        })
    }

    /// Per-call milliseconds of the default call and of cuBLASLt's candidates: a first
    /// call of each (which warms it up and sizes its bursts), then [`ROUNDS`] rounds that
    /// time a burst of each in turn, keeping each one's best. Interleaved so that a GPU
    /// whose clocks move during the tuning (an idle H200 takes a while to reach its
    /// steady clocks, then throttles) favours none of them.
    fn time_candidates(
        &self,
        bound: &Bound,
        gemm: &Gemm,
        scratch: DevicePtr,
    ) -> Result<Vec<(Solution, f64)>, MathLibError> {
        let max = self
            .shared_tunable()
            .lock()
            .max_candidates
            .min(crate::library_choice::LT_QUERY);
        let reps = |first_ms: f64| ((BURST_MS / first_ms.max(1e-6)) as u32).clamp(1, MAX_REPS);
        let mut paths = Vec::new();
        // The default call may be refused (split-K disallowed): then only cuBLASLt's.
        if let Ok(ms) = self.time_burst(bound, gemm, scratch, Path::Classic, 1) {
            paths.push((Solution::Default, Path::Classic, reps(ms)));
        }
        for rank in 0..max {
            match self.time_burst(bound, gemm, scratch, Path::Lt(rank), 1) {
                Ok(ms) => paths.push((Solution::CublasLt(rank), Path::Lt(rank), reps(ms))),
                Err(MathLibError::InvalidGemm(_)) => break,
                Err(e) => return Err(e),
            }
        }
        let mut best = vec![f64::INFINITY; paths.len()];
        for _ in 0..ROUNDS {
            for (ms, &(_, path, n)) in best.iter_mut().zip(&paths) {
                *ms = ms.min(self.time_burst(bound, gemm, scratch, path, n)?);
            }
        }
        Ok(paths.iter().map(|&(s, _, _)| s).zip(best).collect())
    }

    /// Milliseconds per call of `reps` back-to-back calls of `path`, between two waits.
    fn time_burst(
        &self,
        bound: &Bound,
        gemm: &Gemm,
        scratch: DevicePtr,
        path: Path,
        reps: u32,
    ) -> Result<f64, MathLibError> {
        let backend = self.backend();
        backend.synchronize(bound.stream)?;
        let t = Instant::now();
        for _ in 0..reps {
            self.run_path(bound, gemm, scratch, path)?;
        }
        backend.synchronize(bound.stream)?;
        Ok(t.elapsed().as_secs_f64() * 1e3 / f64::from(reps))
    }
}

fn path_of(solution: Solution) -> Path {
    match solution {
        Solution::Default => Path::Classic,
        Solution::CublasLt(rank) => Path::Lt(rank),
    }
}
