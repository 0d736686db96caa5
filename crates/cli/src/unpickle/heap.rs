//! The values a pickle builds, kept compact: scalars inline, strings in one table (a string
//! the pickle refers to again through its memo is the same entry, and short strings are
//! shared by content), containers in one arena addressed by index (so nothing is dropped
//! recursively, however deep the nesting), and the dicts of a snapshot's history stored as
//! fixed records ([`Event`]) once they are appended to a list. A record is the same dict
//! in less room: reading a key of it, or setting one (it turns back into a dict), behaves
//! as the dict would.
use super::UnpickleError;
use rustc_hash::FxHashMap;

/// A string of the table.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StrId(pub u32);

/// A container of the arena.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ObjId(pub u32);

/// One value on the machine's stack, in a container or in the memo.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` or `False`.
    Bool(bool),
    /// An integer that fits 64 signed bits.
    Int(i64),
    /// An integer that does not (its value is not kept).
    BigInt,
    /// A float.
    Float(f64),
    /// A string.
    Str(StrId),
    /// Bytes (kept as text, lossily).
    Bytes(StrId),
    /// A list, tuple, dict or set.
    Obj(ObjId),
    /// Something a Python unpickler would have to construct (a global, an object built by
    /// `REDUCE`): a snapshot has none, so its contents are not kept.
    Opaque,
}

/// A container.
#[derive(Debug)]
pub enum Obj {
    /// A list.
    List(Vec<Value>),
    /// A tuple.
    Tuple(Vec<Value>),
    /// A dict, as its assignments in order: a later one of an equal key wins, as in Python.
    Dict(Vec<(Value, Value)>),
    /// A set or frozenset.
    Set(Vec<Value>),
    /// A dict of a trace event, stored as a record.
    Event(Event),
}

/// The keys of a trace event (`device_traces[d][i]`), in the order PyTorch writes them
/// (`CUDACachingAllocator.cpp`, `snapshot`).
pub const EVENT_KEYS: [&str; 9] = [
    "action",
    "addr",
    "size",
    "stream",
    "time_us",
    "compile_context",
    "user_metadata",
    "frames",
    "device_free",
];

/// A trace event's dict as a record: which of [`EVENT_KEYS`] it has (`present`, bit `i`
/// for key `i`) and their values. Made only from a dict whose keys are among those, each
/// once, with the types PyTorch writes; any other dict stays a dict.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Event {
    present: u16,
    action: StrId,
    compile_context: StrId,
    user_metadata: StrId,
    frames: ObjId,
    ints: [i64; 5],
}

/// Where each integer key of an event lives in `Event::ints`.
const fn int_slot(key: usize) -> Option<usize> {
    match key {
        1 => Some(0),
        2 => Some(1),
        3 => Some(2),
        4 => Some(3),
        8 => Some(4),
        _ => None,
    }
}

/// Strings longer than this are not looked up by content (a memo reference still shares
/// them): the keys and the values that repeat are short.
const SHARE_UP_TO: usize = 64;

/// Everything a pickle built, with the budget it may build within.
#[derive(Debug)]
pub struct Heap {
    strings: Vec<Box<str>>,
    short: FxHashMap<Box<str>, StrId>,
    string_bytes: u64,
    max_string_bytes: u64,
    objs: Vec<Obj>,
    /// Values held by containers (a record counts as 4).
    values: u64,
    event_keys: [StrId; 9],
}

/// Values a record is counted as (its 64 bytes at 16 bytes a value).
const EVENT_WEIGHT: u64 = 4;

impl Heap {
    /// An empty heap that keeps at most `max_string_bytes` bytes of strings.
    pub fn new(max_string_bytes: u64) -> Heap {
        let mut heap = Heap {
            strings: Vec::new(),
            short: FxHashMap::default(),
            string_bytes: 0,
            max_string_bytes,
            objs: Vec::new(),
            values: 0,
            event_keys: [StrId(0); 9],
        };
        for (i, key) in EVENT_KEYS.iter().enumerate() {
            heap.event_keys[i] = heap.intern(key);
        }
        heap
    }

    fn intern(&mut self, text: &str) -> StrId {
        if let Some(&id) = self.short.get(text) {
            return id;
        }
        let id = StrId(self.strings.len() as u32);
        self.strings.push(text.into());
        self.short.insert(text.into(), id);
        id
    }

    /// Whether `more` bytes of string still fit the budget.
    pub fn string_room(&self, more: u64) -> Result<(), UnpickleError> {
        match self.string_bytes.checked_add(more) {
            Some(total) if total <= self.max_string_bytes => Ok(()),
            _ => Err(UnpickleError::TooManyStringBytes {
                limit: self.max_string_bytes,
            }),
        }
    }

    /// Adds a string (shared with an equal one when short).
    pub fn string(&mut self, text: String) -> Result<StrId, UnpickleError> {
        if let Some(&id) = self
            .short
            .get(text.as_str())
            .filter(|_| text.len() <= SHARE_UP_TO)
        {
            return Ok(id);
        }
        self.string_room(text.len() as u64)?;
        if self.strings.len() >= u32::MAX as usize {
            return Err(UnpickleError::TooManyStrings);
        }
        self.string_bytes += text.len() as u64;
        let id = StrId(self.strings.len() as u32);
        if text.len() <= SHARE_UP_TO {
            self.short.insert(text.as_str().into(), id);
        }
        self.strings.push(text.into_boxed_str());
        Ok(id)
    }

    /// The string equal to `text`, if the pickle has it and it is short (keys are).
    pub fn find_short(&self, text: &str) -> Option<StrId> {
        self.short.get(text).copied()
    }

    /// A string's text.
    pub fn text(&self, id: StrId) -> &str {
        self.strings.get(id.0 as usize).map_or("", |s| s)
    }

    /// Gives up the string table (for the decoded snapshot, which refers to it by id).
    pub fn into_strings(self) -> Vec<Box<str>> {
        self.strings
    }

    /// The id of an event key (one of [`EVENT_KEYS`]).
    pub fn event_key(&self, key: usize) -> StrId {
        self.event_keys[key]
    }

    /// Values held by containers.
    pub fn values(&self) -> u64 {
        self.values
    }

    /// Adds a container.
    pub fn alloc(&mut self, obj: Obj) -> Result<Value, UnpickleError> {
        if self.objs.len() >= u32::MAX as usize {
            return Err(UnpickleError::TooManyObjects);
        }
        self.values += weight(&obj);
        self.objs.push(obj);
        Ok(Value::Obj(ObjId(self.objs.len() as u32 - 1)))
    }

    /// A container.
    pub fn get(&self, id: ObjId) -> Option<&Obj> {
        self.objs.get(id.0 as usize)
    }

    /// A container, to change it: a record turns back into a dict first.
    fn get_mut(&mut self, id: ObjId) -> Option<&mut Obj> {
        let index = id.0 as usize;
        if let Some(Obj::Event(e)) = self.objs.get(index) {
            let dict = self.event_pairs(e);
            self.values = self.values - EVENT_WEIGHT + 2 * dict.len() as u64;
            self.objs[index] = Obj::Dict(dict);
        }
        self.objs.get_mut(index)
    }

    /// Appends `items` to the list `target`; dicts shaped like trace events become records.
    pub fn extend_list(&mut self, target: Value, items: Vec<Value>) -> Result<(), String> {
        for item in &items {
            if let Value::Obj(child) = *item {
                self.compact(child);
            }
        }
        let n = items.len() as u64;
        self.fill(
            target,
            n,
            "append to something that is not a list",
            |obj| match obj {
                Obj::List(list) => {
                    list.extend(items);
                    true
                }
                _ => false,
            },
        )
    }

    /// Adds `pairs` to the dict `target`.
    pub fn extend_dict(&mut self, target: Value, pairs: Vec<(Value, Value)>) -> Result<(), String> {
        let n = 2 * pairs.len() as u64;
        self.fill(
            target,
            n,
            "set an item of something that is not a dict",
            |obj| match obj {
                Obj::Dict(dict) => {
                    dict.extend(pairs);
                    true
                }
                _ => false,
            },
        )
    }

    /// Adds `items` to the set `target`.
    pub fn extend_set(&mut self, target: Value, items: Vec<Value>) -> Result<(), String> {
        let n = items.len() as u64;
        self.fill(
            target,
            n,
            "add to something that is not a set",
            |obj| match obj {
                Obj::Set(set) => {
                    set.extend(items);
                    true
                }
                _ => false,
            },
        )
    }

    /// Adds `added` values to the container `target` with `add`, which says whether the
    /// container is of its kind; `refusal` when it is not (or `target` is no container).
    fn fill(
        &mut self,
        target: Value,
        added: u64,
        refusal: &str,
        add: impl FnOnce(&mut Obj) -> bool,
    ) -> Result<(), String> {
        let Value::Obj(id) = target else {
            return Err(refusal.into());
        };
        if !self.get_mut(id).is_some_and(add) {
            return Err(refusal.into());
        }
        self.values += added;
        Ok(())
    }

    /// The value of `key` in the dict (or record) `id`: the last assignment of an equal
    /// key.
    pub fn lookup(&self, id: ObjId, key: StrId) -> Option<Value> {
        match self.get(id)? {
            Obj::Dict(pairs) => pairs
                .iter()
                .rev()
                .find(|(k, _)| self.same_str(*k, key))
                .map(|(_, v)| *v),
            Obj::Event(e) => {
                let i = self.event_keys.iter().position(|&k| k == key)?;
                self.event_value(e, i)
            }
            _ => None,
        }
    }

    fn same_str(&self, value: Value, key: StrId) -> bool {
        match value {
            Value::Str(s) => s == key || self.text(s) == self.text(key),
            _ => false,
        }
    }

    /// The keys and values of a dict or record, in order (a record's in [`EVENT_KEYS`]
    /// order), each key once: the last assignment wins.
    pub fn pairs(&self, id: ObjId) -> Vec<(Value, Value)> {
        match self.get(id) {
            Some(Obj::Dict(pairs)) => {
                let mut out: Vec<(Value, Value)> = Vec::with_capacity(pairs.len());
                for &(k, v) in pairs {
                    match out.iter_mut().find(|(seen, _)| self.equal_keys(*seen, k)) {
                        Some(slot) => slot.1 = v,
                        None => out.push((k, v)),
                    }
                }
                out
            }
            Some(Obj::Event(e)) => self.event_pairs(e),
            _ => Vec::new(),
        }
    }

    fn equal_keys(&self, a: Value, b: Value) -> bool {
        match (a, b) {
            (Value::Str(x), Value::Str(y)) => x == y || self.text(x) == self.text(y),
            (Value::Str(_), _) | (_, Value::Str(_)) => false,
            _ => a == b,
        }
    }

    fn event_value(&self, e: &Event, key: usize) -> Option<Value> {
        if e.present & (1 << key) == 0 {
            return None;
        }
        Some(match key {
            0 => Value::Str(e.action),
            5 => Value::Str(e.compile_context),
            6 => Value::Str(e.user_metadata),
            7 => Value::Obj(e.frames),
            _ => Value::Int(e.ints[int_slot(key)?]),
        })
    }

    fn event_pairs(&self, e: &Event) -> Vec<(Value, Value)> {
        (0..EVENT_KEYS.len())
            .filter_map(|k| Some((Value::Str(self.event_keys[k]), self.event_value(e, k)?)))
            .collect()
    }

    /// Stores the dict `id` as a record if it is shaped like a trace event.
    fn compact(&mut self, id: ObjId) {
        let Some(Obj::Dict(pairs)) = self.get(id) else {
            return;
        };
        if pairs.len() > EVENT_KEYS.len() {
            return;
        }
        let mut e = Event {
            present: 0,
            action: StrId(0),
            compile_context: StrId(0),
            user_metadata: StrId(0),
            frames: ObjId(0),
            ints: [0; 5],
        };
        for &(k, v) in pairs {
            let Value::Str(k) = k else { return };
            let Some(key) = self.event_keys.iter().position(|&e| e == k) else {
                return;
            };
            if e.present & (1 << key) != 0 {
                return;
            }
            e.present |= 1 << key;
            match (key, v) {
                (0, Value::Str(s)) => e.action = s,
                (5, Value::Str(s)) => e.compile_context = s,
                (6, Value::Str(s)) => e.user_metadata = s,
                (7, Value::Obj(o)) => e.frames = o,
                (k, Value::Int(i)) => match int_slot(k) {
                    Some(slot) => e.ints[slot] = i,
                    None => return,
                },
                _ => return,
            }
        }
        let n = 2 * pairs.len() as u64;
        self.values = self.values - n + EVENT_WEIGHT;
        self.objs[id.0 as usize] = Obj::Event(e);
    }
}

fn weight(obj: &Obj) -> u64 {
    match obj {
        Obj::List(v) | Obj::Tuple(v) | Obj::Set(v) => v.len() as u64,
        Obj::Dict(p) => 2 * p.len() as u64,
        Obj::Event(_) => EVENT_WEIGHT,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_and_changes_as_the_dict_it_was() -> Result<(), String> {
        let mut heap = Heap::new(1 << 20);
        let key = |heap: &Heap, k: usize| Value::Str(heap.event_key(k));
        let action = Value::Str(heap.string("alloc".into()).map_err(|e| e.to_string())?);
        let dict = vec![
            (key(&heap, 0), action),
            (key(&heap, 2), Value::Int(512)),
            (key(&heap, 1), Value::Int(4096)),
        ];
        let event = heap.alloc(Obj::Dict(dict)).map_err(|e| e.to_string())?;
        let list = heap
            .alloc(Obj::List(Vec::new()))
            .map_err(|e| e.to_string())?;
        heap.extend_list(list, vec![event])?;
        let Value::Obj(id) = event else {
            return Err("not an object".into());
        };
        assert!(matches!(heap.get(id), Some(Obj::Event(_))));
        assert_eq!(heap.lookup(id, heap.event_key(2)), Some(Value::Int(512)));
        assert_eq!(heap.lookup(id, heap.event_key(3)), None);
        assert_eq!(heap.values(), 1 + EVENT_WEIGHT);
        // Setting a key through a memo reference turns it back into a dict.
        let seven = heap.string("seven".into()).map_err(|e| e.to_string())?;
        heap.extend_dict(event, vec![(key(&heap, 2), Value::Int(7))])?;
        heap.extend_dict(event, vec![(Value::Str(seven), Value::None)])?;
        assert!(matches!(heap.get(id), Some(Obj::Dict(_))));
        assert_eq!(heap.lookup(id, heap.event_key(2)), Some(Value::Int(7)));
        assert_eq!(heap.lookup(id, heap.event_key(1)), Some(Value::Int(4096)));
        assert_eq!(heap.pairs(id).len(), 4);
        assert_eq!(heap.values(), 1 + 2 * 5);
        Ok(())
    }

    #[test]
    fn dicts_of_other_shapes_stay_dicts() -> Result<(), String> {
        let mut heap = Heap::new(1 << 20);
        let size = Value::Str(heap.event_key(2));
        let text = Value::Str(heap.string("512".into()).map_err(|e| e.to_string())?);
        let other = Value::Str(heap.string("other".into()).map_err(|e| e.to_string())?);
        let list = heap
            .alloc(Obj::List(Vec::new()))
            .map_err(|e| e.to_string())?;
        for pairs in [
            vec![(size, text)],
            vec![(size, Value::Int(1)), (other, Value::Int(2))],
            vec![(size, Value::Int(1)), (size, Value::Int(2))],
        ] {
            let dict = heap.alloc(Obj::Dict(pairs)).map_err(|e| e.to_string())?;
            heap.extend_list(list, vec![dict])?;
            let Value::Obj(id) = dict else {
                return Err("not an object".into());
            };
            assert!(matches!(heap.get(id), Some(Obj::Dict(_))));
        }
        Ok(())
    }

    #[test]
    fn short_strings_are_shared_by_content_and_counted_once() -> Result<(), String> {
        let mut heap = Heap::new(10);
        let a = heap.string("N/A".into()).map_err(|e| e.to_string())?;
        let b = heap.string("N/A".into()).map_err(|e| e.to_string())?;
        assert_eq!(a, b);
        assert!(heap.string("1234567".into()).is_ok());
        assert!(matches!(
            heap.string("xyz".into()),
            Err(UnpickleError::TooManyStringBytes { limit: 10 })
        ));
        Ok(())
    }
}
