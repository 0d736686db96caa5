//! Selecting PyTorch 2.11's autocast lists changes every later lookup, in every thread. The
//! selection is process-wide and the other autocast tests read the default: the scenario
//! runs in a process of its own (`fresh_process`).
#![forbid(unsafe_code)]
use ferrocuda_amp::autocast::{
    CastPolicy, DeviceKind, OpTables, all_listed_ops, listed_ops, op_tables, policy_by_name,
    select_op_tables,
};
use ferrocuda_testkit::fresh_process::{Outcome, Runner, Scenario, ensure};
use std::process::ExitCode;

const SCENARIOS: &[Scenario] = &[Scenario {
    name: "selecting_the_2_11_tables_changes_every_lookup",
    env: &[],
    run: selecting_the_2_11_tables_changes_every_lookup,
}];

fn selecting_the_2_11_tables_changes_every_lookup() -> Outcome {
    ensure(op_tables() == OpTables::Pytorch2_15, "2.15's by default")?;
    ensure(
        policy_by_name(DeviceKind::Cuda, "rms_norm") == Some(CastPolicy::Fp32),
        "2.15: rms_norm fp32",
    )?;
    select_op_tables(OpTables::Pytorch2_11);
    let other_thread = std::thread::spawn(|| policy_by_name(DeviceKind::Cuda, "rms_norm"))
        .join()
        .map_err(|_| "the thread panicked")?;
    ensure(
        other_thread.is_none(),
        "2.11: rms_norm not listed, in another thread",
    )?;
    ensure(
        policy_by_name(DeviceKind::Cpu, "cholesky") == Some(CastPolicy::Fp32),
        "2.11: CPU cholesky fp32",
    )?;
    ensure(
        listed_ops(DeviceKind::Cuda).count() == 126,
        "2.11: 126 CUDA ops",
    )?;
    ensure(
        all_listed_ops().contains(&"softmax.Dimname"),
        "2.11 lists the Dimname overloads",
    )?;
    select_op_tables(OpTables::Pytorch2_15);
    ensure(
        listed_ops(DeviceKind::Cuda).count() == 121,
        "back to 2.15: 121",
    )?;
    ensure(
        !all_listed_ops().contains(&"softmax.Dimname"),
        "2.15 lists no Dimname overload",
    )
}

fn main() -> ExitCode {
    Runner {
        variable: "FERROCUDA_AUTOCAST_TABLES_SCENARIO",
        cleared: &[],
        per_backend: false,
    }
    .main(SCENARIOS)
}
