//! The allocator bench's mixed churn (`benches/alloc.rs`, PyTorch's `torch_anchor.py`: 1 024
//! slots, each step frees its slot's block or allocates 512 B to 8 MiB into it, from one
//! xorshift generator), run continuously: a warm-up of `STEPS`, then `ROUNDS` timed rounds of
//! `STEPS` each. Small and free of criterion, so a profiler sees the allocator alone:
//! `cargo xtask churn-profile` counts its instructions per operation under callgrind.
//!
//! `cargo run --release -p ferrocuda-alloc --example churn -- [CONF] [STEPS] [ROUNDS] [SHAPE]`
//! (CONF: an allocator configuration string, "" for PyTorch's defaults; SHAPE: `mixed`, the
//! anchor's churn, or `pairs`, 8 slots of 1 MiB: one thread's stand-in for the locked
//! operations of the bench's 1 MiB pairs on 8 threads, whose configurations differ by
//! their locked path). It runs over the
//! real driver when a GPU is usable and `FERROCUDA_BACKEND` is not `fake`, else over the fake
//! device, and says which; on the fake device it also prints the driver calls the timed
//! rounds made (a steady churn makes almost none with the default configuration).
use ferrocuda_alloc::{Caching, CachingAllocator};
use ferrocuda_driver::{Call, CudaDriver, Driver, FakeDriver};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamHandle};
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

const STREAM: StreamHandle = StreamHandle::legacy(DeviceIndex(0));
/// The fake device's calls worth reporting for a churn.
const CALLS: [Call; 7] = [
    Call::Malloc,
    Call::Free,
    Call::VmMap,
    Call::VmUnmap,
    Call::EventRecord,
    Call::EventQuery,
    Call::StreamQuery,
];

/// The anchor's churn (`SLOTS` = 1 024, `FIXED` = 0: sizes of 512 B to 8 MiB), or `SLOTS`
/// slots of `FIXED` bytes each. Constants, so that the anchor's churn compiles to the code
/// it always did (a mask for the slot, no branch for the size).
struct Churn<const SLOTS: usize, const FIXED: u64> {
    live: Vec<Option<u64>>,
    state: u64,
}

impl<const SLOTS: usize, const FIXED: u64> Churn<SLOTS, FIXED> {
    fn new() -> Self {
        Churn {
            live: vec![None; SLOTS],
            state: 88172645463325252,
        }
    }

    fn run(&mut self, a: &CachingAllocator, steps: u64) -> Result<(), String> {
        for _ in 0..steps {
            let s = &mut self.state;
            *s ^= *s << 13;
            *s ^= *s >> 7;
            *s ^= *s << 17;
            let slot = (*s % SLOTS as u64) as usize;
            match self.live[slot].take() {
                Some(p) => a.free(DevicePtr(p)).map_err(|e| e.to_string())?,
                None => {
                    let size = if FIXED > 0 {
                        FIXED
                    } else {
                        512u64 << ((*s >> 40) % 15)
                    };
                    let block = a.allocate(size, STREAM).map_err(|e| e.to_string())?;
                    self.live[slot] = Some(block.ptr.0);
                }
            }
        }
        Ok(())
    }

    /// A warm-up of `steps`, then `rounds` timed rounds of `steps`: their ns per operation,
    /// and the fake device's call counts after the warm-up.
    fn timed(
        a: &CachingAllocator,
        fake: &FakeDriver,
        steps: u64,
        rounds: u64,
    ) -> Result<(Vec<String>, [u64; CALLS.len()]), String> {
        let mut churn = Self::new();
        churn.run(a, steps)?;
        let before = CALLS.map(|c| fake.calls(c));
        let mut times = Vec::new();
        for _ in 0..rounds {
            let start = Instant::now();
            churn.run(a, steps)?;
            times.push(format!(
                "{:.1}",
                start.elapsed().as_nanos() as f64 / steps as f64
            ));
        }
        Ok((times, before))
    }
}

fn number(arg: Option<&String>, default: u64) -> Result<u64, String> {
    arg.map_or(Ok(default), |s| {
        s.parse().map_err(|e| format!("`{s}` is not a count: {e}"))
    })
}

fn churn(args: &[String]) -> Result<(), String> {
    let conf = args.first().cloned().unwrap_or_default();
    let steps = number(args.get(1), 2_000_000)?;
    let rounds = number(args.get(2), 3)?;
    let shape = args.get(3).map_or("mixed", String::as_str);
    let config = AllocatorConfig::parse(&conf).map_err(|e| e.to_string())?;
    let fake = Arc::new(FakeDriver::default());
    let cuda = (std::env::var("FERROCUDA_BACKEND").as_deref() != Ok("fake"))
        .then(CudaDriver::new)
        .filter(|cuda| cuda.unavailable_reason().is_none());
    let on_gpu = cuda.is_some();
    let driver: Arc<dyn Driver> = match cuda {
        Some(cuda) => Arc::new(cuda),
        None => fake.clone(),
    };
    let a = CachingAllocator::new(driver, DeviceIndex(0), config, Caching::On)
        .map_err(|e| e.to_string())?;
    let (label, (times, before)) = match shape {
        "mixed" => ("", Churn::<1024, 0>::timed(&a, &fake, steps, rounds)?),
        "pairs" => (
            " of 8 slots of 1 MiB",
            Churn::<8, { 1 << 20 }>::timed(&a, &fake, steps, rounds)?,
        ),
        other => return Err(format!("`{other}` is not a shape (mixed or pairs)")),
    };
    let on = if on_gpu { "the GPU" } else { "the fake device" };
    // (A reader that stops early, `| head -1`, is not an error: the lines are written
    // without `println!`, which panics on a closed pipe, and a failed write ends quietly.)
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "churn{label} on {on}, configuration \"{conf}\": ns per operation {}",
        times.join(" ")
    );
    if !on_gpu {
        let calls: Vec<String> = CALLS
            .iter()
            .zip(before)
            .map(|(c, b)| format!("{c:?} {}", fake.calls(*c) - b))
            .collect();
        let _ = writeln!(
            out,
            "driver calls in the timed rounds: {}",
            calls.join(", ")
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match churn(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("churn: {e}");
            ExitCode::FAILURE
        }
    }
}
