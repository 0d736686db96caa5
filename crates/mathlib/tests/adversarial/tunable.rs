//! Adversarial scenarios: the TunableOp results file, signatures and file names.
use super::*;

// ---------------------------------------------------------------------------------------
// Rule 5: TunableOp
// ---------------------------------------------------------------------------------------

const PYTORCH_FILE: &str = include_str!("../data/tunableop_results0_pytorch_2.11.csv");

#[test]
fn pytorchs_results_file_round_trips_byte_for_byte() {
    let parsed = ResultsFile::parse(PYTORCH_FILE).unwrap();
    assert_eq!(
        parsed.validators,
        [("PT_VERSION".to_string(), "2.11.0".to_string())]
    );
    assert_eq!(parsed.rows.len(), 18);
    assert!(parsed.rows.iter().all(|r| r.solution == Solution::Default));
    assert_eq!(parsed.render(), PYTORCH_FILE);
    assert_eq!(parsed.pytorch_rows().unwrap(), parsed.rows);
    // Blank lines are skipped.
    let spaced = PYTORCH_FILE.replace('\n', "\n\n");
    assert_eq!(ResultsFile::parse(&spaced).unwrap(), parsed);
}

/// Every row of PyTorch's own file: its signatures are what `signatures` gives.
#[test]
fn signatures_reproduce_every_row_of_pytorchs_file() {
    let parsed = ResultsFile::parse(PYTORCH_FILE).unwrap();
    for row in &parsed.rows {
        let parts: Vec<&str> = row.op_sig.split('_').collect();
        let dtype = match parts[1] {
            "float" => DType::F32,
            "Half" => DType::F16,
            "BFloat16" => DType::BF16,
            "double" => DType::F64,
            other => panic!("{other}"),
        };
        let p: Vec<&str> = row.param_sig.split('_').collect();
        let trans = (&p[0][..1] == "t", &p[0][1..] == "t");
        let num = |s: &str| s.parse::<usize>().unwrap();
        let (mnk, rest) = ((num(p[1]), num(p[2]), num(p[3])), &p[4..]);
        let (batch, rest) = if rest[0] == "B" {
            (Some(num(rest[1])), &rest[2..])
        } else {
            (None, rest)
        };
        assert_eq!(rest[0], "ld");
        let lds = [num(rest[1]), num(rest[2]), num(rest[3])];
        let got = signatures(dtype, trans, mnk, lds, batch).unwrap();
        assert_eq!(got, (row.op_sig.clone(), row.param_sig.clone()));
    }
}

#[test]
fn signatures_of_the_brief_and_every_type_and_transpose() {
    let s = |d, t, mnk, lds, b| signatures(d, t, mnk, lds, b).unwrap();
    assert_eq!(
        s(DType::F32, (false, false), (64, 64, 64), [64, 64, 64], None),
        (
            "GemmTunableOp_float_NN".to_string(),
            "nn_64_64_64_ld_64_64_64".to_string()
        )
    );
    assert_eq!(
        s(
            DType::BF16,
            (false, false),
            (256, 128, 512),
            [256, 512, 256],
            Some(3)
        ),
        (
            "GemmStridedBatchedTunableOp_BFloat16_NN".to_string(),
            "nn_256_128_512_B_3_ld_256_512_256".to_string()
        )
    );
    assert_eq!(
        s(DType::F64, (true, false), (5, 6, 7), [7, 7, 5], None),
        (
            "GemmTunableOp_double_TN".to_string(),
            "tn_5_6_7_ld_7_7_5".to_string()
        )
    );
    assert_eq!(
        s(DType::F16, (true, true), (5, 6, 7), [7, 6, 5], Some(2)),
        (
            "GemmStridedBatchedTunableOp_Half_TT".to_string(),
            "tt_5_6_7_B_2_ld_7_6_5".to_string()
        )
    );
    let bad = no_panic("I32 signature", || {
        signatures(DType::I32, (false, false), (1, 1, 1), [1, 1, 1], None)
    });
    assert!(bad.is_err(), "{bad:?}");
}

#[test]
fn windows_line_endings_are_read_as_unix_or_refused() {
    let crlf = PYTORCH_FILE.replace('\n', "\r\n");
    let got = no_panic("CRLF", || ResultsFile::parse(&crlf));
    match got {
        Ok(f) => {
            assert_eq!(
                f,
                ResultsFile::parse(PYTORCH_FILE).unwrap(),
                "CRLF accepted: it must mean what the LF file means (no '\\r' kept)"
            );
            assert!(f.pytorch_rows().is_ok());
        }
        Err(e) => eprintln!("CRLF refused: {e}"),
    }
}

fn row_text(solution: &str, ms: &str) -> String {
    format!(
        "Validator,PT_VERSION,2.11.0\nGemmTunableOp_float_NN,nn_8_8_8_ld_8_8_8,{solution},{ms}\n"
    )
}

#[test]
fn malformed_lines_are_errors_not_panics() {
    let lines = [
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,Default",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64",
        "GemmTunableOp_float_NN",
        ",",
        ",,,",
        ",,,,",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,Default,0.01,extra",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,Default,abc",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,Default,",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,Default,0.01x",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,Default, ",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,Defaultx,0.01",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,default,0.01",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,Gemm_Cublaslt_,0.01",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,Gemm_Cublaslt_x,0.01",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,Gemm_Cublaslt_-1,0.01",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,Gemm_Cublaslt_99999999999999999999999,0.01",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,Gemm_Hipblaslt_3,0.01",
        "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,Gemm_Rocblas_3,0.01",
        "Validator,PT_VERSION",
        "Validator",
        "Validator,PT_VERSION,2.11.0,extra",
        "ünïcödé,ß,Default,0.1é",
    ];
    let mut failures = Vec::new();
    for line in lines {
        let text = format!("Validator,PT_VERSION,2.11.0\n{line}\n");
        let got = no_panic(&format!("parse {line:?}"), || ResultsFile::parse(&text));
        if let Ok(f) = got {
            failures.push(format!("{line:?}: accepted as {f:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn solution_names_round_trip() {
    assert_eq!(Solution::Default.name(), "Default");
    assert_eq!(Solution::CublasLt(3).name(), "Gemm_Cublaslt_3");
    for sol in [
        Solution::Default,
        Solution::CublasLt(0),
        Solution::CublasLt(7),
    ] {
        let text = row_text(&sol.name(), "0.5");
        let f = ResultsFile::parse(&text).unwrap();
        assert_eq!(f.rows[0].solution, sol);
        assert_eq!(f.render(), text);
    }
    // Non-canonical spellings of a rank: refused, or read back canonically and stably.
    for odd in ["Gemm_Cublaslt_+1", "Gemm_Cublaslt_01", "Gemm_Cublaslt_ 1"] {
        let text = row_text(odd, "0.5");
        let got = no_panic(odd, || ResultsFile::parse(&text));
        eprintln!("{odd}: {:?}", got.as_ref().map(|f| f.rows[0].solution));
        if let Ok(f) = got {
            let again = ResultsFile::parse(&f.render()).unwrap();
            assert_eq!(again, f, "{odd}: parse(render(parse(x))) == parse(x)");
        }
    }
}

#[test]

fn times_render_as_cpp_streams_print_doubles() {
    let cases: &[(f64, &str)] = &[
        (0.0157971, "0.0157971"),
        (1e-5, "1e-05"),
        (5e-5, "5e-05"),
        (0.0001, "0.0001"),
        (0.000123456789, "0.000123457"),
        (123456.4, "123456"),
        (1234567.0, "1.23457e+06"),
        (9.999995e-05, "0.0001"),
        (999999.5, "1e+06"),
        (0.1 + 0.2, "0.3"),
        (100.0, "100"),
        (0.0, "0"),
        (1.5, "1.5"),
        (2.0 / 3.0, "0.666667"),
        (1e-300, "1e-300"),
        (1e21, "1e+21"),
        (12345.65, "12345.6"),
        (1.0000005, "1"),
        (9.9999996, "10"),
    ];
    let mut failures = Vec::new();
    for &(ms, want) in cases {
        let f = ResultsFile {
            validators: vec![("PT_VERSION".into(), "2.11.0".into())],
            rows: vec![TunedGemm {
                op_sig: "GemmTunableOp_float_NN".into(),
                param_sig: "nn_8_8_8_ld_8_8_8".into(),
                solution: Solution::Default,
                ms,
            }],
        };
        let got = no_panic(&format!("render {ms}"), || f.render());
        if got != row_text("Default", want) {
            failures.push(format!("{ms:e}: rendered {got:?}, want ms {want}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// PyTorch's file by PyTorch 2.11's rules (measured on the H200: any validator but
/// `PT_VERSION` 2.11.0 rejects the file), our solutions dropped from it; our file beside it
/// needs `PT_VERSION` and gives its rows only under the cuBLASLt they were tuned with.
#[test]
fn pytorch_rows_follow_pytorch_and_ours_need_our_cublaslt_version() {
    let rows = "GemmTunableOp_float_NN,nn_8_8_8_ld_8_8_8,Default,0.5\n\
                GemmTunableOp_float_NT,nt_8_8_8_ld_8_8_8,Gemm_Cublaslt_1,0.25\n";
    let solutions = |r: Vec<TunedGemm>| r.into_iter().map(|t| t.solution).collect::<Vec<_>>();
    let pytorch = |validators: &str| {
        ResultsFile::parse(&format!("{validators}{rows}"))
            .unwrap()
            .pytorch_rows()
            .map(solutions)
    };
    let ours = |validators: &str, lt: &str| {
        ResultsFile::parse(&format!("{validators}{rows}"))
            .unwrap()
            .ferrocuda_rows(lt)
            .map(solutions)
    };
    for (v, what) in [
        ("Validator,PT_VERSION,2.10.0\n", "another version"),
        ("", "missing"),
        ("Validator,PT_VERSION,2.11.0 \n", "trailing blank"),
        ("Validator,PT_VERSION,2.11\n", "2.11"),
        ("Validator,PT_VERSION,\n", "empty"),
        ("Validator,pt_version,2.11.0\n", "lower-case key"),
        (
            "Validator,FERROCUDA_CUBLASLT_VERSION,13.0.0\n",
            "only our validator",
        ),
    ] {
        let got = no_panic(what, || pytorch(v));
        assert!(
            matches!(got, Err(MathLibError::TunableOp(_))),
            "{what}: {got:?}"
        );
        let got = no_panic(what, || ours(v, "13.0.0"));
        assert!(
            matches!(got, Err(MathLibError::TunableOp(_))),
            "ours, {what}: {got:?}"
        );
    }
    let with_lt = "Validator,PT_VERSION,2.11.0\nValidator,FERROCUDA_CUBLASLT_VERSION,13.0.0\n";
    assert!(
        matches!(pytorch(with_lt), Err(MathLibError::TunableOp(m)) if m.contains("Unmatched validator")),
        "PyTorch's file with our validator is rejected, as PyTorch rejects it"
    );
    assert_eq!(
        pytorch("Validator,PT_VERSION,2.11.0\n").unwrap(),
        [Solution::Default],
        "our solution in PyTorch's file is dropped"
    );
    assert_eq!(
        ours(with_lt, "13.0.0").unwrap(),
        [Solution::Default, Solution::CublasLt(1)]
    );
    assert!(ours(with_lt, "12.9.1").is_err(), "another cuBLASLt");
    assert!(
        ours("Validator,PT_VERSION,2.11.0\n", "13.0.0").is_err(),
        "no cuBLASLt line"
    );
    // Validators after rows count; an unknown one rejects PyTorch's file.
    let late = format!("{rows}Validator,PT_VERSION,2.11.0\n");
    let got = ResultsFile::parse(&late).and_then(|f| f.pytorch_rows());
    assert!(
        matches!(&got, Ok(r) if r.len() == 1),
        "late validator: {got:?}"
    );
    let unknown = format!("{late}Validator,SOMETHING_ELSE,1\n");
    let got = ResultsFile::parse(&unknown).and_then(|f| f.pytorch_rows());
    assert!(got.is_err(), "unknown validator: {got:?}");
}

#[test]
fn filename_for_inserts_the_ordinal_before_the_extension() {
    let state = |name: Option<&str>| {
        let mut s = TunableState::from_env(|_| None);
        if let Some(n) = name {
            s.filename = n.to_string();
        }
        s
    };
    assert_eq!(state(None).filename, "tunableop_results.csv");
    assert_eq!(state(None).filename_for(0), "tunableop_results0.csv");
    assert_eq!(state(None).filename_for(3), "tunableop_results3.csv");
    assert_eq!(
        state(None).filename_for(u16::MAX),
        "tunableop_results65535.csv"
    );
    assert_eq!(
        state(Some("/tmp/x/tunableop_results.csv")).filename_for(1),
        "/tmp/x/tunableop_results1.csv"
    );
    assert_eq!(
        state(Some("a.tar.gz")).filename_for(2),
        "a.tar2.gz",
        "last dot"
    );
    assert_eq!(state(Some("results")).filename_for(0), "results0");
    let from_env = TunableState::from_env(|k| {
        (k == "PYTORCH_TUNABLEOP_FILENAME").then(|| "mine.csv".to_string())
    });
    assert_eq!(from_env.filename_for(1), "mine1.csv");
    // Report-only: names whose only dot is in a folder, or that start with a dot.
    // PyTorch (`rfind('.')` on the whole path) gives "/tmp/a0.b/results" and "0.hidden".
    for name in ["/tmp/a.b/results", ".hidden", "dir.d/", "trailing.", ""] {
        let got = no_panic(name, || state(Some(name)).filename_for(0));
        eprintln!("filename_for({name:?}, 0) = {got:?}");
    }
}
