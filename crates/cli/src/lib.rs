//! The `ferrocuda` command's library: reading PyTorch memory snapshots and replaying their
//! allocation traces through ferrocuda's caching allocator on the fake device, so allocator
//! settings can be compared on a real workload without a GPU, or on the GPU itself, timed as
//! PyTorch's own replay times PyTorch's allocator.
//!
//! # Design choices
//! - A replay allocates on the trace's streams, frees at `free_completed` (a block whose
//!   free was only requested is still in use), and ignores PyTorch's own `segment_*` events:
//!   the segments are ours to decide.
//! - The fake device keeps no bytes (`backing(false)`): a 60 GiB trace costs no host memory.
//! - After every replay the allocator's books are checked against a recount of its blocks.
//! - Real snapshots share objects (PyTorch writes each stack once and refers to it again
//!   through the pickle's memo): the reader ([`unpickle`]) keeps a reference as a reference,
//!   as Python's `pickle.load` does, never a copy, and keeps the history as compact records
//!   ([`recording`]: 48 bytes an event), so a two-million-event trace reads in a few
//!   hundred megabytes.
//! - Files are hostile until read ([`input`]): decompressed as they are decoded, with caps
//!   on decompressed bytes, string bytes and values held ([`input::Limits`], raised by
//!   `--max-bytes`) checked while reading; no recursion anywhere, so nesting depth costs
//!   nothing; errors name the place (`event 3 of device 0 (device_traces[0][3]), field
//!   size`); a file with neither `device_traces` nor `segments`, or a size above 2^50, is
//!   refused.
//! - Options are checked before any file is read ([`options`]): `--capacity` with units and
//!   a range, every `--conf` (or the environment's configuration) parsed, the fake device's
//!   options refused with `--device cuda`, and CUDA's availability asked.
//! - Each device of a trace is replayed on a fake device of its own: PyTorch's allocators
//!   are per device, so merging them would invent out-of-memory errors. On the GPU
//!   (`--device cuda`) each is replayed on device 0 in turn, with an allocator of its own.
//! - The clock covers only the allocator's `allocate` and `free` calls (and the driver calls
//!   they make): the trace is turned into steps on dense slots and its streams are created
//!   before it starts ([`replay::replay_with`]), as `shared/tools/torch_replay.py` prepares
//!   PyTorch's replay, so the two times per event compare like with like.
//! - PyTorch's figures are shown beside ours when known ([`pytorch`]), compared per parsed
//!   configuration.
//!
//! # What the layer above is responsible for
//! The command (`main.rs`) ends every failure with one `ferrocuda: ...` line and exit code
//! 1, and a closed stdout pipe quietly; nothing here prints.
#![forbid(unsafe_code)]

pub mod graph_plan;
pub mod input;
pub mod options;
pub mod pytorch;
pub mod recording;
pub mod replay;
pub mod report;
pub mod sites;
pub mod trace;
pub mod unpickle;
