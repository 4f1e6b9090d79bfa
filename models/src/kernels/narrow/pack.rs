//! The packed layout of a narrow weight. Every weight is an unsigned byte `u` in blocks of 32
//! with a scale `d` and an offset `m` each: `w = d u + m`. A row holds its block pairs (64
//! weights) front to back, then the scales of all its blocks, then their offsets, so that the
//! kernels stream the weights and take the scales 16 blocks at a time.
//!
//! - Q4_1, 20 bytes per pair of blocks plus 4 + 4 for the scales and offsets: byte `i` of a
//!   pair holds weight `i` of the first block in its low half and weight `i` of the second in
//!   its high half (one 32-byte load and two masks give the 64 weights in order); GGUF's `d`
//!   and `m` as they are.
//! - Q8_0, 64 bytes per pair plus 4 for the scales: GGUF's signed `q` stored as `u = q + 128`,
//!   so that both formats meet the activation in the same `u8 x i8` product; the offset is then
//!   `m = -128 d`, implied rather than stored.
//!
//! A row with an odd number of blocks ends in a zero block (scales 0), as the activation rows
//! end in zeros.

use half::f16;

use super::BLOCK;

/// A block format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// 4-bit weights with a scale and an offset per block of 32 (GGUF type 3).
    Q4_1,
    /// 8-bit weights with a scale per block of 32 (GGUF type 8).
    Q8_0,
}

impl Format {
    /// Bytes of one block pair's weights.
    pub(crate) fn pair_bytes(self) -> usize {
        match self {
            Format::Q4_1 => 32,
            Format::Q8_0 => 64,
        }
    }

    /// Bytes of one row of `pairs` pairs: weights, f16 scales, f16 offsets (Q4_1).
    fn row_bytes(self, pairs: usize) -> usize {
        let per_block = match self {
            Format::Q4_1 => 4,
            Format::Q8_0 => 2,
        };
        pairs * (self.pair_bytes() + 2 * per_block)
    }

    /// Bytes of one block in GGUF's layout.
    fn gguf_block_bytes(self) -> usize {
        match self {
            Format::Q4_1 => 20,
            Format::Q8_0 => 34,
        }
    }
}

/// One packed row, split into its parts.
pub(crate) struct Row<'a> {
    /// `pairs * pair_bytes` bytes of weights.
    pub weights: &'a [u8],
    /// `pairs * 2` f16 scales, little-endian.
    pub scales: &'a [u8],
    /// `pairs * 2` f16 offsets (Q4_1); empty for Q8_0, whose offset is `-128 d`.
    pub offsets: &'a [u8],
}

impl Row<'_> {
    /// Block `b`'s scale and offset as f32.
    pub(crate) fn scale_offset(&self, b: usize) -> (f32, f32) {
        let h = |bytes: &[u8]| f16::from_le_bytes([bytes[2 * b], bytes[2 * b + 1]]).to_f32();
        let d = h(self.scales);
        let m = if self.offsets.is_empty() {
            -128.0 * d
        } else {
            h(self.offsets)
        };
        (d, m)
    }
}

/// A weight `(rows, cols)` in a block format, packed for [`super::linear_narrow`].
#[derive(Clone)]
pub(crate) struct PackedWeight {
    format: Format,
    rows: usize,
    cols: usize,
    /// Block pairs per row.
    pairs: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedWeight")
            .field("format", &self.format)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl PackedWeight {
    fn empty(format: Format, rows: usize, cols: usize) -> Self {
        let pairs = cols.div_ceil(2 * BLOCK);
        Self {
            format,
            rows,
            cols,
            pairs,
            data: vec![0; rows * format.row_bytes(pairs)],
        }
    }

    pub(crate) fn format(&self) -> Format {
        self.format
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    pub(crate) fn cols(&self) -> usize {
        self.cols
    }

    /// Block pairs per row.
    pub(crate) fn pairs(&self) -> usize {
        self.pairs
    }

    /// Bytes from one row to the next.
    pub(crate) fn row_stride(&self) -> usize {
        self.format.row_bytes(self.pairs)
    }

    /// Bytes held (what a decode step streams).
    pub(crate) fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The bytes of rows `j..j + n`, if they all exist.
    pub(crate) fn bytes_of_rows(&self, j: usize, n: usize) -> Option<&[u8]> {
        let len = self.format.row_bytes(self.pairs);
        self.data.get(j * len..(j + n) * len)
    }

    /// Row `j`.
    pub(crate) fn row(&self, j: usize) -> Row<'_> {
        let len = self.format.row_bytes(self.pairs);
        let row = &self.data[j * len..(j + 1) * len];
        let (weights, rest) = row.split_at(self.pairs * self.format.pair_bytes());
        let (scales, offsets) = rest.split_at(self.pairs * 4);
        Row {
            weights,
            scales,
            offsets,
        }
    }

    /// Row `j` as `(weights, scales, offsets)`, to fill.
    fn row_mut(&mut self, j: usize) -> (&mut [u8], &mut [u8], &mut [u8]) {
        let len = self.format.row_bytes(self.pairs);
        let row = &mut self.data[j * len..(j + 1) * len];
        let (weights, rest) = row.split_at_mut(self.pairs * self.format.pair_bytes());
        let (scales, offsets) = rest.split_at_mut(self.pairs * 4);
        (weights, scales, offsets)
    }

    /// Packs a GGUF tensor's data: `rows` rows of `cols / 32` blocks each. `None` when `cols` is
    /// not a whole number of blocks or `bytes` is not the tensor's size.
    pub(crate) fn from_gguf(
        format: Format,
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> Option<Self> {
        let blocks = cols / BLOCK;
        let bb = format.gguf_block_bytes();
        if cols == 0 || !cols.is_multiple_of(BLOCK) || bytes.len() != rows * blocks * bb {
            return None;
        }
        let mut out = Self::empty(format, rows, cols);
        for (j, src) in bytes.chunks_exact(blocks * bb).enumerate() {
            let (weights, scales, offsets) = out.row_mut(j);
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let (pair, half) = (b / 2, b % 2);
                match format {
                    Format::Q4_1 => {
                        // GGUF: d, m, then byte i = weight i (low) | weight i + 16 (high).
                        let dst = &mut weights[pair * 32..][..32];
                        for (i, o) in dst.iter_mut().enumerate() {
                            let byte = blk[4 + i % 16];
                            let q = if i < 16 { byte & 0x0F } else { byte >> 4 };
                            *o |= q << (4 * half);
                        }
                        scales[2 * b..2 * b + 2].copy_from_slice(&blk[0..2]);
                        offsets[2 * b..2 * b + 2].copy_from_slice(&blk[2..4]);
                    }
                    Format::Q8_0 => {
                        // GGUF: d, then 32 signed bytes.
                        let dst = &mut weights[pair * 64 + half * BLOCK..][..BLOCK];
                        for (o, &q) in dst.iter_mut().zip(&blk[2..]) {
                            *o = (q as i8 as i16 + 128) as u8;
                        }
                        scales[2 * b..2 * b + 2].copy_from_slice(&blk[0..2]);
                    }
                }
            }
        }
        Some(out)
    }

    /// Quantises an f32 weight `(rows, cols)` to Q8_0 (`d = max |w| / 127` per block of 32, as
    /// llama.cpp does). `None` when `cols` is not a whole number of blocks.
    pub(crate) fn quantize_q8_0(w: &[f32], rows: usize, cols: usize) -> Option<Self> {
        if cols == 0 || !cols.is_multiple_of(BLOCK) || w.len() != rows * cols {
            return None;
        }
        let mut out = Self::empty(Format::Q8_0, rows, cols);
        for (j, src) in w.chunks_exact(cols).enumerate() {
            let (weights, scales, _) = out.row_mut(j);
            for (b, blk) in src.chunks_exact(BLOCK).enumerate() {
                let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = f16::from_f32(amax / 127.0);
                let inv = if d.to_f32() > 0.0 {
                    1.0 / d.to_f32()
                } else {
                    0.0
                };
                let dst = &mut weights[b * BLOCK..][..BLOCK];
                for (o, &v) in dst.iter_mut().zip(blk) {
                    *o = ((v * inv).round().clamp(-127.0, 127.0) as i16 + 128) as u8;
                }
                scales[2 * b..2 * b + 2].copy_from_slice(&d.to_le_bytes());
            }
        }
        Some(out)
    }

    /// Stacks weights of one format row-wise (a fused projection's parts). `None` when the parts
    /// differ in format or width.
    pub(crate) fn concat_rows(parts: &[&PackedWeight]) -> Option<Self> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.format != first.format || p.cols != first.cols)
        {
            return None;
        }
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        for p in parts {
            data.extend_from_slice(&p.data);
        }
        Some(Self {
            format: first.format,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            pairs: first.pairs,
            data,
        })
    }

    /// The f32 values, `(rows, cols)` row-major.
    #[cfg(test)]
    pub(crate) fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for j in 0..self.rows {
            let row = self.row(j);
            for c in 0..self.cols {
                let (b, i) = (c / BLOCK, c % BLOCK);
                let (pair, half) = (b / 2, b % 2);
                let u = match self.format {
                    Format::Q4_1 => (row.weights[pair * 32 + i] >> (4 * half)) & 0x0F,
                    Format::Q8_0 => row.weights[b * BLOCK + i],
                };
                let (d, m) = row.scale_offset(b);
                out.push(d * u as f32 + m);
            }
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// GGUF Q4_1 blocks for `w` (rows of `cols`), as llama.cpp's quantiser lays them out.
    pub(crate) fn q4_1_gguf_blocks(w: &[f32], cols: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for row in w.chunks_exact(cols) {
            for blk in row.chunks_exact(BLOCK) {
                let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                let q = |v: f32| ((v - min) * inv).round().clamp(0.0, 15.0) as u8;
                for i in 0..16 {
                    out.push(q(blk[i]) | (q(blk[i + 16]) << 4));
                }
            }
        }
        out
    }

    /// llama.cpp's dequantisation of GGUF Q4_1 blocks.
    fn q4_1_gguf_dequantize(bytes: &[u8]) -> Vec<f32> {
        let mut out = Vec::new();
        for blk in bytes.chunks_exact(20) {
            let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            let m = f16::from_le_bytes([blk[2], blk[3]]).to_f32();
            let mut vals = [0f32; 32];
            for i in 0..16 {
                vals[i] = d * (blk[4 + i] & 0x0F) as f32 + m;
                vals[i + 16] = d * (blk[4 + i] >> 4) as f32 + m;
            }
            out.extend_from_slice(&vals);
        }
        out
    }

    #[test]
    fn packing_gguf_blocks_keeps_their_values() {
        let (rows, cols) = (5, 96); // three blocks: a padded pair
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let bytes = q4_1_gguf_blocks(&w, cols);
        let packed = PackedWeight::from_gguf(Format::Q4_1, &bytes, rows, cols).expect("packs");
        assert_eq!(packed.dequantize(), q4_1_gguf_dequantize(&bytes));

        let mut q8 = Vec::new();
        for (b, blk) in w.chunks_exact(BLOCK).enumerate() {
            q8.extend_from_slice(&f16::from_f32(0.01 * (b + 1) as f32).to_le_bytes());
            q8.extend(blk.iter().map(|v| (v * 100.0) as i8 as u8));
        }
        let packed = PackedWeight::from_gguf(Format::Q8_0, &q8, rows, cols).expect("packs");
        let want: Vec<f32> = q8
            .chunks_exact(34)
            .flat_map(|blk| {
                let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                blk[2..].iter().map(move |&q| d * q as i8 as f32)
            })
            .collect();
        assert_eq!(packed.dequantize(), want);

        // Not whole blocks, or not the tensor's size: refused.
        assert!(PackedWeight::from_gguf(Format::Q4_1, &bytes, rows, cols + 1).is_none());
        assert!(PackedWeight::from_gguf(Format::Q4_1, &bytes[1..], rows, cols).is_none());
    }

    #[test]
    fn packing_candles_own_blocks_gives_candles_dequantised_values() -> candle_core::Result<()> {
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::{Device, Tensor};
        let (rows, cols) = (3, 160); // five blocks
        let w = Tensor::randn(0f32, 0.1, (rows, cols), &Device::Cpu)?;
        for (dtype, format) in [
            (GgmlDType::Q4_1, Format::Q4_1),
            (GgmlDType::Q8_0, Format::Q8_0),
        ] {
            let q = QTensor::quantize(&w, dtype)?;
            let want = q
                .dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let packed = PackedWeight::from_gguf(format, &q.data()?, rows, cols).expect("packs");
            assert_eq!(packed.dequantize(), want, "{format:?}");
        }
        Ok(())
    }

    #[test]
    fn q8_0_quantisation_is_within_half_a_step_and_rows_stack() {
        let (rows, cols) = (3, 64);
        let w: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = PackedWeight::quantize_q8_0(&w, rows, cols).expect("packs");
        for (blk, got) in w
            .chunks_exact(BLOCK)
            .zip(p.dequantize().chunks_exact(BLOCK))
        {
            let step = blk.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            for (a, b) in blk.iter().zip(got) {
                assert!(
                    (a - b).abs() <= 0.51 * step + 1e-3 * step.max(1e-6),
                    "{a} vs {b}"
                );
            }
        }
        let both = PackedWeight::concat_rows(&[&p, &p]).expect("same format");
        assert_eq!(both.rows(), 2 * rows);
        assert_eq!(both.dequantize(), [p.dequantize(), p.dequantize()].concat());
        let other = PackedWeight::quantize_q8_0(&w[..cols * 2], 1, 2 * cols).expect("packs");
        assert!(PackedWeight::concat_rows(&[&p, &other]).is_none());
    }
}
