//! Records allocation history while a small workload runs on the GPU, then writes a
//! snapshot that PyTorch's viewer reads (`torch.cuda._memory_viz`, pytorch.org/memory_viz).
//!
//! `cargo run --release --example snapshot -- [out.pickle]` (needs a GPU, or
//! `FERROCUDA_BACKEND=fake` for the fake device; it says which it ran on. The GPU bundle
//! runs it and checks the file with PyTorch's own viewer code).
use ferrocuda::stream::DeviceBuffer;
use ferrocuda::types::DeviceIndex;

fn main() -> std::process::ExitCode {
    match snapshot() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("snapshot: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn snapshot() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "snapshot.pickle".into());
    let rt = ferrocuda::runtime();
    if !rt.is_available() {
        return Err("this example needs a GPU (or FERROCUDA_BACKEND=fake)".into());
    }
    let dev = DeviceIndex(0);
    ferrocuda::memory::record_memory_history(Some("all"), Some("all"), "all", 100_000)?;
    let side = rt.stream_from_pool(dev, false)?;
    let mut keep = Vec::new();
    for step in 0..40usize {
        let n = 1000 + (step * 7919) % 3_000_000;
        let activations = DeviceBuffer::<f32>::filled(rt, dev, n, 1.0)?;
        if step % 3 == 0 {
            activations.record_stream(&side)?;
        }
        if step % 5 == 0 {
            keep.push(activations);
        }
    }
    let raw = ferrocuda::memory::caching_allocator_alloc(12345, dev, None)?;
    rt.synchronize(dev)?;
    ferrocuda::memory::dump_snapshot(std::path::Path::new(&path))?;
    ferrocuda::memory::caching_allocator_delete(raw)?;
    let place = if rt.driver().backend() == "cuda" {
        "the GPU"
    } else {
        "the fake device"
    };
    println!(
        "snapshot of {} live buffers written to {path} on {place} ({} allocated)",
        keep.len() + 1,
        ferrocuda::types::format_size(ferrocuda::memory::memory_allocated(dev)?)
    );
    Ok(())
}
