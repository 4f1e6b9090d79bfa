//! Codecs: how a prompt's state crosses from the producer (the base model) to the consumer (an
//! expert), one implementation per transfer [`Mode`].
//!
//! The producer runs its prefill of a prompt prefix with the codec's [`Codec::capture`] and
//! encodes each layer's capture into [`LayerCode`]s (plain data: layer, kind, dtype, shape,
//! bytes, what transport carries as frames). The consumer feeds the codes, layer by layer as
//! they arrive, to the codec's [`LayerDecoder`], which rebuilds the consumer's own KV cache for
//! the prefix's positions; the consumer then continues with its own forward pass. The payload
//! of a request is exactly the codes' bytes. The evaluation harness and the cluster's actors
//! call the same codecs.
//!
//! Files: [`tensor_bytes`] (tensors to and from code bytes in each dtype), one file per mode:
//! [`oracle`] (no payload: the consumer's own prefill), [`raw`] (the producer's K and V in
//! bf16), [`kivi`] (`q4` and `q2`: KIVI-style 4- and 2-bit K and V), [`kvtc`] (raw KV
//! transform-coded in the base's own basis), [`droidspeak`] (raw KV with a few layer blocks
//! recomputed by the consumer), [`translated`] (`reuse` and `scd`, over a calibrated
//! translator); [`transform`], the transform coder `kvtc` and tc codes share; and
//! [`documents`], the oracle read over compiled documents a producer serves (SemPIC), which is
//! not a mode of its own.

use std::sync::Arc;

use candle_core::Tensor;
use scd_types::{CodeDType, CodeKind, LayerCode, Mode};

use crate::cache::KvCache;
use crate::error::ForwardError;
use crate::llama::{Capture, LayerCapture, Llama};
use crate::prefill_matmul::PrefillMatmul;
use crate::translator::{Ranks, Translator};

pub mod documents;
pub mod droidspeak;
pub mod kivi;
pub mod kvtc;
pub mod oracle;
pub mod raw;
pub mod tensor_bytes;
pub mod transform;
pub mod translated;

pub use documents::{encode_documents, Documents};
pub use droidspeak::DroidSpeak;
pub use kivi::Kivi;
pub use kvtc::Kvtc;
pub use oracle::Oracle;
pub use raw::Raw;
pub use translated::Translated;

/// The prompt prefix whose cache a consumer rebuilds: its tokens (the consumer knows the
/// prompt; only the oracle reads them) and the position of the first one.
#[derive(Debug, Clone, Copy)]
pub struct Prefix<'a> {
    /// The prefix's tokens.
    pub tokens: &'a [u32],
    /// Position of the first token; the rest follow contiguously.
    pub start_pos: usize,
}

impl<'a> Prefix<'a> {
    /// `tokens` at positions `0..tokens.len()`.
    pub fn new(tokens: &'a [u32]) -> Self {
        Self {
            tokens,
            start_pos: 0,
        }
    }

    /// The positions of the prefix's tokens.
    pub fn positions(&self) -> Vec<u32> {
        (self.start_pos..self.start_pos + self.tokens.len())
            .map(|p| p as u32)
            .collect()
    }
}

/// Errors of encoding or decoding codes. A payload from a peer is input: every way it can be
/// wrong is one of these, never a panic.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// A forward pass (the oracle's prefill, a recomputed block) failed.
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// Tensor math failed.
    #[error("tensor operation failed: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The producer's capture lacks what the codec encodes.
    #[error("layer {layer}: the capture has no {what} (the producer must capture it)")]
    MissingCapture {
        /// The layer.
        layer: usize,
        /// What is missing.
        what: &'static str,
    },
    /// A code of a kind this codec does not take.
    #[error("{mode} codec: unexpected code of kind {kind} for layer {layer}")]
    UnexpectedCode {
        /// The codec's mode.
        mode: Mode,
        /// The layer named by the code.
        layer: u16,
        /// Its kind (name or number).
        kind: String,
    },
    /// A code for a layer the consumer does not have.
    #[error("code for layer {layer}, but the consumer has {layers} layers")]
    LayerOutOfRange {
        /// The layer named.
        layer: u16,
        /// The consumer's layers.
        layers: usize,
    },
    /// The same code twice.
    #[error("a second {kind} code for layer {layer}")]
    Duplicate {
        /// The layer.
        layer: u16,
        /// The kind.
        kind: String,
    },
    /// A code with a dtype this codec does not read for its kind.
    #[error("layer {layer} {kind}: dtype {got}, expected {expected}")]
    DType {
        /// The layer.
        layer: u16,
        /// The kind.
        kind: String,
        /// The dtype received.
        got: String,
        /// The dtype(s) accepted.
        expected: String,
    },
    /// A code whose shape is not what the consumer's model and the prefix imply, or whose
    /// bytes do not match its shape.
    #[error("layer {layer} {kind}: shape {got:?} ({bytes} bytes), expected {expected}")]
    Shape {
        /// The layer.
        layer: u16,
        /// The kind.
        kind: String,
        /// The shape received.
        got: Vec<u32>,
        /// Bytes received.
        bytes: usize,
        /// What was expected.
        expected: String,
    },
    /// The payload ended without codes the consumer needs.
    #[error("incomplete payload: no {kind} code for layer {layer}")]
    Missing {
        /// The layer.
        layer: usize,
        /// The kind.
        kind: &'static str,
    },
    /// Transform-coded bytes that do not decode ([`transform`]).
    #[error("layer {layer} {kind}: {why}")]
    Coded {
        /// The layer.
        layer: u16,
        /// The kind.
        kind: String,
        /// What is wrong.
        why: String,
    },
    /// A mode that needs something this build or call does not provide.
    #[error("{0}")]
    Unavailable(String),
}

impl CodecError {
    /// The layer of the code this error is about, where it names one (a batch of codes
    /// failed: which of them did).
    pub fn layer(&self) -> Option<usize> {
        match self {
            Self::MissingCapture { layer, .. } | Self::Missing { layer, .. } => Some(*layer),
            Self::UnexpectedCode { layer, .. }
            | Self::LayerOutOfRange { layer, .. }
            | Self::Duplicate { layer, .. }
            | Self::DType { layer, .. }
            | Self::Shape { layer, .. }
            | Self::Coded { layer, .. } => Some(usize::from(*layer)),
            _ => None,
        }
    }
}

/// The name of a kind for messages.
pub(crate) fn kind_name(kind: CodeKind) -> String {
    kind.name()
        .map_or_else(|| format!("#{}", kind.0), str::to_owned)
}

/// The name of a dtype for messages.
pub(crate) fn dtype_name(dtype: CodeDType) -> String {
    dtype
        .name()
        .map_or_else(|| format!("#{}", dtype.0), str::to_owned)
}

/// A transfer mode's two halves.
pub trait Codec: Send + Sync {
    /// The mode this codec implements.
    fn mode(&self) -> Mode;

    /// The settings that tell this codec from others of its mode in a record (a
    /// transform-coded rate); empty by default.
    fn variant(&self) -> String {
        String::new()
    }

    /// What the producer's prefill must record; `None` when the codec needs no producer pass.
    fn capture(&self) -> Option<Capture>;

    /// Producer side: appends the codes of one layer's capture to `out`.
    fn encode_layer(
        &self,
        capture: &LayerCapture,
        out: &mut Vec<LayerCode>,
    ) -> Result<(), CodecError>;

    /// Consumer side: a decoder that rebuilds `consumer`'s cache for `prefix` from the codes
    /// pushed into it.
    fn decoder<'a>(
        &'a self,
        consumer: &'a Llama,
        prefix: Prefix<'a>,
    ) -> Result<Box<dyn LayerDecoder + 'a>, CodecError>;
}

/// The consumer half of a codec for one request: takes codes as they arrive, gives the cache.
pub trait LayerDecoder {
    /// Takes one code (codes arrive in layer order; a codec may rebuild the layer at once).
    fn push(&mut self, code: &LayerCode) -> Result<(), CodecError>;

    /// Takes several codes in their order, as [`LayerDecoder::push`] of each would (the same
    /// cache; a code that push refuses fails the call), where a codec may rebuild their
    /// layers in parallel: a whole payload, or every code that arrived while the last was
    /// rebuilt. After an error the decoder is not to be used further.
    fn push_many(&mut self, codes: &[LayerCode]) -> Result<(), CodecError> {
        codes.iter().try_for_each(|c| self.push(c))
    }

    /// The consumer's cache for the prefix, once every code has arrived.
    fn finish(self: Box<Self>) -> Result<KvCache, CodecError>;
}

/// Encodes every captured layer, in order, on a thread of the pool (one hand-off for the
/// payload rather than one per layer).
pub fn encode(codec: &dyn Codec, captures: &[LayerCapture]) -> Result<Vec<LayerCode>, CodecError> {
    crate::kernels::on_pool(|| {
        let mut out = Vec::new();
        for c in captures {
            codec.encode_layer(c, &mut out)?;
        }
        Ok(out)
    })
}

/// Rebuilds the consumer's cache from a whole payload, on a thread of the pool.
pub fn decode(
    codec: &dyn Codec,
    consumer: &Llama,
    codes: &[LayerCode],
    prefix: Prefix<'_>,
) -> Result<KvCache, CodecError> {
    crate::kernels::on_pool(|| {
        let mut d = codec.decoder(consumer, prefix)?;
        d.push_many(codes)?;
        d.finish()
    })
}

/// The bytes a payload puts on the wire (the codes' bytes; frame headers not included).
pub fn payload_bytes(codes: &[LayerCode]) -> usize {
    codes.iter().map(|c| c.bytes.len()).sum()
}

/// How a request wants its codes, for the modes that have a choice.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CodecOptions {
    /// Ranks of `reuse` / `scd` codes; the translator's defaults when `None`.
    pub ranks: Option<Ranks>,
    /// Element type of `reuse` / `scd` codes.
    pub code_dtype: CodeDType,
    /// Group size of `q4` and `q2`.
    pub q4_group: usize,
    /// Patch budget of `scd`: the first `k` layers of the translator's greedy order (its
    /// default set when `None`).
    pub patch_k: Option<usize>,
    /// The rate of transform-coded (`tc`) `reuse` / `scd` codes.
    pub tc_rate: TcRate,
    /// Where `reuse` / `scd` codes' products run: the node's prefill setting
    /// ([`crate::KernelChoice`]), so that a node runs its translator on the path it prefills
    /// on, and the f32 prefill gives the f32 reference for both.
    pub matmul: PrefillMatmul,
}

impl Default for CodecOptions {
    fn default() -> Self {
        Self {
            ranks: None,
            code_dtype: CodeDType::F16,
            q4_group: kivi::DEFAULT_GROUP,
            patch_k: None,
            tc_rate: TcRate::default(),
            matmul: PrefillMatmul::best(),
        }
    }
}

/// The rate of transform-coded codes: one step, the error each component of a code may leave
/// in the consumer's rows, before the translator's per-layer scales
/// ([`crate::translator::rate_table`]; without a table K's steps are twice V's and `H_in`'s
/// equal). Larger steps, fewer bytes. Rates are nested as ranks are: one translator codes at
/// any rate, and a request picks its own; the consumer reads each component's step from the
/// code, so it needs no table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TcRate {
    /// The step.
    pub step: f32,
}

impl Default for TcRate {
    fn default() -> Self {
        Self { step: 0.3 }
    }
}

impl TcRate {
    /// Refuses steps that are not positive finite numbers.
    pub fn check(&self) -> Result<(), String> {
        match self.step.is_finite() && self.step > 0.0 {
            true => Ok(()),
            false => Err(format!(
                "transform-coded codes: step {} is not a positive number",
                self.step
            )),
        }
    }
}

/// The codec of a mode that needs no calibration (oracle, raw, q4, q2).
pub fn codec_for(mode: Mode) -> Result<Box<dyn Codec>, CodecError> {
    codec_with(mode, None, &CodecOptions::default())
}

/// The codec of `mode`; `kvtc`, `droidspeak`, `reuse` and `scd` need the pair's translator and
/// the consumer's index in it ([`Translator::check_pair`]).
pub fn codec_with(
    mode: Mode,
    translator: Option<(&Arc<Translator>, usize)>,
    opts: &CodecOptions,
) -> Result<Box<dyn Codec>, CodecError> {
    let need = || {
        CodecError::Unavailable(format!(
            "mode {mode} needs a translator calibrated for the model pair (scd calibrate)"
        ))
    };
    Ok(match mode {
        Mode::Auto => {
            return Err(CodecError::Unavailable(
                "mode auto is resolved to a way of sending before a job runs".into(),
            ))
        }
        Mode::Oracle => Box::new(Oracle),
        Mode::Raw => Box::new(Raw),
        Mode::Q4 => Box::new(Kivi::new(4, opts.q4_group)?),
        Mode::Q2 => Box::new(Kivi::new(2, opts.q4_group)?),
        Mode::Kvtc => {
            let (t, _) = translator.ok_or_else(need)?;
            Box::new(Kvtc::new(t.clone(), opts.tc_rate, opts.matmul)?)
        }
        Mode::DroidSpeak => {
            let (t, _) = translator.ok_or_else(need)?;
            Box::new(DroidSpeak::new(t.manifest.droidspeak_blocks.clone())?)
        }
        Mode::Reuse | Mode::Scd => {
            let (t, expert) = translator.ok_or_else(need)?;
            // Transform-coded codes send every component the rate pays for: all of r_max.
            let ranks = opts.ranks.unwrap_or(match opts.code_dtype {
                CodeDType::TC => t.manifest.r_max,
                _ => t.manifest.default_ranks,
            });
            Box::new(
                Translated::new(
                    t.clone(),
                    mode,
                    expert,
                    ranks,
                    opts.code_dtype,
                    opts.patch_k,
                )?
                .with_matmul(opts.matmul)?
                .with_tc_rate(opts.tc_rate)?,
            )
        }
    })
}

/// Per layer, a K and a V tensor as their codes arrive, each filled once: what the codecs that
/// carry whole K and V rows (raw, documents) collect before they build the cache.
pub(crate) struct KvSlots(Vec<(Option<Tensor>, Option<Tensor>)>);

impl KvSlots {
    pub(crate) fn new(layers: usize) -> Self {
        Self(vec![(None, None); layers])
    }

    /// Fills the K (`is_k`) or V slot of `code`'s layer (checked by [`check_rows`]) with what
    /// `decode` makes of it; a second code for a filled slot is refused before it is decoded.
    pub(crate) fn fill(
        &mut self,
        code: &LayerCode,
        is_k: bool,
        decode: impl FnOnce() -> Result<Tensor, CodecError>,
    ) -> Result<(), CodecError> {
        let Some(pair) = self.0.get_mut(usize::from(code.layer)) else {
            return Err(CodecError::LayerOutOfRange {
                layer: code.layer,
                layers: self.0.len(),
            });
        };
        let slot = if is_k { &mut pair.0 } else { &mut pair.1 };
        if slot.is_some() {
            return Err(CodecError::Duplicate {
                layer: code.layer,
                kind: kind_name(code.kind),
            });
        }
        *slot = Some(decode()?);
        Ok(())
    }

    /// Every layer's `(K, V)`; a missing one is named by `kinds`.
    pub(crate) fn finish(
        self,
        kinds: (&'static str, &'static str),
    ) -> Result<Vec<(Tensor, Tensor)>, CodecError> {
        self.0
            .into_iter()
            .enumerate()
            .map(|(layer, (k, v))| {
                let missing = |kind| CodecError::Missing { layer, kind };
                Ok((k.ok_or(missing(kinds.0))?, v.ok_or(missing(kinds.1))?))
            })
            .collect()
    }
}

/// A code's layer, if the consumer's `layers` include it.
pub(crate) fn check_layer(code: &LayerCode, layers: usize) -> Result<usize, CodecError> {
    let l = usize::from(code.layer);
    if l >= layers {
        return Err(CodecError::LayerOutOfRange {
            layer: code.layer,
            layers,
        });
    }
    Ok(l)
}

/// A layer's code holding tensor `t` as `dtype` (its shape and bytes).
pub(crate) fn tensor_code(
    layer: usize,
    kind: CodeKind,
    dtype: CodeDType,
    t: &Tensor,
) -> Result<LayerCode, CodecError> {
    Ok(LayerCode {
        layer: layer as u16,
        kind,
        dtype,
        shape: t.dims().iter().map(|&d| d as u32).collect(),
        bytes: tensor_bytes::to_bytes(t, dtype)?,
    })
}

/// Layer `l`'s transform-coded code of `kind` holding `z` `(T, r)`, column `j` quantised with
/// step `steps[j]` ([`transform::encode`]).
pub(crate) fn tc_code(
    l: usize,
    kind: CodeKind,
    z: &Tensor,
    steps: &[f32],
) -> Result<LayerCode, CodecError> {
    let (rows, r) = z.dims2()?;
    let values = z.flatten_all()?.to_vec1::<f32>()?;
    let bytes = transform::encode(&values, rows, r, &steps[..r.min(steps.len())]).map_err(|e| {
        CodecError::Coded {
            layer: l as u16,
            kind: kind_name(kind),
            why: e.to_string(),
        }
    })?;
    Ok(LayerCode {
        layer: l as u16,
        kind,
        dtype: CodeDType::TC,
        shape: vec![rows as u32, r as u32],
        bytes,
    })
}

/// The `(rows, r)` matrix a transform-coded code holds (its shape checked by the caller).
pub(crate) fn tc_tensor(code: &LayerCode, rows: usize, r: usize) -> Result<Tensor, CodecError> {
    let values = transform::decode(&code.bytes, rows, r).map_err(|e| CodecError::Coded {
        layer: code.layer,
        kind: kind_name(code.kind),
        why: e.to_string(),
    })?;
    Ok(Tensor::from_vec(
        values,
        (rows, r),
        &candle_core::Device::Cpu,
    )?)
}

/// Checks a code's layer against the consumer and its shape against `(rows, width)`.
pub(crate) fn check_rows(
    code: &LayerCode,
    layers: usize,
    rows: usize,
    width: usize,
) -> Result<(), CodecError> {
    check_layer(code, layers)?;
    if code.shape != [rows as u32, width as u32] || !code.is_consistent() {
        return Err(CodecError::Shape {
            layer: code.layer,
            kind: kind_name(code.kind),
            got: code.shape.clone(),
            bytes: code.bytes.len(),
            expected: format!(
                "[{rows}, {width}] ({} bytes of {})",
                LayerCode::expected_len(code.dtype, &[rows as u32, width as u32]).unwrap_or(0),
                dtype_name(code.dtype)
            ),
        });
    }
    Ok(())
}
