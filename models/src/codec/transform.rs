//! Transform coding of code matrices ([`CodeDType::TC`]): each column of a `(T, r)` code is
//! quantised with its own step and its symbols are entropy-coded, the way KVTC and image codecs
//! code decorrelated components. SCD's codes are already in a decorrelated basis ordered by
//! variance (the joint eigenvectors), which is the input this wants.
//!
//! The caller picks a step per column (`translated` derives them from one rate: a common
//! distortion in the consumer's K/V space, which is reverse water-filling for entropy-coded
//! uniform quantisers). Here each column's step is raised where needed so that no symbol leaves
//! `-127..=127`, and a column whose spread is under [`ZERO_BELOW`] steps is not sent at all
//! (its values are rebuilt as zero, the calibration mean): water-filling gives such a
//! component no bits. The entropy model of a column is a discretised Laplace distribution of
//! the column's own spread over its step, one of [`CLASSES`] shared tables (a quarter-octave
//! apart), so a request carries its own scale and no table travels; the Laplace shape was
//! kept over a Gaussian one for its heavier tails (their bytes on real codes were within 0.5%: `docs/design-notes.md`).
//!
//! Bytes: per column a little-endian f16 step and a class byte (`u8::MAX`: not sent), then the
//! rANS coder's words (little-endian u32), columns in order, each column's rows in order, then
//! a CRC-32 of everything before it. rANS decodes any words to some symbols, so the checksum
//! is what tells a cut or damaged code from a good one; decoding also checks every field and
//! that the coder ends exactly where its words do, so a damaged payload is an error, never a
//! silently different cache.
//!
//! The coder is `constriction`'s rANS (`DefaultAnsCoder`, 32-bit words) over 16-bit lookup
//! models, a maintained implementation rather than one of our own; `docs/design-notes.md`
//! records its measured speed and ratio against the alternatives.

use std::sync::OnceLock;

use constriction::stream::model::ContiguousLookupDecoderModel;
use constriction::stream::stack::DefaultAnsCoder;
use constriction::stream::Decode;
use half::f16;

/// Largest symbol magnitude: a column's step is at least its largest value over this.
pub const SYMBOL_MAX: i32 = 127;
/// A column whose RMS is under this many steps is not sent (rebuilt as zeros).
pub const ZERO_BELOW: f32 = 0.29;
/// Entropy-model classes: class `c` is a spread of `2^(c / 4 - 3)` steps.
pub const CLASSES: usize = 41;
const CLASSES_PER_OCTAVE: f32 = 4.0;
const LOWEST_OCTAVE: f32 = -3.0;
/// The class byte of a column that is not sent.
const NOT_SENT: u8 = u8::MAX;
const HEADER_PER_COLUMN: usize = 3;

/// Why transform-coded bytes could not be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TransformError {
    /// Fewer bytes than the column headers take.
    #[error("{got} bytes, under the {need} bytes of the column headers")]
    Short {
        /// Bytes received.
        got: usize,
        /// Bytes the headers need.
        need: usize,
    },
    /// A column's header is not one this coder writes.
    #[error("column {column}: {why}")]
    Header {
        /// The column.
        column: usize,
        /// What is wrong.
        why: String,
    },
    /// The coded words do not decode to exactly the symbols the headers announce.
    #[error("entropy-coded data: {0}")]
    Stream(String),
    /// The values to code are not finite.
    #[error("column {0} holds a value that is not finite")]
    NotFinite(usize),
}

/// An entropy model: 16-bit probabilities, and a table from every 16-bit value to its symbol,
/// so that decoding a symbol is one lookup rather than a search of the distribution.
type Model = ContiguousLookupDecoderModel<u16, Vec<u16>, Box<[u16]>, 16>;

/// The entropy model of each class, made on first use (about 5 MiB of lookup tables).
fn models() -> &'static [Model] {
    static MODELS: OnceLock<Vec<Model>> = OnceLock::new();
    MODELS.get_or_init(|| {
        (0..CLASSES)
            .map(|c| {
                let probabilities = laplace_pmf(class_spread(c as u8));
                // 255 finite, positive probabilities: the constructor's only failure modes
                // (an empty, single or non-finite distribution, more symbols than 2^16)
                // cannot occur.
                Model::from_floating_point_probabilities_fast(&probabilities, None)
                    .unwrap_or_else(|()| unreachable!("a Laplace table of 255 positive entries"))
            })
            .collect()
    })
}

/// The spread (RMS in steps) class `c` stands for.
fn class_spread(c: u8) -> f64 {
    2f64.powf(f64::from(c) / f64::from(CLASSES_PER_OCTAVE) + f64::from(LOWEST_OCTAVE))
}

/// The class of a column whose RMS is `spread` steps.
fn class_of(spread: f32) -> u8 {
    let c = ((spread.log2() - LOWEST_OCTAVE) * CLASSES_PER_OCTAVE).round();
    c.clamp(0.0, (CLASSES - 1) as f32) as u8
}

/// Probabilities of the symbols `-127..=127` for a Laplace distribution of RMS `spread`
/// (in steps), each symbol the mass of its rounding interval (the tails in the end symbols).
fn laplace_pmf(spread: f64) -> Vec<f64> {
    let b = spread / std::f64::consts::SQRT_2;
    let cdf = |x: f64| {
        if x < 0.0 {
            0.5 * (x / b).exp()
        } else {
            1.0 - 0.5 * (-x / b).exp()
        }
    };
    (-SYMBOL_MAX..=SYMBOL_MAX)
        .map(|q| {
            let lo = if q == -SYMBOL_MAX {
                0.0
            } else {
                cdf(f64::from(q) - 0.5)
            };
            let hi = if q == SYMBOL_MAX {
                1.0
            } else {
                cdf(f64::from(q) + 0.5)
            };
            (hi - lo).max(1e-12)
        })
        .collect()
}

/// Codes `values`, a row-major `(rows, cols)` matrix, with `steps[j]` the wanted step of
/// column `j` (a step of zero or less asks for the column's finest: its largest value over
/// [`SYMBOL_MAX`]).
pub fn encode(
    values: &[f32],
    rows: usize,
    cols: usize,
    steps: &[f32],
) -> Result<Vec<u8>, TransformError> {
    debug_assert_eq!(values.len(), rows * cols);
    debug_assert_eq!(steps.len(), cols);
    let mut out = Vec::with_capacity(cols * HEADER_PER_COLUMN + rows * cols / 2);
    // Each column's largest magnitude and sum of squares, in one pass over the rows in
    // memory order (a column's values are `cols` apart).
    let (mut max, mut sq) = (vec![0f32; cols], vec![0f64; cols]);
    for row in values.chunks_exact(cols.max(1)) {
        for (j, &x) in row.iter().enumerate() {
            if !x.is_finite() {
                return Err(TransformError::NotFinite(j));
            }
            max[j] = max[j].max(x.abs());
            sq[j] += f64::from(x) * f64::from(x);
        }
    }
    let mut sent: Vec<(usize, f32, u8)> = Vec::with_capacity(cols);
    for j in 0..cols {
        let rms = (sq[j] / rows.max(1) as f64).sqrt() as f32;
        let wanted = steps.get(j).copied().unwrap_or(0.0);
        // The step travels as f16: quantise with the rounded value, so both sides use one.
        let step = f16::from_f32(wanted.max(max[j] / SYMBOL_MAX as f32));
        let step_f = step.to_f32();
        let usable = max[j] > 0.0 && step_f > 0.0 && step_f.is_finite();
        let class = match usable && rms / step_f >= ZERO_BELOW {
            true => class_of(rms / step_f),
            false => NOT_SENT,
        };
        out.extend_from_slice(&step.to_le_bytes());
        out.push(class);
        if class != NOT_SENT {
            sent.push((j, step_f, class));
        }
    }
    // The sent columns' symbols, column after column, made in one pass in memory order.
    let mut symbols = vec![0usize; sent.len() * rows];
    for (t, row) in values.chunks_exact(cols.max(1)).enumerate() {
        for (k, &(j, step, _)) in sent.iter().enumerate() {
            let q = (row[j] / step).round() as i32;
            symbols[k * rows + t] = (q.clamp(-SYMBOL_MAX, SYMBOL_MAX) + SYMBOL_MAX) as usize;
        }
    }
    let models = models();
    let mut coder = DefaultAnsCoder::new();
    // rANS is last in, first out: the last column's last row goes in first.
    for (k, &(_, _, class)) in sent.iter().enumerate().rev() {
        coder
            .encode_iid_symbols_reverse(
                &symbols[k * rows..(k + 1) * rows],
                models[usize::from(class)].as_contiguous_categorical(),
            )
            .map_err(|e| TransformError::Stream(format!("encoding: {e}")))?;
    }
    let words = coder
        .into_compressed()
        .map_err(|e| TransformError::Stream(format!("{e:?}")))?;
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// The step of each of the `cols` columns of a code as its header carries it (the step
/// [`encode`] used), or `None` when `bytes` is shorter than the headers.
pub fn steps(bytes: &[u8], cols: usize) -> Option<Vec<f32>> {
    let header = bytes.get(..cols.checked_mul(HEADER_PER_COLUMN)?)?;
    Some(
        header
            .chunks_exact(HEADER_PER_COLUMN)
            .map(|h| f16::from_le_bytes([h[0], h[1]]).to_f32())
            .collect(),
    )
}

/// The row-major `(rows, cols)` matrix `bytes` code (what [`encode`] wrote).
pub fn decode(bytes: &[u8], rows: usize, cols: usize) -> Result<Vec<f32>, TransformError> {
    let head = cols * HEADER_PER_COLUMN;
    if bytes.len() < head + 4 {
        return Err(TransformError::Short {
            got: bytes.len(),
            need: head + 4,
        });
    }
    let (bytes, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(bytes).to_le_bytes() != crc {
        return Err(TransformError::Stream(
            "the checksum does not match: the code is cut or damaged".into(),
        ));
    }
    let (header, body) = bytes.split_at(head);
    let mut columns = Vec::with_capacity(cols);
    for (j, h) in header.chunks_exact(HEADER_PER_COLUMN).enumerate() {
        let step = f16::from_le_bytes([h[0], h[1]]).to_f32();
        let class = h[2];
        if class != NOT_SENT {
            if usize::from(class) >= CLASSES {
                return Err(TransformError::Header {
                    column: j,
                    why: format!("entropy class {class}, not under {CLASSES}"),
                });
            }
            if !(step.is_finite() && step > 0.0) {
                return Err(TransformError::Header {
                    column: j,
                    why: format!("step {step}, not a positive number"),
                });
            }
        }
        columns.push((step, class));
    }
    if body.len() % 4 != 0 {
        return Err(TransformError::Stream(format!(
            "{} bytes, not whole 32-bit words",
            body.len()
        )));
    }
    let words: Vec<u32> = body
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect();
    let mut coder = DefaultAnsCoder::from_compressed(words)
        .map_err(|_| TransformError::Stream("its last word is zero".into()))?;
    let models = models();
    let mut out = vec![0f32; rows * cols];
    for (j, &(step, class)) in columns.iter().enumerate() {
        if class == NOT_SENT {
            continue;
        }
        let model = models[usize::from(class)].as_view();
        for (t, s) in coder.decode_iid_symbols(rows, model).enumerate() {
            let s = s.map_err(|e| TransformError::Stream(format!("{e:?}")))?;
            out[t * cols + j] = (s as i32 - SYMBOL_MAX) as f32 * step;
        }
    }
    if !coder.is_empty() {
        return Err(TransformError::Stream(
            "words left over after every announced symbol".into(),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn matrix(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        // Columns of falling spread, as the eigenvector-ordered codes are.
        (0..rows * cols)
            .map(|i| {
                let j = i % cols;
                let u: f32 = rng.gen_range(-1.0..1.0);
                u * 10.0 / (1.0 + j as f32)
            })
            .collect()
    }

    #[test]
    fn round_trip_is_within_half_a_step_and_drops_small_columns() {
        let (rows, cols) = (64, 24);
        let x = matrix(rows, cols, 1);
        let wanted = vec![0.5f32; cols];
        let bytes = encode(&x, rows, cols, &wanted).unwrap();
        let y = decode(&bytes, rows, cols).unwrap();
        for j in 0..cols {
            let rms = (0..rows).map(|t| x[t * cols + j].powi(2)).sum::<f32>() / rows as f32;
            for t in 0..rows {
                let (a, b) = (x[t * cols + j], y[t * cols + j]);
                if rms.sqrt() / 0.5 < ZERO_BELOW {
                    assert_eq!(b, 0.0, "column {j} is under the threshold: not sent");
                } else {
                    assert!((a - b).abs() <= 0.25 + 1e-3, "column {j}: {a} -> {b}");
                }
            }
        }
        // Far fewer bytes than the f16 matrix.
        assert!(bytes.len() < rows * cols, "{} bytes", bytes.len());
        // The header carries the steps used, and coding the decoded values again with them
        // codes the same symbols (the columns' classes may move: the values' spread did).
        let used = steps(&bytes, cols).unwrap();
        assert!(used.iter().all(|&s| s == 0.5), "{used:?}");
        let again = encode(&y, rows, cols, &used).unwrap();
        assert_eq!(decode(&again, rows, cols).unwrap(), y);
        assert!(steps(&bytes[..5], cols).is_none());
    }

    #[test]
    fn coarser_steps_give_fewer_bytes_and_the_floor_keeps_symbols_in_range() {
        let (rows, cols) = (128, 16);
        let x = matrix(rows, cols, 2);
        let sizes: Vec<usize> = [0.05f32, 0.2, 0.8]
            .iter()
            .map(|&s| encode(&x, rows, cols, &vec![s; cols]).unwrap().len())
            .collect();
        assert!(sizes[0] > sizes[1] && sizes[1] > sizes[2], "{sizes:?}");
        // A wanted step of zero: the finest the symbol range allows, still within one step.
        let bytes = encode(&x, rows, cols, &vec![0.0; cols]).unwrap();
        let y = decode(&bytes, rows, cols).unwrap();
        let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= max / SYMBOL_MAX as f32);
        }
    }

    #[test]
    fn damaged_bytes_are_errors_not_panics() {
        let (rows, cols) = (32, 8);
        let x = matrix(rows, cols, 3);
        let bytes = encode(&x, rows, cols, &vec![0.1; cols]).unwrap();
        assert!(matches!(
            decode(&bytes[..5], rows, cols),
            Err(TransformError::Short { .. })
        ));
        // A header the coder never writes, under a good checksum (a peer's own bug).
        let reseal = |mut b: Vec<u8>| {
            let n = b.len() - 4;
            let crc = crc32fast::hash(&b[..n]);
            b[n..].copy_from_slice(&crc.to_le_bytes());
            b
        };
        let mut bad_class = bytes.clone();
        bad_class[2] = CLASSES as u8;
        let bad_class = reseal(bad_class);
        assert!(matches!(
            decode(&bad_class, rows, cols),
            Err(TransformError::Header { column: 0, .. })
        ));
        let mut bad_step = bytes.clone();
        bad_step[0..2].copy_from_slice(&f16::NAN.to_le_bytes());
        assert!(matches!(
            decode(&reseal(bad_step), rows, cols),
            Err(TransformError::Header { column: 0, .. })
        ));
        // Cut words, extra words, odd lengths.
        assert!(decode(&bytes[..bytes.len() - 4], rows, cols).is_err());
        let mut longer = bytes.clone();
        longer.extend_from_slice(&7u32.to_le_bytes());
        assert!(decode(&longer, rows, cols).is_err());
        assert!(decode(&bytes[..bytes.len() - 1], rows, cols).is_err());
        // Any flipped bit is caught.
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        for _ in 0..500 {
            let mut b = bytes.clone();
            let i = rng.gen_range(0..b.len());
            b[i] ^= 1 << rng.gen_range(0..8);
            assert!(
                decode(&b, rows, cols).is_err(),
                "byte {i} flipped, not caught"
            );
        }
        assert!(matches!(
            encode(&[f32::NAN; 4], 2, 2, &[0.1; 2]),
            Err(TransformError::NotFinite(0))
        ));
    }

    #[test]
    fn all_zero_and_empty_matrices_round_trip() {
        let bytes = encode(&[0.0; 12], 3, 4, &[0.1; 4]).unwrap();
        assert_eq!(decode(&bytes, 3, 4).unwrap(), vec![0.0; 12]);
        let bytes = encode(&[], 0, 4, &[0.1; 4]).unwrap();
        assert!(decode(&bytes, 0, 4).unwrap().is_empty());
    }
}
