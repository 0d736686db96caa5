//! Precision flags as data: PyTorch's defaults, how the legacy setters write into the
//! table (`aten/src/ATen/Context.cpp`), the legacy getters failing where PyTorch 2.11's raise
//! (replayed from recorded programs), and the GEMM mapping.
use std::error::Error;

use ferrocuda_amp::precision::{
    Backend, CublasComputeType::*, CublasLtReductionScheme::*, CublasMathMode::*, CudaDataType::*,
    CudnnOp, Fp32Precision, MatmulPrecision, NoTf32Guard, PrecisionError, PrecisionOp,
    PrecisionSettings, ReductionOption, cublas_gemm, cublas_handle_math_mode, cublaslt_gemm,
    cudnn_allows_tf32, global, reduced_precision_disabled,
};
use ferrocuda_types::DType::{self, BF16, F16, F32, F64, I32};

type TestResult = Result<(), Box<dyn Error>>;

use Fp32Precision::{Bf16, Ieee, Inherit, Tf32};
use PrecisionOp::{All, Conv, Matmul, Rnn};

fn row(s: &PrecisionSettings, b: Backend) -> Result<Vec<Fp32Precision>, PrecisionError> {
    let ops: &[PrecisionOp] = if b == Backend::Generic {
        &[All]
    } else {
        &[All, Conv, Rnn, Matmul]
    };
    ops.iter().map(|op| s.get(b, *op)).collect()
}

#[test]
fn defaults_are_pytorchs() -> TestResult {
    let s = PrecisionSettings::default();
    assert_eq!(row(&s, Backend::Cuda)?, [Inherit, Tf32, Tf32, Inherit]);
    assert_eq!(row(&s, Backend::Mkldnn)?, [Inherit; 4]);
    assert_eq!(row(&s, Backend::Generic)?, [Inherit]);
    assert_eq!(s.resolve(Backend::Cuda, Matmul), Ieee);
    assert_eq!(s.fp32_precision(Backend::Cuda, Matmul)?, Inherit);
    assert!(!s.allow_tf32_matmul()?);
    assert!(s.allow_tf32_cudnn()?);
    assert_eq!(s.float32_matmul_precision()?, MatmulPrecision::Highest);
    assert!(
        s.allow_fp16_reduced_precision_reduction() && s.allow_bf16_reduced_precision_reduction()
    );
    assert!(!s.allow_fp16_accumulation());
    assert_eq!(
        global(),
        s,
        "no TORCH_ALLOW_TF32_CUBLAS_OVERRIDE in the test's environment"
    );
    assert_eq!(PrecisionSettings::from_env(|_| None), s);
    assert_eq!(PrecisionSettings::from_env(|_| Some("0".into())), s);
    let o = PrecisionSettings::from_env(|name| {
        (name == "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE").then(|| "1".into())
    });
    assert_eq!(o, PrecisionSettings::with_tf32_cublas_override());
    assert_eq!(o.float32_matmul_precision()?, MatmulPrecision::High);
    assert_eq!(
        (
            o.get(Backend::Cuda, Matmul)?,
            o.get(Backend::Mkldnn, Matmul)?
        ),
        (Tf32, Inherit),
        "the override leaves mkldnn matmul unset"
    );
    Ok(())
}

#[test]
fn legacy_setters_write_the_table_as_pytorch_does() -> TestResult {
    let cases = [
        (MatmulPrecision::Highest, Ieee, Ieee),
        (MatmulPrecision::High, Tf32, Tf32),
        (MatmulPrecision::Medium, Tf32, Bf16),
    ];
    for (p, cuda, mkldnn) in cases {
        let mut s = PrecisionSettings::default();
        s.set_float32_matmul_precision(p);
        assert_eq!(s.get(Backend::Cuda, Matmul)?, cuda);
        assert_eq!(s.get(Backend::Mkldnn, Matmul)?, mkldnn);
        assert_eq!(s.float32_matmul_precision()?, p);
    }
    let mut s = PrecisionSettings::default();
    s.set_allow_tf32_matmul(true);
    assert_eq!(
        (
            s.get(Backend::Cuda, Matmul)?,
            s.get(Backend::Mkldnn, Matmul)?
        ),
        (Tf32, Inherit)
    );
    assert_eq!(s.float32_matmul_precision()?, MatmulPrecision::High);
    s.set_allow_tf32_matmul(false);
    assert_eq!(s.get(Backend::Cuda, Matmul)?, Ieee);
    s.set_allow_tf32_cudnn(false);
    assert_eq!(
        (s.get(Backend::Cuda, Conv)?, s.get(Backend::Cuda, Rnn)?),
        (Inherit, Inherit)
    );
    assert!(!s.allow_tf32_cudnn()?);
    assert!(!cudnn_allows_tf32(&s, CudnnOp::Conv));
    s.set_allow_tf32_cudnn(true);
    assert!(cudnn_allows_tf32(&s, CudnnOp::Rnn));
    assert!(s.allow_tf32_cudnn()?);
    Ok(())
}

#[test]
fn mixing_the_apis_makes_the_legacy_getters_fail_with_pytorchs_texts() -> TestResult {
    let mut s = PrecisionSettings::default();
    s.set(Backend::Cuda, Matmul, Tf32)?;
    let text = |e: Result<bool, PrecisionError>| e.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        text(s.allow_tf32_matmul()).starts_with(
            "PyTorch is checking whether allow_tf32_new is enabled for cuBlas matmul,"
        )
    );
    assert!(
        text(s.float32_matmul_precision().map(|_| true)).starts_with(
            "PyTorch is checking the matmul precision without a specific backend name,"
        )
    );
    assert!(
        cudnn_allows_tf32(&s, CudnnOp::Conv),
        "kernels read the table"
    );
    // "medium" stays "medium" when CUDA matmul is then set to ieee: stored, not derived.
    let mut s = PrecisionSettings::default();
    s.set_float32_matmul_precision(MatmulPrecision::Medium);
    s.set(Backend::Cuda, Matmul, Ieee)?;
    assert_eq!(s.float32_matmul_precision()?, MatmulPrecision::Medium);
    assert_eq!(s.allow_tf32_matmul(), Err(PrecisionError::MixedMatmulTf32));
    // The legacy cuDNN flag is kept: conv and rnn set to ieee through the new API
    // contradict it.
    let mut s = PrecisionSettings::default();
    s.set(Backend::Cuda, Conv, Ieee)?;
    s.set(Backend::Cuda, Rnn, Ieee)?;
    assert!(
        text(s.allow_tf32_cudnn()).contains("cuDNN conv and cuDNN RNN have different TF32 flags.")
    );
    assert!(!cudnn_allows_tf32(&s, CudnnOp::Rnn));
    Ok(())
}

/// Every program of `tests/data/precision_oracle_2.11.json` (recorded from PyTorch 2.11 by
/// `xtask/torch/precision_oracle.py`) replayed on the settings: each getter answers what
/// PyTorch's answered, or fails with its message.
#[test]
fn recorded_pytorch_2_11_programs_give_the_same_answers() -> TestResult {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/precision_oracle_2.11.json"
    ))?;
    let oracle: serde_json::Value = serde_json::from_str(&text)?;
    let programs = oracle["programs"].as_array().ok_or("no programs")?;
    assert!(programs.len() >= 25, "{} programs", programs.len());
    for program in programs {
        let mut s = match program["env"]["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"].as_str() {
            Some(v) => PrecisionSettings::from_env(|_| Some(v.to_owned())),
            None => PrecisionSettings::default(),
        };
        for step in program["steps"].as_array().ok_or("no steps")? {
            replay(&mut s, step)?;
        }
        let expected = program["state"].as_object().ok_or("no state")?;
        for (getter, want) in expected {
            let got = read(&s, getter)?;
            assert_eq!(&got, want, "{getter} after {}", program["steps"]);
        }
    }
    Ok(())
}

/// An entry of the table.
type Entry = (Backend, PrecisionOp);

/// The entries that the Python attribute `path`'s `fp32_precision` reads and writes in
/// PyTorch 2.11 (`torch.backends.mkldnn.fp32_precision` writes the generic entry).
fn attribute(path: &str) -> Result<(Entry, Entry), String> {
    let (backend, op) = match path {
        "generic" => (Backend::Generic, All),
        "cuda.matmul" => (Backend::Cuda, Matmul),
        "cudnn" => (Backend::Cuda, All),
        "cudnn.conv" => (Backend::Cuda, Conv),
        "cudnn.rnn" => (Backend::Cuda, Rnn),
        "mkldnn" => return Ok(((Backend::Mkldnn, All), (Backend::Generic, All))),
        "mkldnn.matmul" => (Backend::Mkldnn, Matmul),
        "mkldnn.conv" => (Backend::Mkldnn, Conv),
        "mkldnn.rnn" => (Backend::Mkldnn, Rnn),
        other => return Err(format!("unknown attribute {other}")),
    };
    Ok(((backend, op), (backend, op)))
}

fn replay(s: &mut PrecisionSettings, step: &serde_json::Value) -> TestResult {
    let arg = |i: usize| {
        step.get(i)
            .ok_or_else(|| format!("step {step}: no argument {i}"))
    };
    match arg(0)?.as_str() {
        Some("matmul_precision") => {
            let p = MatmulPrecision::parse_lenient(arg(1)?.as_str().ok_or("not a string")?)?;
            s.set_float32_matmul_precision(p);
        }
        Some("allow_tf32_matmul") => {
            s.set_allow_tf32_matmul(arg(1)?.as_bool().ok_or("not a bool")?)
        }
        Some("allow_tf32_cudnn") => s.set_allow_tf32_cudnn(arg(1)?.as_bool().ok_or("not a bool")?),
        Some("fp32") => {
            let (_, (backend, op)) = attribute(arg(1)?.as_str().ok_or("not a string")?)?;
            let p: Fp32Precision = arg(2)?.as_str().ok_or("not a string")?.parse()?;
            s.set(backend, op, p)?;
        }
        _ => return Err(format!("unknown step {step}").into()),
    }
    Ok(())
}

/// What getter `name` of the oracle answers on `s`, in the oracle's JSON form.
fn read(s: &PrecisionSettings, name: &str) -> Result<serde_json::Value, Box<dyn Error>> {
    use serde_json::json;
    let answer = |r: Result<serde_json::Value, PrecisionError>| match r {
        Ok(v) => v,
        Err(e) => json!({ "error": e.to_string() }),
    };
    Ok(match name {
        "matmul_precision" => answer(s.float32_matmul_precision().map(|p| json!(p.to_string()))),
        "allow_tf32_matmul" => answer(s.allow_tf32_matmul().map(|b| json!(b))),
        "allow_tf32_cudnn" => answer(s.allow_tf32_cudnn().map(|b| json!(b))),
        path => {
            let ((backend, op), _) = attribute(path)?;
            answer(s.fp32_precision(backend, op).map(|p| json!(p.to_string())))
        }
    })
}

#[test]
fn resolution_inherits_backend_then_generic() -> TestResult {
    let mut s = PrecisionSettings::default();
    s.set(Backend::Generic, All, Tf32)?;
    assert_eq!(s.resolve(Backend::Cuda, Matmul), Tf32);
    assert_eq!(s.resolve(Backend::Mkldnn, Conv), Tf32);
    s.set(Backend::Mkldnn, All, Ieee)?;
    assert_eq!(s.resolve(Backend::Mkldnn, Conv), Ieee);
    s.set(Backend::Generic, All, Bf16)?;
    assert_eq!(
        s.resolve(Backend::Cuda, Matmul),
        Ieee,
        "bf16 reaching CUDA counts as unset"
    );
    assert_eq!(s.resolve(Backend::Mkldnn, Matmul), Ieee);
    assert_eq!(s.resolve(Backend::Mkldnn, Rnn), Ieee);
    Ok(())
}

#[test]
fn invalid_names_pairs_and_precisions_use_pytorch_texts() {
    let s = PrecisionSettings::default();
    let text = |e: Result<(), PrecisionError>| e.err().map(|e| e.to_string()).unwrap_or_default();
    assert_eq!(
        text("gpu".parse::<Backend>().map(drop)),
        "Unknown backend: gpu"
    );
    assert_eq!(
        text("fc".parse::<PrecisionOp>().map(drop)),
        "Unknown op: fc"
    );
    assert_eq!(
        text("bf16x9".parse::<Fp32Precision>().map(drop)),
        "Unknown precision: bf16x9"
    );
    assert_eq!(
        text(PrecisionSettings::default().set(Backend::Cuda, Matmul, Bf16)),
        "backend 'cuda' does not support precision 'bf16'"
    );
    assert_eq!(
        text(s.get(Backend::Generic, Conv).map(drop)),
        "Invalid (backend, op) pair: (generic, conv)"
    );
    assert_eq!(
        MatmulPrecision::parse_lenient("HIGH").ok(),
        Some(MatmulPrecision::High)
    );
    assert_eq!(
        text(MatmulPrecision::parse_lenient("fast").map(drop)),
        "fast is not one of 'highest', 'high', or 'medium'; the currentsetFloat32MatmulPrecision call has no effect."
    );
    for p in ["none", "ieee", "tf32", "bf16"] {
        assert_eq!(
            p.parse::<Fp32Precision>()
                .map(|p| p.to_string())
                .ok()
                .as_deref(),
            Some(p)
        );
    }
}

#[test]
fn reduction_options_and_their_getters() -> TestResult {
    let mut s = PrecisionSettings::default();
    assert_eq!(
        s.set_allow_fp16_reduced_precision_reduction(true, Some(false)),
        Err(PrecisionError::SplitKWithReducedPrecision)
    );
    for (allow, splitk, option) in [
        (true, None, ReductionOption::AllowReducedPrecisionWithSplitK),
        (
            false,
            None,
            ReductionOption::DisallowReducedPrecisionAllowSplitK,
        ),
        (
            false,
            Some(true),
            ReductionOption::DisallowReducedPrecisionAllowSplitK,
        ),
        (
            false,
            Some(false),
            ReductionOption::DisallowReducedPrecisionDisallowSplitK,
        ),
    ] {
        s.set_allow_fp16_reduced_precision_reduction(allow, splitk)?;
        s.set_allow_bf16_reduced_precision_reduction(allow, splitk)?;
        assert_eq!((s.fp16_reduction(), s.bf16_reduction()), (option, option));
        assert_eq!(s.allow_fp16_reduced_precision_reduction(), allow);
        let code = u8::from(!allow) + u8::from(splitk == Some(false));
        assert_eq!(option as u8, code, "CuBLASReductionOption encoding");
        assert_eq!(
            s.allow_bf16_reduced_precision_reduction_split_k(),
            splitk.unwrap_or(true)
        );
    }
    Ok(())
}

#[test]
fn cublas_math_mode_follows_tf32_and_the_guard() -> TestResult {
    let mut s = PrecisionSettings::default();
    assert_eq!(cublas_handle_math_mode(&s, false), CUBLAS_DEFAULT_MATH);
    s.set_allow_tf32_matmul(true);
    assert_eq!(
        cublas_handle_math_mode(&s, false),
        CUBLAS_TF32_TENSOR_OP_MATH
    );
    {
        let _g = NoTf32Guard::new();
        assert_eq!(
            cublas_handle_math_mode(&s, reduced_precision_disabled()),
            CUBLAS_DEFAULT_MATH
        );
        assert_eq!(
            cublas_gemm(&s, F32, 9, true)?.math_mode,
            CUBLAS_DEFAULT_MATH
        );
    }
    let g = cublas_gemm(&s, F32, 9, false)?;
    assert_eq!(
        (g.math_mode, g.compute_type, g.ab_type),
        (CUBLAS_TF32_TENSOR_OP_MATH, CUBLAS_COMPUTE_32F, CUDA_R_32F)
    );
    let g = cublas_gemm(&s, F64, 9, false)?;
    assert_eq!(
        (g.math_mode, g.compute_type),
        (CUBLAS_DEFAULT_MATH, CUBLAS_COMPUTE_64F)
    );
    Ok(())
}

#[test]
fn half_gemms_on_classic_cublas() -> TestResult {
    let mut s = PrecisionSettings::default();
    s.set_allow_tf32_matmul(true);
    for (dtype, ab) in [(F16, CUDA_R_16F), (BF16, CUDA_R_16BF)] {
        let g = cublas_gemm(&s, dtype, 8, false)?;
        assert_eq!(
            g.math_mode, CUBLAS_DEFAULT_MATH,
            "fp16/bf16 calls reset TF32"
        );
        assert!(!g.disallow_reduced_precision_reduction);
        assert_eq!(
            (g.compute_type, g.ab_type, g.scale_type),
            (CUBLAS_COMPUTE_32F, ab, CUDA_R_32F)
        );
    }
    s.set_allow_fp16_reduced_precision_reduction(false, None)?;
    assert!(cublas_gemm(&s, F16, 8, false)?.disallow_reduced_precision_reduction);
    assert!(!cublas_gemm(&s, BF16, 8, false)?.disallow_reduced_precision_reduction);
    assert!(
        !cublas_gemm(&s, F16, 4, false)?.disallow_reduced_precision_reduction,
        "sm < 5: SgemmEx"
    );
    s.set_allow_bf16_reduced_precision_reduction(false, Some(false))?;
    assert_eq!(
        cublas_gemm(&s, BF16, 8, false)
            .err()
            .map(|e| e.to_string())
            .as_deref(),
        Some(
            "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction(..., allow_splitk=False) requires the cuBLASLt backend"
        )
    );
    s.set_allow_fp16_accumulation(true);
    let g = cublas_gemm(&s, F16, 7, false)?;
    assert_eq!(
        (g.compute_type, g.scale_type),
        (CUBLAS_COMPUTE_16F, CUDA_R_16F)
    );
    assert_eq!(
        cublas_gemm(&s, F16, 6, false)?.compute_type,
        CUBLAS_COMPUTE_32F
    );
    assert_eq!(
        cublas_gemm(&s, BF16, 9, false).map(|g| g.compute_type).ok(),
        None
    );
    assert!(matches!(
        cublas_gemm(&s, I32, 9, false),
        Err(PrecisionError::UnsupportedGemmDtype(DType::I32))
    ));
    Ok(())
}

#[test]
fn cublaslt_compute_types_and_reduction_masks() -> TestResult {
    let mut s = PrecisionSettings::default();
    assert_eq!(
        cublaslt_gemm(&s, F32, 9, false)?.compute_type,
        CUBLAS_COMPUTE_32F
    );
    assert_eq!(
        cublaslt_gemm(&s, F64, 9, false)?.compute_type,
        CUBLAS_COMPUTE_64F
    );
    s.set_float32_matmul_precision(MatmulPrecision::High);
    assert_eq!(
        cublaslt_gemm(&s, F32, 9, false)?.compute_type,
        CUBLAS_COMPUTE_32F_FAST_TF32
    );
    assert_eq!(
        cublaslt_gemm(&s, F32, 9, true)?.compute_type,
        CUBLAS_COMPUTE_32F_FAST_TF32,
        "PyTorch's Lt path ignores NoTF32Guard"
    );
    s.lt_tf32_honours_guard = true;
    assert_eq!(
        cublaslt_gemm(&s, F32, 9, true)?.compute_type,
        CUBLAS_COMPUTE_32F
    );
    s.set(Backend::Cuda, Matmul, Fp32Precision::Bf16x9)?;
    assert_eq!(
        cublaslt_gemm(&s, F32, 9, false)?.compute_type,
        CUBLAS_COMPUTE_32F_EMULATED_16BFX9
    );
    assert_eq!(
        cublaslt_gemm(&s, F32, 9, true)?.compute_type,
        CUBLAS_COMPUTE_32F
    );
    assert!(
        s.set(Backend::Mkldnn, Matmul, Fp32Precision::Bf16x9)
            .is_err()
    );
    let masks = [
        (None, None),
        (
            Some(true),
            Some(
                &[
                    CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                    CUBLASLT_REDUCTION_SCHEME_NONE,
                ][..],
            ),
        ),
        (Some(false), Some(&[CUBLASLT_REDUCTION_SCHEME_NONE][..])),
    ];
    for (splitk, mask) in masks {
        s.set_allow_fp16_reduced_precision_reduction(splitk.is_none(), splitk)?;
        let g = cublaslt_gemm(&s, F16, 9, false)?;
        assert_eq!(g.reduction_scheme_mask, mask);
        assert_eq!(
            (g.ab_type, g.compute_type),
            (CUDA_R_16F, CUBLAS_COMPUTE_32F)
        );
        assert_eq!(
            cublaslt_gemm(&s, BF16, 9, false)?.reduction_scheme_mask,
            None
        );
    }
    s.set_allow_fp16_accumulation(true);
    let g = cublaslt_gemm(&s, F16, 9, false)?;
    assert_eq!(
        (g.compute_type, g.scale_type),
        (CUBLAS_COMPUTE_16F, CUDA_R_16F)
    );
    Ok(())
}
