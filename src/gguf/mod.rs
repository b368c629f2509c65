//! GGUF, the model file format of llama.cpp (versions 2 and 3).
//!
//! A file is a header (`GGUF`, version, tensor count, metadata count), the metadata
//! key/value pairs, one info record per tensor (name, dimensions, type, offset), zero
//! padding up to the data alignment, and the tensor data, each tensor padded to that
//! alignment.  All integers are little-endian; a string is a `u64` byte length and its
//! UTF-8 bytes.  The alignment is `general.alignment` (a `u32`) or 32 when absent.
//!
//! Version 2 has the same layout as version 3 (3 only added big-endian files, which are
//! not read here); version 1, with 32-bit counts and lengths, is obsolete.
//!
//! This module holds the format's vocabulary ([`GgufValue`], [`GgufArray`],
//! [`TensorType`], the type ids in [`value_type`]), a [`writer`], a [`reader`] of the
//! metadata and tensor infos, and the model facts drawn from them in [`metadata`].

pub mod metadata;
pub mod reader;
pub mod writer;

pub use writer::GgufWriter;

/// The four bytes a GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";

/// The format version this module writes, and the newest it reads.
pub const VERSION: u32 = 3;

/// The oldest format version this module reads.
pub const MIN_READ_VERSION: u32 = 2;

/// The metadata key that sets the data alignment (a `u32`, a power of two).
pub const KEY_ALIGNMENT: &str = "general.alignment";

/// The data alignment of a file without `general.alignment`.
pub const DEFAULT_ALIGNMENT: u32 = 32;

/// The longest tensor name llama.cpp accepts, in bytes (`GGML_MAX_NAME - 1`).
pub const MAX_TENSOR_NAME_LEN: usize = 63;

/// The most dimensions a tensor may have (`GGML_MAX_DIMS`).
pub const MAX_TENSOR_DIMS: usize = 4;

/// The on-disk type ids of metadata values (`enum gguf_type`).
pub mod value_type {
    /// `u8`
    pub const UINT8: u32 = 0;
    /// `i8`
    pub const INT8: u32 = 1;
    /// `u16`
    pub const UINT16: u32 = 2;
    /// `i16`
    pub const INT16: u32 = 3;
    /// `u32`
    pub const UINT32: u32 = 4;
    /// `i32`
    pub const INT32: u32 = 5;
    /// `f32`
    pub const FLOAT32: u32 = 6;
    /// A boolean stored as one byte, 0 or 1.
    pub const BOOL: u32 = 7;
    /// A length-prefixed UTF-8 string.
    pub const STRING: u32 = 8;
    /// An array: element type id, `u64` count, elements.
    pub const ARRAY: u32 = 9;
    /// `u64`
    pub const UINT64: u32 = 10;
    /// `i64`
    pub const INT64: u32 = 11;
    /// `f64`
    pub const FLOAT64: u32 = 12;
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// `u8`
    U8(u8),
    /// `i8`
    I8(i8),
    /// `u16`
    U16(u16),
    /// `i16`
    I16(i16),
    /// `u32`
    U32(u32),
    /// `i32`
    I32(i32),
    /// `f32`
    F32(f32),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array of one element type.
    Array(GgufArray),
    /// `u64`
    U64(u64),
    /// `i64`
    I64(i64),
    /// `f64`
    F64(f64),
}

impl GgufValue {
    /// The on-disk type id (see [`value_type`]).
    #[must_use]
    pub const fn type_id(&self) -> u32 {
        match self {
            Self::U8(_) => value_type::UINT8,
            Self::I8(_) => value_type::INT8,
            Self::U16(_) => value_type::UINT16,
            Self::I16(_) => value_type::INT16,
            Self::U32(_) => value_type::UINT32,
            Self::I32(_) => value_type::INT32,
            Self::F32(_) => value_type::FLOAT32,
            Self::Bool(_) => value_type::BOOL,
            Self::String(_) => value_type::STRING,
            Self::Array(_) => value_type::ARRAY,
            Self::U64(_) => value_type::UINT64,
            Self::I64(_) => value_type::INT64,
            Self::F64(_) => value_type::FLOAT64,
        }
    }
}

/// A metadata array: all elements share one type.  Arrays of arrays are part of the
/// format and read back, though llama.cpp itself refuses them.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    /// `u8` elements.
    U8(Vec<u8>),
    /// `i8` elements.
    I8(Vec<i8>),
    /// `u16` elements.
    U16(Vec<u16>),
    /// `i16` elements.
    I16(Vec<i16>),
    /// `u32` elements.
    U32(Vec<u32>),
    /// `i32` elements.
    I32(Vec<i32>),
    /// `f32` elements.
    F32(Vec<f32>),
    /// Boolean elements.
    Bool(Vec<bool>),
    /// String elements.
    String(Vec<String>),
    /// `u64` elements.
    U64(Vec<u64>),
    /// `i64` elements.
    I64(Vec<i64>),
    /// `f64` elements.
    F64(Vec<f64>),
    /// Array elements, each with its own element type.
    Array(Vec<GgufArray>),
}

impl GgufArray {
    /// The on-disk type id of the elements (see [`value_type`]).
    #[must_use]
    pub const fn element_type_id(&self) -> u32 {
        match self {
            Self::U8(_) => value_type::UINT8,
            Self::I8(_) => value_type::INT8,
            Self::U16(_) => value_type::UINT16,
            Self::I16(_) => value_type::INT16,
            Self::U32(_) => value_type::UINT32,
            Self::I32(_) => value_type::INT32,
            Self::F32(_) => value_type::FLOAT32,
            Self::Bool(_) => value_type::BOOL,
            Self::String(_) => value_type::STRING,
            Self::U64(_) => value_type::UINT64,
            Self::I64(_) => value_type::INT64,
            Self::F64(_) => value_type::FLOAT64,
            Self::Array(_) => value_type::ARRAY,
        }
    }

    /// The number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::I8(v) => v.len(),
            Self::U16(v) => v.len(),
            Self::I16(v) => v.len(),
            Self::U32(v) => v.len(),
            Self::I32(v) => v.len(),
            Self::F32(v) => v.len(),
            Self::Bool(v) => v.len(),
            Self::String(v) => v.len(),
            Self::U64(v) => v.len(),
            Self::I64(v) => v.len(),
            Self::F64(v) => v.len(),
            Self::Array(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

macro_rules! value_from {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl From<$t> for GgufValue {
            fn from(v: $t) -> Self {
                Self::$variant(v)
            }
        }
        impl From<Vec<$t>> for GgufValue {
            fn from(v: Vec<$t>) -> Self {
                Self::Array(GgufArray::$variant(v))
            }
        }
    )*};
}

value_from!(
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => String, u64 => U64, i64 => I64, f64 => F64,
);

impl From<&str> for GgufValue {
    fn from(v: &str) -> Self {
        Self::String(v.to_owned())
    }
}

impl From<GgufArray> for GgufValue {
    fn from(v: GgufArray) -> Self {
        Self::Array(v)
    }
}

/// The element type of a tensor (`enum ggml_type`); only the unquantized ones are offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorType {
    /// 32-bit IEEE 754 floats (`GGML_TYPE_F32`).
    F32,
    /// 16-bit IEEE 754 floats (`GGML_TYPE_F16`).
    F16,
}

impl TensorType {
    /// The on-disk type id (`GGML_TYPE_*`).
    #[must_use]
    pub const fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
        }
    }

    /// The type with on-disk id `id`, if it is one of these.
    #[must_use]
    pub const fn from_id(id: u32) -> Option<Self> {
        match id {
            0 => Some(Self::F32),
            1 => Some(Self::F16),
            _ => None,
        }
    }

    /// Bytes per element.
    #[must_use]
    pub const fn element_size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
        }
    }
}

/// Converts an `f32` to the bits of the nearest IEEE 754 half-precision float (ties to
/// even), as ggml's `GGML_FP32_TO_FP16` does.  Overflow gives infinity; NaN stays NaN.
#[must_use]
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    reason = "each cast is of a value masked, shifted or range-checked to fit its target"
)]
pub const fn f32_to_f16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x007f_ffff;
    if exp == 0xff {
        // Infinity, or NaN with its top mantissa bits kept and the quiet bit set.
        return if man == 0 { sign | 0x7c00 } else { sign | 0x7e00 | (man >> 13) as u16 };
    }
    let half_exp = exp - 127 + 15;
    if half_exp >= 0x1f {
        return sign | 0x7c00;
    }
    // Keep `kept` bits of the 24-bit significand, round the dropped ones to nearest even.
    let (significand, shift) = if half_exp <= 0 {
        if half_exp < -10 {
            return sign; // below half the smallest subnormal: a signed zero
        }
        (man | 0x0080_0000, (14 - half_exp) as u32)
    } else {
        (((half_exp as u32) << 23) | man, 13)
    };
    let kept = significand >> shift;
    let dropped = significand & ((1 << shift) - 1);
    let halfway = 1 << (shift - 1);
    // A carry out of the mantissa correctly bumps the exponent (up to infinity).
    let rounded = if dropped > halfway || (dropped == halfway && kept & 1 == 1) { kept + 1 } else { kept };
    sign | rounded as u16
}

#[cfg(test)]
mod tests {
    use super::{GgufArray, GgufValue, TensorType, f32_to_f16_bits, value_type};

    #[test]
    fn f16_conversion_matches_known_values() {
        let p2 = |e: i32| 2f32.powi(e);
        let cases: &[(f32, u16)] = &[
            (0.0, 0x0000),
            (-0.0, 0x8000),
            (1.0, 0x3c00),
            (-2.0, 0xc000),
            (0.5, 0x3800),
            (0.1, 0x2e66),
            (1.0 / 3.0, 0x3555),
            (65504.0, 0x7bff),           // largest finite half
            (65519.0, 0x7bff),           // rounds down to it
            (65520.0, 0x7c00),           // ties to even: infinity
            (1e9, 0x7c00),               // overflow
            (p2(-14), 0x0400),           // smallest normal
            (p2(-24), 0x0001),           // smallest subnormal
            (p2(-25), 0x0000),           // half of it: a tie, rounds to even (zero)
            (p2(-25) * 1.5, 0x0001),     // above the tie: rounds up
            (p2(-14) - p2(-24), 0x03ff), // largest subnormal
            (p2(-14) - p2(-25), 0x0400), // tie between it and the smallest normal: rounds to even
            (1e-10, 0x0000),
            (-1e-10, 0x8000),
            (f32::INFINITY, 0x7c00),
            (f32::NEG_INFINITY, 0xfc00),
            (1.0 + p2(-10), 0x3c01),
            (1.0 + p2(-11), 0x3c00),       // tie, rounds to even (down)
            (1.0 + 3.0 * p2(-11), 0x3c02), // tie, rounds to even (up)
        ];
        for &(x, want) in cases {
            assert_eq!(f32_to_f16_bits(x), want, "{x:e}");
        }
        let nan = f32_to_f16_bits(f32::NAN);
        assert_eq!(nan & 0x7c00, 0x7c00);
        assert_ne!(nan & 0x03ff, 0);
    }

    #[test]
    fn f16_conversion_is_exact_for_every_half() {
        // Every finite half converted to f32 and back must give the same bits.
        for bits in 0..=u16::MAX {
            let exp = (bits >> 10) & 0x1f;
            if exp == 0x1f {
                continue;
            }
            let man = f32::from(bits & 0x3ff);
            let magnitude =
                if exp == 0 { man * 2f32.powi(-24) } else { (1.0 + man / 1024.0) * 2f32.powi(i32::from(exp) - 15) };
            let x = if bits & 0x8000 == 0 { magnitude } else { -magnitude };
            assert_eq!(f32_to_f16_bits(x), bits, "{bits:#06x}");
        }
    }

    #[test]
    fn type_ids_follow_the_format() {
        assert_eq!(GgufValue::from(1u32).type_id(), value_type::UINT32);
        assert_eq!(GgufValue::from("x").type_id(), value_type::STRING);
        assert_eq!(GgufValue::from(true).type_id(), value_type::BOOL);
        assert_eq!(GgufValue::from(-1i64).type_id(), value_type::INT64);
        let tokens = GgufValue::from(vec!["a".to_owned(), "b".to_owned()]);
        assert_eq!(tokens.type_id(), value_type::ARRAY);
        let GgufValue::Array(array) = tokens else { panic!("not an array") };
        assert_eq!(array.element_type_id(), value_type::STRING);
        assert_eq!(array.len(), 2);
        assert!(GgufArray::F32(Vec::new()).is_empty());
        assert_eq!(TensorType::F32.id(), 0);
        assert_eq!(TensorType::F16.id(), 1);
        assert_eq!(TensorType::F16.element_size(), 2);
        assert_eq!(TensorType::from_id(1), Some(TensorType::F16));
        assert_eq!(TensorType::from_id(8), None);
        let nested = GgufArray::Array(vec![GgufArray::U8(vec![1]), GgufArray::Array(Vec::new())]);
        assert_eq!((nested.element_type_id(), nested.len()), (value_type::ARRAY, 2));
    }
}
