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
            if self.expandable_segments {
                "True"
            } else {
                "False"
            },
            self.large_segment_size / MIB
        )?;
        if let Some(m) = self.max_split_size {
            write!(f, ",max_split_size_mb:{}", m / MIB)?;
        }
        write!(
            f,
            ",max_non_split_rounding_mb:{}",
            self.max_non_split_rounding / MIB
        )?;
        if self.garbage_collection_threshold > 0.0 {
            write!(
                f,
                ",garbage_collection_threshold:{}",
                self.garbage_collection_threshold
            )?;
        }
        if self.roundup_power2_divisions.iter().any(|&d| d != 0) {
            let items: Vec<String> = self
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
            self.per_process_memory_fraction
        )?;
        // ferrocuda's own keys, where they differ from their defaults (the recommended set
        // shows as the keys it set).
        let default = AllocatorConfig::default();
        let flags = [
            (
                "cross_stream_reuse",
                self.cross_stream_reuse,
                default.cross_stream_reuse,
            ),
            (
                "expandable_segments_reclaim",
                self.expandable_segments_reclaim,
                default.expandable_segments_reclaim,
            ),
            ("thread_cache", self.thread_cache, default.thread_cache),
            (
                "garbage_collection_without_fraction",
                self.garbage_collection_without_fraction,
                default.garbage_collection_without_fraction,
            ),
            (
                "oom_release_partial",
                self.oom_release_partial,
                default.oom_release_partial,
            ),
            (
                "oom_search_after_sync",
                self.oom_search_after_sync,
                default.oom_search_after_sync,
            ),
        ];
        for (key, on, by_default) in flags {
            if on != by_default {
                write!(f, ",{key}:{}", if on { "True" } else { "False" })?;
            }
        }
        if let Some(page) = self.expandable_segments_page {
            write!(f, ",expandable_segments_page_mb:{}", page / MIB)?;
        }
        Ok(())
    }
}
