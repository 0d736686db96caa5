//! A key-value store that speaks PyTorch's c10d `TCPStore` protocol, server and client: how
//! ranks started by torchrun find each other and share NCCL's unique id. A ferrocuda rank
//! and a PyTorch rank share one store: either side may run the server, and a ferrocuda
//! worker started by `torchrun` connects to the store torchrun's agent made.
//!
//! - [`TcpStoreServer`]: the server (`TCPStore(..., is_master=True)`'s daemon).
//! - [`TcpStore`]: a client, with PyTorch's semantics (`/`-prefixed keys, `get` waits,
//!   `wait` with a timeout that cancels on the server); [`TcpStore::serve`] runs the
//!   server as well.
//!
//! Every call is bounded by a timeout: a server that never answers, a key never set, a
//! port nobody listens on are [`StoreError`]s within it, never a hang.
mod client;
mod server;
mod wire;

pub use client::TcpStore;
pub use server::TcpStoreServer;

use std::time::Duration;

/// What can go wrong with a store.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The server could not listen on the port (in use, or not allowed).
    #[error("The server socket has failed to bind on port {port}: {message}")]
    Bind {
        /// The port.
        port: u16,
        /// The system's reason.
        message: String,
    },
    /// No server accepted a connection within the timeout.
    #[error("TCP client failed to connect to {addr}: {message}")]
    Connect {
        /// `host:port`.
        addr: String,
        /// Why.
        message: String,
    },
    /// A call did not complete within its timeout: PyTorch's "wait timeout after …ms,
    /// keys: …" for a wait (or a `get`, which waits), a reply that did not come otherwise.
    #[error("{what} timeout after {}ms{}", after.as_millis(), keys_text(keys))]
    Timeout {
        /// The call.
        what: &'static str,
        /// Its timeout.
        after: Duration,
        /// The keys waited for, as the server names them (with the `/` prefix).
        keys: Vec<String>,
    },
    /// `wait_for_workers` ran out of time.
    #[error(
        "Timed out after {} seconds waiting for clients. {joined}/{world_size} clients joined.",
        after.as_secs()
    )]
    WorkersTimeout {
        /// How long it waited.
        after: Duration,
        /// Stores counted in.
        joined: usize,
        /// Stores expected.
        world_size: usize,
    },
    /// The server closed the connection (it went away, or refused a query: PyTorch's server
    /// closes a connection on a malformed query or an `add` to a value that is not a number).
    #[error("the store server at {addr} closed the connection during {what}")]
    Closed {
        /// The server.
        addr: String,
        /// The call.
        what: &'static str,
    },
    /// An earlier call failed part-way, leaving the connection out of step; connect again.
    #[error("the store connection is broken by an earlier failure: {0}")]
    Broken(String),
    /// A key, value or key count over the server's limits (it would close the connection).
    #[error("{what} of {len} exceeds the store's limit of {max}")]
    TooLarge {
        /// Key, value or key count.
        what: &'static str,
        /// Its size.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An answer the protocol does not allow.
    #[error("store protocol: {0}")]
    Protocol(String),
    /// Another socket error.
    #[error("store socket: {0}")]
    Io(String),
}

fn keys_text(keys: &[String]) -> String {
    if keys.is_empty() {
        String::new()
    } else {
        format!(", keys: {}", keys.join(", "))
    }
}

impl StoreError {
    pub(crate) fn io(e: std::io::Error) -> StoreError {
        StoreError::Io(e.to_string())
    }
}
