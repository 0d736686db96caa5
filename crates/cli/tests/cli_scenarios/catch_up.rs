//! `ferrocuda replay --catch-up-every N`: the fake device runs queued work (the allocator's
//! events) only at every Nth trace step, as a GPU the host runs ahead of. Only what waits
//! on the device can change: page reclaim's figures, not those of configurations that
//! record no events.
use ferrocuda_cli::replay::{Device, FakeAddresses, Figures};
use ferrocuda_cli::trace::{events, read_recording, segment_addresses};
use ferrocuda_types::AllocatorConfig;
use std::path::Path;
use std::process::Command;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn data(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data")
        .join(name)
}

fn figures(
    trace: &str,
    conf: &str,
    lag: Option<u64>,
) -> Result<Figures, Box<dyn std::error::Error>> {
    let recording = read_recording(&data(trace))?;
    let trace = &recording.traces[0];
    let device = Device::Fake {
        capacity: 80 << 30,
        addresses: FakeAddresses::Fresh,
        catch_up_every: lag,
    };
    let config = AllocatorConfig::parse(conf)?;
    let (f, _) = device.replay(
        0,
        &events(trace),
        &segment_addresses(trace),
        conf,
        config,
        |_| {},
    )?;
    Ok(f)
}

fn memory(f: &Figures) -> (u64, u64, u64, u64, u64) {
    (
        f.peak_requested,
        f.peak_allocated,
        f.peak_reserved,
        f.num_device_alloc,
        f.num_device_free,
    )
}

#[test]
fn a_lagging_device_changes_only_what_waits_on_it() -> TestResult {
    let trace = "bert_serve.pickle.xz";
    for conf in ["", "expandable_segments:True"] {
        assert_eq!(
            memory(&figures(trace, conf, None)?),
            memory(&figures(trace, conf, Some(50))?),
            "{conf:?} records no events: the device's pace cannot matter"
        );
    }
    let conf = "ferrocuda_recommended:True";
    let (eager, late) = (
        figures(trace, conf, None)?,
        figures(trace, conf, Some(400))?,
    );
    assert!(
        late.peak_reserved > eager.peak_reserved,
        "page reclaim moves fewer pages while the device lags: {} vs {}",
        late.peak_reserved,
        eager.peak_reserved
    );
    assert_eq!(late.peak_requested, eager.peak_requested);
    Ok(())
}

#[test]
fn catch_up_every_is_checked_before_anything_runs() -> TestResult {
    let trace = data("bert_serve.pickle.xz");
    for (args, needle) in [
        (&["--catch-up-every", "0"][..], "at least 1"),
        (
            &["--catch-up-every", "5", "--device", "cuda"][..],
            "fake device only",
        ),
        (&["--catch-up-every", "soon"][..], "invalid value"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ferrocuda"))
            .arg("replay")
            .arg(&trace)
            .args(args)
            .output()?;
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(text.contains(needle), "{args:?}: {text}");
    }
    Ok(())
}
