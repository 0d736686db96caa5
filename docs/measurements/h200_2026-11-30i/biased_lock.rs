//! A mutual-exclusion lock biased toward one thread: while one thread takes it again and
//! again with no other thread asking, its lock and unlock are plain loads and stores, with
//! no atomic read-modify-write. For the caching allocator's lock, whose single-threaded
//! callers (a training loop, a server's one worker) otherwise pay a compare-and-swap on
//! every operation; on the H200 host that is about 10 ns of a 65 ns allocator operation,
//! and a locked instruction also waits for every store of the previous operation to leave
//! the core.
//!
//! # How it works
//! Every thread but the bias owner takes an ordinary spin lock. The owner instead announces
//! itself in its own flag, then looks whether it is still the owner; a thread that wants the
//! lock withdraws the bias, then looks whether the owner is inside. This is Dekker's
//! handshake, and it needs a full memory barrier on both sides between the store and the
//! load. The owner's side gets only a compiler barrier; the other side issues
//! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`, which makes every running thread of the
//! process execute a full barrier before it returns (the asymmetric fences of folly's
//! `AsymmetricThreadFence` and of C++ proposal P1202). Withdrawing the bias therefore costs a
//! system call and an interrupt of the process's other running threads (microseconds), so:
//! - the bias goes to a thread only after it took the ordinary lock [`BIAS_AFTER`] times in
//!   a row with no other thread taking it in between, and each withdrawal doubles that
//!   count (up to [`BIAS_AFTER_MAX`]): threads that share the lock keep the ordinary one;
//! - a withdrawal is permanent until the streak is earned again.
//!
//! Each owner has its own flag (one of [`OWNERS`] per lock, kept for its thread for the
//! lock's life): a former owner delayed between its announcement and its look writes only
//! its own flag, never the one of the thread the bias moved to. After [`OWNERS`] distinct
//! threads the lock stays ordinary. Where `membarrier` is missing (a kernel before 4.14, a
//! sandbox that refuses it, another operating system) no bias is ever given.
//!
//! Under `--cfg loom` both fences are sequentially consistent fences (which the asymmetric
//! pair is equivalent to) and `loom_model` checks mutual exclusion under every interleaving
//! loom explores (`cargo xtask loom`).
use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use sync::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// The atomics of the protocol: the standard ones, or loom's under `--cfg loom`.
mod sync {
    #[cfg(loom)]
    pub(super) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
    #[cfg(not(loom))]
    pub(super) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
}

/// Consecutive ordinary acquisitions by one thread that earn it the bias, at first.
pub const BIAS_AFTER: u32 = 64;

/// The most consecutive acquisitions a bias ever needs (reached after withdrawals).
pub const BIAS_AFTER_MAX: u32 = 1 << 20;

/// Distinct threads a lock is ever biased to.
pub const OWNERS: usize = 4;

/// No bias (the value of [`BiasedMutex::bias`]).
const UNBIASED: u64 = 0;

/// A lock biased toward the thread that takes it most (see the module's text).
pub struct BiasedMutex<T> {
    /// The owner: its thread's id shifted left by 8, or'ed with its flag's index + 1; or
    /// [`UNBIASED`]. Set only by the holder of the ordinary lock, to its own thread.
    bias: AtomicU64,
    /// Per owner: its thread's id (0: free) and whether it is inside. A flag is written
    /// only by its thread.
    owner_thread: [AtomicU64; OWNERS],
    owner_inside: [AtomicBool; OWNERS],
    /// The ordinary lock.
    locked: AtomicBool,
    /// The thread that took the ordinary lock last, how many times in a row, and how many
    /// earn the bias now (read and written with the ordinary lock held).
    streak_thread: AtomicU64,
    streak: AtomicU32,
    bias_after: AtomicU32,
    data: UnsafeCell<T>,
}

// SAFETY: the lock hands out `&mut T` to one thread at a time (the module's protocol), so
// sharing the lock between threads needs only that `T` may move between them.
unsafe impl<T: Send> Sync for BiasedMutex<T> {}
// SAFETY: the lock owns its `T`; moving it moves the `T`.
unsafe impl<T: Send> Send for BiasedMutex<T> {}

/// How a guard holds the lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// As its owner, through flag `usize`.
    Owner(usize),
    /// Through the ordinary lock.
    Ordinary,
}

/// The lock, held: the value is reachable through it; dropping it unlocks.
pub struct BiasedMutexGuard<'a, T> {
    lock: &'a BiasedMutex<T>,
    held: Held,
}

impl<T> BiasedMutex<T> {
    pub fn new(value: T) -> BiasedMutex<T> {
        BiasedMutex::with_bias_after(value, BIAS_AFTER)
    }

    /// A lock whose first bias needs `bias_after` consecutive acquisitions (tests).
    fn with_bias_after(value: T, bias_after: u32) -> BiasedMutex<T> {
        BiasedMutex {
            bias: AtomicU64::new(UNBIASED),
            owner_thread: std::array::from_fn(|_| AtomicU64::new(0)),
            owner_inside: std::array::from_fn(|_| AtomicBool::new(false)),
            locked: AtomicBool::new(false),
            streak_thread: AtomicU64::new(0),
            streak: AtomicU32::new(0),
            bias_after: AtomicU32::new(bias_after.max(1)),
            data: UnsafeCell::new(value),
        }
    }

    /// Takes the lock, waiting (yielding the processor between looks) while another thread
    /// holds it.
    #[inline(always)]
    pub fn lock(&self) -> BiasedMutexGuard<'_, T> {
        if let Some(g) = self.lock_as_owner() {
            return g;
        }
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            while self.locked.load(Ordering::Relaxed) {
                yield_now();
            }
        }
        self.ordinary_taken()
    }

    /// Takes the lock if no other thread holds it now (a bias held by another thread that
    /// is outside is withdrawn: that waits only for its current look to end).
    #[inline(always)]
    pub fn try_lock(&self) -> Option<BiasedMutexGuard<'_, T>> {
        if let Some(g) = self.lock_as_owner() {
            return Some(g);
        }
        if self.locked.load(Ordering::Relaxed)
            || self
                .locked
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return None;
        }
        Some(self.ordinary_taken())
    }

    /// Whether the lock is biased to the calling thread now (tests and benches).
    pub fn biased_to_caller(&self) -> bool {
        owner_of(self.bias.load(Ordering::Relaxed)).is_some_and(|(t, _)| t == thread_id())
    }

    /// The owner's way in: announce, fence, look again (see the module's text). `None`
    /// when the calling thread is not the owner, or stopped being it.
    #[inline(always)]
    fn lock_as_owner(&self) -> Option<BiasedMutexGuard<'_, T>> {
        let bias = self.bias.load(Ordering::Relaxed);
        if bias == UNBIASED {
            return None;
        }
        let me = thread_id();
        let (thread, flag) = owner_of(bias)?;
        if thread != me {
            return None;
        }
        self.owner_inside[flag].store(true, Ordering::Relaxed);
        light_fence();
        if self.bias.load(Ordering::Relaxed) == bias {
            // (No acquire is needed: this thread set the bias itself, holding the ordinary
            // lock, after every other thread's last access; none came in since.)
            return Some(BiasedMutexGuard {
                lock: self,
                held: Held::Owner(flag),
            });
        }
        self.owner_inside[flag].store(false, Ordering::Release);
        None
    }

    /// With the ordinary lock just taken: withdraws another thread's bias (waiting until
    /// that thread is outside), counts the streak, and gives the bias to this thread once
    /// it has earned it.
    fn ordinary_taken(&self) -> BiasedMutexGuard<'_, T> {
        let me = thread_id();
        if let Some((_, flag)) = owner_of(self.bias.load(Ordering::Relaxed)) {
            self.withdraw(flag);
        }
        let streak = if self.streak_thread.load(Ordering::Relaxed) == me {
            self.streak.load(Ordering::Relaxed) + 1
        } else {
            self.streak_thread.store(me, Ordering::Relaxed);
            1
        };
        self.streak.store(streak, Ordering::Relaxed);
        if streak >= self.bias_after.load(Ordering::Relaxed)
            && heavy_fence_available()
            && let Some(flag) = self.flag_of(me)
        {
            // (This thread's own flag is false: it is here, not inside as owner.)
            self.bias.store((me << 8) | (flag as u64 + 1), Ordering::Relaxed);
        }
        BiasedMutexGuard {
            lock: self,
            held: Held::Ordinary,
        }
    }

    /// Withdraws the bias from the owner with flag `flag` (the ordinary lock held): once
    /// this returns, the owner is outside and will not come in as owner again.
    #[cold]
    #[inline(never)]
    fn withdraw(&self, flag: usize) {
        self.bias.store(UNBIASED, Ordering::Relaxed);
        heavy_fence();
        while self.owner_inside[flag].load(Ordering::Acquire) {
            yield_now();
        }
        let after = self.bias_after.load(Ordering::Relaxed);
        self.bias_after
            .store((after.saturating_mul(2)).min(BIAS_AFTER_MAX), Ordering::Relaxed);
        self.streak.store(0, Ordering::Relaxed);
    }

    /// The flag kept for thread `me`, claiming a free one if it has none.
    fn flag_of(&self, me: u64) -> Option<usize> {
        if let Some(i) = (0..OWNERS).find(|&i| self.owner_thread[i].load(Ordering::Relaxed) == me) {
            return Some(i);
        }
        let free = (0..OWNERS).find(|&i| self.owner_thread[i].load(Ordering::Relaxed) == 0)?;
        self.owner_thread[free].store(me, Ordering::Relaxed);
        Some(free)
    }

    /// The value, for a caller that owns the lock outright.
    pub fn get_mut(&mut self) -> &mut T {
        self.data.get_mut()
    }
}

impl<T: Default> Default for BiasedMutex<T> {
    fn default() -> BiasedMutex<T> {
        BiasedMutex::new(T::default())
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for BiasedMutex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BiasedMutex")
            .field("biased", &(self.bias.load(Ordering::Relaxed) != UNBIASED))
            .finish_non_exhaustive()
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for BiasedMutexGuard<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BiasedMutexGuard")
            .field("value", &**self)
            .field("as_owner", &matches!(self.held, Held::Owner(_)))
            .finish()
    }
}

impl<T> Deref for BiasedMutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock (as owner or through the ordinary lock), so no
        // other thread reaches the value until it is dropped.
        unsafe { &*self.lock.data.get() }
    }
}

impl<T> DerefMut for BiasedMutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference from the guard.
        unsafe { &mut *self.lock.data.get() }
    }
}

impl<T> Drop for BiasedMutexGuard<'_, T> {
    #[inline(always)]
    fn drop(&mut self) {
        match self.held {
            Held::Owner(flag) => self.lock.owner_inside[flag].store(false, Ordering::Release),
            Held::Ordinary => self.lock.locked.store(false, Ordering::Release),
        }
    }
}

/// The owner's thread and flag in a bias value.
#[inline(always)]
fn owner_of(bias: u64) -> Option<(u64, usize)> {
    (bias != UNBIASED).then(|| (bias >> 8, (bias & 0xff) as usize - 1))
}

/// The calling thread's id: never 0, never reused in the process.
#[cfg(not(loom))]
#[inline(always)]
fn thread_id() -> u64 {
    use std::cell::Cell;
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    thread_local! {
        static ID: Cell<u64> = const { Cell::new(0) };
    }
    ID.with(|id| match id.get() {
        0 => {
            let new = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            id.set(new);
            new
        }
        known => known,
    })
}

/// Under loom all model threads share one OS thread: the id comes from loom's own.
#[cfg(loom)]
fn thread_id() -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    loom::thread::current().id().hash(&mut h);
    (h.finish() >> 8) | 1
}

#[cfg(not(loom))]
fn yield_now() {
    std::thread::yield_now();
}

#[cfg(loom)]
fn yield_now() {
    loom::thread::yield_now();
}

/// The owner's side of the asymmetric fence: only the compiler may not move accesses
/// across it; the heavy side makes the processor's part.
#[cfg(not(loom))]
#[inline(always)]
fn light_fence() {
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
}

#[cfg(loom)]
fn light_fence() {
    loom::sync::atomic::fence(Ordering::SeqCst);
}

#[cfg(loom)]
fn heavy_fence_available() -> bool {
    true
}

#[cfg(loom)]
fn heavy_fence() {
    loom::sync::atomic::fence(Ordering::SeqCst);
}

/// `membarrier`'s commands (`linux/membarrier.h`; the `libc` crate does not name them).
#[cfg(all(not(loom), target_os = "linux"))]
mod membarrier {
    pub(super) const QUERY: libc::c_long = 0;
    pub(super) const PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
    pub(super) const REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

    pub(super) fn call(cmd: libc::c_long) -> libc::c_long {
        // SAFETY: `membarrier(cmd, flags = 0, cpu_id = 0)` reads and writes no memory of
        // ours; an unknown or refused command is an error return.
        unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_long, 0 as libc::c_long) }
    }
}

/// Whether the heavy fence works here: asked and registered once per process.
#[cfg(not(loom))]
fn heavy_fence_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(target_os = "linux")]
        {
            let supported = membarrier::call(membarrier::QUERY);
            supported >= 0
                && supported & membarrier::PRIVATE_EXPEDITED != 0
                && membarrier::call(membarrier::REGISTER_PRIVATE_EXPEDITED) == 0
        }
        #[cfg(not(target_os = "linux"))]
        false
    })
}

/// The other side's fence: every running thread of the process executes a full barrier
/// before this returns. Called only after [`heavy_fence_available`] said yes (a bias is
/// given only then); the kernel then has no reason to refuse, and were it to, the call is
/// repeated rather than the handshake trusted without it.
#[cfg(not(loom))]
fn heavy_fence() {
    #[cfg(target_os = "linux")]
    while membarrier::call(membarrier::PRIVATE_EXPEDITED) != 0 {
        std::thread::yield_now();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn one_thread_earns_the_bias_and_keeps_its_value() {
        let lock = BiasedMutex::new(0u64);
        for _ in 0..BIAS_AFTER + 10 {
            *lock.lock() += 1;
        }
        assert_eq!(*lock.lock(), u64::from(BIAS_AFTER) + 10);
        assert_eq!(lock.biased_to_caller(), heavy_fence_available());
        assert!(lock.try_lock().is_some());
    }

    #[test]
    fn another_thread_withdraws_the_bias_and_the_count_stays_exact() {
        let lock = Arc::new(BiasedMutex::with_bias_after(0u64, 2));
        for _ in 0..10 {
            *lock.lock() += 1;
        }
        let other = lock.clone();
        std::thread::spawn(move || {
            *other.lock() += 1;
            assert!(!other.biased_to_caller());
        })
        .join()
        .expect("thread");
        assert!(!lock.biased_to_caller(), "withdrawn");
        assert_eq!(*lock.lock(), 11);
        // The streak needed doubled (2 → 4): the read above and two more make three, not
        // enough; a fourth earns it.
        for _ in 0..2 {
            *lock.lock() += 1;
        }
        assert!(!lock.biased_to_caller() || !heavy_fence_available());
        *lock.lock() += 1;
        assert_eq!(lock.biased_to_caller(), heavy_fence_available());
        assert_eq!(*lock.lock(), 14);
    }

    #[test]
    fn try_lock_fails_while_another_thread_holds_it_either_way() {
        let lock = Arc::new(BiasedMutex::with_bias_after(0u64, 1));
        let g = lock.lock();
        let other = lock.clone();
        assert!(std::thread::spawn(move || other.try_lock().is_none()).join().expect("thread"));
        drop(g);
        *lock.lock() += 1; // biased now (where the fence is available)
        let g = lock.lock();
        let other = lock.clone();
        // The owner is inside: the other thread's try withdraws the bias, then waits for
        // the owner to leave; it must not get in while the guard lives.
        let handle = std::thread::spawn(move || other.try_lock().map(|mut g| *g += 10).is_some());
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(*g, 1, "nobody else got in while the owner held it");
        drop(g);
        // Biased, the other thread's try waited for the owner to leave; unbiased, the
        // owner held the ordinary lock and the try failed.
        let biased = heavy_fence_available();
        assert_eq!(handle.join().expect("thread"), biased);
        assert_eq!(*lock.lock(), if biased { 11 } else { 1 });
    }

    /// Threads that take turns in bursts (each earns the bias, then loses it to the next)
    /// never overlap: a counter bumped non-atomically in two halves stays exact.
    #[test]
    fn bursts_from_many_threads_never_overlap() {
        const THREADS: u64 = 6;
        const ROUNDS: u64 = 2_000;
        let lock = Arc::new(BiasedMutex::with_bias_after((0u64, 0u64), 1));
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let lock = lock.clone();
                s.spawn(move || {
                    for i in 0..ROUNDS {
                        // Bursts of 1 to 40 in a row, so bias changes hands often.
                        for _ in 0..(1 + (i * 7 + t * 13) % 40) {
                            let mut g = lock.lock();
                            let half = g.0;
                            g.0 = half + 1;
                            std::hint::black_box(&mut *g);
                            g.1 += 1;
                            assert_eq!(g.0, g.1, "two holders at once");
                        }
                    }
                });
            }
        });
        let g = lock.lock();
        let expected: u64 = (0..THREADS)
            .map(|t| (0..ROUNDS).map(|i| 1 + (i * 7 + t * 13) % 40).sum::<u64>())
            .sum();
        assert_eq!((g.0, g.1), (expected, expected));
    }
}

#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use loom::cell::UnsafeCell as LoomCell;
    use loom::sync::Arc;

    /// A value loom watches for unsynchronized access, beside the lock that guards it.
    struct Guarded {
        lock: BiasedMutex<()>,
        value: LoomCell<u64>,
    }

    fn bump(g: &Guarded) {
        let _held = g.lock.lock();
        g.value.with_mut(|v| {
            // SAFETY: loom checks that no other thread touches the cell meanwhile.
            unsafe { *v += 1 }
        });
    }

    /// The main thread earns the bias (one acquisition suffices here) and takes the lock
    /// again while another thread withdraws it: never both inside.
    #[test]
    fn loom_model_owner_and_withdrawer() {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(|| {
            let g = Arc::new(Guarded {
                lock: BiasedMutex::with_bias_after((), 1),
                value: LoomCell::new(0),
            });
            bump(&g); // biased to this thread now
            let other = g.clone();
            let t = loom::thread::spawn(move || bump(&other));
            bump(&g);
            t.join().expect("thread");
            bump(&g);
            g.value.with(|v| {
                // SAFETY: every other thread has been joined.
                assert_eq!(unsafe { *v }, 4)
            });
        });
    }

    /// The bias moves to a second thread while the first, its former owner, comes back:
    /// the former owner's late steps touch only its own flag.
    #[test]
    fn loom_model_bias_moves_between_threads() {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(2);
        builder.check(|| {
            let g = Arc::new(Guarded {
                lock: BiasedMutex::with_bias_after((), 1),
                value: LoomCell::new(0),
            });
            bump(&g); // biased to the main thread
            let other = g.clone();
            let t = loom::thread::spawn(move || {
                bump(&other); // withdraws, and is biased to after
                bump(&other);
            });
            bump(&g);
            t.join().expect("thread");
            g.value.with(|v| {
                // SAFETY: every other thread has been joined.
                assert_eq!(unsafe { *v }, 4)
            });
        });
    }
}
