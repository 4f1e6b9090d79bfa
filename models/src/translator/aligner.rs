//! The Patch aligner `g`: from a code of the producer's attention input `Z_H` (rank `r`) to
//! the consumer's own attention input `H_in,B`, from which the consumer regenerates K and V
//! with its own weights (`docs/method.md` §1.5 and §4.4).
//!
//! `g(z) = z W_lin + b_lin + W_2 silu(W_1 (z / s) + b_1) + b_2`: the linear part is the
//! low-rank decoder of the joint factorisation and stays fixed; the MLP (candle-nn layers)
//! starts at zero and learns the residual, so the aligner is never worse than the linear
//! answer and adds only what the non-linearity can. `s`
//! whitens the code (its components' variances span orders of magnitude). Training uses the L2
//! loss against the consumer's `H_in` on calibration tokens, stops early on a held-out split,
//! and drops trailing code components at random ("nested dropout") so that any rank up to
//! `r_max` decodes well: ranks stay a per-request choice.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Linear, Module};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::low_rank::LowRankCode;
use super::TranslatorError;
use crate::kernels::RowOp;
use crate::ops;
use crate::optim::{AdamW, AdamWConfig};
use crate::prefill_matmul::PrefillMatmul;

/// Training settings of an aligner.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AlignerConfig {
    /// Width of the MLP's hidden layer.
    pub hidden: usize,
    /// Epochs at most.
    pub epochs: usize,
    /// Rows per optimisation step.
    pub batch: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// Epochs without a held-out improvement before stopping.
    pub patience: usize,
    /// Seed of initialisation, shuffling and rank dropout.
    pub seed: u64,
}

impl Default for AlignerConfig {
    fn default() -> Self {
        Self {
            hidden: 512,
            epochs: 30,
            batch: 256,
            lr: 1e-3,
            patience: 3,
            seed: 0,
        }
    }
}

/// A trained aligner.
#[derive(Debug, Clone)]
pub struct Aligner {
    /// `(r_max)`.
    pub z_scale: Tensor,
    /// The linear part: weight `(d, r_max)`, bias `(d)`.
    pub lin: Linear,
    /// `(hidden, r_max)`.
    pub mlp_in: Linear,
    /// `(d, hidden)`.
    pub mlp_out: Linear,
    /// Its fused forms ([`Aligner::then`]), made on first use.
    fused: FusedCache,
}

/// An aligner followed by a linear map (a consumer's K and V projections) as two products, for
/// codes of one rank: `silu(z W_1'^T + b_1)`, the code's whitening `1 / s` folded into `W_1'`,
/// then `[z | hidden]` times the composite of the aligner's output layers and the map. The
/// composite is made once in f32; per request this is two products where the aligner and the
/// projections took five products and seven element-wise passes, and the aligner's `d`-wide
/// output is never written (the map's `n` outputs are fewer). For the shipped translators
/// (`r_max` 256, hidden 512, SmolLM2's K and V) at rank 128 the two products have 39% of the
/// multiply-adds the f32 path spent with the code padded to `r_max`, 48% of the five unpadded.
enum FusedPatch {
    /// bf16 products on AMX tiles.
    Tiles {
        first: crate::kernels::TileLinear,
        second: crate::kernels::TileLinear,
    },
    /// f32 products: weights `(out, in)` and their biases.
    F32 {
        w1: Tensor,
        b1: Tensor,
        w2: Tensor,
        b2: Tensor,
    },
}

impl FusedPatch {
    fn forward(&self, z: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Tiles { first, second } => crate::kernels::skip_mlp_tiles(z, first, second),
            Self::F32 { w1, b1, w2, b2 } => {
                let hidden = ops::row_vector(&ops::linear(z, w1)?, b1, RowOp::AddSilu)?;
                let zh = Tensor::cat(&[z, &hidden], 1)?;
                ops::row_vector(&ops::linear(&zh, w2)?, b2, RowOp::Add)
            }
        }
    }
}

/// The fused forms an aligner keeps: a few (code rank, map) pairs, the latest first. A
/// request picks its ranks, so the cache is bounded rather than one entry per rank asked for.
#[derive(Default)]
struct FusedCache(Mutex<Vec<(FusedKey, Arc<FusedPatch>)>>);

/// A fused form's code rank, the name of its map and where its products run.
type FusedKey = (usize, String, PrefillMatmul);

/// The fused forms kept per aligner: the ranks a node's links use, not every rank a request
/// may ask for (each form is `(r + hidden) x n` weights: for SmolLM2's K and V at rank 128,
/// 0.5 MB in bf16 on tiles, 1.2 MB in f32 with the first layer).
const FUSED_KEPT: usize = 4;

impl Clone for FusedCache {
    /// A copy starts empty: its aligner's weights may be trained apart from the original's.
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for FusedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |v| v.len());
        write!(f, "FusedCache({n} forms)")
    }
}

/// How training went.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AlignerReport {
    /// Held-out mean squared error of the linear decoder alone (the starting point).
    pub linear_mse: f64,
    /// Held-out mean squared error of the trained aligner (the best epoch).
    pub mse: f64,
    /// Epochs run.
    pub epochs: usize,
}

impl Aligner {
    /// `H_in` rows `(T, d)` from codes `z` `(T, r)`, any `r <= r_max`, the products on
    /// `matmul` (training, which records gradients, multiplies in f32 whatever it says).
    pub fn forward(&self, z: &Tensor, matmul: PrefillMatmul) -> candle_core::Result<Tensor> {
        let r_max = self.z_scale.dim(0)?;
        let (t, r) = z.dims2()?;
        // A code's missing components are zeros, which add nothing to a product: on tiles the
        // layers take their weights' first `r` columns instead (half the products at the
        // default ranks); in f32 the code is padded, the products calibration measured.
        let (z, cols) = if r >= r_max || matmul == PrefillMatmul::Tiles {
            (z.clone(), r)
        } else {
            let pad = Tensor::zeros((t, r_max - r), DType::F32, z.device())?;
            (Tensor::cat(&[z, &pad], 1)?, r_max)
        };
        let scaled = z.broadcast_div(&self.z_scale.narrow(0, 0, cols)?)?;
        let hidden = apply(&self.mlp_in, &scaled, matmul)?.silu()?;
        apply(&self.lin, &z, matmul)? + apply(&self.mlp_out, &hidden, matmul)?
    }

    /// `map(g(z))` for codes `z` `(T, r)`, where `map` is linear without a constant term
    /// (`map(x) = x M`, such as a consumer's K and V projections with its adapter) and `key`
    /// names it: the fused form of this aligner and `map` for rank `r` with its products on
    /// `matmul`, made on the first call with that rank, key and setting (`map` is then called
    /// on the aligner's weights, in f32) and kept. The same function as [`Aligner::forward`]
    /// then `map`; on tiles the products are bf16 and callers check that the machine has them.
    pub(crate) fn then<E: From<candle_core::Error>>(
        &self,
        z: &Tensor,
        key: &str,
        matmul: PrefillMatmul,
        map: impl Fn(&Tensor) -> Result<Tensor, E>,
    ) -> Result<Tensor, E> {
        let (rows, r) = z.dims2()?;
        // As in the projections: tiles pay off for many rows, a few stream the f32 weights.
        let matmul = if rows <= crate::kernels::MAX_ROWS {
            PrefillMatmul::F32
        } else {
            matmul
        };
        let id = (r, key.to_string(), matmul);
        let cached = {
            let kept = self.fused.0.lock().map_err(poisoned)?;
            kept.iter().find(|(k, _)| *k == id).map(|(_, f)| f.clone())
        };
        let fused = match cached {
            Some(f) => f,
            None => {
                let f = Arc::new(self.fuse(r, matmul, map)?);
                let mut kept = self.fused.0.lock().map_err(poisoned)?;
                // Another request may have made the same form meanwhile.
                if !kept.iter().any(|(k, _)| *k == id) {
                    kept.insert(0, (id, f.clone()));
                    kept.truncate(FUSED_KEPT);
                }
                f
            }
        };
        Ok(fused.forward(z)?)
    }

    fn fuse<E: From<candle_core::Error>>(
        &self,
        r: usize,
        matmul: PrefillMatmul,
        map: impl Fn(&Tensor) -> Result<Tensor, E>,
    ) -> Result<FusedPatch, E> {
        use crate::kernels::TileLinear;
        let r_max = self.z_scale.dim(0)?;
        if r == 0 || r > r_max {
            return Err(
                candle_core::Error::Msg(format!("aligner: code rank {r} of {r_max}")).into(),
            );
        }
        let bias = |l: &Linear| -> candle_core::Result<Tensor> {
            match l.bias() {
                Some(b) => Ok(b.clone()),
                None => Tensor::zeros(l.weight().dim(0)?, DType::F32, l.weight().device()),
            }
        };
        // (z / s) W_1^T = z (W_1 diag(1 / s))^T, on the first r columns (a code's missing
        // components are zeros).
        let scale = self.z_scale.narrow(0, 0, r)?.unsqueeze(0)?;
        let w1 = self
            .mlp_in
            .weight()
            .narrow(1, 0, r)?
            .broadcast_div(&scale)?;
        let b1 = bias(&self.mlp_in)?;
        // g(z) = [z | hidden] [W_lin | W_2]^T + b_lin + b_2, so map(g(z)) = [z | hidden] M'
        // + map(b) with M' = map([W_lin | W_2]^T): the rows of that transpose are inputs of
        // the map.
        let stacked = Tensor::cat(
            &[
                self.lin.weight().narrow(1, 0, r)?.t()?,
                self.mlp_out.weight().t()?,
            ],
            0,
        )?
        .contiguous()?;
        let b = (bias(&self.lin)? + bias(&self.mlp_out)?)?.unsqueeze(0)?;
        let (m, b2) = (map(&stacked)?, map(&b)?.squeeze(0)?);
        Ok(match matmul {
            PrefillMatmul::Tiles => FusedPatch::Tiles {
                first: TileLinear::from_rows(&w1, &b1)?,
                second: TileLinear::from_columns(&m, &b2)?,
            },
            PrefillMatmul::F32 => FusedPatch::F32 {
                w1: w1.contiguous()?,
                b1,
                w2: m.t()?.contiguous()?,
                b2,
            },
        })
    }

    /// The named tensors of this aligner (prefix `name.`), for saving.
    pub fn tensors(&self, name: &str) -> Vec<(String, Tensor)> {
        let mut out = vec![(format!("{name}.z_scale"), self.z_scale.clone())];
        for (part, l) in [
            ("lin", &self.lin),
            ("mlp_in", &self.mlp_in),
            ("mlp_out", &self.mlp_out),
        ] {
            out.push((format!("{name}.{part}.weight"), l.weight().clone()));
            if let Some(b) = l.bias() {
                out.push((format!("{name}.{part}.bias"), b.clone()));
            }
        }
        out
    }

    /// An aligner from tensors saved by [`Aligner::tensors`].
    pub fn from_tensors(
        name: &str,
        mut take: impl FnMut(&str) -> Result<Tensor, TranslatorError>,
    ) -> Result<Self, TranslatorError> {
        let mut linear = |part: &str| -> Result<Linear, TranslatorError> {
            Ok(Linear::new(
                take(&format!("{name}.{part}.weight"))?,
                Some(take(&format!("{name}.{part}.bias"))?),
            ))
        };
        let lin = linear("lin")?;
        let mlp_in = linear("mlp_in")?;
        let mlp_out = linear("mlp_out")?;
        let z_scale = take(&format!("{name}.z_scale"))?;
        let r_max = z_scale.dim(0)?;
        let d = lin.weight().dim(0)?;
        let hidden = mlp_in.weight().dim(0)?;
        let shapes_fit = lin.weight().dims() == [d, r_max]
            && mlp_in.weight().dims() == [hidden, r_max]
            && mlp_out.weight().dims() == [d, hidden];
        if !shapes_fit {
            return Err(TranslatorError::Corrupt(format!(
                "aligner {name}: inconsistent shapes"
            )));
        }
        Ok(Self {
            z_scale,
            lin,
            mlp_in,
            mlp_out,
            fused: FusedCache::default(),
        })
    }
}

/// One of the aligner's layers on `x`, whose width may be less than the layer's input (the
/// first columns of its weight then apply): on tiles `x W^T + b` through the tile kernel
/// (which leaves rows that record gradients, and a few rows, to f32), else candle-nn's layer.
fn apply(layer: &Linear, x: &Tensor, matmul: PrefillMatmul) -> candle_core::Result<Tensor> {
    match matmul {
        PrefillMatmul::Tiles => {
            let (w, cols) = (layer.weight(), x.dim(1)?);
            let w = if cols < w.dim(1)? {
                w.narrow(1, 0, cols)?.contiguous()?
            } else {
                w.clone()
            };
            let y = ops::linear_packed(x, &w, None, true)?;
            match layer.bias() {
                Some(b) => ops::row_vector(&y, b, RowOp::Add),
                None => Ok(y),
            }
        }
        PrefillMatmul::F32 => layer.forward(x),
    }
}

fn poisoned<T>(_: std::sync::PoisonError<T>) -> candle_core::Error {
    candle_core::Error::Msg("aligner: a thread panicked while fusing this aligner".into())
}

fn mse(pred: &Tensor, target: &Tensor) -> candle_core::Result<f64> {
    Ok(f64::from(
        (pred - target)?.sqr()?.mean_all()?.to_scalar::<f32>()?,
    ))
}

/// Trains the aligner of consumer `expert` from producer rows `h_a` `(N, d_a)` and that
/// consumer's rows `h_b` `(N, d_b)`; the last `heldout` rows decide when to stop.
pub fn train(
    code: &LowRankCode,
    expert: usize,
    h_a: &Tensor,
    h_b: &Tensor,
    heldout: usize,
    cfg: &AlignerConfig,
) -> Result<(Aligner, AlignerReport), TranslatorError> {
    let dev = Device::Cpu;
    let r_max = code.max_rank();
    let n = h_a.dim(0)?;
    if heldout == 0 || heldout >= n {
        return Err(TranslatorError::Fit(format!(
            "aligner: {heldout} held-out rows of {n}"
        )));
    }
    let z = code.encode(h_a, r_max, PrefillMatmul::F32)?;
    let d = h_b.dim(1)?;
    let fit_rows = n - heldout;
    let (z_fit, z_val) = (z.narrow(0, 0, fit_rows)?, z.narrow(0, fit_rows, heldout)?);
    let (b_fit, b_val) = (
        h_b.narrow(0, 0, fit_rows)?,
        h_b.narrow(0, fit_rows, heldout)?,
    );

    let scale: Vec<f32> = code
        .eigenvalues
        .iter()
        .map(|&e| (e.max(1e-12)).sqrt() as f32)
        .collect();
    let z_scale = Tensor::from_vec(scale, r_max, &dev)?;
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let bound = (6.0 / r_max as f64).sqrt() as f32;
    let w1: Vec<f32> = (0..cfg.hidden * r_max)
        .map(|_| rng.gen_range(-bound..bound))
        .collect();
    // The linear part is the ridge decoder, already the least-squares answer for the full
    // code: it stays fixed. Letting Adam move it too (its steps are ~lr per element whatever
    // the gradient's scale) only ever made the held-out error worse than where it started,
    // so every aligner of the first translators stopped at its linear start.
    let lin = Linear::new(
        code.decs[expert].t()?.contiguous()?,
        Some(code.means_b[expert].clone()),
    );
    let vars = [
        Var::from_tensor(&Tensor::from_vec(w1, (cfg.hidden, r_max), &dev)?)?,
        Var::zeros(cfg.hidden, DType::F32, &dev)?,
        Var::zeros((d, cfg.hidden), DType::F32, &dev)?,
        Var::zeros(d, DType::F32, &dev)?,
    ];
    let build = |v: &[Tensor; 4]| Aligner {
        z_scale: z_scale.clone(),
        lin: lin.clone(),
        mlp_in: Linear::new(v[0].clone(), Some(v[1].clone())),
        mlp_out: Linear::new(v[2].clone(), Some(v[3].clone())),
        fused: FusedCache::default(),
    };
    let live = build(&vars.clone().map(|v| v.as_tensor().clone()));
    let snapshot = |vars: &[Var; 4]| -> candle_core::Result<[Tensor; 4]> {
        let copies = vars
            .iter()
            .map(|v| v.as_tensor().detach().copy())
            .collect::<candle_core::Result<Vec<_>>>()?;
        copies
            .try_into()
            .map_err(|_| candle_core::Error::Msg("aligner MLP has four tensors".into()))
    };
    let linear_mse = mse(&live.forward(&z_val, PrefillMatmul::F32)?, &b_val)?;
    let mut best = (linear_mse, snapshot(&vars)?);
    let mut opt = AdamW::new(vars.to_vec(), AdamWConfig::default())?;
    let mut order: Vec<u32> = (0..fit_rows as u32).collect();
    let (mut since_best, mut epochs) = (0, 0);
    for _ in 0..cfg.epochs {
        epochs += 1;
        order.shuffle(&mut rng);
        for chunk in order.chunks(cfg.batch) {
            let idx = Tensor::new(chunk, &dev)?;
            let mut zb = z_fit.index_select(&idx, 0)?;
            // Nested dropout: half the batches see only a random leading part of the code.
            if rng.gen_bool(0.5) {
                let keep = rng.gen_range(1..=r_max);
                let mask: Vec<f32> = (0..r_max).map(|i| f32::from(u8::from(i < keep))).collect();
                zb = zb.broadcast_mul(&Tensor::from_vec(mask, r_max, &dev)?)?;
            }
            let target = b_fit.index_select(&idx, 0)?;
            let loss = (live.forward(&zb, PrefillMatmul::F32)? - target)?
                .sqr()?
                .mean_all()?;
            let grads = loss.backward()?;
            let g: Vec<Option<Tensor>> = opt
                .params()
                .iter()
                .map(|v| grads.get(v.as_tensor()).cloned())
                .collect();
            opt.step(&g, cfg.lr)?;
        }
        let val = mse(&live.forward(&z_val, PrefillMatmul::F32)?, &b_val)?;
        if val < best.0 {
            best = (val, snapshot(&vars)?);
            since_best = 0;
        } else {
            since_best += 1;
            if since_best >= cfg.patience {
                break;
            }
        }
    }
    Ok((
        build(&best.1),
        AlignerReport {
            linear_mse,
            mse: best.0,
            epochs,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translator::low_rank::{fit, FitOptions};
    use crate::translator::moments::Moments;

    /// The consumer's rows are a non-linear function of the producer's: the linear decoder
    /// leaves an error the MLP can remove, and training must keep the fixed linear part and
    /// improve on it (the first translators' aligners never moved from their linear start).
    #[test]
    fn the_mlp_improves_on_the_linear_decoder_and_never_falls_below_it() {
        let dev = Device::Cpu;
        let n = 3000;
        let a = Tensor::randn(0f32, 1.0, (n, 6), &dev).unwrap();
        let mix = Tensor::randn(0f32, 0.5, (6, 4), &dev).unwrap();
        let lin = a.matmul(&mix).unwrap();
        // Half linear, half a saturating non-linearity of the same mixture.
        let b = ((&lin * 0.5).unwrap() + lin.tanh().unwrap().sqr().unwrap()).unwrap();
        let mut m = Moments::new(10);
        m.add(&[&a, &b]).unwrap();
        let code = fit(
            &m,
            &[6, 4],
            FitOptions {
                centre: true,
                ridge: 1e-6,
                rank: 6,
            },
        )
        .unwrap();
        let cfg = AlignerConfig {
            hidden: 64,
            epochs: 40,
            batch: 128,
            lr: 3e-3,
            patience: 5,
            seed: 7,
        };
        let (aligner, report) = train(&code, 0, &a, &b, 500, &cfg).unwrap();
        assert!(
            report.mse < 0.5 * report.linear_mse,
            "aligner {} vs linear {}",
            report.mse,
            report.linear_mse
        );
        // The stored aligner is the one reported, and its linear part is the decoder.
        let z = code
            .encode(&a.narrow(0, n - 500, 500).unwrap(), 6, PrefillMatmul::F32)
            .unwrap();
        let got = mse(
            &aligner.forward(&z, PrefillMatmul::F32).unwrap(),
            &b.narrow(0, n - 500, 500).unwrap(),
        )
        .unwrap();
        assert!((got - report.mse).abs() <= 1e-6 * report.mse.max(1e-12) + 1e-9);
        let dec = code.decs[0].t().unwrap();
        let diff = (aligner.lin.weight() - dec)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(diff, 0.0);
        // A code wider than r_max is an error on either path, not a panic.
        let wide = Tensor::zeros((3, 7), DType::F32, &Device::Cpu).unwrap();
        for matmul in [PrefillMatmul::F32, PrefillMatmul::Tiles] {
            assert!(aligner.forward(&wide, matmul).is_err());
        }
    }

    /// The aligner fused with a linear map is the aligner then the map, at every code rank
    /// (fewer components than `r_max` included), for each map it is given, with products on
    /// `matmul` (`tolerance` of the largest output); the forms kept stay bounded however many
    /// ranks requests ask for, and a rank above `r_max` is an error.
    fn fused_is_the_aligner_then_the_map(
        matmul: PrefillMatmul,
        tolerance: f32,
    ) -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (r_max, hidden, d, n) = (40, 96, 64, 48);
        let rand = |shape: &[usize], std: f32| Tensor::randn(0f32, std, shape, &dev);
        let parts = [
            ("a.z_scale", (rand(&[r_max], 1.0)?.abs()? + 0.5)?),
            ("a.lin.weight", rand(&[d, r_max], 0.2)?),
            ("a.lin.bias", rand(&[d], 0.2)?),
            ("a.mlp_in.weight", rand(&[hidden, r_max], 0.3)?),
            ("a.mlp_in.bias", rand(&[hidden], 0.3)?),
            ("a.mlp_out.weight", rand(&[d, hidden], 0.2)?),
            ("a.mlp_out.bias", rand(&[d], 0.2)?),
        ];
        let aligner = Aligner::from_tensors("a", |name| {
            let found = parts.iter().find(|(p, _)| *p == name);
            found
                .map(|(_, t)| t.clone())
                .ok_or_else(|| TranslatorError::Corrupt(name.into()))
        })
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let maps = [rand(&[d, n], 0.3)?, rand(&[d, n], 0.3)?];
        // Many rows (the products' blocked path) and a decode's few (the streaming one).
        for rows in [70, 3] {
            let z = rand(&[rows, r_max], 1.0)?;
            for r in [r_max, 17, 32, 5, 9, 11] {
                let z = z.narrow(1, 0, r)?.contiguous()?;
                let h = aligner.forward(&z, PrefillMatmul::F32)?;
                for (i, m) in maps.iter().enumerate() {
                    let expected = h.matmul(m)?;
                    let got = aligner.then(&z, &format!("map {i}"), matmul, |x| x.matmul(m))?;
                    let diff = (got - &expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    let scale = expected.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(
                        diff <= scale * tolerance,
                        "{rows} rows, rank {r}, map {i}: {diff} against {scale}"
                    );
                }
            }
        }
        let kept = aligner
            .fused
            .0
            .lock()
            .map(|v| v.len())
            .unwrap_or(usize::MAX);
        assert_eq!(kept, FUSED_KEPT, "12 forms asked for");
        let z = rand(&[5, r_max], 1.0)?;
        assert!(aligner
            .then(&z, "map 0", matmul, |x| x.matmul(&maps[0]))
            .is_ok());
        let wide = rand(&[5, r_max + 1], 1.0)?;
        assert!(aligner
            .then(&wide, "map 0", matmul, |x| x.matmul(&maps[0]))
            .is_err());
        Ok(())
    }

    #[test]
    fn fused_with_a_map_it_is_the_aligner_then_the_map_in_f32() -> candle_core::Result<()> {
        // f32 throughout, summed in another order: rounding, far from a wrong map or rank
        // (order one).
        fused_is_the_aligner_then_the_map(PrefillMatmul::F32, 1e-5)
    }

    #[test]
    #[ignore = "needs a CPU with AMX; `make test` runs it where the CPU has AMX (`make test-amx`)"]
    fn fused_with_a_map_it_is_the_aligner_then_the_map_on_amx_tiles() -> candle_core::Result<()> {
        assert_eq!(
            PrefillMatmul::best(),
            PrefillMatmul::Tiles,
            "this CPU or kernel cannot run AMX tiles"
        );
        // bf16 inputs to two products (8 bits of mantissa): a few parts in a thousand of the
        // largest output.
        fused_is_the_aligner_then_the_map(PrefillMatmul::Tiles, 1.0 / 64.0)
    }
}
