//! The guarded cache of specialisations of one wrapped function: Dynamo's per-code-object
//! cache-entry list (`torch/csrc/dynamo/extra_state.cpp`, `cache_entry.cpp`) with its
//! recompile policy (`torch/_dynamo/convert_frame.py`, `_compile`; `cache_size.py`,
//! `exceeds_recompile_limit`).
//!
//! A call walks the entries most-recent-first; the first whose guards pass moves to the
//! front and is used. A miss compiles a new entry at the front unless a limit is reached:
//! then the warning Dynamo logs is returned as a [`LimitHit`] and the cache turns run-only
//! (entries still hit, misses run eagerly without compiling), or, with
//! `fail_on_recompile_limit_hit`, the call fails with [`CacheError::RecompileLimitHit`]. A
//! recompile reports why every entry missed, as `TORCH_LOGS="recompiles"` prints it.
use std::fmt;
use std::panic::Location;
use std::sync::atomic::{AtomicU32, Ordering};

use super::dynamic::ShapeHistory;
use super::entry::{GuardFailure, GuardSet, Specialization};
use super::global::GlobalState;
use super::tensor::{TensorGuard, TensorMeta};

/// The recompile policy (Dynamo's config names and defaults).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// Entries a function may have before a miss stops compiling (`recompile_limit`, 8).
    /// Every entry counts: there are no `ID_MATCH` guards here.
    pub recompile_limit: usize,
    /// The bound over all entries (`accumulated_recompile_limit`, 256); checked first, so
    /// it binds when `recompile_limit` is raised above it.
    pub accumulated_recompile_limit: usize,
    /// Fail the call instead of turning run-only (`fail_on_recompile_limit_hit`, false).
    pub fail_on_recompile_limit_hit: bool,
    /// After a size or stride of an input changes, compile it dynamic
    /// (`automatic_dynamic_shapes`, true; off = `torch.compile(dynamic=False)`).
    pub automatic_dynamic_shapes: bool,
}

impl Default for CacheConfig {
    fn default() -> CacheConfig {
        CacheConfig {
            recompile_limit: 8,
            accumulated_recompile_limit: 256,
            fail_on_recompile_limit_hit: false,
            automatic_dynamic_shapes: true,
        }
    }
}

/// Dynamo's compile id `frame/compile`: which wrapped function (numbered in creation order
/// per process) and which of its compile attempts.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct CompileId {
    /// The function's number.
    pub frame: u32,
    /// The attempt's number within the function.
    pub compile: u32,
}

impl fmt::Display for CompileId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.frame, self.compile)
    }
}

/// A cache entry's stable handle.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct EntryId(u32);

/// The wrapped function as the texts name it: `'<name>' (<file>:<line>)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FunctionInfo {
    /// The function's name.
    pub name: String,
    /// Where the cache was created.
    pub location: &'static Location<'static>,
}

/// Dynamo's compile counters for one function (`counters["frames"]`), plus hits and eager
/// runs.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Misses that reached the compile step (`frames.total`).
    pub frames_total: u64,
    /// Compiles that produced an entry (`frames.ok`).
    pub frames_ok: u64,
    /// Calls an entry served.
    pub hits: u64,
    /// Calls that ran eagerly because a limit was reached.
    pub eager_runs: u64,
}

/// The recompile log of one miss that compiled (`TORCH_LOGS="recompiles"`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recompile {
    /// The new entry's compile id.
    pub compile_id: CompileId,
    /// The function.
    pub function: FunctionInfo,
    /// Per entry, most recent first: `"<compile id>: <first failed guard>"`.
    pub reasons: Vec<String>,
}

impl fmt::Display for Recompile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let loc = self.function.location;
        write!(
            f,
            "Recompiling function {} in {}:{}\n    triggered by the following guard failure(s):",
            self.function.name,
            loc.file(),
            loc.line()
        )?;
        self.reasons
            .iter()
            .try_for_each(|r| write!(f, "\n    - {r}"))
    }
}

/// Which limit a miss reached.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Limit {
    /// `recompile_limit`.
    Recompile,
    /// `accumulated_recompile_limit`.
    Accumulated,
}

impl Limit {
    /// Dynamo's config name.
    pub fn name(self) -> &'static str {
        match self {
            Limit::Recompile => "recompile_limit",
            Limit::Accumulated => "accumulated_recompile_limit",
        }
    }
}

/// The warning Dynamo logs when a miss reaches a limit. `Display` is its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitHit {
    /// The attempt's compile id (the log line's `[frame/compile]` prefix).
    pub compile_id: CompileId,
    /// Which limit.
    pub limit: Limit,
    /// Its value.
    pub value: usize,
    /// The function.
    pub function: FunctionInfo,
    /// The most recent entry's failure (`"7/7: tensor 'x' size mismatch ..."`).
    pub last_reason: Option<String>,
}

const TROUBLESHOOTING_URL: &str =
    "https://pytorch.org/docs/main/torch.compiler_troubleshooting.html";

impl fmt::Display for LimitHit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let loc = self.function.location;
        writeln!(
            f,
            "torch._dynamo hit config.{} ({})",
            self.limit.name(),
            self.value
        )?;
        writeln!(
            f,
            "   function: '{}' ({}:{})",
            self.function.name,
            loc.file(),
            loc.line()
        )?;
        let reason = self
            .last_reason
            .as_deref()
            .unwrap_or("Unable to find recompilation reasons");
        writeln!(f, "   last reason: {reason}")?;
        writeln!(
            f,
            "To log all recompilation reasons, use TORCH_LOGS=\"recompiles\"."
        )?;
        write!(
            f,
            "To diagnose recompilation issues, see {TROUBLESHOOTING_URL}"
        )
    }
}

/// What a call of [`GuardedCache::call`] did.
#[derive(Debug)]
#[non_exhaustive]
pub enum Call<'a, T> {
    /// An entry's guards passed; it is now the most recent.
    Hit {
        /// The entry.
        entry: EntryId,
        /// Its value.
        value: &'a mut T,
    },
    /// A miss compiled a new entry, now the most recent.
    Compiled {
        /// The entry.
        entry: EntryId,
        /// Its value.
        value: &'a mut T,
        /// The recompile log; `None` for the function's first entry.
        recompile: Option<Recompile>,
    },
    /// Run the function eagerly: a limit was reached.
    Eager {
        /// The warning, on the call that reached the limit; `None` on later misses.
        limit_hit: Option<LimitHit>,
    },
}

/// Why [`GuardedCache::call`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError<E: std::error::Error + 'static> {
    /// A limit was reached with `fail_on_recompile_limit_hit` (`FailOnRecompileLimitHit`).
    /// The cache stays as it was; the next miss fails again.
    #[error(
        "{} reached, because fail_on_recompile_limit_hit = True this is a HARD failure",
        .0.limit.name()
    )]
    RecompileLimitHit(LimitHit),
    /// The compile step failed; no entry was added.
    #[error("compiling a specialisation failed")]
    Compile(#[source] E),
}

/// Whether an entry can still hit.
#[derive(Debug)]
enum Slot<T> {
    Live(T),
    /// Invalidated: fails every call with this reason; the value was handed back.
    Invalidated(String),
}

#[derive(Debug)]
struct Entry<T> {
    flat: GuardSet,
    spec: Specialization,
    id: CompileId,
    slot: Slot<T>,
}

impl<T> Entry<T> {
    #[inline]
    fn passes(&self, inputs: &[TensorMeta<'_>], globals: &GlobalState) -> bool {
        matches!(self.slot, Slot::Live(_)) && self.flat.check(inputs, globals)
    }
}

static FRAME_COUNTER: AtomicU32 = AtomicU32::new(0);

/// The guarded specialisations of one wrapped function; `T` is what a compile produces (a
/// recorded graph, say).
#[derive(Debug)]
pub struct GuardedCache<T> {
    function: FunctionInfo,
    frame: u32,
    config: CacheConfig,
    names: Vec<String>,
    entries: Vec<Entry<T>>,
    /// Entry indices, most recent first.
    order: Vec<u32>,
    history: ShapeHistory,
    attempts: u32,
    run_only: bool,
    stats: CacheStats,
}

impl<T> GuardedCache<T> {
    /// An empty cache for the function `name`, located where this is called (the texts'
    /// `<file>:<line>`), numbered as the process's next function.
    #[track_caller]
    pub fn new(name: impl Into<String>, config: CacheConfig) -> GuardedCache<T> {
        GuardedCache {
            function: FunctionInfo {
                name: name.into(),
                location: Location::caller(),
            },
            frame: FRAME_COUNTER.fetch_add(1, Ordering::Relaxed),
            config,
            names: Vec::new(),
            entries: Vec::new(),
            order: Vec::new(),
            history: ShapeHistory::default(),
            attempts: 0,
            run_only: false,
            stats: CacheStats::default(),
        }
    }

    /// Names the inputs in failure texts (`tensor 'x' ...`); unnamed ones are `inputs[i]`.
    pub fn with_input_names(mut self, names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.names = names.into_iter().map(Into::into).collect();
        self
    }

    /// The entry `inputs` and `globals` hit, made the most recent; `None` on a miss. The
    /// hot path: no allocation.
    #[inline]
    pub fn lookup(
        &mut self,
        inputs: &[TensorMeta<'_>],
        globals: &GlobalState,
    ) -> Option<(EntryId, &mut T)> {
        let index = self.promote(inputs, globals)?;
        match &mut self.entries.get_mut(index as usize)?.slot {
            Slot::Live(value) => Some((EntryId(index), value)),
            Slot::Invalidated(_) => None,
        }
    }

    /// Finds the first entry, most recent first, whose guards pass and moves it to the
    /// front; returns its index.
    #[inline]
    fn promote(&mut self, inputs: &[TensorMeta<'_>], globals: &GlobalState) -> Option<u32> {
        let entries = &self.entries;
        let pos = self.order.iter().position(|&i| {
            entries
                .get(i as usize)
                .is_some_and(|e| e.passes(inputs, globals))
        })?;
        self.order.get_mut(..=pos)?.rotate_right(1);
        self.stats.hits += 1;
        self.order.first().copied()
    }

    /// Serves a call: an entry's value on a hit; on a miss, `compile`s a new entry for the
    /// [`Specialization`] it is given, or says to run eagerly once a limit is reached.
    pub fn call<E: std::error::Error + 'static>(
        &mut self,
        inputs: &[TensorMeta<'_>],
        globals: &GlobalState,
        compile: impl FnOnce(&Specialization) -> Result<T, E>,
    ) -> Result<Call<'_, T>, CacheError<E>> {
        if let Some(index) = self.promote(inputs, globals) {
            return Ok(self.served(index, None));
        }
        if self.run_only {
            self.stats.eager_runs += 1;
            return Ok(Call::Eager { limit_hit: None });
        }
        self.stats.frames_total += 1;
        let compile_id = CompileId {
            frame: self.frame,
            compile: self.attempts,
        };
        self.attempts = self.attempts.saturating_add(1);
        let reasons = self.miss_reasons(inputs, globals);
        if let Some((limit, value)) = self.exceeded_limit() {
            let hit = LimitHit {
                compile_id,
                limit,
                value,
                function: self.function.clone(),
                last_reason: reasons.into_iter().next(),
            };
            if self.config.fail_on_recompile_limit_hit {
                return Err(CacheError::RecompileLimitHit(hit));
            }
            self.run_only = true;
            self.stats.eager_runs += 1;
            return Ok(Call::Eager {
                limit_hit: Some(hit),
            });
        }
        let guards = if self.config.automatic_dynamic_shapes {
            self.history.merge(inputs)
        } else {
            inputs.iter().map(TensorGuard::exact).collect()
        };
        let spec = Specialization::new(guards, *globals);
        let value = compile(&spec).map_err(CacheError::Compile)?;
        let recompile = (!self.entries.is_empty()).then(|| Recompile {
            compile_id,
            function: self.function.clone(),
            reasons,
        });
        let index = self.insert(spec, compile_id, value);
        self.stats.frames_ok += 1;
        Ok(self.served(index, Some(recompile)))
    }

    /// Why each entry, most recent first, rejects `inputs` and `globals`:
    /// `"<compile id>: <first failed guard>"` (`get_and_maybe_log_recompilation_reasons`).
    pub fn miss_reasons(&self, inputs: &[TensorMeta<'_>], globals: &GlobalState) -> Vec<String> {
        self.order
            .iter()
            .filter_map(|&i| self.entries.get(i as usize))
            .filter_map(|e| {
                let failure = match &e.slot {
                    Slot::Invalidated(what) => Some(GuardFailure::Invalidated(what.clone())),
                    Slot::Live(_) => e.spec.first_failure(inputs, globals, |i| self.name(i)),
                };
                failure.map(|f| format!("{}: {f}", e.id))
            })
            .collect()
    }

    /// Invalidates an entry whose guarded object died (`what`, e.g. "a static input"): it
    /// fails every later call (`Cache line invalidated because <what> got deallocated`),
    /// moves to the back and still counts towards the limits, as in Dynamo. Its value is
    /// handed back; `None` when `entry` is unknown or already invalidated.
    pub fn invalidate(&mut self, entry: EntryId, what: impl Into<String>) -> Option<T> {
        let e = self.entries.get_mut(entry.0 as usize)?;
        if matches!(e.slot, Slot::Invalidated(_)) {
            return None;
        }
        let Slot::Live(value) = std::mem::replace(&mut e.slot, Slot::Invalidated(what.into()))
        else {
            return None;
        };
        if let Some(pos) = self.order.iter().position(|&i| i == entry.0) {
            self.order.get_mut(pos..)?.rotate_left(1);
        }
        Some(value)
    }

    /// The entries, most recent first.
    pub fn entries(&self) -> impl Iterator<Item = EntryId> + '_ {
        self.order.iter().map(|&i| EntryId(i))
    }

    /// How many entries there are, invalidated ones included.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing was compiled yet.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// An entry's specialisation.
    pub fn specialization(&self, entry: EntryId) -> Option<&Specialization> {
        self.entries.get(entry.0 as usize).map(|e| &e.spec)
    }

    /// An entry's compile id.
    pub fn compile_id(&self, entry: EntryId) -> Option<CompileId> {
        self.entries.get(entry.0 as usize).map(|e| e.id)
    }

    /// An entry's value; `None` once invalidated.
    pub fn value(&self, entry: EntryId) -> Option<&T> {
        match &self.entries.get(entry.0 as usize)?.slot {
            Slot::Live(v) => Some(v),
            Slot::Invalidated(_) => None,
        }
    }

    /// Whether a limit was reached and misses now run eagerly.
    pub fn is_run_only(&self) -> bool {
        self.run_only
    }

    /// The counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// The function.
    pub fn function(&self) -> &FunctionInfo {
        &self.function
    }

    /// The policy.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    fn name(&self, i: usize) -> String {
        self.names
            .get(i)
            .cloned()
            .unwrap_or_else(|| format!("inputs[{i}]"))
    }

    /// `exceeds_recompile_limit`, checked before compiling: the accumulated limit first.
    fn exceeded_limit(&self) -> Option<(Limit, usize)> {
        let n = self.entries.len();
        if n >= self.config.accumulated_recompile_limit {
            Some((Limit::Accumulated, self.config.accumulated_recompile_limit))
        } else if n >= self.config.recompile_limit {
            Some((Limit::Recompile, self.config.recompile_limit))
        } else {
            None
        }
    }

    fn insert(&mut self, spec: Specialization, id: CompileId, value: T) -> u32 {
        // The limits bound the entry count far below u32::MAX.
        let index = u32::try_from(self.entries.len()).unwrap_or(u32::MAX);
        self.entries.push(Entry {
            flat: GuardSet::new(&spec),
            spec,
            id,
            slot: Slot::Live(value),
        });
        self.order.insert(0, index);
        index
    }

    /// The call's answer for a live entry: a hit, or with `compiled` (its recompile log) a
    /// new entry. Only live entries pass or are inserted, so the eager fallback is never
    /// taken; it exists so that no path can panic.
    fn served(&mut self, index: u32, compiled: Option<Option<Recompile>>) -> Call<'_, T> {
        let entry = EntryId(index);
        match (
            self.entries.get_mut(index as usize).map(|e| &mut e.slot),
            compiled,
        ) {
            (Some(Slot::Live(value)), None) => Call::Hit { entry, value },
            (Some(Slot::Live(value)), Some(recompile)) => Call::Compiled {
                entry,
                value,
                recompile,
            },
            _ => Call::Eager { limit_hit: None },
        }
    }
}
