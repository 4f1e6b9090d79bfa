//! Tensors to and from the bytes of a [`scd_types::LayerCode`]: row-major, little-endian, in
//! f32, f16, bf16, or int8 rows with a per-row scale. Math stays in f32; the narrower types
//! exist for the wire.

use candle_core::{Device, Tensor};
use half::{bf16, f16};
use scd_types::CodeDType;

use super::CodecError;

/// The bytes of a 2-D f32 tensor stored as `dtype` (F32, F16, BF16 or I8_ROWS).
pub fn to_bytes(t: &Tensor, dtype: CodeDType) -> Result<Vec<u8>, CodecError> {
    if dtype == CodeDType::I8_ROWS {
        let cols = t.dims2()?.1;
        return Ok(to_i8_rows(&t.flatten_all()?.to_vec1::<f32>()?, cols));
    }
    let values = t.flatten_all()?.to_vec1::<f32>()?;
    let mut out = Vec::with_capacity(values.len() * 4);
    match dtype {
        CodeDType::F32 => values
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        CodeDType::F16 => values
            .iter()
            .for_each(|&x| out.extend_from_slice(&f16::from_f32(x).to_le_bytes())),
        CodeDType::BF16 => values
            .iter()
            .for_each(|&x| out.extend_from_slice(&bf16::from_f32(x).to_le_bytes())),
        other => {
            return Err(CodecError::Unavailable(format!(
                "cannot store a float tensor as {}",
                super::dtype_name(other)
            )))
        }
    }
    Ok(out)
}

/// Rows of `cols` values quantised to int8 with a scale each (`max |x| / 127`), the scale
/// first: per-token code quantisation, which keeps each token's relative precision whatever
/// its magnitude. Values round half away from zero, as `f32::round` does.
pub fn to_i8_rows(values: &[f32], cols: usize) -> Vec<u8> {
    if cols == 0 {
        return Vec::new();
    }
    let mut out = vec![0u8; values.len() / cols * (cols + 4)];
    for (row, o) in values
        .chunks_exact(cols)
        .zip(out.chunks_exact_mut(cols + 4))
    {
        let max = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scale = if max > 0.0 { max / 127.0 } else { 1.0 };
        let (head, codes) = o.split_at_mut(4);
        head.copy_from_slice(&scale.to_le_bytes());
        quantise_row(codes, row, scale);
    }
    out
}

crate::kernels::multiversion! {
    /// `out[i] = quantise(row[i] / scale)`: vector instructions, eight values at a time on
    /// AVX2 (the int8 codes' quantisation, a value at a time with a libm `round` each, was half
    /// of a translator's encode).
    fn quantise_row(out: &mut [u8], row: &[f32], scale: f32) {
        for (o, &x) in out.iter_mut().zip(row) {
            *o = quantise(x / scale);
        }
    }
}

/// `q.round().clamp(-127.0, 127.0) as i8` as a byte, written with a truncating conversion and
/// compares (`round` is a libm call on x86-64's baseline and stops the loop vectorising). NaN
/// gives 0, as the cast gives it.
#[inline(always)]
fn quantise(q: f32) -> u8 {
    let q = if q.is_nan() {
        0.0
    } else {
        q.clamp(-128.0, 128.0)
    };
    // SAFETY: `q` is finite and within +-128, so it converts to an i32 without overflow.
    let t = unsafe { q.to_int_unchecked::<i32>() };
    let frac = q - t as f32;
    let r = t + i32::from(frac >= 0.5) - i32::from(frac <= -0.5);
    r.clamp(-127, 127) as i8 as u8
}

/// An f32 tensor of `shape` from `bytes` in `dtype` (F32, F16, BF16, or I8_ROWS with a 2-D
/// shape). The caller has checked that the length matches.
pub fn from_bytes(bytes: &[u8], dtype: CodeDType, shape: &[usize]) -> Result<Tensor, CodecError> {
    let values: Vec<f32> = match dtype {
        CodeDType::I8_ROWS => {
            let cols = shape.get(1).copied().unwrap_or(0);
            let mut out = Vec::with_capacity(bytes.len());
            for row in bytes.chunks_exact(cols + 4) {
                let scale = f32::from_le_bytes([row[0], row[1], row[2], row[3]]);
                out.extend(row[4..].iter().map(|&b| f32::from(b as i8) * scale));
            }
            out
        }
        CodeDType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        CodeDType::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        CodeDType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(CodecError::Unavailable(format!(
                "cannot read {} as floats",
                super::dtype_name(other)
            )))
        }
    };
    Ok(Tensor::from_vec(values, shape, &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector-friendly rounding gives the bytes of `f32::round` and a clamp, halves and
    /// the clamp's edges included.
    #[test]
    fn int8_codes_round_half_away_from_zero_as_f32_round_does() {
        let reference = |q: f32| q.round().clamp(-127.0, 127.0) as i8 as u8;
        let mut qs: Vec<f32> = (-1280..=1280).map(|i| i as f32 / 10.0).collect();
        qs.extend([
            0.5,
            -0.5,
            1.5,
            -1.5,
            126.5,
            -126.5,
            127.0001,
            -127.0001,
            0.49999997,
            -0.49999997,
            f32::NAN,
            1e9,
            -3e9,
            f32::INFINITY,
        ]);
        for q in qs {
            assert_eq!(quantise(q), reference(q), "{q}");
        }
        // Through a row: its largest value is 127 after scaling, a half value rounds away.
        let bytes = to_i8_rows(&[2.54, -1.0, 0.01, 0.0, 0.0, 0.0], 3);
        let scale = 2.54f32 / 127.0;
        assert_eq!(&bytes[..4], &scale.to_le_bytes());
        assert_eq!(
            &bytes[4..7],
            &[127u8, reference(-1.0 / scale), reference(0.01 / scale)]
        );
        assert_eq!(&bytes[7..11], &1f32.to_le_bytes());
        assert_eq!(&bytes[11..], &[0, 0, 0]);
    }

    #[test]
    fn round_trips_within_each_formats_precision() {
        let t = Tensor::new(&[[1.5f32, -0.1, 3.0e4], [0.0, 7.25, -1.0e-3]], &Device::Cpu).unwrap();
        for (dtype, rel) in [
            (CodeDType::F32, 0.0),
            (CodeDType::F16, 1e-3),
            (CodeDType::BF16, 8e-3),
        ] {
            let bytes = to_bytes(&t, dtype).unwrap();
            assert_eq!(bytes.len(), 6 * dtype.bits().unwrap() / 8);
            let back = from_bytes(&bytes, dtype, &[2, 3]).unwrap();
            for (a, b) in t
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .zip(back.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            {
                assert!(
                    (a - b).abs() <= rel * a.abs() + 1e-7,
                    "{dtype:?}: {a} vs {b}"
                );
            }
        }
        assert!(to_bytes(&t, CodeDType::I8).is_err());
        let bytes = to_bytes(&t, CodeDType::I8_ROWS).unwrap();
        assert_eq!(bytes.len(), 2 * (3 + 4));
        let back = from_bytes(&bytes, CodeDType::I8_ROWS, &[2, 3])
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let want = t.to_vec2::<f32>().unwrap();
        for (r, w) in back.iter().zip(&want) {
            let max = w.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (a, b) in r.iter().zip(w) {
                assert!((a - b).abs() <= max / 254.0 + 1e-6, "{a} vs {b}");
            }
        }
    }
}
