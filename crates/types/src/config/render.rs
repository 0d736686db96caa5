//! A configuration written back in the configuration grammar: the effective settings, as
//! snapshots and logs show them.
use super::{AllocatorConfig, Backend, MIB};
use std::fmt;
impl fmt::Display for AllocatorConfig {
    /// The effective settings in the configuration grammar (for snapshots and logs).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "backend:{},expandable_segments:{},large_segment_size_mb:{}",
            match self.backend {
                Backend::Native => "native",
                Backend::CudaMallocAsync => "cudaMallocAsync",
            },
            if self.expandable.enabled {
                "True"
            } else {
                "False"
            },
            self.sizes.large_segment_size / MIB
        )?;
        if let Some(m) = self.sizes.max_split_size {
            write!(f, ",max_split_size_mb:{}", m / MIB)?;
        }
        write!(
            f,
            ",max_non_split_rounding_mb:{}",
            self.sizes.max_non_split_rounding / MIB
        )?;
        if self.release.garbage_collection_threshold > 0.0 {
            write!(
                f,
                ",garbage_collection_threshold:{}",
                self.release.garbage_collection_threshold
            )?;
        }
        if self.sizes.roundup_power2_divisions.iter().any(|&d| d != 0) {
            let items: Vec<String> = self
                .sizes
                .roundup_power2_divisions
                .iter()
                .enumerate()
                .map(|(i, d)| format!("{}:{d}", 1u64 << i))
                .collect();
            write!(f, ",roundup_power2_divisions:[{}]", items.join(","))?;
        }
        write!(
            f,
            ",per_process_memory_fraction:{}",
            self.release.per_process_memory_fraction
        )?;
        // ferrocuda's own keys, where they differ from their defaults (the recommended set
        // shows as the keys it set).
        let default = AllocatorConfig::default();
        let flags = [
            (
                "cross_stream_reuse",
                self.reuse.cross_stream_reuse,
                default.reuse.cross_stream_reuse,
            ),
            (
                "expandable_segments_reclaim",
                self.expandable.reclaim,
                default.expandable.reclaim,
            ),
            (
                "expandable_segments_small_page_bound",
                self.expandable.small_page_bound,
                default.expandable.small_page_bound,
            ),
            (
                "thread_cache",
                self.reuse.thread_cache,
                default.reuse.thread_cache,
            ),
            (
                "garbage_collection_without_fraction",
                self.release.garbage_collection_without_fraction,
                default.release.garbage_collection_without_fraction,
            ),
            (
                "oom_release_partial",
                self.release.oom_release_partial,
                default.release.oom_release_partial,
            ),
            (
                "oom_search_after_sync",
                self.release.oom_search_after_sync,
                default.release.oom_search_after_sync,
            ),
        ];
        for (key, on, by_default) in flags {
            if on != by_default {
                write!(f, ",{key}:{}", if on { "True" } else { "False" })?;
            }
        }
        if let Some(page) = self.expandable.page {
            write!(f, ",expandable_segments_page_mb:{}", page / MIB)?;
        }
        if self.pinned.pageable_copy_threads != default.pinned.pageable_copy_threads {
            write!(
                f,
                ",pageable_copy_threads:{}",
                self.pinned.pageable_copy_threads
            )?;
        }
        Ok(())
    }
}
