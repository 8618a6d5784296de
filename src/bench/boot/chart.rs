//! `bench boot --chart FILE.svg`: a stacked timeline of the boot, one
//! horizontal bar per series (backend and start kind), each segment the
//! median of one phase of the series' timeline ([`Phase::COLD_TIMELINE`],
//! [`Phase::KVM_WARM_TIMELINE`] or [`Phase::QEMU_WARM_TIMELINE`]), then the
//! first spawn. Where a bar lacks
//! the first phase of a pair of `FALLBACKS` (a VM that stayed on its
//! initramfs, a warm start without the agent's redial mark), the pair's
//! sum stands in its place.
//!
//! Drawn with `plotters`' SVG backend only (text as SVG `<text>`, no font
//! files needed). The legend lists only the segments some bar has; the
//! picture grows with the bars and the legend. Limits: medians of phases
//! do not add up exactly to the median total; the total's median is
//! written at the end of each bar.

use std::path::Path;

use plotters::prelude::*;

use super::phases::{stat, Phase};
use super::report::Report;

/// Width of the picture in pixels.
const WIDTH: u32 = 1000;
/// Height of the picture's fixed parts (title, margins, axis) in pixels.
const CHROME_HEIGHT: u32 = 120;
/// Height of one bar's row in pixels (the plot's vertical unit).
const BAR_HEIGHT: u32 = 70;
/// Height of one legend entry in pixels.
const LEGEND_ENTRY_HEIGHT: u32 = 20;
/// The legend box's padding and the gap below it, in pixels.
const LEGEND_PADDING: u32 = 30;
/// Room right of the longest bar for its total, as a share of its length.
const TOTAL_ROOM: f64 = 0.3;
/// One colour per stacked segment, in [`segments`] order (Tableau 20 and
/// two more: enough for every cold and warm segment and the first spawn).
const COLOURS: [RGBColor; 22] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0xff, 0x9d, 0xa7),
    RGBColor(0x9c, 0x75, 0x5f),
    RGBColor(0xba, 0xb0, 0xac),
    RGBColor(0xa0, 0xcb, 0xe8),
    RGBColor(0xff, 0xbe, 0x7d),
    RGBColor(0x8c, 0xd1, 0x7d),
    RGBColor(0xb6, 0x99, 0x2d),
    RGBColor(0x49, 0x98, 0x94),
    RGBColor(0x86, 0xbc, 0xb6),
    RGBColor(0xd3, 0x72, 0x95),
    RGBColor(0xfa, 0xbf, 0xd2),
    RGBColor(0xd4, 0xa6, 0xc8),
    RGBColor(0x79, 0x70, 0x6e),
    RGBColor(0x2f, 0x4b, 0x7c),
    RGBColor(0xa0, 0x51, 0x95),
];

/// (first, second, sum): a bar without `first` shows `sum` in its slot
/// and nothing in `second`'s.
const FALLBACKS: [(Phase, Phase, Phase); 2] = [
    (
        Phase::AgentToUserland,
        Phase::UserlandToHello,
        Phase::AgentToHello,
    ),
    (
        Phase::VmRunToRedial,
        Phase::RedialToHelloRead,
        Phase::VmmReadyToHelloRead,
    ),
];

/// Errors of drawing the chart.
#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    #[error("nothing to draw: no backend measured a boot")]
    Empty,
    #[error("cannot draw {path}: {message}")]
    Draw { path: String, message: String },
}

/// The stacked segments in order: a cold boot's, a warm start's (kvm's,
/// with qemu's restore steps where its timeline has them), the first spawn
/// (each bar fills those of its backend and start kind).
fn segments() -> Vec<Phase> {
    let mut s = Phase::COLD_TIMELINE.to_vec();
    s.extend(Phase::KVM_WARM_TIMELINE);
    // Each qemu phase not there yet goes right after its predecessor in
    // the qemu timeline.
    let mut after = Phase::HelperToRestore;
    for p in Phase::QEMU_WARM_TIMELINE {
        if !s.contains(&p) {
            let at = s
                .iter()
                .position(|x| *x == after)
                .map_or(s.len(), |i| i + 1);
            s.insert(at, p);
        }
        after = p;
    }
    s.push(Phase::FirstSpawnToExit);
    s
}

/// One series' bar.
struct Bar {
    /// The series' name and accelerator.
    name: String,
    /// The phase shown in each slot of [`segments`] and its median (ms;
    /// absent phases, and those of the other start kind, as 0 width).
    parts: Vec<(Phase, f64)>,
    /// The median of startVM → connected.
    total: Option<f64>,
}

/// One bar per series that measured a boot.
fn bars(report: &Report) -> Vec<Bar> {
    report
        .backends
        .iter()
        .filter(|b| !b.runs.is_empty())
        .map(|b| {
            let med = |p: Phase| stat(&b.runs, p).map(|s| s.median_ms);
            let own = Phase::timeline(b.backend, b.start);
            let parts = segments()
                .into_iter()
                .map(|p| {
                    let (shown, v) = if p != Phase::FirstSpawnToExit && !own.contains(&p) {
                        (p, None)
                    } else if let Some(&(_, _, sum)) =
                        FALLBACKS.iter().find(|f| f.0 == p && med(f.0).is_none())
                    {
                        (sum, med(sum))
                    } else if FALLBACKS.iter().any(|f| f.1 == p && med(f.0).is_none()) {
                        (p, None)
                    } else {
                        (p, med(p))
                    };
                    (shown, v.unwrap_or(0.0).max(0.0))
                })
                .collect();
            let name = match &b.accel {
                Some(a) => format!("{} ({a})", b.name()),
                None => b.name(),
            };
            Bar {
                name,
                parts,
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
    let segs = segments();
    // The slots some bar fills: one legend entry each.
    let drawn: Vec<usize> = (0..segs.len())
        .filter(|&si| bars.iter().any(|b| b.parts[si].1 > 0.0))
        .collect();
    let legend_height = LEGEND_ENTRY_HEIGHT * drawn.len() as u32 + LEGEND_PADDING;
    let legend_room = f64::from(legend_height) / f64::from(BAR_HEIGHT);
    let height = CHROME_HEIGHT + BAR_HEIGHT * n as u32 + legend_height;
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
            0.0..n as f64 + legend_room,
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
    for si in drawn {
        let seg = segs[si];
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
        // The legend names what the bars show in this slot.
        let shown = |b: &Bar| (b.parts[si].1 > 0.0).then_some(b.parts[si].0);
        let label = match bars.iter().filter_map(shown).find(|p| *p != seg) {
            None => seg.label().to_string(),
            Some(other) if bars.iter().filter_map(shown).all(|p| p == other) => {
                other.label().to_string()
            }
            Some(other) => format!("{} (or {})", seg.label(), other.label()),
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
    use super::super::phases::{Backend, Phases, StartKind};
    use super::super::report::BackendRuns;
    use super::*;

    fn series(backend: Backend, start: StartKind, accel: &str, run: Phases) -> BackendRuns {
        BackendRuns {
            accel: Some(accel.into()),
            runs: vec![run],
            ..BackendRuns::new(backend, start)
        }
    }

    #[test]
    fn writes_an_svg_with_one_bar_per_series() {
        let mut p = Phases::default();
        for (i, ph) in Phase::COLD_TIMELINE.iter().enumerate() {
            p.set(*ph, Some(100.0 * (i + 1) as f64));
        }
        p.set(Phase::StartVmToConnected, Some(2100.0));
        p.set(Phase::FirstSpawnToExit, Some(20.0));
        let mut initramfs = p.clone();
        initramfs.set(Phase::AgentToUserland, None);
        initramfs.set(Phase::UserlandToHello, None);
        initramfs.set(Phase::AgentToHello, Some(700.0));
        let mut warm = Phases::default();
        for (i, ph) in Phase::KVM_WARM_TIMELINE.iter().enumerate() {
            warm.set(*ph, Some(10.0 * (i + 1) as f64));
        }
        // Phases of a cold boot in a warm series' runs are not drawn.
        warm.set(Phase::KernelToAgent, Some(5000.0));
        warm.set(Phase::StartVmToConnected, Some(660.0));
        warm.set(Phase::FirstSpawnToExit, Some(8.0));
        let mut qemu_warm = Phases::default();
        for (i, ph) in Phase::QEMU_WARM_TIMELINE.iter().enumerate() {
            qemu_warm.set(*ph, Some(20.0 * (i + 1) as f64));
        }
        // Nor kvm's restore phases in a qemu bar.
        qemu_warm.set(Phase::RestoreMemory, Some(3000.0));
        qemu_warm.set(Phase::StartVmToConnected, Some(720.0));
        qemu_warm.set(Phase::FirstSpawnToExit, Some(9.0));
        let report = Report {
            runs_requested: 1,
            warmup: 0,
            userland: "default".into(),
            memory_gb: 1.0,
            cpus: 2,
            host_kernel: "test".into(),
            notes: vec![],
            backends: vec![
                series(Backend::Kvm, StartKind::Cold, "kvm", p),
                series(Backend::Kvm, StartKind::Warm, "kvm", warm.clone()),
                series(Backend::Qemu, StartKind::Cold, "tcg", initramfs),
                series(Backend::Qemu, StartKind::Warm, "tcg", qemu_warm),
            ],
        };
        let b = bars(&report);
        let width = |bar: &Bar| bar.parts.iter().map(|p| p.1).sum::<f64>();
        assert_eq!(width(&b[0]), 2100.0 + 20.0);
        assert_eq!(width(&b[1]), 660.0 + 8.0);
        assert_eq!(width(&b[3]), 720.0 + 9.0);
        // Every timeline is in the segments in its order, each slot has
        // its colour.
        let segs = segments();
        assert_eq!(segs.len(), COLOURS.len());
        for tl in [
            &Phase::COLD_TIMELINE[..],
            &Phase::KVM_WARM_TIMELINE[..],
            &Phase::QEMU_WARM_TIMELINE[..],
        ] {
            let at: Vec<usize> = tl
                .iter()
                .map(|p| segs.iter().position(|s| s == p).unwrap())
                .collect();
            assert!(at.windows(2).all(|w| w[0] < w[1]), "{tl:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("boot.svg");
        write_svg(&report, &out).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
        assert!(svg.trim_end().ends_with("</svg>"));
        for text in [
            "kvm cold (kvm)",
            "kvm warm (kvm)",
            "qemu cold (tcg)",
            "connected 2100 ms",
            "connected 660 ms",
            "kernel → agent start",
            "agent → hello",
            "restore: guest memory",
            "redial → final hello",
            "qemu warm (tcg)",
            "connected 720 ms",
            "restore: RAM copied into memfd",
            "restore: hot-plug + cont",
        ] {
            assert!(svg.contains(text), "{text} missing");
        }

        // A warm start without the agent's redial mark: the guest side
        // whole in its slot.
        warm.set(Phase::VmRunToRedial, None);
        warm.set(Phase::RedialToHelloRead, None);
        warm.set(Phase::VmmReadyToHelloRead, Some(190.0));
        let only_warm = Report {
            backends: vec![series(Backend::Kvm, StartKind::Warm, "kvm", warm)],
            ..report.clone()
        };
        let b = bars(&only_warm);
        let slot = segments()
            .iter()
            .position(|p| *p == Phase::VmRunToRedial)
            .unwrap();
        assert_eq!(b[0].parts[slot], (Phase::VmmReadyToHelloRead, 190.0));
        assert_eq!(b[0].parts[slot + 1].1, 0.0);
        write_svg(&only_warm, &out).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        assert!(svg.contains("VMM ready → final hello read"));
        assert!(!svg.contains("kernel → agent start"), "no cold slot drawn");

        let empty = Report {
            backends: vec![],
            ..report
        };
        assert!(matches!(write_svg(&empty, &out), Err(ChartError::Empty)));
    }
}
