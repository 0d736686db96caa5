//! Defect 5: a state dict with a non-finite float did not survive JSON (serde_json writes
//! inf and NaN as `null`, which then loaded as a missing key). Non-finite floats are now the
//! strings "inf", "-inf" and "nan" (finite ones stay numbers), both forms are read back,
//! and PyTorch's key names are kept.
use super::{D0, TestResult, harness, live_scaler};
use ferrocuda_amp::scaler::ScalerStateDict;
use ferrocuda_amp::{GradScaler, GradScalerConfig};

fn dict(scale: f64) -> ScalerStateDict {
    ScalerStateDict {
        scale: Some(scale),
        growth_factor: Some(2.0),
        backoff_factor: Some(0.5),
        growth_interval: Some(2000),
        growth_tracker: Some(3),
    }
}

fn same(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (Some(x), Some(y)) => x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
        (x, y) => x == y,
    }
}

#[test]
fn non_finite_floats_round_trip_as_strings() -> TestResult {
    for (value, text) in [
        (f64::INFINITY, "\"inf\""),
        (f64::NEG_INFINITY, "\"-inf\""),
        (f64::NAN, "\"nan\""),
        (65536.0, "65536.0"),
        (-0.0, "-0.0"),
        (1e-300, "1e-300"),
    ] {
        for field in 0..3 {
            let mut sd = dict(1.0);
            *[&mut sd.scale, &mut sd.growth_factor, &mut sd.backoff_factor][field] = Some(value);
            let json = serde_json::to_string(&sd)?;
            let key = ["scale", "growth_factor", "backoff_factor"][field];
            assert!(json.contains(&format!("\"{key}\":{text}")), "{json}");
            let back: ScalerStateDict = serde_json::from_str(&json)?;
            assert!(same(back.scale, sd.scale), "{json}");
            assert!(same(back.growth_factor, sd.growth_factor), "{json}");
            assert!(same(back.backoff_factor, sd.backoff_factor), "{json}");
            assert_eq!(
                (back.growth_interval, back.growth_tracker),
                (sd.growth_interval, sd.growth_tracker)
            );
        }
    }
    Ok(())
}

#[test]
fn pytorchs_keys_and_both_input_forms() -> TestResult {
    let json = serde_json::to_value(dict(f64::INFINITY))?;
    let mut keys: Vec<&str> = json
        .as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "_growth_tracker",
            "backoff_factor",
            "growth_factor",
            "growth_interval",
            "scale"
        ]
    );
    let numbers: ScalerStateDict = serde_json::from_str(
        r#"{"scale": 1024, "growth_factor": 2.0, "backoff_factor": 0.5,
            "growth_interval": 7, "_growth_tracker": 1}"#,
    )?;
    assert_eq!(numbers.scale, Some(1024.0));
    let strings: ScalerStateDict = serde_json::from_str(
        r#"{"scale": "-inf", "growth_factor": "inf", "backoff_factor": "nan",
            "growth_interval": 7, "_growth_tracker": 1}"#,
    )?;
    assert_eq!(strings.scale, Some(f64::NEG_INFINITY));
    assert_eq!(strings.growth_factor, Some(f64::INFINITY));
    assert!(strings.backoff_factor.is_some_and(f64::is_nan));
    for other in ["lots", "0.5", "Infinity", "+inf", "NaN"] {
        let json = format!(r#"{{"scale": "{other}"}}"#);
        assert!(
            serde_json::from_str::<ScalerStateDict>(&json).is_err(),
            "other strings are refused: {json}"
        );
    }
    let empty: ScalerStateDict = serde_json::from_str("{}")?;
    assert!(empty.is_empty());
    assert_eq!(serde_json::to_string(&ScalerStateDict::default())?, "{}");
    Ok(())
}

/// Through two scalers: an infinite scale set by `update(new_scale)` is saved to JSON and
/// loaded into a fresh scaler, which then reports it.
#[test]
fn an_infinite_scale_survives_a_checkpoint() -> TestResult {
    let h = harness();
    let mut a = live_scaler(&h, 8.0)?;
    a.update_to(f32::INFINITY)?;
    let json = serde_json::to_string(&a.state_dict()?)?;
    let mut b = GradScaler::new(&h.rt, D0, GradScalerConfig::default())?;
    b.load_state_dict(&serde_json::from_str(&json)?)?;
    assert_eq!(b.scale()?, f64::INFINITY, "{json}");
    b.device_state()?;
    assert_eq!(b.scale()?, f64::INFINITY, "{json}");
    Ok(())
}
