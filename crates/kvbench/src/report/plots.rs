//! Plots as SVG and PNG (plotters; the same drawing on both backends): TTFT CDF per policy, TTFT
//! vs request rate for sweeps, per-replica load over time, and TTFT over time with scenario
//! events. Per-run plots show the first seed's runs. Text needs a TrueType font (PNG glyphs,
//! and text layout in both): `$KVBENCH_FONT`, else DejaVu Sans or Liberation Sans from the
//! system (Debian `fonts-dejavu-core`).

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::Report;
use crate::results::RunResult;
use crate::stats::{in_flight_series, percentile};
use crate::BenchError;

const W: u32 = 900;
const H: u32 = 520;

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError::Io(format!("plot: {e}"))
}

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    C[i % C.len()]
}

fn safe(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Font files tried for plot text, after `$KVBENCH_FONT`.
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

/// Registers the plots' font once; the error says how to get one.
fn ensure_font() -> Result<(), BenchError> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let env = std::env::var("KVBENCH_FONT").ok();
        let candidates = env.iter().map(String::as_str).chain(FONTS.iter().copied());
        for path in candidates {
            if let Ok(bytes) = std::fs::read(path) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return Ok(());
                }
            }
        }
        Err(
            "no TrueType font for plot text: install Debian's fonts-dejavu-core or set \
             KVBENCH_FONT to a .ttf file"
                .to_string(),
        )
    })
    .clone()
    .map_err(BenchError::Io)
}

/// Draws one plot as `dir/<stem>.svg` and `dir/<stem>.png`; records both paths.
fn emit(
    dir: &Path,
    stem: &str,
    size: (u32, u32),
    out: &mut Vec<String>,
    svg: impl FnOnce(DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), BenchError>,
    png: impl FnOnce(DrawingArea<BitMapBackend<'_>, Shift>) -> Result<(), BenchError>,
) -> Result<(), BenchError> {
    let svg_path = dir.join(format!("{stem}.svg"));
    svg(SVGBackend::new(&svg_path, size).into_drawing_area())?;
    out.push(format!("plots/{stem}.svg"));
    let png_path = dir.join(format!("{stem}.png"));
    png(BitMapBackend::new(&png_path, size).into_drawing_area())?;
    out.push(format!("plots/{stem}.png"));
    Ok(())
}

/// Writes every plot under `dir`; returns their paths relative to `dir`'s parent.
pub fn write_all(r: &Report, dir: &Path) -> Result<Vec<String>, BenchError> {
    ensure_font()?;
    std::fs::create_dir_all(dir).map_err(err)?;
    let mut out = Vec::new();
    let mut keys: Vec<(String, f64)> = Vec::new();
    let first_seed = r.plan.seed_list().first().copied();
    let first: Vec<&RunResult> = r
        .runs
        .iter()
        .filter(|x| Some(x.seed) == first_seed && x.stats.is_some())
        .collect();
    for run in &first {
        if !keys.iter().any(|k| k.0 == run.workload && k.1 == run.rate) {
            keys.push((run.workload.clone(), run.rate));
        }
    }
    let labels: Vec<String> = r
        .plan
        .policies
        .iter()
        .map(|p| p.label().to_string())
        .collect();
    let color_of = |label: &str| color(labels.iter().position(|l| l == label).unwrap_or(9));
    for (w, rate) in &keys {
        let runs: Vec<&RunResult> = first
            .iter()
            .copied()
            .filter(|x| &x.workload == w && x.rate == *rate)
            .collect();
        let title = format!("TTFT CDF: {w} at {rate} req/s");
        emit(
            dir,
            &format!("ttft-cdf-{}-{rate}", safe(w)),
            (W, H),
            &mut out,
            |a| ttft_cdf(a, &title, &runs, &color_of),
            |a| ttft_cdf(a, &title, &runs, &color_of),
        )?;
        let title = format!("Requests in flight per replica: {w} at {rate} req/s");
        let size = (W, 60 + 260 * runs.len().max(1).div_ceil(2) as u32);
        emit(
            dir,
            &format!("load-{}-{rate}", safe(w)),
            size,
            &mut out,
            |a| load_over_time(a, &title, &runs),
            |a| load_over_time(a, &title, &runs),
        )?;
        if runs.iter().any(|x| !x.events.is_empty()) || *w == r.plan.analysis.shared_prefix {
            let title = format!("TTFT over time: {w} at {rate} req/s");
            emit(
                dir,
                &format!("timeline-{}-{rate}", safe(w)),
                size,
                &mut out,
                |a| timeline(a, &title, &runs),
                |a| timeline(a, &title, &runs),
            )?;
        }
    }
    let mut sweeps: Vec<&str> = Vec::new();
    for (w, _) in &keys {
        if keys.iter().filter(|k| &k.0 == w).count() > 1 && !sweeps.contains(&w.as_str()) {
            sweeps.push(w);
        }
    }
    for w in sweeps {
        emit(
            dir,
            &format!("ttft-vs-rate-{}", safe(w)),
            (W, H),
            &mut out,
            |a| ttft_vs_rate(a, w, r, &labels),
            |a| ttft_vs_rate(a, w, r, &labels),
        )?;
    }
    Ok(out)
}

fn ttft_cdf<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    runs: &[&RunResult],
    color_of: &dyn Fn(&str) -> RGBColor,
) -> Result<(), BenchError>
where
    DB::ErrorType: 'static,
{
    let series: Vec<(String, Vec<f64>)> = runs
        .iter()
        .map(|r| {
            let mut v: Vec<f64> = r
                .records
                .iter()
                .filter(|x| x.ok())
                .filter_map(|x| x.ttft_ms())
                .collect();
            v.sort_by(f64::total_cmp);
            (r.label.clone(), v)
        })
        .collect();
    let max = series
        .iter()
        .flat_map(|s| s.1.last())
        .copied()
        .fold(1.0, f64::max);
    let min = series
        .iter()
        .flat_map(|s| s.1.first())
        .copied()
        .fold(max, f64::min)
        .max(0.1);
    root.fill(&WHITE).map_err(err)?;
    // Log scale only when TTFTs span more than a decade (plotters labels short log ranges
    // poorly).
    if max / min > 20.0 {
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d((min * 0.9..max * 1.1).log_scale(), 0.0..1.0)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("TTFT, simulated ms (log)")
            .y_desc("fraction of requests")
            .x_labels(8)
            .x_label_formatter(&|v| format!("{v:.0}"))
            .draw()
            .map_err(err)?;
        cdf_lines(&mut chart, &series, color_of)?;
    } else {
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..max * 1.05, 0.0..1.0)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("TTFT, simulated ms")
            .y_desc("fraction of requests")
            .draw()
            .map_err(err)?;
        cdf_lines(&mut chart, &series, color_of)?;
    }
    root.present().map_err(err)
}

fn cdf_lines<'a, DB: DrawingBackend + 'a, X>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, plotters::coord::types::RangedCoordf64>>,
    series: &[(String, Vec<f64>)],
    color_of: &dyn Fn(&str) -> RGBColor,
) -> Result<(), BenchError>
where
    X: Ranged<ValueType = f64>,
    DB::ErrorType: 'static,
{
    for (label, v) in series {
        let n = v.len().max(1) as f64;
        let c = color_of(label);
        chart
            .draw_series(LineSeries::new(
                v.iter().enumerate().map(|(i, t)| (*t, (i + 1) as f64 / n)),
                c.stroke_width(2),
            ))
            .map_err(err)?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

fn ttft_vs_rate<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    workload: &str,
    r: &Report,
    labels: &[String],
) -> Result<(), BenchError>
where
    DB::ErrorType: 'static,
{
    let first_seed = r.plan.seed_list().first().copied();
    // (label, colour index, [(rate, p50, p90)])
    type Line = (String, usize, Vec<(f64, f64, f64)>);
    let mut lines: Vec<Line> = Vec::new();
    for (i, label) in labels.iter().enumerate() {
        let mut pts: Vec<(f64, f64, f64)> = r
            .runs
            .iter()
            .filter(|x| x.workload == workload && &x.label == label && Some(x.seed) == first_seed)
            .filter_map(|x| {
                let s = x.stats.as_ref()?;
                Some((x.rate, s.ttft_ms.p50?, s.ttft_ms.p90?))
            })
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        if !pts.is_empty() {
            lines.push((label.clone(), i, pts));
        }
    }
    let xs = lines.iter().flat_map(|l| l.2.iter().map(|p| p.0));
    let (xmin, xmax) = xs.fold((f64::INFINITY, 0.0f64), |(a, b), x| (a.min(x), b.max(x)));
    let ys: Vec<f64> = lines
        .iter()
        .flat_map(|l| l.2.iter().flat_map(|p| [p.1, p.2]))
        .collect();
    let ymax = ys.iter().copied().fold(1.0, f64::max);
    let ymin = ys.iter().copied().fold(ymax, f64::min).max(0.1);
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("TTFT vs request rate: {workload} (solid p90, dashed p50)"),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(
            xmin * 0.9..xmax * 1.05,
            (ymin * 0.8..ymax * 1.25).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("request rate, per simulated second")
        .y_desc("TTFT, simulated ms (log)")
        .y_labels(8)
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(err)?;
    for (label, i, pts) in &lines {
        let c = color(*i);
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|p| (p.0, p.2)),
                c.stroke_width(2),
            ))
            .map_err(err)?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|p| Circle::new((p.0, p.2), 3, c.filled())))
            .map_err(err)?;
        chart
            .draw_series(DashedLineSeries::new(
                pts.iter().map(|p| (p.0, p.1)),
                6,
                4,
                c.stroke_width(1),
            ))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// One panel per policy, one line per replica.
fn load_over_time<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    runs: &[&RunResult],
) -> Result<(), BenchError>
where
    DB::ErrorType: 'static,
{
    let panels = runs.len().max(1);
    let cols = panels.min(2);
    let rows = panels.div_ceil(cols);
    root.fill(&WHITE).map_err(err)?;
    let (top, body) = root.split_vertically(40);
    top.titled(title, ("sans-serif", 20)).map_err(err)?;
    let areas = body.split_evenly((rows, cols));
    let tmax = runs
        .iter()
        .flat_map(|r| r.records.iter().map(|x| x.end_ms / 1000.0))
        .fold(1.0, f64::max);
    for (run, area) in runs.iter().zip(areas) {
        let mut names: Vec<String> = run
            .records
            .iter()
            .filter_map(|x| x.replica.clone())
            .collect();
        names.sort_by_key(|n| (n.len(), n.clone()));
        names.dedup();
        let series = in_flight_series(&run.records, &names, 300);
        let ymax = series
            .iter()
            .flat_map(|s| s.1.iter().copied())
            .max()
            .unwrap_or(1)
            .max(1) as f64;
        let mut chart = ChartBuilder::on(&area)
            .caption(&run.label, ("sans-serif", 15))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(40)
            .build_cartesian_2d(0.0..tmax, 0.0..ymax * 1.1)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("simulated s")
            .y_desc("in flight")
            .y_label_formatter(&|v| format!("{v:.0}"))
            .draw()
            .map_err(err)?;
        for (i, name) in names.iter().enumerate() {
            let c = color(i);
            chart
                .draw_series(LineSeries::new(
                    series.iter().map(|(t, v)| (t / 1000.0, v[i] as f64)),
                    c.stroke_width(1),
                ))
                .map_err(err)?
                .label(name.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 15, y)], c.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .label_font(("sans-serif", 11))
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)
}

/// One panel per policy: TTFT of each request by send time (failures at the bottom, red), with
/// the scenario events as vertical lines.
fn timeline<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    runs: &[&RunResult],
) -> Result<(), BenchError>
where
    DB::ErrorType: 'static,
{
    let panels = runs.len().max(1);
    let cols = panels.min(2);
    let rows = panels.div_ceil(cols);
    root.fill(&WHITE).map_err(err)?;
    let (top, body) = root.split_vertically(40);
    top.titled(title, ("sans-serif", 20)).map_err(err)?;
    let areas = body.split_evenly((rows, cols));
    let tmax = runs
        .iter()
        .flat_map(|r| r.records.iter().map(|x| x.sent_ms / 1000.0))
        .fold(1.0, f64::max);
    for (run, area) in runs.iter().zip(areas) {
        let ttfts: Vec<f64> = run.records.iter().filter_map(|x| x.ttft_ms()).collect();
        let ymax = percentile(&ttfts, 1.0).unwrap_or(10.0).max(10.0);
        let ymin = percentile(&ttfts, 0.0).unwrap_or(1.0).max(0.5);
        let mut chart = ChartBuilder::on(&area)
            .caption(&run.label, ("sans-serif", 15))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..tmax * 1.02, (ymin * 0.5..ymax * 1.5).log_scale())
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("sent at, simulated s")
            .y_desc("TTFT ms (log)")
            .y_labels(6)
            .y_label_formatter(&|v| format!("{v:.0}"))
            .draw()
            .map_err(err)?;
        chart
            .draw_series(run.records.iter().filter(|x| x.ok()).filter_map(|x| {
                Some(Circle::new(
                    (x.sent_ms / 1000.0, x.ttft_ms()?),
                    2,
                    color(0).filled(),
                ))
            }))
            .map_err(err)?;
        chart
            .draw_series(
                run.records
                    .iter()
                    .filter(|x| !x.ok())
                    .map(|x| Cross::new((x.sent_ms / 1000.0, ymin * 0.6), 4, RED.stroke_width(2))),
            )
            .map_err(err)?;
        for e in &run.events {
            let t = e.at_ms / 1000.0;
            chart
                .draw_series(LineSeries::new(
                    [(t, ymin * 0.5), (t, ymax * 1.5)],
                    BLACK.mix(0.6).stroke_width(1),
                ))
                .map_err(err)?;
            chart
                .draw_series([Text::new(
                    format!("{:?} {}", e.action, e.replica).to_lowercase(),
                    (t, ymax * 1.2),
                    ("sans-serif", 11),
                )])
                .map_err(err)?;
        }
    }
    root.present().map_err(err)
}
