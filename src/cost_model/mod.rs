//! The TTFT cost model: a few constants that say how long a transfer mode takes
//! to its first token, fitted to `scd bench ttft`'s cells, checked against them, then projected
//! to other hardware. Pure functions; `report` reads a bench record, fits, projects and draws.
//!
//! For a prompt of `L` tokens, mode `m`, a link of `B` bit/s and the producer cold or warm:
//!
//! ```text
//! oracle:  T = t0 + P(L)                                  P(L) = p1 L + p2 L²
//! other:   S = [cold] P(L) + c_m L                        compute on the path
//!          X = bytes_m(L) * 8 / B                         the payload on the link
//!          T = tx + S + X - w * min(S, X)
//! ```
//!
//! * `t0`, `tx`: the fixed cost of a job through the cluster (submission, claim, the first
//!   token's decode step), on the oracle's path and on a transfer's (which adds the producer's
//!   claim and the stream's set-up, but whose consumer starts from a rebuilt cache). Two
//!   constants rather than one: a single one, fitted on the oracle, over-predicted every warm
//!   cell by 30-100% on the first run;
//! * `P(L)`: a prefill of `L` tokens (the linear term is the weights' matmuls, the quadratic
//!   one attention); the oracle's expert and the producer's base have the same shape;
//! * `c_m`: mode `m`'s encode plus rebuild per token (raw: copying rows; droidspeak: its
//!   recomputed blocks; reuse and scd: the translator's products);
//! * `bytes_m(L)`: the payload, measured (it is linear in `L` for every mode);
//! * `w` in [0, 1]: the layer-wise overlap. The producer sends each layer's codes as soon as it
//!   has them and the consumer rebuilds each layer as it arrives, so compute and transfer
//!   overlap: `w = 0` is a serial path, `w = 1` perfect overlap (only the longer of the two
//!   counts).
//!
//! Unpaced loopback is a link too: its rate `b_loop` is fitted with the rest.
//!
//! Fit (`fit`): `t0, p1, p2` by least squares on the oracle cells (TTFT against 1, L, L²); then
//! for each candidate `w` and `b_loop` on a grid, each mode's `c_m` as the median over its cells
//! of the value that makes the cell exact (the model is monotone in `c_m`, so bisection finds
//! it), and the (w, b_loop) whose fitted model has the smallest median relative error wins.
//! `crossover` solves the model for the bandwidth at which one mode catches another.

pub mod plots;
pub mod report;

use std::collections::BTreeMap;

use scd_types::Mode;

/// Whether the producer prefills the prompt (cold) or holds it in its prefix cache (warm).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum Cache {
    Cold,
    Warm,
}

/// One measured (or asked-about) cell: what the model predicts from.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub mode: Mode,
    pub cache: Cache,
    /// Prompt tokens.
    pub tokens: f64,
    /// Link rate in bit/s; `None` for unpaced loopback.
    pub bits_per_s: Option<f64>,
    /// Payload bytes of one request.
    pub payload_bytes: f64,
}

/// The model's constants (times in seconds).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Model {
    /// Fixed cost of an oracle job, s.
    pub t0: f64,
    /// Fixed cost of a job whose cache crosses the link, s.
    pub t0_transfer: f64,
    /// Prefill, s per token.
    pub p1: f64,
    /// Prefill, s per token².
    pub p2: f64,
    /// Encode + rebuild, s per token, by mode (`Mode::as_str`).
    pub codec_s_per_token: BTreeMap<String, f64>,
    /// Layer-wise overlap of compute and transfer, 0..=1.
    pub overlap: f64,
    /// The unpaced loopback's rate, bit/s.
    pub loopback_bits_per_s: f64,
}

impl Model {
    /// A prefill of `tokens`, s.
    pub fn prefill(&self, tokens: f64) -> f64 {
        self.p1 * tokens + self.p2 * tokens * tokens
    }

    /// The predicted TTFT of `p`, s.
    pub fn predict(&self, p: &Point) -> f64 {
        if p.mode == Mode::Oracle {
            return self.t0 + self.prefill(p.tokens);
        }
        let c = self
            .codec_s_per_token
            .get(p.mode.as_str())
            .copied()
            .unwrap_or(0.0);
        self.predict_with(p, c)
    }

    fn predict_with(&self, p: &Point, codec_s_per_token: f64) -> f64 {
        let prefill = match p.cache {
            Cache::Cold => self.prefill(p.tokens),
            Cache::Warm => 0.0,
        };
        let s = prefill + codec_s_per_token * p.tokens;
        let rate = p.bits_per_s.unwrap_or(self.loopback_bits_per_s);
        let x = p.payload_bytes * 8.0 / rate;
        self.t0_transfer + s + x - self.overlap * s.min(x)
    }
}

/// A measured cell: the point and its median TTFT, s.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    pub point: Point,
    pub ttft_s: f64,
}

/// |predicted - measured| / measured.
pub fn relative_error(model: &Model, m: &Measured) -> f64 {
    (model.predict(&m.point) - m.ttft_s).abs() / m.ttft_s
}

/// The median of `v` (NaN when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Least squares of `y` on the columns of `x` (normal equations, Gaussian elimination: the
/// fits here have at most three columns).
pub fn least_squares(x: &[Vec<f64>], y: &[f64]) -> Option<Vec<f64>> {
    let k = x.first()?.len();
    let mut a = vec![vec![0.0; k + 1]; k];
    for (row, &yi) in x.iter().zip(y) {
        for i in 0..k {
            for j in 0..k {
                a[i][j] += row[i] * row[j];
            }
            a[i][k] += row[i] * yi;
        }
    }
    for col in 0..k {
        let pivot = (col..k).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, pivot);
        let pivot_row = a[col].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (x, p) in row[col..].iter_mut().zip(&pivot_row[col..]) {
                    *x -= f * p;
                }
            }
        }
    }
    Some((0..k).map(|i| a[i][k] / a[i][i]).collect())
}

/// Why a fit is impossible.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FitError {
    #[error("no oracle cells: the prefill cannot be fitted")]
    NoOracle,
    #[error("the oracle cells do not determine the prefill (too few lengths)")]
    Singular,
}

/// The prefill and fixed cost from the oracle cells: `t0 + p1 L + p2 L²`. With one length only
/// the fixed cost is taken as zero and the prefill linear; with two, the prefill is linear.
pub fn fit_prefill(cells: &[Measured]) -> Result<(f64, f64, f64), FitError> {
    let oracle: Vec<&Measured> = cells
        .iter()
        .filter(|m| m.point.mode == Mode::Oracle)
        .collect();
    if oracle.is_empty() {
        return Err(FitError::NoOracle);
    }
    let mut lengths: Vec<f64> = oracle.iter().map(|m| m.point.tokens).collect();
    lengths.sort_by(f64::total_cmp);
    lengths.dedup();
    let y: Vec<f64> = oracle.iter().map(|m| m.ttft_s).collect();
    let cols = |f: &dyn Fn(f64) -> Vec<f64>| -> Vec<Vec<f64>> {
        oracle.iter().map(|m| f(m.point.tokens)).collect()
    };
    match lengths.len() {
        1 => {
            let c = least_squares(&cols(&|l| vec![l]), &y).ok_or(FitError::Singular)?;
            Ok((0.0, c[0], 0.0))
        }
        2 => {
            let c = least_squares(&cols(&|l| vec![1.0, l]), &y).ok_or(FitError::Singular)?;
            Ok((c[0], c[1], 0.0))
        }
        _ => {
            let c = least_squares(&cols(&|l| vec![1.0, l, l * l]), &y).ok_or(FitError::Singular)?;
            Ok((c[0], c[1], c[2]))
        }
    }
}

/// The `c_m` that makes `m` exact under `model` (bisection; 0 when even zero codec time
/// predicts too long).
fn exact_codec(model: &Model, m: &Measured) -> f64 {
    let f = |c: f64| model.predict_with(&m.point, c) - m.ttft_s;
    if f(0.0) >= 0.0 {
        return 0.0;
    }
    let mut hi = 1e-3;
    while f(hi) < 0.0 && hi < 1e3 {
        hi *= 2.0;
    }
    let mut lo = 0.0;
    for _ in 0..80 {
        let mid = 0.5 * (lo + hi);
        if f(mid) < 0.0 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// Fits the model to `cells` (see the module's documentation): `t0` and the prefill on the
/// oracle cells, then `w`, the loopback rate and `tx` (a share of `t0`, 0 to 1.5) on a grid,
/// each point with the `c_m` that make each mode's median cell exact.
pub fn fit(cells: &[Measured]) -> Result<Model, FitError> {
    let (t0, p1, p2) = fit_prefill(cells)?;
    let modes: Vec<Mode> = {
        let mut v: Vec<Mode> = cells
            .iter()
            .map(|m| m.point.mode)
            .filter(|m| *m != Mode::Oracle)
            .collect();
        v.sort();
        v.dedup();
        v
    };
    let mut best: Option<(f64, Model)> = None;
    for wi in 0..=20 {
        let overlap = wi as f64 / 20.0;
        for (loop_gbit, ti) in [0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 50.0]
            .into_iter()
            .flat_map(|g| (0..=30).map(move |ti| (g, ti)))
        {
            let mut model = Model {
                t0,
                t0_transfer: t0 * ti as f64 / 20.0,
                p1,
                p2,
                codec_s_per_token: BTreeMap::new(),
                overlap,
                loopback_bits_per_s: loop_gbit * 1e9,
            };
            for &mode in &modes {
                let c = median(
                    cells
                        .iter()
                        .filter(|m| m.point.mode == mode)
                        .map(|m| exact_codec(&model, m))
                        .collect(),
                );
                model.codec_s_per_token.insert(mode.as_str().into(), c);
            }
            let err = median(cells.iter().map(|m| relative_error(&model, m)).collect());
            if best.as_ref().is_none_or(|(e, _)| err < *e) {
                best = Some((err, model));
            }
        }
    }
    Ok(best.map(|(_, m)| m).expect("the grid is not empty"))
}

/// The link rate (bit/s) at which `a` and `b` take equally long at `tokens` and `cache`, with
/// payloads `bytes_a` and `bytes_b`, searched between `lo` and `hi` bit/s (log bisection).
/// `None` when one is faster over the whole range.
pub fn crossover(
    model: &Model,
    a: (Mode, f64),
    b: (Mode, f64),
    tokens: f64,
    cache: Cache,
    lo: f64,
    hi: f64,
) -> Option<f64> {
    let diff = |rate: f64| {
        let at = |(mode, bytes): (Mode, f64)| {
            model.predict(&Point {
                mode,
                cache,
                tokens,
                bits_per_s: Some(rate),
                payload_bytes: bytes,
            })
        };
        at(a) - at(b)
    };
    let (mut l, mut h) = (lo.ln(), hi.ln());
    let (dl, dh) = (diff(lo), diff(hi));
    if dl.signum() == dh.signum() {
        return None;
    }
    for _ in 0..100 {
        let mid = 0.5 * (l + h);
        if diff(mid.exp()).signum() == dl.signum() {
            l = mid;
        } else {
            h = mid;
        }
    }
    Some((0.5 * (l + h)).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn truth() -> Model {
        Model {
            t0: 0.15,
            t0_transfer: 0.15 * 10.0 / 20.0,
            p1: 1.2e-3,
            p2: 1.0e-7,
            codec_s_per_token: [("raw".to_string(), 5e-5), ("scd".to_string(), 2e-4)]
                .into_iter()
                .collect(),
            overlap: 0.6,
            loopback_bits_per_s: 5e9,
        }
    }

    fn grid(model: &Model) -> Vec<Measured> {
        let mut cells = Vec::new();
        for tokens in [256.0, 1024.0, 2048.0] {
            for cache in [Cache::Cold, Cache::Warm] {
                for rate in [Some(50e6), Some(500e6), Some(5e9), None] {
                    for (mode, bytes_per_token) in [
                        (Mode::Oracle, 0.0),
                        (Mode::Raw, 23_040.0),
                        (Mode::Scd, 8_000.0),
                    ] {
                        let point = Point {
                            mode,
                            cache,
                            tokens,
                            bits_per_s: rate,
                            payload_bytes: bytes_per_token * tokens,
                        };
                        let ttft_s = model.predict(&point);
                        cells.push(Measured { point, ttft_s });
                    }
                }
            }
        }
        cells
    }

    #[test]
    fn least_squares_recovers_a_polynomial() {
        let x: Vec<Vec<f64>> = [1.0, 2.0, 3.0, 5.0]
            .iter()
            .map(|&l| vec![1.0, l, l * l])
            .collect();
        let y: Vec<f64> = [1.0, 2.0, 3.0, 5.0]
            .iter()
            .map(|&l| 0.5 + 2.0 * l + 0.25 * l * l)
            .collect();
        let c = least_squares(&x, &y).unwrap();
        for (got, want) in c.iter().zip([0.5, 2.0, 0.25]) {
            assert!((got - want).abs() < 1e-9, "{c:?}");
        }
    }

    #[test]
    fn the_fit_recovers_the_constants_it_was_made_from() {
        let t = truth();
        let fitted = fit(&grid(&t)).unwrap();
        assert!((fitted.t0 - t.t0).abs() < 1e-9);
        assert!((fitted.t0_transfer - t.t0_transfer).abs() < 1e-9);
        assert!((fitted.p1 - t.p1).abs() < 1e-12);
        assert!((fitted.overlap - t.overlap).abs() < 1e-9);
        assert_eq!(fitted.loopback_bits_per_s, t.loopback_bits_per_s);
        for (mode, c) in &t.codec_s_per_token {
            assert!((fitted.codec_s_per_token[mode] - c).abs() < 1e-9, "{mode}");
        }
        let cells = grid(&t);
        let err = median(cells.iter().map(|m| relative_error(&fitted, m)).collect());
        assert!(err < 1e-6);
    }

    #[test]
    fn the_fit_stays_close_on_noisy_cells() {
        let t = truth();
        let mut cells = grid(&t);
        for (i, c) in cells.iter_mut().enumerate() {
            // +-5%, deterministic.
            c.ttft_s *= 1.0 + 0.05 * ((i * 7 % 11) as f64 / 5.0 - 1.0);
        }
        let fitted = fit(&cells).unwrap();
        let err = median(cells.iter().map(|m| relative_error(&fitted, m)).collect());
        assert!(err < 0.06, "median error {err}");
    }

    #[test]
    fn overlap_bounds_the_path() {
        let mut m = truth();
        let p = Point {
            mode: Mode::Raw,
            cache: Cache::Cold,
            tokens: 1024.0,
            bits_per_s: Some(100e6),
            payload_bytes: 23_040.0 * 1024.0,
        };
        m.overlap = 0.0;
        let serial = m.predict(&p);
        m.overlap = 1.0;
        let overlapped = m.predict(&p);
        let s = m.prefill(1024.0) + 5e-5 * 1024.0;
        let x = 23_040.0 * 1024.0 * 8.0 / 100e6;
        assert!((serial - (m.t0_transfer + s + x)).abs() < 1e-12);
        assert!((overlapped - (m.t0_transfer + s.max(x))).abs() < 1e-12);
    }

    #[test]
    fn crossover_is_where_the_two_meet() {
        let m = truth();
        let raw = (Mode::Raw, 23_040.0 * 1024.0);
        let at = crossover(&m, raw, (Mode::Oracle, 0.0), 1024.0, Cache::Warm, 1e6, 1e12).unwrap();
        let t = |mode, bytes| {
            m.predict(&Point {
                mode,
                cache: Cache::Warm,
                tokens: 1024.0,
                bits_per_s: Some(at),
                payload_bytes: bytes,
            })
        };
        assert!((t(Mode::Raw, raw.1) - t(Mode::Oracle, 0.0)).abs() < 1e-9);
        // Above it raw wins, below the oracle does.
        assert!(
            m.predict(&Point {
                mode: Mode::Raw,
                cache: Cache::Warm,
                tokens: 1024.0,
                bits_per_s: Some(at * 2.0),
                payload_bytes: raw.1,
            }) < t(Mode::Oracle, 0.0)
        );
        // A cold raw transfer never beats the oracle when its prefill alone is as long and its
        // fixed cost no shorter.
        let mut slow = m.clone();
        slow.overlap = 0.0;
        slow.t0_transfer = slow.t0;
        assert_eq!(
            crossover(
                &slow,
                raw,
                (Mode::Oracle, 0.0),
                1024.0,
                Cache::Cold,
                1e6,
                1e12
            ),
            None
        );
    }
}
