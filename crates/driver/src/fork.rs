//! Fork safety, as PyTorch keeps it (`poison_fork` in `torch/csrc/cuda/Module.cpp`).
//!
//! A child forked from a process that has initialised CUDA inherits the parent's driver
//! state but not its threads: a CUDA call in the child is undefined behaviour. PyTorch
//! registers a `pthread_atfork` child handler when CUDA is first initialised; the handler
//! marks the child a "bad fork", and every lazy initialisation in it raises "Cannot
//! re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must use
//! the 'spawn' start method". A child forked before that point is an ordinary process and
//! may initialise CUDA itself.
//!
//! Both drivers do the same, at their initialisation: [`CudaDriver`](crate::CudaDriver)
//! before `cuInit`, [`FakeDriver`](crate::FakeDriver) at its first driver act (it models a
//! CUDA process, so CI checks the behaviour). [`in_bad_fork`] is the mark; in a bad fork every
//! driver call of either backend fails with [`DriverError::BAD_FORK`](crate::DriverError::BAD_FORK),
//! whatever driver object it is made on. [`fork_and_wait`] forks from Rust, for programs and
//! tests that need what Python's `multiprocessing` "fork" start method does.
use std::io;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};

static IN_BAD_FORK: AtomicBool = AtomicBool::new(false);
static POISON: Once = Once::new();

/// The child handler: one atomic store, which is async-signal-safe.
extern "C" fn forked_child() {
    IN_BAD_FORK.store(true, Ordering::Relaxed);
}

/// Marks this process as one that has initialised CUDA: a child forked from now on is a bad
/// fork (PyTorch's `poison_fork`). Called by the drivers before they initialise.
pub(crate) fn poison_fork() {
    POISON.call_once(|| {
        // SAFETY: registers a plain `extern "C" fn` that lives as long as the process and
        // only stores to an atomic. It fails only without memory for the handler (ENOMEM);
        // PyTorch ignores that too, as nothing better can be done.
        let _ = unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
    });
}

/// Whether this process is a child forked after CUDA was initialised in its parent
/// (PyTorch's `torch._C._cuda_isInBadFork()`). Every driver call in it fails with
/// [`DriverError::BAD_FORK`](crate::DriverError::BAD_FORK).
pub fn in_bad_fork() -> bool {
    IN_BAD_FORK.load(Ordering::Relaxed)
}

/// Forks this process, runs `child` in the child (its return value is the child's exit
/// code; a panic is 101) and returns that code once the child has exited.
///
/// Refused, with nothing forked, unless the process has a single thread: a child of a
/// multi-threaded process inherits locks that other threads held (the allocator's, the
/// standard library's), which is why safe Rust has no `fork`. Threads are counted in
/// `/proc/self/task` (Linux).
pub fn fork_and_wait(child: impl FnOnce() -> i32) -> io::Result<i32> {
    let threads = std::fs::read_dir("/proc/self/task")?.count();
    if threads != 1 {
        return Err(io::Error::other(format!(
            "fork refused: this process has {threads} threads, and only a single-threaded \
             process can fork safely"
        )));
    }
    // Output buffered before the fork would otherwise be written twice.
    flush_std_streams();
    // SAFETY: the process has one thread (counted above; only this thread could have
    // started another since), so the child inherits no lock held by another thread and may
    // run any code; the parent only waits for it.
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        0 => {
            let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).unwrap_or(101);
            flush_std_streams();
            // SAFETY: ends the child at once: the parent's exit handlers are the parent's.
            unsafe { libc::_exit(code) }
        }
        pid => wait_for(pid),
    }
}

fn flush_std_streams() {
    use std::io::Write;
    let _ = io::stdout().flush();
    let _ = io::stderr().flush();
}

/// Waits for the child `pid` and returns its exit code; a child killed by a signal is an
/// error naming the signal.
fn wait_for(pid: libc::pid_t) -> io::Result<i32> {
    let mut status = 0;
    // SAFETY: waits for our own child; writes its status through a valid pointer.
    while unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    if libc::WIFEXITED(status) {
        Ok(libc::WEXITSTATUS(status))
    } else {
        Err(io::Error::other(format!(
            "the forked child was killed by signal {}",
            libc::WTERMSIG(status)
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test process has the harness's threads, and this test adds one of its own: the
    /// fork is refused and nothing runs in a child. (The forks that run are in
    /// `tests/fork_process.rs`, a single-threaded program.)
    #[test]
    fn a_multi_threaded_process_is_refused() {
        let (ready, wait) = std::sync::mpsc::channel();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || {
            let _ = ready.send(());
            let _ = stopped.recv();
        });
        wait.recv().unwrap();
        let mut ran = false;
        let err = fork_and_wait(|| {
            ran = true;
            0
        })
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("fork refused: this process has "),
            "{err}"
        );
        assert!(!ran);
        drop(stop);
        other.join().unwrap();
    }
}
