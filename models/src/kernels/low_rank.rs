//! An expert's LoRA terms in a decode step, added to the base product of the same pass.
//!
//! An expert applied on the fly adds `s (x A^T) B^T` to each projection it adapts. Through
//! candle that is two small matmuls per part (a `B` of depth = rank goes to `gemm`, which packs
//! it per call), a scale, zeros for the parts it leaves alone, a concatenation and a sum: a dozen
//! passes and allocations per projection, each a fork and join of the thread pool, and on a
//! decode step those passes, not the adapter's few megabytes, were most of the term's cost.
//! Here a projection's adapter is laid out once at load ([`LowRank`]): every part's `A` stacked
//! into one `(sum of ranks, in)` matrix, so one pass over it gives all parts' `x A^T`, and each
//! part's `B` transposed with the scale folded in, `(rank, cols)`, so that its product runs along
//! the output columns with no reduction across vector lanes. The narrow kernel adds the term to
//! each block of outputs right after computing it, while the block is in cache.
//!
//! Each output's term is one sum over the rank in a fixed order whatever the other rows, so a
//! job's outputs are the same alone and in a batch.

use candle_core::Tensor;

use super::{Elements, Widen};

/// Output columns per vector of partial sums (the AVX-512 width; AVX2 takes two registers).
const LANES: usize = 16;

/// Rows of `x` that share each load of `B`.
const ROWS: usize = 4;

/// One projection's adapter terms, laid out for decode steps: in bf16 where that holds every
/// value exactly (an adapter saved in bf16 with a power-of-two scale, as ours are), else in f32.
/// The kernels widen bf16 as they load it, so both give the same sums; bf16 halves the bytes
/// a decode step streams for the adapter.
#[derive(Debug)]
pub(crate) struct LowRank {
    /// `(sum of ranks, in)`: the adapted parts' `A`, one after another.
    pub a: Tensor,
    /// The adapted parts, in the order of their rows in `a`.
    pub terms: Vec<LowRankTerm>,
}

/// One adapted part of a projection.
#[derive(Debug)]
pub(crate) struct LowRankTerm {
    /// Its first output column in the (fused) projection.
    pub col: usize,
    /// Its first row in [`LowRank::a`].
    pub at: usize,
    /// `(rank, cols)`: its `B` transposed, times the adapter's scale.
    pub bt: Tensor,
}

/// A [`LowRank`]'s values as slices, and the rows it applies to.
pub(crate) struct Group<'a> {
    /// First row of `x` (and of the output) it applies to.
    pub r0: usize,
    /// Rows it applies to.
    pub m: usize,
    /// `(sum of ranks, m)`: `x A^T` of those rows, transposed.
    pub xat: Vec<f32>,
    /// Its terms' values.
    pub terms: Vec<TermValues<'a>>,
}

/// A [`LowRankTerm`]'s values as a slice.
pub(crate) struct TermValues<'a> {
    /// As [`LowRankTerm::col`].
    pub col: usize,
    /// As [`LowRankTerm::at`].
    pub at: usize,
    pub rank: usize,
    pub cols: usize,
    /// `(rank, cols)`, as [`LowRankTerm::bt`].
    pub bt: Elements<'a>,
}

crate::kernels::multiversion! {
    /// Adds the terms of `g` to `out`, the outputs of weight rows (output columns) `first..`
    /// for all `m` rows, `out[(j - first) * m + r]`.
    pub(crate) fn add_terms(out: &mut [f32], m: usize, first: usize, g: &Group<'_>) {
        for t in &g.terms {
            match t.bt {
                Elements::F32(bt) => add_term(out, m, first, g, t, bt),
                Elements::Bf16(bt) => add_term(out, m, first, g, t, bt),
            }
        }
    }
}

/// [`add_terms`] for one term, its `B^T` in `bt`.
#[inline(always)]
fn add_term<T: Widen>(
    out: &mut [f32],
    m: usize,
    first: usize,
    g: &Group<'_>,
    t: &TermValues<'_>,
    bt: &[T],
) {
    let n = out.len() / m;
    let &TermValues {
        col,
        at,
        rank,
        cols,
        ..
    } = t;
    let hi = (col + cols).min(first + n);
    let mut j = col.max(first);
    while j < hi {
        let w = LANES.min(hi - j);
        let c = j - col;
        let mut b = 0;
        while b < g.m {
            let rows = ROWS.min(g.m - b);
            // Each output is one sum over the rank in order, a plain multiply then add per
            // step (never fused), whatever the lanes and rows around it.
            let mut acc = [[0f32; LANES]; ROWS];
            for i in 0..rank {
                let src = &bt[i * cols + c..][..w];
                // A whole vector by value (a copy of unknown length is a memmove call).
                let bv: [f32; LANES] = match <&[T; LANES]>::try_from(src) {
                    Ok(whole) => whole.map(Widen::f32),
                    Err(_) => {
                        let mut v = [0f32; LANES];
                        for (v, s) in v.iter_mut().zip(src) {
                            *v = s.f32();
                        }
                        v
                    }
                };
                let xa = &g.xat[(at + i) * g.m + b..][..rows];
                for (sums, &a) in acc.iter_mut().zip(xa) {
                    for (s, &v) in sums.iter_mut().zip(&bv) {
                        *s += a * v;
                    }
                }
            }
            for (bb, sums) in acc[..rows].iter().enumerate() {
                for (l, &v) in sums[..w].iter().enumerate() {
                    out[(j + l - first) * m + g.r0 + b + bb] += v;
                }
            }
            b += rows;
        }
        j += w;
    }
}
