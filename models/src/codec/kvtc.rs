//! `kvtc`: the base's raw KV transform-coded within the one model, KVTC-style (PCA of the
//! base's own K and V, a step per component, entropy coding), with no translation: the
//! like-for-like baseline of SCD's transform-coded codes. The components are the base's own
//! ([`crate::translator::kvtc`], stored in the pair's translator), the coder is SCD's
//! ([`super::transform`]), and one rate step means the same error per component in both,
//! so the two compare at equal bytes with nothing but the translation between them.
//!
//! The consumer gets back (approximately) the producer's own K and V, so this mode inherits
//! raw's drift: its quality can approach raw's, never pass it. Keys travel before RoPE and are
//! rotated with the producer's rotation on arrival, as in [`super::raw`].

use std::sync::Arc;

use candle_core::Tensor;
use scd_types::{CodeDType, CodeKind, LayerCode, Mode};

use super::{
    check_layer, dtype_name, kind_name, tc_code, tc_tensor, Codec, CodecError, LayerDecoder,
    Prefix, TcRate,
};
use crate::cache::KvCache;
use crate::llama::{Capture, LayerCapture, Llama};
use crate::prefill_matmul::PrefillMatmul;
use crate::rope::RopeTables;
use crate::translator::kvtc::KvtcLayer;
use crate::translator::Translator;

/// The `kvtc` codec over a translator's base basis, at one rate.
#[derive(Debug, Clone)]
pub struct Kvtc {
    translator: Arc<Translator>,
    rate: TcRate,
    /// Steps of K's and V's components at this rate (the basis is orthonormal, so a
    /// component's step is its error in the rows).
    steps: [f32; 2],
    matmul: PrefillMatmul,
}

impl Kvtc {
    /// The codec at `rate` over `translator`'s basis; refused when the translator has none.
    pub fn new(
        translator: Arc<Translator>,
        rate: TcRate,
        matmul: PrefillMatmul,
    ) -> Result<Self, CodecError> {
        rate.check().map_err(CodecError::Unavailable)?;
        let (Some(info), Some(_)) = (&translator.manifest.kvtc, &translator.kvtc) else {
            return Err(CodecError::Unavailable(
                "mode kvtc needs the base's basis in the translator (scd translators kvtc adds it)"
                    .into(),
            ));
        };
        let steps = info.scales.map(|s| rate.step * s);
        Ok(Self {
            translator,
            rate,
            steps,
            matmul,
        })
    }

    fn layer(&self, l: usize) -> Result<&KvtcLayer, CodecError> {
        let layers = self.translator.kvtc.as_deref().unwrap_or_default();
        layers.get(l).ok_or(CodecError::LayerOutOfRange {
            layer: l as u16,
            layers: layers.len(),
        })
    }

    fn encode_on_pool(
        &self,
        capture: &LayerCapture,
        out: &mut Vec<LayerCode>,
    ) -> Result<(), CodecError> {
        let l = capture.layer;
        let basis = self.layer(l)?;
        let missing = |what| CodecError::MissingCapture { layer: l, what };
        let k = capture
            .k_pre_rope
            .as_ref()
            .ok_or_else(|| missing("K before RoPE"))?;
        let v = capture.v.as_ref().ok_or_else(|| missing("V"))?;
        let one = |kind, rows, code: &crate::translator::LowRankCode, step| {
            let r = code.max_rank();
            let z = code.encode(rows, r, self.matmul)?;
            tc_code(l, kind, &z, &vec![step; r])
        };
        // K's and V's codes on two threads, as `translated` codes them.
        let (k, v) = rayon::join(
            || one(CodeKind::KVTC_K, k, &basis.k, self.steps[0]),
            || one(CodeKind::KVTC_V, v, &basis.v, self.steps[1]),
        );
        out.push(k?);
        out.push(v?);
        Ok(())
    }
}

impl Codec for Kvtc {
    fn mode(&self) -> Mode {
        Mode::Kvtc
    }

    fn variant(&self) -> String {
        format!("tc step {}", self.rate.step)
    }

    fn capture(&self) -> Option<Capture> {
        Some(Capture {
            k_pre_rope: true,
            v: true,
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
        let m = &self.translator.manifest;
        let cfg = consumer.config();
        if cfg.num_layers != m.layers || cfg.kv_dim() != m.kv_dim {
            return Err(CodecError::Unavailable(format!(
                "the translator's base has {} layers of KV width {}, the consumer {} of {}",
                m.layers,
                m.kv_dim,
                cfg.num_layers,
                cfg.kv_dim()
            )));
        }
        let mut cache = consumer.new_cache();
        cache.set_next_position(prefix.start_pos);
        Ok(Box::new(KvtcDecoder {
            codec: self,
            rope: consumer.base_rope().tables(&prefix.positions())?,
            rows: prefix.tokens.len(),
            cache,
            pending: vec![(None, None); cfg.num_layers],
            seen: vec![0; cfg.num_layers],
            done: vec![false; cfg.num_layers],
        }))
    }
}

struct KvtcDecoder<'a> {
    codec: &'a Kvtc,
    /// The positions' rotation (the base's: the rows are the base's).
    rope: RopeTables,
    rows: usize,
    cache: KvCache,
    /// Per layer, K (before RoPE) and V rebuilt so far.
    pending: Vec<(Option<Tensor>, Option<Tensor>)>,
    /// Per layer, the codes taken (1: K, 2: V).
    seen: Vec<u8>,
    done: Vec<bool>,
}

impl KvtcDecoder<'_> {
    /// Checks `code` against the consumer, the prefix and the codes already taken, and takes
    /// its slot: its layer, whether it is K's, and its rank.
    fn check(&mut self, code: &LayerCode) -> Result<(usize, bool, usize), CodecError> {
        let l = check_layer(code, self.done.len())?;
        let is_k = match code.kind {
            CodeKind::KVTC_K => true,
            CodeKind::KVTC_V => false,
            other => {
                return Err(CodecError::UnexpectedCode {
                    mode: Mode::Kvtc,
                    layer: code.layer,
                    kind: kind_name(other),
                })
            }
        };
        if code.dtype != CodeDType::TC {
            return Err(CodecError::DType {
                layer: code.layer,
                kind: kind_name(code.kind),
                got: dtype_name(code.dtype),
                expected: dtype_name(CodeDType::TC),
            });
        }
        let basis = self.codec.layer(l)?;
        let r_max = if is_k { &basis.k } else { &basis.v }.max_rank();
        let r = match code.shape.as_slice() {
            &[t, r] if t as usize == self.rows && r >= 1 && r as usize <= r_max => r as usize,
            _ => 0,
        };
        if r == 0 || !code.is_consistent() {
            return Err(CodecError::Shape {
                layer: code.layer,
                kind: kind_name(code.kind),
                got: code.shape.clone(),
                bytes: code.bytes.len(),
                expected: format!("[{}, r] with 1 <= r <= {r_max}", self.rows),
            });
        }
        let bit = if is_k { 1 } else { 2 };
        if self.seen[l] & bit != 0 {
            return Err(CodecError::Duplicate {
                layer: code.layer,
                kind: kind_name(code.kind),
            });
        }
        self.seen[l] |= bit;
        Ok((l, is_k, r))
    }

    /// The rows (K before RoPE, or V) a checked code holds.
    fn rows_of(
        &self,
        code: &LayerCode,
        (l, is_k, r): (usize, bool, usize),
    ) -> Result<Tensor, CodecError> {
        let basis = self.codec.layer(l)?;
        let map = if is_k { &basis.k } else { &basis.v };
        Ok(map.decode(&tc_tensor(code, self.rows, r)?, 0, self.codec.matmul)?)
    }

    /// Keeps a layer's K or V rows, and fills the layer once it has both.
    fn put(&mut self, l: usize, is_k: bool, rows: Tensor) -> Result<(), CodecError> {
        let slot = &mut self.pending[l];
        match is_k {
            true => slot.0 = Some(rows),
            false => slot.1 = Some(rows),
        }
        if let (Some(k), Some(v)) = (&slot.0, &slot.1) {
            self.cache.fill_layer_rotating(&self.rope, l, k, v)?;
            self.pending[l] = (None, None);
            self.done[l] = true;
        }
        Ok(())
    }
}

impl LayerDecoder for KvtcDecoder<'_> {
    fn push(&mut self, code: &LayerCode) -> Result<(), CodecError> {
        let slot = self.check(code)?;
        let rows = self.rows_of(code, slot)?;
        self.put(slot.0, slot.1, rows)
    }

    /// Every code checked in order, then their rows decoded in parallel (one code's coder runs
    /// on one thread), then put in.
    fn push_many(&mut self, codes: &[LayerCode]) -> Result<(), CodecError> {
        use rayon::prelude::*;
        crate::kernels::on_pool(|| {
            let slots = codes
                .iter()
                .map(|c| self.check(c))
                .collect::<Result<Vec<_>, _>>()?;
            let rows = codes
                .par_iter()
                .zip(&slots)
                .map(|(c, &slot)| self.rows_of(c, slot))
                .collect::<Result<Vec<_>, _>>()?;
            for ((l, is_k, _), r) in slots.into_iter().zip(rows) {
                self.put(l, is_k, r)?;
            }
            Ok(())
        })
    }

    fn finish(self: Box<Self>) -> Result<KvCache, CodecError> {
        if let Some(l) = self.done.iter().position(|d| !d) {
            let kind = match self.pending[l].0 {
                None => "kvtc_k",
                Some(_) => "kvtc_v",
            };
            return Err(CodecError::Missing { layer: l, kind });
        }
        Ok(self.cache)
    }
}
