//! The examples on the fake device (CI has no GPU): each works there and says where it ran,
//! takes the allocator configuration from the environment, and reports a malformed one by
//! its message.
use ferrocuda_testkit::examples::run_example as run;
use std::process::Output;

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn tour_runs_on_the_fake_backend_with_the_environments_configuration() -> Result<(), String> {
    let out = run("tour", &[], &[])?;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("tour done on the fake device"),
        "{}",
        text(&out)
    );
    let out = run(
        "tour",
        &[("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")],
        &[],
    )?;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out)
            .contains("allocator configuration: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
        "{}",
        text(&out)
    );
    let out = run("tour", &[("FERROCUDA_ALLOC_CONF", "bogus:1")], &[])?;
    assert!(!out.status.success());
    let t = text(&out);
    assert!(
        t.contains("FERROCUDA_ALLOC_CONF") && t.contains("invalid allocator config at character 0"),
        "{t}"
    );
    assert!(!t.contains("ConfigError {"), "Display, not Debug: {t}");
    Ok(())
}

#[test]
fn snapshot_example_says_it_ran_on_the_fake_device() -> Result<(), String> {
    let path =
        std::env::temp_dir().join(format!("ferrocuda-example-{}.pickle", std::process::id()));
    let out = run("snapshot", &[], &[&path.to_string_lossy()])?;
    let _ = std::fs::remove_file(&path);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("on the fake device") && !t.contains("on the GPU"),
        "{t}"
    );
    Ok(())
}

/// The decode loop on the fake device: eager and trees agree on every step, and every
/// recording the planner saw coming left the pool at the planned bytes, under the default
/// configuration and under one from the environment (a graph's pool never expands).
#[test]
fn decode_agrees_with_eager_and_with_its_plans() -> Result<(), String> {
    for conf in ["", "expandable_segments:True,max_split_size_mb:64"] {
        let out = run("decode", &[("PYTORCH_CUDA_ALLOC_CONF", conf)], &["16"])?;
        let t = text(&out);
        assert!(out.status.success(), "{conf:?}: {t}");
        assert!(
            t.contains("decode done on the fake device"),
            "{conf:?}: {t}"
        );
        assert!(
            t.contains("eager and trees bitwise equal on all 16 steps"),
            "{conf:?}: {t}"
        );
        assert!(
            t.contains("planner: 4 recordings planned before they ran"),
            "{conf:?}: {t}"
        );
    }
    Ok(())
}

/// The CUDA IPC example on the fake device: both roles in one process, both kinds of
/// segment; a role that needs another process says it needs a GPU.
#[test]
fn ipc_peer_shares_blocks_on_the_fake_device() -> Result<(), String> {
    let out = run("ipc_peer", &[], &[])?;
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for conf in ["\"\"", "\"expandable_segments:True\""] {
        for from in ["", " from device 1"] {
            assert!(
                t.contains(&format!(
                    "fake device ({conf}): shared, read{from}, written and given back"
                )),
                "{t}"
            );
        }
    }
    let out = run("ipc_peer", &[], &["produce", ""])?;
    assert!(!out.status.success());
    assert!(text(&out).contains("no GPU"), "{}", text(&out));
    Ok(())
}

/// The torchrun worker alone (a job of one rank) and as three ranks with torchrun's
/// variables set by hand, on the fake device: every rank's all-reduce gives the sum.
#[test]
fn torchrun_worker_runs_alone_and_as_three_ranks() -> Result<(), String> {
    let out = run("torchrun_worker", &[], &[])?;
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("rank 0 of 1 on the fake device"), "{t}");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port()
        .to_string();
    let ranks: Vec<std::thread::JoinHandle<Result<Output, String>>> = (0..3)
        .map(|r| {
            let port = port.clone();
            std::thread::spawn(move || {
                let r = r.to_string();
                let vars = [
                    ("RANK", r.as_str()),
                    ("LOCAL_RANK", r.as_str()),
                    ("WORLD_SIZE", "3"),
                    ("LOCAL_WORLD_SIZE", "3"),
                    ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", port.as_str()),
                ];
                run("torchrun_worker", &vars, &[])
            })
        })
        .collect();
    for (r, h) in ranks.into_iter().enumerate() {
        let out = h.join().map_err(|_| "a rank's thread panicked")??;
        let t = text(&out);
        assert!(out.status.success(), "rank {r}: {t}");
        assert!(
            t.contains(&format!("rank {r} of 3 on the fake device"))
                && t.contains("all_reduce ok (6)"),
            "rank {r}: {t}"
        );
    }
    Ok(())
}
