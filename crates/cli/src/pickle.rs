//! A pass over a pickle's opcodes that measures what decoding it would build, before it is
//! decoded: how deeply its containers nest and how many values it holds once memo
//! references are expanded.
//!
//! `serde_pickle` builds a tree of values and walks (and drops) it recursively, so a list
//! nested 300 000 levels deep (a 600 KB file) overflows the stack and aborts the process,
//! and a memo reference doubled at every level (a few hundred bytes) expands to 2^60
//! values. This pass runs the pickle machine over placeholders instead of values, in
//! constant stack: containers become nodes of a graph whose edges are "holds", memo
//! references share nodes, and depth and expanded size are computed over the graph
//! iteratively. A snapshot nests about 8 deep, so the bounds below are generous.
use std::collections::HashMap;

/// Deepest nesting of containers accepted (a PyTorch snapshot nests about 8 deep).
pub const MAX_DEPTH: u64 = 100;
/// Most values accepted once memo references are expanded (a snapshot of millions of
/// events with their stack frames stays far below).
pub const MAX_VALUES: u64 = 1 << 30;

/// Why a pickle is refused before decoding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShapeError {
    /// Containers nest deeper than [`MAX_DEPTH`].
    #[error("containers nested deeper than {MAX_DEPTH} levels ({depth} or more)")]
    TooDeep {
        /// How deep (at least).
        depth: u64,
    },
    /// More than [`MAX_VALUES`] values once memo references are expanded.
    #[error("more than {MAX_VALUES} values once memo references are expanded")]
    TooManyValues,
    /// A container holds itself.
    #[error("a container holds itself (recursive structure)")]
    Recursive,
    /// Not a well-formed pickle.
    #[error("malformed pickle at byte {at}: {why}")]
    Malformed {
        /// Byte offset of the opcode.
        at: usize,
        /// What is wrong.
        why: String,
    },
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Item {
    /// A scalar: number, string, bytes, None, a global's name.
    Leaf,
    /// A container (index into the node arena).
    Node(usize),
}

#[derive(Default)]
struct Node {
    children: Vec<usize>,
    leaves: u64,
    dict: bool,
}

struct Machine<'a> {
    bytes: &'a [u8],
    pos: usize,
    at: usize,
    stack: Vec<Item>,
    marks: Vec<usize>,
    memo: HashMap<u64, Item>,
    nodes: Vec<Node>,
}

impl Machine<'_> {
    fn bad(&self, why: impl Into<String>) -> ShapeError {
        ShapeError::Malformed {
            at: self.at,
            why: why.into(),
        }
    }

    fn take(&mut self, n: u64) -> Result<&[u8], ShapeError> {
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| self.pos.checked_add(n))
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| self.bad("truncated"))?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn uint(&mut self, n: usize) -> Result<u64, ShapeError> {
        let mut le = [0u8; 8];
        le[..n].copy_from_slice(self.take(n as u64)?);
        Ok(u64::from_le_bytes(le))
    }

    fn line(&mut self) -> Result<&[u8], ShapeError> {
        let rest = &self.bytes[self.pos..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| self.bad("unterminated line"))?;
        self.pos += n + 1;
        Ok(&rest[..n])
    }

    fn memo_id(&mut self, text: bool, width: usize) -> Result<u64, ShapeError> {
        if text {
            let line = self.line()?;
            std::str::from_utf8(line)
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .ok_or_else(|| self.bad("bad memo index"))
        } else {
            self.uint(width)
        }
    }

    fn pop(&mut self) -> Result<Item, ShapeError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.bad("stack underflow"));
        }
        self.stack.pop().ok_or_else(|| self.bad("stack underflow"))
    }

    fn pop_mark(&mut self) -> Result<Vec<Item>, ShapeError> {
        let mark = self.marks.pop().ok_or_else(|| self.bad("no mark"))?;
        if mark > self.stack.len() {
            return Err(self.bad("mark above the stack"));
        }
        Ok(self.stack.split_off(mark))
    }

    fn node(&mut self, items: Vec<Item>) -> Item {
        self.nodes.push(Node::default());
        let id = self.nodes.len() - 1;
        self.add(id, items);
        Item::Node(id)
    }

    fn add(&mut self, id: usize, items: Vec<Item>) {
        let node = &mut self.nodes[id];
        for item in items {
            match item {
                Item::Leaf => node.leaves += 1,
                Item::Node(child) => node.children.push(child),
            }
        }
    }

    /// Adds `items` to the container on top of the stack.
    fn add_to_top(&mut self, items: Vec<Item>) -> Result<(), ShapeError> {
        match self.pop()? {
            Item::Node(id) => {
                self.add(id, items);
                self.stack.push(Item::Node(id));
            }
            Item::Leaf => {
                let mut all = vec![Item::Leaf];
                all.extend(items);
                let node = self.node(all);
                self.stack.push(node);
            }
        }
        Ok(())
    }

    fn pop_n(&mut self, n: usize) -> Result<Vec<Item>, ShapeError> {
        let mut items = (0..n).map(|_| self.pop()).collect::<Result<Vec<_>, _>>()?;
        items.reverse();
        Ok(items)
    }

    /// Runs one opcode; `Ok(true)` at STOP.
    fn step(&mut self) -> Result<bool, ShapeError> {
        self.at = self.pos;
        let op = self.take(1)?[0];
        match op {
            b'.' => return Ok(true),
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
                let top = self.pop()?;
                self.stack.extend([top, top]);
            }
            // Scalars with a line argument: FLOAT INT LONG STRING UNICODE PERSID.
            b'F' | b'I' | b'L' | b'S' | b'V' | b'P' => {
                self.line()?;
                self.stack.push(Item::Leaf);
            }
            // GLOBAL: module and name lines.
            b'c' => {
                self.line()?;
                self.line()?;
                self.stack.push(Item::Leaf);
            }
            // Fixed-width scalars.
            b'J' | b'K' | b'M' | b'G' | 0x82 | 0x83 | 0x84 => {
                let width = match op {
                    b'J' | 0x84 => 4,
                    b'K' | 0x82 => 1,
                    b'M' | 0x83 => 2,
                    _ => 8,
                };
                self.take(width)?;
                self.stack.push(Item::Leaf);
            }
            b'N' | 0x88 | 0x89 | 0x97 => self.stack.push(Item::Leaf),
            0x98 => {}
            // Length-prefixed scalars.
            b'T' | b'X' | b'B' | b'U' | b'C' | 0x8c | 0x8a | 0x8b | 0x8d | 0x8e | 0x96 => {
                let width = match op {
                    b'U' | b'C' | 0x8c | 0x8a => 1,
                    b'T' | b'X' | b'B' | 0x8b => 4,
                    _ => 8,
                };
                let n = self.uint(width)?;
                if op == b'T' && n > i32::MAX as u64 {
                    return Err(self.bad("negative length"));
                }
                self.take(n)?;
                self.stack.push(Item::Leaf);
            }
            0x80 => drop(self.take(1)?),
            0x95 => drop(self.take(8)?),
            b')' | b']' | b'}' | 0x8f => {
                let node = self.node(Vec::new());
                if let (b'}', Item::Node(id)) = (op, node) {
                    self.nodes[id].dict = true;
                }
                self.stack.push(node);
            }
            b'l' | b't' | b'd' | 0x91 | b'o' => {
                let items = self.pop_mark()?;
                let node = self.node(items);
                if let (b'd', Item::Node(id)) = (op, node) {
                    self.nodes[id].dict = true;
                }
                self.stack.push(node);
            }
            b'i' => {
                self.line()?;
                self.line()?;
                let items = self.pop_mark()?;
                let node = self.node(items);
                self.stack.push(node);
            }
            0x85..=0x87 => {
                let items = self.pop_n(usize::from(op - 0x84))?;
                let node = self.node(items);
                self.stack.push(node);
            }
            b'R' | 0x81 | 0x92 => {
                let items = self.pop_n(if op == 0x92 { 3 } else { 2 })?;
                let node = self.node(items);
                self.stack.push(node);
            }
            0x93 | b'Q' => {
                self.pop_n(if op == 0x93 { 2 } else { 1 })?;
                self.stack.push(Item::Leaf);
            }
            b'a' | b'b' => {
                let items = self.pop_n(1)?;
                self.add_to_top(items)?;
            }
            b's' => {
                let items = self.pop_n(2)?;
                self.add_to_top(items)?;
            }
            b'e' | b'u' | 0x90 => {
                let items = self.pop_mark()?;
                self.add_to_top(items)?;
            }
            b'p' | b'q' | b'r' | 0x94 => {
                let id = match op {
                    b'p' => self.memo_id(true, 0)?,
                    b'q' => self.memo_id(false, 1)?,
                    b'r' => self.memo_id(false, 4)?,
                    _ => self.memo.len() as u64,
                };
                let top = *self
                    .stack
                    .last()
                    .ok_or_else(|| self.bad("stack underflow"))?;
                self.memo.insert(id, top);
            }
            b'g' | b'h' | b'j' => {
                let id = match op {
                    b'g' => self.memo_id(true, 0)?,
                    b'h' => self.memo_id(false, 1)?,
                    _ => self.memo_id(false, 4)?,
                };
                let item = *self
                    .memo
                    .get(&id)
                    .ok_or_else(|| self.bad(format!("memo {id} not set")))?;
                self.stack.push(item);
            }
            _ => return Err(self.bad(format!("unknown opcode {op:#04x}"))),
        }
        Ok(false)
    }
}

/// Depth and expanded size of every node, in post-order without recursion.
fn measure(nodes: &[Node]) -> Result<(Vec<u64>, Vec<u64>), ShapeError> {
    const NEW: u8 = 0;
    const OPEN: u8 = 1;
    const DONE: u8 = 2;
    let mut state = vec![NEW; nodes.len()];
    let mut depth = vec![0u64; nodes.len()];
    let mut size = vec![0u64; nodes.len()];
    for root in 0..nodes.len() {
        if state[root] != NEW {
            continue;
        }
        // (node, next child to visit)
        let mut path = vec![(root, 0usize)];
        state[root] = OPEN;
        while let Some(&mut (id, ref mut next)) = path.last_mut() {
            if let Some(&child) = nodes[id].children.get(*next) {
                *next += 1;
                match state[child] {
                    NEW => {
                        state[child] = OPEN;
                        path.push((child, 0));
                    }
                    OPEN => return Err(ShapeError::Recursive),
                    _ => {}
                }
                continue;
            }
            let node = &nodes[id];
            depth[id] = 1 + node.children.iter().map(|&c| depth[c]).max().unwrap_or(0);
            size[id] = node
                .children
                .iter()
                .fold(1u64.saturating_add(node.leaves), |s, &c| {
                    s.saturating_add(size[c])
                });
            if depth[id] > MAX_DEPTH {
                return Err(ShapeError::TooDeep { depth: depth[id] });
            }
            state[id] = DONE;
            path.pop();
        }
    }
    Ok((depth, size))
}

/// What the pickle's value is, at the top.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Top {
    /// A dict.
    Dict,
    /// Any other container.
    Container,
    /// A scalar.
    Scalar,
}

/// Checks that decoding `bytes` builds nothing deeper than [`MAX_DEPTH`] and, for the
/// value it returns, no more than [`MAX_VALUES`] values; says what that value is.
pub fn check_shape(bytes: &[u8]) -> Result<Top, ShapeError> {
    let mut m = Machine {
        bytes,
        pos: 0,
        at: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        nodes: Vec::new(),
    };
    while !m.step()? {}
    let top = m.pop()?;
    let (_, size) = measure(&m.nodes)?;
    match top {
        Item::Node(id) if size[id] > MAX_VALUES => Err(ShapeError::TooManyValues),
        Item::Node(id) if m.nodes[id].dict => Ok(Top::Dict),
        Item::Node(_) => Ok(Top::Container),
        Item::Leaf => Ok(Top::Scalar),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_shapes_pass_and_hostile_ones_do_not() {
        let value = serde_json::json!({"a": [1, 2, {"b": [[1], [2]]}], "c": "x"});
        let bytes = serde_pickle::to_vec(&value, serde_pickle::SerOptions::new()).ok();
        assert_eq!(bytes.map(|b| check_shape(&b)), Some(Ok(Top::Dict)));
        let deep = |n: usize| {
            let mut b = vec![0x80, 2];
            b.extend(std::iter::repeat_n(b']', n));
            b.extend(std::iter::repeat_n(b'a', n - 1));
            b.push(b'.');
            b
        };
        assert_eq!(check_shape(&deep(100)), Ok(Top::Container));
        assert_eq!(
            check_shape(&deep(101)),
            Err(ShapeError::TooDeep { depth: 101 })
        );
        // Deep values left on the stack under the returned one are dropped too: refused.
        let mut left = deep(5000);
        left.pop();
        left.extend([b'N', b'.']);
        assert!(matches!(
            check_shape(&left),
            Err(ShapeError::TooDeep { .. })
        ));
        // Built bottom-up through the memo: the graph, not the order, decides.
        let mut b = vec![0x80, 2];
        for i in 0..=200u8 {
            b.extend([b']', b'q', i, b'0']);
        }
        for i in (0..200u8).rev() {
            b.extend([b'h', i + 1, b'h', i, b'a', b'0']);
        }
        b.extend([b'h', 0, b'.']);
        assert!(matches!(check_shape(&b), Err(ShapeError::TooDeep { .. })));
        // A list holding itself.
        assert_eq!(
            check_shape(&[0x80, 2, b']', b'q', 0, b'h', 0, b'a', b'.']),
            Err(ShapeError::Recursive)
        );
        assert!(matches!(
            check_shape(b"this is not a pickle"),
            Err(ShapeError::Malformed { .. })
        ));
        assert!(matches!(
            check_shape(&[0x80, 2, b'X', 0xff, 0xff, 0xff, 0xff]),
            Err(ShapeError::Malformed { .. })
        ));
    }
}
