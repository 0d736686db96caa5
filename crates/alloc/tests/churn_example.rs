//! The churn example (`examples/churn.rs`, what `cargo xtask churn-profile` counts) on the
//! fake device: it runs its rounds and says where, and refuses a malformed configuration
//! by its message.
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

#[test]
fn a_malformed_configuration_is_refused_by_its_message() -> Result<(), String> {
    let out = churn(&["bogus:1"])?;
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("Unrecognized key 'bogus'"), "{text}");
    let out = churn(&["", "many"])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("`many` is not a count"));
    Ok(())
}
