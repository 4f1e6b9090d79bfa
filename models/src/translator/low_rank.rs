//! The low-rank code of one tensor kind at one layer: SCD's Reuse map (for K and V) and the
//! linear part of the Patch encoder (for `H_in`).
//!
//! Fit (`docs/method.md` §1.4 and §4.3): stack one token's producer row `a` and consumer rows
//! `b_1..b_m` side by side, `x = [a | b_1 | ... | b_m]`; the top eigenvectors `W` of `E[x x^T]`
//! (centred or not) give the joint factorisation `x ~ z W^T` with a shared code `z = x W`. The
//! producer, which only has `a`, gets a ridge encoder `W_enc = (A^T A + lambda I)^-1 A^T Z`; each
//! consumer decodes its own rows with its block of `W`: `b_i ~ z W_i^T`. Everything comes from the
//! moments ([`super::moments`]), so no calibration row is kept.
//!
//! Ranks are nested: `W`'s columns are ordered by eigenvalue and each encoder column is its own
//! regression, so the first `r` columns of the encoder and rows of the decoders are the rank-`r`
//! code. A translator stores `r_max` once and each request picks its rank.

use candle_core::{DType, Device, Tensor};
use faer::linalg::solvers::Solve;
use faer::{Mat, Side};

use super::moments::Moments;
use super::TranslatorError;
use crate::kernels::RowOp;
use crate::ops;
use crate::prefill_matmul::PrefillMatmul;

/// How a low-rank code is fitted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FitOptions {
    /// Subtract the calibration means (kept on both sides, never sent).
    pub centre: bool,
    /// Ridge strength, relative to the producer block's mean variance.
    pub ridge: f64,
    /// Components kept (`r_max`).
    pub rank: usize,
}

/// A fitted low-rank code: producer rows `(T, d_a)` to codes `(T, r)` to each consumer's rows.
#[derive(Debug, Clone)]
pub struct LowRankCode {
    /// `(d_a)`: subtracted before encoding (zero when not centred).
    pub mean_a: Tensor,
    /// `(d_a, r_max)`.
    pub enc: Tensor,
    /// Per consumer `(d_b)`: added after decoding.
    pub means_b: Vec<Tensor>,
    /// Per consumer `(r_max, d_b)`.
    pub decs: Vec<Tensor>,
    /// Eigenvalues of the kept components, largest first (diagnostics, aligner scaling).
    pub eigenvalues: Vec<f64>,
}

impl LowRankCode {
    /// `r_max`.
    pub fn max_rank(&self) -> usize {
        self.eigenvalues.len()
    }

    /// Codes `(T, rank)` of producer rows `a` `(T, d_a)`, the product on `matmul`.
    pub fn encode(
        &self,
        a: &Tensor,
        rank: usize,
        matmul: PrefillMatmul,
    ) -> candle_core::Result<Tensor> {
        times(
            &ops::row_vector(a, &self.mean_a, RowOp::Sub)?,
            &self.enc.narrow(1, 0, rank)?,
            matmul,
        )
    }

    /// Consumer `expert`'s rows `(T, d_b)` from codes `z` `(T, r)`, any `r <= r_max`, the
    /// product on `matmul`.
    pub fn decode(
        &self,
        z: &Tensor,
        expert: usize,
        matmul: PrefillMatmul,
    ) -> candle_core::Result<Tensor> {
        let r = z.dim(1)?;
        let rows = times(z, &self.decs[expert].narrow(0, 0, r)?, matmul)?;
        ops::row_vector(&rows, &self.means_b[expert], RowOp::Add)
    }
}

/// `x m` for `m` `(k, n)`: on AMX tiles when `matmul` says so and `x` has a prompt's rows
/// (more than the few-rows kernels take), without gradients; otherwise candle's f32 matmul,
/// as calibration fitted the code.
fn times(x: &Tensor, m: &Tensor, matmul: PrefillMatmul) -> candle_core::Result<Tensor> {
    let m = m.contiguous()?;
    let tiles = matmul == PrefillMatmul::Tiles
        && !x.track_op()
        && !m.track_op()
        && x.dtype() == DType::F32
        && m.dtype() == DType::F32
        && x.dims2()?.0 > crate::kernels::MAX_ROWS;
    if tiles {
        crate::kernels::matmul_tiles(&x.contiguous()?, &m)
    } else {
        x.matmul(&m)
    }
}

fn to_tensor(m: &Mat<f64>) -> candle_core::Result<Tensor> {
    let (r, c) = (m.nrows(), m.ncols());
    let data: Vec<f32> = (0..r)
        .flat_map(|i| (0..c).map(move |j| (i, j)))
        .map(|(i, j)| m[(i, j)] as f32)
        .collect();
    Tensor::from_vec(data, (r, c), &Device::Cpu)
}

/// The top `rank` eigenvectors (columns, largest eigenvalue first) and eigenvalues of the
/// symmetric `w x w` row-major matrix `c`. Each vector's sign is fixed (largest entry
/// positive) so that fits are reproducible.
fn top_eigenvectors(
    c: &[f64],
    w: usize,
    rank: usize,
) -> Result<(Mat<f64>, Vec<f64>), TranslatorError> {
    let cm = Mat::<f64>::from_fn(w, w, |i, j| c[i * w + j]);
    let evd = cm
        .self_adjoint_eigen(Side::Lower)
        .map_err(|e| TranslatorError::Fit(format!("eigendecomposition failed: {e:?}")))?;
    let (u, s) = (evd.U(), evd.S());
    // Eigenvalues come in increasing order: the top `rank` are the last columns.
    let mut wmat = Mat::<f64>::zeros(w, rank);
    let mut eigenvalues = Vec::with_capacity(rank);
    for k in 0..rank {
        let col = w - 1 - k;
        eigenvalues.push(s.column_vector()[col].max(0.0));
        let (mut best, mut sign) = (0.0f64, 1.0);
        for i in 0..w {
            if u[(i, col)].abs() > best {
                best = u[(i, col)].abs();
                sign = u[(i, col)].signum();
            }
        }
        for i in 0..w {
            wmat[(i, k)] = sign * u[(i, col)];
        }
    }
    Ok((wmat, eigenvalues))
}

/// The principal components of the first `d` columns of the rows whose moments are `m` (the
/// producer's block of a calibration's joint rows, or rows of the producer alone): a code whose
/// one consumer is the producer itself, the encoder the orthonormal basis `W` (`d x d`, by
/// variance) and the decoder `W^T`. What the `kvtc` mode codes the base's own K and V in
/// ([`crate::translator::kvtc`]).
pub fn pca(m: &Moments, d: usize, centre: bool) -> Result<LowRankCode, TranslatorError> {
    let w = m.width();
    if d == 0 || d > w {
        return Err(TranslatorError::Fit(format!(
            "a block of {d} columns of rows of width {w}"
        )));
    }
    if m.count() < 2 {
        return Err(TranslatorError::Fit("no calibration rows".into()));
    }
    let full = m.second_moment(centre);
    let c: Vec<f64> = (0..d)
        .flat_map(|i| full[i * w..i * w + d].iter().copied())
        .collect();
    let (basis, eigenvalues) = top_eigenvectors(&c, d, d)?;
    let mean: Vec<f32> = match centre {
        true => m.mean()[..d].iter().map(|&x| x as f32).collect(),
        false => vec![0.0; d],
    };
    let mean = Tensor::from_vec(mean, d, &Device::Cpu)?;
    let enc = to_tensor(&basis)?;
    Ok(LowRankCode {
        mean_a: mean.clone(),
        decs: vec![enc.t()?.contiguous()?],
        enc,
        means_b: vec![mean],
        eigenvalues,
    })
}

/// Fits the code of the rows whose moments are `m`, made of blocks of `widths` (producer
/// first, then each consumer).
pub fn fit(
    m: &Moments,
    widths: &[usize],
    opts: FitOptions,
) -> Result<LowRankCode, TranslatorError> {
    let w = m.width();
    if widths.len() < 2 || widths.iter().sum::<usize>() != w {
        return Err(TranslatorError::Fit(format!(
            "blocks {widths:?} do not make rows of width {w}"
        )));
    }
    if m.count() < 2 {
        return Err(TranslatorError::Fit("no calibration rows".into()));
    }
    let d_a = widths[0];
    let rank = opts.rank.min(w).max(1);
    let c = m.second_moment(opts.centre);
    let (wmat, eigenvalues) = top_eigenvectors(&c, w, rank)?;
    // Ridge encoder from the moments: (C_AA + lambda I)^-1 C_AX W.
    let trace: f64 = (0..d_a).map(|i| c[i * w + i]).sum();
    let lambda = opts.ridge * trace / d_a as f64;
    let caa = Mat::<f64>::from_fn(d_a, d_a, |i, j| {
        c[i * w + j] + if i == j { lambda } else { 0.0 }
    });
    let cax = Mat::<f64>::from_fn(d_a, w, |i, j| c[i * w + j]);
    let rhs = &cax * &wmat;
    let enc = match caa.llt(Side::Lower) {
        Ok(llt) => llt.solve(&rhs),
        // The moments are positive semi-definite in exact arithmetic, but the centred ones are
        // a difference of sums: on (nearly) rank-deficient inputs with large means, rounding
        // leaves eigenvalues below -lambda and Cholesky stops. Solve through the eigenvectors
        // then, with those eigenvalues taken as zero (plus the ridge).
        Err(_) => {
            let evd = caa.self_adjoint_eigen(Side::Lower).map_err(|e| {
                TranslatorError::Fit(format!("ridge system eigendecomposition failed: {e:?}"))
            })?;
            let (v, s) = (evd.U(), evd.S());
            let mut proj = v.transpose() * &rhs;
            for i in 0..d_a {
                // s already includes lambda; a rounded-negative eigenvalue becomes lambda.
                let e = (s.column_vector()[i] - lambda).max(0.0) + lambda;
                for k in 0..rank {
                    proj[(i, k)] = if e > 0.0 { proj[(i, k)] / e } else { 0.0 };
                }
            }
            v * proj
        }
    };
    let mean = m.mean();
    let mean_of = |from: usize, len: usize| -> candle_core::Result<Tensor> {
        let v: Vec<f32> = if opts.centre {
            mean[from..from + len].iter().map(|&x| x as f32).collect()
        } else {
            vec![0.0; len]
        };
        Tensor::from_vec(v, len, &Device::Cpu)
    };
    let mut means_b = Vec::new();
    let mut decs = Vec::new();
    let mut from = d_a;
    for &d_b in &widths[1..] {
        means_b.push(mean_of(from, d_b)?);
        let block = Mat::<f64>::from_fn(rank, d_b, |k, j| wmat[(from + j, k)]);
        decs.push(to_tensor(&block)?);
        from += d_b;
    }
    Ok(LowRankCode {
        mean_a: mean_of(0, d_a)?,
        enc: to_tensor(&enc)?,
        means_b,
        decs,
        eigenvalues,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefill_matmul::PrefillMatmul::F32;

    fn err(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Rank-deficient producer rows: the centred moments come out with rounded-negative
    /// eigenvalues, below what a tiny ridge makes up for, and Cholesky stops; the fit still
    /// succeeds and reconstructs the consumer.
    #[test]
    fn fits_rank_deficient_rows_where_cholesky_stops() {
        let dev = Device::Cpu;
        let n = 400;
        let latent: Vec<f32> = (0..n * 2)
            .map(|i| ((i as f32) * 0.37).sin() + ((i as f32) * 0.011).cos())
            .collect();
        let latent = Tensor::from_vec(latent, (n, 2), &dev).unwrap();
        let mix_a = Tensor::new(
            &[[1f32, -2., 0.5, 3., 1., 0.], [0.5, 1., -1., 2., 0., 4.]],
            &dev,
        )
        .unwrap();
        let mix_b = Tensor::new(&[[2f32, 0., 1.], [-1., 3., 0.5]], &dev).unwrap();
        let a = latent.matmul(&mix_a).unwrap();
        let offset = Tensor::new(&[5f32, -3., 7.], &dev).unwrap();
        let b = latent
            .matmul(&mix_b)
            .unwrap()
            .broadcast_add(&offset)
            .unwrap();
        let mut m = Moments::new(9);
        m.add(&[&a, &b]).unwrap();
        let opts = FitOptions {
            centre: true,
            ridge: 1e-12,
            rank: 4,
        };
        let code = fit(&m, &[6, 3], opts).unwrap();
        let rebuilt = code
            .decode(&code.encode(&a, 2, F32).unwrap(), 0, F32)
            .unwrap();
        let e = err(&rebuilt, &b) / err(&b, &b.zeros_like().unwrap());
        assert!(e < 1e-3, "relative squared error {e}");
    }

    /// Producer rows on a 3-dimensional subspace, consumer rows a fixed linear map of them plus
    /// an offset: rank 3 reconstructs the consumer almost exactly, rank 1 does not, and the
    /// rank-1 code is the first column of the rank-3 one (nested).
    #[test]
    fn recovers_a_low_rank_linear_relation_with_nested_ranks() {
        let dev = Device::Cpu;
        let latent = Tensor::randn(0f32, 1.0, (500, 3), &dev).unwrap();
        let mix_a = Tensor::randn(0f32, 1.0, (3, 8), &dev).unwrap();
        let mix_b = Tensor::randn(0f32, 1.0, (3, 6), &dev).unwrap();
        let a = latent.matmul(&mix_a).unwrap();
        let offset = Tensor::new(&[5f32, -3., 1., 0., 2., 7.], &dev).unwrap();
        let b = latent
            .matmul(&mix_b)
            .unwrap()
            .broadcast_add(&offset)
            .unwrap();
        let mut m = Moments::new(14);
        m.add(&[&a, &b]).unwrap();
        let opts = FitOptions {
            centre: true,
            ridge: 1e-6,
            rank: 5,
        };
        let code = fit(&m, &[8, 6], opts).unwrap();
        assert_eq!(code.max_rank(), 5);
        assert!(code.eigenvalues[3] < 1e-3 * code.eigenvalues[0]);
        let full = code
            .decode(&code.encode(&a, 3, F32).unwrap(), 0, F32)
            .unwrap();
        assert!(err(&full, &b) < 1e-4, "rank 3: {}", err(&full, &b));
        let one = code
            .decode(&code.encode(&a, 1, F32).unwrap(), 0, F32)
            .unwrap();
        assert!(err(&one, &b) > 10.0 * err(&full, &b));
        let z3 = code.encode(&a, 3, F32).unwrap();
        let z1 = code.encode(&a, 1, F32).unwrap();
        // Equal up to the matmul's summation order, which depends on the output's shape.
        assert!(err(&z3.narrow(1, 0, 1).unwrap(), &z1) < 1e-10);
        // Without centring the offset must be carried by the components.
        let raw = fit(
            &m,
            &[8, 6],
            FitOptions {
                centre: false,
                ..opts
            },
        )
        .unwrap();
        assert_eq!(
            raw.mean_a
                .to_dtype(DType::F32)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0
        );
        assert!(fit(&m, &[8, 5], opts).is_err());
    }

    #[test]
    fn pca_of_a_block_is_an_orthonormal_basis_that_rebuilds_its_rows() {
        let dev = Device::Cpu;
        let n = 300;
        let data: Vec<f32> = (0..n * 5)
            .map(|i| ((i as f32) * 0.13).sin() * (1 + i % 5) as f32 + 2.0)
            .collect();
        let a = Tensor::from_vec(data, (n, 5), &dev).unwrap();
        let b = a.sqr().unwrap();
        let mut m = Moments::new(10);
        m.add(&[&a, &b]).unwrap();
        let code = pca(&m, 5, true).unwrap();
        assert_eq!(code.enc.dims(), [5, 5]);
        let gram = code.enc.t().unwrap().matmul(&code.enc).unwrap();
        assert!(err(&gram, &Tensor::eye(5, DType::F32, &dev).unwrap()) < 1e-10);
        assert!(code.eigenvalues.windows(2).all(|e| e[0] >= e[1]));
        let full = code
            .decode(&code.encode(&a, 5, F32).unwrap(), 0, F32)
            .unwrap();
        assert!(err(&full, &a) < 1e-9, "{}", err(&full, &a));
        // Two components keep the two largest variances: less error than any other pair would.
        let two = code
            .decode(&code.encode(&a, 2, F32).unwrap(), 0, F32)
            .unwrap();
        let left: f64 = code.eigenvalues[2..].iter().sum();
        assert!((f64::from(err(&two, &a)) * 5.0 - left).abs() < 1e-3 * (1.0 + left));
        assert!(pca(&m, 11, true).is_err() && pca(&Moments::new(5), 5, true).is_err());
    }
}
