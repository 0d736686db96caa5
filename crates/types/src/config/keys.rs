//! What each key of the configuration string sets, and the rules between keys (the
//! umbrella `ferrocuda_recommended` first, `large_segment_size_mb` before the bounds that
//! depend on it, PyTorch's re-parse resets, the keys the async backend ignores), all or
//! nothing.
use super::grammar::{
    Parser, Token, Value, bool_value, canonical_key, float_value, is_pow2, mib_value, parse_pairs,
    reserve_value, roundup_table, single, uint_value,
};
use super::{
    AllocatorConfig, AsyncBackendKeys, Backend, ConfigError, ConfigSourceError,
    MAX_PAGEABLE_COPY_THREADS, MAX_SEGMENT_MB, MIB, PinnedConfig, ROUNDUP_INTERVALS, SettingsText,
};
use crate::env::{EnvError, env_value};
impl AllocatorConfig {
    /// Parses `s` over the defaults.
    pub fn parse(s: &str) -> Result<AllocatorConfig, ConfigError> {
        let mut c = AllocatorConfig::default();
        c.update(s)?;
        Ok(c)
    }

    /// Applies `s` as PyTorch's runtime re-parse does: `max_split_size_mb`,
    /// `max_non_split_rounding_mb`, `roundup_power2_divisions` and
    /// `garbage_collection_threshold` return to their defaults first; other options keep
    /// their values unless named. All or nothing: on error nothing changes.
    pub fn update(&mut self, s: &str) -> Result<(), ConfigError> {
        self.update_checked(s, true)
    }

    /// [`update`](Self::update); `check_native` refuses, under the native backend, the keys
    /// the caching allocator does not build yet.
    fn update_checked(&mut self, s: &str, check_native: bool) -> Result<(), ConfigError> {
        let mut c = self.clone();
        c.sizes.max_split_size = None;
        c.sizes.roundup_power2_divisions = [0; ROUNDUP_INTERVALS];
        c.release.garbage_collection_threshold = 0.0;
        // Pass 1: `large_segment_size_mb` first, since other bounds depend on it.
        let mut p = Parser::new(s);
        let pairs = parse_pairs(&mut p)?;
        // The umbrella key first: the keys named beside it override its set.
        for (key, value) in &pairs {
            if key.text == "ferrocuda_recommended" {
                let on = bool_value(single(&p, key, value)?)?;
                if on {
                    c.update(Self::RECOMMENDED)?;
                }
                c.ferrocuda_recommended = on;
            }
        }
        c.sizes.large_segment_size = 20 * MIB;
        for (key, value) in &pairs {
            if key.text == "large_segment_size_mb" {
                let v = single(&p, key, value)?;
                let mb = uint_value(v)?;
                if mb > MAX_SEGMENT_MB {
                    return Err(p.err(
                        Some(v),
                        format!("large_segment_size_mb must be at most {MAX_SEGMENT_MB} (1 EB)"),
                    ));
                }
                if mb <= 10 {
                    return Err(p.err(
                        Some(v),
                        "CachingAllocator option large_segment_size_mb must be > 10 MB",
                    ));
                }
                c.sizes.large_segment_size = mb.saturating_mul(MIB);
            }
        }
        c.sizes.max_non_split_rounding = c.sizes.large_segment_size;
        for (key, value) in &pairs {
            c.apply(&p, key, value)?;
            if key.text == "oom_forensics" {
                check_path_as_written(&p, s, single(&p, key, value)?)?;
            }
        }
        if check_native && c.backend == Backend::Native {
            for (key, _) in &pairs {
                c.check_supported(&p, key)?;
            }
        }
        c.settings_text = SettingsText(s.to_owned());
        *self = c;
        Ok(())
    }

    /// Applies one key (the first pass's keys have been applied by then), looking it up
    /// among PyTorch's device allocator keys, PyTorch's pinned host allocator keys, then
    /// ferrocuda's own.
    fn apply(&mut self, p: &Parser, key: &Token, value: &Value) -> Result<(), ConfigError> {
        if self.apply_device_key(p, key, value)?
            || self.apply_pinned_key(p, key, value)?
            || self.apply_ferrocuda_key(p, key, value)?
        {
            return Ok(());
        }
        Err(p.err(
            Some(key),
            format!("Unrecognized key '{}' in CUDA allocator config.", key.text),
        ))
    }

    /// PyTorch's keys of the device allocator (`CUDAAllocatorConfig`): whether `key` is one.
    fn apply_device_key(
        &mut self,
        p: &Parser,
        key: &Token,
        value: &Value,
    ) -> Result<bool, ConfigError> {
        let min_mb = self.sizes.large_segment_size / MIB;
        match key.text.as_str() {
            // Applied in the first pass (see `update`).
            "large_segment_size_mb" => {}
            "max_split_size_mb" | "max_non_split_rounding_mb" => {
                let v = single(p, key, value)?;
                let bytes = mib_value(v)?;
                if bytes < self.sizes.large_segment_size {
                    return Err(p.err(
                        Some(v),
                        format!(
                            "CachingAllocator option {} too small, must be >= {min_mb}",
                            key.text
                        ),
                    ));
                }
                if key.text == "max_split_size_mb" {
                    self.sizes.max_split_size = Some(bytes);
                } else {
                    self.sizes.max_non_split_rounding = bytes;
                }
            }
            "garbage_collection_threshold" => {
                let v = single(p, key, value)?;
                let f = float_value(v)?;
                if !(f > 0.0 && f < 1.0) {
                    return Err(p.err(
                        Some(v),
                        "garbage_collect_threshold is invalid, set it in (0.0, 1.0)",
                    ));
                }
                self.release.garbage_collection_threshold = f;
            }
            "roundup_power2_divisions" => {
                self.sizes.roundup_power2_divisions = roundup_table(p, value)?
            }
            "expandable_segments" => self.expandable.enabled = bool_value(single(p, key, value)?)?,
            "backend" => {
                let v = single(p, key, value)?;
                self.backend = match v.text.as_str() {
                    "native" => Backend::Native,
                    "cudaMallocAsync" => Backend::CudaMallocAsync,
                    _ => {
                        return Err(p.err(
                            Some(v),
                            "Unknown allocator backend, options are native and cudaMallocAsync",
                        ));
                    }
                };
            }
            "release_lock_on_cudamalloc" | "release_lock_on_hipmalloc" => {
                self.release_lock_on_cudamalloc = bool_value(single(p, key, value)?)?;
            }
            "graph_capture_record_stream_reuse" => {
                self.reuse.graph_capture_record_stream_reuse = bool_value(single(p, key, value)?)?;
            }
            "throw_on_cudamalloc_oom" => {
                self.release.throw_on_cudamalloc_oom = bool_value(single(p, key, value)?)?
            }
            "per_process_memory_fraction" => {
                let v = single(p, key, value)?;
                let f = float_value(v)?;
                if !(0.0..=1.0).contains(&f) {
                    return Err(p.err(
                        Some(v),
                        "per_process_memory_fraction is invalid, set it in [0.0, 1.0]",
                    ));
                }
                self.release.per_process_memory_fraction = f;
            }
            "expandable_segments_reserve" => {
                self.expandable.reserve = Some(reserve_value(&key.text, single(p, key, value)?)?)
            }
            "expandable_segments_reserve_by_class" => {
                let Value::List(items) = value else {
                    return Err(p.err(Some(key), "expected a bracketed list [class:value,...]"));
                };
                self.expandable.reserve_by_class = items
                    .iter()
                    .map(|(k, v)| Ok((k.text.clone(), reserve_value(&key.text, v)?)))
                    .collect::<Result<_, ConfigError>>()?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// PyTorch's keys of the pinned host allocator: whether `key` is one.
    fn apply_pinned_key(
        &mut self,
        p: &Parser,
        key: &Token,
        value: &Value,
    ) -> Result<bool, ConfigError> {
        match key.text.as_str() {
            "pinned_use_cuda_host_register" | "pinned_use_hip_host_register" => {
                self.pinned.use_cuda_host_register = bool_value(single(p, key, value)?)?;
            }
            "pinned_num_register_threads" => {
                let v = single(p, key, value)?;
                let n = uint_value(v)?;
                if !is_pow2(n) {
                    return Err(p.err(
                        Some(v),
                        format!("Number of register threads has to be power of 2, got {n}"),
                    ));
                }
                if n > 128 {
                    return Err(p.err(Some(v), format!("Number of register threads should be less than or equal to 128, got {n}")));
                }
                self.pinned.num_register_threads = n;
            }
            "pinned_reserve_segment_size_mb" => {
                let v = single(p, key, value)?;
                let bytes = mib_value(v)?;
                if bytes == 0 {
                    return Err(p.err(
                        Some(v),
                        "Pinned reserve segment size has to be greater than 0",
                    ));
                }
                self.pinned.reserve_segment_size = bytes;
            }
            "pinned_use_background_threads" => {
                self.pinned.use_background_threads = bool_value(single(p, key, value)?)?
            }
            "pinned_max_round_threshold_mb" => {
                self.pinned.max_round_threshold = Some(mib_value(single(p, key, value)?)?)
            }
            "pinned_max_cached_size_mb" => {
                self.pinned.max_cached_size = Some(mib_value(single(p, key, value)?)?)
            }
            "pinned_free_catch_all" => {
                self.pinned.free_catch_all = bool_value(single(p, key, value)?)?
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// ferrocuda's own keys (each an opt-in improvement on PyTorch, off by default):
    /// whether `key` is one.
    fn apply_ferrocuda_key(
        &mut self,
        p: &Parser,
        key: &Token,
        value: &Value,
    ) -> Result<bool, ConfigError> {
        match key.text.as_str() {
            // Applied in the first pass (see `update`).
            "ferrocuda_recommended" => {}
            "expandable_segments_reclaim" => {
                self.expandable.reclaim = bool_value(single(p, key, value)?)?;
            }
            "expandable_segments_small_page_bound" => {
                self.expandable.small_page_bound = bool_value(single(p, key, value)?)?;
            }
            "expandable_segments_page_mb" => {
                let v = single(p, key, value)?;
                let mb = uint_value(v)?;
                if mb == 0 || mb % 2 != 0 || mb > MAX_SEGMENT_MB {
                    return Err(p.err(
                        Some(v),
                        format!(
                            "expandable_segments_page_mb must be a multiple of 2 (the driver's 2 MiB granularity) from 2 to {MAX_SEGMENT_MB}"
                        ),
                    ));
                }
                self.expandable.page = Some(mb * MIB);
            }
            "thread_cache" => {
                self.reuse.thread_cache = bool_value(single(p, key, value)?)?;
            }
            "cross_stream_reuse" => {
                self.reuse.cross_stream_reuse = bool_value(single(p, key, value)?)?;
            }
            "garbage_collection_without_fraction" => {
                self.release.garbage_collection_without_fraction =
                    bool_value(single(p, key, value)?)?;
            }
            "oom_release_partial" => {
                self.release.oom_release_partial = bool_value(single(p, key, value)?)?;
            }
            "oom_search_after_sync" => {
                self.release.oom_search_after_sync = bool_value(single(p, key, value)?)?;
            }
            "oom_forensics" => {
                let v = single(p, key, value)?;
                self.release.oom_forensics = match v.text.as_str() {
                    "False" => None,
                    "" | "True" => {
                        return Err(p.err(
                            Some(v),
                            "oom_forensics takes the path the snapshot is written to (or False)",
                        ));
                    }
                    path => Some(path.to_owned()),
                };
            }
            "pageable_copy_threads" => {
                let v = single(p, key, value)?;
                let n = uint_value(v)?;
                if n > MAX_PAGEABLE_COPY_THREADS {
                    return Err(p.err(
                        Some(v),
                        format!(
                            "pageable_copy_threads must be at most {MAX_PAGEABLE_COPY_THREADS}, got {n}"
                        ),
                    ));
                }
                self.pinned.pageable_copy_threads = n;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Options that parse but are not built yet: setting one is an error rather than a
    /// silent no-op. Checked once every key is applied, and only for `backend:native`: the
    /// `backend:cudaMallocAsync` allocator ignores them (see
    /// [`AllocatorConfig::async_backend_keys`]), as PyTorch's does.
    fn check_supported(&self, p: &Parser, key: &Token) -> Result<(), ConfigError> {
        let unsupported = match key.text.as_str() {
            "graph_capture_record_stream_reuse" => self.reuse.graph_capture_record_stream_reuse,
            "expandable_segments_reserve_by_class" => true,
            _ => false,
        };
        if unsupported {
            return Err(p.err(
                Some(key),
                format!("'{}' is not supported by ferrocuda yet", key.text),
            ));
        }
        Ok(())
    }

    /// What `ferrocuda_recommended:True` turns on: expandable segments whose free pages
    /// move to where memory grows (`expandable_segments_reclaim`) in 2 MiB large-pool pages,
    /// small blocks kept inside their 2 MiB pages (`expandable_segments_small_page_bound`),
    /// and the out-of-memory path that searches again after waiting for events and frees
    /// only what a request needs. Measured against PyTorch's expandable segments on eight
    /// recorded traces in `docs/measurements/traces_2026-11-23.md`.
    pub const RECOMMENDED: &'static str = "expandable_segments:True,expandable_segments_reclaim:True,expandable_segments_small_page_bound:True,expandable_segments_page_mb:2,oom_search_after_sync:True,oom_release_partial:True";

    /// The variables the configuration is read from, the first one set winning.
    pub const SOURCES: [&'static str; 3] = [
        "FERROCUDA_ALLOC_CONF",
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
    ];

    /// The value of the first of `FERROCUDA_ALLOC_CONF`, `PYTORCH_CUDA_ALLOC_CONF`,
    /// `PYTORCH_ALLOC_CONF` that is set, through `var` (`std::env::var` in
    /// [`AllocatorConfig::from_env`]). A variable that is set with a value that is not
    /// valid UTF-8 is an error naming it, not a variable to pass over: the ones after it
    /// are not read.
    pub fn source(
        var: impl Fn(&str) -> Result<String, std::env::VarError>,
    ) -> Result<Option<(&'static str, String)>, EnvError> {
        for name in Self::SOURCES {
            if let Some(value) = env_value(name, var(name))? {
                return Ok(Some((name, value)));
            }
        }
        Ok(None)
    }

    /// The configuration from the environment (see [`AllocatorConfig::source`]); the
    /// defaults when none is set. The error names the variable.
    pub fn from_env() -> Result<AllocatorConfig, ConfigSourceError> {
        match AllocatorConfig::source(|k| std::env::var(k))? {
            None => Ok(AllocatorConfig::default()),
            Some((var, value)) => AllocatorConfig::parse(&value)
                .map_err(|source| ConfigSourceError::Parse { var, source }),
        }
    }

    /// The keys this configuration sets: those named in the text it was parsed from, and
    /// those whose value differs from the default (for a configuration built in code),
    /// each once, aliases under their own name.
    fn keys_set(&self) -> Vec<String> {
        let mut keys: Vec<String> = Vec::new();
        let mut p = Parser::new(self.settings_text.as_str());
        for (key, _) in parse_pairs(&mut p).unwrap_or_default() {
            if !keys.contains(&key.text) {
                keys.push(key.text);
            }
        }
        let d = AllocatorConfig::default();
        let changed = [
            (
                "large_segment_size_mb",
                self.sizes.large_segment_size != d.sizes.large_segment_size,
            ),
            (
                "max_split_size_mb",
                self.sizes.max_split_size != d.sizes.max_split_size,
            ),
            (
                "max_non_split_rounding_mb",
                self.sizes.max_non_split_rounding != self.sizes.large_segment_size,
            ),
            (
                "garbage_collection_threshold",
                self.release.garbage_collection_threshold != d.release.garbage_collection_threshold,
            ),
            (
                "roundup_power2_divisions",
                self.sizes.roundup_power2_divisions != d.sizes.roundup_power2_divisions,
            ),
            (
                "expandable_segments",
                self.expandable.enabled != d.expandable.enabled,
            ),
            (
                "release_lock_on_cudamalloc",
                self.release_lock_on_cudamalloc != d.release_lock_on_cudamalloc,
            ),
            (
                "per_process_memory_fraction",
                self.release.per_process_memory_fraction != d.release.per_process_memory_fraction,
            ),
            (
                "graph_capture_record_stream_reuse",
                self.reuse.graph_capture_record_stream_reuse
                    != d.reuse.graph_capture_record_stream_reuse,
            ),
            (
                "throw_on_cudamalloc_oom",
                self.release.throw_on_cudamalloc_oom != d.release.throw_on_cudamalloc_oom,
            ),
            (
                "pinned_use_cuda_host_register",
                self.pinned.use_cuda_host_register != d.pinned.use_cuda_host_register,
            ),
            (
                "pinned_num_register_threads",
                self.pinned.num_register_threads != d.pinned.num_register_threads,
            ),
            (
                "pinned_use_background_threads",
                self.pinned.use_background_threads != d.pinned.use_background_threads,
            ),
            (
                "pinned_reserve_segment_size_mb",
                self.pinned.reserve_segment_size != d.pinned.reserve_segment_size,
            ),
            (
                "pinned_max_round_threshold_mb",
                self.pinned.max_round_threshold != d.pinned.max_round_threshold,
            ),
            (
                "pinned_max_cached_size_mb",
                self.pinned.max_cached_size != d.pinned.max_cached_size,
            ),
            (
                "pinned_free_catch_all",
                self.pinned.free_catch_all != d.pinned.free_catch_all,
            ),
            (
                "expandable_segments_reserve",
                self.expandable.reserve != d.expandable.reserve,
            ),
            (
                "expandable_segments_reserve_by_class",
                self.expandable.reserve_by_class != d.expandable.reserve_by_class,
            ),
            (
                "cross_stream_reuse",
                self.reuse.cross_stream_reuse != d.reuse.cross_stream_reuse,
            ),
            (
                "expandable_segments_reclaim",
                self.expandable.reclaim != d.expandable.reclaim,
            ),
            (
                "expandable_segments_small_page_bound",
                self.expandable.small_page_bound != d.expandable.small_page_bound,
            ),
            (
                "thread_cache",
                self.reuse.thread_cache != d.reuse.thread_cache,
            ),
            (
                "garbage_collection_without_fraction",
                self.release.garbage_collection_without_fraction
                    != d.release.garbage_collection_without_fraction,
            ),
            (
                "oom_release_partial",
                self.release.oom_release_partial != d.release.oom_release_partial,
            ),
            (
                "oom_search_after_sync",
                self.release.oom_search_after_sync != d.release.oom_search_after_sync,
            ),
            (
                "oom_forensics",
                self.release.oom_forensics != d.release.oom_forensics,
            ),
            (
                "expandable_segments_page_mb",
                self.expandable.page != d.expandable.page,
            ),
            (
                "pageable_copy_threads",
                self.pinned.pageable_copy_threads != d.pinned.pageable_copy_threads,
            ),
            (
                "ferrocuda_recommended",
                self.ferrocuda_recommended != d.ferrocuda_recommended,
            ),
        ];
        for (key, differs) in changed {
            let named = keys.iter().any(|k| canonical_key(k) == key);
            if differs && !named {
                keys.push(key.to_owned());
            }
        }
        keys
    }

    /// How the `backend:cudaMallocAsync` allocator reads the keys this configuration sets
    /// (see [`AsyncBackendKeys`]).
    pub fn async_backend_keys(&self) -> AsyncBackendKeys {
        let mut out = AsyncBackendKeys::default();
        for key in self.keys_set() {
            match canonical_key(&key) {
                // The backend itself, and the pinned host allocator's keys that PyTorch's
                // generic parser (`AcceleratorAllocatorConfig::parseArgs`,
                // c10/core/AllocatorConfig.cpp) reads without a warning.
                "backend"
                | "pinned_use_background_threads"
                | "pinned_max_round_threshold_mb"
                | "pinned_max_cached_size_mb" => {}
                // ferrocuda's own key for host-to-device copies, which serve both backends
                // (PyTorch knows it no more than the others).
                "pageable_copy_threads" => {}
                // The pinned host allocator's keys that PyTorch's CUDA parser
                // (`CUDAAllocatorConfig::parseArgs`) counts as native-specific: they still
                // configure the host allocator, which serves both backends.
                "pinned_use_cuda_host_register"
                | "pinned_num_register_threads"
                | "pinned_reserve_segment_size_mb"
                | "pinned_free_catch_all" => out.pinned_warned.push(key),
                // The caching allocator's options: of PyTorch's CUDA parser (it warns) or of
                // its generic parser (it says nothing; ferrocuda warns all the same).
                "release_lock_on_cudamalloc"
                | "graph_capture_record_stream_reuse"
                | "per_process_memory_fraction"
                | "throw_on_cudamalloc_oom"
                | "expandable_segments_reserve"
                | "expandable_segments_reserve_by_class"
                | "large_segment_size_mb"
                | "max_split_size_mb"
                | "max_non_split_rounding_mb"
                | "garbage_collection_threshold"
                | "roundup_power2_divisions"
                | "expandable_segments" => out.ignored.push(key),
                // ferrocuda's own keys: PyTorch knows none of them.
                _ => out.ferrocuda_only.push(key),
            }
        }
        out
    }
}

impl PinnedConfig {
    /// Applies a whole configuration string to the pinned host allocator's part: the string
    /// must parse and every key in it must be valid, all or nothing, as for
    /// [`AllocatorConfig::update`]; the `pinned_*` keys and `pageable_copy_threads` it names
    /// take effect, the others are the device allocator's to apply (and to refuse when it
    /// does not build them).
    pub fn update(&mut self, s: &str) -> Result<(), ConfigError> {
        let mut c = AllocatorConfig {
            pinned: self.clone(),
            ..AllocatorConfig::default()
        };
        c.update_checked(s, false)?;
        *self = c.pinned;
        Ok(())
    }
}

/// A path value must be what the string says: the tokenizer drops whitespace (as PyTorch's
/// parser does between keys), which would silently change a path with a space in it.
fn check_path_as_written(p: &Parser, s: &str, v: &Token) -> Result<(), ConfigError> {
    let written: String = s
        .chars()
        .skip(v.position)
        .take_while(|c| !matches!(c, ',' | ':' | '[' | ']'))
        .collect();
    if written.trim_end() == v.text {
        return Ok(());
    }
    Err(p.err(
        Some(v),
        "oom_forensics: the path may not contain spaces, ',', ':', '[' or ']'",
    ))
}
