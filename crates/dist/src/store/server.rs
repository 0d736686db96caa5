//! The store's server (`TCPStoreMasterDaemon` / `LibUVStoreDaemon`): keys and values in
//! memory, clients served one thread each, a client's `wait` answered by whichever thread
//! sets the last key it waits for (as the libuv daemon answers from its loop).
use super::StoreError;
use super::wire::{
    MAGIC, MAX_PAYLOAD_LEN, Message, NOT_READY, Query, READY, Reader, STOP_WAITING, WAIT_CANCELED,
};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::io::BufReader;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

type Key = Vec<u8>;

/// What the server holds (`tcpStore_`, `queues_`, `waitingSockets_`, `keysAwaited_`) and
/// where to write to each client.
#[derive(Default)]
struct State {
    keys: HashMap<Key, Vec<u8>>,
    queues: HashMap<Key, VecDeque<Vec<u8>>>,
    /// Key → the clients waiting for it.
    waiting: HashMap<Key, Vec<u64>>,
    /// Client → how many of its keys it still waits for.
    awaited: HashMap<u64, usize>,
    writers: HashMap<u64, TcpStream>,
}

impl State {
    /// Writes `m` to client `id`; a client gone is left to its reader thread to clean up.
    fn reply(&mut self, id: u64, m: &Message) {
        if let Some(w) = self.writers.get_mut(&id) {
            let _ = m.send(w);
        }
    }

    fn set(&mut self, key: Key, value: Vec<u8>) {
        self.keys.insert(key.clone(), value);
        self.wake_waiting(&key);
    }

    /// `wakeupWaitingClients`: every client waiting for `key` waits for one key fewer; those
    /// that wait for none now are told to stop.
    fn wake_waiting(&mut self, key: &[u8]) {
        for client in self.waiting.remove(key).unwrap_or_default() {
            self.one_fewer(client);
        }
    }

    /// `wakeupOneWaitingClient` (a queue push): the first client waiting for `key` whose
    /// wait ends with it.
    fn wake_one(&mut self, key: &[u8]) {
        let Some(clients) = self.waiting.get(key).cloned() else {
            return;
        };
        for client in clients {
            if self.awaited.get(&client) == Some(&1) {
                if let Some(w) = self.waiting.get_mut(key) {
                    w.retain(|&c| c != client);
                }
                self.one_fewer(client);
                return;
            }
        }
    }

    fn one_fewer(&mut self, client: u64) {
        if let Some(n) = self.awaited.get_mut(&client) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.awaited.remove(&client);
                self.reply(client, &Message::default().byte(STOP_WAITING));
            }
        }
    }

    /// `checkKeys`: every key is set, or names a queue with an element.
    fn ready(&self, keys: &[Key]) -> bool {
        keys.iter()
            .all(|k| self.keys.contains_key(k) || self.queues.get(k).is_some_and(|q| !q.is_empty()))
    }

    /// `compareAndSet`: a missing key is set only when `expected` is empty; the answer is
    /// the value now (or `expected` for a missing key left missing).
    fn compare_set(&mut self, key: Key, expected: Vec<u8>, new: Vec<u8>) -> Vec<u8> {
        let now = match self.keys.get(&key) {
            None if !expected.is_empty() => expected,
            Some(old) if *old != expected => old.clone(),
            _ => {
                self.keys.insert(key.clone(), new.clone());
                new
            }
        };
        self.wake_waiting(&key);
        now
    }

    /// `waitKeys`: client `id` is told to stop waiting now if every key is ready, else
    /// when the keys not set yet are.
    fn wait(&mut self, id: u64, keys: Vec<Key>) {
        if self.ready(&keys) {
            self.reply(id, &Message::default().byte(STOP_WAITING));
            return;
        }
        let missing: Vec<Key> = (keys.into_iter())
            .filter(|k| !self.keys.contains_key(k))
            .collect();
        self.awaited.insert(id, missing.len());
        for k in missing {
            self.waiting.entry(k).or_default().push(id);
        }
    }

    /// `clearClientWaitState`.
    fn forget_waits(&mut self, client: u64) {
        if self.awaited.remove(&client).is_none() {
            return;
        }
        self.waiting.retain(|_, clients| {
            clients.retain(|&c| c != client);
            !clients.is_empty()
        });
    }

    /// `add`: the value parsed as `std::stoll` parses it (leading blanks, a sign, digits),
    /// plus `delta`, stored as decimal text. `None` where PyTorch's server throws (and
    /// closes the connection): a value that is not a number, or an overflow.
    fn add(&mut self, key: Key, delta: i64) -> Option<i64> {
        let sum = match self.keys.get(&key) {
            Some(old) => parse_like_stoll(old)?.checked_add(delta)?,
            None => delta,
        };
        self.set(key, sum.to_string().into_bytes());
        Some(sum)
    }
}

/// `std::stoll(s)`: leading whitespace, an optional sign, then at least one decimal digit;
/// what follows the digits is ignored.
fn parse_like_stoll(s: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(s).ok()?.trim_start();
    let digits_from = usize::from(text.starts_with(['+', '-']));
    let end = digits_from
        + text[digits_from..]
            .bytes()
            .take_while(u8::is_ascii_digit)
            .count();
    if end == digits_from {
        return None;
    }
    text[..end].parse().ok()
}

struct Shared {
    state: Mutex<State>,
    stop: AtomicBool,
    /// Each client's stream (to shut down) and thread.
    clients: Mutex<Vec<(TcpStream, JoinHandle<()>)>>,
}

/// A c10d `TCPStore` server: what `torch.distributed.TCPStore(..., is_master=True)` and
/// torchrun's agent run. PyTorch's clients and [`TcpStore`](super::TcpStore) talk to it
/// alike. Dropping it closes every connection and stops its threads.
pub struct TcpStoreServer {
    port: u16,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreServer")
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl TcpStoreServer {
    /// Listens on `port` of every address (IPv6 and IPv4 where the host has both, else
    /// IPv4, as PyTorch's server binds); port 0 takes a free one ([`TcpStoreServer::port`]).
    /// A port in use is [`StoreError::Bind`].
    pub fn bind(port: u16) -> Result<TcpStoreServer, StoreError> {
        let listener = TcpListener::bind(SocketAddr::from(([0u16; 8], port)))
            .or_else(|_| TcpListener::bind(SocketAddr::from(([0u8; 4], port))))
            .map_err(|e| StoreError::Bind {
                port,
                message: e.to_string(),
            })?;
        let port = listener.local_addr().map_err(StoreError::io)?.port();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            stop: AtomicBool::new(false),
            clients: Mutex::new(Vec::new()),
        });
        let accepting = shared.clone();
        let accept = std::thread::Builder::new()
            .name("ferrocuda-store".into())
            .spawn(move || accept_loop(&listener, &accepting))
            .map_err(StoreError::io)?;
        Ok(TcpStoreServer {
            port,
            shared,
            accept: Some(accept),
        })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Keys it holds (`getNumKeys`; queues aside).
    pub fn num_keys(&self) -> usize {
        self.shared.state.lock().keys.len()
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        // Wake the accepting thread with a connection of our own (if none can be made, the
        // thread is left to end with the process rather than waited for).
        let woken = TcpStream::connect(("127.0.0.1", self.port))
            .or_else(|_| TcpStream::connect(("::1", self.port)))
            .is_ok();
        if let Some(t) = self.accept.take().filter(|_| woken) {
            let _ = t.join();
        }
        let clients = std::mem::take(&mut *self.shared.clients.lock());
        for (stream, _) in &clients {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for (_, t) in clients {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    let mut next_id = 0u64;
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let _ = stream.set_nodelay(true);
        let (Ok(reader), Ok(writer), Ok(keep)) =
            (stream.try_clone(), stream.try_clone(), stream.try_clone())
        else {
            continue;
        };
        next_id += 1;
        let id = next_id;
        shared.state.lock().writers.insert(id, writer);
        let serving = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ferrocuda-store-client".into())
            .spawn(move || {
                // A client that breaks the protocol or leaves ends here; its state goes.
                let _ = serve(&serving, id, reader);
                let mut st = serving.state.lock();
                st.forget_waits(id);
                // Other handles of the socket are held (for shutdown): close it outright.
                if let Some(w) = st.writers.remove(&id) {
                    let _ = w.shutdown(Shutdown::Both);
                }
            });
        let mut clients = shared.clients.lock();
        // Threads of clients gone are joined as new ones come, so none accumulate.
        clients.retain(|(_, t)| !t.is_finished());
        if let Ok(t) = thread {
            clients.push((keep, t));
        }
    }
}

/// Serves client `id` until it leaves or breaks the protocol (PyTorch closes such a
/// connection): the first query must be `VALIDATE` with the magic number.
fn serve(shared: &Shared, id: u64, stream: TcpStream) -> std::io::Result<()> {
    let mut r = Reader(BufReader::new(stream));
    if Query::from_byte(r.byte()?) != Some(Query::Validate) || r.u32()? != MAGIC {
        return Err(std::io::ErrorKind::InvalidData.into());
    }
    loop {
        let query = Query::from_byte(r.byte()?).ok_or(std::io::ErrorKind::InvalidData)?;
        handle(shared, id, query, &mut r)?;
    }
}

/// Reads `query`'s arguments, then does it under the state's lock and answers.
fn handle(
    shared: &Shared,
    id: u64,
    query: Query,
    r: &mut Reader<BufReader<TcpStream>>,
) -> std::io::Result<()> {
    let bad = || std::io::Error::from(std::io::ErrorKind::InvalidData);
    let keys = |r: &mut Reader<BufReader<TcpStream>>| -> std::io::Result<Vec<Key>> {
        let n = r.count()?;
        (0..n).map(|_| r.key()).collect()
    };
    match query {
        Query::Validate => return Err(bad()),
        Query::Ping => {
            let nonce = r.u32()?;
            shared
                .state
                .lock()
                .reply(id, &Message::default().u32(nonce));
        }
        Query::Set => {
            let (k, v) = (r.key()?, r.bytes(MAX_PAYLOAD_LEN)?);
            shared.state.lock().set(k, v);
        }
        Query::CompareSet => {
            let k = r.key()?;
            let (expected, new) = (r.bytes(MAX_PAYLOAD_LEN)?, r.bytes(MAX_PAYLOAD_LEN)?);
            let mut st = shared.state.lock();
            let now = st.compare_set(k, expected, new);
            st.reply(id, &Message::default().bytes(&now));
        }
        Query::Get => {
            let k = r.key()?;
            let mut st = shared.state.lock();
            let v = st.keys.get(&k).cloned().unwrap_or_default();
            st.reply(id, &Message::default().bytes(&v));
        }
        Query::Add => {
            let (k, delta) = (r.key()?, r.i64()?);
            let mut st = shared.state.lock();
            let sum = st.add(k, delta).ok_or_else(bad)?;
            st.reply(id, &Message::default().i64(sum));
        }
        Query::Check => {
            let keys = keys(r)?;
            let mut st = shared.state.lock();
            let answer = if st.ready(&keys) { READY } else { NOT_READY };
            st.reply(id, &Message::default().byte(answer));
        }
        Query::Wait => {
            let keys = keys(r)?;
            shared.state.lock().wait(id, keys);
        }
        Query::CancelWait => {
            let mut st = shared.state.lock();
            st.forget_waits(id);
            st.reply(id, &Message::default().byte(WAIT_CANCELED));
        }
        Query::GetNumKeys => {
            let mut st = shared.state.lock();
            let n = st.keys.len() as i64;
            st.reply(id, &Message::default().i64(n));
        }
        Query::DeleteKey => {
            let k = r.key()?;
            let mut st = shared.state.lock();
            let n = i64::from(st.keys.remove(&k).is_some());
            st.reply(id, &Message::default().i64(n));
        }
        Query::Append => {
            let (k, v) = (r.key()?, r.bytes(MAX_PAYLOAD_LEN)?);
            let mut st = shared.state.lock();
            st.keys.entry(k.clone()).or_default().extend_from_slice(&v);
            st.wake_waiting(&k);
        }
        Query::MultiGet => {
            let keys = keys(r)?;
            let mut st = shared.state.lock();
            let mut m = Message::default();
            for k in &keys {
                m = m.bytes(st.keys.get(k).map_or(&[][..], Vec::as_slice));
            }
            st.reply(id, &m);
        }
        Query::MultiSet => {
            let n = r.count()?;
            let mut pairs = Vec::with_capacity(n);
            for _ in 0..n {
                pairs.push((r.key()?, r.bytes(MAX_PAYLOAD_LEN)?));
            }
            let mut st = shared.state.lock();
            for (k, v) in pairs {
                st.set(k, v);
            }
        }
        Query::QueuePush => {
            let (k, v) = (r.key()?, r.bytes(MAX_PAYLOAD_LEN)?);
            let mut st = shared.state.lock();
            st.queues.entry(k.clone()).or_default().push_back(v);
            st.wake_one(&k);
        }
        Query::QueuePop => {
            let k = r.key()?;
            let mut st = shared.state.lock();
            let queue = st.queues.entry(k).or_default();
            let mut m = Message::default().i64(queue.len() as i64);
            if let Some(v) = queue.pop_front() {
                m = m.bytes(&v);
            }
            st.reply(id, &m);
        }
        Query::QueueLen => {
            let k = r.key()?;
            let mut st = shared.state.lock();
            let n = st.queues.get(&k).map_or(0, VecDeque::len) as i64;
            st.reply(id, &Message::default().i64(n));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_like_stoll;

    #[test]
    fn values_are_parsed_as_stoll_parses_them() {
        assert_eq!(parse_like_stoll(b"42"), Some(42));
        assert_eq!(parse_like_stoll(b"  -7xyz"), Some(-7));
        assert_eq!(parse_like_stoll(b"+3"), Some(3));
        assert_eq!(parse_like_stoll(b"abc"), None);
        assert_eq!(parse_like_stoll(b"-"), None);
        assert_eq!(parse_like_stoll(b""), None);
        assert_eq!(parse_like_stoll(b"99999999999999999999"), None);
    }
}
