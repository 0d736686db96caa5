//! Replaying a device trace through ferrocuda's allocator, on the fake device (the
//! default) or the real one (`--device cuda`), timed as PyTorch's own replay times its.
mod plan;

use crate::options::{AddressChoice, DeviceChoice};
use crate::pytorch::PytorchFigures;
use crate::trace::Event;
use ferrocuda_alloc::{AllocError, Caching, CachingAllocator};
use ferrocuda_driver::fake::{AddressPlan, AddressPlanError, Completion, PlanUse, WhenUnusable};
use ferrocuda_driver::{CudaDriver, Driver, DriverError, FakeDriver};
use ferrocuda_types::{
    AllocatorConfig, DeviceIndex, DevicePtr, MemsetValue, StreamFlags, StreamHandle, format_size,
};
use plan::{Plan, Step};
use std::sync::Arc;
use std::time::Instant;

const DEV: DeviceIndex = DeviceIndex(0);

/// What one replay measured (`--json` prints these keys).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Figures {
    /// The allocator configuration replayed.
    pub conf: String,
    /// The device of the trace whose events were replayed.
    pub device: u16,
    /// Where it was replayed: `fake` or `cuda` ([`Driver::backend`]).
    pub backend: &'static str,
    /// Peak of the bytes the program asked for (sum of live requests).
    pub peak_requested: u64,
    /// Peak of allocated (rounded) bytes.
    pub peak_allocated: u64,
    /// Peak of bytes reserved from the device.
    pub peak_reserved: u64,
    /// `peak_reserved / peak_requested`: 1.0 is the physical limit.
    pub reserved_over_requested: f64,
    /// Segments obtained from the device.
    pub num_device_alloc: u64,
    /// Segments given back to the device.
    pub num_device_free: u64,
    /// Allocations that failed for lack of memory.
    pub num_ooms: u64,
    /// Trace events processed.
    pub events: u64,
    /// The `alloc` and `free_completed` events the allocator was asked to serve (a free of
    /// an address the trace never allocated, or already freed, is not one): the events
    /// timed, the same count as PyTorch's `torch_replay.py` reports as `events`.
    pub timed_events: u64,
    /// Wall time of the timed loop: the allocator's `allocate` and `free` calls, with the
    /// driver calls they make.
    pub seconds: f64,
    /// `seconds` per timed event, in nanoseconds (0 when there are none).
    pub ns_per_event: f64,
    /// PyTorch's own figures for this trace and configuration, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pytorch: Option<PytorchFigures>,
    /// With planned addresses (`--addresses recorded`, `--addresses-from`): how many
    /// segments got theirs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub addresses: Option<AddressUse>,
    /// Where the driver put each segment it allocated (`cuMemAlloc`), in order: what
    /// `--addresses-from` reads, so that a replay on the fake device places its segments as
    /// this one's were (expandable segments' mappings are not segments of this kind).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub segment_addresses: Vec<u64>,
}

/// How a replay with planned addresses used them.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct AddressUse {
    /// Addresses in the plan (the trace's `segment_alloc` events, or the ones given).
    pub recorded: usize,
    /// Segments placed at their recorded address.
    pub used: usize,
    /// Segments placed at a fresh address (the replay diverged from the recording, or the
    /// record ran out).
    pub fresh: usize,
}

impl From<PlanUse> for AddressUse {
    fn from(u: PlanUse) -> AddressUse {
        AddressUse {
            recorded: u.len,
            used: u.planned,
            fresh: u.fresh,
        }
    }
}

/// Why a replay stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The configuration string is invalid.
    #[error("--conf {conf:?}: {source}")]
    Config {
        /// The string.
        conf: String,
        /// The parse error.
        source: ferrocuda_types::ConfigError,
    },
    /// The allocator failed other than by running out of memory.
    #[error("replay failed at event {index}: {source}")]
    Allocator {
        /// Index of the event.
        index: usize,
        /// The error.
        source: AllocError,
    },
    /// The allocator's books disagree with a recount of its blocks (a bug).
    #[error("allocator invariant broken after the replay: {0}")]
    Invariant(String),
    /// The trace's segment addresses cannot be handed out (`--addresses recorded`).
    #[error("--addresses recorded: the trace's segment_alloc addresses: {0}")]
    Addresses(#[from] AddressPlanError),
    /// `--addresses-from`: the file cannot be read, is not a replay's `--json` output, or
    /// has no addresses for a device and configuration replayed.
    #[error("--addresses-from {path}: {why}")]
    AddressFile {
        /// The file.
        path: String,
        /// What is wrong.
        why: String,
    },
    /// `--device cuda` on a machine where the CUDA driver or a GPU is missing.
    #[error(
        "--device cuda: CUDA is unavailable on this machine ({0}); replay on the fake device \
         instead (--device fake, the default)"
    )]
    CudaUnavailable(DriverError),
}

/// Where replays run (`--device`).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Device {
    /// A fresh fake device for each replay, of `capacity` bytes, placing segments where
    /// `addresses` says.
    Fake {
        /// Bytes of memory.
        capacity: u64,
        /// Where segments go.
        addresses: FakeAddresses,
        /// Queued work runs only at every this many trace steps (`--catch-up-every`);
        /// `None`: at once.
        catch_up_every: Option<u64>,
    },
    /// The real driver's device 0, shared by every replay (each with its own allocator,
    /// which gives its memory back when dropped).
    Cuda(Arc<CudaDriver>),
}

/// Where the fake device's `malloc`s place segments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FakeAddresses {
    /// Fresh, increasing addresses.
    Fresh,
    /// The trace's `segment_alloc` addresses of the device replayed, in order.
    Recorded,
    /// The addresses another replay's driver gave, per trace device and configuration
    /// label (`--addresses-from`), read from `source`.
    Given {
        /// The file they came from, for messages.
        source: String,
        /// `(trace device, configuration label, addresses)`.
        rows: Vec<(u16, String, Vec<u64>)>,
    },
}

/// A row of a replay's `--json` output, as far as `--addresses-from` reads it.
#[derive(serde::Deserialize)]
struct GivenRow {
    device: u16,
    conf: String,
    #[serde(default)]
    segment_addresses: Vec<u64>,
}

impl FakeAddresses {
    /// The addresses `--addresses-from path` gives: every row of the `--json` output of a
    /// replay (typically `--device cuda`) at `path`.
    pub fn read(path: &std::path::Path) -> Result<FakeAddresses, ReplayError> {
        let source = path.display().to_string();
        let bad = |why: String| address_file(&source, why);
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let rows: Vec<GivenRow> = serde_json::from_str(&text)
            .map_err(|e| bad(format!("not the --json output of `ferrocuda replay` ({e})")))?;
        Ok(FakeAddresses::Given {
            source,
            rows: rows
                .into_iter()
                .map(|r| (r.device, r.conf, r.segment_addresses))
                .collect(),
        })
    }

    /// The plan for trace device `device` replayed under `label` (`None`: fresh addresses);
    /// `recorded` are the trace's own addresses for that device.
    fn plan(
        &self,
        device: u16,
        label: &str,
        recorded: &[u64],
    ) -> Result<Option<AddressPlan>, ReplayError> {
        match self {
            FakeAddresses::Fresh => Ok(None),
            FakeAddresses::Recorded => Ok(Some(AddressPlan::new(
                recorded.to_vec(),
                WhenUnusable::Fresh,
            )?)),
            FakeAddresses::Given { source, rows } => {
                let bad = |why: String| address_file(source, why);
                let (_, _, list) = rows
                    .iter()
                    .find(|(d, conf, _)| *d == device && conf == label)
                    .ok_or_else(|| {
                        bad(format!(
                            "no row for device {device} under configuration {label:?}"
                        ))
                    })?;
                AddressPlan::new(list.clone(), WhenUnusable::Fresh)
                    .map(Some)
                    .map_err(|e| bad(e.to_string()))
            }
        }
    }
}

/// The error of `--addresses-from path`: `why`.
fn address_file(path: &str, why: String) -> ReplayError {
    ReplayError::AddressFile {
        path: path.to_owned(),
        why,
    }
}

impl Device {
    /// The device `choice` names; for the real one, the driver is initialised here and a
    /// machine without a usable GPU is [`ReplayError::CudaUnavailable`]; the file of
    /// `--addresses-from` is read here.
    pub fn open(choice: &DeviceChoice) -> Result<Device, ReplayError> {
        match choice {
            DeviceChoice::Fake {
                capacity,
                addresses,
                catch_up_every,
            } => Ok(Device::Fake {
                capacity: *capacity,
                catch_up_every: *catch_up_every,
                addresses: match addresses {
                    AddressChoice::Fresh => FakeAddresses::Fresh,
                    AddressChoice::Recorded => FakeAddresses::Recorded,
                    AddressChoice::From(path) => FakeAddresses::read(path)?,
                },
            }),
            DeviceChoice::Cuda => {
                let cuda = CudaDriver::new();
                match cuda.unavailable_reason() {
                    Some(reason) => Err(ReplayError::CudaUnavailable(reason)),
                    None => Ok(Device::Cuda(Arc::new(cuda))),
                }
            }
        }
    }

    /// What the replays ran on, for the note under the figures.
    pub fn describe(&self) -> String {
        match self {
            Device::Fake {
                capacity,
                catch_up_every,
                ..
            } => {
                let lag = catch_up_every.map_or(String::new(), |n| {
                    format!(", its queued work run every {n} trace steps")
                });
                format!("the fake device ({} each{lag})", format_size(*capacity))
            }
            Device::Cuda(cuda) => match cuda.device_properties(DEV) {
                Ok(p) => format!("cuda:0 ({})", p.name),
                Err(_) => "cuda:0".into(),
            },
        }
    }

    /// Replays the events of the trace's device `device` (whose `segment_alloc` addresses
    /// are `recorded`) under `config`, shown as `label`.
    pub fn replay(
        &self,
        device: u16,
        events: &[Event],
        recorded: &[u64],
        label: &str,
        config: AllocatorConfig,
        progress: impl FnMut(u64),
    ) -> Result<(Figures, CachingAllocator), ReplayError> {
        let (mut figures, allocator) = match self {
            Device::Fake {
                capacity,
                addresses,
                catch_up_every,
            } => {
                let fake = fake_device(*capacity, addresses.plan(device, label, recorded)?);
                fake.log_mallocs(true);
                let lag = catch_up_every.map(|every| {
                    fake.set_completion(Completion::Manual);
                    CatchUp { every, fake: &fake }
                });
                let (mut figures, allocator) =
                    replay_lagging(fake.clone(), events, label, config, progress, lag)?;
                figures.addresses = fake.address_plan_use(DEV).map(AddressUse::from);
                figures.segment_addresses = segments_of(fake.take_malloc_log());
                (figures, allocator)
            }
            Device::Cuda(cuda) => {
                cuda.log_mallocs(true);
                let replayed = replay_with(cuda.clone(), events, label, config, progress);
                let log = cuda.take_malloc_log();
                cuda.log_mallocs(false);
                let (mut figures, allocator) = replayed?;
                figures.segment_addresses = segments_of(log);
                (figures, allocator)
            }
        };
        figures.device = device;
        Ok((figures, allocator))
    }
}

/// The addresses of a malloc log that are device [`DEV`]'s.
fn segments_of(log: Vec<(DeviceIndex, DevicePtr)>) -> Vec<u64> {
    log.into_iter()
        .filter(|(d, _)| *d == DEV)
        .map(|(_, p)| p.0)
        .collect()
}

/// A fake device of `capacity` bytes that keeps no bytes; with a `plan`, its `malloc`s hand
/// its addresses out in order, and where the replay's segments stop matching the plan's
/// (another configuration), a segment whose planned place is taken, and every segment past
/// the plan, gets a fresh address above them all.
pub fn fake_device(capacity: u64, plan: Option<AddressPlan>) -> Arc<FakeDriver> {
    let mut builder = FakeDriver::builder().capacity(capacity).backing(false);
    if let Some(plan) = plan {
        builder = builder.address_plan(DEV, plan);
    }
    Arc::new(builder.build())
}

/// Replays `events` (one device's trace) through a fresh allocator configured with `conf`,
/// on a fake device of `capacity` bytes. `progress` is called with the events done so far.
pub fn replay(
    events: &[Event],
    conf: &str,
    capacity: u64,
    progress: impl FnMut(u64),
) -> Result<(Figures, CachingAllocator), ReplayError> {
    let config = AllocatorConfig::parse(conf).map_err(|source| ReplayError::Config {
        conf: conf.to_owned(),
        source,
    })?;
    let label = if conf.is_empty() { "default" } else { conf };
    replay_with(fake_device(capacity, None), events, label, config, progress)
}

/// Progress is reported between chunks of this many steps.
const PROGRESS_EVERY: usize = 65_536;

/// Replays `events` (one device's trace) through a fresh allocator on `driver`'s device 0,
/// configured with `config` and shown as `label`; `progress` is called with the trace
/// events done so far.
///
/// Before the clock starts, the trace becomes a list of allocate and free steps on dense
/// slots and the recorded streams are created in order of first use (`replay/plan.rs`);
/// the clock covers only the loop of `allocate` and `free` calls (driver calls they make
/// included), as in PyTorch's `torch_replay.py`. After it stops, the allocator's books are
/// checked against a recount of its blocks, the figures are read, and the blocks still
/// live are freed, so
/// that dropping the allocator gives all its memory back.
pub fn replay_with(
    driver: Arc<dyn Driver>,
    events: &[Event],
    label: &str,
    config: AllocatorConfig,
    progress: impl FnMut(u64),
) -> Result<(Figures, CachingAllocator), ReplayError> {
    replay_lagging(driver, events, label, config, progress, None)
}

/// A fake device in manual completion whose queued work is run before every `every`th
/// step of the trace. Each free is preceded by a piece of work on the block's stream (an
/// empty memset at its address: the last kernel that used it), so that the stream is busy
/// between catch-ups as a real one is with the program's kernels.
struct CatchUp<'a> {
    /// Steps between catch-ups (at least 1).
    every: u64,
    fake: &'a FakeDriver,
}

/// [`replay_with`], on a device whose queued work runs only when `lag` catches it up
/// (with `None`, as it comes).
fn replay_lagging(
    driver: Arc<dyn Driver>,
    events: &[Event],
    label: &str,
    config: AllocatorConfig,
    mut progress: impl FnMut(u64),
    lag: Option<CatchUp<'_>>,
) -> Result<(Figures, CachingAllocator), ReplayError> {
    let plan = Plan::new(events);
    let allocator = CachingAllocator::new(driver.clone(), DEV, config, Caching::On)
        .map_err(|source| ReplayError::Allocator { index: 0, source })?;
    let streams = plan
        .streams
        .iter()
        .map(|s| {
            if s.id == 0 {
                return Ok(StreamHandle::legacy(DEV));
            }
            let flags = StreamFlags {
                non_blocking: true,
                priority: 0,
            };
            driver
                .stream_create(DEV, flags)
                .map_err(|d| ReplayError::Allocator {
                    index: s.first_use,
                    source: d.into(),
                })
        })
        .collect::<Result<Vec<StreamHandle>, ReplayError>>()?;
    // Each live allocation's address, requested bytes and stream.
    let mut live: Vec<Option<(DevicePtr, u64, StreamHandle)>> = vec![None; plan.slots];
    let (mut requested, mut peak_requested, mut ooms) = (0u64, 0u64, 0u64);
    let failed = |k: usize, source| ReplayError::Allocator {
        index: plan.origin[k],
        source,
    };
    let start = Instant::now();
    for (chunk, steps) in plan.steps.chunks(PROGRESS_EVERY).enumerate() {
        let first = chunk * PROGRESS_EVERY;
        progress(plan.origin[first] as u64);
        for (k, step) in (first..).zip(steps) {
            if let Some(lag) = &lag
                && (k as u64).is_multiple_of(lag.every)
            {
                lag.fake.advance_all();
            }
            match *step {
                Step::Alloc { slot, stream, size } => {
                    match allocator.allocate(size, streams[stream]) {
                        Ok(x) => {
                            let entry = (x.ptr, size, streams[stream]);
                            if let Some((old, old_size, _)) = live[slot].replace(entry) {
                                // The trace reused an address without freeing it: free ours.
                                requested -= old_size;
                                allocator.free(old).map_err(|e| failed(k, e))?;
                            }
                            requested += size;
                            peak_requested = peak_requested.max(requested);
                        }
                        Err(AllocError::OutOfMemory(_)) => ooms += 1,
                        Err(source) => return Err(failed(k, source)),
                    }
                }
                Step::Free { slot } => {
                    if let Some((ptr, size, stream)) = live[slot].take() {
                        if let Some(lag) = &lag {
                            let last_use =
                                lag.fake.memset_async(ptr, MemsetValue::U8(0), 0, stream);
                            last_use.map_err(|d| failed(k, d.into()))?;
                        }
                        requested -= size;
                        allocator.free(ptr).map_err(|e| failed(k, e))?;
                    }
                }
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    progress(events.len() as u64);
    allocator
        .check_invariants()
        .map_err(ReplayError::Invariant)?;
    let stats = allocator.stats();
    let peak_reserved = stats.reserved_bytes.all.peak as u64;
    let timed_events = plan.steps.len() as u64;
    let figures = Figures {
        conf: label.to_owned(),
        device: 0,
        backend: driver.backend(),
        peak_requested,
        peak_allocated: stats.allocated_bytes.all.peak as u64,
        peak_reserved,
        reserved_over_requested: if peak_requested == 0 {
            0.0
        } else {
            peak_reserved as f64 / peak_requested as f64
        },
        num_device_alloc: stats.num_device_alloc as u64,
        num_device_free: stats.num_device_free as u64,
        num_ooms: ooms,
        events: events.len() as u64,
        timed_events,
        seconds,
        ns_per_event: if timed_events == 0 {
            0.0
        } else {
            seconds * 1e9 / timed_events as f64
        },
        pytorch: None,
        addresses: None,
        segment_addresses: Vec::new(),
    };
    // Like PyTorch's replay, blocks still live at the end are freed after the clock stops.
    for (ptr, _, _) in live.into_iter().flatten() {
        allocator
            .free(ptr)
            .map_err(|source| ReplayError::Allocator {
                index: events.len(),
                source,
            })?;
    }
    Ok((figures, allocator))
}
