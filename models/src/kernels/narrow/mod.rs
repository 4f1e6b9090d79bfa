//! Narrow decode weights: `x W^T` for a few rows of `x` with `W` in 4- or 8-bit blocks.
//!
//! A decode step streams every weight once for a handful of rows, so its time is the bytes of
//! the weights over the memory bandwidth: 540 MB of f32 per token for SmolLM2-135M, 66 MB for
//! its GGUF's own Q4_1 blocks plus 30 MB for the Q8_0 embedding that is also the output head.
//! As in llama.cpp's CPU backend, the rows of `x` are quantised per block of 32 and each block
//! pair of a weight row meets them in integer dot products (`vpdpbusd` with AVX-512 VNNI,
//! `vpmaddubsw` with AVX2), scaled in f32. Unlike llama.cpp, an activation takes two signed
//! bytes, not one ([`QuantRows`]): one byte per value changed greedy answers against the f32
//! path on this model (SmolLM2's hidden states carry outlier channels that round a block's
//! other values away), two cost a second integer product per block and keep the decode within
//! float noise of f32 (measured in the real-model tests). Where the CPU has AVX-512 BF16 the
//! default is bf16 products instead ([`bf16`]).
//!
//! - [`pack`]: the packed layout ([`PackedWeight`]): from GGUF blocks (Q4_1, Q8_0) without loss,
//!   or quantised from f32 to Q8_0 (a merged expert, a checkpoint with another format);
//! - [`avx512`], [`avx2`] and [`portable`]: the same function per instruction set, picked at run
//!   time ([`Isa::best_integer`]);
//! - [`bf16`]: the products in bf16 instead (AVX-512 BF16), activations rounded to bf16: fewer
//!   steps per product, what a batch of jobs is bound by, for a rounding the model's tests
//!   state (`crate::decode_products` chooses);
//! - [`tiles`]: the same rounding on AMX tiles, all of a step's rows in one product per block:
//!   for batches, slower for one row.
//!
//! The weights' values are exactly the GGUF's (the f32 path dequantises the same blocks). Each
//! output is the same sum whatever the other rows of `x`, so a job's tokens are the same alone
//! and in a batch on a given CPU.

/// `$kernel::<Q4, W, N>($rows, $x, $r, $tile)`, the AVX-512 kernels' instance for the weight's
/// format (`Q4`: Q4_1, else Q8_0), the tile's weight rows (`W`: [`TILE`] or 1) and its rows of
/// `x` (`N`: 1 to [`GROUP`]).
#[cfg(target_arch = "x86_64")]
macro_rules! tile_kernel {
    ($kernel:ident, $format:expr, $rows:expr, $x:expr, $r:expr, $n:expr, $tile:expr) => {{
        const _: () = assert!(TILE == 4 && GROUP == 4);
        match ($format, $rows.len(), $n) {
            (Format::Q4_1, 1, 1) => $kernel::<true, 1, 1>($rows, $x, $r, $tile),
            (Format::Q4_1, 1, 2) => $kernel::<true, 1, 2>($rows, $x, $r, $tile),
            (Format::Q4_1, 1, 3) => $kernel::<true, 1, 3>($rows, $x, $r, $tile),
            (Format::Q4_1, 1, 4) => $kernel::<true, 1, 4>($rows, $x, $r, $tile),
            (Format::Q4_1, 4, 1) => $kernel::<true, 4, 1>($rows, $x, $r, $tile),
            (Format::Q4_1, 4, 2) => $kernel::<true, 4, 2>($rows, $x, $r, $tile),
            (Format::Q4_1, 4, 3) => $kernel::<true, 4, 3>($rows, $x, $r, $tile),
            (Format::Q4_1, 4, 4) => $kernel::<true, 4, 4>($rows, $x, $r, $tile),
            (Format::Q8_0, 1, 1) => $kernel::<false, 1, 1>($rows, $x, $r, $tile),
            (Format::Q8_0, 1, 2) => $kernel::<false, 1, 2>($rows, $x, $r, $tile),
            (Format::Q8_0, 1, 3) => $kernel::<false, 1, 3>($rows, $x, $r, $tile),
            (Format::Q8_0, 1, 4) => $kernel::<false, 1, 4>($rows, $x, $r, $tile),
            (Format::Q8_0, 4, 1) => $kernel::<false, 4, 1>($rows, $x, $r, $tile),
            (Format::Q8_0, 4, 2) => $kernel::<false, 4, 2>($rows, $x, $r, $tile),
            (Format::Q8_0, 4, 3) => $kernel::<false, 4, 3>($rows, $x, $r, $tile),
            (Format::Q8_0, 4, 4) => $kernel::<false, 4, 4>($rows, $x, $r, $tile),
            _ => unreachable!("at most TILE weight rows and GROUP rows of x"),
        }
    }};
}

mod avx2;
mod avx512;
mod bf16;
mod pack;
mod portable;
mod tiles;

pub(crate) use pack::{Format, PackedWeight};

use pack::Row;

use candle_core::Tensor;
use rayon::prelude::*;

use super::low_rank::{add_terms, Group, LowRank, TermValues};
use super::rows::few_rows_t_of;
use super::{with_elements_all, Elements, MAX_ROWS};

/// Weights per quantisation block (GGUF's Q4_1 and Q8_0).
pub(crate) const BLOCK: usize = 32;

/// Weight rows per parallel task.
const ROWS_PER_TASK: usize = 64;

/// Rows of `x` that meet a tile of weight rows while it is in registers; more rows go in more
/// groups.
const GROUP: usize = 4;

/// How far ahead of the tile being multiplied its successors' rows are prefetched, into L2
/// (`_MM_HINT_T1`): into L1 they evicted the rows of `x` and a batch's 8-job step took about 5%
/// longer on the AMD EPYC, one job the same (BENCHMARKS, "A tile's offsets and lane sums").
const PREFETCH_ROWS: usize = 2 * TILE;

/// Weight rows per tile: independent sums for the core to overlap (one weight row alone is a
/// chain of dependent multiply-adds), and several streams for the prefetcher.
const TILE: usize = 4;

/// The instruction set a kernel runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AMX tiles with bf16 products (and AVX-512 BF16 around them): activations rounded to
    /// bf16.
    AmxBf16,
    /// AVX-512 with BF16's dot products: activations rounded to bf16.
    Avx512Bf16,
    /// AVX-512 with VNNI's `u8 x i8` dot products (and BW, VL for byte and masked loads).
    Avx512Vnni,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// Plain Rust.
    Portable,
}

impl Isa {
    /// The widest integer kernel this CPU runs (two bytes per activation).
    pub(crate) fn best_integer() -> Self {
        [Isa::Avx512Vnni, Isa::Avx2]
            .into_iter()
            .find(|i| i.runs_here())
            .unwrap_or(Isa::Portable)
    }

    /// Whether this CPU has the instruction set's features.
    pub(crate) fn runs_here(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx512 = has!("avx512f") && has!("avx512bw") && has!("avx512vl");
            match self {
                Isa::AmxBf16 => {
                    avx512 && has!("avx512bf16") && has!("f16c") && super::amx::available()
                }
                Isa::Avx512Bf16 => avx512 && has!("avx512bf16") && has!("f16c"),
                Isa::Avx512Vnni => avx512 && has!("avx512vnni") && has!("f16c"),
                Isa::Avx2 => has!("avx2") && has!("fma") && has!("f16c"),
                Isa::Portable => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Portable
        }
    }

    /// Every instruction set this CPU runs (tests run them all).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Self> {
        [
            Isa::AmxBf16,
            Isa::Avx512Bf16,
            Isa::Avx512Vnni,
            Isa::Avx2,
            Isa::Portable,
        ]
        .into_iter()
        .filter(|i| i.runs_here())
        .collect()
    }

    /// Whether the kernel rounds activations to bf16 (else two bytes per value).
    #[cfg(test)]
    fn rounds_to_bf16(self) -> bool {
        matches!(self, Isa::AmxBf16 | Isa::Avx512Bf16)
    }
}

/// Rows of `x` quantised for the integer dot products in two signed bytes per value: per block
/// of 32, `x ~ d (hi + lo / 256)` with `d = max |x| / 127`, `hi = round(x / d)` and `lo` the
/// rounded remainder in 1/256ths, both in `[-127, 127]`. One byte per value (llama.cpp's Q8_1)
/// rounds away the small values of a block that holds an outlier channel, and on SmolLM2 that
/// flipped greedy answers against the f32 path; the second byte costs one more integer dot
/// product per block and brings the rounding to about 1/65,000 of the block's maximum. A row is
/// padded with zeros to whole block pairs.
pub(crate) struct QuantRows {
    /// Rows.
    m: usize,
    /// Block pairs per row.
    pairs: usize,
    /// `(m, pairs * 64)`: the high bytes.
    q: Vec<i8>,
    /// `(m, pairs * 64)`: the low bytes.
    lo: Vec<i8>,
    /// `(m, pairs * 2)`: each block's `d / 256`, the unit of `256 hi + lo`.
    scale: Vec<f32>,
    /// `(m, pairs * 2)`: each block's `d * sum(hi + lo / 256)`, which meets the offset `m`.
    sum: Vec<f32>,
    /// `(m, pairs * 16)`: per pair, `d / 256` of its two blocks across 8 + 8 lanes: the AVX-512
    /// kernel's operand, laid out once per row instead of once per weight row.
    lanes: Vec<f32>,
}

impl QuantRows {
    pub(crate) fn new(x: &[f32], m: usize, k: usize) -> Self {
        let pairs = k.div_ceil(2 * BLOCK);
        let mut q = vec![0i8; m * pairs * 2 * BLOCK];
        let mut lo = vec![0i8; m * pairs * 2 * BLOCK];
        let mut scale = vec![0f32; m * pairs * 2];
        let mut sum = vec![0f32; m * pairs * 2];
        let mut lanes = vec![0f32; m * pairs * 16];
        for r in 0..m {
            let row = &x[r * k..(r + 1) * k];
            for (b, chunk) in row.chunks(BLOCK).enumerate() {
                let amax = chunk.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                let at = (r * pairs * 2 + b) * BLOCK;
                let his = &mut q[at..][..chunk.len()];
                let los = &mut lo[at..][..chunk.len()];
                let mut s = 0i32;
                for ((h, l), &v) in his.iter_mut().zip(los.iter_mut()).zip(chunk) {
                    let t = v * inv;
                    let hi = round(t);
                    let low = round((t - hi as f32) * 256.0);
                    (*h, *l) = (hi as i8, low as i8);
                    s += 256 * hi + low;
                }
                scale[r * pairs * 2 + b] = d / 256.0;
                sum[r * pairs * 2 + b] = d / 256.0 * s as f32;
            }
            for p in 0..pairs {
                let l = &mut lanes[(r * pairs + p) * 16..][..16];
                for half in 0..2 {
                    l[half * 8..half * 8 + 8].fill(scale[r * pairs * 2 + 2 * p + half]);
                }
            }
        }
        Self {
            m,
            pairs,
            q,
            lo,
            scale,
            sum,
            lanes,
        }
    }

    fn q(&self, r: usize) -> &[i8] {
        &self.q[r * self.pairs * 2 * BLOCK..][..self.pairs * 2 * BLOCK]
    }

    fn lo(&self, r: usize) -> &[i8] {
        &self.lo[r * self.pairs * 2 * BLOCK..][..self.pairs * 2 * BLOCK]
    }

    fn scale(&self, r: usize) -> &[f32] {
        &self.scale[r * self.pairs * 2..][..self.pairs * 2]
    }

    fn sum(&self, r: usize) -> &[f32] {
        &self.sum[r * self.pairs * 2..][..self.pairs * 2]
    }

    fn lanes(&self, r: usize) -> &[f32] {
        &self.lanes[r * self.pairs * 16..][..self.pairs * 16]
    }
}

/// The rows of `x` in the form an instruction set's kernel reads.
enum Activations {
    /// Two signed bytes per value, for the integer kernels.
    Bytes(QuantRows),
    /// bf16, for [`Isa::Avx512Bf16`].
    #[cfg(target_arch = "x86_64")]
    Bf16(bf16::Bf16Rows),
    /// bf16 B tiles, for [`Isa::AmxBf16`].
    #[cfg(target_arch = "x86_64")]
    Tiles(tiles::TileRows),
}

impl Activations {
    fn new(isa: Isa, x: &[f32], m: usize, k: usize) -> Self {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::AmxBf16 => Self::Tiles(tiles::TileRows::new(x, m, k)),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => Self::Bf16(bf16::Bf16Rows::new(x, m, k)),
            _ => Self::Bytes(QuantRows::new(x, m, k)),
        }
    }

    /// Rows.
    fn m(&self) -> usize {
        match self {
            Self::Bytes(x) => x.m,
            #[cfg(target_arch = "x86_64")]
            Self::Bf16(x) => x.m,
            #[cfg(target_arch = "x86_64")]
            Self::Tiles(x) => x.m,
        }
    }
}

/// `v` to the nearest integer, halves away from zero, in `[-127, 127]` (for `|v| <= 127`, as
/// the scales make it): `f32::round` is a libm call on the baseline x86-64 target, this is a
/// convert instruction.
#[inline]
fn round(v: f32) -> i32 {
    ((v + 0.5f32.copysign(v)) as i32).clamp(-127, 127)
}

/// `x W^T` for `x` `(m, k)` f32 and `w` packed `(n, k)` on `isa`, [`MAX_ROWS`] rows of `x` at
/// a time.
pub(crate) fn linear_narrow(x: &Tensor, w: &PackedWeight, isa: Isa) -> candle_core::Result<Tensor> {
    linear_narrow_low_rank(x, w, isa, &[])
}

/// [`linear_narrow`] plus adapter terms: `lora` holds `(first row, rows, terms)` per run of
/// rows of one expert, in row order, and each run's rows get its [`LowRank`] term, added to
/// each block of outputs in the pass that computes it.
pub(crate) fn linear_narrow_low_rank(
    x: &Tensor,
    w: &PackedWeight,
    isa: Isa,
    lora: &[(usize, usize, &LowRank)],
) -> candle_core::Result<Tensor> {
    let m = x.dim(0)?;
    let one = |x: &Tensor, r0: usize| {
        // The runs that meet rows `r0..r0 + rows of x`, clipped to them and counted from `r0`.
        let rows = x.dim(0)?;
        let clipped: Vec<_> = lora
            .iter()
            .filter_map(|&(at, n, l)| {
                let (lo, hi) = (at.max(r0), (at + n).min(r0 + rows));
                (lo < hi).then(|| (lo - r0, hi - lo, l))
            })
            .collect();
        linear_narrow_on(isa, x, w, &clipped)
    };
    if m <= MAX_ROWS {
        return one(x, 0);
    }
    let parts = (0..m)
        .step_by(MAX_ROWS)
        .map(|r| one(&x.narrow(0, r, MAX_ROWS.min(m - r))?.contiguous()?, r))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&parts, 0)
}

/// [`linear_narrow_low_rank`] on a given instruction set, for at most [`MAX_ROWS`] rows.
pub(crate) fn linear_narrow_on(
    isa: Isa,
    x: &Tensor,
    w: &PackedWeight,
    lora: &[(usize, usize, &LowRank)],
) -> candle_core::Result<Tensor> {
    let (m, k) = x.dims2()?;
    let (n, k_w) = (w.rows(), w.cols());
    if k != k_w || m == 0 || m > MAX_ROWS {
        candle_core::bail!("linear_narrow: x {:?} and packed w ({n}, {k_w})", x.dims());
    }
    let mut tensors = vec![x];
    for &(r0, rows, l) in lora {
        if r0 + rows > m || l.a.dim(1)? != k {
            candle_core::bail!(
                "linear_narrow: adapter term ({:?}) on rows {r0}..{} of x {:?}",
                l.a.dims(),
                r0 + rows,
                x.dims()
            );
        }
        tensors.push(&l.a);
        tensors.extend(l.terms.iter().map(|t| &t.bt));
    }
    let y = with_elements_all(&tensors, |slices| {
        let Elements::F32(xs) = slices[0] else {
            candle_core::bail!("linear_narrow: x must be f32");
        };
        // Each run's `x A^T` first: the pass over the weight adds the terms block by block.
        let mut groups = Vec::with_capacity(lora.len());
        let mut at = 1;
        for &(r0, rows, l) in lora {
            let a = slices[at];
            let mut terms = Vec::with_capacity(l.terms.len());
            for (t, &bt) in l.terms.iter().zip(&slices[at + 1..]) {
                let (rank, cols) = t.bt.dims2()?;
                if t.at + rank > l.a.dim(0)? || t.col + cols > n {
                    candle_core::bail!("linear_narrow: adapter term out of its projection");
                }
                terms.push(TermValues {
                    col: t.col,
                    at: t.at,
                    rank,
                    cols,
                    bt,
                });
            }
            at += 1 + l.terms.len();
            groups.push(Group {
                r0,
                m: rows,
                xat: few_rows_t_of(&xs[r0 * k..(r0 + rows) * k], rows, k, a),
                terms,
            });
        }
        let xq = Activations::new(isa, xs, m, k);
        // Each task computes its block of y^T `(outputs, m)` in its own buffer and writes it
        // into its columns of y `(m, n)`: no zeroed `(n, m)` buffer and no serial transpose
        // after the pass (a step's outputs, zeroed and transposed on the calling thread while
        // the other threads waited, were some 5% of an 8-job step).
        let mut y: Vec<f32> = Vec::with_capacity(m * n);
        let into = Columns(y.as_mut_ptr());
        (0..n.div_ceil(ROWS_PER_TASK))
            .into_par_iter()
            .for_each(|t| {
                let first = t * ROWS_PER_TASK;
                let cols = ROWS_PER_TASK.min(n - first);
                let mut block = [0f32; ROWS_PER_TASK * MAX_ROWS];
                let block = &mut block[..cols * m];
                weight_rows(isa, w, first, &xq, block);
                for g in &groups {
                    add_terms(block, m, first, g);
                }
                for (j, outs) in block.chunks_exact(m).enumerate() {
                    for (r, &v) in outs.iter().enumerate() {
                        // SAFETY: `r < m` and `first + j < n`, inside `y`'s capacity of `m n`;
                        // this task alone writes columns `first..first + cols`.
                        unsafe { into.at(r * n + first + j).write(v) };
                    }
                }
            });
        // SAFETY: the tasks cover columns `0..n` of every row, so all `m n` elements are
        // written (a panicking task propagates before this line).
        unsafe { y.set_len(m * n) };
        Ok(y)
    })?;
    Tensor::from_vec(y, (m, n), &candle_core::Device::Cpu)
}

/// `y`'s elements for [`linear_narrow_on`]'s tasks, each of which writes its own columns.
struct Columns(*mut f32);

// SAFETY: the tasks write disjoint elements, and `y` outlives the parallel pass.
unsafe impl Sync for Columns {}

impl Columns {
    /// The element at `i`.
    ///
    /// # Safety
    /// `i` inside the buffer's capacity.
    unsafe fn at(&self, i: usize) -> *mut f32 {
        // SAFETY: as the caller guarantees.
        unsafe { self.0.add(i) }
    }
}

/// `out[(j - first) * m + r] = w_j . x_r` for the weight rows `first..` that `out` has room
/// for and every row `r` of `x`: tiles of [`TILE`] weight rows by up to [`GROUP`] rows of `x`.
fn weight_rows(isa: Isa, w: &PackedWeight, first: usize, x: &Activations, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let Activations::Tiles(x) = x {
        // SAFETY: tile rows are made for `Isa::AmxBf16` only, which is only chosen (as the
        // other instruction sets below) on CPUs that run it.
        unsafe { tiles::weight_rows(w, first, x, out) };
        return;
    }
    let m = x.m();
    let n = out.len() / m;
    let mut j = 0;
    while j < n {
        let wide = if n - j >= TILE { TILE } else { 1 };
        let rows: [Row<'_>; TILE] = std::array::from_fn(|a| w.row(first + j + a.min(wide - 1)));
        #[cfg(target_arch = "x86_64")]
        if let Some(ahead) = w.bytes_of_rows(first + j + PREFETCH_ROWS, TILE) {
            for line in ahead.chunks(64) {
                // SAFETY: a prefetch is a hint; the address is inside `ahead`.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                        line.as_ptr().cast(),
                    )
                };
            }
        }
        let mut r = 0;
        while r < m {
            let group = (m - r).min(GROUP);
            let mut tile = [[0f32; GROUP]; TILE];
            match (isa, x) {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the x86 instruction sets are only chosen (by `Isa::best_integer`,
                // `DecodeProducts`, or by tests from `Isa::available`) on CPUs that have their
                // features.
                (Isa::Avx512Bf16, Activations::Bf16(x)) => unsafe {
                    bf16::tile(w.format(), &rows[..wide], x, r, group, &mut tile)
                },
                #[cfg(target_arch = "x86_64")]
                (_, Activations::Bf16(_)) => unreachable!("bf16 rows are made for Avx512Bf16"),
                #[cfg(target_arch = "x86_64")]
                (_, Activations::Tiles(_)) => unreachable!("tile rows are taken above"),
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                (Isa::Avx512Vnni, Activations::Bytes(x)) => unsafe {
                    avx512::tile(w.format(), &rows[..wide], x, r, group, &mut tile)
                },
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, Activations::Bytes(x)) => {
                    for (a, row) in rows[..wide].iter().enumerate() {
                        // SAFETY: as above.
                        unsafe { avx2::row(w.format(), row, x, r, &mut tile[a][..group]) };
                    }
                }
                (_, Activations::Bytes(x)) => {
                    for (a, row) in rows[..wide].iter().enumerate() {
                        portable::row(w.format(), row, x, r, &mut tile[a][..group]);
                    }
                }
            }
            for (a, t) in tile[..wide].iter().enumerate() {
                out[(j + a) * m + r..][..group].copy_from_slice(&t[..group]);
            }
            r += group;
        }
        j += wide;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Random weights through GGUF-style blocks, so that the packed and f32 forms hold the same
    /// values.
    fn weights(format: Format, n: usize, k: usize) -> candle_core::Result<(PackedWeight, Tensor)> {
        let w = Tensor::randn(0f32, 0.05, (n, k), &Device::Cpu)?.to_vec2::<f32>()?;
        let flat: Vec<f32> = w.concat();
        let packed = match format {
            Format::Q8_0 => PackedWeight::quantize_q8_0(&flat, n, k),
            Format::Q4_1 => {
                let bytes = pack::tests::q4_1_gguf_blocks(&flat, k);
                PackedWeight::from_gguf(Format::Q4_1, &bytes, n, k)
            }
        }
        .ok_or_else(|| candle_core::Error::Msg("not packable".into()))?;
        let f = Tensor::from_vec(packed.dequantize(), (n, k), &Device::Cpu)?;
        Ok((packed, f))
    }

    /// `x` as the kernel of `isa` sees it: rounded to bf16, or as it is (two bytes per value
    /// are within the tests' tolerance).
    fn input_of(isa: Isa, x: &Tensor) -> candle_core::Result<Tensor> {
        if isa.rounds_to_bf16() {
            x.to_dtype(candle_core::DType::BF16)?
                .to_dtype(candle_core::DType::F32)
        } else {
            Ok(x.clone())
        }
    }

    #[test]
    fn narrow_rows_match_the_f32_product_and_a_row_alone_equals_it_in_a_batch(
    ) -> candle_core::Result<()> {
        // An odd number of blocks (a padded pair), more rows than a group, n not a task multiple.
        for format in [Format::Q4_1, Format::Q8_0] {
            for (m, k, n) in [(1, 576, 131), (3, 96, 70), (9, 1536, 65), (16, 32, 200)] {
                let (w, wf) = weights(format, n, k)?;
                let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
                let scale = x.matmul(&wf.t()?)?.abs()?.max_all()?.to_scalar::<f32>()?;
                let mut first: Option<Vec<f32>> = None;
                for isa in Isa::available() {
                    let got = linear_narrow_on(isa, &x, &w, &[])?;
                    // The bf16 kernel against the product of x rounded as it rounds it, the
                    // integer kernels (two bytes per activation: about 1e-5 of the largest
                    // output) against the product of x.
                    let want = input_of(isa, &x)?.matmul(&wf.t()?)?;
                    let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(
                        diff < 1e-4 * scale,
                        "{format:?} {isa:?} ({m}, {k}, {n}): max difference {diff} of {scale}"
                    );
                    for row in 0..m {
                        let alone = linear_narrow_on(isa, &x.narrow(0, row, 1)?, &w, &[])?;
                        assert_eq!(
                            alone.flatten_all()?.to_vec1::<f32>()?,
                            got.narrow(0, row, 1)?.flatten_all()?.to_vec1::<f32>()?,
                            "{format:?} {isa:?} ({m}, {k}, {n}) row {row}"
                        );
                    }
                    // The integer kernels sum in different orders: close, not equal.
                    let got = got.flatten_all()?.to_vec1::<f32>()?;
                    if isa.rounds_to_bf16() {
                        continue;
                    }
                    if let Some(f) = &first {
                        let worst = f
                            .iter()
                            .zip(&got)
                            .fold(0f32, |a, (p, q)| a.max((p - q).abs()));
                        assert!(worst < 1e-4 * scale.max(1.0), "{format:?} {isa:?}: {worst}");
                    } else {
                        first = Some(got);
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn exact_on_rows_that_quantise_exactly() -> candle_core::Result<()> {
        // x with integer entries in [-127, 127] and 127 in every block quantises without loss,
        // so every instruction set must give the f32 product of the packed values to rounding.
        let (m, k, n) = (2, 128, 40);
        let (w, wf) = weights(Format::Q4_1, n, k)?;
        let xs: Vec<f32> = (0..m * k)
            .map(|i| {
                if i % 32 == 0 {
                    127.0
                } else {
                    ((i * 37) % 255) as f32 - 127.0
                }
            })
            .collect();
        let x = Tensor::from_vec(xs, (m, k), &Device::Cpu)?;
        let want = x.matmul(&wf.t()?)?;
        for isa in Isa::available() {
            let got = linear_narrow_on(isa, &x, &w, &[])?;
            let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-3, "{isa:?}: {diff}");
        }
        Ok(())
    }

    /// A [`LowRank`] with terms `(col, rank, cols)` and its reference delta for `x`.
    fn low_rank(
        k: usize,
        n: usize,
        terms: &[(usize, usize, usize)],
        seed: f64,
    ) -> candle_core::Result<(LowRank, impl Fn(&Tensor) -> candle_core::Result<Tensor>)> {
        let mut a_parts = Vec::new();
        let mut out = Vec::new();
        let mut at = 0;
        let mut reference = Vec::new();
        for &(col, rank, cols) in terms {
            let a = (Tensor::randn(0f32, 1.0, (rank, k), &Device::Cpu)? * seed)?;
            let bt = Tensor::randn(0f32, 0.1, (rank, cols), &Device::Cpu)?;
            a_parts.push(a.clone());
            reference.push((col, a, bt.clone()));
            out.push(crate::kernels::LowRankTerm { col, at, bt });
            at += rank;
        }
        let stacked = Tensor::cat(&a_parts, 0)?;
        let delta = move |x: &Tensor| {
            let m = x.dim(0)?;
            let mut d = Tensor::zeros((m, n), candle_core::DType::F32, &Device::Cpu)?;
            for (col, a, bt) in &reference {
                let (_, cols) = bt.dims2()?;
                let part = x.matmul(&a.t()?)?.matmul(bt)?;
                let mut pieces = Vec::new();
                if *col > 0 {
                    pieces.push(Tensor::zeros(
                        (m, *col),
                        candle_core::DType::F32,
                        &Device::Cpu,
                    )?);
                }
                pieces.push(part);
                if col + cols < n {
                    pieces.push(Tensor::zeros(
                        (m, n - col - cols),
                        candle_core::DType::F32,
                        &Device::Cpu,
                    )?);
                }
                d = (d + Tensor::cat(&pieces, 1)?)?;
            }
            Ok(d)
        };
        Ok((
            LowRank {
                a: stacked,
                terms: out,
            },
            delta,
        ))
    }

    #[test]
    fn adapter_terms_add_to_their_rows_only_and_a_row_gets_the_same_alone_as_in_a_batch(
    ) -> candle_core::Result<()> {
        // Two experts over one base weight: terms that start inside a task's block of
        // outputs, parts narrower and wider than a vector of columns (9, 70, 80); rows of no
        // expert between them; more rows than one pass takes, so that a run spans two.
        let (k, n) = (96, 200);
        let (w, wf) = weights(Format::Q4_1, n, k)?;
        let (one, one_delta) = low_rank(k, n, &[(0, 3, 70), (120, 17, 80)], 0.5)?;
        let (two, two_delta) = low_rank(k, n, &[(65, 5, 9)], 1.0)?;
        let m = MAX_ROWS + 4;
        let runs = [(0, 2, &one), (3, 2, &two), (10, m - 10, &one)];
        let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
        for isa in Isa::available() {
            let got = linear_narrow_low_rank(&x, &w, isa, &runs)?;
            // The terms take x as it is; the weight's product x as the kernel rounds it.
            let base = input_of(isa, &x)?.matmul(&wf.t()?)?;
            for (r0, rows, delta) in [
                (0, 2, Some(&one_delta as &dyn Fn(&Tensor) -> _)),
                (2, 1, None),
                (3, 2, Some(&two_delta)),
                (5, 5, None),
                (10, m - 10, Some(&one_delta)),
            ] {
                let xs = x.narrow(0, r0, rows)?;
                let mut want = base.narrow(0, r0, rows)?;
                if let Some(d) = delta {
                    want = (want + d(&xs)?)?;
                }
                let have = got.narrow(0, r0, rows)?;
                let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
                let diff = (&have - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(
                    diff < 1e-4 * scale,
                    "{isa:?} rows {r0}..: {diff} of {scale}"
                );
            }
            for (r, l) in [
                (0, Some(&one)),
                (4, Some(&two)),
                (7, None),
                (m - 1, Some(&one)),
            ] {
                let alone = linear_narrow_low_rank(
                    &x.narrow(0, r, 1)?,
                    &w,
                    isa,
                    &l.map(|l| vec![(0, 1, l)]).unwrap_or_default(),
                )?;
                assert_eq!(
                    alone.flatten_all()?.to_vec1::<f32>()?,
                    got.narrow(0, r, 1)?.flatten_all()?.to_vec1::<f32>()?,
                    "{isa:?} row {r}"
                );
            }
            // A term past the projection's outputs is refused, not written out of bounds.
            let (bad, _) = low_rank(k, n + 10, &[(190, 2, 20)], 1.0)?;
            assert!(linear_narrow_low_rank(&x, &w, isa, &[(0, 1, &bad)]).is_err());
        }
        Ok(())
    }

    /// `l`'s values rounded to bf16, held in `dtype`.
    fn in_bf16(l: &LowRank, dtype: candle_core::DType) -> candle_core::Result<LowRank> {
        let round = |t: &Tensor| t.to_dtype(candle_core::DType::BF16)?.to_dtype(dtype);
        Ok(LowRank {
            a: round(&l.a)?,
            terms: l
                .terms
                .iter()
                .map(|t| {
                    Ok(crate::kernels::LowRankTerm {
                        col: t.col,
                        at: t.at,
                        bt: round(&t.bt)?,
                    })
                })
                .collect::<candle_core::Result<_>>()?,
        })
    }

    #[test]
    fn adapter_terms_held_in_bf16_give_the_outputs_of_the_same_values_in_f32(
    ) -> candle_core::Result<()> {
        use candle_core::DType;
        let (k, n) = (96, 200);
        let (w, _) = weights(Format::Q4_1, n, k)?;
        let (one, _) = low_rank(k, n, &[(0, 3, 70), (120, 17, 80)], 0.5)?;
        let (two, _) = low_rank(k, n, &[(65, 5, 9)], 1.0)?;
        let wide = [in_bf16(&one, DType::F32)?, in_bf16(&two, DType::F32)?];
        let narrow = [in_bf16(&one, DType::BF16)?, in_bf16(&two, DType::BF16)?];
        let x = Tensor::randn(0f32, 1.0, (7, k), &Device::Cpu)?;
        for isa in Isa::available() {
            let runs = |l: &[LowRank; 2]| {
                let [one, two] = l;
                linear_narrow_low_rank(&x, &w, isa, &[(0, 3, one), (4, 3, two)])
            };
            let want = runs(&wide)?;
            let got = runs(&narrow)?;
            assert_eq!(
                got.flatten_all()?.to_vec1::<f32>()?,
                want.flatten_all()?.to_vec1::<f32>()?,
                "{isa:?}"
            );
        }
        Ok(())
    }
}
