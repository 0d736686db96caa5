//! The process-wide precision settings: they update in place and move their version, and
//! they start at PyTorch's override under `TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`.
//!
//! The settings are read from the environment once per process, and written by these
//! scenarios, which the other precision tests read: each scenario runs in a process of its
//! own (`fresh_process`).
#![forbid(unsafe_code)]
use ferrocuda_amp::precision::{
    Backend, Fp32Precision, MatmulPrecision, PrecisionOp, PrecisionSettings, global,
    global_version, update_global,
};
use ferrocuda_testkit::fresh_process::{Outcome, Runner, Scenario, ensure};
use std::process::ExitCode;

const OVERRIDE: &str = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE";

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "the_global_settings_update_in_place",
        env: &[],
        run: the_global_settings_update_in_place,
    },
    Scenario {
        name: "the_override_variable_starts_the_global_settings_at_high",
        env: &[(OVERRIDE, "1")],
        run: the_override_variable_starts_the_global_settings_at_high,
    },
];

fn the_global_settings_update_in_place() -> Outcome {
    let was = global();
    ensure(was == PrecisionSettings::default(), "PyTorch's defaults")?;
    let version = global_version();
    update_global(|s| s.set_float32_matmul_precision(MatmulPrecision::Medium));
    ensure(
        global().resolve(Backend::Mkldnn, PrecisionOp::Matmul) == Fp32Precision::Bf16,
        "medium: mkldnn matmul bf16",
    )?;
    ensure(global_version() > version, "an update moves the version")?;
    update_global(|s| *s = was);
    ensure(global() == was, "restored")
}

/// "high", CUDA matmul tf32, mkldnn matmul unset (so it resolves to ieee).
fn the_override_variable_starts_the_global_settings_at_high() -> Outcome {
    ensure(
        global() == PrecisionSettings::with_tf32_cublas_override(),
        format!("{:?}", global()),
    )?;
    ensure(
        global().float32_matmul_precision()? == MatmulPrecision::High,
        "legacy high",
    )?;
    ensure(
        global().resolve(Backend::Mkldnn, PrecisionOp::Matmul) == Fp32Precision::Ieee,
        "mkldnn matmul unset",
    )
}

fn main() -> ExitCode {
    Runner {
        variable: "FERROCUDA_PRECISION_SCENARIO",
        cleared: &[OVERRIDE],
        per_backend: false,
    }
    .main(SCENARIOS)
}
