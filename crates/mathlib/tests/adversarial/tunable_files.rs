//! Adversarial scenarios: TunableOp's two results files through `Blas`.
//!
//! Rules: `write_tunable_file(path)` writes PyTorch's file at `path` (exactly
//! `Validator,PT_VERSION,2.11.0` and the `Default` rows) and our cuBLASLt rows to
//! `<path>.ferrocuda` with validators `PT_VERSION` and `FERROCUDA_CUBLASLT_VERSION` (the
//! backend's `lt_version()`), removing that file when there are none. `read_tunable_file`
//! reads PyTorch's file by PyTorch's rules (any validator but `PT_VERSION` 2.11.0 rejects
//! the whole file: an error; `Gemm_Cublaslt_*` rows in it dropped), then ours if present
//! (rows only under a matching cuBLASLt version; else none, and a warning, not an error).
use super::*;
use ferrocuda_driver::cublas::{GemmCall, MathMode};
use ferrocuda_mathlib::tunable::ferrocuda_file;
use ferrocuda_mathlib::{BlasBackend, HandleId, LtCall, LtCandidate};
use ferrocuda_testkit::temp_dir;
use std::path::{Path, PathBuf};

const V: &str = "Validator,PT_VERSION,2.11.0\n";

/// FakeBlas under another cuBLASLt version.
#[derive(Debug)]
struct Versioned {
    inner: FakeBlas,
    version: String,
}

impl BlasBackend for Versioned {
    fn sm_major(&self, device: DeviceIndex) -> Result<u32, MathLibError> {
        self.inner.sm_major(device)
    }
    fn create_handle(&self, device: DeviceIndex) -> Result<HandleId, MathLibError> {
        self.inner.create_handle(device)
    }
    fn destroy_handle(&self, handle: HandleId) {
        self.inner.destroy_handle(handle)
    }
    fn set_stream(&self, handle: HandleId, stream: StreamHandle) -> Result<(), MathLibError> {
        self.inner.set_stream(handle, stream)
    }
    fn set_math_mode(&self, handle: HandleId, mode: MathMode) -> Result<(), MathLibError> {
        self.inner.set_math_mode(handle, mode)
    }
    fn set_workspace(
        &self,
        handle: HandleId,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), MathLibError> {
        self.inner.set_workspace(handle, ptr, bytes)
    }
    fn gemm(&self, handle: HandleId, call: &GemmCall) -> Result<(), MathLibError> {
        self.inner.gemm(handle, call)
    }
    fn lt_candidates(
        &self,
        handle: HandleId,
        call: &GemmCall,
        workspace: u64,
        reduction_mask: Option<u32>,
        max: usize,
    ) -> Result<Vec<LtCandidate>, MathLibError> {
        self.inner
            .lt_candidates(handle, call, workspace, reduction_mask, max)
    }
    fn lt_gemm(
        &self,
        handle: HandleId,
        lt: &LtCall<'_>,
        stream: StreamHandle,
    ) -> Result<(), MathLibError> {
        self.inner.lt_gemm(handle, lt, stream)
    }
    fn synchronize(&self, stream: StreamHandle) -> Result<(), MathLibError> {
        self.inner.synchronize(stream)
    }
    fn lt_version(&self) -> String {
        self.version.clone()
    }
}

struct Rig {
    fake: Arc<FakeDriver>,
    alloc: Arc<CachingAllocator>,
    blas: Blas,
}

impl Rig {
    /// A Blas over FakeBlas (`lt_version` "fake"), or over a cuBLASLt of `version`.
    fn new(version: Option<&str>) -> Rig {
        let fake = Arc::new(FakeDriver::default());
        let alloc = Arc::new(
            CachingAllocator::new(fake.clone(), DEV, AllocatorConfig::default(), Caching::On)
                .unwrap(),
        );
        let inner = FakeBlas::new(fake.clone(), 9);
        let backend: Arc<dyn BlasBackend> = match version {
            None => Arc::new(inner),
            Some(v) => Arc::new(Versioned {
                inner,
                version: v.to_string(),
            }),
        };
        let sizes = WorkspaceSizes::from_env(|_| None, 9).unwrap();
        let blas = Blas::with_sizes(backend, alloc.clone(), sizes).unwrap();
        Rig { fake, alloc, blas }
    }

    /// Turns TunableOp on, with tuning, its own file name in `dir` (never written here).
    fn tune(&self, dir: &Path) {
        let f = dir.join("never.csv").to_string_lossy().into_owned();
        self.blas.update_tunable(|t| {
            t.enabled = true;
            t.tuning = true;
            t.filename = f;
        });
    }

    /// Runs `m × n × k` f32 GEMMs eagerly (each a new signature, tuned if tuning is on).
    fn gemms(&self, shapes: &[(usize, usize, usize)]) {
        let stream = self
            .fake
            .stream_create(DEV, StreamFlags::default())
            .unwrap();
        for &(m, n, k) in shapes {
            let a = self.alloc.allocate((m * k * 4) as u64, stream).unwrap();
            let b = self.alloc.allocate((k * n * 4) as u64, stream).unwrap();
            let c = self.alloc.allocate((m * n * 4) as u64, stream).unwrap();
            self.blas
                .gemm(
                    stream,
                    &Gemm::plain(DType::F32, m, n, k, a.ptr, b.ptr, c.ptr),
                )
                .unwrap();
        }
        self.fake.stream_synchronize(stream).unwrap();
    }

    fn results(&self) -> Vec<(String, String, Solution, f64)> {
        sorted(self.blas.tunable().results())
    }
}

fn sorted(rows: Vec<TunedGemm>) -> Vec<(String, String, Solution, f64)> {
    let mut v: Vec<_> = rows
        .into_iter()
        .map(|r| (r.op_sig, r.param_sig, r.solution, r.ms))
        .collect();
    v.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
    v
}

fn dir(tag: &str) -> PathBuf {
    let d = temp_dir(tag);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn read(p: &str) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{p}: {e}"))
}

/// Rows of a file: (validators, the other lines sorted).
fn split(text: &str) -> (Vec<String>, Vec<String>) {
    let (mut v, mut r): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
    for line in text.lines().filter(|l| !l.is_empty()) {
        if line.starts_with("Validator,") {
            v.push(line.to_string());
        } else {
            r.push(line.to_string());
        }
    }
    r.sort();
    (v, r)
}

const DEFAULT_ROWS: &str = "GemmTunableOp_float_NN,nn_8_8_8_ld_8_8_8,Default,0.0157971\n\
     GemmTunableOp_Half_TN,tn_5_6_7_ld_7_7_5,Default,0.5\n\
     GemmStridedBatchedTunableOp_BFloat16_NN,nn_16_24_32_B_2_ld_16_32_16,Default,1.5e-05\n";
const LT_ROWS: &str = "GemmTunableOp_float_NN,nn_16_16_16_ld_16_16_16,Gemm_Cublaslt_2,0.0123457\n\
     GemmTunableOp_double_NT,nt_9_9_9_ld_9_9_9,Gemm_Cublaslt_0,123457\n";

fn ours(version: &str, rows: &str) -> String {
    format!("{V}Validator,FERROCUDA_CUBLASLT_VERSION,{version}\n{rows}")
}

/// PyTorch's file with `DEFAULT_ROWS` and ours (version "fake") with `LT_ROWS` at `path`.
fn write_both(path: &str) {
    std::fs::write(path, format!("{V}{DEFAULT_ROWS}")).unwrap();
    std::fs::write(ferrocuda_file(path), ours("fake", LT_ROWS)).unwrap();
}

fn lines(text: &str) -> Vec<String> {
    let mut v: Vec<String> = text.lines().map(str::to_string).collect();
    v.sort();
    v
}

// ---------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------

/// Loaded Default and cuBLASLt rows, written: PyTorch's file is exactly its validator and
/// the Default rows; ours has exactly the two validators (PT_VERSION, then our cuBLASLt
/// version "fake") and the cuBLASLt rows.
#[test]
fn write_splits_default_and_cublaslt_rows_exactly() {
    let d = dir("tf-split");
    let src = s(&d.join("in.csv"));
    write_both(&src);
    let rig = Rig::new(None);
    assert_eq!(rig.blas.read_tunable_file(&src).unwrap(), 5);
    let out = s(&d.join("out.csv"));
    rig.blas.write_tunable_file(&out).unwrap();
    let pytorch = read(&out);
    assert!(pytorch.starts_with(V), "{pytorch:?}");
    let (v, rows) = split(&pytorch);
    assert_eq!(v, ["Validator,PT_VERSION,2.11.0"], "PyTorch's validators");
    assert_eq!(rows, lines(DEFAULT_ROWS), "PyTorch's rows");
    let mine = read(&ferrocuda_file(&out));
    let (v, rows) = split(&mine);
    assert_eq!(
        v,
        [
            "Validator,PT_VERSION,2.11.0",
            "Validator,FERROCUDA_CUBLASLT_VERSION,fake"
        ],
        "our validators"
    );
    assert_eq!(rows, lines(LT_ROWS), "our rows");
    assert_eq!(
        rig.blas.tunable_validators(),
        [
            ("PT_VERSION".to_string(), "2.11.0".to_string()),
            ("FERROCUDA_CUBLASLT_VERSION".to_string(), "fake".to_string())
        ]
    );
}

/// Round trip: results (read, then tuned on the fake) written, read by a fresh Blas: the
/// same results; written again: the same two files byte for byte.
#[test]
fn write_then_read_in_a_fresh_blas_gives_the_same_results() {
    let d = dir("tf-round");
    let src = s(&d.join("in.csv"));
    write_both(&src);
    let rig = Rig::new(None);
    rig.blas.read_tunable_file(&src).unwrap();
    rig.tune(&d);
    rig.gemms(&[(32, 32, 32), (8, 24, 40), (1, 1, 1), (64, 8, 16)]);
    let before = rig.results();
    assert_eq!(before.len(), 9, "{before:?}");
    let out = s(&d.join("out.csv"));
    rig.blas.write_tunable_file(&out).unwrap();
    let fresh = Rig::new(None);
    let n = fresh.blas.read_tunable_file(&out).unwrap();
    assert_eq!(n, before.len(), "rows loaded");
    let after = fresh.results();
    assert_eq!(after.len(), before.len());
    for (a, b) in before.iter().zip(&after) {
        assert_eq!((&a.0, &a.1, a.2), (&b.0, &b.1, b.2));
        assert!(
            (a.3 - b.3).abs() <= 1e-5 * a.3.abs(),
            "ms {} read back as {}",
            a.3,
            b.3
        );
    }
    assert!(fresh.blas.tunable().warnings.is_empty());
    let again = s(&d.join("again.csv"));
    fresh.blas.write_tunable_file(&again).unwrap();
    assert_eq!(lines(&read(&again)), lines(&read(&out)));
    assert_eq!(
        lines(&read(&ferrocuda_file(&again))),
        lines(&read(&ferrocuda_file(&out)))
    );
}

/// Loaded cuBLASLt solutions are used by the next GEMM of their signature.
#[test]
fn loaded_cublaslt_solutions_are_used() {
    let d = dir("tf-use");
    let src = s(&d.join("in.csv"));
    write_both(&src);
    let fake = Arc::new(FakeDriver::default());
    let alloc = Arc::new(
        CachingAllocator::new(fake.clone(), DEV, AllocatorConfig::default(), Caching::On).unwrap(),
    );
    let backend = Arc::new(FakeBlas::new(fake.clone(), 9));
    let blas = Blas::with_sizes(
        backend.clone(),
        alloc.clone(),
        WorkspaceSizes::from_env(|_| None, 9).unwrap(),
    )
    .unwrap();
    blas.read_tunable_file(&src).unwrap();
    blas.update_tunable(|t| {
        t.enabled = true;
        t.tuning = false;
    });
    let stream = fake.stream_create(DEV, StreamFlags::default()).unwrap();
    let buf = alloc.allocate(16 * 16 * 4, stream).unwrap();
    blas.gemm(
        stream,
        &Gemm::plain(DType::F32, 16, 16, 16, buf.ptr, buf.ptr, buf.ptr),
    )
    .unwrap();
    assert_eq!(backend.lt_runs(), [2], "the loaded Gemm_Cublaslt_2");
}

/// No results: PyTorch's file is exactly its validator; a stale file of ours beside it is
/// removed; reading back loads nothing.
#[test]
fn empty_results_write_the_validator_alone_and_remove_a_stale_file_of_ours() {
    let d = dir("tf-empty");
    let out = s(&d.join("out.csv"));
    std::fs::write(ferrocuda_file(&out), ours("fake", LT_ROWS)).unwrap();
    let rig = Rig::new(None);
    rig.blas.write_tunable_file(&out).unwrap();
    assert_eq!(read(&out), V);
    assert!(
        !Path::new(&ferrocuda_file(&out)).exists(),
        "the stale file of ours is still there"
    );
    let fresh = Rig::new(None);
    assert_eq!(fresh.blas.read_tunable_file(&out).unwrap(), 0);
    assert!(fresh.results().is_empty());
    // Only Default rows: the same.
    std::fs::write(ferrocuda_file(&out), ours("fake", LT_ROWS)).unwrap();
    let src = s(&d.join("defaults.csv"));
    std::fs::write(&src, format!("{V}{DEFAULT_ROWS}")).unwrap();
    let rig = Rig::new(None);
    rig.blas.read_tunable_file(&src).unwrap();
    rig.blas.write_tunable_file(&out).unwrap();
    assert!(!Path::new(&ferrocuda_file(&out)).exists());
    assert_eq!(lines(&read(&out)), lines(&format!("{V}{DEFAULT_ROWS}")));
}

/// Only cuBLASLt rows: PyTorch's file is the validator alone.
#[test]
fn only_cublaslt_rows_leave_pytorchs_file_with_its_validator_alone() {
    let d = dir("tf-onlylt");
    let src = s(&d.join("in.csv"));
    std::fs::write(&src, V).unwrap();
    std::fs::write(ferrocuda_file(&src), ours("fake", LT_ROWS)).unwrap();
    let rig = Rig::new(None);
    assert_eq!(rig.blas.read_tunable_file(&src).unwrap(), 2);
    let out = s(&d.join("out.csv"));
    rig.blas.write_tunable_file(&out).unwrap();
    assert_eq!(read(&out), V);
    assert_eq!(split(&read(&ferrocuda_file(&out))).1, lines(LT_ROWS));
}

/// Paths with dots in folder names (and none, or several, in the file's): ours is
/// `<path>.ferrocuda` exactly; the folder holds those two files and nothing else; they read
/// back.
#[test]
fn file_names_with_dots_in_folders() {
    let base = dir("tf-dots");
    for (folder, name) in [
        ("a.b", "results"),
        ("a.b.c", "tunable.results.csv"),
        (".hidden.d", "r.csv"),
        ("x.csv", "y"),
    ] {
        let d = base.join(folder);
        std::fs::create_dir_all(&d).unwrap();
        let src = s(&base.join(format!("src-{folder}.csv")));
        write_both(&src);
        let rig = Rig::new(None);
        rig.blas.read_tunable_file(&src).unwrap();
        let path = s(&d.join(name));
        assert_eq!(ferrocuda_file(&path), format!("{path}.ferrocuda"));
        rig.blas.write_tunable_file(&path).unwrap();
        let mut listed: Vec<String> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        listed.sort();
        assert_eq!(
            listed,
            [name.to_string(), format!("{name}.ferrocuda")],
            "{folder}"
        );
        let fresh = Rig::new(None);
        assert_eq!(
            fresh.blas.read_tunable_file(&path).unwrap(),
            5,
            "{folder}/{name}"
        );
    }
}

/// Writing into a folder that does not exist, reading a file that does not exist: typed
/// errors.
#[test]
fn missing_folders_and_files_are_typed_errors() {
    let d = dir("tf-missing");
    let rig = Rig::new(None);
    let nowhere = s(&d.join("no").join("such").join("r.csv"));
    let got = no_panic("write", || rig.blas.write_tunable_file(&nowhere));
    assert!(matches!(got, Err(MathLibError::TunableOp(_))), "{got:?}");
    let got = no_panic("read", || rig.blas.read_tunable_file(&nowhere));
    assert!(matches!(got, Err(MathLibError::TunableOp(_))), "{got:?}");
}

// ---------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------

/// Ours from another cuBLASLt: PyTorch's rows load, ours none, a warning, no error.
#[test]
fn a_stale_file_of_ours_from_another_cublaslt_loads_none_of_its_rows_and_warns() {
    let d = dir("tf-stale");
    let path = s(&d.join("r.csv"));
    write_both(&path);
    let rig = Rig::new(Some("13.1.0"));
    let n = rig.blas.read_tunable_file(&path).unwrap();
    assert_eq!(n, 3, "only PyTorch's rows");
    assert!(
        rig.results().iter().all(|r| r.2 == Solution::Default),
        "{:?}",
        rig.results()
    );
    assert!(
        !rig.blas.tunable().warnings.is_empty(),
        "no warning for a file of another cuBLASLt"
    );
}

/// The same the other way: written by a Blas over cuBLASLt "13.1.0", read under "fake".
#[test]
fn a_file_of_ours_written_under_another_cublaslt_is_not_loaded_and_warns() {
    let d = dir("tf-stale2");
    let rig2 = Rig::new(Some("13.1.0"));
    let src = s(&d.join("lt.csv"));
    std::fs::write(&src, V).unwrap();
    std::fs::write(ferrocuda_file(&src), ours("13.1.0", LT_ROWS)).unwrap();
    assert_eq!(rig2.blas.read_tunable_file(&src).unwrap(), 2);
    let out = s(&d.join("out.csv"));
    rig2.blas.write_tunable_file(&out).unwrap();
    assert!(read(&ferrocuda_file(&out)).contains("Validator,FERROCUDA_CUBLASLT_VERSION,13.1.0\n"));
    let fake = Rig::new(None);
    assert_eq!(fake.blas.read_tunable_file(&out).unwrap(), 0);
    assert!(fake.results().is_empty());
    assert!(!fake.blas.tunable().warnings.is_empty());
}

/// Ours with `PT_VERSION` 2.10.0 (or none, or an unreadable line): none of its rows, a
/// warning, not an error; PyTorch's rows still load.
#[test]
fn a_file_of_ours_with_another_pytorch_version_is_a_warning_not_an_error() {
    let d = dir("tf-pt210");
    for (what, text) in [
        (
            "PT_VERSION 2.10.0",
            format!(
                "Validator,PT_VERSION,2.10.0\nValidator,FERROCUDA_CUBLASLT_VERSION,fake\n{LT_ROWS}"
            ),
        ),
        (
            "no PT_VERSION",
            format!("Validator,FERROCUDA_CUBLASLT_VERSION,fake\n{LT_ROWS}"),
        ),
        (
            "garbage line",
            format!("{}not a line\n", ours("fake", LT_ROWS)),
        ),
    ] {
        let path = s(&d.join(format!("{}.csv", what.replace(' ', "_"))));
        std::fs::write(&path, format!("{V}{DEFAULT_ROWS}")).unwrap();
        std::fs::write(ferrocuda_file(&path), text).unwrap();
        let rig = Rig::new(None);
        let got = no_panic(what, || rig.blas.read_tunable_file(&path));
        assert_eq!(got, Ok(3), "{what}");
        assert!(
            rig.results().iter().all(|r| r.2 == Solution::Default),
            "{what}: {:?}",
            rig.results()
        );
        assert!(
            !rig.blas.tunable().warnings.is_empty(),
            "{what}: no warning"
        );
    }
}

/// PyTorch's file with any validator but `PT_VERSION` 2.11.0 is rejected whole: an error,
/// nothing loaded (our file beside it neither), results as they were.
#[test]
fn pytorchs_file_with_other_validators_is_rejected_and_loads_nothing() {
    let d = dir("tf-extra");
    let cases = [
        (
            "ROCm",
            format!("{V}Validator,ROCM_VERSION,6.2.0\n{DEFAULT_ROWS}"),
        ),
        (
            "ours in PyTorch's",
            format!("{V}Validator,FERROCUDA_CUBLASLT_VERSION,fake\n{DEFAULT_ROWS}"),
        ),
        (
            "late extra",
            format!("{V}{DEFAULT_ROWS}Validator,GCN_ARCH_NAME,gfx942\n"),
        ),
        (
            "2.10.0",
            format!("Validator,PT_VERSION,2.10.0\n{DEFAULT_ROWS}"),
        ),
        ("empty key", format!("{V}Validator,,x\n{DEFAULT_ROWS}")),
    ];
    for (what, text) in cases {
        let path = s(&d.join(format!("{}.csv", what.replace(' ', "_").replace('\'', ""))));
        std::fs::write(&path, text).unwrap();
        std::fs::write(ferrocuda_file(&path), ours("fake", LT_ROWS)).unwrap();
        let rig = Rig::new(None);
        // Something there before, to see it kept as it was.
        rig.tune(&d);
        rig.gemms(&[(4, 4, 4)]);
        let before = rig.results();
        let got = no_panic(what, || rig.blas.read_tunable_file(&path));
        assert!(
            matches!(got, Err(MathLibError::TunableOp(_))),
            "{what}: {got:?}"
        );
        assert_eq!(
            rig.results(),
            before,
            "{what}: rows loaded from a rejected file"
        );
    }
}

/// `Gemm_Cublaslt_*` rows found in PyTorch's file are dropped (with no file of ours).
#[test]
fn cublaslt_rows_in_pytorchs_file_are_dropped() {
    let d = dir("tf-drop");
    let path = s(&d.join("r.csv"));
    std::fs::write(&path, format!("{V}{DEFAULT_ROWS}{LT_ROWS}")).unwrap();
    let rig = Rig::new(None);
    assert_eq!(rig.blas.read_tunable_file(&path).unwrap(), 3);
    assert!(rig.results().iter().all(|r| r.2 == Solution::Default));
}

/// Reading one file twice keeps one result per signature.
#[test]
fn reading_twice_does_not_duplicate_results() {
    let d = dir("tf-twice");
    let path = s(&d.join("r.csv"));
    write_both(&path);
    let rig = Rig::new(None);
    rig.blas.read_tunable_file(&path).unwrap();
    let once = rig.results();
    rig.blas.read_tunable_file(&path).unwrap();
    assert_eq!(rig.results(), once);
    rig.blas.write_tunable_file(&path).unwrap();
    let (_, rows) = split(&read(&path));
    assert_eq!(rows, lines(DEFAULT_ROWS), "rows written twice");
}

// ---------------------------------------------------------------------------------------
// ResultsFile directly
// ---------------------------------------------------------------------------------------

/// `pytorch_rows` and `ferrocuda_rows` on edge files.
#[test]
fn results_file_rows_on_edge_files() {
    let parse = |t: &str| ResultsFile::parse(t).unwrap();
    // No rows.
    assert_eq!(parse(V).pytorch_rows().unwrap(), []);
    assert_eq!(parse(&ours("fake", "")).ferrocuda_rows("fake").unwrap(), []);
    // Ours read as PyTorch's: rejected (our validator is not PyTorch's).
    assert!(parse(&ours("fake", LT_ROWS)).pytorch_rows().is_err());
    // Versions compare exactly: another is refused.
    for other in ["fak", "fake ", "FAKE", ""] {
        assert!(
            parse(&ours("fake", LT_ROWS)).ferrocuda_rows(other).is_err(),
            "version {other:?}"
        );
    }
    // Every row of ours is kept (Default ones too) under the right version.
    let mixed = parse(&ours("fake", &format!("{DEFAULT_ROWS}{LT_ROWS}")));
    assert_eq!(mixed.ferrocuda_rows("fake").unwrap().len(), 5);
    // PyTorch's rows keep order and drop exactly the cuBLASLt ones.
    let p = parse(&format!("{V}{LT_ROWS}{DEFAULT_ROWS}{LT_ROWS}"));
    let rows = p.pytorch_rows().unwrap();
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r.solution == Solution::Default));
}

/// PyTorch's file giving `PT_VERSION` twice, 2.11.0 then 2.10.0: rejected (PyTorch keeps
/// the last value of a validator key, 2.10.0; and a `PT_VERSION` other than 2.11.0 is
/// present either way).
#[test]
fn pytorch_rows_rejects_a_second_pt_version_of_another_version() {
    let twice = format!("{V}Validator,PT_VERSION,2.10.0\n{DEFAULT_ROWS}");
    let got = ResultsFile::parse(&twice).unwrap().pytorch_rows();
    assert!(
        matches!(got, Err(MathLibError::TunableOp(_))),
        "2.11.0 then 2.10.0: {got:?}"
    );
}

/// Through `Blas::read_tunable_file`: such a PyTorch file is an error and loads nothing
/// (neither its rows nor those of our file beside it).
#[test]
fn read_rejects_pytorchs_file_with_a_second_pt_version_of_another_version() {
    let d = dir("tf-pt-twice");
    let path = s(&d.join("r.csv"));
    std::fs::write(
        &path,
        format!("{V}Validator,PT_VERSION,2.10.0\n{DEFAULT_ROWS}"),
    )
    .unwrap();
    std::fs::write(ferrocuda_file(&path), ours("fake", LT_ROWS)).unwrap();
    let rig = Rig::new(None);
    let got = rig.blas.read_tunable_file(&path);
    assert!(matches!(got, Err(MathLibError::TunableOp(_))), "{got:?}");
    assert!(rig.results().is_empty(), "{:?}", rig.results());
}

/// Our file giving `PT_VERSION` twice, the last another version: no rows.
#[test]
fn ferrocuda_rows_with_a_second_pt_version_of_another_version_gives_none() {
    let twice = format!("{}Validator,PT_VERSION,2.10.0\n", ours("fake", LT_ROWS));
    let got = ResultsFile::parse(&twice).unwrap().ferrocuda_rows("fake");
    assert!(!matches!(&got, Ok(r) if !r.is_empty()), "{got:?}");
}

/// Our file giving two cuBLASLt versions, the last another: no rows (PyTorch's reading of
/// validators keeps the last value of a key).
#[test]
fn ferrocuda_rows_with_two_cublaslt_versions_gives_none() {
    let twice = format!(
        "{}Validator,FERROCUDA_CUBLASLT_VERSION,13.1.0\n",
        ours("fake", LT_ROWS)
    );
    let got = ResultsFile::parse(&twice).unwrap().ferrocuda_rows("fake");
    assert!(!matches!(&got, Ok(r) if !r.is_empty()), "{got:?}");
}

/// Report-only: one signature in both files (Default in PyTorch's, cuBLASLt in ours):
/// which one is kept is not specified.
#[test]
fn a_signature_in_both_files_report() {
    let d = dir("tf-both");
    let path = s(&d.join("r.csv"));
    std::fs::write(
        &path,
        format!("{V}GemmTunableOp_float_NN,nn_16_16_16_ld_16_16_16,Default,0.5\n"),
    )
    .unwrap();
    std::fs::write(ferrocuda_file(&path), ours("fake", LT_ROWS)).unwrap();
    let rig = Rig::new(None);
    let n = no_panic("read", || rig.blas.read_tunable_file(&path));
    eprintln!(
        "a signature in both files: read {n:?}, results {:?}",
        rig.results()
    );
    let kept: Vec<_> = rig
        .results()
        .into_iter()
        .filter(|r| r.1 == "nn_16_16_16_ld_16_16_16")
        .collect();
    assert_eq!(kept.len(), 1, "one result per signature: {kept:?}");
}
