//! Replaying a device trace through ferrocuda's allocator on the fake device.
use crate::pytorch::PytorchFigures;
use crate::trace::{Action, Event};
use ferrocuda_alloc::{AllocError, CachingAllocator};
use ferrocuda_driver::fake::{AddressPlan, AddressPlanError, PlanUse, WhenUnusable};
use ferrocuda_driver::{Driver, FakeDriver};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamFlags, StreamHandle};
use std::collections::HashMap;
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
    /// Wall time of the replay.
    pub seconds: f64,
    /// PyTorch's own figures for this trace and configuration, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pytorch: Option<PytorchFigures>,
    /// With recorded addresses: how many segments got theirs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub addresses: Option<AddressUse>,
}

/// How a replay with recorded addresses used them.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct AddressUse {
    /// `segment_alloc` addresses in the trace.
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
    replay_with(events, label, config, capacity, None, progress)
}

/// [`replay`] with a parsed configuration, shown as `label` in the figures. With
/// `addresses` (the trace's [`segment_addresses`](crate::trace::segment_addresses)), the
/// fake device hands them out to its `malloc`s in order, so best-fit ties between segments
/// break as they did in the recording; where the replay's segments stop matching the
/// recording's (another configuration), a segment whose recorded place is taken, and every
/// segment past the record, gets a fresh address above them all.
pub fn replay_with(
    events: &[Event],
    label: &str,
    config: AllocatorConfig,
    capacity: u64,
    addresses: Option<&[u64]>,
    mut progress: impl FnMut(u64),
) -> Result<(Figures, CachingAllocator), ReplayError> {
    let mut builder = FakeDriver::builder().capacity(capacity).backing(false);
    if let Some(list) = addresses {
        let plan = AddressPlan::new(list.to_vec(), WhenUnusable::Fresh)?;
        builder = builder.address_plan(DEV, plan);
    }
    let fake = Arc::new(builder.build());
    let allocator = CachingAllocator::new(fake.clone(), DEV, config, true)
        .map_err(|source| ReplayError::Allocator { index: 0, source })?;
    let mut streams: HashMap<u64, StreamHandle> = HashMap::new();
    let mut live: HashMap<u64, (DevicePtr, u64)> = HashMap::new();
    let (mut requested, mut peak_requested, mut ooms) = (0u64, 0u64, 0u64);
    let start = Instant::now();
    for (index, e) in events.iter().enumerate() {
        if index % 65_536 == 0 {
            progress(index as u64);
        }
        match e.action {
            Action::Alloc => {
                let stream = match streams.get(&e.stream) {
                    Some(s) => *s,
                    None => {
                        let s = if e.stream == 0 {
                            StreamHandle::legacy(DEV)
                        } else {
                            let flags = StreamFlags {
                                non_blocking: true,
                                priority: 0,
                            };
                            fake.stream_create(DEV, flags)
                                .map_err(|d| ReplayError::Allocator {
                                    index,
                                    source: d.into(),
                                })?
                        };
                        *streams.entry(e.stream).or_insert(s)
                    }
                };
                match allocator.allocate(e.size, stream) {
                    Ok(x) => {
                        if let Some((old, size)) = live.insert(e.addr, (x.ptr, e.size)) {
                            // The trace reused an address without freeing it first: free ours.
                            requested -= size;
                            allocator
                                .free(old)
                                .map_err(|source| ReplayError::Allocator { index, source })?;
                        }
                        requested += e.size;
                        peak_requested = peak_requested.max(requested);
                    }
                    Err(AllocError::OutOfMemory(_)) => ooms += 1,
                    Err(source) => return Err(ReplayError::Allocator { index, source }),
                }
            }
            Action::FreeCompleted => {
                // Frees of blocks allocated before recording began, or that OOMed, are skipped.
                if let Some((ptr, size)) = live.remove(&e.addr) {
                    requested -= size;
                    allocator
                        .free(ptr)
                        .map_err(|source| ReplayError::Allocator { index, source })?;
                }
            }
            Action::Other => {}
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    progress(events.len() as u64);
    allocator
        .check_invariants()
        .map_err(ReplayError::Invariant)?;
    let stats = allocator.stats();
    let peak_reserved = stats.reserved_bytes.all.peak as u64;
    let figures = Figures {
        conf: label.to_owned(),
        device: 0,
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
        seconds,
        pytorch: None,
        addresses: fake.address_plan_use(DEV).map(AddressUse::from),
    };
    Ok((figures, allocator))
}
