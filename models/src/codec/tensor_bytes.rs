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
        return Ok(to_i8_rows(&t.to_vec2::<f32>()?));
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

/// Rows quantised to int8 with a scale each (`max |x| / 127`), the scale first: per-token code
/// quantisation, which keeps each token's relative precision whatever its magnitude.
pub fn to_i8_rows(rows: &[Vec<f32>]) -> Vec<u8> {
    let cols = rows.first().map_or(0, Vec::len);
    let mut out = Vec::with_capacity(rows.len() * (cols + 4));
    for row in rows {
        let max = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scale = if max > 0.0 { max / 127.0 } else { 1.0 };
        out.extend_from_slice(&scale.to_le_bytes());
        out.extend(
            row.iter()
                .map(|&x| (x / scale).round().clamp(-127.0, 127.0) as i8 as u8),
        );
    }
    out
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
