//! A wrapped function (`cudagraphify_impl` with its `fn_cache`, behind Dynamo's guards).
//!
//! A call first goes through the function's guarded specialisations
//! ([`GuardedCache`](crate::guards::GuardedCache): dtype, device, shape and stride of each
//! input, and the global state: autocast, precision flags and the caller's
//! [`LibraryState`]), most recent first, within Dynamo's recompile limits and with its
//! automatic dynamic shapes; once a limit is reached, calls no entry accepts run eagerly
//! ([`SkipReason::RecompileLimit`]). Within a specialisation, each input signature (dtype,
//! shape and staticness of each input, leading dimensions padded to buckets) has one
//! function id of the tree, with a cap on how many are kept per wrapped function (least
//! recently used evicted), as cudagraph trees record one graph per distinct size.
use super::config::WrapOptions;
use super::context::{Call, TreeFn};
use super::errors::{SkipReason, TreeError, TreeEvent};
use super::manager::Trees;
use super::nodes::FunctionId;
use super::tensor::{Input, MAX_RANK, Shape};
use crate::guards::{self, EntryId, GlobalState, GuardedCache, LibraryState, TensorMeta};
use ferrocuda_types::DType;
use parking_lot::Mutex;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

impl Trees {
    /// Wraps `f`: each call warms up, records or replays per input signature. Recompile
    /// messages name the place of this call as the function's location.
    #[track_caller]
    pub fn wrap<F: TreeFn + 'static>(self: &Arc<Self>, f: F, options: WrapOptions) -> Wrapped {
        Wrapped::new(self.clone(), Box::new(f), options)
    }
}

/// One input's part of a signature.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct KeyPart {
    dtype: DType,
    shape: Shape,
    is_static: bool,
}

#[derive(Debug)]
struct Entry {
    /// The guarded specialisation the signature belongs to.
    guard: EntryId,
    key: Vec<KeyPart>,
    function: FunctionId,
    /// The tick of its last use (for LRU eviction).
    used: u64,
}

#[derive(Debug, Default)]
struct ShapeCache {
    entries: Vec<Entry>,
    tick: u64,
    /// Signatures ever seen.
    distinct: usize,
    warned: bool,
}

/// What the guards say of a call.
enum Guarded {
    /// The specialisation that serves it.
    Entry(EntryId),
    /// Run eagerly, as this function id (a recompile limit was reached).
    Eager(FunctionId),
}

/// Which function id serves a call: the guards, then the shapes.
#[derive(Debug)]
struct Lookup {
    guards: GuardedCache<()>,
    shapes: ShapeCache,
    /// The function id that runs eagerly once a recompile limit is reached.
    eager: Option<FunctionId>,
}

/// [`Wrapped::arity`] before the first call that is not refused.
const UNSET: usize = usize::MAX;

/// A function wrapped by [`Trees::wrap`]; see the [module docs](super).
pub struct Wrapped {
    trees: Arc<Trees>,
    options: WrapOptions,
    f: Mutex<Box<dyn TreeFn>>,
    cache: Mutex<Lookup>,
    /// The number of inputs it takes: [`WrapOptions::num_inputs`], else that of the first
    /// call not refused ([`UNSET`] until then).
    arity: AtomicUsize,
}

impl std::fmt::Debug for Wrapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wrapped")
            .field("options", &self.options)
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

/// An input's sizes and contiguous strides, as the guards take them.
fn sizes_and_strides(shape: &Shape) -> ([i64; MAX_RANK], [i64; MAX_RANK], usize) {
    let dims = shape.dims();
    let (mut sizes, mut strides) = ([0i64; MAX_RANK], [0i64; MAX_RANK]);
    let mut stride = 1i64;
    for (i, &d) in dims.iter().enumerate().rev() {
        sizes[i] = i64::try_from(d).unwrap_or(i64::MAX);
        strides[i] = stride;
        stride = stride.saturating_mul(sizes[i].max(1));
    }
    (sizes, strides, dims.len())
}

impl Wrapped {
    #[track_caller]
    pub(crate) fn new(trees: Arc<Trees>, f: Box<dyn TreeFn>, options: WrapOptions) -> Wrapped {
        Wrapped {
            trees,
            cache: Mutex::new(Lookup {
                guards: GuardedCache::new(options.name.clone(), options.guards),
                shapes: ShapeCache::default(),
                eager: None,
            }),
            f: Mutex::new(f),
            arity: AtomicUsize::new(options.num_inputs.unwrap_or(UNSET)),
            options,
        }
    }

    /// Calls the function: a warm-up, a recording, a replay, or an eager run (see
    /// [`Call::served`]). A failure of the function (an error, or a panic, which goes on
    /// unwinding) leaves the tree as it was. The library part of the guarded global state
    /// is [`LibraryState::default`]; see [`Wrapped::call_with`].
    pub fn call(&self, inputs: &[Input<'_>]) -> Result<Call, TreeError> {
        self.call_with(inputs, LibraryState::default())
    }

    /// [`Wrapped::call`] under `library`: the global state the caller's tensor library owns
    /// (grad mode, default dtype, deterministic algorithms, threads), guarded with the
    /// autocast state and the precision flags.
    pub fn call_with(
        &self,
        inputs: &[Input<'_>],
        library: LibraryState,
    ) -> Result<Call, TreeError> {
        self.refuse(inputs)?;
        let shapes = self.shapes_of(inputs)?;
        self.fix_arity(inputs.len())?;
        let fid = self.function_for(inputs, &shapes, library)?;
        let mut f = self.f.lock();
        self.trees.run(fid, inputs, &shapes, &mut **f)
    }

    /// The tree manager.
    pub fn trees(&self) -> &Arc<Trees> {
        &self.trees
    }

    /// The function ids kept, one per signature, most recently used first.
    pub fn functions(&self) -> Vec<FunctionId> {
        let cache = self.cache.lock();
        let mut entries: Vec<&Entry> = cache.shapes.entries.iter().collect();
        entries.sort_by_key(|e| std::cmp::Reverse(e.used));
        entries.into_iter().map(|e| e.function).collect()
    }

    /// Refuses, before the guards see it, a call PyTorch refuses before Dynamo looks at
    /// its cache: a wrong number of inputs (Python's `TypeError` when binding the
    /// arguments, before the frame is evaluated), an input whose shape needs more bytes
    /// than its buffer holds, whatever its rank (a view past its storage cannot be made:
    /// `setStorage: sizes ... out of bounds for storage`), an output made stale by a later
    /// run (its storage's access error, `dealloc_current_path_weakrefs` in
    /// `torch/_inductor/cudagraph_trees.py`). So a refused call compiles no guard entry,
    /// uses no recompile slot (`recompile_limit`) and makes no dim dynamic (the frame
    /// state `automatic_dynamic_shapes` merges), as in `torch/_dynamo/convert_frame.py`,
    /// whose `_compile` runs only for a frame that was entered. (A rank above
    /// [`MAX_RANK`] is refused when the input is made: [`Input::shaped`].)
    fn refuse(&self, inputs: &[Input<'_>]) -> Result<(), TreeError> {
        let arity = self.arity.load(Ordering::Acquire);
        if arity != UNSET && arity != inputs.len() {
            return Err(self.input_count(arity, inputs.len()));
        }
        for (index, input) in inputs.iter().enumerate() {
            if let Some(t) = input.tree {
                t.ptr()?;
            }
            if input.used_bytes() > input.bytes {
                return Err(TreeError::InputTooSmall {
                    index,
                    shape: input.shape.dims().to_vec(),
                    dtype: input.dtype,
                    needed: input.used_bytes(),
                    bytes: input.bytes,
                });
            }
        }
        Ok(())
    }

    /// Takes `n` inputs as the function's number when none is fixed yet (the first call
    /// not refused); [`TreeError::InputCount`] when another call fixed another.
    fn fix_arity(&self, n: usize) -> Result<(), TreeError> {
        if self.arity.load(Ordering::Acquire) == n {
            return Ok(());
        }
        match (self.arity).compare_exchange(UNSET, n, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(()),
            Err(fixed) if fixed == n => Ok(()),
            Err(fixed) => Err(self.input_count(fixed, n)),
        }
    }

    fn input_count(&self, expected: usize, found: usize) -> TreeError {
        TreeError::InputCount {
            function: self.options.name.clone(),
            expected,
            found,
        }
    }

    /// The shapes the function sees: leading dimensions of non-static inputs padded to
    /// their bucket.
    fn shapes_of(&self, inputs: &[Input<'_>]) -> Result<Vec<Shape>, TreeError> {
        let Some(buckets) = &self.options.buckets else {
            return Ok(inputs.iter().map(|i| i.shape).collect());
        };
        (inputs.iter().enumerate())
            .map(|(index, input)| match input.shape.dims().first() {
                Some(&n) if !input.is_static => buckets
                    .bucket(n)
                    .map(|b| input.shape.with_leading(b))
                    .ok_or(TreeError::NoBucket { index, n }),
                _ => Ok(input.shape),
            })
            .collect()
    }

    /// The guarded specialisation that serves this call, made on a miss, or the eager
    /// function once a recompile limit was reached.
    fn guard_entry(
        &self,
        lookup: &mut Lookup,
        inputs: &[Input<'_>],
        shapes: &[Shape],
        library: LibraryState,
    ) -> Result<Guarded, TreeError> {
        let dims: Vec<_> = shapes.iter().map(sizes_and_strides).collect();
        let metas = (inputs.iter().zip(&dims))
            .map(|(i, (sizes, strides, rank))| {
                TensorMeta::new(i.dtype, i.device, false, &sizes[..*rank], &strides[..*rank])
            })
            .collect::<Result<Vec<_>, guards::GuardError>>()
            .map_err(|e| TreeError::Config(e.to_string()))?;
        let globals = GlobalState::current(library);
        let limit_hit = match lookup
            .guards
            .call(&metas, &globals, |_| Ok::<(), Infallible>(()))
        {
            Ok(guards::Call::Hit { entry, .. }) => return Ok(Guarded::Entry(entry)),
            Ok(guards::Call::Compiled {
                entry, recompile, ..
            }) => {
                if let Some(log) = recompile {
                    self.trees.report(TreeEvent::Recompile(log.to_string()));
                }
                return Ok(Guarded::Entry(entry));
            }
            Ok(guards::Call::Eager { limit_hit }) => limit_hit,
            Err(guards::CacheError::RecompileLimitHit(hit)) => {
                return Err(TreeError::Skipped(SkipReason::RecompileLimit {
                    warning: hit.to_string(),
                }));
            }
            Err(guards::CacheError::Compile(never)) => match never {},
        };
        let eager = match (lookup.eager, limit_hit) {
            (Some(eager), None) => eager,
            (_, hit) => {
                let warning = hit.map_or_else(String::new, |hit| hit.to_string());
                let skip = SkipReason::RecompileLimit { warning };
                *lookup
                    .eager
                    .insert(self.trees.register(&self.options, Some(skip)))
            }
        };
        Ok(Guarded::Eager(eager))
    }

    /// [`SkipReason::CaptureSize`] when `capture_sizes` is set and does not list the
    /// leading dimensions of the non-static inputs (`cudagraph_capture_sizes`).
    fn outside_capture_sizes(&self, inputs: &[Input<'_>], shapes: &[Shape]) -> Option<SkipReason> {
        let sizes = self.options.capture_sizes.as_ref()?;
        let key: Vec<usize> = (inputs.iter().zip(shapes))
            .filter(|(i, _)| !i.is_static)
            .map(|(_, s)| s.dims().first().copied().unwrap_or(1))
            .collect();
        (!sizes.contains(&key)).then_some(SkipReason::CaptureSize { key })
    }

    /// Which function id (and so which recordings) serves this call: the one of its
    /// guarded specialisation and signature, made on first sight (evicting the least
    /// recently used beyond the cap), or the eager one past a recompile limit.
    fn function_for(
        &self,
        inputs: &[Input<'_>],
        shapes: &[Shape],
        library: LibraryState,
    ) -> Result<FunctionId, TreeError> {
        let mut lookup = self.cache.lock();
        let guard = match self.guard_entry(&mut lookup, inputs, shapes, library)? {
            Guarded::Entry(guard) => guard,
            Guarded::Eager(eager) => return Ok(eager),
        };
        let cache = &mut lookup.shapes;
        cache.tick += 1;
        let tick = cache.tick;
        let same = |e: &Entry| {
            e.guard == guard
                && e.key.len() == inputs.len()
                && (e.key.iter().zip(inputs.iter().zip(shapes))).all(|(k, (i, s))| {
                    k.dtype == i.dtype && k.shape == *s && k.is_static == i.is_static
                })
        };
        if let Some(e) = cache.entries.iter_mut().find(|e| same(e)) {
            e.used = tick;
            return Ok(e.function);
        }
        if let Some(cap) = self.options.max_recorded_shapes
            && cache.entries.len() >= cap.max(1)
            && let Some(lru) = (cache.entries.iter().enumerate())
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
        {
            let evicted = cache.entries.swap_remove(lru);
            self.trees.evict(evicted.function)?;
        }
        let key: Vec<KeyPart> = (inputs.iter().zip(shapes))
            .map(|(i, &shape)| KeyPart {
                dtype: i.dtype,
                shape,
                is_static: i.is_static,
            })
            .collect();
        cache.distinct += 1;
        let skip = if self.trees.config.skip_dynamic_graphs && cache.distinct > 1 {
            Some(SkipReason::DynamicShapes)
        } else {
            self.outside_capture_sizes(inputs, shapes)
        };
        let function = self.trees.register(&self.options, skip);
        self.trees.report(TreeEvent::NewShape {
            function: function.0,
            key: format!(
                "{:?}",
                key.iter().map(|k| (k.dtype, k.shape)).collect::<Vec<_>>()
            ),
        });
        if let Some(limit) = self.trees.config.dynamic_shape_warn_limit
            && cache.distinct > limit
            && !cache.warned
        {
            cache.warned = true;
            self.trees.report(TreeEvent::Warning(format!(
                "CUDAGraph supports dynamic shapes by recording a new graph for each distinct input size. Recording too many CUDAGraphs may lead to extra overhead. We have observed {} distinct sizes. Please consider the following options for better performance: a) padding inputs to a few fixed number of shapes; or b) set torch._inductor.config.triton.cudagraph_skip_dynamic_graphs=True. Set torch._inductor.config.triton.cudagraph_dynamic_shape_warn_limit=None to silence this warning.",
                cache.distinct
            )));
        }
        cache.entries.push(Entry {
            guard,
            key,
            function,
            used: tick,
        });
        Ok(function)
    }
}
