//! The churn example (`examples/churn.rs`, what `cargo xtask churn-profile` counts) on the
//! fake device: it runs its rounds and says where, in either shape, and refuses a malformed
//! configuration, count or shape by its message.
use ferrocuda_testkit::examples::run_example;
use std::process::Output;

fn churn(args: &[&str]) -> Result<Output, String> {
    run_example("churn", &[], args)
}

#[test]
fn the_churn_runs_its_rounds_on_the_fake_device() -> Result<(), String> {
    let out = churn(&["expandable_segments:True", "20000", "2"])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let line = text
        .lines()
        .find(|l| {
            l.starts_with("churn on the fake device, configuration \"expandable_segments:True\"")
        })
        .ok_or(format!("no result line: {text}"))?;
    let times = line
        .rsplit_once("ns per operation ")
        .map(|(_, t)| t.split(' ').count());
    assert_eq!(times, Some(2), "{line}");
    assert!(
        text.contains("driver calls in the timed rounds: Malloc 0"),
        "{text}"
    );
    Ok(())
}

/// The stand-in for the 8-thread pairs' locked path: 8 slots of 1 MiB, said by its line.
#[test]
fn the_pairs_shape_runs_eight_slots_of_one_mebibyte() -> Result<(), String> {
    let out = churn(&["", "20000", "1", "pairs"])?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("churn of 8 slots of 1 MiB on the fake device, configuration \"\""),
        "{text}"
    );
    Ok(())
}

#[test]
fn a_malformed_configuration_is_refused_by_its_message() -> Result<(), String> {
    let out = churn(&["bogus:1"])?;
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("Unrecognized key 'bogus'"), "{text}");
    let out = churn(&["", "many"])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("`many` is not a count"));
    let out = churn(&["", "100", "1", "triples"])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("`triples` is not a shape"));
    Ok(())
}
