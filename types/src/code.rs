//! A layer's codes as plain data: what the producer's codec emits, what a code frame carries and
//! what the consumer's codec reads, without tensors.

use rkyv::{Archive, Deserialize as RkyvDeserialize, Serialize as RkyvSerialize};

/// What a layer code holds. A `u8` with named values rather than a Rust enum, so that a newer
/// peer's kinds still pass validation (the codec decides what to do with a kind it does not
/// know).
#[derive(
    Archive,
    RkyvSerialize,
    RkyvDeserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct CodeKind(pub u8);

impl CodeKind {
    /// Reuse code for keys (`Z_K`).
    pub const REUSE_K: CodeKind = CodeKind(0);
    /// Reuse code for values (`Z_V`).
    pub const REUSE_V: CodeKind = CodeKind(1);
    /// Patch code for the attention input (`Z_H`).
    pub const PATCH_H: CodeKind = CodeKind(2);
    /// Raw keys (before RoPE).
    pub const RAW_K: CodeKind = CodeKind(3);
    /// Raw values.
    pub const RAW_V: CodeKind = CodeKind(4);
    /// A raw hidden state (the residual stream entering a layer).
    pub const HIDDEN: CodeKind = CodeKind(5);
    /// Quantised keys.
    pub const QUANT_K: CodeKind = CodeKind(6);
    /// Quantised values.
    pub const QUANT_V: CodeKind = CodeKind(7);
    /// Scales or other side data that go with a quantised or coded tensor.
    pub const AUX: CodeKind = CodeKind(8);
    /// Scales and minima of [`CodeKind::QUANT_K`]'s groups.
    pub const SCALES_K: CodeKind = CodeKind(9);
    /// Scales and minima of [`CodeKind::QUANT_V`]'s groups.
    pub const SCALES_V: CodeKind = CodeKind(10);
    /// Compiled documents' keys, after RoPE at the positions they are placed at, `(rows,
    /// kv_dim)`: every document of a job, one after another (SemPIC).
    pub const DOC_K: CodeKind = CodeKind(11);
    /// Compiled documents' values, `(rows, kv_dim)`, as [`CodeKind::DOC_K`].
    pub const DOC_V: CodeKind = CodeKind(12);
    /// Components of the producer's keys (before RoPE) in the base model's own PCA basis,
    /// transform-coded (the `kvtc` mode: raw KV compressed as hard as SCD's codes).
    pub const KVTC_K: CodeKind = CodeKind(13);
    /// Components of the producer's values, as [`CodeKind::KVTC_K`].
    pub const KVTC_V: CodeKind = CodeKind(14);

    /// A short name for logs; `None` for a kind this version does not know.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::REUSE_K => "reuse_k",
            Self::REUSE_V => "reuse_v",
            Self::PATCH_H => "patch_h",
            Self::RAW_K => "raw_k",
            Self::RAW_V => "raw_v",
            Self::HIDDEN => "hidden",
            Self::QUANT_K => "quant_k",
            Self::QUANT_V => "quant_v",
            Self::AUX => "aux",
            Self::SCALES_K => "scales_k",
            Self::SCALES_V => "scales_v",
            Self::DOC_K => "doc_k",
            Self::DOC_V => "doc_v",
            Self::KVTC_K => "kvtc_k",
            Self::KVTC_V => "kvtc_v",
            _ => return None,
        })
    }
}

/// The element type of a layer code's bytes. A `u8` with named values, for the same reason as
/// [`CodeKind`].
#[derive(
    Archive,
    RkyvSerialize,
    RkyvDeserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
pub struct CodeDType(pub u8);

impl CodeDType {
    /// IEEE f32, little-endian.
    pub const F32: CodeDType = CodeDType(0);
    /// IEEE f16, little-endian.
    pub const F16: CodeDType = CodeDType(1);
    /// bfloat16, little-endian.
    pub const BF16: CodeDType = CodeDType(2);
    /// Unsigned bytes.
    pub const U8: CodeDType = CodeDType(3);
    /// Signed bytes.
    pub const I8: CodeDType = CodeDType(4);
    /// u32, little-endian.
    pub const U32: CodeDType = CodeDType(5);
    /// Packed 4-bit values, two per byte, low nibble first.
    pub const Q4: CodeDType = CodeDType(6);
    /// Rows of signed bytes, each row led by its little-endian f32 scale (the value is
    /// `byte * scale`): codes quantised per token. Two-dimensional shapes only.
    pub const I8_ROWS: CodeDType = CodeDType(7);
    /// Transform-coded codes: each column quantised with its own step and the symbols
    /// entropy-coded (`scd_models::codec::transform`), so the length depends on the values, not
    /// only the shape: at most [`LayerCode::max_len`]. Two-dimensional shapes only.
    pub const TC: CodeDType = CodeDType(8);
    /// Packed 2-bit values, four per byte, lowest bits first.
    pub const Q2: CodeDType = CodeDType(9);

    /// Whether this version knows the dtype (a peer's newer dtypes pass validation unchecked).
    pub fn is_known(self) -> bool {
        self.name().is_some()
    }

    /// Bits per element; `None` for a dtype this version does not know, or one whose length
    /// depends on the values ([`CodeDType::TC`]).
    pub fn bits(self) -> Option<usize> {
        Some(match self {
            Self::F32 | Self::U32 => 32,
            Self::F16 | Self::BF16 => 16,
            Self::U8 | Self::I8 => 8,
            Self::Q4 => 4,
            Self::Q2 => 2,
            Self::I8_ROWS => 8,
            _ => return None,
        })
    }

    /// A short name for logs; `None` for a dtype this version does not know.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
            Self::U8 => "u8",
            Self::I8 => "i8",
            Self::U32 => "u32",
            Self::Q4 => "q4",
            Self::I8_ROWS => "i8-rows",
            Self::TC => "tc",
            Self::Q2 => "q2",
            _ => return None,
        })
    }
}

/// One tensor of one layer's codes: a typed description and its bytes (row-major,
/// little-endian). A codec's payload for a prompt is a list of these, in layer order, and its
/// size on the wire is the sum of their byte lengths plus the frame headers.
#[derive(Archive, RkyvSerialize, RkyvDeserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct LayerCode {
    /// The transformer layer.
    pub layer: u16,
    /// What the bytes hold.
    pub kind: CodeKind,
    /// Element type of the bytes.
    pub dtype: CodeDType,
    /// The tensor's shape, outermost first.
    pub shape: Vec<u32>,
    /// The tensor's bytes.
    pub bytes: Vec<u8>,
}

impl LayerCode {
    /// The byte length implied by shape and dtype; `None` when the dtype is unknown, its
    /// length depends on the values ([`CodeDType::TC`]) or the length overflows.
    pub fn expected_len(dtype: CodeDType, shape: &[u32]) -> Option<usize> {
        if dtype == CodeDType::TC {
            return None;
        }
        if dtype == CodeDType::I8_ROWS {
            let &[rows, cols] = shape else {
                return None;
            };
            return (rows as usize).checked_mul((cols as usize).checked_add(4)?);
        }
        let bits = dtype.bits()?;
        let mut n: usize = 1;
        for &d in shape {
            n = n.checked_mul(d as usize)?;
        }
        Some(n.checked_mul(bits)?.div_ceil(8))
    }

    /// The most bytes a code of `dtype` and `shape` may hold: [`Self::expected_len`] for the
    /// fixed-width dtypes; for [`CodeDType::TC`] `(T, r)`, three bytes of column header per
    /// column, four bytes per symbol (the coder's models have 16-bit precision: no symbol
    /// costs more than 16 bits, so this leaves room), the coder's two words of state and a
    /// four-byte checksum.
    pub fn max_len(dtype: CodeDType, shape: &[u32]) -> Option<usize> {
        if dtype != CodeDType::TC {
            return Self::expected_len(dtype, shape);
        }
        let &[rows, cols] = shape else {
            return None;
        };
        let symbols = (rows as usize).checked_mul(cols as usize)?;
        symbols
            .checked_mul(4)?
            .checked_add((cols as usize).checked_mul(3)?)?
            .checked_add(12)
    }

    /// Whether the bytes are as long as shape and dtype say: exactly, or for
    /// [`CodeDType::TC`] within [`Self::max_len`].
    pub fn is_consistent(&self) -> bool {
        match self.dtype {
            CodeDType::TC => {
                Self::max_len(self.dtype, &self.shape).is_some_and(|max| self.bytes.len() <= max)
            }
            _ => Self::expected_len(self.dtype, &self.shape) == Some(self.bytes.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_len_counts_bits_and_refuses_overflow() {
        assert_eq!(LayerCode::expected_len(CodeDType::F16, &[3, 4]), Some(24));
        assert_eq!(LayerCode::expected_len(CodeDType::Q4, &[3]), Some(2));
        assert_eq!(LayerCode::expected_len(CodeDType(99), &[1]), None);
        assert_eq!(
            LayerCode::expected_len(CodeDType::I8_ROWS, &[3, 5]),
            Some(27)
        );
        assert_eq!(LayerCode::expected_len(CodeDType::I8_ROWS, &[15]), None);
        assert_eq!(
            LayerCode::expected_len(CodeDType::F32, &[u32::MAX, u32::MAX, u32::MAX]),
            None
        );
        let c = LayerCode {
            layer: 0,
            kind: CodeKind::RAW_K,
            dtype: CodeDType::BF16,
            shape: vec![2, 2],
            bytes: vec![0; 8],
        };
        assert!(c.is_consistent());
        assert!(!LayerCode {
            bytes: vec![0; 7],
            ..c.clone()
        }
        .is_consistent());
        // Transform-coded codes: any length up to the bound, 2-D shapes only.
        assert_eq!(LayerCode::expected_len(CodeDType::TC, &[3, 5]), None);
        assert_eq!(
            LayerCode::max_len(CodeDType::TC, &[3, 5]),
            Some(60 + 15 + 12)
        );
        assert_eq!(LayerCode::max_len(CodeDType::TC, &[15]), None);
        let tc = LayerCode {
            dtype: CodeDType::TC,
            shape: vec![3, 5],
            bytes: vec![0; 40],
            ..c
        };
        assert!(tc.is_consistent());
        assert!(!LayerCode {
            bytes: vec![0; 88],
            ..tc.clone()
        }
        .is_consistent());
        assert!(!LayerCode {
            shape: vec![15],
            ..tc
        }
        .is_consistent());
    }
}
