//! A data-integrity fuzz of graphs over the caching allocator: random
//! programs of captures (new pools, shared pools, pool handles, forked side streams,
//! `record_stream` inside the capture, every capture mode), replays, eager allocations and
//! frees on several streams, `record_stream`, `empty_cache`, `update_inputs` and graph
//! drops, under random allocator configurations drawing on every key (ferrocuda's own
//! included). Every live user buffer holds a canary, checked after each replay; every
//! replay's output is checked against an eager run of the same work; the allocator's
//! invariants are checked after every step, and at the end the device must have its memory
//! back (the allocator's reserved bytes: the same check on both backends). Out of memory
//! is allowed (as a typed error); any other error, and any corruption, fails the program.
//!
//! The same programs run on two backends, picked as the conformance suite does
//! (`Harness`, its `module()` loading `KERNELS`):
//! - the fake device (a fresh 192 MiB `FakeDriver` per program, the kernels registered as
//!   fake kernels): `FERROCUDA_GRAPH_FUZZ_PROGRAMS` (default 200) programs;
//! - the real driver (`cuda_harness()`, the kernels compiled by NVRTC once, one runtime for
//!   the whole run, a fresh allocator per program): `#[ignore]`d without a GPU, run by the
//!   GPU bundle (where a missing GPU fails it), `FERROCUDA_GRAPH_FUZZ_GPU_PROGRAMS` (default
//!   100) programs. Every program's `per_process_memory_fraction` is scaled by
//!   192 MiB / device total, so the allocator sees the fake's 192 MiB on an 80 GB device too
//!   and its out-of-memory paths still run.
//!
//! `FERROCUDA_GRAPH_FUZZ_SEED` sets the first seed; `cargo xtask graph-fuzz --programs N`
//! runs the fake one in release.
#![forbid(unsafe_code)]
use ferrocuda_alloc::{Caching, CachingAllocator, DeviceAllocators};
use ferrocuda_driver::{FakeDriver, fake::Completion};
use ferrocuda_graph::{CaptureMode, CudaGraph, GraphError, PoolId};
use ferrocuda_stream::{
    DeviceBuffer, Function, KernelCache, MemoryError, Runtime, Stream, StreamError,
};
use ferrocuda_testkit::{Harness, cuda_harness, register_fake_kernels};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, KernelArg, LaunchConfig};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

const D0: DeviceIndex = DeviceIndex(0);
const MIB: u64 = 1 << 20;
const CAPACITY: u64 = 192 * MIB;

/// Keys a configuration is drawn from (each with probability 0.3, one value each).
const KEYS: &[&[&str]] = &[
    &["expandable_segments:True", "expandable_segments:False"],
    &["expandable_segments_reserve:2G"],
    &["max_split_size_mb:20", "max_split_size_mb:48"],
    &["max_non_split_rounding_mb:32"],
    &[
        "roundup_power2_divisions:4",
        "roundup_power2_divisions:[1:2,64:4,>:8]",
    ],
    &[
        "garbage_collection_threshold:0.2",
        "garbage_collection_threshold:0.7",
    ],
    &["large_segment_size_mb:12", "large_segment_size_mb:32"],
    &[
        "per_process_memory_fraction:0.5",
        "per_process_memory_fraction:0.9",
    ],
    &["release_lock_on_cudamalloc:True"],
    &["throw_on_cudamalloc_oom:True"],
    &["expandable_segments_reclaim:True"],
    &["expandable_segments_small_page_bound:True"],
    &[
        "expandable_segments_page_mb:2",
        "expandable_segments_page_mb:6",
    ],
    &["cross_stream_reuse:True"],
    &["garbage_collection_without_fraction:True"],
    &["oom_release_partial:True"],
    &["oom_search_after_sync:True"],
    &["ferrocuda_recommended:True"],
    &["thread_cache:False"],
];

/// SplitMix64: a small deterministic generator, one per program.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    /// A small whole number as `f32`, so that every computed value is exact.
    fn value(&mut self) -> f32 {
        (1 + self.below(8)) as f32
    }

    /// Elements of a buffer: mostly small, sometimes a large-pool size.
    fn length(&mut self) -> usize {
        match self.below(10) {
            0..=5 => 1 + self.below(16 << 10),
            6..=8 => (16 << 10) + self.below(512 << 10),
            _ => (300 << 10) + self.below(700 << 10),
        }
    }

    /// A valid configuration (some draws conflict, e.g. `max_split_size_mb` below
    /// `large_segment_size_mb`: they are drawn again).
    fn config(&mut self) -> String {
        loop {
            let mut keys = Vec::new();
            for choices in KEYS {
                if self.chance(30) {
                    keys.push(choices[self.below(choices.len())]);
                }
            }
            let config = keys.join(",");
            if AllocatorConfig::parse(&config).is_ok() {
                return config;
            }
        }
    }
}

/// What a captured (or eager) piece of work does to its input: each temporary (of the
/// given length, at least the input's) takes `factor * previous + 1`, the `+ 1` on a forked
/// side stream when `fork`, tied to it by `record_stream` when `record`; the output takes
/// `last * previous`. Temporaries are freed as soon as the next one is computed.
#[derive(Clone, Debug)]
struct Recipe {
    temporaries: Vec<(usize, f32)>,
    last: f32,
    fork: bool,
    record: bool,
}

impl Recipe {
    fn random(rng: &mut Rng) -> Recipe {
        Recipe {
            temporaries: (0..rng.below(3) + 1)
                .map(|_| (rng.length(), rng.value()))
                .collect(),
            last: rng.value(),
            fork: rng.chance(40),
            record: rng.chance(50),
        }
    }
}

/// A captured graph, its static input and output, and the pool group it replays with.
struct Entry {
    graph: CudaGraph,
    /// Entries capturing into one pool share a group and replay together in capture order.
    group: usize,
    recipe: Recipe,
    input: DeviceBuffer<f32>,
    input_value: f32,
    output: DeviceBuffer<f32>,
    /// What the output holds since its last replay (nothing before the first).
    expected: Option<Vec<f32>>,
}

type Failure = String;

fn is_oom(e: &StreamError) -> bool {
    matches!(
        e,
        StreamError::Memory {
            source: MemoryError::OutOfMemory(_)
        }
    )
}

/// Out of memory is allowed; any other error fails the program.
fn allow_oom<T>(r: Result<T, StreamError>, what: &str) -> Result<Option<T>, Failure> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if is_oom(&e) => Ok(None),
        Err(e) => Err(format!("{what}: {e}")),
    }
}

struct Program {
    rt: Arc<Runtime>,
    allocators: Arc<DeviceAllocators>,
    scale: Function,
    add_one: Function,
    /// The legacy default stream and two side streams.
    streams: Vec<Stream>,
    /// Eager buffers, each filled with its canary.
    user: Vec<(DeviceBuffer<f32>, f32)>,
    entries: Vec<Entry>,
    groups: usize,
    replays: u64,
}

/// A fresh fake device of [`CAPACITY`], the suite's kernels registered.
fn fake_harness() -> Harness {
    let fake = Arc::new(
        FakeDriver::builder()
            .capacity(CAPACITY)
            .completion(Completion::Manual)
            .build(),
    );
    register_fake_kernels(&fake);
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    Harness::new(rt, Some(fake))
}

impl Program {
    /// A program on `h`'s runtime with a fresh allocator of `config`, its
    /// `per_process_memory_fraction` scaled so that the limit is that fraction of
    /// [`CAPACITY`] (the identity on the fake device, which has exactly that).
    fn new(h: &Harness, config: &str) -> Result<Program, Failure> {
        let rt = h.rt.clone();
        let mut parsed = AllocatorConfig::parse(config).map_err(|e| e.to_string())?;
        let (_, total) = rt.mem_get_info(D0).map_err(|e| e.to_string())?;
        if total > CAPACITY {
            parsed.release.per_process_memory_fraction *= CAPACITY as f64 / total as f64;
        }
        let allocators = DeviceAllocators::new(rt.driver().clone(), parsed, Caching::On);
        allocators.install(&rt);
        let setup = || -> Result<_, StreamError> {
            let module = h.module()?;
            let streams = vec![
                rt.default_stream(D0)?,
                rt.new_stream(D0, 0)?,
                rt.new_stream(D0, 0)?,
            ];
            Ok((
                module.function("scale_f32")?,
                module.function("add_one_f32")?,
                streams,
            ))
        };
        let (scale, add_one, streams) = setup().map_err(|e| e.to_string())?;
        Ok(Program {
            rt,
            allocators,
            scale,
            add_one,
            streams,
            user: Vec::new(),
            entries: Vec::new(),
            groups: 0,
            replays: 0,
        })
    }

    fn alloc(&self) -> Result<&CachingAllocator, Failure> {
        self.allocators.device(D0).map_err(|e| e.to_string())
    }

    /// Runs `recipe` on `input` on the current stream `stream` (forking to `side`),
    /// returning the output. Inside a capture this is what the graph records.
    fn run(
        &self,
        recipe: &Recipe,
        input: &DeviceBuffer<f32>,
        stream: &Stream,
        side: &Stream,
    ) -> Result<DeviceBuffer<f32>, StreamError> {
        let n = input.len();
        let cfg = LaunchConfig::for_elements(n, 256);
        let n32 = n as u32;
        let count = KernelArg::value(&n32);
        let mut previous: Option<DeviceBuffer<f32>> = None;
        for &(len, factor) in &recipe.temporaries {
            let t = DeviceBuffer::<f32>::uninit(&self.rt, D0, len.max(n))?;
            let source = previous.as_ref().unwrap_or(input);
            let factor = KernelArg::value(&factor);
            stream.launch(&self.scale, &cfg, &[t.arg(), source.arg(), factor, count])?;
            let on = if recipe.fork {
                side.wait_stream(stream)?;
                side
            } else {
                stream
            };
            on.launch(&self.add_one, &cfg, &[t.arg(), count])?;
            if recipe.fork {
                if recipe.record {
                    t.record_stream(side)?;
                }
                stream.wait_stream(side)?;
            }
            previous = Some(t);
        }
        let output = DeviceBuffer::<f32>::uninit(&self.rt, D0, n)?;
        let source = previous.as_ref().unwrap_or(input);
        let last = KernelArg::value(&recipe.last);
        stream.launch(
            &self.scale,
            &cfg,
            &[output.arg(), source.arg(), last, count],
        )?;
        Ok(output)
    }

    /// One random step; its description, or why the program failed.
    fn step(&mut self, rng: &mut Rng) -> Result<String, Failure> {
        match rng.below(100) {
            0..=19 => self.eager_alloc(rng),
            20..=31 if !self.user.is_empty() => self.eager_free(rng),
            32..=46 => self.capture(rng),
            47..=74 if !self.entries.is_empty() => self.replay(rng),
            75..=81 if !self.entries.is_empty() => self.drop_graph(rng),
            82..=88 if !self.entries.is_empty() => self.update_inputs(rng),
            89..=93 => {
                self.alloc()?.empty_cache();
                Ok("empty_cache".into())
            }
            _ => {
                self.rt.synchronize(D0).map_err(|e| e.to_string())?;
                Ok("synchronize".into())
            }
        }
    }

    fn eager_alloc(&mut self, rng: &mut Rng) -> Result<String, Failure> {
        let (len, canary) = (rng.length(), rng.value());
        let stream = self.streams[rng.below(3)].clone();
        let guard = self.rt.stream_guard(&stream).map_err(|e| e.to_string())?;
        let made = allow_oom(
            DeviceBuffer::filled(&self.rt, D0, len, canary),
            "eager alloc",
        )?;
        drop(guard);
        if let Some(buf) = made {
            self.user.push((buf, canary));
        }
        Ok(format!("alloc {len} on {:?}", stream.handle()))
    }

    fn eager_free(&mut self, rng: &mut Rng) -> Result<String, Failure> {
        let (buf, _) = self.user.swap_remove(rng.below(self.user.len()));
        if rng.chance(40) {
            let other = &self.streams[1 + rng.below(2)];
            other
                .wait_stream(&self.streams[0])
                .map_err(|e| e.to_string())?;
            buf.record_stream(other).map_err(|e| e.to_string())?;
        }
        Ok(format!("free {:?}", buf.ptr()))
    }

    fn capture(&mut self, rng: &mut Rng) -> Result<String, Failure> {
        let recipe = Recipe::random(rng);
        let (pool, group) = match rng.below(10) {
            0..=4 if !self.entries.is_empty() => {
                let e = &self.entries[rng.below(self.entries.len())];
                (e.graph.pool(), e.group)
            }
            5..=6 => (Some(PoolId::handle()), self.new_group()),
            _ => (None, self.new_group()),
        };
        let stream = match rng.below(3) {
            0 => None,
            i => Some(self.streams[i].clone()),
        };
        let mode = [
            CaptureMode::ThreadLocal,
            CaptureMode::Global,
            CaptureMode::Relaxed,
        ][rng.below(3)];
        let input_value = rng.value();
        let len = rng.length().min(256 << 10);
        let made = allow_oom(
            DeviceBuffer::filled(&self.rt, D0, len, input_value),
            "static input",
        )?;
        let Some(input) = made else {
            return Ok("capture: no room for its input".into());
        };
        let graph = CudaGraph::new(self.rt.clone(), self.allocators.clone(), D0)
            .map_err(|e| e.to_string())?;
        let guard = graph
            .capture(stream.as_ref(), pool, mode)
            .map_err(|e| format!("capture begin: {e}"))?;
        let on = guard.stream().clone();
        let side = self
            .streams
            .iter()
            .find(|s| **s != on && !s.is_default())
            .cloned()
            .ok_or("no side stream")?;
        let Some(output) = allow_oom(self.run(&recipe, &input, &on, &side), "capture")? else {
            drop(guard);
            return Ok("capture ran out of memory (discarded)".into());
        };
        guard.end().map_err(|e| format!("capture end: {e}"))?;
        let what = format!(
            "capture {recipe:?} pool {pool:?} on {:?} {mode:?}",
            on.handle()
        );
        self.entries.push(Entry {
            graph,
            group,
            recipe,
            input,
            input_value,
            output,
            expected: None,
        });
        Ok(what)
    }

    fn new_group(&mut self) -> usize {
        self.groups += 1;
        self.groups
    }

    /// Replays every graph of a random group in capture order on a random stream, with new
    /// input values, then checks each output against an eager run and every canary.
    fn replay(&mut self, rng: &mut Rng) -> Result<String, Failure> {
        let group = self.entries[rng.below(self.entries.len())].group;
        let stream = self.streams[rng.below(3)].clone();
        for e in self.entries.iter_mut().filter(|e| e.group == group) {
            e.input_value = rng.value();
            let values = vec![e.input_value; e.input.len()];
            e.input.copy_from_host(&values).map_err(|e| e.to_string())?;
        }
        // The inputs were written in the current stream's order, as a user's copy would be.
        let current = self.rt.current_stream(D0).map_err(|e| e.to_string())?;
        stream.wait_stream(&current).map_err(|e| e.to_string())?;
        for e in self.entries.iter().filter(|e| e.group == group) {
            e.graph
                .replay(&stream)
                .map_err(|e| format!("replay: {e}"))?;
            self.replays += 1;
        }
        self.rt.synchronize(D0).map_err(|e| e.to_string())?;
        for i in 0..self.entries.len() {
            if self.entries[i].group == group {
                let eager = self.eager(&self.entries[i])?;
                self.entries[i].expected = eager;
            }
        }
        self.check_all()?;
        Ok(format!("replay group {group} on {:?}", stream.handle()))
    }

    /// The eager result of an entry's work on its input (`None` if it ran out of memory).
    fn eager(&self, e: &Entry) -> Result<Option<Vec<f32>>, Failure> {
        let stream = &self.streams[1];
        let _guard = self.rt.stream_guard(stream).map_err(|e| e.to_string())?;
        let out = allow_oom(
            self.run(&e.recipe, &e.input, stream, &self.streams[2]),
            "eager",
        )?;
        out.map(|o| o.to_host().map_err(|e| e.to_string()))
            .transpose()
    }

    /// Every canary, every static input and every replayed output, as they must be.
    fn check_all(&self) -> Result<(), Failure> {
        self.rt.synchronize(D0).map_err(|e| e.to_string())?;
        let uniform = |buf: &DeviceBuffer<f32>, v: f32, what: &str| -> Result<(), Failure> {
            let host = buf.to_host().map_err(|e| e.to_string())?;
            match host.iter().position(|&x| x != v) {
                None => Ok(()),
                Some(i) => Err(format!(
                    "{what} {:?}[{i}] = {}, not {v}",
                    buf.ptr(),
                    host[i]
                )),
            }
        };
        for (buf, canary) in &self.user {
            uniform(buf, *canary, "canary")?;
        }
        for e in &self.entries {
            uniform(&e.input, e.input_value, "static input")?;
            if let Some(expected) = &e.expected {
                let got = e.output.to_host().map_err(|e| e.to_string())?;
                if &got != expected {
                    return Err(format!(
                        "output {:?} differs from the eager run",
                        e.output.ptr()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Drops a graph; its output becomes a user buffer (when it holds a known value) or is
    /// freed. An output of a graph whose pool another graph still uses is always freed: the
    /// graphs captured before it may have had a temporary at its address, and their replays
    /// write there (the documented rule for shared pools: their graphs' outputs are valid
    /// after a replay of all of them in capture order).
    fn drop_graph(&mut self, rng: &mut Rng) -> Result<String, Failure> {
        let e = self.entries.remove(rng.below(self.entries.len()));
        let shared = self.entries.iter().any(|other| other.group == e.group);
        let Entry {
            graph,
            output,
            expected,
            ..
        } = e;
        drop(graph);
        let value = expected.and_then(|x| x.first().copied());
        if let Some(v) = value.filter(|_| !shared && rng.chance(50)) {
            self.user.push((output, v));
        }
        Ok("drop graph".into())
    }

    /// Points a graph at a new static input; the old one is kept as a user buffer or freed.
    fn update_inputs(&mut self, rng: &mut Rng) -> Result<String, Failure> {
        let i = rng.below(self.entries.len());
        let value = rng.value();
        let len = self.entries[i].input.len();
        let Some(new) = allow_oom(DeviceBuffer::filled(&self.rt, D0, len, value), "new input")?
        else {
            return Ok("update_inputs: no room".into());
        };
        let e = &mut self.entries[i];
        match e.graph.update_inputs(&[(&e.input, &new)]) {
            Ok(_) => {}
            Err(GraphError::Stream(s)) if is_oom(&s) => return Ok("update_inputs: oom".into()),
            Err(err) => return Err(format!("update_inputs: {err}")),
        }
        let old = std::mem::replace(&mut e.input, new);
        let old_value = std::mem::replace(&mut e.input_value, value);
        if rng.chance(50) {
            self.user.push((old, old_value));
        }
        Ok("update_inputs".into())
    }

    /// Drops everything: the device must get all its memory back.
    fn finish(mut self) -> Result<(), Failure> {
        self.check_all()?;
        self.entries.clear();
        self.user.clear();
        self.rt.synchronize(D0).map_err(|e| e.to_string())?;
        let alloc = self.alloc()?;
        alloc.empty_cache();
        alloc.check_invariants()?;
        let reserved = alloc.stats().reserved_bytes.all.current;
        if reserved != 0 {
            return Err(format!(
                "{reserved} bytes reserved after everything was dropped"
            ));
        }
        Ok(())
    }
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One program from `seed` on `h`: its replay count, or why it failed with its last steps.
fn program(h: &Harness, seed: u64) -> Result<u64, Failure> {
    let mut rng = Rng(seed);
    let config = rng.config();
    let steps = 10 + rng.below(60);
    let mut p = Program::new(h, &config).map_err(|e| format!("config {config:?}: {e}"))?;
    let mut trail = Vec::new();
    for _ in 0..steps {
        let outcome = p.step(&mut rng).and_then(|what| {
            trail.push(what);
            p.alloc()?.check_invariants()
        });
        if let Err(e) = outcome {
            let last: Vec<_> = trail.iter().rev().take(6).rev().collect();
            return Err(format!("config {config:?}: {e}; last steps {last:?}"));
        }
    }
    let replays = p.replays;
    p.finish()
        .map_err(|e| format!("config {config:?}: at the end: {e}"))?;
    Ok(replays)
}

/// Runs `programs` programs from the seed, each on the harness `harness()` gives, and fails
/// with every failed program.
fn run_programs(backend: &str, programs: u64, harness: impl Fn() -> Rc<Harness>) {
    let seed = env_number("FERROCUDA_GRAPH_FUZZ_SEED", 20_261_205);
    let start = Instant::now();
    let mut failures = Vec::new();
    let mut replays = 0;
    for n in 0..programs {
        match program(&harness(), seed + n) {
            Ok(r) => replays += r,
            Err(e) => failures.push(format!("program {n} (seed {}): {e}", seed + n)),
        }
    }
    eprintln!(
        "graph fuzz ({backend}): {programs} programs from seed {seed}, {replays} replays checked, {} failed, {:.1} s",
        failures.len(),
        start.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// On the fake device: a fresh 192 MiB device per program.
#[test]
fn random_graph_programs_corrupt_nothing() {
    let programs = env_number("FERROCUDA_GRAPH_FUZZ_PROGRAMS", 200);
    run_programs("fake device", programs, || Rc::new(fake_harness()));
}

/// On the real driver: one runtime (the kernels compiled once), a fresh allocator per
/// program, limited to 192 MiB. Fails, never skips, without a GPU (`cuda_harness`).
#[test]
#[ignore = "needs a GPU: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn random_graph_programs_corrupt_nothing_on_the_gpu() {
    let h = Rc::new(cuda_harness());
    let programs = env_number("FERROCUDA_GRAPH_FUZZ_GPU_PROGRAMS", 100);
    run_programs("GPU", programs, || h.clone());
}
