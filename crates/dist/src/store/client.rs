//! The store's client (`c10d::TCPStore` without `is_master`), and a store that also runs
//! the server (`is_master=True`).
use super::StoreError;
use super::server::TcpStoreServer;
use super::wire::{
    MAGIC, MAX_KEY_COUNT, MAX_KEY_LEN, MAX_PAYLOAD_LEN, Message, NOT_READY, Query, READY, Reader,
    STOP_WAITING, WAIT_CANCELED, check_len,
};
use parking_lot::Mutex;
use std::io::{BufReader, ErrorKind};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// `TCPStore`'s prefix of every user key (`keyPrefix_`): a PyTorch client's `set("a")` is
/// the server's `/a`, and so is ours.
const KEY_PREFIX: &str = "/";
/// The key `wait_for_workers` counts on (`initKey_`, unprefixed).
const INIT_KEY: &str = "init/";

/// The connection: a writer and a buffered reader of one socket, and why it broke, if it
/// did (a reply cut short leaves the stream out of step: no later query is sent on it).
struct Conn {
    writer: TcpStream,
    reader: Reader<BufReader<TcpStream>>,
    broken: Option<String>,
}

/// A client of a c10d `TCPStore` server (ours, PyTorch's, or torchrun's agent store), with
/// PyTorch's client semantics: keys prefixed with `/`, `get` waiting for its key, `wait`
/// cancelled on the server when it times out. Every call is bounded by the store's timeout
/// ([`StoreError::Timeout`]); one call runs at a time per store (PyTorch's
/// `activeOpLock_`). With [`TcpStore::serve`] it owns the server too, which stops when
/// it is dropped.
pub struct TcpStore {
    addr: SocketAddr,
    timeout: Duration,
    conn: Mutex<Conn>,
    server: Option<TcpStoreServer>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .field("timeout", &self.timeout)
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

/// The first of `host:port`'s addresses that accepts a connection, retried with backoff
/// until `deadline` (the server may not be up yet: PyTorch retries the same way).
fn connect_until(host: &str, port: u16, deadline: Instant) -> Result<TcpStream, StoreError> {
    let mut delay = Duration::from_millis(10);
    loop {
        let addrs: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| StoreError::Connect {
                addr: format!("{host}:{port}"),
                message: e.to_string(),
            })?
            .collect();
        let mut last = String::from("no address");
        for addr in &addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(addr, left.max(Duration::from_millis(1))) {
                Ok(s) => return Ok(s),
                Err(e) => last = e.to_string(),
            }
        }
        if Instant::now() + delay > deadline {
            return Err(StoreError::Connect {
                addr: format!("{host}:{port}"),
                message: format!("no server answered before the timeout: {last}"),
            });
        }
        std::thread::sleep(delay);
        delay = (delay * 2).min(Duration::from_secs(1));
    }
}

impl TcpStore {
    /// Connects to the server at `host:port` (retrying until `timeout` while none listens),
    /// validates and pings it as PyTorch's client does. `timeout` bounds every later call.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<TcpStore, StoreError> {
        let deadline = Instant::now() + timeout;
        let stream = connect_until(host, port, deadline)?;
        let addr = stream.peer_addr().map_err(StoreError::io)?;
        let _ = stream.set_nodelay(true);
        let reader = stream.try_clone().map_err(StoreError::io)?;
        let store = TcpStore {
            addr,
            timeout,
            conn: Mutex::new(Conn {
                writer: stream,
                reader: Reader(BufReader::new(reader)),
                broken: None,
            }),
            server: None,
        };
        store.call(
            "validate",
            Message::query(Query::Validate).u32(MAGIC),
            |_| Ok(()),
        )?;
        let nonce = std::process::id();
        let back = store.call("ping", Message::query(Query::Ping).u32(nonce), |r| r.u32())?;
        if back != nonce {
            return Err(StoreError::Protocol(format!(
                "Ping failed, invalid value returned from server. Expected: {nonce}, Got: {back}"
            )));
        }
        Ok(store)
    }

    /// Runs a server on `port` (0: any free port) and connects to it
    /// (`TCPStore(host, port, world_size, is_master=True)`). With `world_size`, waits
    /// until that many stores counted themselves in ([`TcpStore::wait_for_workers`],
    /// PyTorch's `wait_for_workers=True`).
    pub fn serve(
        port: u16,
        world_size: Option<usize>,
        timeout: Duration,
    ) -> Result<TcpStore, StoreError> {
        let server = TcpStoreServer::bind(port)?;
        let mut store = TcpStore::connect("127.0.0.1", server.port(), timeout)
            .or_else(|_| TcpStore::connect("::1", server.port(), timeout))?;
        store.server = Some(server);
        if let Some(n) = world_size {
            store.wait_for_workers(n)?;
        }
        Ok(store)
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port of the server this store runs, if it runs one.
    pub fn server_port(&self) -> Option<u16> {
        self.server.as_ref().map(TcpStoreServer::port)
    }

    /// The bound of every call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Counts this store in and, for the store that runs the server, waits until `world_size`
    /// have (`waitForWorkers`): "Timed out after … seconds waiting for clients. n/N clients
    /// joined." past the timeout.
    pub fn wait_for_workers(&self, world_size: usize) -> Result<(), StoreError> {
        self.count_in()?;
        if self.server.is_none() {
            return Ok(());
        }
        let start = Instant::now();
        loop {
            let joined = self.workers_joined()?;
            if joined >= world_size as i64 {
                return Ok(());
            }
            if start.elapsed() > self.timeout {
                return Err(StoreError::WorkersTimeout {
                    after: start.elapsed(),
                    joined: joined.max(0) as usize,
                    world_size,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Counts this store in (`init/` + 1: the first half of `waitForWorkers`, which every
    /// PyTorch store made with a world size does); returns how many have.
    pub fn count_in(&self) -> Result<i64, StoreError> {
        self.add_raw(INIT_KEY, 1)
    }

    /// How many stores counted themselves in so far (`init/`, which
    /// [`TcpStore::wait_for_workers`] counts on).
    pub fn workers_joined(&self) -> Result<i64, StoreError> {
        self.add_raw(INIT_KEY, 0)
    }

    fn prefixed(key: &str) -> Result<Vec<u8>, StoreError> {
        let k = format!("{KEY_PREFIX}{key}").into_bytes();
        check_len("key", k.len(), MAX_KEY_LEN)?;
        Ok(k)
    }

    fn prefixed_all(keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        check_len("key count", keys.len(), MAX_KEY_COUNT)?;
        keys.iter().map(|k| TcpStore::prefixed(k)).collect()
    }

    /// Sends `m` and reads its reply with `read`, within the store's timeout. A failure
    /// breaks the connection for later calls.
    fn call<T>(
        &self,
        what: &'static str,
        m: Message,
        read: impl FnOnce(&mut Reader<BufReader<TcpStream>>) -> std::io::Result<T>,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.lock();
        self.call_locked(&mut conn, what, &m, self.timeout, read)
    }

    fn call_locked<T>(
        &self,
        conn: &mut Conn,
        what: &'static str,
        m: &Message,
        timeout: Duration,
        read: impl FnOnce(&mut Reader<BufReader<TcpStream>>) -> std::io::Result<T>,
    ) -> Result<T, StoreError> {
        if let Some(why) = &conn.broken {
            return Err(StoreError::Broken(why.clone()));
        }
        let result = (|| {
            conn.writer.set_write_timeout(Some(timeout))?;
            m.send(&mut conn.writer)?;
            conn.reader.0.get_ref().set_read_timeout(Some(timeout))?;
            read(&mut conn.reader)
        })();
        result.map_err(|e| {
            let err = self.io_error(what, timeout, &e);
            conn.broken = Some(err.to_string());
            err
        })
    }

    fn io_error(&self, what: &'static str, timeout: Duration, e: &std::io::Error) -> StoreError {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => StoreError::Timeout {
                what,
                after: timeout,
                keys: Vec::new(),
            },
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
                StoreError::Closed {
                    addr: self.addr.to_string(),
                    what,
                }
            }
            _ => StoreError::Io(format!("{what}: {e}")),
        }
    }

    /// Sets `key` to `value` (`set`).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.put(Query::Set, "set", key, value)
    }

    /// Sends `query` with `key` and `value`, a query with no answer (`set`, `append`).
    fn put(
        &self,
        query: Query,
        what: &'static str,
        key: &str,
        value: &[u8],
    ) -> Result<(), StoreError> {
        check_len("value", value.len(), MAX_PAYLOAD_LEN)?;
        let m = Message::query(query)
            .bytes(&TcpStore::prefixed(key)?)
            .bytes(value);
        self.call(what, m, |_| Ok(()))
    }

    /// `key`'s value, once it is set (`get`: a wait for the key, then the read; the wait's
    /// timeout is the store's).
    pub fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let k = TcpStore::prefixed(key)?;
        let mut conn = self.conn.lock();
        self.wait_locked(&mut conn, std::slice::from_ref(&k), self.timeout)?;
        let m = Message::query(Query::Get).bytes(&k);
        self.call_locked(&mut conn, "get", &m, self.timeout, |r| {
            r.bytes(MAX_PAYLOAD_LEN)
        })
    }

    /// Adds `delta` to the number stored at `key` (0 if missing) and returns the sum
    /// (`add`). A value that is not a number makes the server close the connection
    /// ([`StoreError::Closed`]), as PyTorch's does.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.add_raw(&format!("{KEY_PREFIX}{key}"), delta)
    }

    fn add_raw(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        check_len("key", key.len(), MAX_KEY_LEN)?;
        let m = Message::query(Query::Add).bytes(key.as_bytes()).i64(delta);
        self.call("add", m, |r| r.i64())
    }

    /// Sets `key` to `desired` if it holds `expected` (or is missing and `expected` is
    /// empty); returns the value now (`compare_set`; for a missing key left missing, PyTorch
    /// answers `expected`, and so does this).
    pub fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        check_len("value", expected.len().max(desired.len()), MAX_PAYLOAD_LEN)?;
        let m = (Message::query(Query::CompareSet).bytes(&TcpStore::prefixed(key)?))
            .bytes(expected)
            .bytes(desired);
        self.call("compare_set", m, |r| r.bytes(MAX_PAYLOAD_LEN))
    }

    /// Whether every key is set (`check`), without waiting.
    pub fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let keys = TcpStore::prefixed_all(keys)?;
        let m = Message::query(Query::Check).keys(&keys);
        match self.call("check", m, |r| r.byte())? {
            READY => Ok(true),
            NOT_READY => Ok(false),
            b => Err(StoreError::Protocol(format!("check answered {b}"))),
        }
    }

    /// Waits until every key is set, for at most `timeout` (the store's if `None`): past it,
    /// the wait is cancelled on the server and the call is [`StoreError::Timeout`] naming
    /// the keys ("wait timeout after …ms, keys: …"); the store stays usable.
    pub fn wait(&self, keys: &[&str], timeout: Option<Duration>) -> Result<(), StoreError> {
        let keys = TcpStore::prefixed_all(keys)?;
        let mut conn = self.conn.lock();
        self.wait_locked(&mut conn, &keys, timeout.unwrap_or(self.timeout))
    }

    /// `doWait`: the wait query, its answer within `timeout`, else `CANCEL_WAIT` and its
    /// answer (a `STOP_WAITING` that crossed the cancel first is read and dropped).
    fn wait_locked(
        &self,
        conn: &mut Conn,
        keys: &[Vec<u8>],
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let m = Message::query(Query::Wait).keys(keys);
        let answer = self.call_locked(conn, "wait", &m, timeout, |r| r.byte());
        match answer {
            Ok(STOP_WAITING) => return Ok(()),
            Ok(b) => {
                let e = StoreError::Protocol(format!("Stop_waiting response is expected, got {b}"));
                conn.broken = Some(e.to_string());
                return Err(e);
            }
            Err(StoreError::Timeout { .. }) => conn.broken = None,
            Err(e) => return Err(e),
        }
        let cancel = Message::query(Query::CancelWait);
        let mut reply =
            self.call_locked(conn, "cancel_wait", &cancel, self.timeout, |r| r.byte())?;
        if reply == STOP_WAITING {
            reply = self.call_locked(
                conn,
                "cancel_wait",
                &Message::default(),
                self.timeout,
                |r| r.byte(),
            )?;
        }
        if reply != WAIT_CANCELED {
            let e =
                StoreError::Protocol(format!("wait_canceled response is expected, got {reply}"));
            conn.broken = Some(e.to_string());
            return Err(e);
        }
        Err(StoreError::Timeout {
            what: "wait",
            after: timeout,
            keys: keys
                .iter()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .collect(),
        })
    }

    /// Deletes `key`; whether it was there (`delete_key`).
    pub fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        let m = Message::query(Query::DeleteKey).bytes(&TcpStore::prefixed(key)?);
        Ok(self.call("delete_key", m, |r| r.i64())? == 1)
    }

    /// Keys the server holds (`num_keys`; counts `init/` and every client's keys).
    pub fn num_keys(&self) -> Result<i64, StoreError> {
        self.call("num_keys", Message::query(Query::GetNumKeys), |r| r.i64())
    }

    /// Appends `value` to `key`'s value (setting it if missing: `append`).
    pub fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.put(Query::Append, "append", key, value)
    }

    /// The values of `keys`, once all are set (`multi_get`).
    pub fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        let keys = TcpStore::prefixed_all(keys)?;
        let mut conn = self.conn.lock();
        self.wait_locked(&mut conn, &keys, self.timeout)?;
        let m = Message::query(Query::MultiGet).keys(&keys);
        let n = keys.len();
        self.call_locked(&mut conn, "multi_get", &m, self.timeout, |r| {
            (0..n).map(|_| r.bytes(MAX_PAYLOAD_LEN)).collect()
        })
    }

    /// Sets each key to its value (`multi_set`).
    pub fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<(), StoreError> {
        if keys.len() != values.len() {
            return Err(StoreError::Protocol(
                "multiSet keys and values vectors must be of same size".into(),
            ));
        }
        let keys = TcpStore::prefixed_all(keys)?;
        let mut m = Message::query(Query::MultiSet).i64(keys.len() as i64);
        for (k, v) in keys.iter().zip(values) {
            check_len("value", v.len(), MAX_PAYLOAD_LEN)?;
            m = m.bytes(k).bytes(v);
        }
        self.call("multi_set", m, |_| Ok(()))
    }
}
