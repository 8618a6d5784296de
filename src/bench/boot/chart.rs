//! `bench boot --chart FILE.svg`: a stacked timeline of the boot, one
//! horizontal bar per backend, each segment the median of one phase of
//! [`Phase::TIMELINE`] (when a VM stayed on its initramfs, "agent →
//! hello" stands for the two userland segments), then the first spawn.
//!
//! Drawn with `plotters`' SVG backend only (text as SVG `<text>`, no font
//! files needed). Limits: medians of phases do not add up exactly to the
//! median total; the total's median is written at the end of each bar.

use std::path::Path;

use plotters::prelude::*;

use super::phases::{stat, Phase};
use super::report::Report;

/// Width and height of the picture in pixels (height grows per backend).
const WIDTH: u32 = 1000;
/// Height of the picture's fixed parts (title, axis, legend) in pixels.
const BASE_HEIGHT: u32 = 410;
/// Room above the bars for the legend, in bar heights.
const LEGEND_ROOM: f64 = 1.6;
/// Room right of the longest bar for its total, as a share of its length.
const TOTAL_ROOM: f64 = 0.3;
/// Height added per backend bar in pixels.
const BAR_HEIGHT: u32 = 70;
/// One colour per stacked segment, in [`segments`] order.
const COLOURS: [RGBColor; 8] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0x9c, 0x75, 0x5f),
];

/// Errors of drawing the chart.
#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    #[error("nothing to draw: no backend measured a boot")]
    Empty,
    #[error("cannot draw {path}: {message}")]
    Draw { path: String, message: String },
}

/// The stacked segments in order, with the agent → hello fallback.
fn segments() -> Vec<Phase> {
    let mut s = Phase::TIMELINE.to_vec();
    s.push(Phase::FirstSpawnToExit);
    s
}

/// One backend's bar.
struct Bar {
    /// The backend's name and accelerator.
    name: String,
    /// The phase shown in each slot of [`segments`] and its median (ms;
    /// absent phases as 0 width).
    parts: Vec<(Phase, f64)>,
    /// The median of startVM → connected.
    total: Option<f64>,
}

/// One bar per backend that measured a boot.
fn bars(report: &Report) -> Vec<Bar> {
    report
        .backends
        .iter()
        .filter(|b| !b.runs.is_empty())
        .map(|b| {
            let med = |p: Phase| stat(&b.runs, p).map(|s| s.median_ms);
            let switched = med(Phase::AgentToUserland).is_some();
            let mut segs = Vec::new();
            for p in segments() {
                let v = match p {
                    Phase::AgentToUserland if !switched => med(Phase::AgentToHello),
                    Phase::UserlandToHello if !switched => None,
                    _ => med(p),
                };
                let shown = if p == Phase::AgentToUserland && !switched {
                    Phase::AgentToHello
                } else {
                    p
                };
                segs.push((shown, v.unwrap_or(0.0).max(0.0)));
            }
            let name = match &b.accel {
                Some(a) => format!("{} ({a})", b.backend.as_str()),
                None => b.backend.as_str().to_string(),
            };
            Bar {
                name,
                parts: segs,
                total: med(Phase::StartVmToConnected),
            }
        })
        .collect()
}

/// Writes the chart of `report` to `path` as SVG.
pub fn write_svg(report: &Report, path: &Path) -> Result<(), ChartError> {
    let bars = bars(report);
    if bars.is_empty() {
        return Err(ChartError::Empty);
    }
    let fail = |e: &dyn std::fmt::Display| ChartError::Draw {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    let longest = bars
        .iter()
        .map(|b| b.parts.iter().map(|s| s.1).sum::<f64>())
        .fold(0.0f64, f64::max)
        .max(1.0);
    let n = bars.len();
    let height = BASE_HEIGHT + BAR_HEIGHT * n as u32;
    let root = SVGBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let title = format!(
        "startVM → connected → first spawn, median of {} run(s), userland {}",
        report.runs_requested, report.userland
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(10)
        .build_cartesian_2d(
            0.0..longest * (1.0 + TOTAL_ROOM),
            0.0..n as f64 + LEGEND_ROOM,
        )
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .light_line_style(WHITE)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .x_desc("milliseconds since startVM")
        .draw()
        .map_err(|e| fail(&e))?;
    // Each bar's name above its left end.
    let names: Vec<_> = bars
        .iter()
        .enumerate()
        .map(|(k, bar)| {
            let y = (n - 1 - k) as f64 + 0.95;
            Text::new(bar.name.clone(), (0.0, y), ("sans-serif", 14))
        })
        .collect();
    chart.draw_series(names).map_err(|e| fail(&e))?;
    let segs = segments();
    for (si, seg) in segs.iter().enumerate() {
        let colour = COLOURS[si % COLOURS.len()];
        let rects: Vec<Rectangle<(f64, f64)>> = bars
            .iter()
            .enumerate()
            .filter_map(|(k, bar)| {
                let start: f64 = bar.parts[..si].iter().map(|p| p.1).sum();
                let w = bar.parts[si].1;
                let y = (n - 1 - k) as f64;
                (w > 0.0).then(|| {
                    Rectangle::new([(start, y + 0.2), (start + w, y + 0.8)], colour.filled())
                })
            })
            .collect();
        // The legend names what each bar shows in this slot.
        let label = match bars.iter().map(|b| b.parts[si].0).find(|p| p != seg) {
            None => seg.label().to_string(),
            Some(other) if bars.iter().all(|b| b.parts[si].0 == other) => other.label().to_string(),
            Some(other) => format!("{} (initramfs: {})", seg.label(), other.label()),
        };
        chart
            .draw_series(rects)
            .map_err(|e| fail(&e))?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled()));
    }
    let totals: Vec<_> = bars
        .iter()
        .enumerate()
        .filter_map(|(k, bar)| {
            let end: f64 = bar.parts.iter().map(|p| p.1).sum();
            let total = bar.total?;
            let y = (n - 1 - k) as f64 + 0.5;
            Some(Text::new(
                format!(" connected {total:.0} ms"),
                (end, y),
                ("sans-serif", 13),
            ))
        })
        .collect();
    chart.draw_series(totals).map_err(|e| fail(&e))?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::phases::{Backend, Phases};
    use super::super::report::BackendRuns;
    use super::*;

    #[test]
    fn writes_an_svg_with_one_bar_per_backend() {
        let mut p = Phases::default();
        for (i, ph) in Phase::TIMELINE.iter().enumerate() {
            p.set(*ph, Some(100.0 * (i + 1) as f64));
        }
        p.set(Phase::StartVmToConnected, Some(2100.0));
        p.set(Phase::FirstSpawnToExit, Some(20.0));
        let mut initramfs = p.clone();
        initramfs.set(Phase::AgentToUserland, None);
        initramfs.set(Phase::UserlandToHello, None);
        initramfs.set(Phase::AgentToHello, Some(700.0));
        let report = Report {
            runs_requested: 1,
            warmup: 0,
            userland: "default".into(),
            memory_gb: 1.0,
            cpus: 2,
            host_kernel: "test".into(),
            backends: vec![
                BackendRuns {
                    backend: Backend::Kvm,
                    accel: Some("kvm".into()),
                    runs: vec![p],
                    failures: vec![],
                },
                BackendRuns {
                    backend: Backend::Qemu,
                    accel: Some("tcg".into()),
                    runs: vec![initramfs],
                    failures: vec![],
                },
            ],
        };
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("boot.svg");
        write_svg(&report, &out).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
        assert!(svg.trim_end().ends_with("</svg>"));
        for text in [
            "kvm (kvm)",
            "qemu (tcg)",
            "connected 2100 ms",
            "kernel → agent start",
            "agent → hello",
        ] {
            assert!(svg.contains(text), "{text} missing");
        }
        let empty = Report {
            backends: vec![],
            ..report
        };
        assert!(matches!(write_svg(&empty, &out), Err(ChartError::Empty)));
    }
}
