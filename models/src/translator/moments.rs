//! Running first and second moments of calibration rows, the only thing the factorisations need
//! from the data: a row is the side-by-side concatenation `[a | b_1 | ... | b_m]` of one token's
//! producer and consumer tensors, and the sums are kept in f64 for any number of tokens, so
//! memory is `width^2` whatever the calibration size.

use candle_core::{DType, Tensor};

use super::TranslatorError;

/// `n`, `sum x` and `sum x x^T` over the rows seen.
#[derive(Debug, Clone)]
pub struct Moments {
    width: usize,
    n: u64,
    sum: Vec<f64>,
    /// Row-major `width x width`.
    outer: Vec<f64>,
}

impl Moments {
    /// No rows yet, for rows of `width` values.
    pub fn new(width: usize) -> Self {
        Self {
            width,
            n: 0,
            sum: vec![0.0; width],
            outer: vec![0.0; width * width],
        }
    }

    /// Row width.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Rows seen.
    pub fn count(&self) -> u64 {
        self.n
    }

    /// Adds the rows `[blocks[0] | blocks[1] | ...]`, each block `(T, d_i)` with the same `T`.
    pub fn add(&mut self, blocks: &[&Tensor]) -> Result<(), TranslatorError> {
        let x = Tensor::cat(blocks, 1)?.to_dtype(DType::F32)?;
        let (t, w) = x.dims2()?;
        if w != self.width {
            return Err(TranslatorError::Fit(format!(
                "calibration rows of width {w}, expected {}",
                self.width
            )));
        }
        // One matmul per prompt; a few hundred rows summed in f32 lose nothing that matters
        // before they join the f64 totals.
        let xtx = x.t()?.matmul(&x)?.flatten_all()?.to_vec1::<f32>()?;
        for (acc, v) in self.outer.iter_mut().zip(xtx) {
            *acc += f64::from(v);
        }
        let colsum = x.sum(0)?.to_vec1::<f32>()?;
        for (acc, v) in self.sum.iter_mut().zip(colsum) {
            *acc += f64::from(v);
        }
        self.n += t as u64;
        Ok(())
    }

    /// The mean row.
    pub fn mean(&self) -> Vec<f64> {
        let n = self.n.max(1) as f64;
        self.sum.iter().map(|s| s / n).collect()
    }

    /// `E[x x^T]`, minus `mean mean^T` when `centred`: row-major `width x width`.
    pub fn second_moment(&self, centred: bool) -> Vec<f64> {
        let n = self.n.max(1) as f64;
        let mean = self.mean();
        let w = self.width;
        let mut out = vec![0.0; w * w];
        for i in 0..w {
            for j in 0..w {
                let mut v = self.outer[i * w + j] / n;
                if centred {
                    v -= mean[i] * mean[j];
                }
                out[i * w + j] = v;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn moments_of_two_batches_equal_moments_of_all_rows() {
        let a = Tensor::randn(1f32, 2.0, (7, 3), &Device::Cpu).unwrap();
        let b = Tensor::randn(-1f32, 1.0, (7, 2), &Device::Cpu).unwrap();
        let mut m = Moments::new(5);
        m.add(&[&a.narrow(0, 0, 4).unwrap(), &b.narrow(0, 0, 4).unwrap()])
            .unwrap();
        m.add(&[&a.narrow(0, 4, 3).unwrap(), &b.narrow(0, 4, 3).unwrap()])
            .unwrap();
        let x = Tensor::cat(&[&a, &b], 1)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        let rows = x.to_vec2::<f64>().unwrap();
        let mean: Vec<f64> = (0..5)
            .map(|j| rows.iter().map(|r| r[j]).sum::<f64>() / 7.0)
            .collect();
        let cov = m.second_moment(true);
        for i in 0..5 {
            assert!((m.mean()[i] - mean[i]).abs() < 1e-5);
            for j in 0..5 {
                let want = rows
                    .iter()
                    .map(|r| (r[i] - mean[i]) * (r[j] - mean[j]))
                    .sum::<f64>()
                    / 7.0;
                assert!((cov[i * 5 + j] - want).abs() < 1e-4, "{i},{j}");
            }
        }
        assert_eq!(m.count(), 7);
        assert!(m.add(&[&a]).is_err());
    }
}
