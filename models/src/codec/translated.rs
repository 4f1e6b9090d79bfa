//! SCD's two modes over a calibrated translator ([`crate::translator`]): `reuse` rebuilds
//! every layer from low-rank codes of K and V; `scd` does the same except on the translator's
//! Patch layers, where it sends a code of the attention input `H_in` instead, aligns it to the
//! consumer with the MLP, and lets the consumer regenerate K and V with its own weights.
//!
//! Codes are `(T, r)` matrices in f16 (default), bf16, f32, int8 rows, or transform-coded
//! ([`super::transform`]: a step per component from one rate, entropy-coded); the ranks are the
//! request's, any up to the translator's `r_max`, and the consumer reads them from the shapes.
//! The consumer rebuilds each layer as soon as its codes are in, so rebuild overlaps transfer.

use std::sync::Arc;

use candle_core::Tensor;
use scd_types::{CodeDType, CodeKind, LayerCode, Mode};

use super::tensor_bytes::from_bytes;
use super::{
    check_layer, dtype_name, kind_name, tc_code, tc_tensor, tensor_code, Codec, CodecError,
    LayerDecoder, Prefix, TcRate,
};
use crate::cache::{KvCache, RotatedLayer};
use crate::llama::{Capture, LayerCapture, Llama, Proj};
use crate::prefill_matmul::PrefillMatmul;
use crate::rope::RopeTables;
use crate::translator::{Ranks, Translator};

/// Code dtypes these modes send.
pub const CODE_DTYPES: [CodeDType; 5] = [
    CodeDType::F16,
    CodeDType::BF16,
    CodeDType::F32,
    CodeDType::I8_ROWS,
    CodeDType::TC,
];

/// `reuse` or `scd` over one translator, for one of its consumers.
#[derive(Debug, Clone)]
pub struct Translated {
    translator: Arc<Translator>,
    mode: Mode,
    expert: usize,
    ranks: Ranks,
    dtype: CodeDType,
    /// The layers this producer patches (empty for `reuse`).
    patch: Vec<usize>,
    /// The rate of transform-coded codes.
    rate: TcRate,
    /// Where the codes' products run: the best this machine has unless set
    /// ([`Self::with_matmul`], from [`super::CodecOptions::matmul`]).
    matmul: PrefillMatmul,
    /// The wanted step of every component, per layer, of transform-coded codes.
    steps: Option<Arc<Vec<LayerSteps>>>,
}

/// The wanted quantiser step of each component of one layer's codes ([`CodeDType::TC`]).
#[derive(Debug, Clone)]
struct LayerSteps {
    k: Vec<f32>,
    v: Vec<f32>,
    h: Vec<f32>,
}

/// Steps that make every component's error cost the same in the consumer's rows: a code
/// component `j` reaches the consumer through its decoder row `W_j`, so an error `e` in it
/// becomes `e W_j`, of squared size `e^2 |W_j|^2`; a step `scale / |W_j|` gives every component
/// the same distortion there, which is reverse water-filling's rule for entropy-coded uniform
/// quantisers (components under the threshold get no bits: [`super::transform::ZERO_BELOW`]).
pub(crate) fn equal_distortion_steps(dec: &Tensor, scale: f32) -> Result<Vec<f32>, CodecError> {
    let norms = dec.sqr()?.sum(1)?.sqrt()?.to_vec1::<f32>()?;
    Ok(norms
        .into_iter()
        .map(|n| if n > 0.0 { scale / n } else { f32::INFINITY })
        .collect())
}

impl LayerSteps {
    /// Layer `l`'s steps for consumer `expert` at `rate`, K's, V's and `H_in`'s scaled by
    /// `scales` (the translator's rate table's).
    fn of(
        translator: &Translator,
        l: usize,
        expert: usize,
        rate: TcRate,
        [k, v, h]: [f32; 3],
    ) -> Result<Self, CodecError> {
        let layer = &translator.layers[l];
        Ok(Self {
            k: equal_distortion_steps(&layer.k.decs[expert], rate.step * k)?,
            v: equal_distortion_steps(&layer.v.decs[expert], rate.step * v)?,
            // `H_in` reaches K and V through the aligner, which has no row to weigh: one step.
            h: layer
                .patch
                .as_ref()
                .map_or_else(Vec::new, |p| vec![rate.step * h; p.h.max_rank()]),
        })
    }
}

impl Translated {
    /// The codec of `mode` (`reuse` or `scd`) for consumer number `expert` of `translator`,
    /// sending codes of `ranks` in `dtype`, patching the first `patch_k` layers of the
    /// translator's greedy order (its default set when `None`).
    pub fn new(
        translator: Arc<Translator>,
        mode: Mode,
        expert: usize,
        ranks: Ranks,
        dtype: CodeDType,
        patch_k: Option<usize>,
    ) -> Result<Self, CodecError> {
        if !mode.uses_translator_codes() {
            return Err(CodecError::Unavailable(format!(
                "a translator carries reuse and scd, not {mode}"
            )));
        }
        if !CODE_DTYPES.contains(&dtype) {
            return Err(CodecError::Unavailable(format!(
                "codes cannot be sent as {}",
                dtype_name(dtype)
            )));
        }
        if expert >= translator.manifest.consumers.len() {
            return Err(CodecError::Unavailable(format!(
                "the translator has {} consumers, not {}",
                translator.manifest.consumers.len(),
                expert + 1
            )));
        }
        translator
            .check_ranks(ranks)
            .map_err(|e| CodecError::Unavailable(e.to_string()))?;
        let patch = match mode {
            Mode::Scd => translator
                .patch_set(patch_k)
                .map_err(|e| CodecError::Unavailable(e.to_string()))?,
            _ => Vec::new(),
        };
        let matmul = PrefillMatmul::best();
        Self {
            translator,
            mode,
            expert,
            ranks,
            dtype,
            patch,
            matmul,
            rate: TcRate::default(),
            steps: None,
        }
        .with_tc_rate(TcRate::default())
    }

    /// This codec's transform-coded codes at `rate` (nothing changes for other dtypes).
    pub fn with_tc_rate(mut self, rate: TcRate) -> Result<Self, CodecError> {
        if self.dtype != CodeDType::TC {
            return Ok(self);
        }
        rate.check().map_err(CodecError::Unavailable)?;
        let scales = self.translator.tc_scales(self.expert);
        let layers = (0..self.translator.layers.len())
            .map(|l| LayerSteps::of(&self.translator, l, self.expert, rate, scales))
            .collect::<Result<Vec<_>, _>>()?;
        self.steps = Some(Arc::new(layers));
        self.rate = rate;
        Ok(self)
    }

    /// This codec with its products on `matmul` (a node passes its prefill's, so that it runs
    /// its translator on the path it prefills on); tiles where the machine lacks them are
    /// refused.
    pub fn with_matmul(mut self, matmul: PrefillMatmul) -> Result<Self, CodecError> {
        self.matmul = matmul
            .check_available()
            .map_err(|e| CodecError::Unavailable(e.to_string()))?;
        Ok(self)
    }

    /// The translator.
    pub fn translator(&self) -> &Arc<Translator> {
        &self.translator
    }

    /// The ranks sent.
    pub fn ranks(&self) -> Ranks {
        self.ranks
    }

    /// Whether this producer patches `layer`. The consumer needs no such list: it takes a
    /// layer's codes as they come, Patch where the translator has a Patch part for the layer.
    fn is_patch(&self, layer: usize) -> bool {
        self.patch.contains(&layer)
    }

    /// The Patch layers of this codec.
    pub fn patch_layers(&self) -> &[usize] {
        &self.patch
    }

    /// The bytes this codec's payload for a prefix of `rows` tokens puts on the wire, known
    /// before anything is encoded (what a choice of ranks for a link needs); for
    /// transform-coded codes, whose size depends on the values, the most it can be.
    pub fn payload_bytes(&self, rows: usize) -> u64 {
        let len = |r: usize| {
            LayerCode::max_len(self.dtype, &[rows as u32, r as u32]).unwrap_or(usize::MAX) as u64
        };
        (0..self.translator.layers.len())
            .map(|l| match self.is_patch(l) {
                true => len(self.ranks.h),
                false => len(self.ranks.k).saturating_add(len(self.ranks.v)),
            })
            .fold(0u64, u64::saturating_add)
    }

    /// [`Codec::encode_layer`]'s work, on a thread of the pool.
    fn encode_on_pool(
        &self,
        capture: &LayerCapture,
        out: &mut Vec<LayerCode>,
    ) -> Result<(), CodecError> {
        let l = capture.layer;
        let t = self
            .translator
            .layers
            .get(l)
            .ok_or(CodecError::LayerOutOfRange {
                layer: l as u16,
                layers: self.translator.layers.len(),
            })?;
        let missing = |what| CodecError::MissingCapture { layer: l, what };
        if self.is_patch(l) {
            let h = capture.h_in.as_ref().ok_or_else(|| missing("H_in"))?;
            let patch = t
                .patch
                .as_ref()
                .ok_or_else(|| missing("patch translator"))?;
            let z = patch.h.encode(h, self.ranks.h, self.matmul)?;
            out.push(self.code(l, CodeKind::PATCH_H, &z)?);
        } else {
            let k = capture
                .k_pre_rope
                .as_ref()
                .ok_or_else(|| missing("K before RoPE"))?;
            let v = capture.v.as_ref().ok_or_else(|| missing("V"))?;
            // K's and V's codes on two threads: entropy coding is most of a tc code's cost,
            // and one code's columns go through one coder.
            let (k, v) = rayon::join(
                || {
                    self.code(
                        l,
                        CodeKind::REUSE_K,
                        &t.k.encode(k, self.ranks.k, self.matmul)?,
                    )
                },
                || {
                    self.code(
                        l,
                        CodeKind::REUSE_V,
                        &t.v.encode(v, self.ranks.v, self.matmul)?,
                    )
                },
            );
            out.push(k?);
            out.push(v?);
        }
        Ok(())
    }

    /// Layer `l`'s code of `kind` holding `z` `(T, r)` in this codec's dtype.
    fn code(&self, l: usize, kind: CodeKind, z: &Tensor) -> Result<LayerCode, CodecError> {
        let Some(steps) = &self.steps else {
            return tensor_code(l, kind, self.dtype, z);
        };
        let s = &steps[l];
        let wanted = match kind {
            CodeKind::REUSE_K => &s.k,
            CodeKind::REUSE_V => &s.v,
            _ => &s.h,
        };
        tc_code(l, kind, z, wanted)
    }
}

impl Codec for Translated {
    fn mode(&self) -> Mode {
        self.mode
    }

    fn variant(&self) -> String {
        match self.dtype {
            CodeDType::TC => format!("tc step {}", self.rate.step),
            _ => String::new(),
        }
    }

    fn capture(&self) -> Option<Capture> {
        Some(Capture {
            k_pre_rope: true,
            v: true,
            h_in: self.mode == Mode::Scd,
            ..Capture::none()
        })
    }

    fn encode_layer(
        &self,
        capture: &LayerCapture,
        out: &mut Vec<LayerCode>,
    ) -> Result<(), CodecError> {
        crate::kernels::on_pool(|| self.encode_on_pool(capture, out))
    }

    fn decoder<'a>(
        &'a self,
        consumer: &'a Llama,
        prefix: Prefix<'a>,
    ) -> Result<Box<dyn LayerDecoder + 'a>, CodecError> {
        let me = &self.translator.manifest.consumers[self.expert];
        if !me.model.matches(consumer) {
            return Err(CodecError::Unavailable(format!(
                "the translator's consumer {} is not the model decoding",
                me.name
            )));
        }
        let layers = consumer.config().num_layers;
        if layers != self.translator.layers.len() {
            return Err(CodecError::Unavailable(format!(
                "the translator has {} layers, the consumer {layers}",
                self.translator.layers.len()
            )));
        }
        Ok(Box::new(TranslatedDecoder {
            codec: self,
            consumer,
            rope: consumer.rope().tables(&prefix.positions())?,
            positions: prefix.positions(),
            cache: {
                let mut c = consumer.new_cache();
                c.set_next_position(prefix.start_pos);
                c
            },
            seen: vec![0; layers],
            pending_k: vec![None; layers],
            pending_v: vec![None; layers],
            done: vec![false; layers],
        }))
    }
}

struct TranslatedDecoder<'a> {
    codec: &'a Translated,
    consumer: &'a Llama,
    positions: Vec<u32>,
    /// The positions' rotation, the consumer's own.
    rope: RopeTables,
    cache: KvCache,
    /// The codes taken per layer ([`SEEN_K`], [`SEEN_V`], [`SEEN_H`]).
    seen: Vec<u8>,
    pending_k: Vec<Option<Tensor>>,
    pending_v: Vec<Option<Tensor>>,
    done: Vec<bool>,
}

const SEEN_K: u8 = 1;
const SEEN_V: u8 = 2;
const SEEN_H: u8 = 4;

/// The codes of one layer in a batch, checked, with what earlier batches left of it.
struct LayerWork<'c> {
    layer: usize,
    patch: Option<&'c LayerCode>,
    k: Half<'c>,
    v: Half<'c>,
}

/// A Reuse layer's K or V: its code in this batch, its rows from an earlier one, or neither
/// yet.
enum Half<'c> {
    Missing,
    Code(&'c LayerCode),
    Rows(Tensor),
}

/// What a batch made of a layer: its buffers, or the half of a Reuse layer that waits for the
/// other.
enum LayerDone {
    Filled(RotatedLayer),
    Waiting {
        layer: usize,
        k: Option<Tensor>,
        v: Option<Tensor>,
    },
}

impl TranslatedDecoder<'_> {
    /// Checks `code` against the prefix, `r_max`, the layers and the codes already taken,
    /// and takes it.
    fn check(&mut self, code: &LayerCode) -> Result<CodeKind, CodecError> {
        let l = check_layer(code, self.done.len())?;
        let t = &self.codec.translator.layers[l];
        let patchable = self.codec.mode == Mode::Scd && t.patch.is_some();
        let (bit, clashes, r_max) = match code.kind {
            CodeKind::PATCH_H if patchable => {
                let r_max = t.patch.as_ref().map_or(0, |p| p.h.max_rank());
                (SEEN_H, SEEN_K | SEEN_V | SEEN_H, r_max)
            }
            CodeKind::REUSE_K => (SEEN_K, SEEN_K | SEEN_H, t.k.max_rank()),
            CodeKind::REUSE_V => (SEEN_V, SEEN_V | SEEN_H, t.v.max_rank()),
            other => {
                return Err(CodecError::UnexpectedCode {
                    mode: self.codec.mode,
                    layer: code.layer,
                    kind: kind_name(other),
                })
            }
        };
        if self.seen[l] & clashes != 0 {
            return Err(CodecError::Duplicate {
                layer: code.layer,
                kind: kind_name(code.kind),
            });
        }
        self.check_shape(code, r_max)?;
        self.seen[l] |= bit;
        Ok(code.kind)
    }

    /// Checks the code's dtype and shape: `(T, r)` for the prefix's `T` and `1 <= r <= r_max`.
    fn check_shape(&self, code: &LayerCode, r_max: usize) -> Result<(), CodecError> {
        let rows = self.positions.len();
        let bad_shape = || CodecError::Shape {
            layer: code.layer,
            kind: kind_name(code.kind),
            got: code.shape.clone(),
            bytes: code.bytes.len(),
            expected: format!("[{rows}, r] with 1 <= r <= {r_max}, bytes as the dtype implies"),
        };
        if !CODE_DTYPES.contains(&code.dtype) {
            return Err(CodecError::DType {
                layer: code.layer,
                kind: kind_name(code.kind),
                got: dtype_name(code.dtype),
                expected: "f16, bf16, f32, i8-rows or tc".into(),
            });
        }
        let &[t, r] = code.shape.as_slice() else {
            return Err(bad_shape());
        };
        if t as usize != rows || r == 0 || r as usize > r_max || !code.is_consistent() {
            return Err(bad_shape());
        }
        Ok(())
    }

    /// [`LayerDecoder::push_many`]'s work, on a thread of the pool: every code checked in
    /// order, then each layer's products and its buffers made in parallel with the other
    /// layers' (one layer's products are too small to keep two cores busy), then put in.
    fn push_on_pool(&mut self, codes: &[LayerCode]) -> Result<(), CodecError> {
        let mut work: Vec<LayerWork<'_>> = Vec::new();
        let mut slot = vec![usize::MAX; self.done.len()];
        for code in codes {
            let kind = self.check(code)?;
            let l = usize::from(code.layer);
            if slot[l] == usize::MAX {
                slot[l] = work.len();
                work.push(LayerWork {
                    layer: l,
                    patch: None,
                    k: self.pending_k[l].take().map_or(Half::Missing, Half::Rows),
                    v: self.pending_v[l].take().map_or(Half::Missing, Half::Rows),
                });
            }
            let w = &mut work[slot[l]];
            match kind {
                CodeKind::PATCH_H => w.patch = Some(code),
                CodeKind::REUSE_K => w.k = Half::Code(code),
                _ => w.v = Half::Code(code),
            }
        }
        let made = if work.len() > 1 {
            use rayon::prelude::*;
            work.into_par_iter()
                .map(|w| self.rebuild(w))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            work.into_iter()
                .map(|w| self.rebuild(w))
                .collect::<Result<Vec<_>, _>>()?
        };
        for done in made {
            match done {
                LayerDone::Filled(filled) => {
                    let l = filled.layer();
                    self.cache.put_layer(filled)?;
                    self.done[l] = true;
                }
                LayerDone::Waiting { layer, k, v } => {
                    self.pending_k[layer] = k;
                    self.pending_v[layer] = v;
                }
            }
        }
        Ok(())
    }

    /// One layer's products from its codes, and its buffers once K and V are both there.
    fn rebuild(&self, work: LayerWork<'_>) -> Result<LayerDone, CodecError> {
        let l = work.layer;
        let (k, v) = match work.patch {
            Some(code) => {
                let (k, v) = self.patch(l, code)?;
                (Some(k), Some(v))
            }
            None => (self.reuse(l, work.k, true)?, self.reuse(l, work.v, false)?),
        };
        match (k, v) {
            (Some(k), Some(v)) => Ok(LayerDone::Filled(
                self.cache.rotated_layer(&self.rope, l, &k, &v)?,
            )),
            (k, v) => Ok(LayerDone::Waiting { layer: l, k, v }),
        }
    }

    /// A checked code as an f32 `(T, r)` matrix.
    fn codes(&self, code: &LayerCode) -> Result<Tensor, CodecError> {
        // `check` saw the shape `[T, r]`.
        let r = code.shape.get(1).map_or(0, |&r| r as usize);
        let rows = self.positions.len();
        if code.dtype == CodeDType::TC {
            return tc_tensor(code, rows, r);
        }
        from_bytes(&code.bytes, code.dtype, &[rows, r])
    }

    /// A Reuse layer's K (`is_k`) or V rows.
    fn reuse(&self, l: usize, half: Half<'_>, is_k: bool) -> Result<Option<Tensor>, CodecError> {
        let t = &self.codec.translator.layers[l];
        let map = if is_k { &t.k } else { &t.v };
        Ok(match half {
            Half::Missing => None,
            Half::Rows(rows) => Some(rows),
            Half::Code(code) => {
                Some(map.decode(&self.codes(code)?, self.codec.expert, self.codec.matmul)?)
            }
        })
    }

    /// A Patch layer's K and V: the aligner fused with this consumer's K and V projections of
    /// the layer (made on the translator's first request at this rank, then kept).
    fn patch(&self, l: usize, code: &LayerCode) -> Result<(Tensor, Tensor), CodecError> {
        let p = self.codec.translator.layers[l]
            .patch
            .as_ref()
            .ok_or(CodecError::Missing {
                layer: l,
                kind: "patch translator",
            })?;
        let consumer = self.consumer;
        let id = consumer.identity();
        let key = format!("{l} {} {:?}", id.sha256, id.adapter_sha256);
        let z = self.codes(code)?;
        let kv = p.aligners[self.codec.expert].then(
            &z,
            &key,
            self.codec.matmul,
            |x| -> Result<_, CodecError> {
                let k = consumer.project_f32(l, Proj::K, x)?;
                let v = consumer.project_f32(l, Proj::V, x)?;
                Ok(Tensor::cat(&[k, v], 1)?)
            },
        )?;
        let n = kv.dim(1)? / 2;
        Ok((
            kv.narrow(1, 0, n)?.contiguous()?,
            kv.narrow(1, n, n)?.contiguous()?,
        ))
    }
}

impl LayerDecoder for TranslatedDecoder<'_> {
    fn push(&mut self, code: &LayerCode) -> Result<(), CodecError> {
        self.push_many(std::slice::from_ref(code))
    }

    fn push_many(&mut self, codes: &[LayerCode]) -> Result<(), CodecError> {
        crate::kernels::on_pool(|| self.push_on_pool(codes))
    }

    fn finish(self: Box<Self>) -> Result<KvCache, CodecError> {
        if let Some(l) = self.done.iter().position(|d| !d) {
            let kind = if self.pending_k[l].is_none() {
                "reuse_k"
            } else {
                "reuse_v"
            };
            return Err(CodecError::Missing { layer: l, kind });
        }
        Ok(self.cache)
    }
}
