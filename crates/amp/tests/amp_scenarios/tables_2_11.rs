//! PyTorch 2.11's autocast lists: exactly the ops PyTorch 2.11 registers under each Autocast
//! dispatch key (`tests/data/autocast_registrations_2.11.json`, dumped from the installed
//! 2.11), with 2.11's policies where they differ from 2.15's.
use std::collections::BTreeSet;
use std::error::Error;

use ferrocuda_amp::autocast::{CastPolicy, DeviceKind, OpTables, listed_ops_in, op_tables};

const KEYS: [(&str, DeviceKind); 6] = [
    ("AutocastCUDA", DeviceKind::Cuda),
    ("AutocastCPU", DeviceKind::Cpu),
    ("AutocastXPU", DeviceKind::Xpu),
    ("AutocastMPS", DeviceKind::Mps),
    ("AutocastMTIA", DeviceKind::Mtia),
    ("AutocastMAIA", DeviceKind::Maia),
];

#[test]
fn the_2_11_tables_register_exactly_what_pytorch_2_11_does() -> Result<(), Box<dyn Error>> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/autocast_registrations_2.11.json"
    ))?;
    let dump: serde_json::Value = serde_json::from_str(&text)?;
    assert_eq!(dump["torch"], "2.11.0+cu130");
    for (key, device) in KEYS {
        let theirs: BTreeSet<String> = dump[key]
            .as_array()
            .ok_or(key)?
            .iter()
            .map(|op| {
                op.as_str()
                    .map(|s| s.trim_start_matches("aten::").to_owned())
            })
            .collect::<Option<_>>()
            .ok_or(key)?;
        let ours: BTreeSet<String> = listed_ops_in(OpTables::Pytorch2_11, device)
            .map(|(name, _)| name.to_owned())
            .collect();
        assert_eq!(
            ours.difference(&theirs).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "{key}: listed here, not by PyTorch 2.11"
        );
        assert_eq!(
            theirs.difference(&ours).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "{key}: listed by PyTorch 2.11, not here"
        );
    }
    Ok(())
}

#[test]
fn the_2_11_policies_differ_from_2_15_only_where_2_11_did() {
    let in_211 = |d, name: &str| {
        listed_ops_in(OpTables::Pytorch2_11, d).find_map(|(n, p)| (n == name).then_some(p))
    };
    let in_215 = |d, name: &str| {
        listed_ops_in(OpTables::Pytorch2_15, d).find_map(|(n, p)| (n == name).then_some(p))
    };
    for d in [
        DeviceKind::Cuda,
        DeviceKind::Xpu,
        DeviceKind::Mtia,
        DeviceKind::Maia,
    ] {
        assert_eq!(
            in_211(d, "softmax.Dimname"),
            Some(CastPolicy::Fp32SetOptDtype)
        );
        assert_eq!(
            in_211(d, "sum.dim_DimnameList"),
            Some(CastPolicy::Fp32SetOptDtype)
        );
        assert_eq!(
            in_211(d, "norm.names_ScalarOpt_dim"),
            Some(CastPolicy::Fp32AppendDtype {
                redispatch: "norm.names_ScalarOpt_dim_dtype"
            })
        );
        assert_eq!(in_211(d, "rms_norm"), None, "listed after 2.11");
        assert_eq!(in_215(d, "rms_norm"), Some(CastPolicy::Fp32));
    }
    assert_eq!(
        in_211(DeviceKind::Mps, "cumsum.dimname"),
        Some(CastPolicy::Fp32)
    );
    for op in ["cholesky", "qr", "prod.dim_Dimname"] {
        assert_eq!(in_211(DeviceKind::Cpu, op), Some(CastPolicy::Fp32), "{op}");
        assert_eq!(in_215(DeviceKind::Cpu, op), None, "{op}");
    }
    assert_eq!(
        in_211(DeviceKind::Cpu, "index_copy.dimname"),
        Some(CastPolicy::Promote)
    );
    assert_eq!(in_211(DeviceKind::Cuda, "linalg_matrix_sqrth"), None);
    // Every op both list has the same policy in both.
    for (_, device) in KEYS {
        for (name, p) in listed_ops_in(OpTables::Pytorch2_11, device) {
            if let Some(q) = in_215(device, name) {
                assert_eq!(p, q, "{device} {name}");
            }
        }
    }
    assert_eq!(op_tables(), OpTables::Pytorch2_15, "2.15's are the default");
}
