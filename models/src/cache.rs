//! The per-layer key/value cache: mutable state kept outside the model's immutable weights.
//!
//! Inside, each layer holds K (after RoPE) and V as `(kv_heads, capacity, head_dim)` buffers, the
//! layout attention multiplies with, filled up to `len`. Decode steps write into spare capacity
//! instead of re-concatenating the whole cache each token. At the boundary (injection and
//! export) K and V use the capture layout `(T, kv_heads * head_dim)`, one row per token.
//!
//! A cache can be injected: from post-RoPE K (what another model's cache holds) or from pre-RoPE
//! K plus the positions to rotate it to (what SCD rebuilds and what SemPIC re-positions).
//!
//! Buffers are f32, or f16 from the first decode step of a model on narrow decode weights
//! ([`crate::DecodeWeights::Narrow`], the default): a decode step reads every key and value of
//! every job it runs, and with several jobs those reads are more bytes than the weights.
//! llama.cpp keeps its cache in f16 by default for the same reason. A prefill keeps f32 (its
//! logits stay those of the f32 path); a layer turns f16 once, at the first step of at most 16
//! rows (the decode attention kernel's) that appends to it: a decode step, or a prompt that
//! short, which runs on the decode kernels anyway.

use candle_core::{DType, Tensor};
use half::slice::HalfFloatSliceExt;

use crate::config::LlamaConfig;
use crate::error::ForwardError;
use crate::kernels;
use crate::rope::{Rope, RopeTables};

/// Spare rows allocated beyond what is needed when a layer's buffer grows.
const GROW_ROWS: usize = 256;

#[derive(Debug, Clone)]
struct LayerKv {
    /// `(kv_heads, capacity, head_dim)`, f32 or f16 (both of one dtype).
    k: Tensor,
    v: Tensor,
    len: usize,
}

/// One layer's buffers made apart from a cache ([`KvCache::rotated_layer`]).
#[derive(Debug)]
pub struct RotatedLayer {
    layer: usize,
    kv: LayerKv,
    next_position: usize,
}

impl RotatedLayer {
    /// The layer it is.
    pub fn layer(&self) -> usize {
        self.layer
    }
}

/// Keys and values of the positions a model has seen, per layer.
///
/// Not `Clone`: decode steps write into the buffers in place, so a copy must not share them;
/// use [`KvCache::try_clone`].
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    kv_heads: usize,
    head_dim: usize,
    next_position: usize,
}

impl KvCache {
    /// An empty cache for `cfg`'s model.
    pub fn new(cfg: &LlamaConfig) -> Self {
        Self {
            layers: vec![None; cfg.num_layers],
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            next_position: 0,
        }
    }

    /// The most bytes a cache for `cfg`'s model holds for `positions` positions: at f32 (the
    /// width while it is rebuilt) with the spare rows its buffers grow by. What a consumer
    /// reserves for a job before rebuilding its cache.
    pub fn peak_bytes(cfg: &LlamaConfig, positions: usize) -> u64 {
        let per_row = 2 * cfg.num_kv_heads * cfg.head_dim * std::mem::size_of::<f32>();
        (cfg.num_layers * per_row) as u64 * (positions + GROW_ROWS) as u64
    }

    /// A cache from per-layer `(K after RoPE, V)`, each `(T, kv_heads * head_dim)`, one pair per
    /// layer of the model. New tokens will be placed from `next_position` on (usually `T`).
    pub fn from_post_rope(
        cfg: &LlamaConfig,
        layers: &[(Tensor, Tensor)],
        next_position: usize,
    ) -> Result<Self, ForwardError> {
        if layers.len() != cfg.num_layers {
            return Err(ForwardError::Shape {
                what: "injected cache (layers)".into(),
                got: vec![layers.len()],
                expected: vec![cfg.num_layers],
            });
        }
        let mut cache = Self::new(cfg);
        for (l, (k, v)) in layers.iter().enumerate() {
            let k = cache.rows_to_heads(k, &format!("injected K of layer {l}"))?;
            let v = cache.rows_to_heads(v, &format!("injected V of layer {l}"))?;
            if k.dim(1)? != v.dim(1)? {
                return Err(ForwardError::Shape {
                    what: format!("injected V of layer {l}"),
                    got: v.dims().to_vec(),
                    expected: k.dims().to_vec(),
                });
            }
            cache.append(l, &k, &v, false)?;
        }
        cache.next_position = next_position;
        Ok(cache)
    }

    /// A cache from per-layer `(K before RoPE, V)`, each `(T, kv_heads * head_dim)`; row `t` of K
    /// is rotated to `positions[t]`. New tokens go after the largest position.
    pub fn from_pre_rope(
        cfg: &LlamaConfig,
        rope: &Rope,
        layers: &[(Tensor, Tensor)],
        positions: &[u32],
    ) -> Result<Self, ForwardError> {
        if layers.len() != cfg.num_layers {
            return Err(ForwardError::Shape {
                what: "injected cache (layers)".into(),
                got: vec![layers.len()],
                expected: vec![cfg.num_layers],
            });
        }
        let mut cache = Self::new(cfg);
        let tables = rope.tables(positions)?;
        for (l, (k, v)) in layers.iter().enumerate() {
            cache.fill_layer_rotating(&tables, l, k, v)?;
        }
        Ok(cache)
    }

    /// Fills the empty `layer` from K before RoPE and V, each `(T, kv_heads * head_dim)`, row
    /// `t` of K rotated to `positions[t]`; the next position moves past the largest one. A
    /// consumer rebuilds its cache this way, layer by layer, as codes arrive.
    pub fn fill_layer_pre_rope(
        &mut self,
        rope: &Rope,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        positions: &[u32],
    ) -> Result<(), ForwardError> {
        self.fill_layer_rotating(&rope.tables(positions)?, layer, k, v)
    }

    /// [`KvCache::fill_layer_pre_rope`] with the positions' tables computed once for all layers.
    pub fn fill_layer_rotating(
        &mut self,
        tables: &RopeTables,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(), ForwardError> {
        if !k.track_op() && !v.track_op() {
            // The usual case (no gradients): each of K and V read once and written once, into
            // the layer's buffers.
            let filled = self.rotated_layer(tables, layer, k, v)?;
            return self.put_layer(filled);
        }
        self.check_empty(layer)?;
        // Checked before rotating: the rotation takes any number of heads.
        self.check_rows(k, &format!("K of layer {layer}"))?;
        let k = tables.rotate_to_heads(k)?;
        let v = self.rows_to_heads(v, &format!("V of layer {layer}"))?;
        if k.dim(1)? != v.dim(1)? {
            return Err(ForwardError::Shape {
                what: format!("V of layer {layer}"),
                got: v.dims().to_vec(),
                expected: k.dims().to_vec(),
            });
        }
        self.append(layer, &k, &v, false)?;
        self.next_position = self.next_position.max(tables.next_position());
        Ok(())
    }

    /// The buffers of empty layer `layer` from its pre-RoPE K and V rows (no gradients),
    /// rotated to `tables`' positions, without changing this cache: what
    /// [`KvCache::fill_layer_rotating`] does, split so that several layers can be made on
    /// several threads at once and then put in with [`KvCache::put_layer`].
    pub fn rotated_layer(
        &self,
        tables: &RopeTables,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<RotatedLayer, ForwardError> {
        self.check_empty(layer)?;
        let t = self.check_rows(k, &format!("K of layer {layer}"))?;
        tables.check_rows(t)?;
        if self.check_rows(v, &format!("V of layer {layer}"))? != t {
            return Err(ForwardError::Shape {
                what: format!("V of layer {layer}"),
                got: v.dims().to_vec(),
                expected: k.dims().to_vec(),
            });
        }
        let (heads, d, capacity) = (self.kv_heads, self.head_dim, t + GROW_ROWS);
        Ok(RotatedLayer {
            layer,
            kv: LayerKv {
                k: kernels::rows_to_cache_heads(k, Some(tables.cos_sin()), heads, d, capacity)?,
                v: kernels::rows_to_cache_heads(v, None, heads, d, capacity)?,
                len: t,
            },
            next_position: tables.next_position(),
        })
    }

    /// Puts in a layer made by [`KvCache::rotated_layer`] (of a cache of this shape), if the
    /// layer is still empty.
    pub fn put_layer(&mut self, filled: RotatedLayer) -> Result<(), ForwardError> {
        self.check_empty(filled.layer)?;
        let (h, _, d) = filled.kv.k.dims3()?;
        if (h, d) != (self.kv_heads, self.head_dim) {
            return Err(ForwardError::Shape {
                what: format!("K of layer {}", filled.layer),
                got: filled.kv.k.dims().to_vec(),
                expected: vec![self.kv_heads, filled.kv.len, self.head_dim],
            });
        }
        self.layers[filled.layer] = Some(filled.kv);
        self.next_position = self.next_position.max(filled.next_position);
        Ok(())
    }

    fn check_empty(&self, layer: usize) -> Result<(), ForwardError> {
        if layer >= self.layers.len() || self.layer_len(layer) > 0 {
            return Err(ForwardError::LayerRange {
                start: layer,
                end: layer + 1,
                layers: self.layers.len(),
            });
        }
        Ok(())
    }

    /// A deep copy whose buffers are independent of this cache's.
    pub fn try_clone(&self) -> Result<Self, ForwardError> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            layers.push(match l {
                Some(l) => Some(LayerKv {
                    k: l.k.copy()?,
                    v: l.v.copy()?,
                    len: l.len,
                }),
                None => None,
            });
        }
        Ok(Self {
            layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            next_position: self.next_position,
        })
    }

    /// Tokens held by layer 0 (every layer after a full forward pass).
    pub fn len(&self) -> usize {
        self.layer_len(0)
    }

    /// Whether layer 0 holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens held by `layer`.
    pub fn layer_len(&self, layer: usize) -> usize {
        self.layers
            .get(layer)
            .and_then(|l| l.as_ref())
            .map_or(0, |l| l.len)
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The position the next token gets by default.
    pub fn next_position(&self) -> usize {
        self.next_position
    }

    /// Overrides the position of the next token (e.g. after injecting a re-positioned block).
    pub fn set_next_position(&mut self, position: usize) {
        self.next_position = position;
    }

    /// Drops every token from index `len` on, in every layer (to reuse a shared prefix).
    pub fn truncate(&mut self, len: usize) {
        for l in self.layers.iter_mut().flatten() {
            l.len = l.len.min(len);
        }
        self.next_position = self.next_position.min(len);
    }

    /// `(K after RoPE, V)` of `layer` in the capture layout `(T, kv_heads * head_dim)`, f32
    /// whichever dtype the layer keeps.
    pub fn layer(&self, layer: usize) -> Result<Option<(Tensor, Tensor)>, ForwardError> {
        let Some(Some(l)) = self.layers.get(layer) else {
            return Ok(None);
        };
        let to_rows = |x: &Tensor| -> candle_core::Result<Tensor> {
            x.narrow(1, 0, l.len)?
                .transpose(0, 1)?
                .to_dtype(DType::F32)?
                .contiguous()?
                .reshape((l.len, self.kv_heads * self.head_dim))
        };
        Ok(Some((to_rows(&l.k)?, to_rows(&l.v)?)))
    }

    /// The dtype `layer` keeps its keys and values in (`None` while it is empty).
    pub fn layer_dtype(&self, layer: usize) -> Option<DType> {
        self.layers.get(layer)?.as_ref().map(|l| l.k.dtype())
    }

    /// Views of `layer`'s filled K and V, `(kv_heads, len, head_dim)`, in the layer's dtype.
    pub(crate) fn views(&self, layer: usize) -> candle_core::Result<Option<(Tensor, Tensor)>> {
        match self.layers.get(layer) {
            Some(Some(l)) => Ok(Some((l.k.narrow(1, 0, l.len)?, l.v.narrow(1, 0, l.len)?))),
            _ => Ok(None),
        }
    }

    /// Appends `(kv_heads, T, head_dim)` f32 keys (after RoPE) and values to `layer`, stored in
    /// f16 if `f16` (the layer's rows so far too, once) or in the layer's dtype (f32 for a new
    /// layer).
    ///
    /// Rows are written in place into spare capacity; when the new rows or the layer's rows
    /// carry gradients the buffers are rebuilt by concatenation instead, so that gradients flow
    /// through the cache (a SemPIC writer's compiled documents), in f32.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        f16: bool,
    ) -> candle_core::Result<()> {
        let t = k.dim(1)?;
        let differentiable = k.track_op()
            || v.track_op()
            || self.layers[layer]
                .as_ref()
                .is_some_and(|l| l.k.track_op() || l.v.track_op());
        let slot = &mut self.layers[layer];
        match slot {
            Some(l) if differentiable => {
                let filled = |x: &Tensor| x.narrow(1, 0, l.len)?.to_dtype(DType::F32);
                let k_all = Tensor::cat(&[&filled(&l.k)?, k], 1)?;
                let v_all = Tensor::cat(&[&filled(&l.v)?, v], 1)?;
                l.len += t;
                l.k = k_all;
                l.v = v_all;
            }
            None if differentiable => {
                *slot = Some(LayerKv {
                    k: k.clone(),
                    v: v.clone(),
                    len: t,
                });
            }
            Some(l) => {
                let dtype = if f16 { DType::F16 } else { l.k.dtype() };
                let cap = l.k.dim(1)?;
                let needed = l.len + t;
                if needed > cap
                    || !l.k.is_contiguous()
                    || !l.v.is_contiguous()
                    || l.k.dtype() != dtype
                {
                    let capacity = if needed > cap {
                        needed + GROW_ROWS
                    } else {
                        cap
                    };
                    let k_new = grow(&l.k, l.len, capacity, dtype)?;
                    let v_new = grow(&l.v, l.len, capacity, dtype)?;
                    l.k = k_new;
                    l.v = v_new;
                }
                l.k.slice_set(&k.to_dtype(dtype)?.contiguous()?, 1, l.len)?;
                l.v.slice_set(&v.to_dtype(dtype)?.contiguous()?, 1, l.len)?;
                l.len = needed;
            }
            None => {
                let (h, _, d) = k.dims3()?;
                let cap = t + GROW_ROWS;
                let dtype = if f16 { DType::F16 } else { DType::F32 };
                let kb = Tensor::zeros((h, cap, d), dtype, k.device())?;
                let vb = Tensor::zeros((h, cap, d), dtype, v.device())?;
                kb.slice_set(&k.to_dtype(dtype)?.contiguous()?, 1, 0)?;
                vb.slice_set(&v.to_dtype(dtype)?.contiguous()?, 1, 0)?;
                *slot = Some(LayerKv {
                    k: kb,
                    v: vb,
                    len: t,
                });
            }
        }
        Ok(())
    }

    fn rows_to_heads(&self, x: &Tensor, what: &str) -> Result<Tensor, ForwardError> {
        let t = self.check_rows(x, what)?;
        Ok(x.reshape((t, self.kv_heads, self.head_dim))?
            .transpose(0, 1)?
            .contiguous()?)
    }

    /// The rows of `x`, which must be `(T, kv_heads * head_dim)`.
    fn check_rows(&self, x: &Tensor, what: &str) -> Result<usize, ForwardError> {
        let width = self.kv_heads * self.head_dim;
        match x.dims() {
            &[t, w] if w == width => Ok(t),
            dims => Err(ForwardError::Shape {
                what: what.into(),
                got: dims.to_vec(),
                expected: vec![dims.first().copied().unwrap_or(0), width],
            }),
        }
    }
}

/// A `dtype` buffer of `capacity` rows holding the first `len` rows of `old`.
fn grow(old: &Tensor, len: usize, capacity: usize, dtype: DType) -> candle_core::Result<Tensor> {
    let (h, cap, d) = old.dims3()?;
    if dtype == DType::F16 && old.dtype() == DType::F32 && old.is_contiguous() {
        // A layer's one conversion, of every row it holds: candle converts an element at a
        // time, `half` eight at a time with F16C.
        let mut new = vec![half::f16::ZERO; h * capacity * d];
        kernels::with_f32(old, |src| {
            for (dst, src) in new
                .chunks_exact_mut(capacity * d)
                .zip(src.chunks_exact(cap * d))
            {
                dst[..len * d].convert_from_f32_slice(&src[..len * d]);
            }
            Ok(())
        })?;
        return Tensor::from_vec(new, (h, capacity, d), old.device());
    }
    let new = Tensor::zeros((h, capacity, d), dtype, old.device())?;
    if len > 0 {
        new.slice_set(&old.narrow(1, 0, len)?.to_dtype(dtype)?.contiguous()?, 1, 0)?;
    }
    Ok(new)
}
