//! Quantised raw KV, KIVI-style (Liu et al., 2024), at 4 bits (`q4`) or 2 (`q2`, KIVI's own
//! setting): keys per channel (each channel's scale and minimum over a group of tokens, since
//! key outliers sit in fixed channels), values per token (each token's scale and minimum over
//! a group of channels). Asymmetric levels, scales and minima in f16. KIVI also keeps the
//! newest tokens (a residual window) in full precision while it decodes; a transferred prefix
//! has no such tail, so every token here is quantised. It shrinks the payload but keeps the producer's feature
//! space: the baseline that compression alone does not fix drift. Keys are quantised before
//! RoPE (as KVQuant does; per-channel groups stay aligned with the outlier channels at every
//! position) and rotated on arrival with the producer's RoPE, as [`super::raw`] explains.

use candle_core::{Device, Tensor};
use half::f16;
use scd_types::{CodeDType, CodeKind, LayerCode, Mode};

use super::{check_layer, dtype_name, kind_name, Codec, CodecError, LayerDecoder, Prefix};
use crate::cache::KvCache;
use crate::llama::{Capture, LayerCapture, Llama};
use crate::rope::RopeTables;

/// Group size of the quantisation unless told otherwise.
pub const DEFAULT_GROUP: usize = 32;

/// KIVI-style KV at `bits` bits with groups of `group` tokens (keys) or channels (values).
#[derive(Debug, Clone, Copy)]
pub struct Kivi {
    bits: u8,
    group: usize,
}

impl Default for Kivi {
    fn default() -> Self {
        Self {
            bits: 4,
            group: DEFAULT_GROUP,
        }
    }
}

impl Kivi {
    /// `bits` (4 or 2) with groups of `group` (a positive even number).
    pub fn new(bits: u8, group: usize) -> Result<Self, CodecError> {
        if bits != 4 && bits != 2 {
            return Err(CodecError::Unavailable(format!(
                "KIVI-style KV has 4 or 2 bits, not {bits}"
            )));
        }
        if group == 0 || !group.is_multiple_of(2) {
            return Err(CodecError::Unavailable(format!(
                "q{bits} group {group} must be positive and even"
            )));
        }
        Ok(Self { bits, group })
    }

    /// The mode of this width.
    fn the_mode(&self) -> Mode {
        match self.bits {
            2 => Mode::Q2,
            _ => Mode::Q4,
        }
    }

    /// The levels' wire dtype.
    fn dtype(&self) -> CodeDType {
        match self.bits {
            2 => CodeDType::Q2,
            _ => CodeDType::Q4,
        }
    }

    /// The highest level.
    fn top(&self) -> f32 {
        f32::from((1u8 << self.bits) - 1)
    }

    /// Levels of `x` in `[min, min + top scale]`.
    fn level(&self, x: f32, min: f32, scale: f32) -> u8 {
        ((x - min) / scale).round().clamp(0.0, self.top()) as u8
    }

    fn scale_of(&self, min: f32, max: f32) -> f32 {
        if max > min {
            (max - min) / self.top()
        } else {
            1.0
        }
    }

    /// Levels packed lowest bits first.
    fn pack(&self, levels: &[u8]) -> Vec<u8> {
        let per = usize::from(8 / self.bits);
        levels
            .chunks(per)
            .map(|p| {
                p.iter()
                    .enumerate()
                    .fold(0u8, |b, (i, &l)| b | l << (i * usize::from(self.bits)))
            })
            .collect()
    }

    fn unpack(&self, bytes: &[u8], n: usize) -> Vec<u8> {
        let per = usize::from(8 / self.bits);
        let mask = (1u8 << self.bits) - 1;
        let mut out = Vec::with_capacity(bytes.len() * per);
        for b in bytes {
            out.extend((0..per).map(|i| b >> (i * usize::from(self.bits)) & mask));
        }
        out.truncate(n);
        out
    }
}

fn f16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect()
}

fn f16_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

impl Kivi {
    /// `(levels, [scale, min] per group)` of `x` `(T, d)`, keys per channel over token groups.
    fn quantise_keys(&self, x: &[Vec<f32>], d: usize) -> (Vec<u8>, Vec<f32>) {
        let t = x.len();
        let mut levels = vec![0u8; t * d];
        let mut side = Vec::with_capacity(t.div_ceil(self.group) * d * 2);
        for (g, rows) in x.chunks(self.group).enumerate() {
            for c in 0..d {
                let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
                for r in rows {
                    lo = lo.min(r[c]);
                    hi = hi.max(r[c]);
                }
                let scale = f16::from_f32(self.scale_of(lo, hi)).to_f32();
                let lo = f16::from_f32(lo).to_f32();
                for (i, r) in rows.iter().enumerate() {
                    levels[(g * self.group + i) * d + c] = self.level(r[c], lo, scale);
                }
                side.extend([scale, lo]);
            }
        }
        (levels, side)
    }

    /// Values per token over channel groups.
    fn quantise_values(&self, x: &[Vec<f32>], d: usize) -> (Vec<u8>, Vec<f32>) {
        let mut levels = Vec::with_capacity(x.len() * d);
        let mut side = Vec::with_capacity(x.len() * d / self.group * 2);
        for row in x {
            for grp in row.chunks(self.group) {
                let lo = grp.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = grp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let scale = f16::from_f32(self.scale_of(lo, hi)).to_f32();
                let lo = f16::from_f32(lo).to_f32();
                levels.extend(grp.iter().map(|&v| self.level(v, lo, scale)));
                side.extend([scale, lo]);
            }
        }
        (levels, side)
    }
}

impl Codec for Kivi {
    fn mode(&self) -> Mode {
        self.the_mode()
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
        let l = capture.layer;
        let missing = |what| CodecError::MissingCapture { layer: l, what };
        let k = capture
            .k_pre_rope
            .as_ref()
            .ok_or_else(|| missing("K before RoPE"))?;
        let v = capture.v.as_ref().ok_or_else(|| missing("V"))?;
        let (t, d) = k.dims2()?;
        if d % self.group != 0 {
            return Err(CodecError::Unavailable(format!(
                "q{} group {} does not divide the KV width {d}",
                self.bits, self.group
            )));
        }
        let (kl, ks) = self.quantise_keys(&k.to_vec2::<f32>()?, d);
        let (vl, vs) = self.quantise_values(&v.to_vec2::<f32>()?, d);
        let (t32, d32, g) = (t as u32, d as u32, self.group as u32);
        let mk = |kind, dtype, shape: Vec<u32>, bytes| LayerCode {
            layer: l as u16,
            kind,
            dtype,
            shape,
            bytes,
        };
        out.push(mk(
            CodeKind::QUANT_K,
            self.dtype(),
            vec![t32, d32],
            self.pack(&kl),
        ));
        out.push(mk(
            CodeKind::SCALES_K,
            CodeDType::F16,
            vec![t32.div_ceil(g), d32, 2],
            f16_bytes(&ks),
        ));
        out.push(mk(
            CodeKind::QUANT_V,
            self.dtype(),
            vec![t32, d32],
            self.pack(&vl),
        ));
        out.push(mk(
            CodeKind::SCALES_V,
            CodeDType::F16,
            vec![t32, d32 / g, 2],
            f16_bytes(&vs),
        ));
        Ok(())
    }

    fn decoder<'a>(
        &'a self,
        consumer: &'a Llama,
        prefix: Prefix<'a>,
    ) -> Result<Box<dyn LayerDecoder + 'a>, CodecError> {
        let layers = consumer.config().num_layers;
        let mut cache = consumer.new_cache();
        cache.set_next_position(prefix.start_pos);
        Ok(Box::new(KiviDecoder {
            codec: *self,
            consumer,
            rope: consumer.base_rope().tables(&prefix.positions())?,
            positions: prefix.positions(),
            cache,
            parts: vec![[None, None, None, None]; layers],
            done: vec![false; layers],
        }))
    }
}

struct KiviDecoder<'a> {
    codec: Kivi,
    consumer: &'a Llama,
    positions: Vec<u32>,
    /// The positions' rotation (the base's: raw keys are the base's).
    rope: RopeTables,
    cache: KvCache,
    /// Per layer: QUANT_K, SCALES_K, QUANT_V, SCALES_V bytes.
    parts: Vec<[Option<Vec<u8>>; 4]>,
    done: Vec<bool>,
}

impl LayerDecoder for KiviDecoder<'_> {
    fn push(&mut self, code: &LayerCode) -> Result<(), CodecError> {
        let l = check_layer(code, self.done.len())?;
        let (t, d, g) = (
            self.positions.len() as u32,
            self.consumer.config().kv_dim() as u32,
            self.codec.group as u32,
        );
        let (slot, dtype, shape) = match code.kind {
            CodeKind::QUANT_K => (0, self.codec.dtype(), vec![t, d]),
            CodeKind::SCALES_K => (1, CodeDType::F16, vec![t.div_ceil(g), d, 2]),
            CodeKind::QUANT_V => (2, self.codec.dtype(), vec![t, d]),
            CodeKind::SCALES_V => (3, CodeDType::F16, vec![t, d / g.max(1), 2]),
            other => {
                return Err(CodecError::UnexpectedCode {
                    mode: self.codec.the_mode(),
                    layer: code.layer,
                    kind: kind_name(other),
                })
            }
        };
        if code.dtype != dtype {
            return Err(CodecError::DType {
                layer: code.layer,
                kind: kind_name(code.kind),
                got: dtype_name(code.dtype),
                expected: dtype_name(dtype),
            });
        }
        if code.shape != shape || !code.is_consistent() {
            return Err(CodecError::Shape {
                layer: code.layer,
                kind: kind_name(code.kind),
                got: code.shape.clone(),
                bytes: code.bytes.len(),
                expected: format!("{shape:?} (group {g})"),
            });
        }
        if self.done[l] || self.parts[l][slot].is_some() {
            return Err(CodecError::Duplicate {
                layer: code.layer,
                kind: kind_name(code.kind),
            });
        }
        self.parts[l][slot] = Some(code.bytes.clone());
        if self.parts[l].iter().all(Option::is_some) {
            let [Some(qk), Some(sk), Some(qv), Some(sv)] = std::mem::take(&mut self.parts[l])
            else {
                return Ok(());
            };
            let (t, d, g) = (t as usize, d as usize, g as usize);
            let (kl, ks) = (self.codec.unpack(&qk, t * d), f16_values(&sk));
            let (vl, vs) = (self.codec.unpack(&qv, t * d), f16_values(&sv));
            let mut k = vec![0f32; t * d];
            let mut v = vec![0f32; t * d];
            for r in 0..t {
                for c in 0..d {
                    let i = r * d + c;
                    let sk_i = ((r / g) * d + c) * 2;
                    k[i] = f32::from(kl[i]) * ks[sk_i] + ks[sk_i + 1];
                    let sv_i = (r * (d / g) + c / g) * 2;
                    v[i] = f32::from(vl[i]) * vs[sv_i] + vs[sv_i + 1];
                }
            }
            let k = Tensor::from_vec(k, (t, d), &Device::Cpu)?;
            let v = Tensor::from_vec(v, (t, d), &Device::Cpu)?;
            self.cache.fill_layer_rotating(&self.rope, l, &k, &v)?;
            self.done[l] = true;
        }
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<KvCache, CodecError> {
        if let Some(l) = self.done.iter().position(|d| !d) {
            return Err(CodecError::Missing {
                layer: l,
                kind: "quant_k/quant_v with their scales",
            });
        }
        Ok(self.cache)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_and_levels_round_trip_at_both_widths() {
        for bits in [4u8, 2] {
            let q = Kivi::new(bits, 32).unwrap();
            let top = (1u8 << bits) - 1;
            let levels: Vec<u8> = (0..11)
                .map(|i| (i * 7 % (top as usize + 1)) as u8)
                .collect();
            assert_eq!(q.unpack(&q.pack(&levels), 11), levels, "{bits} bits");
            assert_eq!(q.pack(&levels).len(), (11 * bits as usize).div_ceil(8));
            assert_eq!(q.level(-9.0, 0.0, 1.0), 0);
            assert_eq!(q.level(99.0, 0.0, 1.0), top);
        }
        let q4 = Kivi::default();
        // 0.52 / (1/15) = 7.8 and 0.45 / (1/15) = 6.75: well away from a rounding tie.
        assert_eq!(q4.level(0.52, 0.0, 1.0 / 15.0), 8);
        assert_eq!(q4.level(0.45, 0.0, 1.0 / 15.0), 7);
        // 0.52 / (1/3) = 1.56, 0.45 / (1/3) = 1.35.
        let q2 = Kivi::new(2, 32).unwrap();
        assert_eq!(q2.level(0.52, 0.0, 1.0 / 3.0), 2);
        assert_eq!(q2.level(0.45, 0.0, 1.0 / 3.0), 1);
        assert!(Kivi::new(4, 3).is_err() && Kivi::new(3, 32).is_err());
    }
}
