//! The narrow kernel on AVX2: one block (32 weights) per register, `vpmaddubsw` for the
//! `u8 x i8` products (pairs summed into 16 bits, which cannot overflow: at most
//! `2 * 127 * 127`) and `vpmaddwd` to widen them to 32-bit lanes.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::pack::Row;
use super::{Format, QuantRows, GROUP};

/// `out[b] = w . x_{r + b}` for one packed weight row and up to [`GROUP`] rows of `x`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub(super) unsafe fn row(format: Format, w: &Row<'_>, x: &QuantRows, r: usize, out: &mut [f32]) {
    macro_rules! go {
        ($($n:literal)*) => {
            match out.len() {
                $($n => blocks::<$n>(format, w, x, r, out),)*
                _ => unreachable!("at most GROUP rows of x"),
            }
        };
    }
    const _: () = assert!(GROUP == 4);
    // SAFETY: the caller guarantees the features `blocks` is compiled for.
    unsafe { go!(1 2 3 4) }
}

/// Two f16 at `at` (little-endian) as f32.
#[target_feature(enable = "avx2,f16c")]
fn two_f16(bytes: &[u8], at: usize) -> [f32; 2] {
    let bits = i32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    let mut v = [0f32; 4];
    // SAFETY: `v` holds 4 floats.
    unsafe { _mm_storeu_ps(v.as_mut_ptr(), _mm_cvtph_ps(_mm_cvtsi32_si128(bits))) };
    [v[0], v[1]]
}

/// The eight 32-bit partial sums of `w` (unsigned) times the 32 signed bytes at `x`, with the
/// signs of `sign` moved onto `x` when given.
///
/// # Safety
/// AVX2; 32 bytes readable at `x`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn block_dot(x: *const i8, w: __m256i, sign: Option<__m256i>, ones: __m256i) -> __m256i {
    // SAFETY: as the caller guarantees.
    let mut x = unsafe { _mm256_loadu_si256(x.cast()) };
    if let Some(s) = sign {
        x = _mm256_sign_epi8(x, s);
    }
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)]
fn blocks<const N: usize>(format: Format, w: &Row<'_>, x: &QuantRows, r: usize, out: &mut [f32]) {
    let pairs = x.pairs;
    let pb = format.pair_bytes();
    debug_assert_eq!(w.weights.len(), pairs * pb);
    let qs: [&[i8]; N] = std::array::from_fn(|b| x.q(r + b));
    let los: [&[i8]; N] = std::array::from_fn(|b| x.lo(r + b));
    let scale: [&[f32]; N] = std::array::from_fn(|b| x.scale(r + b));
    let sum: [&[f32]; N] = std::array::from_fn(|b| x.sum(r + b));
    let low = _mm256_set1_epi8(0x0F);
    let flip = _mm256_set1_epi8(-128);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); N];
    // Q4_1's offsets times the activation sums, one scalar per row.
    let mut offsets = [0f32; N];
    for p in 0..pairs {
        let d = two_f16(w.scales, 4 * p);
        let m = match format {
            Format::Q4_1 => two_f16(w.offsets, 4 * p),
            Format::Q8_0 => [0.0; 2],
        };
        // SAFETY: `w.weights` holds `pairs` pairs of `pb` bytes; each row of `x` holds
        // `pairs * 64` bytes; every access below stays inside pair `p`.
        unsafe {
            let pair = w.weights.as_ptr().add(p * pb);
            let (wa, wb, sa, sb) = match format {
                Format::Q4_1 => {
                    let nib = _mm256_loadu_si256(pair.cast());
                    let lo = _mm256_and_si256(nib, low);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(nib), low);
                    // Unsigned nibbles: no sign to move.
                    (lo, hi, None, None)
                }
                Format::Q8_0 => {
                    // `u = q + 128` back to the signed `q`, then `|q|` with the sign moved
                    // onto the activation (`vpmaddubsw` takes one unsigned side).
                    let a = _mm256_xor_si256(_mm256_loadu_si256(pair.cast()), flip);
                    let b = _mm256_xor_si256(_mm256_loadu_si256(pair.add(32).cast()), flip);
                    (
                        _mm256_sign_epi8(a, a),
                        _mm256_sign_epi8(b, b),
                        Some(a),
                        Some(b),
                    )
                }
            };
            for b in 0..N {
                // `256 hi + lo` per block: the high bytes' sums shifted up, plus the low bytes'.
                let dots = |bytes: &[i8], off: usize, w: __m256i, sign: Option<__m256i>| {
                    block_dot(bytes.as_ptr().add(p * 64 + off), w, sign, ones)
                };
                let da = _mm256_add_epi32(
                    _mm256_slli_epi32::<8>(dots(qs[b], 0, wa, sa)),
                    dots(los[b], 0, wa, sa),
                );
                let db = _mm256_add_epi32(
                    _mm256_slli_epi32::<8>(dots(qs[b], 32, wb, sb)),
                    dots(los[b], 32, wb, sb),
                );
                let (s0, s1) = (scale[b][2 * p], scale[b][2 * p + 1]);
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(da), _mm256_set1_ps(d[0] * s0), acc[b]);
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(db), _mm256_set1_ps(d[1] * s1), acc[b]);
                offsets[b] += m[0] * sum[b][2 * p] + m[1] * sum[b][2 * p + 1];
            }
        }
    }
    for b in 0..N {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[b]) };
        out[b] = lanes.iter().sum::<f32>() + offsets[b];
    }
}
