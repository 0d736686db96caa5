//! Element types of device buffers.
use serde::{Deserialize, Serialize};

/// The element type of a buffer, named as `torch.dtype` names them.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DType {
    /// `torch.bool`
    Bool,
    /// `torch.uint8`
    U8,
    /// `torch.int8`
    I8,
    /// `torch.int16`
    I16,
    /// `torch.int32`
    I32,
    /// `torch.int64`
    I64,
    /// `torch.float16`
    F16,
    /// `torch.bfloat16`
    BF16,
    /// `torch.float32`
    F32,
    /// `torch.float64`
    F64,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_floating_point(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
}

/// Rust element types with a [`DType`].
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The matching dtype.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(u8 => U8, i8 => I8, i16 => I16, i32 => I32, i64 => I64, half::f16 => F16,
         half::bf16 => BF16, f32 => F32, f64 => F64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(
            <half::bf16 as Element>::DTYPE.size(),
            std::mem::size_of::<half::bf16>()
        );
        assert_eq!(<f64 as Element>::DTYPE.size(), 8);
        assert!(DType::F16.is_floating_point() && !DType::I64.is_floating_point());
    }
}
