//! The narrow kernel on AVX-512 BF16: activations rounded to bf16, weights widened to bf16 in
//! registers, `vdpbf16ps` summing pairs of products into f32 lanes.
//!
//! Per 64 weights and row of `x` this takes two dot products and one fused multiply-add (the
//! block scales), against the integer kernel's two dot products, a shift, a convert, a multiply
//! and a fused multiply-add ([`super::avx512`]): the integer steps are what bound a batch of
//! rows, the weights' bytes what bound a single row. Rounding the activations to bf16 (8
//! significant bits, relative to each value, so outlier channels round nothing else away) is
//! the price; the real-model tests state it against the f32 path.
//!
//! Every integer weight of a block, 0-15 (Q4_1) or 0-255 (Q8_0, stored as `q + 128`), is exact
//! in bf16. Q4_1's nibbles become bf16 by an OR: the bits `0x4300 | u` are the bf16 `128 + u`,
//! so each block's dot product carries `128` times the activation's block sum, which joins the
//! offset (`m - 128 d`) after the weights. Q8_0's bytes go through f32 (four widenings, four
//! converts and two narrowings per pair, shared by the tile's rows of `x`).
//!
//! A pair's 64 weights go in two registers, each holding 16 of the first block and 16 of the
//! second, so that lanes 0-7 of a product sum the first block and lanes 8-15 the second, and
//! one vector of the pair's two scales finishes both; [`Bf16Rows`] lays the activations out in
//! that order once per row.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use half::bf16;

use super::avx512::{chunk_scales, finish, first};
use super::pack::Row;
use super::{Format, BLOCK, GROUP, TILE};

/// Rows of `x` rounded to bf16 (to nearest, ties to even), per block pair in the kernel's
/// order: values 0-15 of the first block, 0-15 of the second, 16-31 of the first, 16-31 of the
/// second. A row is padded with zeros to whole block pairs.
pub(crate) struct Bf16Rows {
    /// Rows.
    pub(super) m: usize,
    /// Block pairs per row.
    pub(super) pairs: usize,
    /// `(m, pairs * 64)` bf16 bits.
    x: Vec<u16>,
    /// `(m, pairs * 2)`: each block's sum of its rounded values, which meets the offsets.
    sum: Vec<f32>,
}

impl Bf16Rows {
    pub(crate) fn new(x: &[f32], m: usize, k: usize) -> Self {
        let pairs = k.div_ceil(2 * BLOCK);
        let mut out = vec![0u16; m * pairs * 2 * BLOCK];
        let mut sum = vec![0f32; m * pairs * 2];
        for r in 0..m {
            let row = &x[r * k..(r + 1) * k];
            for (b, chunk) in row.chunks(BLOCK).enumerate() {
                let (pair, half) = (b / 2, b % 2);
                let dst = &mut out[(r * pairs + pair) * 2 * BLOCK..][..2 * BLOCK];
                let (bits, s) = rounded_block(chunk);
                // Value i of block `half` goes to quarter `2 (i / 16) + half`.
                dst[half * 16..][..16].copy_from_slice(&bits[..16]);
                dst[(2 + half) * 16..][..16].copy_from_slice(&bits[16..]);
                sum[r * pairs * 2 + b] = s;
            }
        }
        Self {
            m,
            pairs,
            x: out,
            sum,
        }
    }

    fn x(&self, r: usize) -> &[u16] {
        &self.x[r * self.pairs * 2 * BLOCK..][..self.pairs * 2 * BLOCK]
    }

    fn sum(&self, r: usize) -> &[f32] {
        &self.sum[r * self.pairs * 2..][..self.pairs * 2]
    }
}

/// A block of up to [`BLOCK`] values rounded to bf16 (to nearest, ties to even), zeros past
/// its end, and the f32 sum of the rounded values. Converted 32 at a time where the CPU has
/// AVX-512 BF16 (the kernels that read these rows need it): value by value, rounding and a
/// chain of dependent adds took as long per block as the block's products for a batch of rows.
pub(super) fn rounded_block(chunk: &[f32]) -> ([u16; BLOCK], f32) {
    debug_assert!(chunk.len() <= BLOCK);
    use std::arch::is_x86_feature_detected as has;
    if has!("avx512f") && has!("avx512bw") && has!("avx512bf16") {
        // SAFETY: the features were just detected.
        return unsafe { rounded_block_avx512(chunk) };
    }
    let mut bits = [0u16; BLOCK];
    let mut s = 0f32;
    for (b, &v) in bits.iter_mut().zip(chunk) {
        let v = bf16::from_f32(v);
        s += v.to_f32();
        *b = v.to_bits();
    }
    (bits, s)
}

/// [`rounded_block`] on AVX-512 BF16 (which also flushes subnormal inputs, below 1e-38, to
/// zero).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
fn rounded_block_avx512(chunk: &[f32]) -> ([u16; BLOCK], f32) {
    let n = chunk.len().min(BLOCK);
    // SAFETY: masked loads read only the block's `n` values; the store writes the 64 bytes of
    // `bits`.
    unsafe {
        let lo = _mm512_maskz_loadu_ps(first(n), chunk.as_ptr());
        let hi = if n > 16 {
            _mm512_maskz_loadu_ps(first(n - 16), chunk.as_ptr().add(16))
        } else {
            _mm512_setzero_ps()
        };
        let bf = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
        // Each rounded value is its bf16 bits in the top half of an f32.
        let widen =
            |h: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
        let s = _mm512_reduce_add_ps(_mm512_add_ps(
            widen(_mm512_castsi512_si256(bf)),
            widen(_mm512_extracti64x4_epi64::<1>(bf)),
        ));
        let mut bits = [0u16; BLOCK];
        _mm512_storeu_si512(bits.as_mut_ptr().cast(), bf);
        (bits, s)
    }
}

/// `tile[a][b] = rows[a] . x_{r + b}` for `b < n`.
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and BF16.
pub(super) unsafe fn tile(
    format: Format,
    rows: &[Row<'_>],
    x: &Bf16Rows,
    r: usize,
    n: usize,
    tile: &mut [[f32; GROUP]; TILE],
) {
    // SAFETY: the caller guarantees the features `kernel` is compiled for.
    unsafe { tile_kernel!(kernel, format, rows, x, r, n, tile) }
}

/// A pair's 64 weights as bf16 in [`Bf16Rows`]' order: Q4_1's as `128 + u`, Q8_0's as `u`.
///
/// # Safety
/// `at` must point at the pair's weights (32 bytes for Q4_1, 64 for Q8_0).
#[inline(always)]
unsafe fn widen<const Q4: bool>(at: *const u8) -> (__m512bh, __m512bh) {
    // SAFETY: the caller guarantees the bytes; `kernel`'s features cover the instructions.
    unsafe {
        if Q4 {
            // Byte i holds weight i of the first block (low nibble) and of the second (high).
            let w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(at.cast()));
            let magic = _mm512_set1_epi16(0x4300);
            // (w & 0x000F) | 0x4300: the first block; (w >> 4) | 0x4300: the second.
            let lo = _mm512_ternarylogic_epi32::<0xEA>(w, _mm512_set1_epi16(0x000F), magic);
            let hi = _mm512_or_si512(_mm512_srli_epi16::<4>(w), magic);
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_shuffle_i64x2::<0x44>(lo, hi)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_shuffle_i64x2::<0xEE>(lo, hi)),
            )
        } else {
            // The first block's 32 bytes, then the second's.
            let f = |o: usize| {
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(at.add(o).cast())))
            };
            (
                _mm512_cvtne2ps_pbh(f(32), f(0)),
                _mm512_cvtne2ps_pbh(f(48), f(16)),
            )
        }
    }
}

/// `W` weight rows (Q4_1 when `Q4`, else Q8_0) by `N` rows of `x` from `r`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
// Index loops over the tile's fixed-size arrays, which the compiler keeps in registers.
#[allow(clippy::needless_range_loop)]
fn kernel<const Q4: bool, const W: usize, const N: usize>(
    rows: &[Row<'_>],
    x: &Bf16Rows,
    r: usize,
    tile: &mut [[f32; GROUP]; TILE],
) {
    let pairs = x.pairs;
    let pb = if Q4 { 32 } else { 64 };
    let ws: [&Row<'_>; W] = std::array::from_fn(|a| &rows[a]);
    let xs: [&[u16]; N] = std::array::from_fn(|b| x.x(r + b));
    for a in 0..W {
        assert!(ws[a].weights.len() == pairs * pb && ws[a].scales.len() == pairs * 4);
        assert!(!Q4 || ws[a].offsets.len() == pairs * 4);
    }
    let two = _mm512_set1_epi32(2);
    let mut acc = [[_mm512_setzero_ps(); N]; W];
    let mut p = 0;
    while p < pairs {
        // 8 pairs' 16 scales per weight row, then each pair's two spread over 8 lanes each.
        let chunk = (pairs - p).min(8);
        let mut idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let ds = chunk_scales(&ws, p, chunk);
        for pp in p..p + chunk {
            for a in 0..W {
                // SAFETY: every row in `ws` holds `pairs` pairs of `pb` bytes; each row of `x`
                // holds `pairs * 64` values; every access stays inside pair `pp`.
                unsafe {
                    let (w0, w1) = widen::<Q4>(ws[a].weights.as_ptr().add(pp * pb));
                    let d = _mm512_permutexvar_ps(idx, ds[a]);
                    for b in 0..N {
                        let at = xs[b].as_ptr().add(pp * 64);
                        let x0 = _mm512_loadu_si512(at.cast());
                        let x1 = _mm512_loadu_si512(at.add(32).cast());
                        let dot = _mm512_dpbf16_ps(
                            _mm512_setzero_ps(),
                            w0,
                            std::mem::transmute::<__m512i, __m512bh>(x0),
                        );
                        let dot =
                            _mm512_dpbf16_ps(dot, w1, std::mem::transmute::<__m512i, __m512bh>(x1));
                        acc[a][b] = _mm512_fmadd_ps(dot, d, acc[a][b]);
                    }
                }
            }
            idx = _mm512_add_epi32(idx, two);
        }
        p += chunk;
    }
    // The offsets: Q4_1's `m` less the `128 d` of its bf16 weights `128 + u`.
    let sums: [&[f32]; N] = std::array::from_fn(|b| x.sum(r + b));
    // SAFETY: this kernel's features include the ones `finish` needs.
    unsafe { finish(Q4, true, &ws, &sums, acc, tile) };
}
