//! The allocator configuration string (`FERROCUDA_ALLOC_CONF` / `PYTORCH_CUDA_ALLOC_CONF`)
//! with PyTorch's grammar (`CUDAAllocatorConfig::parseArgs` in
//! c10/cuda/CUDAAllocatorConfig.cpp): `key:value` pairs separated by `,`, list values in
//! brackets. Stricter than PyTorch where PyTorch is sloppy: a number must be all digits
//! (`40MB` is an error, not 40), and every error names the offending token and its
//! character position.
//!
//! The values are here: [`AllocatorConfig`], grouped by the part of the allocator that reads
//! them ([`SizeConfig`], [`ExpandableConfig`], [`ReleaseConfig`], [`ReuseConfig`],
//! [`PinnedConfig`]). The grammar is in `grammar`, what each key sets in `keys`, the
//! rendering back into the grammar in `render`.
use crate::env::EnvError;
use serde::{Deserialize, Serialize};

mod grammar;
mod keys;
mod render;

const MIB: u64 = 1 << 20;
/// The largest `large_segment_size_mb`: 1 EB, the largest request an allocator accepts, so
/// that size arithmetic on it cannot overflow.
const MAX_SEGMENT_MB: u64 = 1 << 40;
/// The most threads `pageable_copy_threads` may name.
pub const MAX_PAGEABLE_COPY_THREADS: u64 = 64;
/// Entries of the `roundup_power2_divisions` table: intervals `[2^(20+k), 2^(21+k))`.
pub const ROUNDUP_INTERVALS: usize = 16;

/// Which allocator serves device memory.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Backend {
    /// The caching allocator.
    #[default]
    Native,
    /// The driver's stream-ordered allocator (accepted for compatibility; not built yet).
    CudaMallocAsync,
}

/// Every option of the allocator configuration, with PyTorch's defaults, grouped by the part
/// of the allocator that reads it. Serialized flat, one field per key, as the string names
/// them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllocatorConfig {
    /// Block sizes, rounding and splitting (see [`SizeConfig`]).
    #[serde(flatten)]
    pub sizes: SizeConfig,
    /// Expandable segments (see [`ExpandableConfig`]).
    #[serde(flatten)]
    pub expandable: ExpandableConfig,
    /// Memory limits, garbage collection and what happens when the device is full (see
    /// [`ReleaseConfig`]).
    #[serde(flatten)]
    pub release: ReleaseConfig,
    /// Which freed blocks may serve which requests beyond PyTorch's per-stream cache (see
    /// [`ReuseConfig`]).
    #[serde(flatten)]
    pub reuse: ReuseConfig,
    /// The pinned host allocator's keys (see [`PinnedConfig`]).
    #[serde(flatten)]
    pub pinned: PinnedConfig,
    /// `backend`.
    pub backend: Backend,
    /// `release_lock_on_cudamalloc` (ferrocuda never holds its lock across driver calls).
    pub release_lock_on_cudamalloc: bool,
    /// `ferrocuda_recommended` (ferrocuda's own): turns on the recommended set of
    /// ferrocuda-only improvements ([`AllocatorConfig::RECOMMENDED`]) before the other keys
    /// of the string apply (so they can override any of it).
    pub ferrocuda_recommended: bool,
    /// The settings string this configuration was last parsed from (PyTorch's
    /// `CUDAAllocatorConfig::last_allocator_settings()`, which a snapshot shows as
    /// `PYTORCH_CUDA_ALLOC_CONF`): empty for the defaults.
    #[serde(skip)]
    pub settings_text: SettingsText,
}

/// Block sizes, rounding and splitting: read by the device allocator's rounding and its
/// free pools when a request is sized and a cached block is chosen or split.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SizeConfig {
    /// `large_segment_size_mb`, in bytes (default 20 MiB).
    pub large_segment_size: u64,
    /// `max_split_size_mb`, in bytes; `None` is unlimited (the default).
    pub max_split_size: Option<u64>,
    /// `max_non_split_rounding_mb`, in bytes (default: the large segment size).
    pub max_non_split_rounding: u64,
    /// `roundup_power2_divisions` per interval; 0 or 1 mean plain 512-byte rounding.
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
}

/// Expandable segments: read where a segment is created and where its pages are mapped,
/// reclaimed and unmapped.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExpandableConfig {
    /// `expandable_segments`.
    #[serde(rename = "expandable_segments")]
    pub enabled: bool,
    /// `expandable_segments_reserve`: a fraction of device memory or a size in bytes.
    #[serde(rename = "expandable_segments_reserve")]
    pub reserve: Option<ReserveSize>,
    /// `expandable_segments_reserve_by_class`: `(class, reserve)` pairs.
    #[serde(rename = "expandable_segments_reserve_by_class")]
    pub reserve_by_class: Vec<(String, ReserveSize)>,
    /// `expandable_segments_reclaim` (ferrocuda's own): before an expandable range maps
    /// new physical pages, whole free pages elsewhere in the same stream's ranges whose
    /// last use the device has run (an event mark shows it; no stream sync) are unmapped
    /// and mapped where they are needed. Physical memory then follows live bytes instead of
    /// the address layout, less so while the device lags behind the host. Off by default.
    #[serde(rename = "expandable_segments_reclaim")]
    pub reclaim: bool,
    /// `expandable_segments_page_mb` (ferrocuda's own), in bytes: the page of the large
    /// pool's expandable segments (`None`: `large_segment_size_mb`, PyTorch's 20 MiB).
    /// Smaller pages let `expandable_segments_reclaim` move memory in finer steps and
    /// strand less of it at the ends of free ranges, at the price of more map calls.
    #[serde(rename = "expandable_segments_page")]
    pub page: Option<u64>,
    /// `expandable_segments_small_page_bound` (ferrocuda's own): a free small block of an
    /// expandable segment merges only with free neighbours inside its own 2 MiB page, and
    /// the small pool grows by a page of its own, as the default's 2 MiB small segments
    /// keep blocks apart. Fewer splits and merges when many threads churn small blocks;
    /// pages are still reclaimed and moved. Off by default.
    #[serde(rename = "expandable_segments_small_page_bound", default)]
    pub small_page_bound: bool,
}

/// Memory limits, garbage collection and what happens when the device is full: read by
/// the allocator's release path and its out-of-memory path.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReleaseConfig {
    /// `per_process_memory_fraction` in [0, 1] (default 1: no limit).
    pub per_process_memory_fraction: f64,
    /// `garbage_collection_threshold` in (0, 1); 0 is off (the default).
    pub garbage_collection_threshold: f64,
    /// `garbage_collection_without_fraction` (ferrocuda's own): garbage collection runs
    /// without a memory fraction too, against the device's memory. PyTorch runs it only
    /// with a fraction set. Off by default.
    pub garbage_collection_without_fraction: bool,
    /// `oom_release_partial` (ferrocuda's own): when no cached block fits and the device is
    /// full, the largest whole cached segments are freed only until the request fits, and
    /// the oversize step tries again after a partial release, before everything is freed.
    /// PyTorch frees every cached segment. Off by default.
    pub oom_release_partial: bool,
    /// `oom_search_after_sync` (ferrocuda's own): when the device is full, the cache is
    /// searched again after waiting for other streams' events, before anything is freed
    /// (PyTorch never looks again). Off by default.
    pub oom_search_after_sync: bool,
    /// `throw_on_cudamalloc_oom`.
    pub throw_on_cudamalloc_oom: bool,
    /// `oom_forensics:<path>` (ferrocuda's own): an out-of-memory error also says how the
    /// cache is fragmented (per pool and stream), what `empty_cache` would give back and the
    /// largest request that would then succeed, and the largest live blocks with their
    /// allocation sites; and a snapshot is written to this path. `None` (the default, or
    /// `oom_forensics:False`): PyTorch's message only.
    pub oom_forensics: Option<String>,
}

/// Which freed blocks may serve which requests beyond PyTorch's per-stream cache: read by
/// the allocator's thread cache, its slow path and graph captures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReuseConfig {
    /// `thread_cache` (ferrocuda's own): a thread that frees the block it allocated last
    /// keeps it parked, and gets it back without the allocator's lock when its next request
    /// is the same (size, stream). A block is parked only where PyTorch's free-then-best-fit
    /// would hand out the same block, and statistics account for every such reuse, so
    /// single-threaded programs see exactly PyTorch's addresses and statistics. On by default.
    pub thread_cache: bool,
    /// `cross_stream_reuse` (ferrocuda's own): before asking the driver for a new segment,
    /// take a whole free segment cached by another stream, ordering the allocating stream
    /// after that stream's work with an event wait (no host sync). Off by default, as
    /// PyTorch never shares cached blocks across streams.
    pub cross_stream_reuse: bool,
    /// `graph_capture_record_stream_reuse`.
    pub graph_capture_record_stream_reuse: bool,
}

/// The pinned host allocator's keys: read only by the host allocator
/// (`HostAllocator::new` takes this part).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PinnedConfig {
    /// `pinned_use_cuda_host_register`.
    #[serde(rename = "pinned_use_cuda_host_register")]
    pub use_cuda_host_register: bool,
    /// `pinned_num_register_threads` (power of two, at most 128; default 1).
    #[serde(rename = "pinned_num_register_threads")]
    pub num_register_threads: u64,
    /// `pinned_use_background_threads`.
    #[serde(rename = "pinned_use_background_threads")]
    pub use_background_threads: bool,
    /// `pinned_reserve_segment_size_mb`, in bytes (0: off).
    #[serde(rename = "pinned_reserve_segment_size")]
    pub reserve_segment_size: u64,
    /// `pinned_max_round_threshold_mb`, in bytes (`None`: unlimited).
    #[serde(rename = "pinned_max_round_threshold")]
    pub max_round_threshold: Option<u64>,
    /// `pinned_max_cached_size_mb`, in bytes (`None`: unlimited).
    #[serde(rename = "pinned_max_cached_size")]
    pub max_cached_size: Option<u64>,
    /// `pinned_free_catch_all`.
    #[serde(rename = "pinned_free_catch_all")]
    pub free_catch_all: bool,
    /// `pageable_copy_threads` (ferrocuda's own): a copy of at least 4 MiB from pageable host
    /// memory to a device (`DeviceBuffer::copy_from_host`) is staged through page-locked
    /// buffers of its own by this many threads, each chunk's transfer starting as soon as
    /// it is staged; 0, the default, leaves the copy to the driver, as PyTorch does. At
    /// most [`MAX_PAGEABLE_COPY_THREADS`]. Kept with the pinned host allocator's keys (the
    /// runtime asks the host allocator for it), it applies with either device backend.
    pub pageable_copy_threads: u64,
}

/// The text a configuration was last parsed from. It records where the configuration came
/// from and is not part of what it configures: any two compare equal.
#[derive(Clone, Debug, Default)]
pub struct SettingsText(pub String);

impl PartialEq for SettingsText {
    fn eq(&self, _: &SettingsText) -> bool {
        true
    }
}

impl SettingsText {
    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A virtual-address reserve: a fraction of device memory, or bytes (`12G`).
#[derive(Copy, Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ReserveSize {
    /// Times the device's memory.
    Fraction(f64),
    /// Bytes.
    Bytes(u64),
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            sizes: SizeConfig::default(),
            expandable: ExpandableConfig::default(),
            release: ReleaseConfig::default(),
            reuse: ReuseConfig::default(),
            pinned: PinnedConfig::default(),
            backend: Backend::Native,
            release_lock_on_cudamalloc: false,
            ferrocuda_recommended: false,
            settings_text: SettingsText::default(),
        }
    }
}

impl Default for SizeConfig {
    fn default() -> Self {
        SizeConfig {
            large_segment_size: 20 * MIB,
            max_split_size: None,
            max_non_split_rounding: 20 * MIB,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
        }
    }
}

impl Default for ReleaseConfig {
    fn default() -> Self {
        ReleaseConfig {
            per_process_memory_fraction: 1.0,
            garbage_collection_threshold: 0.0,
            garbage_collection_without_fraction: false,
            oom_release_partial: false,
            oom_search_after_sync: false,
            throw_on_cudamalloc_oom: false,
            oom_forensics: None,
        }
    }
}

impl Default for ReuseConfig {
    fn default() -> Self {
        ReuseConfig {
            thread_cache: true,
            cross_stream_reuse: false,
            graph_capture_record_stream_reuse: false,
        }
    }
}

impl Default for PinnedConfig {
    fn default() -> Self {
        PinnedConfig {
            use_cuda_host_register: false,
            num_register_threads: 1,
            use_background_threads: false,
            reserve_segment_size: 0,
            max_round_threshold: None,
            max_cached_size: None,
            free_catch_all: false,
            pageable_copy_threads: 0,
        }
    }
}

/// A configuration string that does not parse or validate.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid allocator config at character {position} ('{token}'): {message}")]
pub struct ConfigError {
    /// Character offset of the offending token in the string.
    pub position: usize,
    /// The offending token (empty at the end of the string).
    pub token: String,
    /// What is wrong, in PyTorch's words where PyTorch has them.
    pub message: String,
}

/// The keys of a configuration as the `backend:cudaMallocAsync` allocator reads them.
/// PyTorch accepts every one of its keys beside that backend; the backend uses only
/// `backend` and the pinned host allocator's keys (the host allocator serves both
/// backends). PyTorch's CUDA parser (`CUDAAllocatorConfig::parseArgs`,
/// c10/cuda/CUDAAllocatorConfig.cpp) warns once per string, `backend:cudaMallocAsync ignores
/// max_split_size_mb,roundup_power2_divisions, and garbage_collect_threshold.`, when the
/// string also names one of its own keys other than `backend` (`release_lock_on_cudamalloc`,
/// `pinned_use_cuda_host_register`, `pinned_num_register_threads`,
/// `pinned_reserve_segment_size_mb`, `graph_capture_record_stream_reuse`,
/// `per_process_memory_fraction`, and in later versions `pinned_free_catch_all`,
/// `throw_on_cudamalloc_oom`, `expandable_segments_reserve[_by_class]`); the keys of its
/// generic parser (`max_split_size_mb` and the others of
/// `AcceleratorAllocatorConfig::parseArgs`, c10/core/AllocatorConfig.cpp) it ignores without
/// a word. ferrocuda gives the same warning for both, since the backend ignores both.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AsyncBackendKeys {
    /// Options of the caching allocator, which the backend ignores.
    pub ignored: Vec<String>,
    /// Keys of the pinned host allocator that apply, yet for which PyTorch warns.
    pub pinned_warned: Vec<String>,
    /// ferrocuda's own keys, which do nothing with this backend (PyTorch refuses them as
    /// unrecognized whatever the backend).
    pub ferrocuda_only: Vec<String>,
}

impl AsyncBackendKeys {
    /// Whether PyTorch's warning is due.
    pub fn warns(&self) -> bool {
        !self.ignored.is_empty() || !self.pinned_warned.is_empty()
    }
}

/// The allocator configuration from the environment cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigSourceError {
    /// A variable is set but cannot be read.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// The variable's value does not parse.
    #[error("{var}: {source}")]
    Parse {
        /// The variable.
        var: &'static str,
        /// Why.
        source: ConfigError,
    },
}

#[cfg(test)]
mod tests;
