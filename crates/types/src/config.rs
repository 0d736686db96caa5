//! The allocator configuration string (`FERROCUDA_ALLOC_CONF` / `PYTORCH_CUDA_ALLOC_CONF`)
//! with PyTorch's grammar (allocator spec §5): `key:value` pairs separated by `,`, list
//! values in brackets. Stricter than PyTorch where PyTorch is sloppy: a number must be all
//! digits (`40MB` is an error, not 40), and every error names the offending token and its
//! character position.
use crate::env::{EnvError, env_value};
use serde::{Deserialize, Serialize};
use std::fmt;

const MIB: u64 = 1 << 20;
/// The largest `large_segment_size_mb`: 1 EB, the largest request an allocator accepts, so
/// that size arithmetic on it cannot overflow.
const MAX_SEGMENT_MB: u64 = 1 << 40;
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

/// Every option of the allocator configuration, with PyTorch's defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllocatorConfig {
    /// `large_segment_size_mb`, in bytes (default 20 MiB).
    pub large_segment_size: u64,
    /// `max_split_size_mb`, in bytes; `None` is unlimited (the default).
    pub max_split_size: Option<u64>,
    /// `max_non_split_rounding_mb`, in bytes (default: the large segment size).
    pub max_non_split_rounding: u64,
    /// `garbage_collection_threshold` in (0, 1); 0 is off (the default).
    pub garbage_collection_threshold: f64,
    /// `roundup_power2_divisions` per interval; 0 or 1 mean plain 512-byte rounding.
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// `expandable_segments`.
    pub expandable_segments: bool,
    /// `backend`.
    pub backend: Backend,
    /// `release_lock_on_cudamalloc` (ferrocuda never holds its lock across driver calls).
    pub release_lock_on_cudamalloc: bool,
    /// `per_process_memory_fraction` in [0, 1] (default 1: no limit).
    pub per_process_memory_fraction: f64,
    /// `graph_capture_record_stream_reuse`.
    pub graph_capture_record_stream_reuse: bool,
    /// `throw_on_cudamalloc_oom`.
    pub throw_on_cudamalloc_oom: bool,
    /// `pinned_use_cuda_host_register`.
    pub pinned_use_cuda_host_register: bool,
    /// `pinned_num_register_threads` (power of two, at most 128; default 1).
    pub pinned_num_register_threads: u64,
    /// `pinned_use_background_threads`.
    pub pinned_use_background_threads: bool,
    /// `pinned_reserve_segment_size_mb`, in bytes (0: off).
    pub pinned_reserve_segment_size: u64,
    /// `pinned_max_round_threshold_mb`, in bytes (`None`: unlimited).
    pub pinned_max_round_threshold: Option<u64>,
    /// `pinned_max_cached_size_mb`, in bytes (`None`: unlimited).
    pub pinned_max_cached_size: Option<u64>,
    /// `pinned_free_catch_all`.
    pub pinned_free_catch_all: bool,
    /// `expandable_segments_reserve`: a fraction of device memory or a size in bytes.
    pub expandable_segments_reserve: Option<ReserveSize>,
    /// `expandable_segments_reserve_by_class`: `(class, reserve)` pairs.
    pub expandable_segments_reserve_by_class: Vec<(String, ReserveSize)>,
    /// `cross_stream_reuse` (ferrocuda's own): before asking the driver for a new segment,
    /// take a whole free segment cached by another stream, ordering the allocating stream
    /// after that stream's work with an event wait (no host sync). Off by default, as
    /// PyTorch never shares cached blocks across streams.
    pub cross_stream_reuse: bool,
    /// `expandable_segments_reclaim` (ferrocuda's own): before an expandable range maps
    /// new physical pages, whole free pages elsewhere in the same stream's ranges whose
    /// last use the device has run (an event mark shows it; no stream sync) are unmapped
    /// and mapped where they are needed. Physical memory then follows live bytes instead of
    /// the address layout, less so while the device lags behind the host. Off by default.
    pub expandable_segments_reclaim: bool,
    /// `thread_cache` (ferrocuda's own): a thread that frees the block it allocated last
    /// keeps it parked, and gets it back without the allocator's lock when its next request
    /// is the same (size, stream). A block is parked only where PyTorch's free-then-best-fit
    /// would hand out the same block, and statistics account for every such reuse, so
    /// single-threaded programs see exactly PyTorch's addresses and statistics. On by default.
    pub thread_cache: bool,
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
    /// `expandable_segments_page_mb` (ferrocuda's own), in bytes: the page of the large
    /// pool's expandable segments (`None`: `large_segment_size_mb`, PyTorch's 20 MiB).
    /// Smaller pages let `expandable_segments_reclaim` move memory in finer steps and
    /// strand less of it at the ends of free ranges, at the price of more map calls.
    pub expandable_segments_page: Option<u64>,
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
            large_segment_size: 20 * MIB,
            max_split_size: None,
            max_non_split_rounding: 20 * MIB,
            garbage_collection_threshold: 0.0,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            expandable_segments: false,
            backend: Backend::Native,
            release_lock_on_cudamalloc: false,
            per_process_memory_fraction: 1.0,
            graph_capture_record_stream_reuse: false,
            throw_on_cudamalloc_oom: false,
            pinned_use_cuda_host_register: false,
            pinned_num_register_threads: 1,
            pinned_use_background_threads: false,
            pinned_reserve_segment_size: 0,
            pinned_max_round_threshold: None,
            pinned_max_cached_size: None,
            pinned_free_catch_all: false,
            expandable_segments_reserve: None,
            expandable_segments_reserve_by_class: Vec::new(),
            cross_stream_reuse: false,
            expandable_segments_reclaim: false,
            thread_cache: true,
            garbage_collection_without_fraction: false,
            oom_release_partial: false,
            oom_search_after_sync: false,
            expandable_segments_page: None,
            ferrocuda_recommended: false,
            settings_text: SettingsText::default(),
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

#[derive(Clone, Debug, PartialEq)]
struct Token {
    text: String,
    position: usize,
}

fn tokenize(s: &str) -> Vec<Token> {
    let mut out: Vec<Token> = Vec::new();
    let mut word: Option<Token> = None;
    for (i, c) in s.chars().enumerate() {
        if c.is_whitespace() {
            continue;
        }
        if matches!(c, ',' | ':' | '[' | ']') {
            out.extend(word.take());
            out.push(Token {
                text: c.to_string(),
                position: i,
            });
        } else {
            word.get_or_insert(Token {
                text: String::new(),
                position: i,
            })
            .text
            .push(c);
        }
    }
    out.extend(word);
    out
}

struct Parser {
    tokens: Vec<Token>,
    at: usize,
    end: usize,
}

impl Parser {
    fn err(&self, tok: Option<&Token>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            position: tok.map_or(self.end, |t| t.position),
            token: tok.map_or(String::new(), |t| t.text.clone()),
            message: message.into(),
        }
    }

    fn next(&mut self, what: &str) -> Result<Token, ConfigError> {
        let t = self.tokens.get(self.at).cloned();
        self.at += 1;
        t.ok_or_else(|| {
            self.err(
                None,
                format!("expected {what} but reached the end of the config"),
            )
        })
    }

    fn expect(&mut self, symbol: &str) -> Result<(), ConfigError> {
        let t = self.next(&format!("'{symbol}'"))?;
        if t.text == symbol {
            Ok(())
        } else {
            Err(self.err(Some(&t), format!("expected '{symbol}'")))
        }
    }

    fn value(&mut self) -> Result<Token, ConfigError> {
        let t = self.next("a value")?;
        if matches!(t.text.as_str(), "," | ":" | "[" | "]") {
            return Err(self.err(Some(&t), "expected a value"));
        }
        Ok(t)
    }

    fn peek_is(&self, symbol: &str) -> bool {
        self.tokens.get(self.at).is_some_and(|t| t.text == symbol)
    }

    /// `[ key : value (, key : value)* ]`, the opening bracket already consumed.
    fn list(&mut self) -> Result<Vec<(Token, Token)>, ConfigError> {
        let mut items = Vec::new();
        loop {
            let key = self.value()?;
            self.expect(":")?;
            items.push((key, self.value()?));
            let sep = self.next("',' or ']'")?;
            match sep.text.as_str() {
                "," => continue,
                "]" => return Ok(items),
                _ => return Err(self.err(Some(&sep), "expected ',' or closing bracket ']'")),
            }
        }
    }
}

fn bool_value(t: &Token) -> Result<bool, ConfigError> {
    match t.text.as_str() {
        "True" => Ok(true),
        "False" => Ok(false),
        _ => Err(ConfigError {
            position: t.position,
            token: t.text.clone(),
            message: format!("Expected 'True' or 'False' but got '{}'", t.text),
        }),
    }
}

fn uint_value(t: &Token) -> Result<u64, ConfigError> {
    let bad = |m: &str| ConfigError {
        position: t.position,
        token: t.text.clone(),
        message: m.into(),
    };
    if t.text.is_empty() || !t.text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("expected a whole number"));
    }
    t.text.parse::<u64>().map_err(|_| bad("number too large"))
}

fn float_value(t: &Token) -> Result<f64, ConfigError> {
    let v: f64 = t.text.parse().map_err(|_| ConfigError {
        position: t.position,
        token: t.text.clone(),
        message: "expected a number".into(),
    })?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(ConfigError {
            position: t.position,
            token: t.text.clone(),
            message: "expected a finite number".into(),
        })
    }
}

fn mib_value(t: &Token) -> Result<u64, ConfigError> {
    // Values above what fits in bytes are clamped, as PyTorch clamps to SIZE_MAX.
    Ok(uint_value(t)?.saturating_mul(MIB))
}

/// A value of `expandable_segments_reserve` (or of an entry of
/// `expandable_segments_reserve_by_class`, `key` naming which): a fraction of the device's
/// memory, or whole GiB (`40G`), in either case > 0. PyTorch warns and keeps its default
/// for a value that is not positive (`CUDAAllocatorConfig::parseReserveSpec`,
/// c10/cuda/CUDAAllocatorConfig.cpp); here it is an error, `0G` included.
fn reserve_value(key: &str, t: &Token) -> Result<ReserveSize, ConfigError> {
    let not_positive = || ConfigError {
        position: t.position,
        token: t.text.clone(),
        message: format!(
            "{key} must be > 0: a positive fraction of the device's memory (0.5) or a \
             positive whole number of GiB (40G)"
        ),
    };
    if let Some(g) = t.text.strip_suffix('G') {
        let n = uint_value(&Token {
            text: g.into(),
            position: t.position,
        })?;
        if n == 0 {
            return Err(not_positive());
        }
        return Ok(ReserveSize::Bytes(n.saturating_mul(1 << 30)));
    }
    let f = float_value(t)?;
    if f > 0.0 {
        Ok(ReserveSize::Fraction(f))
    } else {
        Err(not_positive())
    }
}

fn is_pow2(v: u64) -> bool {
    v.is_power_of_two()
}

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
        let mut c = self.clone();
        c.max_split_size = None;
        c.roundup_power2_divisions = [0; ROUNDUP_INTERVALS];
        c.garbage_collection_threshold = 0.0;
        let tokens = tokenize(s);
        let end = s.chars().count();
        // Pass 1: `large_segment_size_mb` first, since other bounds depend on it.
        let mut p = Parser {
            tokens: tokens.clone(),
            at: 0,
            end,
        };
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
        c.large_segment_size = 20 * MIB;
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
                c.large_segment_size = mb.saturating_mul(MIB);
            }
        }
        c.max_non_split_rounding = c.large_segment_size;
        for (key, value) in &pairs {
            c.apply(&p, key, value)?;
        }
        if c.backend == Backend::Native {
            for (key, _) in &pairs {
                c.check_supported(&p, key)?;
            }
        }
        c.settings_text = SettingsText(s.to_owned());
        *self = c;
        Ok(())
    }

    fn apply(&mut self, p: &Parser, key: &Token, value: &Value) -> Result<(), ConfigError> {
        let min_mb = self.large_segment_size / MIB;
        match key.text.as_str() {
            "large_segment_size_mb" => {}
            "max_split_size_mb" | "max_non_split_rounding_mb" => {
                let v = single(p, key, value)?;
                let bytes = mib_value(v)?;
                if bytes < self.large_segment_size {
                    return Err(p.err(
                        Some(v),
                        format!(
                            "CachingAllocator option {} too small, must be >= {min_mb}",
                            key.text
                        ),
                    ));
                }
                if key.text == "max_split_size_mb" {
                    self.max_split_size = Some(bytes);
                } else {
                    self.max_non_split_rounding = bytes;
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
                self.garbage_collection_threshold = f;
            }
            "roundup_power2_divisions" => self.roundup_power2_divisions = roundup_table(p, value)?,
            "expandable_segments" => self.expandable_segments = bool_value(single(p, key, value)?)?,
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
            "pinned_use_cuda_host_register" | "pinned_use_hip_host_register" => {
                self.pinned_use_cuda_host_register = bool_value(single(p, key, value)?)?;
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
                self.pinned_num_register_threads = n;
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
                self.pinned_reserve_segment_size = bytes;
            }
            "pinned_use_background_threads" => {
                self.pinned_use_background_threads = bool_value(single(p, key, value)?)?
            }
            "pinned_max_round_threshold_mb" => {
                self.pinned_max_round_threshold = Some(mib_value(single(p, key, value)?)?)
            }
            "pinned_max_cached_size_mb" => {
                self.pinned_max_cached_size = Some(mib_value(single(p, key, value)?)?)
            }
            "pinned_free_catch_all" => {
                self.pinned_free_catch_all = bool_value(single(p, key, value)?)?
            }
            "graph_capture_record_stream_reuse" => {
                self.graph_capture_record_stream_reuse = bool_value(single(p, key, value)?)?;
            }
            "expandable_segments_reclaim" => {
                self.expandable_segments_reclaim = bool_value(single(p, key, value)?)?;
            }
            "cross_stream_reuse" => {
                self.cross_stream_reuse = bool_value(single(p, key, value)?)?;
            }
            "thread_cache" => {
                self.thread_cache = bool_value(single(p, key, value)?)?;
            }
            "garbage_collection_without_fraction" => {
                self.garbage_collection_without_fraction = bool_value(single(p, key, value)?)?;
            }
            "oom_release_partial" => {
                self.oom_release_partial = bool_value(single(p, key, value)?)?;
            }
            "oom_search_after_sync" => {
                self.oom_search_after_sync = bool_value(single(p, key, value)?)?;
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
                self.expandable_segments_page = Some(mb * MIB);
            }
            // Applied in the first pass (see `update`).
            "ferrocuda_recommended" => {}
            "throw_on_cudamalloc_oom" => {
                self.throw_on_cudamalloc_oom = bool_value(single(p, key, value)?)?
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
                self.per_process_memory_fraction = f;
            }
            "expandable_segments_reserve" => {
                self.expandable_segments_reserve =
                    Some(reserve_value(&key.text, single(p, key, value)?)?)
            }
            "expandable_segments_reserve_by_class" => {
                let Value::List(items) = value else {
                    return Err(p.err(Some(key), "expected a bracketed list [class:value,...]"));
                };
                self.expandable_segments_reserve_by_class = items
                    .iter()
                    .map(|(k, v)| Ok((k.text.clone(), reserve_value(&key.text, v)?)))
                    .collect::<Result<_, ConfigError>>()?;
            }
            _ => {
                return Err(p.err(
                    Some(key),
                    format!("Unrecognized key '{}' in CUDA allocator config.", key.text),
                ));
            }
        }
        Ok(())
    }

    /// Options that parse but are not built yet: setting one is an error rather than a
    /// silent no-op. Checked once every key is applied, and only for `backend:native`: the
    /// `backend:cudaMallocAsync` allocator ignores them (see
    /// [`AllocatorConfig::async_backend_keys`]), as PyTorch's does.
    fn check_supported(&self, p: &Parser, key: &Token) -> Result<(), ConfigError> {
        let unsupported = match key.text.as_str() {
            "graph_capture_record_stream_reuse" => self.graph_capture_record_stream_reuse,
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
    /// and the out-of-memory path that searches again after waiting for events and frees
    /// only what a request needs. Measured against PyTorch's expandable segments on eight
    /// recorded traces in `docs/measurements/traces_2026-11-23.md`.
    pub const RECOMMENDED: &'static str = "expandable_segments:True,expandable_segments_reclaim:True,expandable_segments_page_mb:2,oom_search_after_sync:True,oom_release_partial:True";

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
        let mut p = Parser {
            tokens: tokenize(self.settings_text.as_str()),
            at: 0,
            end: 0,
        };
        for (key, _) in parse_pairs(&mut p).unwrap_or_default() {
            if !keys.contains(&key.text) {
                keys.push(key.text);
            }
        }
        let d = AllocatorConfig::default();
        let changed = [
            (
                "large_segment_size_mb",
                self.large_segment_size != d.large_segment_size,
            ),
            ("max_split_size_mb", self.max_split_size != d.max_split_size),
            (
                "max_non_split_rounding_mb",
                self.max_non_split_rounding != self.large_segment_size,
            ),
            (
                "garbage_collection_threshold",
                self.garbage_collection_threshold != d.garbage_collection_threshold,
            ),
            (
                "roundup_power2_divisions",
                self.roundup_power2_divisions != d.roundup_power2_divisions,
            ),
            (
                "expandable_segments",
                self.expandable_segments != d.expandable_segments,
            ),
            (
                "release_lock_on_cudamalloc",
                self.release_lock_on_cudamalloc != d.release_lock_on_cudamalloc,
            ),
            (
                "per_process_memory_fraction",
                self.per_process_memory_fraction != d.per_process_memory_fraction,
            ),
            (
                "graph_capture_record_stream_reuse",
                self.graph_capture_record_stream_reuse != d.graph_capture_record_stream_reuse,
            ),
            (
                "throw_on_cudamalloc_oom",
                self.throw_on_cudamalloc_oom != d.throw_on_cudamalloc_oom,
            ),
            (
                "pinned_use_cuda_host_register",
                self.pinned_use_cuda_host_register != d.pinned_use_cuda_host_register,
            ),
            (
                "pinned_num_register_threads",
                self.pinned_num_register_threads != d.pinned_num_register_threads,
            ),
            (
                "pinned_use_background_threads",
                self.pinned_use_background_threads != d.pinned_use_background_threads,
            ),
            (
                "pinned_reserve_segment_size_mb",
                self.pinned_reserve_segment_size != d.pinned_reserve_segment_size,
            ),
            (
                "pinned_max_round_threshold_mb",
                self.pinned_max_round_threshold != d.pinned_max_round_threshold,
            ),
            (
                "pinned_max_cached_size_mb",
                self.pinned_max_cached_size != d.pinned_max_cached_size,
            ),
            (
                "pinned_free_catch_all",
                self.pinned_free_catch_all != d.pinned_free_catch_all,
            ),
            (
                "expandable_segments_reserve",
                self.expandable_segments_reserve != d.expandable_segments_reserve,
            ),
            (
                "expandable_segments_reserve_by_class",
                self.expandable_segments_reserve_by_class != d.expandable_segments_reserve_by_class,
            ),
            (
                "cross_stream_reuse",
                self.cross_stream_reuse != d.cross_stream_reuse,
            ),
            (
                "expandable_segments_reclaim",
                self.expandable_segments_reclaim != d.expandable_segments_reclaim,
            ),
            ("thread_cache", self.thread_cache != d.thread_cache),
            (
                "garbage_collection_without_fraction",
                self.garbage_collection_without_fraction != d.garbage_collection_without_fraction,
            ),
            (
                "oom_release_partial",
                self.oom_release_partial != d.oom_release_partial,
            ),
            (
                "oom_search_after_sync",
                self.oom_search_after_sync != d.oom_search_after_sync,
            ),
            (
                "expandable_segments_page_mb",
                self.expandable_segments_page != d.expandable_segments_page,
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

/// A key under its own name (`release_lock_on_hipmalloc` is `release_lock_on_cudamalloc`).
fn canonical_key(key: &str) -> &str {
    match key {
        "release_lock_on_hipmalloc" => "release_lock_on_cudamalloc",
        "pinned_use_hip_host_register" => "pinned_use_cuda_host_register",
        k => k,
    }
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

#[derive(Clone, Debug)]
enum Value {
    Single(Token),
    List(Vec<(Token, Token)>),
}

fn single<'a>(p: &Parser, key: &Token, v: &'a Value) -> Result<&'a Token, ConfigError> {
    match v {
        Value::Single(t) => Ok(t),
        Value::List(_) => Err(p.err(
            Some(key),
            format!("option {} takes a single value, not a list", key.text),
        )),
    }
}

fn parse_pairs(p: &mut Parser) -> Result<Vec<(Token, Value)>, ConfigError> {
    let mut pairs = Vec::new();
    while p.at < p.tokens.len() {
        let key = p.value()?;
        p.expect(":")?;
        let value = if p.peek_is("[") {
            p.at += 1;
            Value::List(p.list()?)
        } else {
            Value::Single(p.value()?)
        };
        pairs.push((key, value));
        if p.at < p.tokens.len() {
            p.expect(",")?;
            if p.at == p.tokens.len() {
                return Err(p.err(None, "expected a key after ','"));
            }
        }
    }
    Ok(pairs)
}

fn roundup_table(p: &Parser, value: &Value) -> Result<[u64; ROUNDUP_INTERVALS], ConfigError> {
    let mut table = [0u64; ROUNDUP_INTERVALS];
    match value {
        Value::Single(t) => {
            let d = uint_value(t)?;
            if !is_pow2(d) {
                return Err(p.err(Some(t), "For roundups, the divisions has to be power of 2 "));
            }
            table = [d; ROUNDUP_INTERVALS];
        }
        Value::List(items) => {
            let mut last: Option<usize> = None;
            for (k, v) in items {
                let d = uint_value(v)?;
                if d != 0 && !is_pow2(d) {
                    return Err(p.err(
                        Some(v),
                        "For roundups, the divisions has to be power of 2 or 0 to disable roundup ",
                    ));
                }
                if k.text == ">" {
                    let from = last.map_or(0, |l| l + 1);
                    table[from.min(ROUNDUP_INTERVALS)..].fill(d);
                    continue;
                }
                let mb = uint_value(k)?;
                if !is_pow2(mb) {
                    return Err(p.err(
                        Some(k),
                        "For roundups, the intervals have to be power of 2 ",
                    ));
                }
                let index = (mb.ilog2() as usize).min(ROUNDUP_INTERVALS - 1);
                if last.is_none() {
                    table[..index].fill(d);
                }
                table[index] = d;
                last = Some(index);
            }
        }
    }
    Ok(table)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_a_full_valid_string() {
        let c = AllocatorConfig::parse("").expect("a valid config");
        assert_eq!(c, AllocatorConfig::default());
        let s = "backend:native, expandable_segments:True,max_split_size_mb:512,\
                 roundup_power2_divisions:[256:1,>:4],garbage_collection_threshold:0.8,\
                 per_process_memory_fraction:0.9, release_lock_on_cudamalloc:True";
        let c = AllocatorConfig::parse(s).expect("a valid config");
        assert!(c.expandable_segments && c.release_lock_on_cudamalloc);
        assert_eq!(c.max_split_size, Some(512 * MIB));
        assert_eq!(c.garbage_collection_threshold, 0.8);
        assert_eq!(c.per_process_memory_fraction, 0.9);
        // 256 MiB is index 8; the first entry fills below it; `>` fills after it.
        let mut want = [1u64; ROUNDUP_INTERVALS];
        want[9..].fill(4);
        assert_eq!(c.roundup_power2_divisions, want);
    }

    #[test]
    fn roundup_tables_follow_the_code_not_the_docs() {
        let c =
            AllocatorConfig::parse("roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]")
                .expect("a valid config");
        let t = c.roundup_power2_divisions;
        assert_eq!(
            &t[..7],
            &[8, 8, 8, 8, 8, 8, 8],
            "64 MiB is index 6 and fills below"
        );
        assert_eq!(&t[7..11], &[2, 2, 2, 1]);
        assert!(t[11..].iter().all(|&d| d == 1));
        assert_eq!(
            AllocatorConfig::parse("roundup_power2_divisions:4")
                .map(|c| c.roundup_power2_divisions),
            Ok([4; 16])
        );
    }

    #[test]
    fn the_recommended_set_applies_first_and_named_keys_override_it() {
        let c = AllocatorConfig::parse("ferrocuda_recommended:True").unwrap_or_default();
        assert!(c.ferrocuda_recommended && c.expandable_segments);
        assert!(c.expandable_segments_reclaim && c.oom_search_after_sync && c.oom_release_partial);
        assert_eq!(c.expandable_segments_page, Some(2 * MIB));
        // Named keys win wherever they stand.
        for s in [
            "expandable_segments_page_mb:4,ferrocuda_recommended:True",
            "ferrocuda_recommended:True,expandable_segments_page_mb:4",
        ] {
            let c = AllocatorConfig::parse(s).unwrap_or_default();
            assert_eq!(c.expandable_segments_page, Some(4 * MIB), "{s}");
            assert!(c.expandable_segments_reclaim, "{s}");
        }
        let c = AllocatorConfig::parse("ferrocuda_recommended:True,large_segment_size_mb:32")
            .unwrap_or_default();
        assert_eq!(c.large_segment_size, 32 * MIB);
        let off = AllocatorConfig::parse("ferrocuda_recommended:False").unwrap_or_default();
        assert_eq!(off, AllocatorConfig::default());
        assert!(AllocatorConfig::parse("ferrocuda_recommended:yes").is_err());
        // The set itself parses.
        assert!(AllocatorConfig::parse(AllocatorConfig::RECOMMENDED).is_ok());
    }

    #[test]
    fn expandable_page_sizes_are_whole_2_mib_steps() {
        for bad in ["0", "1", "3", "2199023255554"] {
            let s = format!("expandable_segments_page_mb:{bad}");
            let e = AllocatorConfig::parse(&s).err().map(|e| e.to_string());
            assert!(
                e.as_deref().is_some_and(|e| e.contains("multiple of 2")),
                "{s}: {e:?}"
            );
        }
        let c = AllocatorConfig::parse("expandable_segments_page_mb:6").unwrap_or_default();
        assert_eq!(c.expandable_segments_page, Some(6 * MIB));
    }

    #[test]
    fn large_segment_size_is_applied_first_and_bounds_the_others() {
        let c = AllocatorConfig::parse("max_split_size_mb:40,large_segment_size_mb:32")
            .expect("a valid config");
        assert_eq!(
            (
                c.large_segment_size,
                c.max_split_size,
                c.max_non_split_rounding
            ),
            (32 * MIB, Some(40 * MIB), 32 * MIB)
        );
        let e = AllocatorConfig::parse("max_split_size_mb:30,large_segment_size_mb:32").err();
        assert!(e.is_some_and(|e| e.message.contains("must be >= 32")));
    }

    #[test]
    fn update_resets_only_the_resettable_options_and_is_atomic() {
        let mut c = AllocatorConfig::parse(
            "expandable_segments:True,max_split_size_mb:100,roundup_power2_divisions:2",
        )
        .expect("a valid config");
        assert!(c.update("garbage_collection_threshold:0.5").is_ok());
        assert!(c.expandable_segments, "kept");
        assert_eq!(
            (c.max_split_size, c.roundup_power2_divisions),
            (None, [0; 16]),
            "reset"
        );
        let before = c.clone();
        assert!(c.update("expandable_segments:False,bogus:1").is_err());
        assert_eq!(c, before, "a failed update changes nothing");
    }

    fn vars(
        set: &'static [(&'static str, &'static str)],
    ) -> impl Fn(&str) -> Result<String, std::env::VarError> {
        move |k: &str| {
            set.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
                .ok_or(std::env::VarError::NotPresent)
        }
    }

    #[test]
    fn env_precedence() {
        assert_eq!(AllocatorConfig::source(vars(&[])), Ok(None));
        static BOTH: [(&str, &str); 2] = [
            ("PYTORCH_CUDA_ALLOC_CONF", "a:1"),
            ("FERROCUDA_ALLOC_CONF", "b:2"),
        ];
        assert_eq!(
            AllocatorConfig::source(vars(&BOTH)).map(|s| s.map(|(k, _)| k)),
            Ok(Some("FERROCUDA_ALLOC_CONF"))
        );
        static TORCH: [(&str, &str); 2] = [
            ("PYTORCH_ALLOC_CONF", "c:3"),
            ("PYTORCH_CUDA_ALLOC_CONF", "a:1"),
        ];
        assert_eq!(
            AllocatorConfig::source(vars(&TORCH)).map(|s| s.map(|(k, _)| k)),
            Ok(Some("PYTORCH_CUDA_ALLOC_CONF"))
        );
    }

    /// A variable set to bytes that are not UTF-8 is an error naming it; the variables
    /// after it in the order are not read in its place (they used to win).
    #[cfg(unix)]
    #[test]
    fn a_variable_that_is_not_utf8_is_an_error_naming_it() {
        use std::os::unix::ffi::OsStringExt;
        for bad in AllocatorConfig::SOURCES {
            let var = move |k: &str| {
                if k == bad {
                    Err(std::env::VarError::NotUnicode(
                        std::ffi::OsString::from_vec(b"expandable_segments:\xff".to_vec()),
                    ))
                } else {
                    Ok("max_split_size_mb:100".to_owned())
                }
            };
            let before: Vec<_> = AllocatorConfig::SOURCES
                .into_iter()
                .take_while(|k| *k != bad)
                .collect();
            let got = AllocatorConfig::source(var);
            if let Some(first) = before.first() {
                // A variable before it is set and valid: it wins, the bad one is not read.
                assert_eq!(got.map(|s| s.map(|(k, _)| k)), Ok(Some(*first)), "{bad}");
                continue;
            }
            match got {
                Err(EnvError::NotUnicode { name, value }) => {
                    assert_eq!(name, bad);
                    assert!(value.contains(r"\xFF"), "{value}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        // Unset before it: the bad one is the first set, so the error.
        let var = |k: &str| match k {
            "PYTORCH_CUDA_ALLOC_CONF" => Err(std::env::VarError::NotUnicode(
                std::ffi::OsString::from_vec(vec![0xfe]),
            )),
            "PYTORCH_ALLOC_CONF" => Ok("max_split_size_mb:100".to_owned()),
            _ => Err(std::env::VarError::NotPresent),
        };
        let e = AllocatorConfig::source(var).err().map(|e| e.to_string());
        assert!(
            e.as_deref().is_some_and(|e| e.starts_with(
                "environment variable PYTORCH_CUDA_ALLOC_CONF is set but its value is not valid UTF-8"
            )),
            "{e:?}"
        );
    }

    #[test]
    fn a_reserve_of_zero_is_refused_in_every_form() {
        for (input, token) in [
            ("expandable_segments_reserve:0", "0"),
            ("expandable_segments_reserve:0.0", "0.0"),
            ("expandable_segments_reserve:0G", "0G"),
            ("expandable_segments_reserve:-0.5", "-0.5"),
            ("expandable_segments_reserve:1e-400", "1e-400"),
            ("expandable_segments_reserve_by_class:[decode:0G]", "0G"),
        ] {
            let e = AllocatorConfig::parse(input).err();
            let key = input.split(':').next().unwrap_or_default();
            assert!(
                e.as_ref().is_some_and(|e| e.token == token
                    && e.message
                        .starts_with(&format!("{key} must be > 0: a positive fraction"))),
                "{input}: {e:?}"
            );
        }
        for (input, want) in [
            (
                "expandable_segments_reserve:0.5",
                ReserveSize::Fraction(0.5),
            ),
            (
                "expandable_segments_reserve:1G",
                ReserveSize::Bytes(1 << 30),
            ),
        ] {
            let c = AllocatorConfig::parse(input).map(|c| c.expandable_segments_reserve);
            assert_eq!(c, Ok(Some(want)), "{input}");
        }
    }

    /// Under `backend:cudaMallocAsync` every key PyTorch accepts parses (what is not built
    /// for the caching allocator yet included: the backend ignores it), and each is read as
    /// PyTorch's backend reads it.
    #[test]
    fn keys_beside_the_async_backend() {
        let keys = |s: &str| AllocatorConfig::parse(s).map(|c| c.async_backend_keys());
        assert_eq!(
            keys("backend:cudaMallocAsync"),
            Ok(AsyncBackendKeys::default())
        );
        let all = "backend:cudaMallocAsync,max_split_size_mb:100,garbage_collection_threshold:0.5,\
                   roundup_power2_divisions:4,release_lock_on_cudamalloc:True,\
                   max_non_split_rounding_mb:64,expandable_segments:True,\
                   large_segment_size_mb:32,per_process_memory_fraction:0.5,\
                   graph_capture_record_stream_reuse:True,throw_on_cudamalloc_oom:True,\
                   expandable_segments_reserve:0.5,expandable_segments_reserve_by_class:[a:1G],\
                   pinned_use_cuda_host_register:True,pinned_num_register_threads:4,\
                   pinned_reserve_segment_size_mb:8,pinned_free_catch_all:True,\
                   pinned_use_background_threads:True,pinned_max_round_threshold_mb:16,\
                   pinned_max_cached_size_mb:64";
        let k = keys(all).unwrap_or_default();
        assert_eq!(
            k.ignored,
            [
                "max_split_size_mb",
                "garbage_collection_threshold",
                "roundup_power2_divisions",
                "release_lock_on_cudamalloc",
                "max_non_split_rounding_mb",
                "expandable_segments",
                "large_segment_size_mb",
                "per_process_memory_fraction",
                "graph_capture_record_stream_reuse",
                "throw_on_cudamalloc_oom",
                "expandable_segments_reserve",
                "expandable_segments_reserve_by_class",
            ]
        );
        assert_eq!(
            k.pinned_warned,
            [
                "pinned_use_cuda_host_register",
                "pinned_num_register_threads",
                "pinned_reserve_segment_size_mb",
                "pinned_free_catch_all",
            ]
        );
        assert!(k.ferrocuda_only.is_empty() && k.warns());
        // A key named with its default value counts (PyTorch's parser flags the key).
        let k = keys("release_lock_on_hipmalloc:False,backend:cudaMallocAsync");
        assert_eq!(
            k.map(|k| k.ignored),
            Ok(vec!["release_lock_on_hipmalloc".to_owned()])
        );
        // The pinned keys PyTorch's generic parser reads: no warning.
        let k =
            keys("backend:cudaMallocAsync,pinned_use_background_threads:True").unwrap_or_default();
        assert!(!k.warns());
        // ferrocuda's own keys.
        let k = keys("backend:cudaMallocAsync,thread_cache:False,ferrocuda_recommended:True")
            .unwrap_or_default();
        assert_eq!(
            k.ferrocuda_only,
            [
                "thread_cache",
                "ferrocuda_recommended",
                "expandable_segments_reclaim",
                "oom_release_partial",
                "oom_search_after_sync",
                "expandable_segments_page_mb"
            ]
        );
        // A configuration built in code: what differs from the defaults.
        let c = AllocatorConfig {
            backend: Backend::CudaMallocAsync,
            max_split_size: Some(64 * MIB),
            cross_stream_reuse: true,
            ..AllocatorConfig::default()
        };
        let k = c.async_backend_keys();
        assert_eq!(
            (k.ignored, k.ferrocuda_only),
            (
                vec!["max_split_size_mb".to_owned()],
                vec!["cross_stream_reuse".to_owned()]
            )
        );
    }

    /// What is not built yet is an error with the caching allocator only.
    #[test]
    fn unbuilt_options_are_errors_with_the_native_backend_only() {
        for s in [
            "graph_capture_record_stream_reuse:True",
            "expandable_segments_reserve_by_class:[a:1G]",
        ] {
            let e = AllocatorConfig::parse(s).err();
            assert!(
                e.is_some_and(|e| e.message.contains("is not supported by ferrocuda yet")),
                "{s}"
            );
            let native = format!("backend:native,{s}");
            assert!(AllocatorConfig::parse(&native).is_err(), "{native}");
            let with_async = format!("{s},backend:cudaMallocAsync");
            assert!(AllocatorConfig::parse(&with_async).is_ok(), "{with_async}");
        }
        assert!(
            AllocatorConfig::parse(
                "graph_capture_record_stream_reuse:True,graph_capture_record_stream_reuse:False"
            )
            .is_ok()
        );
    }

    #[test]
    fn display_round_trips() {
        let c = AllocatorConfig::parse("max_split_size_mb:64,roundup_power2_divisions:[32:4,>:2],garbage_collection_threshold:0.25").expect("a valid config");
        assert_eq!(AllocatorConfig::parse(&c.to_string()), Ok(c));
        // ferrocuda's own keys show where they differ from their defaults.
        let mut r = AllocatorConfig::parse("ferrocuda_recommended:True,thread_cache:False")
            .expect("a valid config");
        let text = r.to_string();
        for key in [
            "expandable_segments:True",
            "expandable_segments_reclaim:True",
            "expandable_segments_page_mb:2",
            "oom_search_after_sync:True",
            "oom_release_partial:True",
            "thread_cache:False",
        ] {
            assert!(text.contains(key), "{key} in {text}");
        }
        let back = AllocatorConfig::parse(&text).expect("its own text parses");
        // The umbrella flag itself is not shown: the keys it set are.
        r.ferrocuda_recommended = false;
        assert_eq!(back, r);
        assert!(
            !AllocatorConfig::default()
                .to_string()
                .contains("thread_cache")
        );
    }

    /// At least 30 malformed inputs, each with the token and position its error names.
    #[test]
    fn malformed_inputs_name_the_token_and_position() {
        let cases: &[(&str, &str, usize, &str)] = &[
            ("foo:1,bar:2", "foo", 0, "Unrecognized key 'foo'"),
            (
                "expandable_segments:True,bar:2",
                "bar",
                25,
                "Unrecognized key 'bar'",
            ),
            ("garbage_collection_threshold:1.2", "1.2", 29, "(0.0, 1.0)"),
            ("garbage_collection_threshold:0", "0", 29, "(0.0, 1.0)"),
            (
                "garbage_collection_threshold:-0.5",
                "-0.5",
                29,
                "(0.0, 1.0)",
            ),
            (
                "garbage_collection_threshold:abc",
                "abc",
                29,
                "expected a number",
            ),
            ("garbage_collection_threshold:nan", "nan", 29, "finite"),
            ("max_split_size_mb:2", "2", 18, "too small, must be >= 20"),
            ("max_split_size_mb:40MB", "40MB", 18, "whole number"),
            ("max_split_size_mb:-40", "-40", 18, "whole number"),
            (
                "max_split_size_mb:99999999999999999999999",
                "99999999999999999999999",
                18,
                "too large",
            ),
            (
                "max_non_split_rounding_mb:10",
                "10",
                26,
                "max_non_split_rounding_mb too small",
            ),
            ("large_segment_size_mb:10", "10", 22, "must be > 10 MB"),
            (
                "expandable_segments:true",
                "true",
                20,
                "Expected 'True' or 'False'",
            ),
            (
                "expandable_segments:1",
                "1",
                20,
                "Expected 'True' or 'False'",
            ),
            (
                "release_lock_on_cudamalloc:yes",
                "yes",
                27,
                "Expected 'True' or 'False'",
            ),
            (
                "pinned_num_register_threads:1024",
                "1024",
                28,
                "less than or equal to 128",
            ),
            ("pinned_num_register_threads:3", "3", 28, "power of 2"),
            (
                "pinned_reserve_segment_size_mb:0",
                "0",
                31,
                "greater than 0",
            ),
            (
                "roundup_power2_divisions:3",
                "3",
                25,
                "divisions has to be power of 2",
            ),
            (
                "roundup_power2_divisions:0",
                "0",
                25,
                "divisions has to be power of 2",
            ),
            (
                "roundup_power2_divisions:[64:3]",
                "3",
                29,
                "power of 2 or 0",
            ),
            (
                "roundup_power2_divisions:[96:4]",
                "96",
                26,
                "intervals have to be power of 2",
            ),
            (
                "roundup_power2_divisions:[64:8,>:1",
                "",
                34,
                "reached the end",
            ),
            (
                "roundup_power2_divisions:[64:8;>:1]",
                ":",
                32,
                "closing bracket",
            ),
            ("roundup_power2_divisions:[64]", "]", 28, "expected ':'"),
            (
                "backend:cudaMallocSync",
                "cudaMallocSync",
                8,
                "Unknown allocator backend",
            ),
            ("per_process_memory_fraction:1.5", "1.5", 28, "[0.0, 1.0]"),
            ("per_process_memory_fraction:-0.1", "-0.1", 28, "[0.0, 1.0]"),
            ("expandable_segments", "", 19, "expected ':'"),
            ("expandable_segments:", "", 20, "expected a value"),
            (":True", ":", 0, "expected a value"),
            ("expandable_segments:True,", "", 25, "expected a key"),
            (
                "expandable_segments:True expandable_segments:False",
                ":",
                44,
                "expected ','",
            ),
            (
                "expandable_segments:[a:True]",
                "expandable_segments",
                0,
                "single value",
            ),
            (
                "expandable_segments_reserve:0",
                "0",
                28,
                "positive fraction",
            ),
            (
                "expandable_segments_reserve_by_class:4",
                "expandable_segments_reserve_by_class",
                0,
                "bracketed list",
            ),
            (
                "max_split_size_mb:[1:2]",
                "max_split_size_mb",
                0,
                "single value",
            ),
        ];
        assert!(cases.len() >= 30);
        for (input, token, position, message) in cases {
            match AllocatorConfig::parse(input) {
                Ok(c) => panic!("{input:?} parsed as {c:?}"),
                Err(e) => {
                    assert_eq!(
                        (e.token.as_str(), e.position),
                        (*token, *position),
                        "{input:?}: {e}"
                    );
                    assert!(e.message.contains(message), "{input:?}: {e}");
                    assert!(e.to_string().contains(&format!("character {position}")));
                }
            }
        }
    }

    #[test]
    fn pinned_keys_parse_and_keep_their_values_across_reparses() {
        let mut c = AllocatorConfig::parse(
            "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,\
             pinned_use_background_threads:True,pinned_reserve_segment_size_mb:16,\
             pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:128,\
             pinned_free_catch_all:True",
        )
        .expect("the pinned keys are supported");
        assert!(c.pinned_use_cuda_host_register && c.pinned_use_background_threads);
        assert!(c.pinned_free_catch_all);
        assert_eq!(c.pinned_num_register_threads, 8);
        assert_eq!(c.pinned_reserve_segment_size, 16 * MIB);
        assert_eq!(c.pinned_max_round_threshold, Some(64 * MIB));
        assert_eq!(c.pinned_max_cached_size, Some(128 * MIB));
        // A re-parse resets only the device rounding options (allocator spec §1.3).
        c.update("pinned_use_hip_host_register:False")
            .expect("the alias");
        assert!(!c.pinned_use_cuda_host_register);
        assert_eq!(c.pinned_num_register_threads, 8);
        assert_eq!(c.pinned_max_cached_size, Some(128 * MIB));
    }
}
