//! Putting the calling thread's current context back: the exported C functions
//! (`crate::c_export`) run on PyTorch's threads, whose current context is PyTorch's current
//! device. A driver act for another device binds that device's context ([`CudaDriver`]'s
//! `bind`); inside a [`ContextScope`] the context it replaced is remembered, and put back
//! when the outermost scope of the thread ends. Nothing is asked of libcuda when no act
//! switched contexts.
//!
//! [`CudaDriver`]: super::CudaDriver
use cudarc::driver::sys;
use std::cell::Cell;

thread_local! {
    /// Open scopes on this thread, and the context to put back (its address; 0 is none
    /// bound) once an act switched.
    static SCOPE: Cell<(u32, Option<usize>)> = const { Cell::new((0, None)) };
}

/// While one lives on a thread, context switches made by the driver are undone when the
/// outermost one drops. (A thread whose thread-locals are gone, one freeing memory in its
/// own exit, gets an inactive scope.)
#[derive(Debug)]
pub(crate) struct ContextScope {
    active: bool,
    /// Not `Send`: the scope belongs to the thread's context.
    _thread: std::marker::PhantomData<*const ()>,
}

impl ContextScope {
    pub(crate) fn enter() -> ContextScope {
        let active = SCOPE
            .try_with(|s| {
                let (depth, saved) = s.get();
                s.set((depth + 1, saved));
            })
            .is_ok();
        ContextScope {
            active,
            _thread: std::marker::PhantomData,
        }
    }
}

impl Drop for ContextScope {
    fn drop(&mut self) {
        if !self.active {
            return;
        }
        let restore = SCOPE.try_with(|s| {
            let (depth, saved) = s.get();
            if depth == 1 {
                s.set((0, None));
                saved
            } else {
                s.set((depth - 1, saved));
                None
            }
        });
        if let Ok(Some(previous)) = restore {
            // SAFETY: `previous` was this thread's current context (or none) when the driver
            // first switched inside the scope; the driver was loaded to make that switch.
            // A context destroyed meanwhile by its owner is refused with an error, which a
            // drop can only drop.
            let _ = unsafe { sys::cuCtxSetCurrent(previous as sys::CUcontext) };
        }
    }
}

/// The driver is about to make another context current in place of `previous`: inside a
/// scope, remember the first one replaced.
pub(super) fn note_switch(previous: sys::CUcontext) {
    let _ = SCOPE.try_with(|s| {
        if let (depth @ 1.., None) = s.get() {
            s.set((depth, Some(previous as usize)));
        }
    });
}
