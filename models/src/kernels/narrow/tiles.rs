//! The narrow kernel on AMX tiles: bf16 products of a batch's rows with the packed weights,
//! sixteen outputs by up to sixteen rows of `x` per instruction.
//!
//! The bf16 kernel ([`super::bf16`]) takes two `vdpbf16ps` per 64 weights and row of `x`, so a
//! batch of jobs pays for each of its rows; a tile product (`tdpbf16ps`) multiplies 16 weight
//! rows by 32 inputs by up to 16 rows of `x` in one instruction. The weights are the A tile
//! (one row per output, one block of 32 inputs): each row's block widened to bf16 in registers
//! and stored to a buffer in L1, straight from the packed layout ([`super::pack`]), so the
//! decode keeps one copy of its weights. The rows of `x` are the B tile, laid out once per call
//! ([`TileRows`]): its columns are the rows of `x`, so a tile has as many columns as the batch
//! has rows and a single row is no wider than it must be.
//!
//! A block's scale and offset belong to its output, so the products cannot run on in the tile
//! across blocks: each block's 16 x m sums are stored (to L1) and meet the scales in AVX-512,
//! `y += d C + m s` with `s` the block's sum of `x`. The sums are laid out as `y^T` is
//! (output-major), `16 m` values in `m` registers, so the scales spread over them by a
//! permutation per register rather than a broadcast per output.
//!
//! Weights are widened exactly: Q4_1's nibbles `u` by a table lookup (`vpermw`) to the bf16
//! `u`, Q8_0's bytes to the bf16 `q` (its offset is then zero). The activations are rounded to
//! bf16 (as the bf16 kernel rounds them); sums are f32. Each output depends only on its own
//! row of `x` (a tile element reads one row of A and one column of B, and the scaling is per
//! element), so a job's outputs are the same alone and in a batch.
//!
//! One job decodes 10-18% slower on this kernel than on the bf16 one (the stores and tile
//! loads between the registers and the tiles are latency a single row does not hide), and a row count cannot
//! pick the kernel without a job's tokens depending on its batch; so this kernel is asked for
//! (`crate::decode_products`), for nodes that serve batches.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use half::bf16;

use super::avx512::first;
use super::pack::PackedWeight;
use super::{Format, BLOCK};

/// Outputs per tile (its rows), and the most rows of `x` (its columns).
const TILE: usize = 16;

/// Rows of `x` in bf16 as B tiles, one per block of 32 inputs: row `i` of block `b`'s tile
/// holds, for each row `r` of `x`, the pair `(x[r][32 b + 2 i], x[r][32 b + 2 i + 1])`. A row
/// is padded with zeros to whole block pairs, as the packed weights are.
pub(crate) struct TileRows {
    /// Rows (at most [`TILE`]).
    pub(super) m: usize,
    /// Block pairs per row.
    pairs: usize,
    /// `2 pairs` tiles of `16 x 2 m` bf16 bits.
    b: Vec<u16>,
    /// `(2 pairs, 16)`: each block's sum of each row's rounded values (lanes past `m` zero),
    /// which meets the offsets.
    sum: Vec<f32>,
    /// `m` registers' worth of lane indices: for register `c`, lane `l`, the output
    /// `(16 c + l) / m` and the row `(16 c + l) % m` of element `16 c + l` of `y^T`.
    output_of: Vec<[u32; TILE]>,
    row_of: Vec<[u32; TILE]>,
}

impl TileRows {
    pub(crate) fn new(x: &[f32], m: usize, k: usize) -> Self {
        assert!(
            (1..=TILE).contains(&m),
            "a tile takes 1 to {TILE} rows, not {m}"
        );
        let pairs = k.div_ceil(2 * BLOCK);
        let blocks = 2 * pairs;
        let mut b = vec![0u16; blocks * BLOCK * m];
        let mut sum = vec![0f32; blocks * TILE];
        for r in 0..m {
            let row = &x[r * k..(r + 1) * k];
            for (blk, chunk) in row.chunks(BLOCK).enumerate() {
                let tile = &mut b[blk * BLOCK * m..][..BLOCK * m];
                let (bits, s) = super::bf16::rounded_block(chunk);
                for (i, pair) in bits.chunks_exact(2).enumerate() {
                    tile[(i * m + r) * 2..][..2].copy_from_slice(pair);
                }
                sum[blk * TILE + r] = s;
            }
        }
        Self {
            m,
            pairs,
            b,
            sum,
            output_of: (0..m)
                .map(|c| std::array::from_fn(|l| ((16 * c + l) / m) as u32))
                .collect(),
            row_of: (0..m)
                .map(|c| std::array::from_fn(|l| ((16 * c + l) % m) as u32))
                .collect(),
        }
    }
}

/// Tile configuration for `m` rows of `x`: tiles 0-1 the sums (16 outputs by `m`), 2-3 the
/// weights (16 outputs by 32 inputs), 4-5 the rows of `x` (16 input pairs by `m`).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new(m: usize) -> Self {
        let mut c = [0u8; 64];
        c[0] = 1;
        for (t, colsb) in [4 * m, 4 * m, 64, 64, 4 * m, 4 * m].into_iter().enumerate() {
            c[16 + 2 * t] = colsb as u8;
            c[48 + t] = TILE as u8;
        }
        Self(c)
    }
}

/// Block pairs a group widens before it multiplies them: the tile products of a chunk run back
/// to back, apart from the stores that fed them and the loads that read their sums, so that
/// neither waits on the other.
const CHUNK: usize = 4;

/// Buffers of one group of 16 outputs: the A tiles of a chunk's blocks and their products.
#[repr(C, align(64))]
struct Group {
    a: [[u16; TILE * BLOCK]; 2 * CHUNK],
    c: [[f32; TILE * TILE]; 2 * CHUNK],
}

/// `out[(j - first) * m + r] = w_j . x_r` for the weight rows `first..` that `out` has room
/// for and every row `r` of `x`.
///
/// # Safety
/// The CPU must have AMX-TILE and AMX-BF16 with the tile data granted to this process
/// ([`crate::kernels::amx::available`]), and AVX-512 F, BW, VL, BF16 and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
pub(super) unsafe fn weight_rows(w: &PackedWeight, first: usize, x: &TileRows, out: &mut [f32]) {
    let m = x.m;
    let n = out.len() / m;
    assert!(x.pairs == w.pairs() && first + n <= w.rows());
    let config = TileConfig::new(m);
    // SAFETY: the caller guarantees AMX; the configuration is a valid palette-1 layout.
    unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack)) };
    let mut group = Group {
        a: [[0; TILE * BLOCK]; 2 * CHUNK],
        c: [[0.0; TILE * TILE]; 2 * CHUNK],
    };
    for g0 in (0..n).step_by(TILE) {
        let rows = (n - g0).min(TILE);
        if rows < TILE {
            // Outputs past the last: zero weights, zero sums.
            group.a = [[0; TILE * BLOCK]; 2 * CHUNK];
        }
        let y = &mut out[g0 * m..(g0 + rows) * m];
        // SAFETY: the caller's features; `rows` rows from `first + g0` exist (asserted above).
        unsafe {
            by_rows!(
                w.format() == Format::Q4_1,
                m,
                outputs(w, first + g0, rows, x, &mut group, y),
                [1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16]
            )
        }
    }
}

/// `$f::<Q4, M>(args)` for the weight's format (`Q4`: Q4_1, else Q8_0) and the rows of `x`
/// (`M`, one of the listed): with `M` known, the accumulators and lane indices stay in
/// registers.
macro_rules! by_rows {
    ($q4:expr, $m:expr, $f:ident $args:tt, [$($n:literal)*]) => {
        match ($q4, $m) {
            $(
                (true, $n) => $f::<true, $n> $args,
                (false, $n) => $f::<false, $n> $args,
            )*
            _ => unreachable!("1 to 16 rows of x"),
        }
    };
}
use by_rows;

/// The 32 bf16 values of a pair's two blocks for one weight row, into `a0` and `a1`.
///
/// # Safety
/// `at` points at the pair's weights (32 bytes for Q4_1, 64 for Q8_0); `a0`, `a1` at 32 u16.
#[inline(always)]
unsafe fn widen<const Q4: bool>(at: *const u8, table: __m512i, a0: *mut u16, a1: *mut u16) {
    // SAFETY: the caller guarantees the memory; the enclosing function the features.
    unsafe {
        if Q4 {
            // Byte i: weight i of the first block (low nibble) and of the second (high); the
            // table maps index i (its low five bits) to the bf16 of `i & 15`.
            let w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(at.cast()));
            let lo = _mm512_permutexvar_epi16(w, table);
            let hi = _mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(w), table);
            _mm512_storeu_si512(a0.cast(), lo);
            _mm512_storeu_si512(a1.cast(), hi);
        } else {
            // Q8_0's `u = q + 128`, as `q`.
            let q = |o: usize| {
                let u = _mm512_cvtepu8_epi32(_mm_loadu_si128(at.add(o).cast()));
                _mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(128)))
            };
            let lo = _mm512_cvtne2ps_pbh(q(16), q(0));
            let hi = _mm512_cvtne2ps_pbh(q(48), q(32));
            _mm512_storeu_si512(a0.cast(), std::mem::transmute::<__m512bh, __m512i>(lo));
            _mm512_storeu_si512(a1.cast(), std::mem::transmute::<__m512bh, __m512i>(hi));
        }
    }
}

/// Outputs `j0..j0 + rows` (at most 16) by every row of `x`, into `y` (`rows x m`).
///
/// # Safety
/// As [`weight_rows`], with the tile configuration for `x.m` loaded; rows `j0..j0 + rows` of
/// `w` exist.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
// Index loops over the accumulators, fixed-size arrays the compiler keeps in registers.
#[allow(clippy::needless_range_loop)]
unsafe fn outputs<const Q4: bool, const M: usize>(
    w: &PackedWeight,
    j0: usize,
    rows: usize,
    x: &TileRows,
    group: &mut Group,
    y: &mut [f32],
) {
    let m = M;
    debug_assert_eq!(x.m, M);
    let pb = w.format().pair_bytes();
    let stride = w.row_stride();
    // The group's rows as one slice, so that every pointer below (each row's weights, the
    // gathers of their scales and offsets) stays inside what it was taken from; the row's
    // parts lie at the same offsets in every row.
    let Some(bytes) = w.bytes_of_rows(j0, rows) else {
        unreachable!("the caller checked rows {j0}..{} exist", j0 + rows)
    };
    let row0 = w.row(j0);
    let part_at = |part: &[u8]| part.as_ptr() as usize - row0.weights.as_ptr() as usize;
    let (scales_at, offsets_at) = (part_at(row0.scales), part_at(row0.offsets));
    let base = bytes.as_ptr();
    let table: [u16; 32] = std::array::from_fn(|i| bf16::from_f32((i & 15) as f32).to_bits());
    // SAFETY: `table` is 64 bytes.
    let table = unsafe { _mm512_loadu_si512(table.as_ptr().cast()) };
    // Row o's scales (and offsets) lie `o * stride` bytes after row j0's.
    let index = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(stride as i32),
    );
    let live = first(rows);
    let mut acc = [_mm512_setzero_ps(); M];
    // SAFETY: the index rows are 16 lanes each, M of them.
    let (output_of, row_of): ([__m512i; M], [__m512i; M]) = unsafe {
        (
            std::array::from_fn(|v| _mm512_loadu_si512(x.output_of[v].as_ptr().cast())),
            std::array::from_fn(|v| _mm512_loadu_si512(x.row_of[v].as_ptr().cast())),
        )
    };
    let b_tile = BLOCK * m;
    for p0 in (0..x.pairs).step_by(CHUNK) {
        let chunk = (x.pairs - p0).min(CHUNK);
        for o in 0..rows {
            // The next group's same rows and pairs, a group ahead (its bytes lie 16 rows on):
            // sixteen rows read a little at a time are more streams than the hardware
            // prefetcher follows. The row's scales and offsets go with its first chunk.
            let row = base.wrapping_add(o * stride);
            let ahead = row.wrapping_add(TILE * stride);
            // A prefetch is a hint and does not fault; the addresses are only formed.
            for line in (p0 * pb..(p0 + chunk) * pb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast());
            }
            if p0 == 0 {
                for line in (x.pairs * pb..stride).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast());
                }
            }
            for q in 0..chunk {
                // SAFETY: row j0 + o is in `bytes`; pair p0 + q's bytes are inside it; each
                // buffer holds 16 rows of 32 u16.
                unsafe {
                    widen::<Q4>(
                        row.add((p0 + q) * pb),
                        table,
                        group.a[2 * q].as_mut_ptr().add(o * BLOCK),
                        group.a[2 * q + 1].as_mut_ptr().add(o * BLOCK),
                    )
                };
            }
        }
        // SAFETY: per pair, the tiles read two 1 KB A buffers and blocks 2p's and 2p + 1's B
        // tiles (16 rows of 4m bytes each, inside `x.b`), and write 16 rows of 4m bytes to two
        // 1 KB C buffers, as the configuration loaded by the caller sizes them; `chunk` pairs
        // of buffers exist.
        unsafe {
            std::arch::asm!(
                "2:",
                "tileloadd tmm2, [{a} + {sa}]",
                "tileloadd tmm4, [{b0} + {sb}]",
                "tilezero tmm0",
                "tdpbf16ps tmm0, tmm2, tmm4",
                "tileloadd tmm3, [{a} + {sa} + 1024]",
                "tileloadd tmm5, [{b1} + {sb}]",
                "tilezero tmm1",
                "tdpbf16ps tmm1, tmm3, tmm5",
                "tilestored [{c} + {sb}], tmm0",
                "tilestored [{c} + {sb} + 1024], tmm1",
                "add {a}, 2048",
                "add {c}, 2048",
                "add {b0}, {bpair}",
                "add {b1}, {bpair}",
                "dec {n}",
                "jnz 2b",
                a = inout(reg) group.a.as_ptr() => _,
                c = inout(reg) group.c.as_mut_ptr() => _,
                b0 = inout(reg) x.b.as_ptr().add(2 * p0 * b_tile) => _,
                b1 = inout(reg) x.b.as_ptr().add((2 * p0 + 1) * b_tile) => _,
                n = inout(reg) chunk => _,
                bpair = in(reg) 4 * b_tile,
                sa = in(reg) 2 * BLOCK,
                sb = in(reg) 4 * m,
                options(nostack),
            );
        }
        for q in 0..chunk {
            let p = p0 + q;
            // Each row's two f16 scales (and offsets) of this pair, one 32-bit lane per
            // output.
            // SAFETY: the masked-off lanes are not read; row j0 + o's scales (and offsets)
            // hold `pairs` pairs of two f16, inside `bytes`.
            let (d, off) = unsafe {
                let scales = base.add(scales_at + 4 * p);
                let d = _mm512_mask_i32gather_epi32::<1>(
                    _mm512_setzero_si512(),
                    live,
                    index,
                    scales.cast(),
                );
                let off = if Q4 {
                    let offsets = base.add(offsets_at + 4 * p);
                    _mm512_mask_i32gather_epi32::<1>(
                        _mm512_setzero_si512(),
                        live,
                        index,
                        offsets.cast(),
                    )
                } else {
                    _mm512_setzero_si512()
                };
                (d, off)
            };
            for half in 0..2 {
                let f16s = |v: __m512i| {
                    let v = if half == 0 {
                        v
                    } else {
                        _mm512_srli_epi32::<16>(v)
                    };
                    _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v))
                };
                let (d, off) = (f16s(d), f16s(off));
                // SAFETY: block 2p + half's 16 sums exist.
                let s = unsafe { _mm512_loadu_ps(x.sum.as_ptr().add((2 * p + half) * TILE)) };
                let c = &group.c[2 * q + half];
                for v in 0..M {
                    // SAFETY: `c` holds 16 m sums.
                    let sums = unsafe { _mm512_loadu_ps(c.as_ptr().add(16 * v)) };
                    let (o, r) = (output_of[v], row_of[v]);
                    acc[v] = _mm512_fmadd_ps(sums, _mm512_permutexvar_ps(o, d), acc[v]);
                    if Q4 {
                        acc[v] = _mm512_fmadd_ps(
                            _mm512_permutexvar_ps(o, off),
                            _mm512_permutexvar_ps(r, s),
                            acc[v],
                        );
                    }
                }
            }
        }
    }
    let len = rows * m;
    for (v, a) in acc.iter().enumerate() {
        let at = 16 * v;
        if at >= len {
            break;
        }
        // SAFETY: the mask keeps the store inside `y`'s `rows * m` elements.
        unsafe { _mm512_mask_storeu_ps(y.as_mut_ptr().add(at), first(len - at), *a) };
    }
}
