//! The narrow kernel in plain Rust: for CPUs without AVX2, and the definition the vector
//! versions are tested against.

use super::pack::Row;
use super::{Format, QuantRows, BLOCK};

/// `out[b] = w . x_{r + b}` for one packed weight row.
pub(super) fn row(format: Format, w: &Row<'_>, x: &QuantRows, r: usize, out: &mut [f32]) {
    for (b, o) in out.iter_mut().enumerate() {
        let (q, lo, scale, sum) = (x.q(r + b), x.lo(r + b), x.scale(r + b), x.sum(r + b));
        let mut acc = 0f32;
        for blk in 0..2 * x.pairs {
            let (pair, half) = (blk / 2, blk % 2);
            let xq = q[blk * BLOCK..(blk + 1) * BLOCK]
                .iter()
                .zip(&lo[blk * BLOCK..(blk + 1) * BLOCK])
                .map(|(&h, &l)| 256 * h as i32 + l as i32);
            let dot: i32 = match format {
                Format::Q4_1 => w.weights[pair * 32..][..BLOCK]
                    .iter()
                    .zip(xq)
                    .map(|(&byte, v)| ((byte >> (4 * half)) & 0x0F) as i32 * v)
                    .sum(),
                Format::Q8_0 => w.weights[blk * BLOCK..][..BLOCK]
                    .iter()
                    .zip(xq)
                    .map(|(&u, v)| (u as i32 - 128) * v)
                    .sum(),
            };
            let (d, m) = w.scale_offset(blk);
            acc += dot as f32 * (d * scale[blk]);
            if format == Format::Q4_1 {
                acc += m * sum[blk];
            }
        }
        *o = acc;
    }
}
