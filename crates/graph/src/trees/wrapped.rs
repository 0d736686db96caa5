//! A wrapped function (`cudagraphify_impl` with its `fn_cache`): per input signature
//! (dtype, shape and staticness of each input, leading dimensions padded to buckets) one
//! function id of the tree, with a cap on how many are kept (least recently used evicted).
//!
//! The choice of which function id serves a call lives in one place,
//! `Wrapped::function_for`: a guard cache (dtype/device/shape/stride and global-state
//! guards) can replace its plain signature lookup without touching the tree.
use super::config::WrapOptions;
use super::context::{Call, TreeFn};
use super::errors::{SkipReason, TreeError, TreeEvent};
use super::manager::Trees;
use super::nodes::FunctionId;
use super::tensor::{Input, Shape};
use ferrocuda_types::DType;
use parking_lot::Mutex;
use std::sync::Arc;

/// One input's part of a signature.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct KeyPart {
    dtype: DType,
    shape: Shape,
    is_static: bool,
}

#[derive(Debug)]
struct Entry {
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

/// A function wrapped by [`Trees::wrap`]; see the [module docs](super).
pub struct Wrapped {
    trees: Arc<Trees>,
    options: WrapOptions,
    f: Mutex<Box<dyn TreeFn>>,
    cache: Mutex<ShapeCache>,
}

impl std::fmt::Debug for Wrapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wrapped")
            .field("options", &self.options)
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

impl Wrapped {
    pub(crate) fn new(trees: Arc<Trees>, f: Box<dyn TreeFn>, options: WrapOptions) -> Wrapped {
        Wrapped {
            trees,
            options,
            f: Mutex::new(f),
            cache: Mutex::new(ShapeCache::default()),
        }
    }

    /// Calls the function: a warm-up, a recording, a replay, or an eager run (see
    /// [`Call::served`]). A failure of the function (an error, or a panic, which goes on
    /// unwinding) leaves the tree as it was.
    pub fn call(&self, inputs: &[Input<'_>]) -> Result<Call, TreeError> {
        let shapes = self.shapes_of(inputs)?;
        let fid = self.function_for(inputs, &shapes)?;
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
        let mut entries: Vec<&Entry> = cache.entries.iter().collect();
        entries.sort_by_key(|e| std::cmp::Reverse(e.used));
        entries.into_iter().map(|e| e.function).collect()
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

    /// Which function id (and so which recordings) serves this call: the one of its
    /// signature, made on first sight (evicting the least recently used beyond the cap).
    fn function_for(
        &self,
        inputs: &[Input<'_>],
        shapes: &[Shape],
    ) -> Result<FunctionId, TreeError> {
        let mut cache = self.cache.lock();
        cache.tick += 1;
        let tick = cache.tick;
        let same = |e: &Entry| {
            e.key.len() == inputs.len()
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
        let skip = (self.trees.config.skip_dynamic_graphs && cache.distinct > 1)
            .then_some(SkipReason::DynamicShapes);
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
            key,
            function,
            used: tick,
        });
        Ok(function)
    }
}
