//! The oracle's files (`torch_alloc_oracle.py`'s docstring, `oracle_batch.py`'s additions),
//! read into checked values: a malformed file is an error naming the file and the place.
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Why the oracle files could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum FormatError {
    /// A file or folder could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file is not (xz-compressed) JSON.
    #[error("{path} is not JSON: {why}")]
    NotJson { path: PathBuf, why: String },
    /// A file is JSON but not what the oracle writes.
    #[error("{path}: {at}: {why}")]
    Shape {
        path: PathBuf,
        at: String,
        why: String,
    },
    /// A program without its result, or the other way round.
    #[error("{0}")]
    Unpaired(String),
}

/// One operation of a program.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Op {
    Alloc { id: u64, bytes: u64, stream: usize },
    Free { id: u64 },
    RecordStream { id: u64, stream: usize },
    Busy { stream: usize, micros: u64 },
    Sync,
    EmptyCache,
    ResetPeak,
    ResetAccumulated,
    Stats,
}

impl std::fmt::Display for Op {
    /// The operation as the program file writes it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::Alloc { id, bytes, stream } => write!(f, "[\"alloc\", {id}, {bytes}, {stream}]"),
            Op::Free { id } => write!(f, "[\"free\", {id}]"),
            Op::RecordStream { id, stream } => write!(f, "[\"record_stream\", {id}, {stream}]"),
            Op::Busy { stream, micros } => write!(f, "[\"busy\", {stream}, {micros}]"),
            Op::Sync => write!(f, "[\"sync\"]"),
            Op::EmptyCache => write!(f, "[\"empty_cache\"]"),
            Op::ResetPeak => write!(f, "[\"reset_peak\"]"),
            Op::ResetAccumulated => write!(f, "[\"reset_accumulated\"]"),
            Op::Stats => write!(f, "[\"stats\"]"),
        }
    }
}

/// A program of allocator operations.
#[derive(Clone, Debug)]
pub(crate) struct Program {
    pub(crate) conf: String,
    pub(crate) fraction: Option<f64>,
    pub(crate) streams: usize,
    pub(crate) ops: Vec<Op>,
}

/// A `record_stream` event: the step of the free that recorded it, and the stream.
pub(crate) type Token = (usize, usize);

/// When PyTorch's events completed, as seen around one allocation (`oracle_batch.py`).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Obs {
    /// Complete when the allocation processed its events.
    pub(crate) done: Vec<Token>,
    /// Completed during the allocation call: either way.
    pub(crate) maybe: Vec<Token>,
}

/// What PyTorch did at one step.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Step {
    /// An operation that reports nothing.
    Nothing,
    /// An allocation: where it landed (`None` with expandable segments, which have no
    /// segment base), or `Err(())` for out of memory; with the event observations.
    Alloc(Result<Option<Placement>, ()>, Obs),
    /// `memory_stats()`.
    Stats(BTreeMap<String, i64>),
}

/// Where a block landed: the `seg`-th new segment, at `offset`, in a segment of `seg_bytes`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    pub(crate) seg: usize,
    pub(crate) offset: u64,
    pub(crate) seg_bytes: u64,
}

/// What PyTorch did with a program.
#[derive(Clone, Debug)]
pub(crate) struct Outcome {
    pub(crate) torch: String,
    pub(crate) device_bytes: u64,
    /// Every new segment's address, in the order the driver handed them out.
    pub(crate) segments: Vec<u64>,
    pub(crate) steps: Vec<Step>,
    /// Whether allocation steps carry event observations.
    pub(crate) observed: bool,
    /// Whether record_stream reached PyTorch's allocator (`"record_stream": "applied"`,
    /// `oracle_batch.py`); `torch_alloc_oracle.py`'s `record()` never reaches it.
    pub(crate) record_stream_applied: bool,
}

/// A program and its result, named after their files.
#[derive(Clone, Debug)]
pub(crate) struct Case {
    pub(crate) name: String,
    pub(crate) program: Program,
    pub(crate) outcome: Outcome,
}

const PROGRAM: &str = ".program.json";
const RESULT: &str = ".result.json";

/// Every `NAME.program.json` with its `NAME.result.json` in `dir` (each may be `.xz`), by name.
pub(crate) fn read_dir(dir: &Path) -> Result<Vec<Case>, FormatError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| FormatError::Io { path, source }
    };
    let mut files: BTreeMap<String, [Option<PathBuf>; 2]> = BTreeMap::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        let file = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let file = file.strip_suffix(".xz").unwrap_or(file);
        for (slot, suffix) in [PROGRAM, RESULT].into_iter().enumerate() {
            if let Some(name) = file.strip_suffix(suffix) {
                files.entry(name.to_owned()).or_default()[slot] = Some(path.clone());
            }
        }
    }
    if files.is_empty() {
        return Err(FormatError::Unpaired(format!(
            "{} holds no NAME{PROGRAM} / NAME{RESULT} pair",
            dir.display()
        )));
    }
    files
        .into_iter()
        .map(|(name, pair)| match pair {
            [Some(p), Some(r)] => {
                let case = Case {
                    program: read_program(&p, &load(&p)?)?,
                    outcome: read_outcome(&r, &load(&r)?)?,
                    name,
                };
                check_pairing(&case, &r)?;
                Ok(case)
            }
            _ => Err(FormatError::Unpaired(format!(
                "{}: {name}{PROGRAM} and {name}{RESULT} go together; one is missing",
                dir.display()
            ))),
        })
        .collect()
}

/// Every step of the result answers its operation: an allocation step for `alloc`, the
/// statistics for `stats`, nothing otherwise; placements name segments the result lists.
fn check_pairing(case: &Case, result: &Path) -> Result<(), FormatError> {
    let r = Reader { path: result };
    let (ops, steps) = (&case.program.ops, &case.outcome.steps);
    if ops.len() != steps.len() {
        let why = format!("{} steps for {} operations", steps.len(), ops.len());
        return Err(r.err("steps", why));
    }
    for (i, (op, step)) in ops.iter().zip(steps).enumerate() {
        let fits = match (op, step) {
            (Op::Alloc { .. }, Step::Alloc(Ok(Some(p)), _)) => p.seg < case.outcome.segments.len(),
            (Op::Alloc { .. }, Step::Alloc(..)) | (Op::Stats, Step::Stats(_)) => true,
            (Op::Alloc { .. } | Op::Stats, _) | (_, Step::Alloc(..) | Step::Stats(_)) => false,
            _ => true,
        };
        if !fits {
            let kind = match step {
                Step::Nothing => "null",
                Step::Alloc(Ok(Some(_)), _) => "a placement in an unlisted segment",
                Step::Alloc(..) => "an allocation step",
                Step::Stats(_) => "statistics",
            };
            let why = format!("{kind} does not answer operation {op:?}");
            return Err(r.err(format!("steps[{i}]"), why));
        }
    }
    Ok(())
}

/// Reads a JSON file, xz-compressed when its name ends in `.xz`.
fn load(path: &Path) -> Result<Value, FormatError> {
    let raw = std::fs::read(path).map_err(|source| FormatError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let not_json = |why: String| FormatError::NotJson {
        path: path.to_path_buf(),
        why,
    };
    let text = if path.extension().is_some_and(|e| e == "xz") {
        let mut out = Vec::new();
        lzma_rs::xz_decompress(&mut raw.as_slice(), &mut out)
            .map_err(|e| not_json(format!("bad xz data: {e}")))?;
        out
    } else {
        raw
    };
    serde_json::from_slice(&text).map_err(|e| not_json(e.to_string()))
}

/// Reads values out of one file, naming the file and the place on error.
struct Reader<'a> {
    path: &'a Path,
}

impl Reader<'_> {
    fn err(&self, at: impl Into<String>, why: impl Into<String>) -> FormatError {
        FormatError::Shape {
            path: self.path.to_path_buf(),
            at: at.into(),
            why: why.into(),
        }
    }

    fn field<'v>(&self, v: &'v Value, key: &str) -> Result<&'v Value, FormatError> {
        v.get(key)
            .ok_or_else(|| self.err("the top level", format!("no key {key:?}")))
    }

    fn uint(&self, v: &Value, at: &str) -> Result<u64, FormatError> {
        v.as_u64()
            .ok_or_else(|| self.err(at, format!("{v} is not a whole number ≥ 0")))
    }

    fn index(&self, v: &Value, at: &str, below: usize) -> Result<usize, FormatError> {
        let i = self.uint(v, at)?;
        usize::try_from(i)
            .ok()
            .filter(|&i| i < below)
            .ok_or_else(|| self.err(at, format!("{i} is not below {below}")))
    }

    fn list<'v>(&self, v: &'v Value, at: &str) -> Result<&'v Vec<Value>, FormatError> {
        v.as_array()
            .ok_or_else(|| self.err(at, format!("{} is not a list", short(v))))
    }

    fn fraction(&self, v: &Value) -> Result<Option<f64>, FormatError> {
        match v {
            Value::Null => Ok(None),
            _ => v
                .as_f64()
                .filter(|f| (0.0..=1.0).contains(f))
                .map(Some)
                .ok_or_else(|| self.err("fraction", format!("{v} is not null or in [0, 1]"))),
        }
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

/// Stream counts above this are refused (the oracle makes 1 to 3).
const MAX_STREAMS: u64 = 64;

fn read_program(path: &Path, v: &Value) -> Result<Program, FormatError> {
    let r = Reader { path };
    let conf = r.field(v, "conf")?.as_str().unwrap_or_default().to_owned();
    let fraction = r.fraction(v.get("fraction").unwrap_or(&Value::Null))?;
    let streams = match v.get("streams") {
        None => 1,
        Some(s) => r.uint(s, "streams")?,
    };
    if !(1..=MAX_STREAMS).contains(&streams) {
        return Err(r.err("streams", format!("{streams} is not in 1..={MAX_STREAMS}")));
    }
    let streams = streams as usize;
    let ops = r
        .list(r.field(v, "ops")?, "ops")?
        .iter()
        .enumerate()
        .map(|(i, op)| read_op(&r, op, i, streams))
        .collect::<Result<_, _>>()?;
    Ok(Program {
        conf,
        fraction,
        streams,
        ops,
    })
}

fn read_op(r: &Reader<'_>, op: &Value, i: usize, streams: usize) -> Result<Op, FormatError> {
    let at = format!("op {i}");
    let args = r.list(op, &at)?;
    let arg = |k: usize| {
        args.get(k)
            .ok_or_else(|| r.err(&at, format!("{} has too few arguments", short(op))))
    };
    let kind = arg(0)?.as_str().unwrap_or_default();
    let want = match kind {
        "alloc" => 4,
        "free" => 2,
        "record_stream" | "busy" => 3,
        _ => 1,
    };
    if args.len() != want {
        return Err(r.err(&at, format!("{} should have {want} items", short(op))));
    }
    Ok(match kind {
        "alloc" => Op::Alloc {
            id: r.uint(arg(1)?, &at)?,
            bytes: r.uint(arg(2)?, &at)?,
            stream: r.index(arg(3)?, &at, streams)?,
        },
        "free" => Op::Free {
            id: r.uint(arg(1)?, &at)?,
        },
        "record_stream" => Op::RecordStream {
            id: r.uint(arg(1)?, &at)?,
            stream: r.index(arg(2)?, &at, streams)?,
        },
        "busy" => Op::Busy {
            stream: r.index(arg(1)?, &at, streams)?,
            micros: r.uint(arg(2)?, &at)?,
        },
        "sync" => Op::Sync,
        "empty_cache" => Op::EmptyCache,
        "reset_peak" => Op::ResetPeak,
        "reset_accumulated" => Op::ResetAccumulated,
        "stats" => Op::Stats,
        _ => return Err(r.err(&at, format!("unknown operation {}", short(op)))),
    })
}

fn read_outcome(path: &Path, v: &Value) -> Result<Outcome, FormatError> {
    let r = Reader { path };
    let segments = r
        .list(r.field(v, "segments")?, "segments")?
        .iter()
        .enumerate()
        .map(|(i, s)| r.uint(s, &format!("segments[{i}]")))
        .collect::<Result<_, _>>()?;
    let steps = r
        .list(r.field(v, "steps")?, "steps")?
        .iter()
        .enumerate()
        .map(|(i, s)| read_step(&r, s, i))
        .collect::<Result<_, _>>()?;
    Ok(Outcome {
        torch: r
            .field(v, "torch")?
            .as_str()
            .unwrap_or("unknown")
            .to_owned(),
        device_bytes: r.uint(r.field(v, "device_bytes")?, "device_bytes")?,
        segments,
        steps,
        observed: v.get("observed").and_then(Value::as_bool) == Some(true),
        record_stream_applied: v.get("record_stream").and_then(Value::as_str) == Some("applied"),
    })
}

fn read_step(r: &Reader<'_>, s: &Value, i: usize) -> Result<Step, FormatError> {
    let at = format!("steps[{i}]");
    let Some(map) = s.as_object() else {
        return match s {
            Value::Null => Ok(Step::Nothing),
            _ => Err(r.err(at, format!("{} is neither null nor a dict", short(s)))),
        };
    };
    let get = |k: &str| map.get(k).map(|v| r.uint(v, &format!("{at}.{k}")));
    let obs = match map.get("obs") {
        None => Obs::default(),
        Some(o) => Obs {
            done: read_tokens(r, o.get("done"), &at)?,
            maybe: read_tokens(r, o.get("maybe"), &at)?,
        },
    };
    if let Some(seg) = get("seg") {
        let (offset, seg_bytes) = match (get("offset"), get("seg_bytes")) {
            (Some(o), Some(b)) => (o?, b?),
            _ => return Err(r.err(at, "an allocation needs seg, offset and seg_bytes")),
        };
        let seg = usize::try_from(seg?).map_err(|_| r.err(&at, "seg is too large"))?;
        let placed = Placement {
            seg,
            offset,
            seg_bytes,
        };
        return Ok(Step::Alloc(Ok(Some(placed)), obs));
    }
    if let Some(oom) = map.get("oom") {
        return match oom.as_bool() {
            Some(true) => Ok(Step::Alloc(Err(()), obs)),
            Some(false) => Ok(Step::Alloc(Ok(None), obs)),
            None => Err(r.err(at, format!("oom is {oom}, not true or false"))),
        };
    }
    let stats = map
        .iter()
        .map(|(k, v)| {
            v.as_i64()
                .map(|v| (k.clone(), v))
                .ok_or_else(|| r.err(&at, format!("statistic {k} is {v}, not an integer")))
        })
        .collect::<Result<_, _>>()?;
    Ok(Step::Stats(stats))
}

fn read_tokens(r: &Reader<'_>, v: Option<&Value>, at: &str) -> Result<Vec<Token>, FormatError> {
    let Some(v) = v else {
        return Ok(Vec::new());
    };
    r.list(v, at)?
        .iter()
        .map(|t| match t.as_array().map(Vec::as_slice) {
            Some([step, stream]) => Ok((
                r.index(step, at, usize::MAX)?,
                r.index(stream, at, MAX_STREAMS as usize)?,
            )),
            _ => Err(r.err(
                at,
                format!("event token {} is not [step, stream]", short(t)),
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape_error(program: &str, result: &str) -> String {
        let dir = std::env::temp_dir().join(format!("oracle-format-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::write(dir.join("p.program.json"), program);
        let _ = std::fs::write(dir.join("p.result.json"), result);
        let out = read_dir(&dir)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        let _ = std::fs::remove_dir_all(&dir);
        out
    }

    const RESULT_OK: &str =
        r#"{"torch": "2.11", "device_bytes": 100, "segments": [], "steps": [null]}"#;

    #[test]
    fn malformed_files_are_named_with_the_place() {
        let bad_stream = r#"{"conf": "", "streams": 2, "ops": [["alloc", 0, 512, 2]]}"#;
        let e = shape_error(bad_stream, RESULT_OK);
        assert!(e.contains("p.program.json: op 0: 2 is not below 2"), "{e}");
        let unknown = r#"{"conf": "", "ops": [["launch"]]}"#;
        let e = shape_error(unknown, RESULT_OK);
        assert!(e.contains("unknown operation"), "{e}");
        let short_alloc = r#"{"conf": "", "ops": [["alloc", 1]]}"#;
        assert!(shape_error(short_alloc, RESULT_OK).contains("should have 4 items"));
        let ok = r#"{"conf": "", "ops": [["sync"]]}"#;
        let e = shape_error(
            ok,
            r#"{"torch": "x", "device_bytes": 1, "segments": [-1], "steps": []}"#,
        );
        assert!(e.contains("segments[0]: -1 is not a whole number"), "{e}");
        let e = shape_error(ok, "{\"torch\"");
        assert!(e.contains("is not JSON"), "{e}");
        let e = shape_error(
            ok,
            r#"{"torch": "x", "device_bytes": 1, "segments": [], "steps": [{"seg": 1}]}"#,
        );
        assert!(
            e.contains("steps[0]: an allocation needs seg, offset and seg_bytes"),
            "{e}"
        );
    }

    #[test]
    fn a_lone_program_is_an_error() {
        let dir = std::env::temp_dir().join(format!("oracle-lone-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::write(dir.join("q.program.json"), "{}");
        let e = read_dir(&dir)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(e.contains("one is missing"), "{e}");
    }
}
