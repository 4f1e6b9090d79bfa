//! Attention of a prefill's many query rows on AMX tiles.
//!
//! The two products of attention (scores `Q K^T`, then `P V`) are the prefill's other big
//! matmuls: for 1,024 tokens a sixth of the flops of the projections, but in f32 they took
//! about as long as the projections on tiles. Here each task is one KV head and one chunk of
//! consecutive queries: the queries of the heads that share the KV head are stacked (so keys
//! and values are packed once for all of them), the keys the chunk can see are packed as a
//! tile weight, the scores go through a causal softmax that writes the probabilities in bf16
//! ([`super::softmax`]), and the values, packed transposed, are multiplied by them. Products
//! are bf16 with f32 sums, as the projections' ([`super::amx`]).

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::amx;
use super::attend::{heads_view, Shapes};
use super::softmax::softmax_prefix_bf16;

/// Query rows per task: small enough that even a 256-token prefill gives each core a few
/// tasks, large enough that packing a chunk's keys is a small part of its work.
const CHUNK: usize = 128;

/// Attention outputs `(n_h, t, d)` of queries `q` `(n_h, t, d)` (scaled and rotated) over keys
/// `k` and values `v` `(n_kv, n_keys, d)` (views of the cache, rows `d` apart), query `i` at
/// key index `past + i`; query head `h` uses KV head `h / (n_h / n_kv)`. Callers check
/// [`amx::available`].
pub(crate) fn attend_tiles(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
) -> candle_core::Result<Tensor> {
    let Shapes {
        n_h, t, d, n_kv, ..
    } = Shapes::of("attend_tiles", q, k, v, past)?;
    let groups = n_h / n_kv;
    let q = q.contiguous()?;
    let tasks: Vec<(usize, usize)> = (0..n_kv)
        .flat_map(|g| (0..t).step_by(CHUNK).map(move |start| (g, start)))
        .collect();
    let mut out: Vec<f32> = vec![0f32; n_h * t * d];
    let shared = amx::SharedOut(out.as_mut_ptr());
    heads_view(&q, |qs, _| {
        heads_view(k, |ks, k_head| {
            heads_view(v, |vs, v_head| {
                tasks.par_iter().for_each(|&(g, start)| {
                    let rows = CHUNK.min(t - start);
                    let seen = past + start + rows;
                    let heads = g * groups..(g + 1) * groups;
                    let at = |h: usize| h * t * d + start * d;
                    amx::with_scratch(|s| {
                        s.x.clear();
                        for h in heads.clone() {
                            s.x.extend_from_slice(&qs[at(h)..][..rows * d]);
                        }
                        let o = chunk(
                            s,
                            (groups * rows, rows),
                            &ks[g * k_head..][..seen * d],
                            &vs[g * v_head..][..seen * d],
                            (past + start, d),
                        );
                        for (h, head_rows) in heads.zip(o.chunks_exact(rows * d)) {
                            // SAFETY: task (g, start) writes rows `start..start + rows` of the
                            // heads of KV head `g`: no two tasks write the same element, and
                            // `out` outlives the loop.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    head_rows.as_ptr(),
                                    shared.at(at(h)),
                                    rows * d,
                                )
                            };
                        }
                    });
                });
                Ok(())
            })
        })
    })?;
    Tensor::from_vec(out, (n_h, t, d), &Device::Cpu)
}

/// One task: the queries in `s.x` `(stacked, d)` (each head's `rows` consecutive queries, the
/// first at key index `first`) over `keys` and `values` `(seen, d)`; outputs `(stacked, d)`.
fn chunk<'s>(
    s: &'s mut amx::Scratch,
    (stacked, rows): (usize, usize),
    keys: &[f32],
    values: &[f32],
    (first, d): (usize, usize),
) -> &'s [f32] {
    let seen = keys.len() / d;
    s.weight.repack(keys, seen, d);
    // Scores in rows of `width` (`seen` rounded up to whole tiles).
    let width = amx::linear_padded((&s.x, d), stacked, &s.weight, &mut s.a, &mut s.y);
    // The probabilities in bf16 are the second product's `x`: the softmax writes them there,
    // zeros past what each query may see (padding included), and zero padding rows.
    s.weight.repack_transposed(values, seen, d);
    debug_assert_eq!(s.weight.padded_depth(), width);
    let rows_pad = amx::padded_rows(stacked);
    // Each of the first `stacked` rows is written whole below; only the padding rows are
    // zeroed (a whole cleared buffer per chunk is a pass over it for nothing).
    s.a.resize(rows_pad * width, 0);
    s.a[stacked * width..rows_pad * width].fill(0);
    for (r, (scores, probs)) in
        s.y.chunks_exact_mut(width)
            .zip(s.a.chunks_exact_mut(width))
            .take(stacked)
            .enumerate()
    {
        // SAFETY: the tile path runs only where `amx::available()`, which checked AVX-512F
        // and AVX512_BF16; `width` is a multiple of 32.
        unsafe { softmax_prefix_bf16(scores, first + r % rows + 1, probs) };
    }
    let d_pad = amx::linear_padded_bf16(&s.a, rows_pad, &s.weight, &mut s.x);
    debug_assert_eq!(d_pad, d.next_multiple_of(32));
    if d_pad != d {
        // Rows of `d_pad` to rows of `d`, in place.
        for r in 0..stacked {
            s.x.copy_within(r * d_pad..r * d_pad + d, r * d);
        }
    }
    &s.x[..stacked * d]
}

#[cfg(test)]
mod tests {
    use super::super::test_values as values;
    use super::*;

    /// Plain f64 attention of query `i` over keys `0..=past + i`.
    fn reference(q: &[f32], k: &[f32], v: &[f32], dims: [usize; 5]) -> Vec<f32> {
        let [n_h, n_kv, t, n_keys, d] = dims;
        let groups = n_h / n_kv;
        let mut out = vec![0f32; n_h * t * d];
        let past = n_keys - t;
        for h in 0..n_h {
            let g = h / groups;
            for i in 0..t {
                let qr = &q[(h * t + i) * d..][..d];
                let seen = past + i + 1;
                let s: Vec<f64> = (0..seen)
                    .map(|j| {
                        let kr = &k[(g * n_keys + j) * d..][..d];
                        qr.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for c in 0..d {
                    let o: f64 = (0..seen)
                        .map(|j| e[j] / z * v[(g * n_keys + j) * d + c] as f64)
                        .sum();
                    out[(h * t + i) * d + c] = o as f32;
                }
            }
        }
        out
    }

    #[test]
    #[ignore = "needs a CPU with AMX; `make test` runs it where the CPU has AMX (`make test-amx`)"]
    fn tile_attention_matches_plain_attention_on_amx_tiles() {
        assert!(amx::available(), "this CPU or kernel cannot run AMX tiles");
        // Several chunks, a chunk that is not whole, keys from a cache before the queries, a
        // key count that is not a multiple of 32.
        for &(n_h, n_kv, t, past, d) in
            &[(9, 3, 300, 0, 64), (4, 2, 40, 17, 64), (2, 1, 130, 5, 32)]
        {
            let n_keys = past + t;
            let q = values(n_h * t * d, 1);
            let k = values(n_kv * n_keys * d, 2);
            let v = values(n_kv * n_keys * d, 3);
            let want = reference(&q, &k, &v, [n_h, n_kv, t, n_keys, d]);
            let tensor = |x: &[f32], a, b| Tensor::from_slice(x, (a, b, d), &Device::Cpu).unwrap();
            let got = attend_tiles(
                &tensor(&q, n_h, t),
                &tensor(&k, n_kv, n_keys),
                &tensor(&v, n_kv, n_keys),
                past,
            )
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
            // bf16 inputs to both products: about 3 significant digits.
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                worst < 2e-2,
                "({n_h}, {n_kv}, {t}, {past}, {d}): max |d| {worst}"
            );
        }
    }
}
