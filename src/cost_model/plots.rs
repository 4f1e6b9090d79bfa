//! The cost model's pictures, drawn with plotters into SVG and PNG: TTFT against bandwidth
//! per mode (cold and warm, measured points and the fitted model's curves), KL against payload
//! (this machine's modes and the paper's), measured against predicted, and the projected
//! speed-up against bandwidth of the 7B and 32B pairs. Text needs a TrueType font: the first of
//! a few usual system paths (`--font` names another); without one no plot is drawn.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use plotters::coord::Shift;
use plotters::prelude::*;
use scd_types::Mode;

use super::report::{projected, PAIRS, PAPER, PAPER_TOKENS};
use super::{Cache, Model, Point};
use crate::cmd::bench_ttft::{Cell, Quality};

/// One series of a chart.
struct Series {
    name: String,
    color: RGBColor,
    points: Vec<(f64, f64)>,
    line: bool,
    markers: bool,
}

fn color(mode: Mode) -> RGBColor {
    match mode {
        Mode::Oracle => RGBColor(0, 0, 0),
        Mode::Raw => RGBColor(31, 119, 180),
        Mode::Q4 => RGBColor(255, 127, 14),
        Mode::Q2 => RGBColor(188, 189, 34),
        Mode::Kvtc => RGBColor(23, 190, 207),
        Mode::DroidSpeak => RGBColor(44, 160, 44),
        Mode::Reuse => RGBColor(148, 103, 189),
        Mode::Scd => RGBColor(214, 39, 40),
        Mode::Auto => RGBColor(127, 127, 127),
    }
}

fn font(given: Option<&Path>) -> Option<&'static [u8]> {
    let candidates = [
        given.map(|p| p.display().to_string()).unwrap_or_default(),
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf".into(),
        "/usr/share/fonts/TTF/DejaVuSans.ttf".into(),
        "/usr/share/fonts/dejavu/DejaVuSans.ttf".into(),
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf".into(),
    ];
    candidates
        .iter()
        .filter(|p| !p.is_empty())
        .find_map(|p| std::fs::read(p).ok())
        .map(|b| &*Box::leak(b.into_boxed_slice()))
}

type Res = Result<(), Box<dyn std::error::Error>>;

#[allow(clippy::too_many_arguments)]
fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    x: (f64, f64),
    y: (f64, f64),
    series: &[Series],
    diagonal: bool,
    legend: SeriesLabelPosition,
) -> Res
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d((x.0..x.1).log_scale(), (y.0..y.1).log_scale())?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_label_formatter(&|v| short(*v))
        .y_label_formatter(&|v| short(*v))
        .label_style(("sans-serif", 13))
        .draw()?;
    if diagonal {
        for (k, c) in [
            (1.0, BLACK.mix(0.6)),
            (1.15, BLACK.mix(0.25)),
            (1.0 / 1.15, BLACK.mix(0.25)),
        ] {
            let lo = x.0.max(y.0);
            let hi = x.1.min(y.1);
            chart.draw_series(LineSeries::new([(lo, lo * k), (hi, hi * k)], c))?;
        }
    }
    for s in series {
        let style = s.color.stroke_width(if s.markers { 2 } else { 1 });
        let legend_color = s.color;
        if s.line {
            let anno = chart.draw_series(LineSeries::new(s.points.iter().copied(), style))?;
            if !s.name.is_empty() {
                anno.label(&s.name).legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], legend_color.stroke_width(2))
                });
            }
        }
        if s.markers {
            let anno = chart.draw_series(
                s.points
                    .iter()
                    .map(|&p| Circle::new(p, 4, s.color.filled())),
            )?;
            if !s.line && !s.name.is_empty() {
                anno.label(&s.name)
                    .legend(move |(x, y)| Circle::new((x + 9, y), 4, legend_color.filled()));
            }
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 13))
        .position(legend)
        .draw()?;
    root.present()?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn chart_at(
    dir: &Path,
    name: &str,
    title: &str,
    x_label: &str,
    y_label: &str,
    x: (f64, f64),
    y: (f64, f64),
    series: &[Series],
    diagonal: bool,
    legend: SeriesLabelPosition,
) -> anyhow::Result<()> {
    let svg = dir.join(format!("{name}.svg"));
    let png = dir.join(format!("{name}.png"));
    draw(
        SVGBackend::new(&svg, (900, 600)).into_drawing_area(),
        title,
        x_label,
        y_label,
        x,
        y,
        series,
        diagonal,
        legend.clone(),
    )
    .map_err(|e| anyhow::anyhow!("drawing {}: {e}", svg.display()))?;
    draw(
        BitMapBackend::new(&png, (900, 600)).into_drawing_area(),
        title,
        x_label,
        y_label,
        x,
        y,
        series,
        diagonal,
        legend,
    )
    .map_err(|e| anyhow::anyhow!("drawing {}: {e}", png.display()))?;
    Ok(())
}

/// [`chart_at`] with the legend in the upper right.
#[allow(clippy::too_many_arguments)]
fn chart(
    dir: &Path,
    name: &str,
    title: &str,
    x_label: &str,
    y_label: &str,
    x: (f64, f64),
    y: (f64, f64),
    series: &[Series],
    diagonal: bool,
) -> anyhow::Result<()> {
    let at = SeriesLabelPosition::UpperRight;
    chart_at(
        dir, name, title, x_label, y_label, x, y, series, diagonal, at,
    )
}

/// An axis label with at most three significant digits (log axes' labels are products of
/// floats: 0.6000000001).
fn short(v: f64) -> String {
    let digits = (2 - v.abs().max(1e-12).log10().floor() as i32).clamp(0, 12) as usize;
    let s = format!("{v:.digits$}");
    match s.contains('.') {
        true => s.trim_end_matches('0').trim_end_matches('.').to_string(),
        false => s,
    }
}

fn bounds(series: &[Series], pad: f64) -> ((f64, f64), (f64, f64)) {
    let pts = series
        .iter()
        .flat_map(|s| s.points.iter())
        .filter(|p| p.0.is_finite() && p.1.is_finite() && p.0 > 0.0 && p.1 > 0.0);
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    ((x0 / pad, x1 * pad), (y0 / pad, y1 * pad))
}

/// The quality-bytes frontier of `points` (mode, payload share of raw, KL) into `out`.svg
/// and .png: a line through each mode's rates, a marker where it has one; `false` when no
/// font was found (nothing drawn).
pub fn frontier(
    out: &Path,
    title: &str,
    points: &[(Mode, f64, f64)],
    font_path: Option<&Path>,
) -> anyhow::Result<bool> {
    let Some(font) = font(font_path) else {
        eprintln!("no TrueType font found (name one with --font): no plot drawn");
        return Ok(false);
    };
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| anyhow::anyhow!("the plot font is not a TrueType font"))?;
    let mut by_mode: BTreeMap<Mode, Vec<(f64, f64)>> = BTreeMap::new();
    for &(mode, share, kl) in points {
        by_mode.entry(mode).or_default().push((100.0 * share, kl));
    }
    let series: Vec<Series> = by_mode
        .into_iter()
        .map(|(mode, mut pts)| {
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            // Records of one run share their reference (raw): one point.
            pts.dedup();
            Series {
                name: mode.to_string(),
                color: color(mode),
                line: pts.len() > 1,
                markers: true,
                points: pts,
            }
        })
        .collect();
    anyhow::ensure!(
        series.iter().any(|s| !s.points.is_empty()),
        "no methods to draw"
    );
    let (x, y) = bounds(&series, 1.2);
    let dir = out.parent().unwrap_or(Path::new("."));
    let name = out
        .file_name()
        .context("the plot's path has no file name")?
        .to_string_lossy();
    chart_at(
        dir,
        &name,
        title,
        "payload, % of raw bf16 KV",
        "KL(oracle || method), nats per token",
        x,
        y,
        &series,
        false,
        SeriesLabelPosition::LowerLeft,
    )?;
    Ok(true)
}

/// Every plot of the report into `dir`.
pub fn draw_all(
    dir: &Path,
    cells: &[Cell],
    quality: &BTreeMap<String, Quality>,
    model: &Model,
    bytes_per_token: &BTreeMap<Mode, f64>,
    shares: &BTreeMap<String, f64>,
    font_path: Option<&Path>,
) -> anyhow::Result<()> {
    let Some(font) = font(font_path) else {
        eprintln!("no TrueType font found (name one with --font): no plots drawn");
        return Ok(());
    };
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| anyhow::anyhow!("the plot font is not a TrueType font"))?;
    let modes: Vec<Mode> = bytes_per_token.keys().copied().collect();
    let loop_mbit = model.loopback_bits_per_s / 1e6;

    // TTFT against bandwidth, at the length with the most links.
    let mut lengths: BTreeMap<usize, usize> = BTreeMap::new();
    for c in cells {
        *lengths.entry(c.tokens).or_default() += 1;
    }
    let tokens = lengths
        .iter()
        .max_by_key(|(t, n)| (**n, **t))
        .map(|(t, _)| *t)
        .context("no cells")?;
    for (cache, name) in [(Cache::Cold, "cold"), (Cache::Warm, "warm")] {
        let mut series = Vec::new();
        for &mode in &modes {
            let mut measured: Vec<(f64, f64)> = cells
                .iter()
                .filter(|c| c.mode == mode && c.cache == name && c.tokens == tokens)
                .map(|c| {
                    (
                        c.link_mbit.map_or(loop_mbit, |m| m as f64),
                        c.ttft_median_ms.value,
                    )
                })
                .collect();
            measured.sort_by(|a, b| a.0.total_cmp(&b.0));
            if measured.is_empty() {
                continue;
            }
            let bytes = bytes_per_token[&mode] * tokens as f64;
            let curve: Vec<(f64, f64)> = (0..=60)
                .map(|i| {
                    let mbit = 20.0 * (loop_mbit / 20.0).powf(i as f64 / 60.0);
                    let t = model.predict(&Point {
                        mode,
                        cache,
                        tokens: tokens as f64,
                        bits_per_s: Some(mbit * 1e6),
                        payload_bytes: bytes,
                    });
                    (mbit, t * 1e3)
                })
                .collect();
            series.push(Series {
                name: format!("{mode} (measured)"),
                color: color(mode),
                points: measured,
                line: false,
                markers: true,
            });
            series.push(Series {
                name: String::new(),
                color: color(mode),
                points: curve,
                line: true,
                markers: false,
            });
        }
        let (x, y) = bounds(&series, 1.3);
        chart(
            dir,
            &format!("ttft-vs-bandwidth-{name}"),
            &format!(
                "TTFT against link, {name} producer, {tokens} tokens (points measured, lines the fitted model; loopback at {:.1} Gbit/s)",
                loop_mbit / 1e3
            ),
            "link, Mbit/s",
            "TTFT, ms (median)",
            x,
            y,
            &series,
            false,
        )?;
    }

    // KL against payload.
    let raw = bytes_per_token.get(&Mode::Raw).copied().unwrap_or(f64::NAN);
    let mut series = Vec::new();
    for &mode in &modes {
        if mode == Mode::Oracle {
            continue;
        }
        if let Some(q) = quality.get(mode.as_str()) {
            series.push(Series {
                name: format!("{mode}, this run"),
                color: color(mode),
                points: vec![(bytes_per_token[&mode] / raw, q.kl.value)],
                line: false,
                markers: true,
            });
        }
    }
    let paper: Vec<(f64, f64)> = PAPER
        .iter()
        .filter(|p| p.0 != Mode::Oracle)
        .map(|p| (p.1 / 115.02, p.4))
        .collect();
    series.push(Series {
        name: "the paper (Mistral-7B pair): raw, q4, droidspeak, reuse, scd".into(),
        color: RGBColor(120, 120, 120),
        points: paper,
        line: false,
        markers: true,
    });
    series.push(Series {
        name: "KL ceiling 0.1".into(),
        color: RGBColor(200, 200, 200),
        points: vec![(0.05, 0.1), (2.0, 0.1)],
        line: true,
        markers: false,
    });
    let (_, y) = bounds(&series, 1.5);
    chart(
        dir,
        "kl-vs-payload",
        "Quality against size: KL to the oracle against payload (share of raw KV)",
        "payload / raw KV payload",
        "KL(oracle || mode), nats per token",
        (0.1, 1.6),
        y,
        &series,
        false,
    )?;

    // Measured against predicted.
    let mut series = Vec::new();
    for &mode in &modes {
        let pts: Vec<(f64, f64)> = super::report::measured(cells)
            .iter()
            .filter(|m| m.point.mode == mode)
            .map(|m| (m.ttft_s * 1e3, model.predict(&m.point) * 1e3))
            .collect();
        series.push(Series {
            name: mode.to_string(),
            color: color(mode),
            points: pts,
            line: false,
            markers: true,
        });
    }
    let ((x0, x1), (y0, y1)) = bounds(&series, 1.2);
    let b = (x0.min(y0), x1.max(y1));
    chart(
        dir,
        "measured-vs-predicted",
        "TTFT: the cost model against every measured cell (lines: equal, +-15%)",
        "measured, ms",
        "predicted, ms",
        b,
        b,
        &series,
        true,
    )?;

    // Projected speed-up against bandwidth.
    for (pair, file) in PAIRS
        .iter()
        .zip(["projected-speedup-7b", "projected-speedup-32b"])
    {
        let pm = projected(model, pair, false, PAPER_TOKENS, shares);
        let oracle = pm.prefill(PAPER_TOKENS);
        let mut series = Vec::new();
        for &mode in &modes {
            if mode == Mode::Oracle {
                continue;
            }
            let bytes = bytes_per_token[&mode] / raw * pair.kv_bytes_per_token * PAPER_TOKENS;
            let pts: Vec<(f64, f64)> = (0..=50)
                .map(|i| {
                    let g = 10.0 * 40f64.powf(i as f64 / 50.0);
                    let t = pm.predict(&Point {
                        mode,
                        cache: Cache::Warm,
                        tokens: PAPER_TOKENS,
                        bits_per_s: Some(g * 1e9),
                        payload_bytes: bytes,
                    });
                    (g, oracle / t)
                })
                .collect();
            series.push(Series {
                name: mode.to_string(),
                color: color(mode),
                points: pts,
                line: true,
                markers: false,
            });
        }
        if pair.name.starts_with("7B") {
            series.push(Series {
                name: "the paper at 200 Gbit/s (raw 2.28x, scd 2.65x, reuse 2.81x, q4 5.60x, droidspeak 1.67x)".into(),
                color: RGBColor(120, 120, 120),
                points: PAPER
                    .iter()
                    .filter(|p| p.0 != Mode::Oracle)
                    .map(|p| (200.0, p.3))
                    .collect(),
                line: false,
                markers: true,
            });
        }
        series.push(Series {
            name: "the oracle".into(),
            color: RGBColor(0, 0, 0),
            points: vec![(10.0, 1.0), (400.0, 1.0)],
            line: true,
            markers: false,
        });
        let (_, y) = bounds(&series, 1.3);
        chart(
            dir,
            file,
            &format!(
                "Projected speed-up over the oracle, {}, one H100, warm, {PAPER_TOKENS} tokens (oracle {:.0} ms)",
                pair.name,
                oracle * 1e3
            ),
            "link, Gbit/s",
            "speed-up against the oracle",
            (10.0, 400.0),
            y,
            &series,
            false,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::short;

    #[test]
    fn axis_labels_keep_three_significant_digits() {
        assert_eq!(short(0.6000000001), "0.6");
        assert_eq!(short(0.12345), "0.123");
        assert_eq!(short(100.0), "100");
        assert_eq!(short(2.5), "2.5");
        assert_eq!(short(1500.0), "1500");
        assert_eq!(short(0.0004), "0.0004");
    }
}
