//! DroidSpeak-style selective recompute (Liu et al., 2024): the producer's raw KV (bf16) for
//! most layers; for a few layer blocks, chosen offline by profiling on calibration data (see
//! [`crate::translator::select`]), the producer sends its residual stream at the block's entry
//! instead, and the consumer runs the block with its own weights, so those layers' K and V are
//! its own (rotated with its own RoPE; the raw layers keep the producer's, see [`super::raw`]).

use scd_types::{CodeKind, LayerCode, Mode};

use super::raw::RAW_DTYPE;
use super::tensor_bytes::from_bytes;
use super::{
    check_rows, dtype_name, kind_name, tensor_code, Codec, CodecError, LayerDecoder, Prefix,
};
use crate::cache::KvCache;
use crate::llama::{Capture, LayerCapture, Llama};
use crate::rope::RopeTables;

/// Raw KV plus recomputed blocks `[start, end)`.
#[derive(Debug, Clone)]
pub struct DroidSpeak {
    blocks: Vec<(usize, usize)>,
}

impl DroidSpeak {
    /// Recomputes `blocks` (non-empty, non-overlapping ranges of layers).
    pub fn new(mut blocks: Vec<(usize, usize)>) -> Result<Self, CodecError> {
        blocks.sort_unstable();
        let overlapping = blocks.windows(2).any(|w| w[0].1 > w[1].0);
        if blocks.iter().any(|&(s, e)| s >= e) || overlapping {
            return Err(CodecError::Unavailable(format!(
                "bad recompute blocks {blocks:?}"
            )));
        }
        Ok(Self { blocks })
    }

    /// The recomputed blocks.
    pub fn blocks(&self) -> &[(usize, usize)] {
        &self.blocks
    }

    fn block_at(&self, layer: usize) -> Option<(usize, usize)> {
        self.blocks
            .iter()
            .copied()
            .find(|&(s, e)| (s..e).contains(&layer))
    }
}

impl Codec for DroidSpeak {
    fn mode(&self) -> Mode {
        Mode::DroidSpeak
    }

    fn capture(&self) -> Option<Capture> {
        Some(Capture {
            k_pre_rope: true,
            v: true,
            hidden: true,
            ..Capture::none()
        })
    }

    fn encode_layer(
        &self,
        capture: &LayerCapture,
        out: &mut Vec<LayerCode>,
    ) -> Result<(), CodecError> {
        let l = capture.layer;
        let missing = |what| CodecError::MissingCapture { layer: l, what };
        let tensors = match self.block_at(l) {
            Some((s, _)) if s == l => vec![(
                CodeKind::HIDDEN,
                capture
                    .hidden
                    .as_ref()
                    .ok_or_else(|| missing("hidden state"))?,
            )],
            Some(_) => Vec::new(),
            None => vec![
                (
                    CodeKind::RAW_K,
                    capture
                        .k_pre_rope
                        .as_ref()
                        .ok_or_else(|| missing("K before RoPE"))?,
                ),
                (
                    CodeKind::RAW_V,
                    capture.v.as_ref().ok_or_else(|| missing("V"))?,
                ),
            ],
        };
        for (kind, t) in tensors {
            out.push(tensor_code(l, kind, RAW_DTYPE, t)?);
        }
        Ok(())
    }

    fn decoder<'a>(
        &'a self,
        consumer: &'a Llama,
        prefix: Prefix<'a>,
    ) -> Result<Box<dyn LayerDecoder + 'a>, CodecError> {
        let layers = consumer.config().num_layers;
        if self.blocks.iter().any(|&(_, e)| e > layers) {
            return Err(CodecError::Unavailable(format!(
                "recompute blocks {:?} beyond {layers} layers",
                self.blocks
            )));
        }
        let mut cache = consumer.new_cache();
        cache.set_next_position(prefix.start_pos);
        Ok(Box::new(DroidSpeakDecoder {
            codec: self,
            consumer,
            prefix,
            rope: consumer.base_rope().tables(&prefix.positions())?,
            positions: prefix.positions(),
            cache,
            pending_k: vec![None; layers],
            done: vec![false; layers],
        }))
    }
}

struct DroidSpeakDecoder<'a> {
    codec: &'a DroidSpeak,
    consumer: &'a Llama,
    prefix: Prefix<'a>,
    positions: Vec<u32>,
    /// The positions' rotation (the base's, as raw keys are).
    rope: RopeTables,
    cache: KvCache,
    pending_k: Vec<Option<candle_core::Tensor>>,
    done: Vec<bool>,
}

impl LayerDecoder for DroidSpeakDecoder<'_> {
    fn push(&mut self, code: &LayerCode) -> Result<(), CodecError> {
        let cfg = self.consumer.config();
        let l = usize::from(code.layer);
        let rows = self.positions.len();
        if code.dtype != RAW_DTYPE {
            return Err(CodecError::DType {
                layer: code.layer,
                kind: kind_name(code.kind),
                got: dtype_name(code.dtype),
                expected: dtype_name(RAW_DTYPE),
            });
        }
        let block = self.codec.block_at(l);
        let unexpected = || CodecError::UnexpectedCode {
            mode: Mode::DroidSpeak,
            layer: code.layer,
            kind: kind_name(code.kind),
        };
        match code.kind {
            CodeKind::HIDDEN => {
                check_rows(code, cfg.num_layers, rows, cfg.hidden_size)?;
                let Some((s, e)) = block.filter(|&(s, _)| s == l) else {
                    return Err(unexpected());
                };
                if self.done[s] {
                    return Err(CodecError::Duplicate {
                        layer: code.layer,
                        kind: kind_name(code.kind),
                    });
                }
                let hidden = from_bytes(&code.bytes, code.dtype, &[rows, cfg.hidden_size])?;
                self.consumer.forward_layers(
                    &hidden,
                    s..e,
                    self.prefix.start_pos,
                    Some(&mut self.cache),
                )?;
                self.done[s..e].iter_mut().for_each(|d| *d = true);
            }
            CodeKind::RAW_K | CodeKind::RAW_V if block.is_none() => {
                check_rows(code, cfg.num_layers, rows, cfg.kv_dim())?;
                if self.done[l] {
                    return Err(CodecError::Duplicate {
                        layer: code.layer,
                        kind: kind_name(code.kind),
                    });
                }
                let t = from_bytes(&code.bytes, code.dtype, &[rows, cfg.kv_dim()])?;
                if code.kind == CodeKind::RAW_K {
                    if self.pending_k[l].replace(t).is_some() {
                        return Err(CodecError::Duplicate {
                            layer: code.layer,
                            kind: kind_name(code.kind),
                        });
                    }
                } else {
                    let k = self.pending_k[l].take().ok_or(CodecError::Missing {
                        layer: l,
                        kind: "raw_k (before raw_v)",
                    })?;
                    self.cache.fill_layer_rotating(&self.rope, l, &k, &t)?;
                    self.done[l] = true;
                }
            }
            _ => return Err(unexpected()),
        }
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<KvCache, CodecError> {
        if let Some(l) = self.done.iter().position(|d| !d) {
            let kind = if self.codec.block_at(l).is_some() {
                "hidden"
            } else {
                "raw_k/raw_v"
            };
            return Err(CodecError::Missing { layer: l, kind });
        }
        Ok(self.cache)
    }
}
