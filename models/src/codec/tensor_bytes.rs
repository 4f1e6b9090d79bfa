//! Tensors to and from the bytes of a [`scd_types::LayerCode`]: row-major, little-endian, in
//! f32, f16 or bf16. Math stays in f32; the narrower types exist for the wire.

use candle_core::{Device, Tensor};
use half::{bf16, f16};
use scd_types::CodeDType;

use super::CodecError;

/// The bytes of a 2-D f32 tensor stored as `dtype` (F32, F16 or BF16).
pub fn to_bytes(t: &Tensor, dtype: CodeDType) -> Result<Vec<u8>, CodecError> {
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

/// An f32 tensor of `shape` from `bytes` in `dtype` (F32, F16 or BF16). The caller has checked
/// that the length matches.
pub fn from_bytes(bytes: &[u8], dtype: CodeDType, shape: &[usize]) -> Result<Tensor, CodecError> {
    let values: Vec<f32> = match dtype {
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
    }
}
