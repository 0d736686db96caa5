//! PyTorch's c10d `TCPStore` wire protocol (`torch/csrc/distributed/c10d/TCPStore.cpp`,
//! `TCPStoreBackend.hpp`, `TCPStoreLibUvBackend.cpp`): each query is one command byte and
//! its arguments; strings and byte vectors are a `u64` length and the bytes, numbers are
//! native-endian (little-endian on every host PyTorch supports). A client's first query is
//! `VALIDATE` with the magic number, then a `PING` whose nonce comes back.
use super::StoreError;
use std::io::{Read, Write};

/// `validationMagicNumber`.
pub(crate) const MAGIC: u32 = 0x3C85_F7CE;

/// The libuv server's limits (`MAX_STRING_LEN`, `MAX_PAYLOAD_LEN`, `MAX_KEY_COUNT`): a query
/// past them closes the connection there, and is refused before sending here.
pub(crate) const MAX_KEY_LEN: usize = 8 * 1024;
pub(crate) const MAX_PAYLOAD_LEN: usize = 8 * 1024 * 1024;
pub(crate) const MAX_KEY_COUNT: usize = 128 * 1024;

/// `QueryType`, in PyTorch's order.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Query {
    Validate = 0,
    Set = 1,
    CompareSet = 2,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    GetNumKeys = 7,
    DeleteKey = 8,
    Append = 9,
    MultiGet = 10,
    MultiSet = 11,
    CancelWait = 12,
    Ping = 13,
    QueuePush = 14,
    QueuePop = 15,
    QueueLen = 16,
}

impl Query {
    pub(crate) fn from_byte(b: u8) -> Option<Query> {
        use Query::*;
        const ALL: [Query; 17] = [
            Validate, Set, CompareSet, Get, Add, Check, Wait, GetNumKeys, DeleteKey, Append,
            MultiGet, MultiSet, CancelWait, Ping, QueuePush, QueuePop, QueueLen,
        ];
        ALL.get(usize::from(b)).copied()
    }
}

/// `CheckResponseType`.
pub(crate) const READY: u8 = 0;
pub(crate) const NOT_READY: u8 = 1;
/// `WaitResponseType`.
pub(crate) const STOP_WAITING: u8 = 0;
pub(crate) const WAIT_CANCELED: u8 = 1;

/// A query (or a response) being built, sent in one write.
#[derive(Default)]
pub(crate) struct Message(pub(crate) Vec<u8>);

impl Message {
    pub(crate) fn query(q: Query) -> Message {
        Message(vec![q as u8])
    }

    pub(crate) fn byte(mut self, b: u8) -> Message {
        self.0.push(b);
        self
    }

    pub(crate) fn u32(mut self, v: u32) -> Message {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn u64(mut self, v: u64) -> Message {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn i64(mut self, v: i64) -> Message {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// A string or a byte vector: its length, then its bytes.
    pub(crate) fn bytes(self, b: &[u8]) -> Message {
        let mut m = self.u64(b.len() as u64);
        m.0.extend_from_slice(b);
        m
    }

    /// A count of keys, then each key.
    pub(crate) fn keys(self, keys: &[Vec<u8>]) -> Message {
        (keys.iter()).fold(self.u64(keys.len() as u64), |m, k| m.bytes(k))
    }

    pub(crate) fn send(&self, w: &mut impl Write) -> std::io::Result<()> {
        w.write_all(&self.0)?;
        w.flush()
    }
}

/// Reads the fields of a query or a response.
pub(crate) struct Reader<R>(pub(crate) R);

impl<R: Read> Reader<R> {
    pub(crate) fn exact<const N: usize>(&mut self) -> std::io::Result<[u8; N]> {
        let mut b = [0; N];
        self.0.read_exact(&mut b)?;
        Ok(b)
    }

    pub(crate) fn byte(&mut self) -> std::io::Result<u8> {
        Ok(self.exact::<1>()?[0])
    }

    pub(crate) fn u32(&mut self) -> std::io::Result<u32> {
        Ok(u32::from_le_bytes(self.exact()?))
    }

    pub(crate) fn u64(&mut self) -> std::io::Result<u64> {
        Ok(u64::from_le_bytes(self.exact()?))
    }

    pub(crate) fn i64(&mut self) -> std::io::Result<i64> {
        Ok(i64::from_le_bytes(self.exact()?))
    }

    /// A length-prefixed vector of at most `max` bytes (longer is `InvalidData`).
    pub(crate) fn bytes(&mut self, max: usize) -> std::io::Result<Vec<u8>> {
        let len = self.u64()?;
        if len > max as u64 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a field of {len} bytes, over the limit of {max}"),
            ));
        }
        let mut v = vec![0; len as usize];
        self.0.read_exact(&mut v)?;
        Ok(v)
    }

    /// A key: at most [`MAX_KEY_LEN`] bytes (PyTorch's keys are `std::string`s: any bytes).
    pub(crate) fn key(&mut self) -> std::io::Result<Vec<u8>> {
        self.bytes(MAX_KEY_LEN)
    }

    /// A count of keys, at most [`MAX_KEY_COUNT`].
    pub(crate) fn count(&mut self) -> std::io::Result<usize> {
        let n = self.u64()?;
        if n > MAX_KEY_COUNT as u64 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{n} keys, over the limit of {MAX_KEY_COUNT}"),
            ));
        }
        Ok(n as usize)
    }
}

/// Refuses a key or a value the server would refuse (it closes the connection instead).
pub(crate) fn check_len(what: &'static str, len: usize, max: usize) -> Result<(), StoreError> {
    if len > max {
        return Err(StoreError::TooLarge { what, len, max });
    }
    Ok(())
}
