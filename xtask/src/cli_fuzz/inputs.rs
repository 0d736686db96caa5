//! The inputs of `cargo xtask cli-fuzz`: its random generator, and the bytes of one case's
//! input file (snapshots generated, corrupted, pickled with memo sharing, cut from a real
//! trace, compressed) with the allocator configurations and capacities of its command line.
use serde_json::{Value, json};
use std::io::Write;

/// splitmix64: a small, well-known generator; cases must replay from (seed, index) alone.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64, case: u64) -> Rng {
        let mut r = Rng(seed ^ case.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        r.next();
        r
    }
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub(super) fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    pub(super) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    pub(super) fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

const ACTIONS: &[&str] = &[
    "alloc",
    "alloc",
    "alloc",
    "free_requested",
    "free_completed",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
    "snapshot",
    "something_else",
];

/// A size: mostly what programs ask for, sometimes more than the device has, and (in one
/// value of 2000) beyond what any device has or beyond 2^63.
fn size(r: &mut Rng) -> u64 {
    match r.below(2000) {
        0 => *r.pick(&[1 << 50, (1 << 50) + 1, i64::MAX as u64, 1 << 63, u64::MAX]),
        1..=100 => 0,
        101..=200 => r.below(1 << 40) + (80 << 30),
        201..=1200 => r.below(1 << 20),
        _ => r.below(1 << 32),
    }
}

fn event(r: &mut Rng, addrs: &[u64]) -> Value {
    let stream = if r.chance(90) {
        r.below(4)
    } else {
        r.next() >> 1
    };
    json!({
        "action": r.pick(ACTIONS),
        "addr": r.pick(addrs),
        "size": size(r),
        "stream": stream,
        "time_us": r.below(1 << 40),
        "compile_context": "N/A",
        "frames": match r.below(10) {
            // A few stacks shared by many events (as PyTorch's are): the memo writer below
            // writes each once and refers back to it.
            0..=3 => json!([{"filename": "x.py", "line": 3, "name": "f"},
                            {"filename": "??", "line": 0, "name": "torch::unwind::unwind()"}]),
            4 => json!([{"filename": "y.py", "line": r.below(3), "name": "g"}]),
            5 => json!([]),
            _ => Value::Null,
        },
    })
}

fn segment(r: &mut Rng, device: u64) -> Value {
    let blocks: Vec<Value> = (0..r.below(4))
        .map(|i| {
            json!({"address": i << 20, "size": size(r), "requested_size": size(r),
                   "state": r.pick(&["active_allocated", "active_pending_free", "inactive"])})
        })
        .collect();
    json!({
        "device": device, "address": r.below(1 << 47), "total_size": size(r),
        "allocated_size": size(r), "active_size": 0, "requested_size": 0, "stream": r.below(3),
        "segment_type": r.pick(&["small", "large", "odd"]), "segment_pool_id": [0, 0],
        "is_expandable": r.chance(30), "blocks": blocks,
    })
}

/// A snapshot-shaped value: mostly valid, with a few fields of the wrong type or missing.
fn snapshot(r: &mut Rng) -> Value {
    let devices = *r.pick(&[1u64, 1, 1, 2, 3]);
    let addrs: Vec<u64> = (0..1 + r.below(40)).map(|_| r.below(1 << 47)).collect();
    let traces: Vec<Value> = (0..devices)
        .map(|_| Value::Array((0..r.below(120)).map(|_| event(r, &addrs)).collect()))
        .collect();
    let segments: Vec<Value> = (0..r.below(6))
        .map(|_| {
            let device = r.below(devices);
            segment(r, device)
        })
        .collect();
    let mut s = json!({"segments": segments, "device_traces": traces});
    if r.chance(20) {
        s["memory_stats"] = json!({"requested_bytes.all.peak": size(r), "reserved_bytes.all.peak": size(r),
                                   "allocated_bytes.all.peak": size(r), "num_device_alloc": r.below(9)});
    }
    if r.chance(20) {
        s["allocator_settings"] = json!({"PYTORCH_CUDA_ALLOC_CONF": conf(r)});
    }
    if r.chance(25) {
        for _ in 0..1 + r.below(2) {
            corrupt_value(r, &mut s);
        }
    }
    s
}

/// Replaces or removes one field somewhere in the value.
fn corrupt_value(r: &mut Rng, s: &mut Value) {
    let replacement = r
        .pick(&[
            json!("text"),
            json!(-1),
            json!(1.5),
            Value::Null,
            json!([1, 2]),
            json!({"a": 1}),
            json!(u64::MAX),
        ])
        .clone();
    let top = *r.pick(&[
        "segments",
        "device_traces",
        "memory_stats",
        "allocator_settings",
    ]);
    if r.chance(20) {
        if let Some(m) = s.as_object_mut() {
            m.remove(top);
        }
        return;
    }
    let mut at = &mut s[top];
    while let Some(len) = at.as_array().map(Vec::len).filter(|&n| n > 0) {
        let i = r.below(len as u64) as usize;
        at = &mut at[i];
    }
    let field = *r.pick(&[
        "action",
        "addr",
        "size",
        "stream",
        "device",
        "total_size",
        "blocks",
    ]);
    match at.as_object_mut() {
        Some(m) if r.chance(30) => drop(m.remove(field)),
        Some(m) => drop(m.insert(field.into(), replacement)),
        None => *at = replacement,
    }
}

pub(super) fn conf(r: &mut Rng) -> String {
    const VALID: &[&str] = &[
        "expandable_segments:True",
        "max_split_size_mb:100",
        "garbage_collection_threshold:0.5",
        "roundup_power2_divisions:[64:8,>:1]",
        "large_segment_size_mb:12",
        "expandable_segments_reclaim:True",
        "expandable_segments_small_page_bound:True",
        "cross_stream_reuse:True",
        "thread_cache:False",
    ];
    if r.chance(85) {
        return match r.below(4) {
            0 => "default".into(),
            1 => String::new(),
            _ => (0..1 + r.below(2))
                .map(|_| *r.pick(VALID))
                .collect::<Vec<_>>()
                .join(","),
        };
    }
    const PARTS: &[&str] = &[
        "expandable_segments:True",
        "expandable_segments:False",
        "max_split_size_mb:100",
        "max_split_size_mb:20",
        "max_split_size_mb:2",
        "garbage_collection_threshold:0.5",
        "garbage_collection_threshold:1.5",
        "roundup_power2_divisions:4",
        "roundup_power2_divisions:[64:8,>:1]",
        "roundup_power2_divisions:[64:8,>:1",
        "large_segment_size_mb:12",
        "expandable_segments_reclaim:True",
        "cross_stream_reuse:True",
        "thread_cache:False",
        "per_process_memory_fraction:0.5",
        "per_process_memory_fraction:0.0",
        "backend:cudaMallocAsync",
        "bogus:1",
        "max_split_size_mb:99999999999999999999999",
        "default",
        "",
        ":",
        ",",
        "\u{00e9}:\u{1F600}",
    ];
    let n = 1 + r.below(3);
    let mut s = (0..n).map(|_| *r.pick(PARTS)).collect::<Vec<_>>().join(",");
    if r.chance(10) && !s.is_empty() {
        let cut = r.below(s.len() as u64) as usize;
        s = s.chars().take(cut).collect();
    }
    s
}

pub(super) fn capacity(r: &mut Rng) -> String {
    if r.chance(85) {
        return r
            .pick(&["80", "80G", "1G", "512M", "2M", "4T", "64M"])
            .to_string();
    }
    r.pick(&[
        "0",
        "17179869184",
        "17179869189",
        "18446744073709551616",
        "-1",
        "1.5G",
        "80X",
        "",
        "1K",
        "5T",
        " 8G",
    ])
    .to_string()
}

/// A pickle (protocol 4) of `v` as CPython's pickler writes objects that are shared: each
/// equal string, list or dict is written once, memoized, and referred back to (`BINGET`,
/// `LONG_BINGET`) wherever it occurs again, as PyTorch's snapshots share their stacks. A
/// `null` field is left out of its dict.
fn memo_pickle(v: &Value) -> Vec<u8> {
    struct Writer {
        out: Vec<u8>,
        seen: std::collections::HashMap<String, u32>,
    }
    impl Writer {
        fn shared(&mut self, key: String) -> bool {
            match self.seen.get(&key) {
                Some(&id) if id < 256 => self.out.extend([b'h', id as u8]),
                Some(&id) => {
                    self.out.push(b'j');
                    self.out.extend(id.to_le_bytes());
                }
                None => return false,
            }
            true
        }
        fn memoize(&mut self, key: String) {
            let id = self.seen.len() as u32;
            self.seen.insert(key, id);
            self.out.push(0x94);
        }
        fn write(&mut self, v: &Value) {
            match v {
                Value::Null => self.out.push(b'N'),
                Value::Bool(b) => self.out.push(if *b { 0x88 } else { 0x89 }),
                Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
                    (Some(i), _, _) => {
                        self.out.extend([0x8a, 8]);
                        self.out.extend(i.to_le_bytes());
                    }
                    (None, Some(u), _) => {
                        self.out.extend([0x8a, 9]);
                        self.out.extend(u.to_le_bytes());
                        self.out.push(0);
                    }
                    (_, _, f) => {
                        self.out.push(b'G');
                        self.out.extend(f.unwrap_or(0.0).to_be_bytes());
                    }
                },
                Value::String(s) => {
                    if !self.shared(format!("s{s}")) {
                        self.out.push(b'X');
                        self.out.extend((s.len() as u32).to_le_bytes());
                        self.out.extend(s.as_bytes());
                        self.memoize(format!("s{s}"));
                    }
                }
                Value::Array(items) => {
                    let key = format!("a{v}");
                    if !self.shared(key.clone()) {
                        self.out.push(b']');
                        self.memoize(key);
                        self.out.push(b'(');
                        items.iter().for_each(|i| self.write(i));
                        self.out.push(b'e');
                    }
                }
                Value::Object(map) => {
                    let key = format!("o{v}");
                    if !self.shared(key.clone()) {
                        self.out.push(b'}');
                        self.memoize(key);
                        self.out.push(b'(');
                        for (k, v) in map.iter().filter(|(_, v)| !v.is_null()) {
                            self.write(&Value::String(k.clone()));
                            self.write(v);
                        }
                        self.out.push(b'u');
                    }
                }
            }
        }
    }
    let mut w = Writer {
        out: vec![0x80, 4],
        seen: Default::default(),
    };
    w.write(v);
    w.out.push(b'.');
    w.out
}

/// The bytes of one input file: a pickled snapshot, perhaps mutated or compressed, or
/// something that is not one at all.
pub(super) fn input(r: &mut Rng, real: &[u8]) -> Result<Vec<u8>, String> {
    let mut bytes = match r.below(20) {
        0 => Vec::new(),
        1 => (0..r.below(4096)).map(|_| r.next() as u8).collect(),
        2 => real[..r.below(real.len() as u64) as usize].to_vec(),
        3 => {
            // Nesting: a list (or dict values) deeper than any snapshot.
            let n = *r.pick(&[50usize, 99, 100, 101, 5000, 300_000]);
            let mut b = vec![0x80, 2];
            b.extend(std::iter::repeat_n(b']', n));
            b.extend(std::iter::repeat_n(b'a', n - 1));
            b.push(b'.');
            b
        }
        4 => {
            serde_pickle::to_vec(&json!({"a": 1}), Default::default()).map_err(|e| e.to_string())?
        }
        5 => {
            // A container that holds itself, under a key the reader walks.
            let key = *r.pick(&["device_traces", "segments", "frames"]);
            let mut b = vec![0x80, 4, b'}', 0x94, b'X'];
            b.extend((key.len() as u32).to_le_bytes());
            b.extend(key.as_bytes());
            b.extend([b']', 0x94, b'h', *r.pick(&[0u8, 1]), b'a', b's', b'.']);
            b
        }
        6..=11 => memo_pickle(&snapshot(r)),
        _ => serde_pickle::to_vec(&snapshot(r), serde_pickle::SerOptions::new())
            .map_err(|e| e.to_string())?,
    };
    if r.chance(12) && !bytes.is_empty() {
        for _ in 0..1 + r.below(8) {
            let i = r.below(bytes.len() as u64) as usize;
            match r.below(3) {
                0 => bytes[i] = r.next() as u8,
                1 => bytes.truncate(i.max(1)),
                _ => bytes.insert(i, r.next() as u8),
            }
        }
    }
    match r.below(10) {
        0 => {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            gz.write_all(&bytes).map_err(|e| e.to_string())?;
            bytes = gz.finish().map_err(|e| e.to_string())?;
        }
        1 => {
            let mut xz = Vec::new();
            lzma_rs::xz_compress(&mut bytes.as_slice(), &mut xz).map_err(|e| e.to_string())?;
            bytes = xz;
        }
        _ => {}
    }
    if r.chance(5) && bytes.len() > 8 {
        let i = 6 + r.below(bytes.len() as u64 - 6) as usize;
        bytes[i] ^= 0x55;
    }
    Ok(bytes)
}
