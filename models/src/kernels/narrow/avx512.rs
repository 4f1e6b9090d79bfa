//! The narrow kernel on AVX-512 with VNNI: one block pair (64 weights) per register.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes and sums each four into a 32-bit lane: lanes
//! 0-7 hold the first block's partial sums and 8-15 the second's, so a pair's two scales go on
//! as one vector, spread from 16 blocks' scales converted at once ([`QuantRows`] lays out the
//! activation's side). Both formats' weights are the unsigned side as they are (Q4_1's
//! nibbles, Q8_0's `q + 128`); the offsets, `m` times the activation block's sum, are one short
//! dot product per output after the weights.
//!
//! A tile is up to [`TILE`] weight rows by up to [`GROUP`] rows of `x`, each output its own
//! accumulator: one output's sum is a chain of dependent multiply-adds, and the tile's
//! independent chains are what keeps the core busy while the weights stream in.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::pack::Row;
use super::{Format, QuantRows, GROUP, TILE};

/// `tile[a][b] = rows[a] . x_{r + b}` for `b < n`.
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and VNNI.
pub(super) unsafe fn tile(
    format: Format,
    rows: &[Row<'_>],
    x: &QuantRows,
    r: usize,
    n: usize,
    tile: &mut [[f32; GROUP]; TILE],
) {
    // SAFETY: the caller guarantees the features `kernel` is compiled for.
    unsafe { tile_kernel!(kernel, format, rows, x, r, n, tile) }
}

/// The mask of the first `n` of 16 lanes.
pub(super) fn first(n: usize) -> __mmask16 {
    ((1u32 << n.min(16)) - 1) as __mmask16
}

/// `W` weight rows (Q4_1 when `Q4`, else Q8_0) by `N` rows of `x` from `r`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
// Index loops over the tile's fixed-size arrays, which the compiler keeps in registers.
#[allow(clippy::needless_range_loop)]
fn kernel<const Q4: bool, const W: usize, const N: usize>(
    rows: &[Row<'_>],
    x: &QuantRows,
    r: usize,
    tile: &mut [[f32; GROUP]; TILE],
) {
    let pairs = x.pairs;
    let pb = if Q4 { 32 } else { 64 };
    let ws: [&Row<'_>; W] = std::array::from_fn(|a| &rows[a]);
    let qs: [&[i8]; N] = std::array::from_fn(|b| x.q(r + b));
    let los: [&[i8]; N] = std::array::from_fn(|b| x.lo(r + b));
    let lanes: [&[f32]; N] = std::array::from_fn(|b| x.lanes(r + b));
    for a in 0..W {
        assert!(ws[a].weights.len() == pairs * pb && ws[a].scales.len() == pairs * 4);
        assert!(!Q4 || ws[a].offsets.len() == pairs * 4);
    }
    let low = _mm512_set1_epi8(0x0F);
    let two = _mm512_set1_epi32(2);
    let mut acc = [[_mm512_setzero_ps(); N]; W];
    let mut p = 0;
    while p < pairs {
        // 8 pairs' 16 scales per weight row, then each pair's two spread over 8 lanes each.
        let chunk = (pairs - p).min(8);
        let mut idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let ds = chunk_scales(&ws, p, chunk);
        for pp in p..p + chunk {
            // SAFETY: every row in `ws` holds `pairs` pairs of `pb` bytes; each row of `x`
            // holds `pairs * 64` bytes and `pairs * 16` lane scales; every access stays inside
            // pair `pp`.
            unsafe {
                let mut xv = [_mm512_setzero_si512(); N];
                let mut xl = [_mm512_setzero_si512(); N];
                for b in 0..N {
                    xv[b] = _mm512_loadu_si512(qs[b].as_ptr().add(pp * 64).cast());
                    xl[b] = _mm512_loadu_si512(los[b].as_ptr().add(pp * 64).cast());
                }
                for a in 0..W {
                    let at = ws[a].weights.as_ptr().add(pp * pb);
                    let wv = if Q4 {
                        // The 32 bytes in both halves, the upper half shifted to its high
                        // nibbles: the second block.
                        let both = _mm512_broadcast_i64x4(_mm256_loadu_si256(at.cast()));
                        _mm512_and_si512(_mm512_mask_srli_epi16::<4>(both, 0xFFFF_0000, both), low)
                    } else {
                        _mm512_loadu_si512(at.cast())
                    };
                    let d = _mm512_permutexvar_ps(idx, ds[a]);
                    for b in 0..N {
                        // 256 hi + lo: the high bytes' sums shifted up, then the low bytes'.
                        let hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv[b]);
                        let dot = _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(hi), wv, xl[b]);
                        let scale =
                            _mm512_mul_ps(d, _mm512_loadu_ps(lanes[b].as_ptr().add(pp * 16)));
                        acc[a][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[a][b]);
                    }
                }
                idx = _mm512_add_epi32(idx, two);
            }
        }
        p += chunk;
    }
    let sums: [&[f32]; N] = std::array::from_fn(|b| x.sum(r + b));
    // SAFETY: this kernel's features include the ones `finish` needs.
    unsafe { finish(Q4, false, &ws, &sums, acc, tile) };
}

/// The scales of pairs `p..p + chunk` (at most 8) of each weight row, 16 f16 converted at once.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
#[inline]
pub(super) fn chunk_scales<const W: usize>(
    ws: &[&Row<'_>; W],
    p: usize,
    chunk: usize,
) -> [__m512; W] {
    assert!(chunk <= 8 && ws.iter().all(|w| w.scales.len() >= 4 * (p + chunk)));
    // SAFETY: the masked load reads the `2 * chunk` scales of pairs `p..p + chunk`, inside the
    // row's scales (asserted; the masked-off lanes are not read).
    std::array::from_fn(|a| unsafe {
        let at = ws[a].scales.as_ptr().add(4 * p).cast::<i16>();
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(2 * chunk), at))
    })
}

/// Finishes a tile of `W` weight rows by `N` rows of `x`: `tile[a][b]` is the lanes of
/// `acc[a][b]` summed, plus the offsets: over row `a`'s blocks, its offset times the block sum
/// of row `b` of `x` (`sums[b]`), 16 blocks at a time. The offset is Q4_1's `m` (less `128 d`
/// when `less_128d`: the bf16 kernel's weights are `128 + u`) or Q8_0's `-128 d` (its weights
/// are `q + 128`).
///
/// Each weight row's offsets are converted once for the tile's rows of `x`, and four outputs'
/// lanes are summed in one tree ([`sum_lanes4`]). Done per output (a loop over the row's blocks
/// and a reduction of its own), this was about 30% of the bf16 kernel's time on the model's
/// 576-wide rows. Each output takes the same additions in the same order as alone, so a row's
/// result does not depend on the rows beside it.
///
/// Inlined into each kernel (not a function with the features of its own, which the compiler
/// would not inline), so that the accumulators stay in registers: as a call, the 16 of them
/// went through memory and the epilogue took 11% of an 8-job step.
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and F16C.
#[inline(always)]
// Index loops over the tile's fixed-size arrays, which the compiler keeps in registers.
#[allow(clippy::needless_range_loop)]
pub(super) unsafe fn finish<const W: usize, const N: usize>(
    q4: bool,
    less_128d: bool,
    ws: &[&Row<'_>; W],
    sums: &[&[f32]; N],
    mut acc: [[__m512; N]; W],
    tile: &mut [[f32; GROUP]; TILE],
) {
    let blocks = sums[0].len();
    assert!(sums.iter().all(|s| s.len() == blocks));
    assert!(ws
        .iter()
        .all(|w| w.scales.len() >= 2 * blocks && (!q4 || w.offsets.len() >= 2 * blocks)));
    // SAFETY: the caller guarantees the features of the intrinsics below; the memory each
    // one reads is stated where it reads it.
    unsafe {
        let mut k = 0;
        while k < blocks {
            let mask = first(blocks - k);
            // Masked loads of blocks `k..min(k + 16, blocks)`, inside each row's `blocks`
            // scales and offsets and each activation's `blocks` sums (asserted).
            let s: [__m512; N] =
                std::array::from_fn(|b| _mm512_maskz_loadu_ps(mask, sums[b].as_ptr().add(k)));
            for a in 0..W {
                let m = {
                    let at = ws[a].scales.as_ptr().add(2 * k).cast::<i16>();
                    let d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, at));
                    if q4 {
                        let at = ws[a].offsets.as_ptr().add(2 * k).cast::<i16>();
                        let m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, at));
                        if less_128d {
                            _mm512_fmadd_ps(d, _mm512_set1_ps(-128.0), m)
                        } else {
                            m
                        }
                    } else {
                        _mm512_mul_ps(d, _mm512_set1_ps(-128.0))
                    }
                };
                for b in 0..N {
                    acc[a][b] = _mm512_fmadd_ps(m, s[b], acc[a][b]);
                }
            }
            k += 16;
        }
        let outputs = W * N;
        let mut i = 0;
        while i < outputs {
            let v = std::array::from_fn(|j| {
                let o = i + j;
                if o < outputs {
                    acc[o / N][o % N]
                } else {
                    _mm512_setzero_ps()
                }
            });
            let total = sum_lanes4(v);
            for (j, &t) in total.iter().enumerate().take(outputs - i) {
                let o = i + j;
                tile[o / N][o % N] = t;
            }
            i += 4;
        }
    }
}

/// The lanes of each of four vectors summed, pairing lanes as `_mm512_reduce_add_ps` does
/// (`i` with `i + 8`, then `i + 4`, `i + 2`, `i + 1`), so that each sum equals that
/// reduction's: four reductions in 14 instructions instead of 32.
///
/// # Safety
/// The CPU must have AVX-512 F.
#[inline(always)]
pub(super) unsafe fn sum_lanes4(v: [__m512; 4]) -> [f32; 4] {
    // Each 256-bit half of `t01` is one input with lanes i and i + 8 added; each 128-bit
    // quarter of `u` one input with lanes i, i + 4 added to that.
    let halves = |x: __m512, y: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        )
    };
    let (t01, t23) = (halves(v[0], v[1]), halves(v[2], v[3]));
    let u = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0b10_00_10_00>(t01, t23),
        _mm512_shuffle_f32x4::<0b11_01_11_01>(t01, t23),
    );
    let w = _mm512_add_ps(u, _mm512_permute_ps::<0b01_00_11_10>(u));
    let z = _mm512_add_ps(w, _mm512_movehdup_ps(w));
    let lanes = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
        z,
    );
    let mut out = [0f32; 4];
    // SAFETY: `out` holds the four floats stored.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), _mm512_castps512_ps128(lanes)) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[ignore = "needs a CPU with AVX-512F; `make test` runs it where the CPU has AVX-512F (`make test-avx512f`)"]
    fn four_lane_sums_equal_the_reduction_of_each_vector_alone_on_avx512f() {
        assert!(
            std::arch::is_x86_feature_detected!("avx512f"),
            "this test needs a CPU with AVX-512F, where the AVX-512 decode kernels run"
        );
        // Magnitudes from 1e-8 to 1e8 with both signs, so that any other pairing of the lanes
        // rounds differently.
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let mantissa = (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            mantissa * 10f32.powi((seed % 17) as i32 - 8)
        };
        for _ in 0..1000 {
            let lanes: [[f32; 16]; 4] = std::array::from_fn(|_| std::array::from_fn(|_| next()));
            // SAFETY: AVX-512F was detected above; each load reads 16 floats of `lanes`.
            let (got, want) = unsafe {
                let v = lanes.map(|l| _mm512_loadu_ps(l.as_ptr()));
                (sum_lanes4(v), v.map(|v| _mm512_reduce_add_ps(v)))
            };
            assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "{lanes:?}");
        }
    }
}
