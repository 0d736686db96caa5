//! torchrun's variables read into a `DistEnv`: what a worker needs, and typed errors naming
//! the variable for what is missing or wrong (the cross-process runs are
//! `torchrun_process.rs`).
use ferrocuda_dist::{DistEnv, DistError};
use ferrocuda_types::DeviceIndex;
use std::collections::HashMap;

fn env(vars: &[(&str, &str)]) -> Result<DistEnv, DistError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    DistEnv::from_vars(|k| map.get(k).cloned())
}

const TORCHRUN: [(&str, &str); 8] = [
    ("RANK", "3"),
    ("WORLD_SIZE", "8"),
    ("LOCAL_RANK", "1"),
    ("LOCAL_WORLD_SIZE", "4"),
    ("MASTER_ADDR", "node0"),
    ("MASTER_PORT", "29500"),
    ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ("TORCHELASTIC_RESTART_COUNT", "2"),
];

#[test]
fn torchruns_variables_make_the_env() -> Result<(), DistError> {
    let e = env(&TORCHRUN)?;
    assert_eq!(
        e,
        DistEnv {
            rank: 3,
            world_size: 8,
            local_rank: 1,
            local_world_size: Some(4),
            master_addr: "node0".into(),
            master_port: 29500,
            agent_store: true,
            restart_count: 2,
            nonblocking_comm: false,
        }
    );
    assert_eq!(e.device(), DeviceIndex(1));
    // PyTorch's switch for non-blocking communicators: off unless set to a true value.
    for (value, on) in [("1", true), ("true", true), ("0", false), ("", false)] {
        let mut vars = TORCHRUN.to_vec();
        vars.push(("TORCH_NCCL_USE_COMM_NONBLOCKING", value));
        assert_eq!(env(&vars)?.nonblocking_comm, on, "{value:?}");
    }
    // `torch.distributed.launch`-style: no agent store, no local world size, LOCAL_RANK 0.
    let e = env(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1234"),
    ])?;
    assert!(!e.agent_store && e.local_rank == 0 && e.restart_count == 0);
    Ok(())
}

#[test]
fn missing_and_malformed_variables_are_named() {
    let without = |var: &str| -> Vec<(&str, &str)> {
        TORCHRUN
            .iter()
            .copied()
            .filter(|(k, _)| *k != var)
            .collect()
    };
    let with = |var: &'static str, value: &'static str| -> Vec<(&'static str, &'static str)> {
        let mut v = without(var);
        v.push((var, value));
        v
    };
    for var in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
        match env(&without(var)) {
            Err(DistError::Env { var: v, message }) => {
                assert_eq!(v, var);
                assert!(message.contains("torchrun"), "{message}");
            }
            other => panic!("{var} missing: {other:?}"),
        }
    }
    for (var, value) in [
        ("RANK", "x"),
        ("WORLD_SIZE", "-1"),
        ("LOCAL_RANK", "one"),
        ("MASTER_PORT", "70000"),
        ("TORCHELASTIC_RESTART_COUNT", "?"),
    ] {
        match env(&with(var, value)) {
            Err(DistError::Env { var: v, message }) => {
                assert_eq!(v, var);
                assert!(message.contains(value), "{message}");
            }
            other => panic!("{var}={value}: {other:?}"),
        }
    }
    assert_eq!(
        env(&with("RANK", "8")),
        Err(DistError::InvalidRank { rank: 8, size: 8 })
    );
    assert!(matches!(
        env(&with("WORLD_SIZE", "0")),
        Err(DistError::Env {
            var: "WORLD_SIZE",
            ..
        })
    ));
    assert!(matches!(
        env(&with("LOCAL_RANK", "4")),
        Err(DistError::Env {
            var: "LOCAL_RANK",
            ..
        })
    ));
}
