//! A cache hint for the host side: [`prefetch`] asks the CPU to start loading a line that
//! the caller will read soon. The allocator's `free` starts its lookup's loads with it
//! before it takes the allocator's lock, so that they overlap the lock's atomic operation
//! (a locked instruction holds back the loads after it on x86) instead of following it.

/// Starts loading the cache line at `addr` into the nearest cache, if the CPU will: a hint
/// that reads nothing the program sees and never faults, whatever `addr` is (a stale or
/// made-up address costs at most a wasted load). A no-op where no such instruction is
/// known.
#[inline(always)]
pub fn prefetch(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has; PREFETCHh reads no
    // memory the program observes and does not fault on any address (Intel SDM, PREFETCHh:
    // "does not affect program behavior"), so an arbitrary address is sound.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(addr as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

#[cfg(test)]
mod tests {
    use super::prefetch;

    /// Addresses no program may read (null, unmapped, the top of the address space, freed
    /// memory) are hints like any other: none faults.
    #[test]
    fn any_address_is_safe_to_prefetch() {
        let freed = Box::new([7u8; 4096]);
        let addr = freed.as_ptr() as usize;
        drop(freed);
        for a in [0, 1, 4096, usize::MAX, usize::MAX - 63, 1 << 47, addr] {
            prefetch(a);
        }
        let live = [1u64; 8];
        prefetch(live.as_ptr() as usize);
        assert_eq!(
            live.iter().sum::<u64>(),
            8,
            "a prefetch changes nothing it touches"
        );
    }
}
