//! A data-integrity fuzz of the trees: random programs of calls of five wrapped functions
//! (one writing its input in place, one allocating a temporary before it reads its input,
//! one with a static input), steps, dropped outputs and outputs moved out, under every
//! generation policy, every input feed, one or two warm-ups, two input sizes and capped
//! functions that evict recordings. Half the programs also repeat a random loop body, step
//! after step (training and decode loops: warm-up, recording, then replays), whose calls
//! take outputs of the same iteration and of the previous one, across the step boundary.
//! Inputs are callers' buffers or outputs of earlier calls, stale or not.
//!
//! A host model knows every buffer's and every held output's values. Each call must give
//! the model's values, or fail with the typed stale error, and only when one of its inputs
//! is an output that is stale (before the call, or made stale by the path the call ended);
//! an input stale before the call must be refused. After every operation each held output
//! either reads its model values or is `StaleOutput`: never wrong data. At the end the
//! tree is dropped and nothing of its pool stays in use.
//!
//! `FERROCUDA_TREES_FUZZ_PROGRAMS` (default 40) programs from `FERROCUDA_TREES_FUZZ_SEED`.
use crate::{D0, Setup, TestResult, random};
use ferrocuda_graph::trees::{
    Arg, Ctx, FunctionMode, GenerationPolicy, Input, InputFeed, Served, TreeConfig, TreeError,
    TreeTensor, Trees, WrapOptions, Wrapped,
};
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_testkit::Harness;
use std::sync::Arc;

/// Elements of the tensors: two sizes, so that signatures change, guards recompile and
/// capped functions evict recordings.
const SIZES: [usize; 2] = [64, 32];
/// Operations per program.
const OPS: usize = 100;
/// Outputs held at most (the oldest is dropped beyond).
const HELD: usize = 12;

/// SplitMix64.
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
}

/// The wrapped functions, with their host twins.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Kind {
    /// `2 x`.
    Scale,
    /// `x + y`.
    Sum,
    /// `x += 1` in place, then `3 x` (`mutated_inputs: [0]`).
    Bump,
    /// `x + 0 x`, the temporary `0 x` allocated first (it lands on a freed block).
    Temp,
    /// `x + w`, `w` static.
    AddStatic,
}

const KINDS: [Kind; 5] = [
    Kind::Scale,
    Kind::Sum,
    Kind::Bump,
    Kind::Temp,
    Kind::AddStatic,
];

impl Kind {
    /// Non-static inputs (`AddStatic` takes the static buffer after them).
    fn arity(self) -> usize {
        if self == Kind::Sum { 2 } else { 1 }
    }

    fn expected(self, xs: &[&[f32]], w: &[f32]) -> Vec<f32> {
        let x = xs[0];
        match self {
            Kind::Scale => x.iter().map(|v| 2.0 * v).collect(),
            Kind::Sum => x.iter().zip(xs[1]).map(|(a, b)| a + b).collect(),
            Kind::Bump => x.iter().map(|v| 3.0 * (v + 1.0)).collect(),
            Kind::Temp => x.iter().map(|v| v + 0.0 * v).collect(),
            Kind::AddStatic => x.iter().zip(w).map(|(a, b)| a + b).collect(),
        }
    }
}

/// Where a call's non-static input comes from.
#[derive(Copy, Clone, Debug)]
enum Source {
    /// A caller's buffer.
    Buffer(usize),
    /// A held output, by id.
    Held(u64),
}

/// Where an input of a loop body's call comes from.
#[derive(Copy, Clone, Debug)]
enum BodySource {
    Buffer(usize),
    /// Output of the `i`-th call of this iteration.
    This(usize),
    /// Output of the `i`-th call of the previous iteration (an earlier step).
    Last(usize),
}

/// One call of a loop body.
#[derive(Clone, Debug)]
struct BodyCall {
    function: usize,
    sources: Vec<BodySource>,
}

/// A loop body, its size, and the outputs of its last iteration (held ids).
struct Body {
    size: usize,
    calls: Vec<BodyCall>,
    last: Vec<Option<u64>>,
}

/// An output kept by the program, with the values it must read while valid.
struct Held {
    id: u64,
    tensor: TreeTensor,
    values: Vec<f32>,
    what: String,
}

struct Program<'s> {
    s: &'s Setup<'s>,
    rng: Rng,
    policy: GenerationPolicy,
    functions: Vec<(Kind, Wrapped)>,
    /// Callers' buffers, two of each size, with their values.
    buffers: Vec<(DeviceBuffer<f32>, Vec<f32>)>,
    /// The static input of `AddStatic`, one per size.
    weights: Vec<(DeviceBuffer<f32>, Vec<f32>)>,
    held: Vec<Held>,
    next_id: u64,
    body: Option<Body>,
    log: Vec<String>,
    refusals: usize,
    /// Calls served by a warm-up, a recording, a replay, eagerly.
    served: [usize; 4],
}

fn mismatch(got: &[f32], want: &[f32]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} values, expected {}", got.len(), want.len()));
    }
    let i = (got.iter().zip(want)).position(|(a, b)| a.to_bits() != b.to_bits())?;
    Some(format!("element {i} is {}, expected {}", got[i], want[i]))
}

impl<'s> Program<'s> {
    fn new(s: &'s Setup<'s>, seed: u64) -> Result<(Program<'s>, TreeConfig), crate::BoxError> {
        let mut rng = Rng(seed);
        let policy = if seed.is_multiple_of(2) {
            GenerationPolicy::Explicit
        } else {
            GenerationPolicy::Heuristic
        };
        let input_feed = match rng.below(3) {
            0 => InputFeed::Copy,
            1 => InputFeed::Patch,
            _ => InputFeed::Auto {
                min_bytes: (SIZES[0] * size_of::<f32>()) as u64,
            },
        };
        let config = TreeConfig {
            warmup_runs: 1 + rng.below(2) as u32,
            generations: policy,
            input_feed,
            kept_instances: 1 + rng.below(3),
            ..TreeConfig::default()
        };
        let made = |n: usize, i: u64| -> Result<(DeviceBuffer<f32>, Vec<f32>), crate::BoxError> {
            let v = random(n, seed.wrapping_mul(31).wrapping_add(i));
            Ok((s.buffer(&v)?, v))
        };
        let buffers = (0..4)
            .map(|i| made(SIZES[i % 2], i as u64))
            .collect::<Result<Vec<_>, _>>()?;
        let weights = (0..2)
            .map(|i| made(SIZES[i], 10 + i as u64))
            .collect::<Result<Vec<_>, _>>()?;
        let program = Program {
            s,
            rng,
            policy,
            functions: Vec::new(),
            buffers,
            weights,
            held: Vec::new(),
            next_id: 0,
            body: None,
            log: Vec::new(),
            refusals: 0,
            served: [0; 4],
        };
        Ok((program, config))
    }

    /// Wraps one function of each kind, and draws a loop body for half the programs.
    fn wrap(&mut self, trees: &Arc<Trees>) {
        for kind in KINDS {
            let k = self.s.k.clone();
            let mode = match self.rng.below(6) {
                0 => FunctionMode::Forward,
                1 => FunctionMode::Backward,
                _ => FunctionMode::Inference,
            };
            let f = trees.wrap(
                move |ctx: &mut Ctx<'_>, a: &[Arg]| {
                    let x = &a[0];
                    let out = match kind {
                        Kind::Scale => k.scaled(ctx, x, 2.0)?,
                        Kind::Sum | Kind::AddStatic => k.sum(ctx, x, &a[1])?,
                        Kind::Bump => {
                            k.add_one(ctx.stream(), x.arg(), x.numel())?;
                            k.scaled(ctx, x, 3.0)?
                        }
                        Kind::Temp => {
                            let zero = k.scaled(ctx, x, 0.0)?;
                            k.sum(ctx, x, &zero.as_arg())?
                        }
                    };
                    Ok(vec![out])
                },
                WrapOptions {
                    name: format!("{kind:?}"),
                    mode,
                    mutated_inputs: if kind == Kind::Bump { vec![0] } else { vec![] },
                    // Sometimes one signature kept: the other size evicts its recordings.
                    max_recorded_shapes: self.rng.chance(30).then_some(1),
                    ..WrapOptions::default()
                },
            );
            self.functions.push((kind, f));
        }
        if self.rng.chance(50) {
            let size = self.rng.below(SIZES.len());
            let len = 2 + self.rng.below(3);
            let mut calls = Vec::with_capacity(len);
            for c in 0..len {
                let function = self.rng.below(self.functions.len());
                let sources = (0..self.functions[function].0.arity())
                    .map(|_| match self.rng.below(10) {
                        0..5 if c > 0 => BodySource::This(self.rng.below(c)),
                        0..8 => BodySource::Last(self.rng.below(len)),
                        _ => BodySource::Buffer(2 * self.rng.below(2) + size),
                    })
                    .collect();
                calls.push(BodyCall { function, sources });
            }
            self.body = Some(Body {
                size,
                calls,
                last: vec![None; len],
            });
        }
    }

    fn fail(&self, what: String) -> crate::BoxError {
        let tail = self.log.len().saturating_sub(12);
        format!(
            "{what}\n  last operations:\n    {}",
            self.log[tail..].join("\n    ")
        )
        .into()
    }

    fn position(&self, id: u64) -> Option<usize> {
        self.held.iter().position(|h| h.id == id)
    }

    fn hold(&mut self, tensor: TreeTensor, values: Vec<f32>, what: String) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.held.push(Held {
            id,
            tensor,
            values,
            what,
        });
        if self.held.len() > HELD {
            self.held.remove(0);
        }
        id
    }

    /// Every held output reads its values, or is stale.
    fn check_all(&self) -> TestResult {
        for h in &self.held {
            match h.tensor.to_host::<f32>() {
                Ok(got) => {
                    if let Some(m) = mismatch(&got, &h.values) {
                        return Err(self.fail(format!("held {} (valid): {m}", h.what)));
                    }
                }
                Err(TreeError::StaleOutput { .. }) if !h.tensor.is_valid() => {}
                Err(e) => return Err(self.fail(format!("held {}: {e}", h.what))),
            }
        }
        Ok(())
    }

    /// An input of `n` elements: a held output of that size (a valid one mostly), or a
    /// caller's buffer.
    fn source(&mut self, n: usize) -> Source {
        let of_size: Vec<&Held> = (self.held.iter()).filter(|h| h.values.len() == n).collect();
        let valid: Vec<u64> = (of_size.iter())
            .filter(|h| h.tensor.is_valid())
            .map(|h| h.id)
            .collect();
        let any: Vec<u64> = of_size.iter().map(|h| h.id).collect();
        if !any.is_empty() && self.rng.chance(60) {
            let pick = if !valid.is_empty() && self.rng.chance(75) {
                valid
            } else {
                any
            };
            return Source::Held(pick[self.rng.below(pick.len())]);
        }
        let size = SIZES.iter().position(|&s| s == n).unwrap_or(0);
        Source::Buffer(2 * self.rng.below(2) + size)
    }

    /// A random call.
    fn random_call(&mut self) -> TestResult {
        let function = self.rng.below(self.functions.len());
        let size = self.rng.below(SIZES.len());
        let sources: Vec<Source> = (0..self.functions[function].0.arity())
            .map(|_| self.source(SIZES[size]))
            .collect();
        let keep = self.rng.chance(75);
        self.call(function, size, &sources, keep).map(|_| ())
    }

    /// One iteration of the loop body: a step (mostly, under explicit steps), then its
    /// calls, each output held for the next calls and the next iteration.
    fn iterate(&mut self, trees: &Trees) -> TestResult {
        let Some(body) = self.body.take() else {
            return self.random_call();
        };
        if self.policy == GenerationPolicy::Explicit && self.rng.chance(85) {
            trees.mark_step_begin();
            self.log.push("mark_step_begin (loop)".into());
        }
        let mut this: Vec<Option<u64>> = vec![None; body.calls.len()];
        let mut result = Ok(());
        for (c, call) in body.calls.iter().enumerate() {
            let sources: Vec<Source> = (call.sources.iter())
                .map(|src| {
                    let id = match *src {
                        BodySource::This(i) => this.get(i).copied().flatten(),
                        BodySource::Last(i) => body.last.get(i).copied().flatten(),
                        BodySource::Buffer(b) => return Source::Buffer(b),
                    };
                    match id.filter(|&id| self.position(id).is_some()) {
                        Some(id) => Source::Held(id),
                        None => Source::Buffer(body.size),
                    }
                })
                .collect();
            match self.call(call.function, body.size, &sources, true) {
                Ok(id) => this[c] = id,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.body = Some(Body { last: this, ..body });
        result
    }

    /// Calls `function` on `sources` (of size index `size`) and checks the outcome; the id
    /// of its output when kept.
    fn call(
        &mut self,
        function: usize,
        size: usize,
        sources: &[Source],
        keep: bool,
    ) -> Result<Option<u64>, crate::BoxError> {
        let kind = self.functions[function].0;
        let held: Vec<Option<usize>> = (sources.iter())
            .map(|src| match *src {
                Source::Held(id) => self.position(id),
                Source::Buffer(_) => None,
            })
            .collect();
        if (sources.iter().zip(&held)).any(|(s, h)| matches!(s, Source::Held(_)) && h.is_none()) {
            return Err(self.fail(format!("{kind:?}: an input was dropped")));
        }
        let mut inputs: Vec<Input<'_>> = (sources.iter().zip(&held))
            .map(|(src, h)| match *h {
                Some(h) => Input::output(&self.held[h].tensor),
                None => Input::buffer(&self.buffers[b_of(*src)].0),
            })
            .collect();
        if kind == Kind::AddStatic {
            inputs.push(Input::buffer(&self.weights[size].0).mark_static());
        }
        let tree_inputs: Vec<&TreeTensor> = held
            .iter()
            .flatten()
            .map(|&h| &self.held[h].tensor)
            .collect();
        let stale_before = tree_inputs.iter().any(|t| !t.is_valid());
        let values: Vec<&[f32]> = (sources.iter().zip(&held))
            .map(|(src, h)| match *h {
                Some(h) => self.held[h].values.as_slice(),
                None => self.buffers[b_of(*src)].1.as_slice(),
            })
            .collect();
        let expected = kind.expected(&values, &self.weights[size].1);
        let described: Vec<String> = (sources.iter().zip(&held))
            .map(|(src, h)| match *h {
                Some(h) => {
                    let h = &self.held[h];
                    let stale = if h.tensor.is_valid() { "" } else { " (stale)" };
                    format!("{}{stale}", h.what)
                }
                None => format!("buffer {}", b_of(*src)),
            })
            .collect();
        let result = self.functions[function].1.call(&inputs);
        let stale_after = tree_inputs.iter().any(|t| !t.is_valid());
        drop(inputs);
        let line = format!("call {kind:?}({})", described.join(", "));
        let call = match result {
            Ok(call) if stale_before => {
                return Err(self.fail(format!(
                    "{line}: a stale input was accepted ({:?})",
                    call.served
                )));
            }
            Ok(call) => call,
            Err(TreeError::StaleOutput { .. }) if stale_after => {
                self.refusals += 1;
                self.log.push(format!("{line}: StaleOutput"));
                return Ok(None);
            }
            Err(e) => return Err(self.fail(format!("{line}: {e}"))),
        };
        self.served[match call.served {
            Served::Warmup => 0,
            Served::Recorded => 1,
            Served::Replayed => 2,
            _ => 3,
        }] += 1;
        self.log.push(format!("{line}: {:?}", call.served));
        let [out] = call.outputs.as_slice() else {
            return Err(self.fail(format!("{line}: {} outputs", call.outputs.len())));
        };
        match out.to_host::<f32>() {
            Ok(got) => {
                if let Some(m) = mismatch(&got, &expected) {
                    return Err(self.fail(format!("{line} ({:?}): {m}", call.served)));
                }
            }
            Err(e) => return Err(self.fail(format!("{line}: its output: {e}"))),
        }
        if kind == Kind::Bump {
            // The write lands once, however the call was served.
            let values = match held[0] {
                Some(h) => &mut self.held[h].values,
                None => &mut self.buffers[b_of(sources[0])].1,
            };
            values.iter_mut().for_each(|x| *x += 1.0);
        }
        if !keep {
            return Ok(None);
        }
        let what = format!("{kind:?}#{}", self.next_id);
        Ok(Some(self.hold(out.clone(), expected, what)))
    }

    fn step(&mut self, trees: &Trees) -> TestResult {
        match self.rng.below(100) {
            0..30 => self.iterate(trees)?,
            30..60 => self.random_call()?,
            60..78 => {
                trees.mark_step_begin();
                self.log.push("mark_step_begin".into());
            }
            78..90 => {
                if !self.held.is_empty() {
                    let h = self.held.remove(self.rng.below(self.held.len()));
                    self.log.push(format!("drop {}", h.what));
                }
            }
            _ => {
                if !self.held.is_empty() {
                    let i = self.rng.below(self.held.len());
                    let (tensor, values, what) = {
                        let h = &self.held[i];
                        (h.tensor.copy_out(), h.values.clone(), h.what.clone())
                    };
                    match tensor {
                        Ok(copy) => {
                            self.log.push(format!("copy_out {what}"));
                            self.hold(copy, values, format!("copy of {what}"));
                        }
                        Err(TreeError::StaleOutput { .. }) if !self.held[i].tensor.is_valid() => {
                            self.log.push(format!("copy_out {what}: StaleOutput"));
                        }
                        Err(e) => return Err(self.fail(format!("copy_out {what}: {e}"))),
                    }
                }
            }
        }
        self.check_all()
    }
}

/// The buffer index of a [`Source::Buffer`] (0 otherwise; never used so).
fn b_of(src: Source) -> usize {
    match src {
        Source::Buffer(b) => b,
        Source::Held(_) => 0,
    }
}

/// One program: how its calls were served (warm-up, recording, replay, eager), how many
/// were refused as stale, and how many replays launched another kept instance.
fn program(h: &Harness, seed: u64) -> Result<([usize; 4], usize, u64), crate::BoxError> {
    let s = Setup::new(h)?;
    let (mut p, config) = Program::new(&s, seed)?;
    let trees = s.trees(config.clone())?;
    let pool = trees.pool();
    p.wrap(&trees);
    for _ in 0..OPS {
        p.step(&trees)
            .map_err(|e| format!("seed {seed}, {config:?}: {e}"))?;
    }
    let counts = (p.served, p.refusals, trees.stats().kept_instance_launches);
    drop(p);
    drop(trees);
    assert_eq!(
        s.pool_users(pool)?,
        Some(0),
        "seed {seed}: nothing holds the pool"
    );
    assert!(
        s.pool_state(pool)?.1.is_empty(),
        "seed {seed}: no block of the pool stays allocated"
    );
    s.allocators.device(D0)?.check_invariants()?;
    Ok(counts)
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Random programs: calls give the host's values or `StaleOutput` for an input made stale,
/// and held outputs read their values or are stale, after every operation.
pub(crate) fn random_tree_programs_never_give_wrong_data(h: &Harness) -> TestResult {
    let programs = env_number("FERROCUDA_TREES_FUZZ_PROGRAMS", 40);
    let seed = env_number("FERROCUDA_TREES_FUZZ_SEED", 20_261_210);
    let (mut served, mut refusals, mut kept) = ([0; 4], 0, 0);
    for i in 0..programs {
        let (s, r, k) = program(h, seed.wrapping_add(i))?;
        served.iter_mut().zip(s).for_each(|(a, b)| *a += b);
        refusals += r;
        kept += k;
    }
    let [warmups, recordings, replays, eager] = served;
    eprintln!(
        "trees fuzz: {programs} programs from seed {seed}: calls checked: {warmups} warm-ups, {recordings} recordings, {replays} replays, {eager} eager; {refusals} refused as stale; {kept} replays of another kept instance"
    );
    assert!(
        recordings > 0 && replays > 0 && refusals > 0 && kept > 0,
        "the programs record, replay, pass outputs across steps and move inputs back"
    );
    Ok(())
}
