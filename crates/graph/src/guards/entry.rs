//! One cache entry's guards, twice: the [`Specialization`] (what was guarded, per input and
//! global, readable, with PyTorch's verbose failures) and its flat form, the array the hot
//! path compares in one pass without allocating.
//!
//! The flat form keeps the global state as two words, per input one 8-byte header (dtype, device index, `requires_grad`,
//! rank) and per dim a (value, mask) pair for the size and for the stride, a dynamic dim
//! having mask 0: a dim passes when `(actual ^ value) & mask == 0`, folded over all dims of
//! an input before one branch. Checks run global state first, then inputs in order, as
//! Dynamo's root guard manager runs its global-state leaf guard before the inputs'.
use std::fmt;

use super::global::{GlobalState, GlobalStateDiff};
use super::tensor::{TensorFailure, TensorGuard, TensorMeta};

/// What one entry was specialised on: a guard per input and the global state. The value a
/// compile step receives, so it knows which dims are dynamic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Specialization {
    inputs: Vec<TensorGuard>,
    globals: GlobalState,
}

impl Specialization {
    /// A specialisation on these input guards and global state.
    pub fn new(inputs: Vec<TensorGuard>, globals: GlobalState) -> Specialization {
        Specialization { inputs, globals }
    }

    /// The input guards, in call order.
    pub fn inputs(&self) -> &[TensorGuard] {
        &self.inputs
    }

    /// The guarded global state.
    pub fn globals(&self) -> &GlobalState {
        &self.globals
    }

    /// The first guard `inputs` and `globals` fail, in the hot path's order (input count,
    /// global state, then each input's `TensorCheck::check_verbose`), or `None`.
    pub fn first_failure(
        &self,
        inputs: &[TensorMeta<'_>],
        globals: &GlobalState,
        name: impl Fn(usize) -> String,
    ) -> Option<GuardFailure> {
        if inputs.len() != self.inputs.len() {
            return Some(GuardFailure::InputCount {
                expected: self.inputs.len(),
                actual: inputs.len(),
            });
        }
        let diff = self.globals.diff(globals);
        if !diff.is_empty() {
            return Some(GuardFailure::GlobalState(diff));
        }
        self.inputs
            .iter()
            .zip(inputs)
            .enumerate()
            .find_map(|(i, (guard, actual))| {
                guard.first_mismatch(actual).map(|mismatch| {
                    GuardFailure::Tensor(TensorFailure {
                        name: name(i),
                        mismatch,
                    })
                })
            })
    }
}

/// Why one entry's guards failed. `Display` is the text Dynamo's recompile log prints for
/// the entry (after its compile id).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GuardFailure {
    /// A different number of inputs (Dynamo guards the length of `*args`).
    InputCount {
        /// Guarded.
        expected: usize,
        /// Seen.
        actual: usize,
    },
    /// "GLOBAL_STATE changed: grad_mode "
    GlobalState(GlobalStateDiff),
    /// "tensor 'x' size mismatch at index 0. expected 4, actual 8"
    Tensor(TensorFailure),
    /// `"Cache line invalidated because <what> got deallocated"`: the entry was invalidated
    /// and fails every call.
    Invalidated(String),
}

impl fmt::Display for GuardFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GuardFailure::InputCount { expected, actual } => {
                write!(f, "len(inputs) == {expected} (actual {actual})")
            }
            GuardFailure::GlobalState(diff) => write!(f, "GLOBAL_STATE changed: {diff}"),
            GuardFailure::Tensor(t) => t.fmt(f),
            GuardFailure::Invalidated(what) => {
                write!(f, "Cache line invalidated because {what} got deallocated")
            }
        }
    }
}

/// One dim's size and stride checks: `(actual ^ value) & mask == 0` passes.
#[derive(Copy, Clone, Debug)]
struct DimCheck {
    size: i64,
    size_mask: i64,
    stride: i64,
    stride_mask: i64,
}

impl DimCheck {
    /// Non-zero when `size` or `stride` fails this dim's check. `EXACT`: every dim of the
    /// set is static (all masks are all ones), so the masks need not be loaded.
    #[inline(always)]
    fn differs<const EXACT: bool>(&self, size: i64, stride: i64) -> i64 {
        if EXACT {
            (size ^ self.size) | (stride ^ self.stride)
        } else {
            ((size ^ self.size) & self.size_mask) | ((stride ^ self.stride) & self.stride_mask)
        }
    }

    fn is_static(&self) -> bool {
        self.size_mask == -1 && self.stride_mask == -1
    }

    fn new(size: Option<i64>, stride: Option<i64>) -> DimCheck {
        let split = |v: Option<i64>| v.map_or((0, 0), |v| (v, -1));
        let ((size, size_mask), (stride, stride_mask)) = (split(size), split(stride));
        DimCheck {
            size,
            size_mask,
            stride,
            stride_mask,
        }
    }
}

/// Non-zero when any dim of one input fails `checks` (all three slices have the input's
/// rank). Ranks 1 to 4, most tensors', are unrolled: straight-line code with no loop or
/// trip-count branch; the rest fold in a loop.
#[inline(always)]
fn dims_differ<const EXACT: bool>(checks: &[DimCheck], sizes: &[i64], strides: &[i64]) -> i64 {
    match (checks, sizes, strides) {
        ([a], [s0], [t0]) => a.differs::<EXACT>(*s0, *t0),
        ([a, b], [s0, s1], [t0, t1]) => a.differs::<EXACT>(*s0, *t0) | b.differs::<EXACT>(*s1, *t1),
        ([a, b, c], [s0, s1, s2], [t0, t1, t2]) => {
            a.differs::<EXACT>(*s0, *t0)
                | b.differs::<EXACT>(*s1, *t1)
                | c.differs::<EXACT>(*s2, *t2)
        }
        ([a, b, c, d], [s0, s1, s2, s3], [t0, t1, t2, t3]) => {
            a.differs::<EXACT>(*s0, *t0)
                | b.differs::<EXACT>(*s1, *t1)
                | c.differs::<EXACT>(*s2, *t2)
                | d.differs::<EXACT>(*s3, *t3)
        }
        _ => checks
            .iter()
            .zip(sizes.iter().zip(strides))
            .fold(0, |acc, (d, (size, stride))| {
                acc | d.differs::<EXACT>(*size, *stride)
            }),
    }
}

/// A [`Specialization`] flattened for the hot path.
#[derive(Clone, Debug)]
pub struct GuardSet {
    globals: GlobalState,
    headers: Box<[u64]>,
    dims: Box<[DimCheck]>,
    /// No dim is dynamic: the masks are all ones and the check skips them.
    all_static: bool,
}

impl GuardSet {
    /// Flattens `spec`.
    pub fn new(spec: &Specialization) -> GuardSet {
        let dims: Box<[DimCheck]> = spec
            .inputs
            .iter()
            .flat_map(|g| g.sizes().iter().zip(g.strides()))
            .map(|(size, stride)| DimCheck::new(*size, *stride))
            .collect();
        GuardSet {
            globals: spec.globals,
            headers: spec.inputs.iter().map(TensorGuard::header).collect(),
            all_static: dims.iter().all(DimCheck::is_static),
            dims,
        }
    }

    /// Whether `inputs` and `globals` pass every guard.
    #[inline]
    pub fn check(&self, inputs: &[TensorMeta<'_>], globals: &GlobalState) -> bool {
        if self.all_static {
            self.check_with::<true>(inputs, globals)
        } else {
            self.check_with::<false>(inputs, globals)
        }
    }

    #[inline(always)]
    fn check_with<const EXACT: bool>(
        &self,
        inputs: &[TensorMeta<'_>],
        globals: &GlobalState,
    ) -> bool {
        if inputs.len() != self.headers.len() || self.globals != *globals {
            return false;
        }
        let mut dims: &[DimCheck] = &self.dims;
        for (header, input) in self.headers.iter().zip(inputs) {
            if *header != input.header() {
                return false;
            }
            let Some((mine, rest)) = dims.split_at_checked(input.sizes().len()) else {
                return false;
            };
            if dims_differ::<EXACT>(mine, input.sizes(), input.strides()) != 0 {
                return false;
            }
            dims = rest;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use ferrocuda_types::{DType, DeviceIndex};

    use super::super::global::LibraryState;
    use super::*;

    #[test]
    fn flat_form_agrees_with_the_structured_guards() -> Result<(), Box<dyn std::error::Error>> {
        let globals = GlobalState::current(LibraryState::default());
        let a = TensorMeta::new(DType::F32, DeviceIndex(0), false, &[4, 8], &[8, 1])?;
        let b = TensorMeta::new(DType::F16, DeviceIndex(0), true, &[2, 3, 5], &[15, 5, 1])?;
        let dynamic = TensorGuard::with_dims(
            &b,
            vec![None, Some(3), Some(5)],
            vec![None, Some(5), Some(1)],
        );
        let spec = Specialization::new(vec![TensorGuard::exact(&a), dynamic], globals);
        let flat = GuardSet::new(&spec);
        let name = |i: usize| format!("in{i}");
        let b2 = TensorMeta::new(DType::F16, DeviceIndex(0), true, &[7, 3, 5], &[99, 5, 1])?;
        let b3 = TensorMeta::new(DType::F16, DeviceIndex(0), true, &[7, 4, 5], &[99, 5, 1])?;
        assert!(flat.check(&[a, b], &globals));
        assert!(flat.check(&[a, b2], &globals));
        assert!(!flat.check(&[a, b3], &globals));
        assert!(!flat.check(&[a], &globals));
        assert_eq!(spec.first_failure(&[a, b2], &globals, name), None);
        let text = spec
            .first_failure(&[a, b3], &globals, name)
            .map(|f| f.to_string());
        assert_eq!(
            text.as_deref(),
            Some("tensor 'in1' size mismatch at index 1. expected 3, actual 4")
        );
        let no_grad = GlobalState::current(LibraryState {
            grad_mode: false,
            ..LibraryState::default()
        });
        assert!(!flat.check(&[a, b], &no_grad));
        let text = spec
            .first_failure(&[a, b3], &no_grad, name)
            .map(|f| f.to_string());
        assert_eq!(text.as_deref(), Some("GLOBAL_STATE changed: grad_mode "));
        Ok(())
    }
}
