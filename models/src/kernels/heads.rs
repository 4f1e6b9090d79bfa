//! Moving between the row-per-token layout of the projections and the head-major layout of
//! attention, with RoPE folded into the move.
//!
//! Unfused, a block's attention input costs three projection outputs, three transposing copies,
//! two RoPE passes and a scaling pass over the queries; its output a concatenation and another
//! transposing copy. Here the fused q/k/v projection's output is read once and written once in
//! head-major order, rotated and scaled on the way, and the attention chunks are written once
//! into the output projection's input.

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::{multiversion, with_f32};

/// One block's queries, keys and values in head-major layout.
pub(crate) struct Heads {
    /// `(n_heads, T, head_dim)`, rotated, multiplied by the query scale.
    pub q: Tensor,
    /// `(n_kv_heads, T, head_dim)`, rotated.
    pub k_rot: Tensor,
    /// `(n_kv_heads, T, head_dim)`.
    pub v: Tensor,
}

/// Splits the fused projection output `qkv` `(T, (n_h + 2 n_kv) d)` (queries, then keys, then
/// values, each head-major within a row) into heads, applying the interleaved RoPE with tables
/// `cos`/`sin` `(T, d / 2)` to queries and keys and `q_scale` to queries.
pub(crate) fn split_qkv_rope(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    (n_h, n_kv, d): (usize, usize, usize),
    q_scale: f32,
) -> candle_core::Result<Heads> {
    let (t, width) = qkv.dims2()?;
    let heads = n_h + 2 * n_kv;
    if width != heads * d || d % 2 != 0 {
        candle_core::bail!("split_qkv_rope: row width {width} is not {heads} heads of {d}");
    }
    check_tables("split_qkv_rope", cos, sin, t, d)?;
    let mut out = vec![0f32; heads * t * d];
    with_f32(qkv, |src| {
        with_f32(cos, |cos| {
            with_f32(sin, |sin| {
                out.par_chunks_mut(t * d).enumerate().for_each(|(j, dst)| {
                    let offset = j * d;
                    if j < n_h + n_kv {
                        let scale = if j < n_h { q_scale } else { 1.0 };
                        rope_head(dst, src, width, offset, cos, sin, d, scale);
                    } else {
                        copy_head(dst, src, width, offset, d);
                    }
                });
                Ok(())
            })
        })
    })?;
    let all = Tensor::from_vec(out, (heads, t, d), &Device::Cpu)?;
    Ok(Heads {
        q: all.narrow(0, 0, n_h)?,
        k_rot: all.narrow(0, n_h, n_kv)?,
        v: all.narrow(0, n_h + n_kv, n_kv)?,
    })
}

/// Rows `x` `(T, heads d)` as a cache buffer `(heads, capacity, d)` (`capacity >= T`): row `r`
/// of each head is the head's part of row `r` of `x`, rotated by table row `r` of `cos`/`sin`
/// `(T, d / 2)` when `rope` is given; rows from `T` on are zero. One pass over `x`, where
/// rotating, moving to heads and copying into a zeroed buffer took four (a rebuilt cache is
/// filled from rows, 30 layers of keys and values per request).
pub(crate) fn rows_to_cache_heads(
    x: &Tensor,
    rope: Option<(&Tensor, &Tensor)>,
    heads: usize,
    d: usize,
    capacity: usize,
) -> candle_core::Result<Tensor> {
    let (t, width) = x.dims2()?;
    if width != heads * d || !d.is_multiple_of(2) || capacity < t {
        candle_core::bail!(
            "rows_to_cache_heads: rows {:?} as {heads} heads of {d} in {capacity} rows",
            x.dims()
        );
    }
    if let Some((cos, sin)) = rope {
        check_tables("rows_to_cache_heads", cos, sin, t, d)?;
    }
    // `vec![0; n]` is `calloc`: a buffer this large usually comes as fresh zero pages, and the
    // spare rows' pages are then not touched until a decode step writes them.
    let mut out = vec![0f32; heads * capacity * d];
    with_f32(x, |src| {
        let mut fill = |cos: &[f32], sin: &[f32]| {
            out.par_chunks_mut(capacity * d)
                .enumerate()
                .for_each(|(h, dst)| {
                    let dst = &mut dst[..t * d];
                    if rope.is_some() {
                        rope_head(dst, src, width, h * d, cos, sin, d, 1.0);
                    } else {
                        copy_head(dst, src, width, h * d, d);
                    }
                });
        };
        match rope {
            Some((cos, sin)) => with_f32(cos, |cos| {
                with_f32(sin, |sin| {
                    fill(cos, sin);
                    Ok(())
                })
            }),
            None => {
                fill(&[], &[]);
                Ok(())
            }
        }
    })?;
    Tensor::from_vec(out, (heads, capacity, d), &Device::Cpu)
}

/// Row `r` of `dst` `(T, d)` is row `r` of the head at `offset` in `src` (rows of `width`).
fn copy_head(dst: &mut [f32], src: &[f32], width: usize, offset: usize, d: usize) {
    for (row, o) in dst.chunks_exact_mut(d).enumerate() {
        o.copy_from_slice(&src[row * width + offset..][..d]);
    }
}

/// Checks RoPE tables `cos`/`sin` against `t` rows of heads of `d`; `kernel` names the caller.
fn check_tables(
    kernel: &str,
    cos: &Tensor,
    sin: &Tensor,
    t: usize,
    d: usize,
) -> candle_core::Result<()> {
    if cos.dims() != [t, d / 2] || sin.dims() != [t, d / 2] {
        candle_core::bail!(
            "{kernel}: RoPE tables {:?}/{:?} do not match ({t}, {})",
            cos.dims(),
            sin.dims(),
            d / 2
        );
    }
    Ok(())
}

multiversion! {
    /// Row `r` of `dst` `(T, d)` is row `r` of the head at `offset` in `src` (rows of `width`),
    /// rotated by table row `r` of `cos`/`sin` `(T, d / 2)` and multiplied by `scale`.
    fn rope_head(
        dst: &mut [f32],
        src: &[f32],
        width: usize,
        offset: usize,
        cos: &[f32],
        sin: &[f32],
        d: usize,
        scale: f32,
    ) {
        let half = d / 2;
        for (r, out) in dst.chunks_exact_mut(d).enumerate() {
            let x = &src[r * width + offset..][..d];
            let c = &cos[r * half..][..half];
            let s = &sin[r * half..][..half];
            for (((o, x), &c), &s) in out.chunks_exact_mut(2).zip(x.chunks_exact(2)).zip(c).zip(s) {
                o[0] = (x[0] * c - x[1] * s) * scale;
                o[1] = (x[0] * s + x[1] * c) * scale;
            }
        }
    }
}

/// Writes attention outputs given per chunk of consecutive queries, each `(n_h, rows, d)`, as
/// one `(T, n_h d)` matrix (the output projection's input).
pub(crate) fn merge_heads(chunks: &[Tensor]) -> candle_core::Result<Tensor> {
    let Some(first) = chunks.first() else {
        candle_core::bail!("merge_heads: no chunks");
    };
    let (n_h, _, d) = first.dims3()?;
    let mut t = 0;
    for c in chunks {
        let (h, rows, dd) = c.dims3()?;
        if (h, dd) != (n_h, d) {
            candle_core::bail!("merge_heads: chunk {:?} next to ({n_h}, _, {d})", c.dims());
        }
        t += rows;
    }
    let row = n_h * d;
    let mut out = vec![0f32; t * row];
    let mut done = 0;
    for c in chunks {
        let rows = c.dim(1)?;
        let dst = &mut out[done * row..(done + rows) * row];
        with_f32(c, |src| {
            dst.par_chunks_mut(row).enumerate().for_each(|(r, o)| {
                for (h, oh) in o.chunks_exact_mut(d).enumerate() {
                    oh.copy_from_slice(&src[(h * rows + r) * d..][..d]);
                }
            });
            Ok(())
        })?;
        done += rows;
    }
    Tensor::from_vec(out, (t, row), &Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::rope_heads;
    use crate::rope::Rope;

    /// The fused split equals the unfused path: three projections, per-head transposes, RoPE,
    /// a scaled query.
    #[test]
    fn split_matches_separate_ops() -> candle_core::Result<()> {
        let (n_h, n_kv, d, t) = (6, 2, 8, 11);
        let qkv = Tensor::randn(0f32, 1.0, (t, (n_h + 2 * n_kv) * d), &Device::Cpu)?;
        let rope = Rope::with_params(d, 10_000.0);
        let positions: Vec<u32> = (5..5 + t as u32).collect();
        let (cos, sin) = rope.cos_sin(&positions, &Device::Cpu)?;
        let split = split_qkv_rope(&qkv, &cos, &sin, (n_h, n_kv, d), 0.25)?;
        let heads = |x: Tensor, n: usize| x.reshape((t, n, d))?.transpose(0, 1)?.contiguous();
        let q = heads(qkv.narrow(1, 0, n_h * d)?, n_h)?;
        let k = heads(qkv.narrow(1, n_h * d, n_kv * d)?, n_kv)?;
        let v = heads(qkv.narrow(1, (n_h + n_kv) * d, n_kv * d)?, n_kv)?;
        let q = (rope_heads(&q, &cos, &sin)? * 0.25)?;
        let k = rope_heads(&k, &cos, &sin)?;
        for (got, want) in [(&split.q, &q), (&split.k_rot, &k), (&split.v, &v)] {
            assert_eq!(got.dims(), want.dims());
            let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-6, "max difference {diff}");
        }
        Ok(())
    }

    /// A cache buffer from rows equals RoPE by candle on the transposed rows (bit for bit:
    /// the same products in the same order), then zero rows up to the capacity; without RoPE
    /// the transpose alone.
    #[test]
    fn rows_to_cache_heads_rotate_like_candle_and_leave_the_spare_rows_zero(
    ) -> candle_core::Result<()> {
        let (heads, d, t, capacity) = (3, 8, 13, 20);
        let x = Tensor::randn(0f32, 1.0, (t, heads * d), &Device::Cpu)?;
        let rope = Rope::with_params(d, 100_000.0);
        let positions: Vec<u32> = (0..t as u32).map(|p| 3 * p + 1).collect();
        let (cos, sin) = rope.cos_sin(&positions, &Device::Cpu)?;
        let per_head = x.reshape((t, heads, d))?.transpose(0, 1)?.contiguous()?;
        let spare = Tensor::zeros(
            (heads, capacity - t, d),
            candle_core::DType::F32,
            &Device::Cpu,
        )?;
        for (rotate, filled) in [
            (Some((&cos, &sin)), rope_heads(&per_head, &cos, &sin)?),
            (None, per_head.clone()),
        ] {
            let got = rows_to_cache_heads(&x, rotate, heads, d, capacity)?;
            let want = Tensor::cat(&[&filled, &spare], 1)?;
            assert_eq!(got.dims(), want.dims());
            let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(diff, 0.0);
        }
        assert!(rows_to_cache_heads(&x, None, heads, d, t - 1).is_err());
        assert!(rows_to_cache_heads(&x, None, heads + 1, d, capacity).is_err());
        Ok(())
    }

    #[test]
    fn merge_equals_cat_and_transpose() -> candle_core::Result<()> {
        let (n_h, d) = (3, 4);
        let a = Tensor::randn(0f32, 1.0, (n_h, 5, d), &Device::Cpu)?;
        let b = Tensor::randn(0f32, 1.0, (n_h, 2, d), &Device::Cpu)?;
        let want = Tensor::cat(&[&a, &b], 1)?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((7, n_h * d))?;
        let got = merge_heads(&[a, b])?;
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        Ok(())
    }

    #[test]
    fn refuses_mismatched_shapes() -> candle_core::Result<()> {
        let qkv = Tensor::zeros((3, 10), candle_core::DType::F32, &Device::Cpu)?;
        let tab = Tensor::zeros((3, 2), candle_core::DType::F32, &Device::Cpu)?;
        assert!(split_qkv_rope(&qkv, &tab, &tab, (1, 1, 4), 1.0).is_err());
        Ok(())
    }
}
