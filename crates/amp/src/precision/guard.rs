//! The thread-local "disable fp32 reduced precision" flag (`NoTF32Guard` in
//! `aten/src/ATen/Context.cpp`): ops where TF32 costs accuracy and buys no speed hold it.
use std::cell::Cell;
use std::marker::PhantomData;

thread_local! {
    static DISABLED: Cell<bool> = const { Cell::new(false) };
}

/// While alive, fp32 GEMMs on this thread do not use reduced precision (see
/// [`cublas_handle_math_mode`](super::cublas_handle_math_mode)). Nested guards are no-ops;
/// the guard that set the flag clears it.
#[derive(Debug)]
#[must_use = "the flag clears when the guard drops"]
pub struct NoTf32Guard {
    set_it: bool,
    _thread_bound: PhantomData<*const ()>,
}

impl NoTf32Guard {
    /// Sets the flag on this thread.
    pub fn new() -> NoTf32Guard {
        let set_it = !DISABLED.with(|d| d.replace(true));
        NoTf32Guard {
            set_it,
            _thread_bound: PhantomData,
        }
    }
}

impl Default for NoTf32Guard {
    fn default() -> Self {
        NoTf32Guard::new()
    }
}

impl Drop for NoTf32Guard {
    fn drop(&mut self) {
        if self.set_it {
            DISABLED.with(|d| d.set(false));
        }
    }
}

/// Whether a [`NoTf32Guard`] is alive on this thread.
pub fn reduced_precision_disabled() -> bool {
    DISABLED.with(Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_guards_clear_at_the_outer_drop() {
        assert!(!reduced_precision_disabled());
        let outer = NoTf32Guard::new();
        {
            let _inner = NoTf32Guard::new();
            assert!(reduced_precision_disabled());
        }
        assert!(reduced_precision_disabled());
        drop(outer);
        assert!(!reduced_precision_disabled());
        let seen_elsewhere = std::thread::scope(|s| {
            let _g = NoTf32Guard::new();
            s.spawn(reduced_precision_disabled).join().ok()
        });
        assert_eq!(seen_elsewhere, Some(false));
    }
}
