//! What one input of a wrapped function is, and the guard on it: PyTorch's `TensorCheck`
//! (`torch/csrc/dynamo/guards.cpp`) over plain data.
//!
//! Our buffers carry no shape, so the caller describes each input with a [`TensorMeta`]
//! (borrowed sizes and strides, no copy). A [`TensorGuard`] built from one compares, in
//! `TensorCheck::check`'s order, dtype, device index, `requires_grad`, rank, then per dim an
//! optional size and an optional stride (`None` = a dynamic dim). Its verbose failure is a
//! typed [`TensorMismatch`] computed only when asked; its `Display` is
//! `TensorCheck::check_verbose`'s text.
use std::fmt;

use ferrocuda_types::{DType, DeviceIndex};

use super::GuardError;

/// One input as the guards see it: dtype, device, `requires_grad`, sizes and strides (in
/// elements). Sizes and strides are borrowed from the caller, so describing a call allocates
/// nothing.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta<'a> {
    dtype: DType,
    device: DeviceIndex,
    requires_grad: bool,
    /// dtype, device, `requires_grad` and rank packed once (see [`header`]).
    header: u64,
    sizes: &'a [i64],
    strides: &'a [i64],
}

impl<'a> TensorMeta<'a> {
    /// Describes an input; sizes and strides must have the same length (the rank), which
    /// must fit in a `u32`.
    pub fn new(
        dtype: DType,
        device: DeviceIndex,
        requires_grad: bool,
        sizes: &'a [i64],
        strides: &'a [i64],
    ) -> Result<TensorMeta<'a>, GuardError> {
        let rank = u32::try_from(sizes.len());
        let (Ok(rank), true) = (rank, sizes.len() == strides.len()) else {
            return Err(GuardError::StrideRank {
                sizes: sizes.len(),
                strides: strides.len(),
            });
        };
        Ok(TensorMeta {
            dtype,
            device,
            requires_grad,
            header: header(dtype, device, requires_grad, rank),
            sizes,
            strides,
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device index.
    pub fn device(&self) -> DeviceIndex {
        self.device
    }

    /// Whether autograd tracks the input.
    pub fn requires_grad(&self) -> bool {
        self.requires_grad
    }

    /// The sizes, one per dim.
    pub fn sizes(&self) -> &'a [i64] {
        self.sizes
    }

    /// The strides in elements, one per dim.
    pub fn strides(&self) -> &'a [i64] {
        self.strides
    }

    /// The fields compared before the dims, packed for one comparison.
    #[inline]
    pub(crate) fn header(&self) -> u64 {
        self.header
    }
}

/// dtype (8 bits), `requires_grad` (8), device index (16) and rank (32) in one word, so that
/// the fields `TensorCheck` compares before the dims are one comparison.
fn header(dtype: DType, device: DeviceIndex, requires_grad: bool, rank: u32) -> u64 {
    u64::from(dtype as u8)
        | u64::from(requires_grad) << 8
        | u64::from(device.0) << 16
        | u64::from(rank) << 32
}

/// The guard on one input (`TensorCheck`): what it must equal, `None` for a dynamic size or
/// stride.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorGuard {
    dtype: DType,
    device: DeviceIndex,
    requires_grad: bool,
    sizes: Vec<Option<i64>>,
    strides: Vec<Option<i64>>,
}

impl TensorGuard {
    /// A guard every dim of which is static: exactly `meta`'s sizes and strides.
    pub fn exact(meta: &TensorMeta<'_>) -> TensorGuard {
        TensorGuard::with_dims(
            meta,
            meta.sizes.iter().map(|s| Some(*s)).collect(),
            meta.strides.iter().map(|s| Some(*s)).collect(),
        )
    }

    /// A guard on `meta`'s dtype, device and `requires_grad` with the given per-dim sizes
    /// and strides (`None` = dynamic). Their lengths are the guarded rank.
    pub(crate) fn with_dims(
        meta: &TensorMeta<'_>,
        sizes: Vec<Option<i64>>,
        strides: Vec<Option<i64>>,
    ) -> TensorGuard {
        TensorGuard {
            dtype: meta.dtype,
            device: meta.device,
            requires_grad: meta.requires_grad,
            sizes,
            strides,
        }
    }

    /// The guarded dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The guarded device index.
    pub fn device(&self) -> DeviceIndex {
        self.device
    }

    /// The guarded `requires_grad`.
    pub fn requires_grad(&self) -> bool {
        self.requires_grad
    }

    /// The guarded sizes, `None` where a dim is dynamic.
    pub fn sizes(&self) -> &[Option<i64>] {
        &self.sizes
    }

    /// The guarded strides, `None` where a stride is dynamic.
    pub fn strides(&self) -> &[Option<i64>] {
        &self.strides
    }

    /// The guarded rank.
    pub fn rank(&self) -> usize {
        self.sizes.len()
    }

    /// The packed header an input must have; a guard's rank comes from a [`TensorMeta`],
    /// so it fits.
    pub(crate) fn header(&self) -> u64 {
        let rank = u32::try_from(self.sizes.len()).unwrap_or(u32::MAX);
        header(self.dtype, self.device, self.requires_grad, rank)
    }

    /// Whether `actual` passes (`TensorCheck::check`: the fields in order, then per dim the
    /// size and the stride).
    pub fn check(&self, actual: &TensorMeta<'_>) -> bool {
        self.first_mismatch(actual).is_none()
    }

    /// The first failing field in `TensorCheck::check_verbose`'s order (dtype, device index,
    /// `requires_grad`, rank, every size, then every stride), or `None` when `actual` passes.
    pub fn first_mismatch(&self, actual: &TensorMeta<'_>) -> Option<TensorMismatch> {
        if self.dtype != actual.dtype {
            return Some(TensorMismatch::Dtype {
                expected: self.dtype,
                actual: actual.dtype,
            });
        }
        if self.device != actual.device {
            return Some(TensorMismatch::DeviceIndex {
                expected: self.device,
                actual: actual.device,
            });
        }
        if self.requires_grad != actual.requires_grad {
            return Some(TensorMismatch::RequiresGrad {
                expected: self.requires_grad,
            });
        }
        if self.sizes.len() != actual.sizes.len() {
            return Some(TensorMismatch::Rank {
                expected: self.sizes.len(),
                actual: actual.sizes.len(),
            });
        }
        let dim = |guard: &[Option<i64>], seen: &[i64]| {
            guard
                .iter()
                .zip(seen)
                .enumerate()
                .find_map(|(i, (g, s))| g.filter(|g| g != s).map(|expected| (i, expected, *s)))
        };
        if let Some((index, expected, actual)) = dim(&self.sizes, actual.sizes) {
            return Some(TensorMismatch::Size {
                index,
                expected,
                actual,
            });
        }
        dim(&self.strides, actual.strides).map(|(index, expected, actual)| TensorMismatch::Stride {
            index,
            expected,
            actual,
        })
    }
}

/// Why an input failed its [`TensorGuard`]. `Display` gives `TensorCheck::check_verbose`'s
/// text after the `tensor '<name>' ` prefix (see [`TensorFailure`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TensorMismatch {
    /// "dtype mismatch. expected Float, actual Half"
    Dtype {
        /// Guarded.
        expected: DType,
        /// Seen.
        actual: DType,
    },
    /// "Tensor device index mismatch. Expected device index to be 0, actual 1"
    DeviceIndex {
        /// Guarded.
        expected: DeviceIndex,
        /// Seen.
        actual: DeviceIndex,
    },
    /// "requires_grad mismatch. expected requires_grad=1"
    RequiresGrad {
        /// Guarded.
        expected: bool,
    },
    /// "rank mismatch. expected 2, actual 3"
    Rank {
        /// Guarded.
        expected: usize,
        /// Seen.
        actual: usize,
    },
    /// "size mismatch at index 0. expected 4, actual 8"
    Size {
        /// The dim.
        index: usize,
        /// Guarded.
        expected: i64,
        /// Seen.
        actual: i64,
    },
    /// "stride mismatch at index 0. expected 4, actual 8"
    Stride {
        /// The dim.
        index: usize,
        /// Guarded.
        expected: i64,
        /// Seen.
        actual: i64,
    },
}

impl fmt::Display for TensorMismatch {
    /// PyTorch streams C++ values: `requires_grad` prints as `1`/`0` (kept), the device index
    /// is an `int8_t` that prints as a raw byte (printed as a number here).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            TensorMismatch::Dtype { expected, actual } => write!(
                f,
                "dtype mismatch. expected {}, actual {}",
                ScalarTypeName(expected),
                ScalarTypeName(actual)
            ),
            TensorMismatch::DeviceIndex { expected, actual } => write!(
                f,
                "Tensor device index mismatch. Expected device index to be {}, actual {}",
                expected.0, actual.0
            ),
            TensorMismatch::RequiresGrad { expected } => write!(
                f,
                "requires_grad mismatch. expected requires_grad={}",
                u8::from(expected)
            ),
            TensorMismatch::Rank { expected, actual } => {
                write!(f, "rank mismatch. expected {expected}, actual {actual}")
            }
            TensorMismatch::Size {
                index,
                expected,
                actual,
            } => write!(
                f,
                "size mismatch at index {index}. expected {expected}, actual {actual}"
            ),
            TensorMismatch::Stride {
                index,
                expected,
                actual,
            } => write!(
                f,
                "stride mismatch at index {index}. expected {expected}, actual {actual}"
            ),
        }
    }
}

/// A named input's failure: `tensor 'x' dtype mismatch. expected Float, actual Half`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorFailure {
    /// The input's name.
    pub name: String,
    /// What differed.
    pub mismatch: TensorMismatch,
}

impl fmt::Display for TensorFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tensor '{}' {}", self.name, self.mismatch)
    }
}

/// A dtype as `c10::ScalarType` prints (`Float`, `Half`, `BFloat16`, ...).
#[derive(Copy, Clone, Debug)]
pub struct ScalarTypeName(pub DType);

impl fmt::Display for ScalarTypeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.0 {
            DType::Bool => "Bool",
            DType::U8 => "Byte",
            DType::I8 => "Char",
            DType::I16 => "Short",
            DType::I32 => "Int",
            DType::I64 => "Long",
            DType::F16 => "Half",
            DType::BF16 => "BFloat16",
            DType::F32 => "Float",
            DType::F64 => "Double",
            other => return write!(f, "{other:?}"),
        };
        f.write_str(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZES: [i64; 3] = [4, 8, 2];
    const STRIDES: [i64; 3] = [16, 2, 1];

    fn meta<'a>(sizes: &'a [i64], strides: &'a [i64]) -> TensorMeta<'a> {
        with(DType::F32, 0, false, sizes, strides)
    }

    fn with<'a>(
        dtype: DType,
        device: u16,
        rg: bool,
        sizes: &'a [i64],
        strides: &'a [i64],
    ) -> TensorMeta<'a> {
        let rank = u32::try_from(sizes.len()).unwrap_or(u32::MAX);
        let device = DeviceIndex(device);
        TensorMeta {
            dtype,
            device,
            requires_grad: rg,
            header: header(dtype, device, rg, rank),
            sizes,
            strides,
        }
    }

    fn failure(guard: &TensorGuard, actual: &TensorMeta<'_>) -> Option<String> {
        guard.first_mismatch(actual).map(|mismatch| {
            TensorFailure {
                name: "x".into(),
                mismatch,
            }
            .to_string()
        })
    }

    #[test]
    fn each_field_fails_with_pytorchs_text() {
        let base = meta(&SIZES, &STRIDES);
        let guard = TensorGuard::exact(&base);
        assert!(guard.check(&base));
        let cases: [(TensorMeta<'_>, &str); 6] = [
            (
                with(DType::F16, 0, false, &SIZES, &STRIDES),
                "tensor 'x' dtype mismatch. expected Float, actual Half",
            ),
            (
                with(DType::F32, 1, false, &SIZES, &STRIDES),
                "tensor 'x' Tensor device index mismatch. Expected device index to be 0, actual 1",
            ),
            (
                with(DType::F32, 0, true, &SIZES, &STRIDES),
                "tensor 'x' requires_grad mismatch. expected requires_grad=0",
            ),
            (
                meta(&SIZES[..2], &STRIDES[..2]),
                "tensor 'x' rank mismatch. expected 3, actual 2",
            ),
            (
                meta(&[4, 9, 2], &STRIDES),
                "tensor 'x' size mismatch at index 1. expected 8, actual 9",
            ),
            (
                meta(&SIZES, &[16, 2, 3]),
                "tensor 'x' stride mismatch at index 2. expected 1, actual 3",
            ),
        ];
        for (actual, text) in cases {
            assert!(!guard.check(&actual));
            assert_eq!(failure(&guard, &actual).as_deref(), Some(text));
        }
    }

    #[test]
    fn verbose_reports_sizes_before_strides_and_in_field_order() {
        let guard = TensorGuard::exact(&meta(&SIZES, &STRIDES));
        // A stride at dim 0 and a size at dim 2 differ: check_verbose reports the size.
        let both = meta(&[4, 8, 3], &[99, 2, 1]);
        assert_eq!(
            guard.first_mismatch(&both),
            Some(TensorMismatch::Size {
                index: 2,
                expected: 2,
                actual: 3
            })
        );
        // dtype is reported before requires_grad.
        let two = with(DType::BF16, 0, true, &SIZES, &STRIDES);
        assert_eq!(
            failure(&guard, &two).as_deref(),
            Some("tensor 'x' dtype mismatch. expected Float, actual BFloat16")
        );
    }

    #[test]
    fn dynamic_dims_accept_any_value() {
        let base = meta(&SIZES, &STRIDES);
        let guard = TensorGuard::with_dims(
            &base,
            vec![None, Some(8), Some(2)],
            vec![None, Some(2), Some(1)],
        );
        assert!(guard.check(&meta(&[7, 8, 2], &[99, 2, 1])));
        assert!(!guard.check(&meta(&[7, 9, 2], &[99, 2, 1])));
    }

    #[test]
    fn mismatched_sizes_and_strides_are_refused() {
        assert_eq!(
            TensorMeta::new(DType::F32, DeviceIndex(0), false, &SIZES, &STRIDES[..2]),
            Err(GuardError::StrideRank {
                sizes: 3,
                strides: 2
            })
        );
    }
}
