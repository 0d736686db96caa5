//! A pickle reader for snapshots: Python's unpickling machine (`pickle.py`, `_Unpickler`),
//! protocols 0 to 5, run over a byte stream into a compact [`Heap`].
//!
//! PyTorch's snapshots share objects: the same list of stack frames, the same frame dicts
//! and strings are written once and referred to again through the pickle's memo. Python's
//! `pickle.load` gives the same object back each time; so does this reader (a memo entry is
//! a reference into the heap, never a copy), so a snapshot whose 50 000 frames name one
//! 1 MiB string keeps that string once. Nothing here recurses: containers live in an arena
//! and are addressed by index, so a list nested 300 000 deep costs what 300 000 lists cost.
//!
//! Bounds ([`Limits`]) are checked as the bytes are read: the decompressed bytes (by the
//! input), the bytes of distinct strings (before a string is read), and the values held by
//! containers, the memo and the stack together. What a Python unpickler would have to
//! construct (`GLOBAL`, `REDUCE`, `BUILD`, ...) becomes an opaque value: a snapshot holds only
//! dicts, lists, tuples, strings and numbers. Persistent ids, the extension registry and
//! out-of-band buffers need help from the caller in Python too, and are errors here.
pub mod heap;

use crate::input::{Limits, TooLarge};
use heap::{Heap, Obj, Value};
use rustc_hash::FxHashMap;
use std::io::{self, BufRead, Read};

/// Why a pickle could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UnpickleError {
    /// Not a well-formed pickle.
    #[error("malformed pickle at byte {at}: {why}")]
    Malformed {
        /// Offset of the opcode in the decompressed stream.
        at: u64,
        /// What is wrong.
        why: String,
    },
    /// The stream ended before `STOP`.
    #[error("the pickle ends early (truncated at byte {at})")]
    Truncated {
        /// Bytes read.
        at: u64,
    },
    /// The decompressed stream is larger than the limit.
    #[error(transparent)]
    TooLarge(TooLarge),
    /// More string bytes than the limit.
    #[error("more than {limit} bytes of strings (raise the limit with --max-bytes)")]
    TooManyStringBytes {
        /// The limit.
        limit: u64,
    },
    /// More values than the limit.
    #[error(
        "more than {limit} values in containers, memo and stack (raise the limit with --max-bytes)"
    )]
    TooManyValues {
        /// The limit.
        limit: u64,
    },
    /// More than 2^32 strings.
    #[error("more than 2^32 strings")]
    TooManyStrings,
    /// More than 2^32 containers.
    #[error("more than 2^32 containers")]
    TooManyObjects,
    /// The stream could not be read (bad compressed data, say).
    #[error("{0}")]
    Io(String),
}

/// The highest protocol Python 3.8 and later write (`pickle.HIGHEST_PROTOCOL`).
const HIGHEST_PROTOCOL: u8 = 5;

/// Memo ids up to this are kept in a vector; sparser ones in a map.
const DENSE_MEMO: u64 = 1 << 28;

struct Machine<R> {
    input: R,
    /// Bytes consumed.
    pos: u64,
    /// Where the current opcode started.
    at: u64,
    heap: Heap,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: Vec<Option<Value>>,
    sparse_memo: FxHashMap<u64, Value>,
    memo_len: u64,
    max_values: u64,
}

impl<R: BufRead> Machine<R> {
    fn bad(&self, why: impl Into<String>) -> UnpickleError {
        UnpickleError::Malformed {
            at: self.at,
            why: why.into(),
        }
    }

    fn io(&self, e: io::Error) -> UnpickleError {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            return UnpickleError::Truncated { at: self.pos };
        }
        if let Some(too_large) = e.get_ref().and_then(|i| i.downcast_ref::<TooLarge>()) {
            return UnpickleError::TooLarge(*too_large);
        }
        UnpickleError::Io(e.to_string())
    }

    /// The next byte (from the reader's buffer: this is the loop every opcode goes
    /// through).
    fn byte(&mut self) -> Result<u8, UnpickleError> {
        let next = match self.input.fill_buf() {
            Ok(buf) => buf.first().copied(),
            Err(e) => return Err(self.io(e)),
        };
        let b = next.ok_or(UnpickleError::Truncated { at: self.pos })?;
        self.input.consume(1);
        self.pos += 1;
        Ok(b)
    }

    fn fixed<const N: usize>(&mut self) -> Result<[u8; N], UnpickleError> {
        let mut b = [0u8; N];
        self.input.read_exact(&mut b).map_err(|e| self.io(e))?;
        self.pos += N as u64;
        Ok(b)
    }

    fn uint(&mut self, width: usize) -> Result<u64, UnpickleError> {
        let mut le = [0u8; 8];
        for b in le.iter_mut().take(width) {
            *b = self.byte()?;
        }
        Ok(u64::from_le_bytes(le))
    }

    /// `n` bytes, read in pieces (a length the stream does not have is not allocated).
    fn bytes(&mut self, n: u64) -> Result<Vec<u8>, UnpickleError> {
        let mut out = Vec::new();
        let got = (&mut self.input)
            .take(n)
            .read_to_end(&mut out)
            .map_err(|e| self.io(e))?;
        self.pos += got as u64;
        if (got as u64) < n {
            return Err(UnpickleError::Truncated { at: self.pos });
        }
        Ok(out)
    }

    /// A newline-terminated argument (protocol 0) as text.
    fn line(&mut self) -> Result<String, UnpickleError> {
        Ok(String::from_utf8_lossy(&self.line_bytes()?).into_owned())
    }

    /// A newline-terminated argument (protocol 0), at most 64 KiB.
    fn line_bytes(&mut self) -> Result<Vec<u8>, UnpickleError> {
        let mut out = Vec::new();
        let got = (&mut self.input)
            .take(1 << 16)
            .read_until(b'\n', &mut out)
            .map_err(|e| self.io(e))?;
        self.pos += got as u64;
        if out.pop() != Some(b'\n') {
            return Err(self.bad("unterminated line (or longer than 64 KiB)"));
        }
        if out.last() == Some(&b'\r') {
            out.pop();
        }
        Ok(out)
    }

    /// A string of `n` bytes (checked against the string budget before it is read).
    fn string(&mut self, n: u64, bytes: bool) -> Result<Value, UnpickleError> {
        self.heap.string_room(n)?;
        let raw = self.bytes(n)?;
        let text = match String::from_utf8(raw) {
            Ok(t) => t,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        };
        let id = self.heap.string(text)?;
        Ok(if bytes {
            Value::Bytes(id)
        } else {
            Value::Str(id)
        })
    }

    fn push(&mut self, v: Value) -> Result<(), UnpickleError> {
        self.stack.push(v);
        self.check_values()
    }

    fn check_values(&self) -> Result<(), UnpickleError> {
        let held = self.heap.values() + self.memo_len + self.stack.len() as u64;
        if held > self.max_values {
            return Err(UnpickleError::TooManyValues {
                limit: self.max_values,
            });
        }
        Ok(())
    }

    fn pop(&mut self) -> Result<Value, UnpickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.bad("stack underflow"));
        }
        self.stack.pop().ok_or_else(|| self.bad("stack underflow"))
    }

    fn top(&self) -> Result<Value, UnpickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        match self.stack.last() {
            Some(&v) if self.stack.len() > floor => Ok(v),
            _ => Err(self.bad("stack underflow")),
        }
    }

    fn pop_mark(&mut self) -> Result<Vec<Value>, UnpickleError> {
        let mark = self.marks.pop().ok_or_else(|| self.bad("no MARK"))?;
        Ok(self.stack.split_off(mark.min(self.stack.len())))
    }

    fn pairs(&self, items: Vec<Value>) -> Result<Vec<(Value, Value)>, UnpickleError> {
        if !items.len().is_multiple_of(2) {
            return Err(self.bad("odd number of items for a dict"));
        }
        Ok(items.chunks_exact(2).map(|p| (p[0], p[1])).collect())
    }

    fn new_obj(&mut self, obj: Obj) -> Result<(), UnpickleError> {
        let v = self.heap.alloc(obj)?;
        self.push(v)
    }

    fn memo_put(&mut self, id: u64) -> Result<(), UnpickleError> {
        let v = self.top()?;
        if id < DENSE_MEMO && id as usize <= self.memo.len() {
            if id as usize == self.memo.len() {
                self.memo.push(None);
            }
            if self.memo[id as usize].replace(v).is_none() {
                self.memo_len += 1;
            }
        } else if self.sparse_memo.insert(id, v).is_none() {
            self.memo_len += 1;
        }
        self.check_values()
    }

    fn memo_get(&mut self, id: u64) -> Result<(), UnpickleError> {
        let found = match usize::try_from(id).ok().and_then(|i| self.memo.get(i)) {
            Some(&v) => v,
            None => self.sparse_memo.get(&id).copied(),
        };
        let v = found.ok_or_else(|| self.bad(format!("memo entry {id} was never set")))?;
        self.push(v)
    }

    fn memo_index(&mut self, op: u8) -> Result<u64, UnpickleError> {
        match op {
            b'p' | b'g' => self
                .line()?
                .trim()
                .parse()
                .map_err(|_| self.bad("bad memo index")),
            b'q' | b'h' => self.uint(1),
            _ => self.uint(4),
        }
    }

    /// An integer of `LONG1`/`LONG4`: little-endian two's complement.
    fn long(&mut self, n: u64) -> Result<Value, UnpickleError> {
        if n > 16 {
            self.heap.string_room(n)?;
            self.bytes(n)?;
            return Ok(Value::BigInt);
        }
        let raw = self.bytes(n)?;
        let mut wide = [0u8; 16];
        wide[..raw.len()].copy_from_slice(&raw);
        if raw.last().is_some_and(|&b| b & 0x80 != 0) {
            wide[raw.len()..].fill(0xff);
        }
        Ok(i64::try_from(i128::from_le_bytes(wide)).map_or(Value::BigInt, Value::Int))
    }

    /// An integer written as text (`INT`, `LONG`): `00`/`01` are booleans in `INT`.
    fn text_int(&mut self, op: u8) -> Result<Value, UnpickleError> {
        let line = self.line()?;
        let digits = line.trim().trim_end_matches('L');
        match (op, digits) {
            (b'I', "00") => Ok(Value::Bool(false)),
            (b'I', "01") => Ok(Value::Bool(true)),
            _ => match digits.parse::<i64>() {
                Ok(i) => Ok(Value::Int(i)),
                Err(_) if digits.parse::<i128>().is_ok() || is_integer(digits) => Ok(Value::BigInt),
                Err(_) => Err(self.bad(format!("bad integer {digits:?}"))),
            },
        }
    }

    /// Runs one opcode; `Ok(true)` at `STOP`. The stack, marks and memo are handled here;
    /// the rest by kind: scalars, containers, and what Python would construct.
    fn step(&mut self) -> Result<bool, UnpickleError> {
        self.at = self.pos;
        let op = self.byte()?;
        match op {
            b'.' => return Ok(true),
            0x80 => {
                let version = self.byte()?;
                if version > HIGHEST_PROTOCOL {
                    return Err(self.bad(format!("unsupported pickle protocol: {version}")));
                }
            }
            0x95 => drop(self.fixed::<8>()?),
            b'(' => self.marks.push(self.stack.len()),
            b'0' => {
                let floor = self.marks.last().copied().unwrap_or(0);
                if self.stack.len() > floor {
                    self.pop()?;
                } else {
                    self.pop_mark()?;
                }
            }
            b'1' => drop(self.pop_mark()?),
            b'2' => {
                let v = self.top()?;
                self.push(v)?;
            }
            b'p' | b'q' | b'r' => {
                let id = self.memo_index(op)?;
                self.memo_put(id)?;
            }
            0x94 => self.memo_put(self.memo_len)?,
            b'g' | b'h' | b'j' => {
                let id = self.memo_index(op)?;
                self.memo_get(id)?;
            }
            0x97 => {
                return Err(self.bad(
                    "the pickle refers to out-of-band buffers (protocol 5's NEXT_BUFFER), \
                     which a snapshot does not use",
                ));
            }
            0x98 => drop(self.top()?),
            b'P' | b'Q' => {
                return Err(self.bad(
                    "a persistent id, which needs the writer's persistent_load (a snapshot has none)",
                ));
            }
            0x82..=0x84 => {
                return Err(self
                    .bad("an extension-registry code (EXT1/2/4), which a snapshot does not use"));
            }
            _ => {
                if let Some(v) = self.scalar(op)? {
                    self.push(v)?;
                } else if !self.container(op)? && !self.constructed(op)? {
                    return Err(self.bad(format!("unknown opcode {op:#04x}")));
                }
            }
        }
        Ok(false)
    }

    /// A scalar opcode's value; `None` when `op` is not one.
    fn scalar(&mut self, op: u8) -> Result<Option<Value>, UnpickleError> {
        Ok(Some(match op {
            b'N' => Value::None,
            0x88 => Value::Bool(true),
            0x89 => Value::Bool(false),
            b'I' | b'L' => self.text_int(op)?,
            b'J' => Value::Int(i64::from(i32::from_le_bytes(self.fixed::<4>()?))),
            b'K' => Value::Int(i64::from(self.byte()?)),
            b'M' => Value::Int(i64::from(u16::from_le_bytes(self.fixed::<2>()?))),
            0x8a => {
                let n = u64::from(self.byte()?);
                self.long(n)?
            }
            0x8b => {
                let n = i32::from_le_bytes(self.fixed::<4>()?);
                let n = u64::try_from(n).map_err(|_| self.bad("LONG4 with a negative length"))?;
                self.long(n)?
            }
            b'F' => {
                let line = self.line()?;
                Value::Float(
                    line.trim()
                        .parse::<f64>()
                        .map_err(|_| self.bad(format!("bad float {line:?}")))?,
                )
            }
            b'G' => Value::Float(f64::from_be_bytes(self.fixed::<8>()?)),
            // Text strings: protocol 0's quoted STRING and raw-unicode UNICODE lines.
            b'S' | b'V' => {
                let line = self.line_bytes()?;
                let text = if op == b'S' {
                    let line = String::from_utf8_lossy(&line);
                    line.trim()
                        .strip_prefix(['\'', '"'])
                        .and_then(|t| t.strip_suffix(['\'', '"']))
                        .ok_or_else(|| self.bad("the STRING opcode argument must be quoted"))?
                        .to_owned()
                } else {
                    raw_unicode_escape(&line)
                };
                self.heap.string_room(text.len() as u64)?;
                Value::Str(self.heap.string(text)?)
            }
            // Length-prefixed strings and bytes.
            b'T' | b'U' | b'X' | 0x8c | 0x8d | b'B' | b'C' | 0x8e | 0x96 => {
                let width = match op {
                    b'U' | 0x8c | b'C' => 1,
                    b'T' | b'X' | b'B' => 4,
                    _ => 8,
                };
                let n = self.uint(width)?;
                if op == b'T' && n > i32::MAX as u64 {
                    return Err(self.bad("BINSTRING pickle has negative byte count"));
                }
                self.string(n, matches!(op, b'B' | b'C' | 0x8e | 0x96))?
            }
            _ => return Ok(None),
        }))
    }

    /// A container opcode (make one, or add to the one on top); `false` when `op` is not one.
    fn container(&mut self, op: u8) -> Result<bool, UnpickleError> {
        match op {
            b')' => self.new_obj(Obj::Tuple(Vec::new()))?,
            b']' => self.new_obj(Obj::List(Vec::new()))?,
            b'}' => self.new_obj(Obj::Dict(Vec::new()))?,
            0x8f => self.new_obj(Obj::Set(Vec::new()))?,
            b't' => {
                let items = self.pop_mark()?;
                self.new_obj(Obj::Tuple(items))?;
            }
            0x85..=0x87 => {
                let mut items = Vec::new();
                for _ in 0..(op - 0x84) {
                    items.push(self.pop()?);
                }
                items.reverse();
                self.new_obj(Obj::Tuple(items))?;
            }
            b'l' => {
                let items = self.pop_mark()?;
                let list = self.heap.alloc(Obj::List(Vec::new()))?;
                self.heap
                    .extend_list(list, items)
                    .map_err(|w| self.bad(w))?;
                self.push(list)?;
            }
            b'd' => {
                let items = self.pop_mark()?;
                let pairs = self.pairs(items)?;
                self.new_obj(Obj::Dict(pairs))?;
            }
            0x91 => {
                let items = self.pop_mark()?;
                self.new_obj(Obj::Set(items))?;
            }
            b'a' | b'e' => {
                let items = if op == b'a' {
                    vec![self.pop()?]
                } else {
                    self.pop_mark()?
                };
                let list = self.top()?;
                self.heap
                    .extend_list(list, items)
                    .map_err(|w| self.bad(w))?;
            }
            b's' | b'u' => {
                let pairs = if op == b's' {
                    let value = self.pop()?;
                    vec![(self.pop()?, value)]
                } else {
                    let items = self.pop_mark()?;
                    self.pairs(items)?
                };
                let dict = self.top()?;
                self.heap
                    .extend_dict(dict, pairs)
                    .map_err(|w| self.bad(w))?;
            }
            0x90 => {
                let items = self.pop_mark()?;
                let set = self.top()?;
                self.heap.extend_set(set, items).map_err(|w| self.bad(w))?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// What a Python unpickler would construct (`GLOBAL`, `REDUCE`, `BUILD`, ...): its
    /// arguments are consumed and an opaque value stands for it; `false` when `op` is not
    /// one of those.
    fn constructed(&mut self, op: u8) -> Result<bool, UnpickleError> {
        let (lines, popped, mark) = match op {
            b'c' => (2, 0, false),
            0x93 | b'R' | 0x81 => (0, 2, false),
            0x92 => (0, 3, false),
            b'i' => (2, 0, true),
            b'o' => (0, 0, true),
            b'b' => {
                // BUILD sets the state of the object below: nothing to keep.
                self.pop()?;
                return Ok(true);
            }
            _ => return Ok(false),
        };
        for _ in 0..lines {
            self.line()?;
        }
        for _ in 0..popped {
            self.pop()?;
        }
        if mark {
            self.pop_mark()?;
        }
        self.push(Value::Opaque)?;
        Ok(true)
    }
}

/// Python's `raw-unicode-escape` decoding (protocol 0's `UNICODE`): bytes are Latin-1
/// characters, except `\uXXXX` and `\UXXXXXXXX`.
fn raw_unicode_escape(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let width = match (bytes[i], bytes.get(i + 1)) {
            (b'\\', Some(b'u')) => 4,
            (b'\\', Some(b'U')) => 8,
            _ => 0,
        };
        let escaped = bytes
            .get(i + 2..i + 2 + width)
            .filter(|_| width > 0)
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u32::from_str_radix(hex, 16).ok())
            .and_then(char::from_u32);
        match escaped {
            Some(c) => {
                out.push(c);
                i += 2 + width;
            }
            None => {
                out.push(char::from(bytes[i]));
                i += 1;
            }
        }
    }
    out
}

/// Whether `text` is an integer of any size (an optional sign, then digits).
fn is_integer(text: &str) -> bool {
    let digits = text.strip_prefix(['-', '+']).unwrap_or(text);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

/// What a pickle built: the heap and the value `STOP` returned.
#[derive(Debug)]
pub struct Unpickled {
    /// Every string and container.
    pub heap: Heap,
    /// The pickle's value.
    pub top: Value,
}

/// Runs the pickle in `input` to its `STOP`, within `limits` (the input counts the
/// decompressed bytes itself).
pub fn unpickle<R: BufRead>(input: R, limits: &Limits) -> Result<Unpickled, UnpickleError> {
    let mut m = Machine {
        input,
        pos: 0,
        at: 0,
        heap: Heap::new(limits.max_string_bytes),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Vec::new(),
        sparse_memo: FxHashMap::default(),
        memo_len: 0,
        max_values: limits.max_values,
    };
    while !m.step()? {}
    let top = m.pop()?;
    Ok(Unpickled { heap: m.heap, top })
}

#[cfg(test)]
mod tests;
