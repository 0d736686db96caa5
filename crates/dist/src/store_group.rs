//! Collectives between processes through the rendezvous store: what a group of fake-device
//! ranks in separate processes (CI's torchrun runs) uses instead of NCCL, and a way to check
//! a rendezvous without GPUs. Each call reads this rank's input to the host (in stream
//! order: the host waits for the stream), publishes it under the call's key, reads the
//! other ranks' (waiting at most the store's timeout: a dead or stuck peer is
//! [`StoreError::Timeout`](crate::StoreError::Timeout) on every rank that waits for it),
//! computes the result as NCCL defines it, and writes it on the stream. A call captured
//! into a graph is refused (the host cannot wait inside a capture). Slow by design: a
//! correctness backend, not a transport.
use crate::collective::{check_host_call, check_ranks};
use crate::fake::{Num, reduce};
use crate::store::TcpStore;
use crate::{Collective, DistError, Result};
use ferrocuda_driver::Driver;
use ferrocuda_driver::nccl::{CollectiveCall, CollectiveOp, ReduceOp};
use ferrocuda_types::{CaptureStatus, DType, DeviceIndex, StreamHandle};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// One rank of a group whose collectives move through a [`TcpStore`] (see the module docs).
pub struct StoreRank {
    driver: Arc<dyn Driver>,
    store: Arc<TcpStore>,
    rank: usize,
    size: usize,
    device: DeviceIndex,
    /// Keys of this group begin with it.
    prefix: String,
    calls: Mutex<Calls>,
}

/// Collectives called so far (every rank calls them in one order), and sends so far per
/// (sender, receiver).
#[derive(Default)]
struct Calls {
    collectives: u64,
    sends: HashMap<(usize, usize), u64>,
}

impl std::fmt::Debug for StoreRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreRank")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.device)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// A rank's published part of a call: what it called (so that ranks that disagree are
/// told), then its input.
fn publish(what: &str, input: &[u8]) -> Vec<u8> {
    let mut v = (what.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(what.as_bytes());
    v.extend_from_slice(input);
    v
}

fn unpack(v: &[u8]) -> Result<(&str, &[u8])> {
    let bad = || DistError::Mismatched("a malformed part in the store".into());
    let len = u32::from_le_bytes(v.get(..4).ok_or_else(bad)?.try_into().map_err(|_| bad())?);
    let end = 4 + len as usize;
    let what = std::str::from_utf8(v.get(4..end).ok_or_else(bad)?).map_err(|_| bad())?;
    Ok((what, &v[end..]))
}

impl StoreRank {
    /// Rank `rank` of `size` on `device`, its calls under `prefix` in `store` (every rank
    /// of the group gives the same prefix and store server).
    pub fn new(
        driver: Arc<dyn Driver>,
        store: Arc<TcpStore>,
        rank: usize,
        size: usize,
        device: DeviceIndex,
        prefix: &str,
    ) -> Result<StoreRank> {
        if rank >= size {
            return Err(DistError::InvalidRank { rank, size });
        }
        Ok(StoreRank {
            driver,
            store,
            rank,
            size,
            device,
            prefix: prefix.to_string(),
            calls: Mutex::new(Calls::default()),
        })
    }

    /// The store the group meets through.
    pub fn store(&self) -> &Arc<TcpStore> {
        &self.store
    }

    fn read(&self, call: &CollectiveCall, elems: usize, stream: StreamHandle) -> Result<Vec<u8>> {
        let mut host = vec![0u8; elems * call.dtype.size()];
        if !host.is_empty() {
            self.driver.memcpy_dtoh(&mut host, call.send, stream)?;
        }
        Ok(host)
    }

    /// The parts of `ranks` for call key `key`, once published; ranks that called
    /// something else than `what` make it [`DistError::Mismatched`].
    fn gather(&self, key: &str, ranks: &[usize], what: &str) -> Result<Vec<Vec<u8>>> {
        let keys: Vec<String> = ranks.iter().map(|r| format!("{key}/{r}")).collect();
        let names: Vec<&str> = keys.iter().map(String::as_str).collect();
        let parts = self.store.multi_get(&names)?;
        parts
            .iter()
            .zip(ranks)
            .map(|(p, r)| {
                let (theirs, input) = unpack(p)?;
                if theirs != what {
                    return Err(DistError::Mismatched(format!(
                        "rank {} called {what}, rank {r} {theirs}",
                        self.rank
                    )));
                }
                Ok(input.to_vec())
            })
            .collect()
    }

    /// Counts this rank out of call `key`; the last of `readers` deletes its parts.
    fn done(&self, key: &str, parts: &[usize], readers: usize) -> Result<()> {
        if self.store.add(&format!("{key}/read"), 1)? == readers as i64 {
            for r in parts {
                self.store.delete_key(&format!("{key}/{r}"))?;
            }
            self.store.delete_key(&format!("{key}/read"))?;
        }
        Ok(())
    }

    fn write(&self, call: &CollectiveCall, out: &[u8], stream: StreamHandle) -> Result<()> {
        if !out.is_empty() {
            self.driver.memcpy_htod_async(call.recv, out, stream)?;
        }
        Ok(())
    }
}

/// Leaving the group: a rank says so in the store; the rank whose process holds the store
/// server waits (at most the store's timeout) until every rank has left, so that the
/// server outlives the others' last reads.
impl Drop for StoreRank {
    fn drop(&mut self) {
        let left = |r: usize| format!("{}/left/{r}", self.prefix);
        let _ = self.store.set(&left(self.rank), b"1");
        if self.store.server_port().is_some() {
            let keys: Vec<String> = (0..self.size).map(left).collect();
            let names: Vec<&str> = keys.iter().map(String::as_str).collect();
            let _ = self.store.wait(&names, None);
        }
    }
}

/// `inputs` (one per rank, bytes of `dtype`) reduced by `op`.
fn reduce_bytes(inputs: &[Vec<u8>], dtype: DType, op: ReduceOp) -> Result<Vec<u8>> {
    fn typed<T: Num>(inputs: &[Vec<u8>], op: ReduceOp) -> Vec<u8> {
        let values: Vec<Vec<T>> = inputs
            .iter()
            .map(|b| {
                (b.chunks_exact(std::mem::size_of::<T>()))
                    .map(bytemuck::pod_read_unaligned)
                    .collect()
            })
            .collect();
        bytemuck::cast_slice(&reduce(&values, op)).to_vec()
    }
    Ok(match dtype {
        DType::F32 => typed::<f32>(inputs, op),
        DType::F64 => typed::<f64>(inputs, op),
        DType::I32 => typed::<i32>(inputs, op),
        DType::I64 => typed::<i64>(inputs, op),
        other => return Err(DistError::UnsupportedType(other)),
    })
}

impl Collective for StoreRank {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn device(&self) -> DeviceIndex {
        self.device
    }

    fn collective(&self, call: &CollectiveCall, stream: StreamHandle) -> Result<()> {
        check_ranks(call.op, self.rank, self.size)?;
        check_host_call(self.device, call, stream)?;
        if self.driver.stream_capture_status(stream)? != CaptureStatus::None {
            return Err(DistError::Mismatched(
                "a store group's collective cannot be captured into a graph".into(),
            ));
        }
        let what = format!("{:?} of {} {:?}", call.op, call.count, call.dtype);
        let all: Vec<usize> = (0..self.size).collect();
        let (n, size) = (call.count, self.size);
        match call.op {
            CollectiveOp::Send { peer } | CollectiveOp::Recv { peer } => {
                let sending = matches!(call.op, CollectiveOp::Send { .. });
                let pair = if sending {
                    (self.rank, peer)
                } else {
                    (peer, self.rank)
                };
                let seq = {
                    let mut calls = self.calls.lock();
                    let seq = calls.sends.entry(pair).or_insert(0);
                    *seq += 1;
                    *seq
                };
                let key = format!("{}/p2p/{}-{}/{seq}", self.prefix, pair.0, pair.1);
                let what = format!("send/recv of {n} {:?}", call.dtype);
                if sending {
                    let input = self.read(call, n, stream)?;
                    self.store
                        .set(&format!("{key}/{}", self.rank), &publish(&what, &input))?;
                    return Ok(());
                }
                let data = self.gather(&key, &[peer], &what)?.remove(0);
                self.write(call, &data, stream)?;
                return self.done(&key, &[peer], 1);
            }
            _ => {}
        }
        let seq = {
            let mut calls = self.calls.lock();
            calls.collectives += 1;
            calls.collectives
        };
        let key = format!("{}/coll/{seq}", self.prefix);
        let in_elems = match call.op {
            CollectiveOp::ReduceScatter(_) => n * size,
            CollectiveOp::Broadcast { root } if root != self.rank => 0,
            _ => n,
        };
        let input = self.read(call, in_elems, stream)?;
        self.store
            .set(&format!("{key}/{}", self.rank), &publish(&what, &input))?;
        let out = match call.op {
            CollectiveOp::AllReduce(op) => {
                reduce_bytes(&self.gather(&key, &all, &what)?, call.dtype, op)?
            }
            CollectiveOp::ReduceScatter(op) => {
                let sum = reduce_bytes(&self.gather(&key, &all, &what)?, call.dtype, op)?;
                let block = n * call.dtype.size();
                sum[self.rank * block..(self.rank + 1) * block].to_vec()
            }
            CollectiveOp::AllGather => self.gather(&key, &all, &what)?.concat(),
            CollectiveOp::Broadcast { root } => self.gather(&key, &[root], &what)?.remove(0),
            CollectiveOp::Send { .. } | CollectiveOp::Recv { .. } => Vec::new(),
        };
        self.write(call, &out, stream)?;
        self.done(&key, &all, size)
    }
}
