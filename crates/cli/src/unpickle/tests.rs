use super::*;
use heap::ObjId;
use serde_json::{Value as Json, json};
use std::process::Command;

/// A value as JSON, shared objects expanded (for comparison with Python's view), with
/// `"<opaque>"` for what Python would construct. Refuses cycles.
fn to_json(heap: &Heap, v: Value, path: &mut Vec<ObjId>) -> Result<Json, String> {
    Ok(match v {
        Value::None => Json::Null,
        Value::Bool(b) => json!(b),
        Value::Int(i) => json!(i),
        Value::BigInt => json!("<bigint>"),
        Value::Float(f) => json!(f),
        Value::Str(s) => json!(heap.text(s)),
        Value::Bytes(s) => json!({ "bytes": heap.text(s) }),
        Value::Opaque => json!("<opaque>"),
        Value::Obj(id) => {
            if path.contains(&id) {
                return Err("cycle".into());
            }
            path.push(id);
            let out = match heap.get(id) {
                Some(Obj::List(items)) | Some(Obj::Tuple(items)) => Json::Array(
                    items
                        .iter()
                        .map(|&i| to_json(heap, i, path))
                        .collect::<Result<_, _>>()?,
                ),
                Some(Obj::Set(items)) => {
                    let mut all: Vec<Json> = items
                        .iter()
                        .map(|&i| to_json(heap, i, path))
                        .collect::<Result<_, _>>()?;
                    all.sort_by_key(|j| j.to_string());
                    all.dedup();
                    json!({ "set": all })
                }
                Some(Obj::Dict(_)) | Some(Obj::Event(_)) => {
                    let mut map = serde_json::Map::new();
                    for (k, v) in heap.pairs(id) {
                        let key = match to_json(heap, k, path)? {
                            Json::String(s) => s,
                            other => other.to_string(),
                        };
                        map.insert(key, to_json(heap, v, path)?);
                    }
                    Json::Object(map)
                }
                None => return Err("dangling object".into()),
            };
            path.pop();
            out
        }
    })
}

fn decode(bytes: &[u8]) -> Result<Json, String> {
    let out = unpickle(bytes, &Limits::DEFAULT).map_err(|e| e.to_string())?;
    to_json(&out.heap, out.top, &mut Vec::new())
}

/// The same random structures, with sharing, pickled by CPython under every protocol and
/// read by both: ours must give what `pickle.loads` gives, every time.
#[test]
fn reads_what_cpython_writes_under_every_protocol_as_cpython_reads_it() -> Result<(), String> {
    let script = r#"
import json, pickle, random, sys
rng = random.Random(7)
def scalar():
    return rng.choice([None, True, False, 0, 1, -1, 255, 256, 65535, 65536, -2**31,
        2**31 - 1, 2**62, -2**63, 2**63 - 1, 1.5, -0.25, "", "alloc", "N/A",
        "\u00e9t\u00e9 \u20ac \\u", "x" * 300, b"raw" if proto >= 3 else "raw"])
proto = 0
def build(depth, shared):
    k = rng.random()
    if depth > 4 or k < 0.3:
        return scalar()
    if shared and k < 0.45:
        return rng.choice(shared)
    if k < 0.65:
        v = [build(depth + 1, shared) for _ in range(rng.randrange(4))]
    elif k < 0.75:
        v = tuple(build(depth + 1, shared) for _ in range(rng.randrange(4)))
    else:
        v = {rng.choice(["action", "addr", "size", "frames", "k%d" % rng.randrange(5)]):
             build(depth + 1, shared) for _ in range(rng.randrange(5))}
    shared.append(v)
    return v
def plain(v):
    if isinstance(v, bytes): return {"bytes": v.decode()}
    if isinstance(v, (list, tuple)): return [plain(x) for x in v]
    if isinstance(v, dict): return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63:
        return "<bigint>"
    return v
cases = []
for case in range(300):
    shared = []
    proto = case % 6
    v = [build(0, shared) for _ in range(3)]
    event = {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1,
             "compile_context": "N/A", "user_metadata": "", "frames": v[0] if isinstance(v[0], list) else []}
    v.append([event, event, {"action": "free_completed", "addr": 2**64}])
    cases.append({"pickle": pickle.dumps(v, protocol=proto).hex(), "value": plain(v)})
json.dump(cases, sys.stdout)
"#;
    let out = Command::new("python3")
        .args(["-c", script])
        .output()
        .map_err(|e| format!("python3 is needed for this test: {e}"))?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cases: Vec<Json> = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    assert_eq!(cases.len(), 300);
    for (i, case) in cases.iter().enumerate() {
        let hex = case["pickle"].as_str().unwrap_or_default();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|j| u8::from_str_radix(&hex[j..j + 2], 16).unwrap_or(0))
            .collect();
        let ours = decode(&bytes).map_err(|e| format!("case {i}: {e}"))?;
        assert_eq!(ours, case["value"], "case {i} (protocol {})", i % 6);
    }
    Ok(())
}

#[test]
fn a_memo_reference_is_the_same_object_not_a_copy() -> Result<(), String> {
    // [s, s, s] where s is one 1 MiB string: kept once.
    let mut b = vec![0x80, 4, b']', 0x94, b'('];
    b.push(b'X');
    b.extend((1u32 << 20).to_le_bytes());
    b.extend(std::iter::repeat_n(b'a', 1 << 20));
    b.push(0x94);
    for _ in 0..50_000 {
        b.extend([b'h', 1]);
    }
    b.extend([b'e', b'.']);
    let out = unpickle(b.as_slice(), &Limits::scaled(1 << 22)).map_err(|e| e.to_string())?;
    let Value::Obj(id) = out.top else {
        return Err("not a list".into());
    };
    let Some(Obj::List(items)) = out.heap.get(id) else {
        return Err("not a list".into());
    };
    assert_eq!(items.len(), 50_001);
    assert!(items.iter().all(|&v| v == items[0]));
    assert_eq!(
        out.heap.into_strings().iter().map(|s| s.len()).max(),
        Some(1 << 20)
    );
    Ok(())
}

#[test]
fn hostile_pickles_end_with_errors_within_their_bounds() {
    let err = |bytes: &[u8], limits: &Limits| {
        unpickle(bytes, limits)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    // A list holding itself reads (as in Python); what uses it finds the cycle.
    assert!(
        unpickle(
            &[0x80, 2, b']', b'q', 0, b'h', 0, b'a', b'.'][..],
            &Limits::DEFAULT
        )
        .is_ok()
    );
    // 300 000 nested lists: no recursion anywhere.
    let n = 300_000;
    let mut deep = vec![0x80, 2];
    deep.extend(std::iter::repeat_n(b']', n));
    deep.extend(std::iter::repeat_n(b'a', n - 1));
    deep.push(b'.');
    assert!(unpickle(deep.as_slice(), &Limits::DEFAULT).is_ok());
    // A string longer than the budget is refused before it is read.
    let mut big = vec![0x80, 4, 0x8d];
    big.extend(u64::MAX.to_le_bytes());
    assert!(err(&big, &Limits::DEFAULT).contains("bytes of strings"));
    // Values past the budget.
    let mut many = vec![0x80, 4, b']', b'('];
    many.extend(std::iter::repeat_n(b'N', 10_000));
    many.extend([b'e', b'.']);
    assert!(err(&many, &Limits::scaled(16 * 1000)).contains("values"));
    // Memo entries count too.
    let mut memo = vec![0x80, 4, b'N'];
    memo.extend(std::iter::repeat_n(0x94, 10_000));
    memo.push(b'.');
    assert!(err(&memo, &Limits::scaled(16 * 1000)).contains("values"));
    // Sparse memo ids do not allocate a vector up to them.
    assert!(
        unpickle(
            &[0x80, 2, b'N', b'r', 0xff, 0xff, 0xff, 0xff, b'.'][..],
            &Limits::DEFAULT
        )
        .is_ok()
    );
    assert!(err(b"this is not a pickle", &Limits::DEFAULT).contains("MARK"));
    assert!(err(&[0xff], &Limits::DEFAULT).contains("unknown opcode 0xff"));
    assert!(err(&[0x80, 2, b'X', 0xff, 0xff], &Limits::DEFAULT).contains("truncated"));
    assert!(err(&[0x80, 6, b'N', b'.'], &Limits::DEFAULT).contains("protocol: 6"));
    assert!(err(&[0x80, 5, 0x97, b'.'], &Limits::DEFAULT).contains("out-of-band"));
    assert!(err(&[0x80, 2, b'h', 3, b'.'], &Limits::DEFAULT).contains("never set"));
    assert!(err(&[0x80, 2, b'}', b'N', b'a', b'.'], &Limits::DEFAULT).contains("not a list"));
}
