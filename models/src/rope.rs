//! Rotary position embedding, interleaved variant (dimensions `2i` and `2i+1` rotate together by
//! `pos * theta^(-2i/d)`), at arbitrary, possibly non-contiguous positions.
//!
//! The angles are computed per call from the positions (a few thousand sines for a long
//! prompt), so there is no table and no maximum position here; the model enforces its context
//! window. Inverse rotation is rotation by the negated angle, so `inverse(apply(x)) == x` up to
//! float rounding.

use candle_core::{Device, Tensor};

use crate::config::LlamaConfig;
use crate::error::ForwardError;

/// The rotation of one model: head width and base frequency.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    head_dim: usize,
    inv_freq: Vec<f64>,
}

impl Rope {
    /// The rotation that `cfg`'s model uses.
    pub fn new(cfg: &LlamaConfig) -> Self {
        Self::with_params(cfg.head_dim, cfg.rope_theta)
    }

    /// A rotation for heads of width `head_dim` (even) and base `theta`.
    pub fn with_params(head_dim: usize, theta: f64) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64))
            .collect();
        Self { head_dim, inv_freq }
    }

    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// `(cos, sin)` tables of shape `(positions.len(), head_dim / 2)`, angles in f64.
    pub fn cos_sin(
        &self,
        positions: &[u32],
        device: &Device,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let a = f64::from(p) * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Ok((
            Tensor::from_vec(cos, (positions.len(), half), device)?,
            Tensor::from_vec(sin, (positions.len(), half), device)?,
        ))
    }

    /// Rotates `x` of shape `(T, n_heads * head_dim)` (the layout of captured K) so that row
    /// `t` sits at position `positions[t]`.
    pub fn apply(&self, x: &Tensor, positions: &[u32]) -> Result<Tensor, ForwardError> {
        self.rotate_rows(x, positions, false)
    }

    /// Undoes [`Rope::apply`]: rotates row `t` of `x` back from position `positions[t]`.
    pub fn inverse(&self, x: &Tensor, positions: &[u32]) -> Result<Tensor, ForwardError> {
        self.rotate_rows(x, positions, true)
    }

    fn rotate_rows(
        &self,
        x: &Tensor,
        positions: &[u32],
        inverse: bool,
    ) -> Result<Tensor, ForwardError> {
        let (t, width) = x.dims2()?;
        let tables = self.tables(positions)?;
        let tables = if inverse { tables.inverse()? } else { tables };
        let y = tables.rotate_to_heads(x)?;
        Ok(y.transpose(0, 1)?.reshape((t, width))?)
    }

    /// The angles of `positions`, computed once for every layer whose rows go to them (a
    /// cache rebuilt from codes rotates 30 layers' keys to the same positions; the sines and
    /// cosines were a quarter of filling it).
    pub fn tables(&self, positions: &[u32]) -> Result<RopeTables, ForwardError> {
        let (cos, sin) = self.cos_sin(positions, &Device::Cpu)?;
        Ok(RopeTables {
            head_dim: self.head_dim,
            rows: positions.len(),
            next: positions.iter().max().map_or(0, |&p| p as usize + 1),
            cos,
            sin,
        })
    }
}

/// [`Rope::cos_sin`] of one set of positions, with what rotating rows to them needs.
#[derive(Debug, Clone)]
pub struct RopeTables {
    head_dim: usize,
    rows: usize,
    /// One past the largest position.
    next: usize,
    /// `(rows, head_dim / 2)`.
    cos: Tensor,
    sin: Tensor,
}

impl RopeTables {
    /// The position after the largest one (0 for none).
    pub fn next_position(&self) -> usize {
        self.next
    }

    /// `(cos, sin)`, each `(rows, head_dim / 2)`.
    pub(crate) fn cos_sin(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// Checks that `t` rows go to these positions.
    pub(crate) fn check_rows(&self, t: usize) -> Result<(), ForwardError> {
        if t != self.rows {
            return Err(ForwardError::Positions {
                what: "rope input".into(),
                positions: self.rows,
                rows: t,
            });
        }
        Ok(())
    }

    /// The tables of the opposite rotation.
    fn inverse(self) -> candle_core::Result<Self> {
        Ok(Self {
            sin: self.sin.neg()?,
            ..self
        })
    }

    /// Rows `x` `(T, n_heads * head_dim)` rotated to the positions, head-major
    /// `(n_heads, T, head_dim)`: the cache's layout, with no copy back to rows.
    pub fn rotate_to_heads(&self, x: &Tensor) -> Result<Tensor, ForwardError> {
        let (t, width) = x.dims2()?;
        self.check_rows(t)?;
        if !width.is_multiple_of(self.head_dim) {
            return Err(ForwardError::Shape {
                what: "rope input (T, n_heads * head_dim)".into(),
                got: vec![t, width],
                expected: vec![t, self.head_dim],
            });
        }
        let heads = width / self.head_dim;
        let per_head = x
            .reshape((t, heads, self.head_dim))?
            .transpose(0, 1)?
            .contiguous()?;
        Ok(crate::ops::rope_heads(&per_head, &self.cos, &self.sin)?)
    }
}
