//! Adversarial scenarios: `CUBLAS_WORKSPACE_CONFIG` and the other workspace variables.
use super::*;

// ---------------------------------------------------------------------------------------
// Rule 1: CUBLAS_WORKSPACE_CONFIG
// ---------------------------------------------------------------------------------------

/// `std::sregex_iterator` over `:([0-9]+):([0-9]+)`: leftmost match, then the next search
/// from the end of it. Every capture is `std::stoull`-ed (past 64 bits: error), each term
/// `SIZE * 1024 * COUNT` must fit 64 bits, and so must the sum. `Err` for overflow.
fn model_workspace_config(s: &str) -> Result<Option<u64>, String> {
    let b = s.as_bytes();
    let digits = |from: usize| {
        let mut j = from;
        while j < b.len() && b[j].is_ascii_digit() {
            j += 1;
        }
        j
    };
    let mut i = 0;
    let mut total: Option<u64> = None;
    while i < b.len() {
        if b[i] == b':' {
            let e1 = digits(i + 1);
            if e1 > i + 1 && e1 < b.len() && b[e1] == b':' {
                let e2 = digits(e1 + 1);
                if e2 > e1 + 1 {
                    let size: u64 = s[i + 1..e1].parse().map_err(|e| format!("{e}"))?;
                    let count: u64 = s[e1 + 1..e2].parse().map_err(|e| format!("{e}"))?;
                    let term = u128::from(size) * 1024 * u128::from(count);
                    let term = u64::try_from(term).map_err(|e| format!("{e}"))?;
                    total = Some(total.unwrap_or(0).checked_add(term).ok_or("sum overflow")?);
                    i = e2;
                    continue;
                }
            }
        }
        i += 1;
    }
    Ok(total)
}

#[test]
fn workspace_config_follows_regex_iterator_semantics() {
    let k = 1024u64;
    let cases: &[(&str, Option<u64>)] = &[
        ("", None),
        (":", None),
        ("::", None),
        (":1:", None),
        (":1", None),
        ("1:2", None),
        (":-1:2", None),
        (":+1:2", None),
        (":1: 2", None),
        (": 1:2", None),
        ("abc", None),
        (":1:2", Some(2 * k)),
        (":1:2:", Some(2 * k)),
        (":1:2:3:4", Some(2 * k + 12 * k)),
        (":1:2:3", Some(2 * k)),
        ("::1:2", Some(2 * k)),
        (":1::2:3", Some(6 * k)),
        ("x:0:0", Some(0)),
        (":0:0", Some(0)),
        (":007:2", Some(14 * k)),
        (":12:34:56", Some(12 * k * 34)),
        (":1:2:3:4:5:6", Some(2 * k + 12 * k + 30 * k)),
        (":1:23a:4:5", Some(23 * k + 20 * k)),
        (":4096:8", Some(MIB32)),
        (":4096:8x", Some(MIB32)),
        ("junk:4096:8junk", Some(MIB32)),
        (" :4096:8\n", Some(MIB32)),
        (":16:8:4096:2", Some(LEGACY_DEFAULT)),
        (":4096:2:16:8", Some(LEGACY_DEFAULT)),
        (":4096:2,:16:8", Some(LEGACY_DEFAULT)),
        // Unicode around and between matches; non-ASCII digits and colons are not [0-9] / ':'.
        ("é:1:2ü:3:4", Some(2 * k + 12 * k)),
        ("日本:4096:8語", Some(MIB32)),
        (":١:٢", None),
        (":１:２", None),
        ("：1：2", None),
        (":1:2\u{0301}", Some(2 * k)),
        // Leading zeros are not overflow (std::stoull reads them).
        (":0000000000000000000000000000001:1", Some(k)),
        (":1:0000000000000000000000000000002", Some(2 * k)),
        // Largest term that fits: 2^44 KiB * 2^10... (2^54 * 1024 = 2^64 is too big).
        (":16777216:1048575", Some(16_777_216 * 1024 * 1_048_575)),
    ];
    let mut failures = Vec::new();
    for &(input, want) in cases {
        let got = no_panic(&format!("parse_workspace_config({input:?})"), || {
            parse_workspace_config(input)
        });
        assert_eq!(
            model_workspace_config(input),
            Ok(want),
            "the model itself on {input:?}"
        );
        match got {
            Ok(v) if v == want => {}
            other => failures.push(format!("{input:?}: got {other:?}, want {want:?}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn workspace_config_overflow_is_an_error_not_a_panic() {
    let cases = [
        ":99999999999999999999999:1",
        ":1:99999999999999999999999",
        ":18446744073709551616:1",           // 2^64: stoull throws
        ":18446744073709551615:1",           // u64::MAX KiB: the product overflows
        ":18014398509481984:1",              // 2^54 * 1024 = 2^64
        ":4294967296:4294967296",            // 2^32 * 1024 * 2^32
        ":1:2:99999999999999999999999999:1", // a later match overflows
        &format!(":{}:1", "9".repeat(5000)),
    ];
    let mut failures = Vec::new();
    for input in cases {
        let got = no_panic(&format!("parse_workspace_config({:.40}...)", input), || {
            parse_workspace_config(input)
        });
        assert!(model_workspace_config(input).is_err(), "model on {input}");
        if got.is_ok() {
            failures.push(format!("{:.60}: got {got:?}, want Err", input));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Two terms of 2^63 bytes each: every number and every product fits 64 bits, the sum does
/// not. C++ would wrap `total_size` silently; the brief asks overflow be an `Err`.
#[test]
fn workspace_config_sum_overflow_is_an_error_not_a_panic() {
    let input = ":8589934592:1048576:8589934592:1048576"; // 2^33 KiB * 2^20, twice
    let got = no_panic("sum overflow", || parse_workspace_config(input));
    assert!(
        got.is_err(),
        "{input}: got {got:?}, want Err (sum past 64 bits)"
    );
}

/// `SIZE * 1024 * COUNT` is 0 when COUNT is 0, even when SIZE * 1024 alone is past 64 bits
/// (SIZE itself fits 64 bits, so `std::stoull` does not throw; PyTorch computes 0). Report
/// only: Some(0) or an error are both defensible; a panic or another value is not.
#[test]
fn workspace_config_huge_size_times_zero_count_is_zero_or_an_error() {
    let input = ":18014398509481984:0";
    let got = no_panic("huge*0", || parse_workspace_config(input));
    eprintln!("{input} -> {got:?} (PyTorch: 0; SIZE * 1024 alone is past 64 bits)");
    assert!(matches!(got, Ok(Some(0)) | Err(_)), "{input}: {got:?}");
}

/// Random strings over a hostile alphabet against the model above.
#[test]
fn workspace_config_random_strings_match_the_model() {
    let alphabet: Vec<&str> = vec![
        ":", ":", ":", "0", "1", "2", "7", "9", "x", " ", "é", "-", "٣", "\n",
    ];
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let mut failures = Vec::new();
    for _ in 0..3000 {
        let len = rng.below(16) as usize;
        let s: String = (0..len)
            .map(|_| alphabet[rng.below(alphabet.len() as u64) as usize])
            .collect();
        let want = model_workspace_config(&s);
        let got = no_panic(&format!("{s:?}"), || parse_workspace_config(&s));
        match (&want, &got) {
            (Ok(w), Ok(g)) if w == g => {}
            (Err(_), Err(_)) => {}
            _ => failures.push(format!("{s:?}: got {got:?}, want {want:?}")),
        }
    }
    failures.truncate(10);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------
// Rule 2: WorkspaceSizes::from_env
// ---------------------------------------------------------------------------------------

pub(crate) fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect();
    move |k: &str| map.get(k).cloned()
}

fn default_for(sm: u32) -> u64 {
    if matches!(sm, 9 | 10 | 12) {
        MIB32
    } else {
        LEGACY_DEFAULT
    }
}

#[test]
fn default_cublas_workspace_by_compute_capability() {
    let mut failures = Vec::new();
    for sm in (0..=13).chain([20, 90, 100, u32::MAX]) {
        let got = no_panic(&format!("sm {sm}"), || {
            WorkspaceSizes::from_env(env(&[]), sm)
        });
        match got {
            Ok(w) => {
                if w.cublas != default_for(sm) || !w.warnings.is_empty() {
                    failures.push(format!(
                        "sm {sm}: cublas {} warnings {:?}, want {}",
                        w.cublas,
                        w.warnings,
                        default_for(sm)
                    ));
                }
                if !w.unified || w.cublaslt != w.cublas {
                    failures.push(format!(
                        "sm {sm}: unset: unified {} lt {} (want unified, lt = cublas {})",
                        w.unified, w.cublaslt, w.cublas
                    ));
                }
            }
            Err(e) => failures.push(format!("sm {sm}: {e:?}")),
        }
        assert_eq!(
            ferrocuda_mathlib::workspace_config::default_cublas_workspace(sm),
            default_for(sm),
            "default_cublas_workspace({sm})"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn unparsable_cublas_workspace_config_warns_and_uses_the_default() {
    let mut failures = Vec::new();
    for sm in [8, 9] {
        for bad in [
            "", "abc", ":", ":1:", "1:2", "4096:8", ": 4096:8", ":-1:-1", ":１:２",
        ] {
            let w = WorkspaceSizes::from_env(env(&[("CUBLAS_WORKSPACE_CONFIG", bad)]), sm);
            let want = default_for(sm);
            let text = format!(
                "Could not parse CUBLAS_WORKSPACE_CONFIG, using default workspace size of {want} bytes."
            );
            match w {
                Ok(w) if w.cublas == want && w.warnings == [text.clone()] => {}
                other => failures.push(format!("sm {sm} {bad:?}: {other:?}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn cublas_workspace_config_values_are_read_and_overflow_is_an_error() {
    let ok = [
        (":0:0", 0),
        (":4096:8", MIB32),
        (":16:8:4096:2", LEGACY_DEFAULT),
        (":1:1", 1024),
        ("garbage:1:1garbage", 1024),
    ];
    for (v, want) in ok {
        let w = WorkspaceSizes::from_env(env(&[("CUBLAS_WORKSPACE_CONFIG", v)]), 8).unwrap();
        assert_eq!((w.cublas, w.warnings.len()), (want, 0), "{v:?}: {w:?}");
        // Unified and no CUBLASLT_WORKSPACE_SIZE: the cuBLAS size.
        assert_eq!((w.unified, w.cublaslt), (true, want), "{v:?}: {w:?}");
    }
    let bad = WorkspaceSizes::from_env(
        env(&[("CUBLAS_WORKSPACE_CONFIG", ":99999999999999999999999:1")]),
        9,
    );
    assert!(
        matches!(bad, Err(MathLibError::WorkspaceConfig(_))),
        "{bad:?}"
    );
}

#[test]
fn unified_workspace_flag() {
    let w = |v: Option<&str>| {
        let pairs: Vec<(&str, &str)> = v
            .map(|v| vec![("TORCH_CUBLASLT_UNIFIED_WORKSPACE", v)])
            .unwrap_or_default();
        WorkspaceSizes::from_env(env(&pairs), 9).unwrap()
    };
    let unset = w(None);
    assert!(unset.unified && unset.warnings.is_empty(), "{unset:?}");
    let one = w(Some("1"));
    assert!(one.unified && one.warnings.is_empty(), "{one:?}");
    assert_eq!(one.cublaslt, MIB32, "unified: the cuBLAS size");
    let zero = w(Some("0"));
    assert!(!zero.unified && zero.warnings.is_empty(), "{zero:?}");
    assert_eq!(zero.cublaslt, 1024 * 1024, "not unified: 1 024 KiB");
    let mut failures = Vec::new();
    for other in [
        "", "2", "true", "false", " 1", "1 ", "01", "00", "yes", "0x1", "١",
    ] {
        let got = w(Some(other));
        let warned = got.warnings.len() == 1
            && got.warnings[0].contains("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
            && got.warnings[0].contains(other);
        if !got.unified || !warned || got.cublaslt != MIB32 {
            failures.push(format!("{other:?}: {got:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// c10::utils::check_env's text, word for word (its missing space included).
#[test]
fn unified_workspace_warning_is_pytorchs_text() {
    let got =
        WorkspaceSizes::from_env(env(&[("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "2")]), 9).unwrap();
    assert_eq!(
        got.warnings,
        [
            "Ignoring invalid value for boolean flag TORCH_CUBLASLT_UNIFIED_WORKSPACE: 2valid values are 0 or 1."
        ],
    );
}

#[derive(Debug, PartialEq)]
enum Stoi {
    Value(i32),
    Invalid,
    OutOfRange,
}

/// `std::stoi`: C `isspace` blanks, an optional sign, decimal digits, the rest ignored.
fn stoi(s: &str) -> Stoi {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r') {
        i += 1;
    }
    let neg = i < b.len() && b[i] == b'-';
    if i < b.len() && (b[i] == b'-' || b[i] == b'+') {
        i += 1;
    }
    let start = i;
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    if i == start {
        return Stoi::Invalid;
    }
    let mag: u128 = s[start..i].parse().unwrap_or(u128::MAX);
    let v = if neg {
        -(mag.min(1 << 100) as i128)
    } else {
        mag.min(1 << 100) as i128
    };
    match i32::try_from(v) {
        Ok(v) => Stoi::Value(v),
        Err(_) => Stoi::OutOfRange,
    }
}

#[test]
fn cublaslt_workspace_size_is_read_like_stoi() {
    let values = [
        "64",
        "  64",
        "\t\n\r64",
        "\x0b64", // vertical tab: C isspace, not Rust's is_ascii_whitespace
        "\x0c64", // form feed
        "+64",
        "64kib",
        "64 ",
        "0064",
        "12.9",
        "1e3",
        "0x10",
        "0",
        "2147483647",
        "2147483648",
        "99999999999999999999999",
        "-2147483649",
        "",
        "   ",
        "+",
        "-",
        "+-1",
        "- 1",
        "abc",
        "\u{a0}64", // no-break space: not C isspace
        "\u{3000}64",
        "６４",
        "١٢",
    ];
    let mut failures = Vec::new();
    for unified in [true, false] {
        for v in values {
            let flag = if unified { "1" } else { "0" };
            let got = no_panic(&format!("CUBLASLT_WORKSPACE_SIZE={v:?}"), || {
                WorkspaceSizes::from_env(
                    env(&[
                        ("CUBLASLT_WORKSPACE_SIZE", v),
                        ("TORCH_CUBLASLT_UNIFIED_WORKSPACE", flag),
                    ]),
                    9,
                )
            });
            let default = if unified { MIB32 } else { 1 << 20 };
            let (want, warns) = match stoi(v) {
                Stoi::Value(x) if x >= 0 => (x as u64 * 1024, false),
                Stoi::Value(_) => unreachable!("negatives are not in this table"),
                Stoi::Invalid | Stoi::OutOfRange => (default, true),
            };
            match &got {
                Ok(w)
                    if w.cublaslt == want
                        && w.warnings.len() == usize::from(warns)
                        && w.warnings
                            .iter()
                            .all(|t| t.contains("CUBLASLT_WORKSPACE_SIZE")) => {}
                other => failures.push(format!(
                    "unified {unified} {v:?}: got {other:?}, want {want} warn {warns}"
                )),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// PyTorch's two stoi warnings, word for word; the default named in KiB (the cuBLAS size
/// when unified: `parseChosenWorkspaceSize() / 1024`, else 1 024).
#[test]
fn cublaslt_workspace_size_warnings_are_pytorchs_text() {
    let w = |v: &str, flag: &str| {
        WorkspaceSizes::from_env(
            env(&[
                ("CUBLASLT_WORKSPACE_SIZE", v),
                ("TORCH_CUBLASLT_UNIFIED_WORKSPACE", flag),
            ]),
            9,
        )
        .unwrap()
        .warnings
    };
    assert_eq!(
        w("abc", "0"),
        ["invalid CUBLASLT_WORKSPACE_SIZE, using default workspace size of 1024 KiB."]
    );
    assert_eq!(
        w("99999999999", "0"),
        ["CUBLASLT_WORKSPACE_SIZE out of range, using default workspace size of 1024 KiB."]
    );
    assert_eq!(
        w("abc", "1"),
        ["invalid CUBLASLT_WORKSPACE_SIZE, using default workspace size of 32768 KiB."]
    );
}

#[test]
fn negative_cublaslt_workspace_size_is_an_error() {
    for v in ["-1", " -64", "-2147483648", "-1kib"] {
        let got = WorkspaceSizes::from_env(env(&[("CUBLASLT_WORKSPACE_SIZE", v)]), 9);
        assert!(
            matches!(got, Err(MathLibError::WorkspaceConfig(_))),
            "{v:?}: {got:?}"
        );
    }
}

/// "-0" is zero to std::stoi, not a negative number: 0 bytes, no error, no warning.
#[test]
fn minus_zero_cublaslt_workspace_size_is_zero() {
    let got = WorkspaceSizes::from_env(
        env(&[
            ("CUBLASLT_WORKSPACE_SIZE", "-0"),
            ("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0"),
        ]),
        9,
    );
    assert!(
        matches!(&got, Ok(w) if w.cublaslt == 0 && w.warnings.is_empty()),
        "{got:?}"
    );
}

#[test]
fn effective_lt_limits_only_when_unified() {
    assert_eq!(
        WorkspaceSizes::effective_lt(false, 1000, 2000),
        (2000, None)
    );
    assert_eq!(WorkspaceSizes::effective_lt(true, 2000, 1000), (1000, None));
    assert_eq!(WorkspaceSizes::effective_lt(true, 2000, 2000), (2000, None));
    let (bytes, warning) = WorkspaceSizes::effective_lt(true, 1000, 2000);
    assert_eq!(bytes, 1000);
    assert_eq!(
        warning.as_deref(),
        Some(
            "Requested unified CUBLASLT workspace size of 2000 bytes exceeds CUBLAS workspace size of 1000 bytes. Please increase CUBLAS workspace size via CUBLAS_WORKSPACE_CONFIG or decrease requested CUBLASLT_WORKSPACE_SIZE. Otherwise CUBLASLT workspace size will be limited to the CUBLAS workspace size."
        )
    );
    // Unified with a larger explicit cuBLASLt size: `cublaslt` holds it as parsed.
    let w = WorkspaceSizes::from_env(
        env(&[
            ("CUBLAS_WORKSPACE_CONFIG", ":1:1"),
            ("CUBLASLT_WORKSPACE_SIZE", "64"),
        ]),
        9,
    )
    .unwrap();
    assert_eq!(
        (w.cublas, w.cublaslt, w.unified),
        (1024, 65536, true),
        "{w:?}"
    );
}
