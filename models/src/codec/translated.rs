//! SCD's two modes over a calibrated translator ([`crate::translator`]): `reuse` rebuilds
//! every layer from low-rank codes of K and V; `scd` does the same except on the translator's
//! Patch layers, where it sends a code of the attention input `H_in` instead, aligns it to the
//! consumer with the MLP, and lets the consumer regenerate K and V with its own weights.
//!
//! Codes are `(T, r)` matrices in f16 (default), bf16, f32 or int8 rows; the ranks are the
//! request's, any up to the translator's `r_max`, and the consumer reads them from the shapes.
//! The consumer rebuilds each layer as soon as its codes are in, so rebuild overlaps transfer.

use std::sync::Arc;

use candle_core::Tensor;
use scd_types::{CodeDType, CodeKind, LayerCode, Mode};

use super::tensor_bytes::{from_bytes, to_bytes};
use super::{dtype_name, kind_name, Codec, CodecError, LayerDecoder, Prefix};
use crate::cache::KvCache;
use crate::llama::{Capture, LayerCapture, Llama, Proj};
use crate::prefill_matmul::PrefillMatmul;
use crate::rope::RopeTables;
use crate::translator::{Ranks, Translator};

/// Code dtypes these modes send.
pub const CODE_DTYPES: [CodeDType; 4] = [
    CodeDType::F16,
    CodeDType::BF16,
    CodeDType::F32,
    CodeDType::I8_ROWS,
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
    /// Where the codes' products run: the models' own prefill setting
    /// ([`PrefillMatmul::from_env`]), so that a node runs its translator on the path it
    /// prefills on, and `SCD_PREFILL_MATMUL=f32` gives the f32 reference for both.
    matmul: PrefillMatmul,
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
        if !matches!(mode, Mode::Reuse | Mode::Scd) {
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
        let matmul =
            PrefillMatmul::from_env().map_err(|e| CodecError::Unavailable(e.to_string()))?;
        Ok(Self {
            translator,
            mode,
            expert,
            ranks,
            dtype,
            patch,
            matmul,
        })
    }

    /// This codec with its products on `matmul` (tiles where the machine lacks them are
    /// refused).
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
    /// before anything is encoded (what a choice of ranks for a link needs).
    pub fn payload_bytes(&self, rows: usize) -> u64 {
        let len = |r: usize| {
            LayerCode::expected_len(self.dtype, &[rows as u32, r as u32]).unwrap_or(usize::MAX)
                as u64
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
            out.push(code(l, CodeKind::PATCH_H, self.dtype, &z)?);
        } else {
            let k = capture
                .k_pre_rope
                .as_ref()
                .ok_or_else(|| missing("K before RoPE"))?;
            let v = capture.v.as_ref().ok_or_else(|| missing("V"))?;
            out.push(code(
                l,
                CodeKind::REUSE_K,
                self.dtype,
                &t.k.encode(k, self.ranks.k, self.matmul)?,
            )?);
            out.push(code(
                l,
                CodeKind::REUSE_V,
                self.dtype,
                &t.v.encode(v, self.ranks.v, self.matmul)?,
            )?);
        }
        Ok(())
    }
}

fn code(
    layer: usize,
    kind: CodeKind,
    dtype: CodeDType,
    z: &Tensor,
) -> Result<LayerCode, CodecError> {
    Ok(LayerCode {
        layer: layer as u16,
        kind,
        dtype,
        shape: z.dims().iter().map(|&d| d as u32).collect(),
        bytes: to_bytes(z, dtype)?,
    })
}

impl Codec for Translated {
    fn mode(&self) -> Mode {
        self.mode
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
    pending_k: Vec<Option<Tensor>>,
    pending_v: Vec<Option<Tensor>>,
    done: Vec<bool>,
}

impl TranslatedDecoder<'_> {
    /// The code as an f32 `(T, r)` matrix after checking it against the prefix and `r_max`.
    fn read(&self, code: &LayerCode, r_max: usize) -> Result<Tensor, CodecError> {
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
                expected: "f16, bf16, f32 or i8-rows".into(),
            });
        }
        let &[t, r] = code.shape.as_slice() else {
            return Err(bad_shape());
        };
        if t as usize != rows || r == 0 || r as usize > r_max || !code.is_consistent() {
            return Err(bad_shape());
        }
        from_bytes(&code.bytes, code.dtype, &[rows, r as usize])
    }

    fn fill(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(), CodecError> {
        self.cache.fill_layer_rotating(&self.rope, layer, k, v)?;
        self.done[layer] = true;
        Ok(())
    }

    /// [`LayerDecoder::push`]'s work, on a thread of the pool.
    fn push_on_pool(&mut self, code: &LayerCode) -> Result<(), CodecError> {
        let layers = self.done.len();
        let l = usize::from(code.layer);
        if l >= layers {
            return Err(CodecError::LayerOutOfRange {
                layer: code.layer,
                layers,
            });
        }
        let duplicate = || CodecError::Duplicate {
            layer: code.layer,
            kind: kind_name(code.kind),
        };
        if self.done[l] {
            return Err(duplicate());
        }
        let t = &self.codec.translator.layers[l];
        let expert = self.codec.expert;
        let patchable = self.codec.mode == Mode::Scd && t.patch.is_some();
        match code.kind {
            CodeKind::PATCH_H if patchable => {
                if self.pending_k[l].is_some() || self.pending_v[l].is_some() {
                    return Err(duplicate());
                }
                let p = t.patch.as_ref().ok_or(CodecError::Missing {
                    layer: l,
                    kind: "patch translator",
                })?;
                let z = self.read(code, p.h.max_rank())?;
                let aligner = &p.aligners[expert];
                // The aligner fused with this consumer's K and V projections of the layer
                // (made on the translator's first request at this rank, then kept).
                let id = self.consumer.identity();
                let key = format!("{l} {} {:?}", id.sha256, id.adapter_sha256);
                let kv =
                    aligner.then(&z, &key, self.codec.matmul, |x| -> Result<_, CodecError> {
                        let k = self.consumer.project_f32(l, Proj::K, x)?;
                        let v = self.consumer.project_f32(l, Proj::V, x)?;
                        Ok(Tensor::cat(&[k, v], 1)?)
                    })?;
                let n = kv.dim(1)? / 2;
                let (k, v) = (
                    kv.narrow(1, 0, n)?.contiguous()?,
                    kv.narrow(1, n, n)?.contiguous()?,
                );
                self.fill(l, &k, &v)?;
            }
            CodeKind::REUSE_K | CodeKind::REUSE_V => {
                let is_k = code.kind == CodeKind::REUSE_K;
                let (map, r_max) = if is_k {
                    (&t.k, t.k.max_rank())
                } else {
                    (&t.v, t.v.max_rank())
                };
                let rows = map.decode(&self.read(code, r_max)?, expert, self.codec.matmul)?;
                let slot = if is_k {
                    &mut self.pending_k[l]
                } else {
                    &mut self.pending_v[l]
                };
                if slot.is_some() {
                    return Err(duplicate());
                }
                *slot = Some(rows);
                if let (Some(k), Some(v)) = (&self.pending_k[l], &self.pending_v[l]) {
                    let (k, v) = (k.clone(), v.clone());
                    self.pending_k[l] = None;
                    self.pending_v[l] = None;
                    self.fill(l, &k, &v)?;
                }
            }
            other => {
                return Err(CodecError::UnexpectedCode {
                    mode: self.codec.mode,
                    layer: code.layer,
                    kind: kind_name(other),
                })
            }
        }
        Ok(())
    }
}

impl LayerDecoder for TranslatedDecoder<'_> {
    fn push(&mut self, code: &LayerCode) -> Result<(), CodecError> {
        crate::kernels::on_pool(|| self.push_on_pool(code))
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
