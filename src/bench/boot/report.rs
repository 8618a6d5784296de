//! What `bench boot` prints: the JSON document (`--json`) and the table,
//! both built from the runs' [`Phases`] by [`Report`], and the document read
//! back for `--replay` ([`Report::from_json`]).
//!
//! The runs are grouped in series, one per backend and start kind ("kvm
//! cold", "kvm warm", "qemu cold", "qemu warm"). JSON shape ([`SCHEMA`]):
//! ```text
//! { "schema": "...", "runs": N, "warmup": W, "userland": "default",
//!   "memory_gb": 1.0, "cpus": 2,
//!   "host": { "cpus": 2, "kernel": "6.1.0-..." },
//!   "notes": ["..."],
//!   "backends": [ { "backend": "kvm" | "qemu", "start": "cold" | "warm",
//!                   "accel": "kvm" | "tcg" | null,
//!                   "failures": ["..."],
//!                   "snapshot": { "snapshot_ms", "stopped_ms", "memory_data_mib",
//!                                 "memory_disk_mib", "state_bytes" } | null,
//!                   "rss_process": "helper" | "qemu",
//!                   "rss_after_connected": [ { "anon_kib", "file_kib" } ],
//!                   "runs": [ { "start": "cold" | "warm", "<phase>": ms | null, ... } ],
//!                   "summary": { "<phase>": {"median_ms", "p90_ms", "n"} | null } } ],
//!   "ratios": { "<phase>": kvm cold median / qemu cold median | null } | null,
//!   "warm_cold_ratios": { "kvm" | "qemu": { "<phase>": warm median / cold median | null } } | null }
//! ```
//! Every phase key of [`Phase::ALL`] is always present; a phase a series
//! cannot measure (a cold boot's restore, a warm start's kernel phases) or
//! did not measure is `null`, never a made-up number (a warm series has
//! its own backend's restore phases only). `ratios` is `null` unless both
//! backends ran cold, `warm_cold_ratios` unless a backend ran both kinds;
//! `snapshot` is the boot snapshot a warm series' first, unmeasured boot
//! took (its fields as the backend logs them, the others `null`);
//! `rss_after_connected` is, per run, the resident memory once startVM
//! answered of the process holding the guest's memory (`rss_process`: the
//! kvm helper, or QEMU, whose guest RAM is a shared memfd, counted as
//! file-backed). `notes` are for what was asked and not measured (none
//! now; older documents have them).
//!
//! Limits: `--replay` reads back the runs' phases, the settings, the notes,
//! the snapshots and the failures, and recomputes summaries and ratios; a
//! [`SCHEMA_V1`] document (before start kinds) has cold series only, and a
//! field a document lacks takes its default.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::log::SnapshotTaken;
use super::phases::{stat, Backend, Phase, Phases, Rss, StartKind, Stat};

/// The `schema` value of the JSON document.
pub const SCHEMA: &str = "cowork-helper bench boot v2";
/// The schema before start kinds: one cold series per backend (still
/// replayed).
pub const SCHEMA_V1: &str = "cowork-helper bench boot v1";
/// Bytes per KiB, for the table's footer.
const KIB: f64 = 1024.0;

/// Errors of reading a document back (`--replay`).
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("not a {SCHEMA:?} (or {SCHEMA_V1:?}) document: its schema is {0}")]
    Schema(Value),
    #[error("the document does not have the shape `bench boot --json` writes: {0}")]
    Shape(serde_json::Error),
}

/// The runs of one backend and start kind (a series).
#[derive(Clone, Debug, PartialEq)]
pub struct BackendRuns {
    pub backend: Backend,
    /// How its VMs started.
    pub start: StartKind,
    /// QEMU's accelerator, or `kvm` for our VMM; `None` before any run.
    pub accel: Option<String>,
    pub runs: Vec<Phases>,
    /// One line per run that failed (not in `runs`).
    pub failures: Vec<String>,
    /// Warm: the boot snapshot the series' first, unmeasured boot took.
    pub snapshot: Option<SnapshotTaken>,
    /// The resident memory once each run's startVM answered of the helper
    /// (kvm) or of QEMU (qemu), see [`rss_process`].
    pub rss: Vec<Rss>,
}

impl BackendRuns {
    /// An empty series.
    pub fn new(backend: Backend, start: StartKind) -> BackendRuns {
        BackendRuns {
            backend,
            start,
            accel: None,
            runs: Vec::new(),
            failures: Vec::new(),
            snapshot: None,
            rss: Vec::new(),
        }
    }

    /// "kvm warm", "qemu cold".
    pub fn name(&self) -> String {
        format!("{} {}", self.backend.as_str(), self.start.as_str())
    }
}

/// Everything one `bench boot` invocation measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    pub runs_requested: usize,
    /// Unmeasured boots per series before the runs.
    pub warmup: usize,
    pub userland: String,
    pub memory_gb: f64,
    pub cpus: u32,
    pub host_kernel: String,
    /// What was asked and not measured, and why (read back from older
    /// documents; a run now measures all it is asked for).
    pub notes: Vec<String>,
    pub backends: Vec<BackendRuns>,
}

fn stat_json(s: Option<Stat>) -> Value {
    match s {
        Some(s) => json!({"median_ms": round3(s.median_ms), "p90_ms": round3(s.p90_ms), "n": s.n}),
        None => Value::Null,
    }
}

/// Milliseconds to three decimals (a microsecond): the sources have no more.
fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

fn phases_json(p: &Phases, start: StartKind) -> Value {
    let mut m = Map::new();
    m.insert("start".into(), json!(start.as_str()));
    for ph in Phase::ALL {
        m.insert(
            ph.key().into(),
            p.get(ph).map_or(Value::Null, |v| json!(round3(v))),
        );
    }
    Value::Object(m)
}

/// Every phase's ratio, `null` where there is none.
fn ratios_json(ratio: impl Fn(Phase) -> Option<f64>) -> Value {
    let mut m = Map::new();
    for ph in Phase::ALL {
        m.insert(
            ph.key().into(),
            ratio(ph).map_or(Value::Null, |r| json!(round3(r))),
        );
    }
    Value::Object(m)
}

/// The process whose resident memory a backend's series records.
pub fn rss_process(b: Backend) -> &'static str {
    match b {
        Backend::Kvm => "helper",
        Backend::Qemu => "qemu",
    }
}

fn snapshot_json(s: Option<SnapshotTaken>) -> Value {
    match s {
        Some(s) => json!({
            "snapshot_ms": s.snapshot_ms,
            "stopped_ms": s.stopped_ms,
            "memory_data_mib": s.memory_data_mib,
            "memory_disk_mib": s.memory_disk_mib,
            "state_bytes": s.state_bytes,
        }),
        None => Value::Null,
    }
}

/// The document as `--replay` reads it (serde defaults for what older
/// documents lack).
#[derive(Deserialize)]
struct Document {
    #[serde(default)]
    runs: usize,
    #[serde(default)]
    warmup: usize,
    #[serde(default)]
    userland: String,
    #[serde(default)]
    memory_gb: f64,
    #[serde(default)]
    cpus: u32,
    #[serde(default)]
    host: DocumentHost,
    #[serde(default)]
    notes: Vec<String>,
    backends: Vec<DocumentSeries>,
}

#[derive(Default, Deserialize)]
struct DocumentHost {
    #[serde(default)]
    kernel: String,
}

#[derive(Deserialize)]
struct DocumentSeries {
    backend: Backend,
    #[serde(default)]
    start: StartKind,
    #[serde(default)]
    accel: Option<String>,
    #[serde(default)]
    failures: Vec<String>,
    #[serde(default)]
    snapshot: Option<SnapshotTaken>,
    #[serde(default)]
    rss_after_connected: Vec<Rss>,
    /// Each run's phases by key (other keys, such as `start`, are skipped).
    runs: Vec<BTreeMap<String, Value>>,
}

impl Report {
    /// The series of this backend and start kind, when it ran.
    pub fn runs_of(&self, b: Backend, start: StartKind) -> Option<&BackendRuns> {
        self.backends
            .iter()
            .find(|r| r.backend == b && r.start == start)
    }

    /// `a`'s median of `phase` over `b`'s, when both measured it.
    fn median_ratio(a: Option<&BackendRuns>, b: Option<&BackendRuns>, phase: Phase) -> Option<f64> {
        let a = stat(&a?.runs, phase)?.median_ms;
        let b = stat(&b?.runs, phase)?.median_ms;
        (b > 0.0).then(|| a / b)
    }

    /// Whether both backends ran cold (the kvm/qemu ratios).
    fn both_cold(&self) -> bool {
        self.runs_of(Backend::Kvm, StartKind::Cold).is_some()
            && self.runs_of(Backend::Qemu, StartKind::Cold).is_some()
    }

    /// kvm cold median / qemu cold median of `phase`, when both measured it.
    pub fn ratio(&self, phase: Phase) -> Option<f64> {
        Report::median_ratio(
            self.runs_of(Backend::Kvm, StartKind::Cold),
            self.runs_of(Backend::Qemu, StartKind::Cold),
            phase,
        )
    }

    /// The backends that ran both cold and warm, in series order.
    pub fn warm_and_cold(&self) -> Vec<Backend> {
        let mut out: Vec<Backend> = Vec::new();
        for s in &self.backends {
            let b = s.backend;
            if !out.contains(&b)
                && self.runs_of(b, StartKind::Cold).is_some()
                && self.runs_of(b, StartKind::Warm).is_some()
            {
                out.push(b);
            }
        }
        out
    }

    /// `backend`'s warm median / cold median of `phase`, when both
    /// measured it.
    pub fn warm_cold_ratio(&self, backend: Backend, phase: Phase) -> Option<f64> {
        Report::median_ratio(
            self.runs_of(backend, StartKind::Warm),
            self.runs_of(backend, StartKind::Cold),
            phase,
        )
    }

    /// The JSON document (see the module documentation).
    pub fn to_json(&self) -> Value {
        let backends: Vec<Value> = self
            .backends
            .iter()
            .map(|b| {
                let mut summary = Map::new();
                for ph in Phase::ALL {
                    summary.insert(ph.key().into(), stat_json(stat(&b.runs, ph)));
                }
                json!({
                    "backend": b.backend.as_str(),
                    "start": b.start.as_str(),
                    "accel": b.accel,
                    "failures": b.failures,
                    "snapshot": snapshot_json(b.snapshot),
                    "rss_process": rss_process(b.backend),
                    "rss_after_connected": b.rss,
                    "runs": b.runs.iter().map(|r| phases_json(r, b.start)).collect::<Vec<_>>(),
                    "summary": summary,
                })
            })
            .collect();
        let ratios = if self.both_cold() {
            ratios_json(|ph| self.ratio(ph))
        } else {
            Value::Null
        };
        let warm = self.warm_and_cold();
        let warm_cold = if warm.is_empty() {
            Value::Null
        } else {
            let mut m = Map::new();
            for b in warm {
                m.insert(
                    b.as_str().into(),
                    ratios_json(|ph| self.warm_cold_ratio(b, ph)),
                );
            }
            Value::Object(m)
        };
        json!({
            "schema": SCHEMA,
            "runs": self.runs_requested,
            "warmup": self.warmup,
            "userland": self.userland,
            "memory_gb": self.memory_gb,
            "cpus": self.cpus,
            "host": {
                "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
                "kernel": self.host_kernel,
            },
            "notes": self.notes,
            "backends": backends,
            "ratios": ratios,
            "warm_cold_ratios": warm_cold,
        })
    }

    /// A report read back from [`Report::to_json`]'s document, or one of
    /// [`SCHEMA_V1`] (see the module documentation).
    pub fn from_json(v: &Value) -> Result<Report, ReplayError> {
        let schema = &v["schema"];
        if schema != SCHEMA && schema != SCHEMA_V1 {
            return Err(ReplayError::Schema(schema.clone()));
        }
        let doc = Document::deserialize(v).map_err(ReplayError::Shape)?;
        let backends = doc
            .backends
            .into_iter()
            .map(|b| BackendRuns {
                backend: b.backend,
                start: b.start,
                accel: b.accel,
                runs: b
                    .runs
                    .iter()
                    .map(|r| {
                        let mut p = Phases::default();
                        for ph in Phase::ALL {
                            p.set(ph, r.get(ph.key()).and_then(Value::as_f64));
                        }
                        p
                    })
                    .collect(),
                failures: b.failures,
                snapshot: b.snapshot,
                rss: b.rss_after_connected,
            })
            .collect();
        Ok(Report {
            runs_requested: doc.runs,
            warmup: doc.warmup,
            userland: doc.userland,
            memory_gb: doc.memory_gb,
            cpus: doc.cpus,
            host_kernel: doc.host.kernel,
            notes: doc.notes,
            backends,
        })
    }

    /// The table for people: one row per phase some series measures,
    /// median and p90 per series (`-` where the series' start kind does
    /// not have the phase, `absent` where it has it but did not measure
    /// it), the kvm/qemu ratio when both ran cold and each backend's
    /// warm/cold ratio when it ran both; then one line per series.
    pub fn table(&self) -> String {
        let both = self.both_cold();
        let warm = self.warm_and_cold();
        let mut head = vec!["phase (ms)".to_string()];
        for b in &self.backends {
            let accel = b.accel.as_deref().unwrap_or("?");
            head.push(format!("{} ({accel}) median / p90", b.name()));
        }
        if both {
            head.push("kvm/qemu cold".into());
        }
        for b in &warm {
            head.push(format!("{} warm/cold", b.as_str()));
        }
        let mut rows = vec![head];
        let shown = Phase::ALL.into_iter().filter(|ph| {
            self.backends
                .iter()
                .any(|b| ph.measured_in(b.backend, b.start))
        });
        for ph in shown {
            let mut row = vec![ph.label().to_string()];
            for b in &self.backends {
                row.push(match stat(&b.runs, ph) {
                    Some(s) => format!("{:.1} / {:.1}", s.median_ms, s.p90_ms),
                    None if !ph.measured_in(b.backend, b.start) => "-".into(),
                    None => "absent".into(),
                });
            }
            let show = |r: Option<f64>| r.map_or_else(|| "-".into(), |r| format!("{r:.2}×"));
            if both {
                row.push(show(self.ratio(ph)));
            }
            for b in &warm {
                row.push(show(self.warm_cold_ratio(*b, ph)));
            }
            rows.push(row);
        }
        let cols = rows[0].len();
        let widths: Vec<usize> = (0..cols)
            .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
            .collect();
        let snapshot_boot = if self.backends.iter().any(|b| b.start == StartKind::Warm) {
            " (a warm series has at least one, which takes its boot snapshot)"
        } else {
            ""
        };
        let mut out = format!(
            "cowork-helper bench boot: {} run(s) per series after {} warm-up boot(s){snapshot_boot}, userland {}, {} GiB, {} vCPUs, host kernel {}\n",
            self.runs_requested, self.warmup, self.userland, self.memory_gb, self.cpus, self.host_kernel
        );
        for (i, r) in rows.iter().enumerate() {
            let line: Vec<String> = r
                .iter()
                .zip(&widths)
                .map(|(cell, w)| format!("{cell}{}", " ".repeat(w - cell.chars().count())))
                .collect();
            out += line.join("  ").trim_end();
            out.push('\n');
            if i == 0 {
                out += &"-".repeat(widths.iter().sum::<usize>() + 2 * (cols - 1));
                out.push('\n');
            }
        }
        for b in &self.backends {
            out += &format!(
                "{}: {} run(s) measured, {} failed\n",
                b.name(),
                b.runs.len(),
                b.failures.len()
            );
            if let Some(s) = b.snapshot {
                out += &format!("  {}\n", snapshot_words(&s));
            }
            if let Some(r) = rss_median(&b.rss) {
                let (who, file) = match b.backend {
                    Backend::Kvm => ("helper", "file-backed"),
                    Backend::Qemu => (
                        "QEMU process",
                        "file-backed and shared (the guest's RAM is a memfd)",
                    ),
                };
                out += &format!(
                    "  {who} resident once connected (median of {}): {:.1} MiB anonymous, {:.1} MiB {file}\n",
                    b.rss.len(),
                    r.anon_kib as f64 / KIB,
                    r.file_kib as f64 / KIB
                );
            }
            for f in &b.failures {
                out += &format!("  failed: {f}\n");
            }
        }
        for n in &self.notes {
            out += &format!("note: {n}\n");
        }
        out
    }
}

/// The median of each field of `samples` (`None` without samples).
fn rss_median(samples: &[Rss]) -> Option<Rss> {
    let median = |mut v: Vec<u64>| {
        v.sort_unstable();
        v.get(v.len() / 2).copied()
    };
    Some(Rss {
        anon_kib: median(samples.iter().map(|r| r.anon_kib).collect())?,
        file_kib: median(samples.iter().map(|r| r.file_kib).collect())?,
    })
}

/// One line on a boot snapshot: how long it took and how large it is.
fn snapshot_words(s: &SnapshotTaken) -> String {
    let num = |v: Option<f64>, unit: &str, scale: f64| {
        v.map_or_else(|| "?".into(), |v| format!("{:.1} {unit}", v / scale))
    };
    let took = match (s.snapshot_ms, s.stopped_ms) {
        (None, Some(stopped)) => format!("the machine stopped {stopped:.1} ms"),
        (ms, _) => num(ms, "ms", 1.0),
    };
    let on_disk = match s.memory_disk_mib {
        Some(_) => format!(" ({} on disk)", num(s.memory_disk_mib, "MiB", 1.0)),
        None if s.stopped_ms.is_some() => String::new(),
        None => " (? on disk)".into(),
    };
    format!(
        "snapshot taken by the first warm-up boot: {took}, memory {} with data{on_disk}, state {}",
        num(s.memory_data_mib, "MiB", 1.0),
        num(s.state_bytes, "KiB", KIB),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(values: &[(Phase, f64)], n: usize) -> Vec<Phases> {
        (0..n)
            .map(|i| {
                let mut p = Phases::default();
                for &(ph, v) in values {
                    p.set(ph, Some(v + i as f64));
                }
                p
            })
            .collect()
    }

    fn series(backend: Backend, start: StartKind, accel: &str, runs: Vec<Phases>) -> BackendRuns {
        BackendRuns {
            accel: Some(accel.into()),
            runs,
            ..BackendRuns::new(backend, start)
        }
    }

    fn report(both: bool) -> Report {
        let mut backends = vec![series(
            Backend::Qemu,
            StartKind::Cold,
            "tcg",
            runs(
                &[
                    (Phase::StartVmToConnected, 4000.0),
                    (Phase::KernelToAgent, 900.0),
                ],
                3,
            ),
        )];
        if both {
            let mut kvm = series(
                Backend::Kvm,
                StartKind::Cold,
                "kvm",
                runs(&[(Phase::StartVmToConnected, 1000.0)], 3),
            );
            kvm.failures = vec!["run 4: guest did not connect".into()];
            backends.insert(0, kvm);
        }
        Report {
            runs_requested: 3,
            warmup: 1,
            userland: "default".into(),
            memory_gb: 1.0,
            cpus: 2,
            host_kernel: "6.1.0-test".into(),
            notes: vec![],
            backends,
        }
    }

    /// kvm cold, kvm warm and qemu cold, as `--backend both --start both`
    /// gives them.
    fn warm_report() -> Report {
        let mut r = report(true);
        let mut warm = series(
            Backend::Kvm,
            StartKind::Warm,
            "kvm",
            runs(
                &[
                    (Phase::StartVmToConnected, 250.0),
                    (Phase::HelperToVmmReady, 40.0),
                    (Phase::RestoreMemory, 5.0),
                    (Phase::RestoreTotal, 30.0),
                    (Phase::FirstSpawnToExit, 6.0),
                ],
                3,
            ),
        );
        warm.snapshot = Some(SnapshotTaken {
            snapshot_ms: Some(884.75),
            stopped_ms: None,
            memory_data_mib: Some(301.0),
            memory_disk_mib: Some(305.0),
            state_bytes: Some(48_213.0),
        });
        warm.rss = vec![
            Rss {
                anon_kib: 30 * 1024,
                file_kib: 90 * 1024,
            },
            Rss {
                anon_kib: 20 * 1024,
                file_kib: 80 * 1024,
            },
            Rss {
                anon_kib: 40 * 1024,
                file_kib: 85 * 1024,
            },
        ];
        r.backends.insert(1, warm);
        r.notes = vec!["an older document's note".into()];
        r
    }

    /// [`warm_report`] with a qemu warm series, as `--backend both --start
    /// both` gives them.
    fn both_warm_report() -> Report {
        let mut r = warm_report();
        let mut warm = series(
            Backend::Qemu,
            StartKind::Warm,
            "tcg",
            runs(
                &[
                    (Phase::StartVmToConnected, 800.0),
                    (Phase::HelperToVmmReady, 180.0),
                    (Phase::RestoreRam, 115.0),
                    (Phase::RestoreLoad, 50.0),
                    (Phase::RestoreTotal, 180.0),
                    (Phase::FirstSpawnToExit, 90.0),
                ],
                3,
            ),
        );
        warm.snapshot = Some(SnapshotTaken {
            stopped_ms: Some(159.64),
            memory_data_mib: Some(120.0),
            state_bytes: Some(467_573.0),
            ..SnapshotTaken::default()
        });
        warm.rss = vec![Rss {
            anon_kib: 56 * 1024,
            file_kib: 49 * 1024,
        }];
        r.backends.push(warm);
        r
    }

    #[test]
    fn json_has_every_phase_with_nulls_for_the_absent() {
        let v = report(false).to_json();
        assert_eq!(v["schema"], SCHEMA);
        assert_eq!(v["runs"], 3);
        assert_eq!(v["warmup"], 1);
        assert!(v["ratios"].is_null());
        assert!(v["warm_cold_ratios"].is_null());
        let b = &v["backends"][0];
        assert_eq!(b["backend"], "qemu");
        assert_eq!(b["start"], "cold");
        assert_eq!(b["accel"], "tcg");
        assert!(b["snapshot"].is_null());
        assert_eq!(b["runs"].as_array().unwrap().len(), 3);
        for ph in Phase::ALL {
            assert!(b["runs"][0].get(ph.key()).is_some(), "{}", ph.key());
            assert!(b["summary"].get(ph.key()).is_some(), "{}", ph.key());
        }
        assert_eq!(b["runs"][1]["start"], "cold");
        assert_eq!(b["runs"][1]["startvm_to_connected"], 4001.0);
        assert!(b["runs"][1]["helper_to_vmm_ready"].is_null());
        let s = &b["summary"]["startvm_to_connected"];
        assert_eq!(
            (s["median_ms"].as_f64(), s["n"].as_u64()),
            (Some(4001.0), Some(3))
        );
        assert!((s["p90_ms"].as_f64().unwrap() - 4001.8).abs() < 1e-9);
        assert!(b["summary"]["first_spawn_to_exit"].is_null());
        // Round trip through text: what --json prints parses back, and
        // --replay gets the same report from it.
        let text = serde_json::to_string_pretty(&v).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), v);
        let back = Report::from_json(&v).unwrap();
        assert_eq!(back, report(false));
        assert!(matches!(
            Report::from_json(&json!({"schema": "other"})),
            Err(ReplayError::Schema(_))
        ));
        let e = Report::from_json(
            &json!({"schema": SCHEMA, "backends": [{"backend": "vbox", "runs": []}]}),
        )
        .unwrap_err();
        assert!(matches!(e, ReplayError::Shape(_)), "{e}");
        assert!(e.to_string().contains("vbox"), "{e}");
    }

    #[test]
    fn both_backends_give_ratios_and_the_table_says_what_is_absent() {
        let r = report(true);
        let v = r.to_json();
        assert_eq!(v["ratios"]["startvm_to_connected"], 0.25);
        // Only qemu measured it: no ratio.
        assert!(v["ratios"]["kernel_to_agent"].is_null());
        assert_eq!(
            v["backends"][0]["failures"][0],
            "run 4: guest did not connect"
        );
        let t = r.table();
        assert!(t.contains("kvm cold (kvm) median / p90"), "{t}");
        assert!(t.contains("kvm/qemu cold"), "{t}");
        assert!(t.contains("0.25×"), "{t}");
        assert!(t.contains("absent"), "{t}");
        assert!(t.contains("failed: run 4"), "{t}");
        // Cold series only: no warm row, no warm/cold column.
        assert!(!t.contains("restore"), "{t}");
        assert!(!t.contains("warm/cold"), "{t}");
    }

    #[test]
    fn warm_series_get_their_rows_ratios_and_snapshot() {
        let r = warm_report();
        let v = r.to_json();
        let warm = &v["backends"][1];
        assert_eq!(
            (&warm["backend"], &warm["start"]),
            (&json!("kvm"), &json!("warm"))
        );
        assert_eq!(warm["runs"][0]["start"], "warm");
        assert_eq!(warm["runs"][0]["restore_memory"], 5.0);
        assert_eq!(warm["summary"]["restore_total"]["median_ms"], 31.0);
        assert!(warm["runs"][0]["kernel_to_agent"].is_null());
        assert_eq!(warm["snapshot"]["snapshot_ms"], 884.75);
        assert_eq!(warm["snapshot"]["state_bytes"], 48_213.0);
        assert_eq!(warm["rss_after_connected"][1]["anon_kib"], 20 * 1024);
        assert_eq!(warm["rss_after_connected"][1]["file_kib"], 80 * 1024);
        assert!(v["backends"][0]["rss_after_connected"]
            .as_array()
            .is_some_and(Vec::is_empty));
        // kvm/qemu compares the cold series; warm/cold per backend.
        assert_eq!(v["ratios"]["startvm_to_connected"], 0.25);
        let wc = &v["warm_cold_ratios"]["kvm"];
        // 251 / 1001 (medians).
        assert_eq!(wc["startvm_to_connected"], round3(251.0 / 1001.0));
        assert!(wc["restore_total"].is_null(), "no cold restore: {wc}");
        // No qemu warm series here: no qemu warm/cold ratio.
        assert!(v["warm_cold_ratios"]["qemu"].is_null());
        assert_eq!(v["notes"][0], "an older document's note");
        assert_eq!(warm["rss_process"], "helper");

        let t = r.table();
        for want in [
            "kvm cold (kvm) median / p90",
            "kvm warm (kvm) median / p90",
            "qemu cold (tcg) median / p90",
            "kvm warm/cold",
            "restore: guest memory",
            "restore (total)",
            "0.25×",
            "snapshot taken by the first warm-up boot: 884.8 ms, memory 301.0 MiB with data (305.0 MiB on disk), state 47.1 KiB",
            "note: an older document's note",
            "(a warm series has at least one, which takes its boot snapshot)",
            // Medians of each field: 30 of 20/30/40, 85 of 80/85/90.
            "helper resident once connected (median of 3): 30.0 MiB anonymous, 85.0 MiB file-backed",
        ] {
            assert!(t.contains(want), "{want} missing:\n{t}");
        }
        let row = |label: &str| {
            t.lines()
                .find(|l| l.starts_with(label))
                .unwrap_or_else(|| panic!("no row {label}:\n{t}"))
                .to_string()
        };
        // The warm series has no kernel phase ("-"), the cold ones no
        // restore ("-"); the warm/cold ratio of startVM → connected.
        // Columns: phase, kvm cold, kvm warm, qemu cold, kvm/qemu, kvm warm/cold.
        let kernel = cells(&row("kernel → agent start"));
        assert_eq!(kernel[1..], ["absent", "-", "901.0 / 901.8", "-", "-"]);
        let restore = cells(&row("restore: guest memory"));
        assert_eq!(restore[1..], ["-", "6.0 / 6.8", "-", "-", "-"]);
        let total = cells(&row("startVM → connected"));
        assert_eq!(total[4..], ["0.25×", "0.25×"]);

        // Round trip with the warm series, its snapshot and the notes.
        let back = Report::from_json(&v).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn a_qemu_warm_series_gets_its_restore_rows_ratio_and_snapshot() {
        let r = both_warm_report();
        let v = r.to_json();
        let qw = &v["backends"][3];
        assert_eq!(
            (&qw["backend"], &qw["start"]),
            (&json!("qemu"), &json!("warm"))
        );
        assert_eq!(qw["runs"][0]["restore_ram"], 115.0);
        assert!(qw["runs"][0]["restore_memory"].is_null());
        assert_eq!(qw["snapshot"]["stopped_ms"], 159.64);
        assert!(qw["snapshot"]["snapshot_ms"].is_null());
        assert_eq!(qw["rss_process"], "qemu");
        // qemu's warm/cold ratio beside kvm's: 801 / 4001 (medians).
        let wc = &v["warm_cold_ratios"]["qemu"];
        assert_eq!(wc["startvm_to_connected"], round3(801.0 / 4001.0));
        assert!(v["warm_cold_ratios"]["kvm"]["startvm_to_connected"].is_number());
        // kvm/qemu still compares the cold series.
        assert_eq!(v["ratios"]["startvm_to_connected"], 0.25);

        let t = r.table();
        for want in [
            "qemu warm (tcg) median / p90",
            "kvm warm/cold",
            "qemu warm/cold",
            "restore: RAM copied into memfd",
            "snapshot taken by the first warm-up boot: the machine stopped 159.6 ms, memory 120.0 MiB with data, state 456.6 KiB",
            "QEMU process resident once connected (median of 1): 56.0 MiB anonymous, 49.0 MiB file-backed and shared",
        ] {
            assert!(t.contains(want), "{want} missing:\n{t}");
        }
        let row = |label: &str| {
            cells(
                t.lines()
                    .find(|l| l.starts_with(label))
                    .unwrap_or_else(|| panic!("no row {label}:\n{t}")),
            )
        };
        // Columns: phase, kvm cold, kvm warm, qemu cold, qemu warm,
        // kvm/qemu, kvm warm/cold, qemu warm/cold. Each warm series has
        // its own backend's restore steps ("-" for the other's), both the
        // total.
        assert_eq!(
            row("restore: RAM copied into memfd")[1..],
            ["-", "-", "-", "116.0 / 116.8", "-", "-", "-"]
        );
        assert_eq!(
            row("restore: servers set up, QEMU spawned")[1..],
            ["-", "-", "-", "absent", "-", "-", "-"]
        );
        assert_eq!(
            row("restore: guest memory")[1..],
            ["-", "6.0 / 6.8", "-", "-", "-", "-", "-"]
        );
        assert_eq!(
            row("restore (total)")[1..],
            ["-", "31.0 / 31.8", "-", "181.0 / 181.8", "-", "-", "-"]
        );
        let total = row("startVM → connected");
        assert_eq!(total[5..], ["0.25×", "0.25×", "0.20×"]);
        assert_eq!(Report::from_json(&v).unwrap(), r);
    }

    /// A table row's cells (columns are at least two spaces apart).
    fn cells(row: &str) -> Vec<String> {
        row.split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(String::from)
            .collect()
    }

    #[test]
    fn a_v1_document_replays_as_cold_series() {
        // As `bench boot --json` wrote it before start kinds (trimmed):
        // no start, snapshot, notes or warm phases.
        let v1 = json!({
            "schema": SCHEMA_V1,
            "runs": 1,
            "warmup": 1,
            "userland": "default",
            "memory_gb": 1.0,
            "cpus": 2,
            "host": {"cpus": 2, "kernel": "6.1.0-28-cloud-amd64"},
            "backends": [
                {"backend": "kvm", "accel": "kvm", "failures": [],
                 "runs": [{"startvm_to_connected": 2570.235, "kernel_to_agent": 1228.707,
                           "hello_to_connected": null}],
                 "summary": {}},
                {"backend": "qemu", "accel": "tcg", "failures": ["run 2: x"],
                 "runs": [{"startvm_to_connected": 9000.5}],
                 "summary": {}}
            ],
            "ratios": {"startvm_to_connected": 0.286}
        });
        let r = Report::from_json(&v1).unwrap();
        assert_eq!(r.notes, Vec::<String>::new());
        assert_eq!(r.host_kernel, "6.1.0-28-cloud-amd64");
        assert_eq!(r.backends.len(), 2);
        for b in &r.backends {
            assert_eq!(b.start, StartKind::Cold);
            assert_eq!(b.snapshot, None);
        }
        let kvm = r.runs_of(Backend::Kvm, StartKind::Cold).unwrap();
        assert_eq!(kvm.runs[0].get(Phase::KernelToAgent), Some(1228.707));
        assert_eq!(kvm.runs[0].get(Phase::RestoreTotal), None);
        assert_eq!(r.backends[1].failures, vec!["run 2: x".to_string()]);
        // Recomputed, and written back as the current schema.
        assert_eq!(r.ratio(Phase::StartVmToConnected), Some(2570.235 / 9000.5));
        let again = r.to_json();
        assert_eq!(again["schema"], SCHEMA);
        assert_eq!(again["backends"][0]["start"], "cold");
        // A bare document: every setting takes its default.
        let bare = Report::from_json(&json!({"schema": SCHEMA_V1, "backends": []})).unwrap();
        assert_eq!((bare.runs_requested, bare.cpus), (0, 0));
        assert!(bare.table().contains("run(s) per series"));
    }
}
