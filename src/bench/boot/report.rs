//! What `bench boot` prints: the JSON document (`--json`) and the table,
//! both built from the runs' [`Phases`] by [`Report`].
//!
//! JSON shape ([`SCHEMA`]):
//! ```text
//! { "schema": "...", "runs": N, "warmup": W, "userland": "default",
//!   "memory_gb": 1.0, "cpus": 2,
//!   "host": { "cpus": 2, "kernel": "6.1.0-..." },
//!   "backends": [ { "backend": "kvm", "accel": "kvm" | "tcg" | null,
//!                   "failures": ["..."],
//!                   "runs": [ { "<phase>": ms | null, ... } ],
//!                   "summary": { "<phase>": {"median_ms", "p90_ms", "n"} | null } } ],
//!   "ratios": { "<phase>": kvm median / qemu median | null } | null }
//! ```
//! Every phase key of [`Phase::ALL`] is always present; a phase a backend
//! cannot measure is `null`, never a made-up number. `ratios` is `null`
//! unless both backends ran.

use serde_json::{json, Map, Value};

use super::phases::{stat, Backend, Phase, Phases, Stat};

/// The `schema` value of the JSON document.
pub const SCHEMA: &str = "cowork-helper bench boot v1";

/// The runs of one backend.
#[derive(Clone, Debug, PartialEq)]
pub struct BackendRuns {
    pub backend: Backend,
    /// QEMU's accelerator, or `kvm` for our VMM; `None` before any run.
    pub accel: Option<String>,
    pub runs: Vec<Phases>,
    /// One line per run that failed (not in `runs`).
    pub failures: Vec<String>,
}

/// Everything one `bench boot` invocation measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    pub runs_requested: usize,
    /// Unmeasured boots per backend before the runs.
    pub warmup: usize,
    pub userland: String,
    pub memory_gb: f64,
    pub cpus: u32,
    pub host_kernel: String,
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

fn phases_json(p: &Phases) -> Value {
    let mut m = Map::new();
    for ph in Phase::ALL {
        m.insert(
            ph.key().into(),
            p.get(ph).map_or(Value::Null, |v| json!(round3(v))),
        );
    }
    Value::Object(m)
}

impl Report {
    /// The backend's runs, when it ran.
    pub fn runs_of(&self, b: Backend) -> Option<&BackendRuns> {
        self.backends.iter().find(|r| r.backend == b)
    }

    /// kvm median / qemu median of `phase`, when both measured it.
    pub fn ratio(&self, phase: Phase) -> Option<f64> {
        let kvm = stat(&self.runs_of(Backend::Kvm)?.runs, phase)?.median_ms;
        let qemu = stat(&self.runs_of(Backend::Qemu)?.runs, phase)?.median_ms;
        (qemu > 0.0).then(|| kvm / qemu)
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
                    "accel": b.accel,
                    "failures": b.failures,
                    "runs": b.runs.iter().map(phases_json).collect::<Vec<_>>(),
                    "summary": summary,
                })
            })
            .collect();
        let both = self.runs_of(Backend::Kvm).is_some() && self.runs_of(Backend::Qemu).is_some();
        let ratios = if both {
            let mut m = Map::new();
            for ph in Phase::ALL {
                m.insert(
                    ph.key().into(),
                    self.ratio(ph).map_or(Value::Null, |r| json!(round3(r))),
                );
            }
            Value::Object(m)
        } else {
            Value::Null
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
            "backends": backends,
            "ratios": ratios,
        })
    }

    /// A report read back from [`Report::to_json`]'s document (for
    /// `bench boot --replay`): the runs' phases, the settings and the
    /// failures; summaries and ratios are recomputed.
    pub fn from_json(v: &Value) -> Result<Report, String> {
        if v["schema"] != SCHEMA {
            return Err(format!(
                "not a {SCHEMA:?} document (schema {})",
                v["schema"]
            ));
        }
        let num = |x: &Value| x.as_u64().unwrap_or_default() as usize;
        let mut backends = Vec::new();
        for b in v["backends"].as_array().ok_or("no backends array")? {
            let backend = match b["backend"].as_str() {
                Some("kvm") => Backend::Kvm,
                Some("qemu") => Backend::Qemu,
                other => return Err(format!("unknown backend {other:?}")),
            };
            let mut runs = Vec::new();
            for r in b["runs"].as_array().ok_or("no runs array")? {
                let mut p = Phases::default();
                for ph in Phase::ALL {
                    p.set(ph, r[ph.key()].as_f64());
                }
                runs.push(p);
            }
            let failures = b["failures"]
                .as_array()
                .map(|f| {
                    f.iter()
                        .filter_map(|x| x.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            backends.push(BackendRuns {
                backend,
                accel: b["accel"].as_str().map(String::from),
                runs,
                failures,
            });
        }
        Ok(Report {
            runs_requested: num(&v["runs"]),
            warmup: num(&v["warmup"]),
            userland: v["userland"].as_str().unwrap_or_default().to_string(),
            memory_gb: v["memory_gb"].as_f64().unwrap_or_default(),
            cpus: v["cpus"].as_u64().unwrap_or_default() as u32,
            host_kernel: v["host"]["kernel"].as_str().unwrap_or_default().to_string(),
            backends,
        })
    }

    /// The table for people: one row per phase, median and p90 per backend,
    /// and the kvm/qemu ratio when both ran.
    pub fn table(&self) -> String {
        let both = self.runs_of(Backend::Kvm).is_some() && self.runs_of(Backend::Qemu).is_some();
        let mut head = vec!["phase (ms)".to_string()];
        for b in &self.backends {
            let accel = b.accel.as_deref().unwrap_or("?");
            head.push(format!("{} ({accel}) median / p90", b.backend.as_str()));
        }
        if both {
            head.push("kvm/qemu".into());
        }
        let mut rows = vec![head];
        for ph in Phase::ALL {
            let mut row = vec![ph.label().to_string()];
            for b in &self.backends {
                row.push(match stat(&b.runs, ph) {
                    Some(s) => format!("{:.1} / {:.1}", s.median_ms, s.p90_ms),
                    None => "absent".into(),
                });
            }
            if both {
                row.push(
                    self.ratio(ph)
                        .map_or_else(|| "-".into(), |r| format!("{r:.2}×")),
                );
            }
            rows.push(row);
        }
        let cols = rows[0].len();
        let widths: Vec<usize> = (0..cols)
            .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
            .collect();
        let mut out = format!(
            "cowork-helper bench boot: {} run(s) per backend after {} warm-up boot(s), userland {}, {} GiB, {} vCPUs, host kernel {}\n",
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
                b.backend.as_str(),
                b.runs.len(),
                b.failures.len()
            );
            for f in &b.failures {
                out += &format!("  failed: {f}\n");
            }
        }
        out
    }
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

    fn report(both: bool) -> Report {
        let mut backends = vec![BackendRuns {
            backend: Backend::Qemu,
            accel: Some("tcg".into()),
            runs: runs(
                &[
                    (Phase::StartVmToConnected, 4000.0),
                    (Phase::KernelToAgent, 900.0),
                ],
                3,
            ),
            failures: vec![],
        }];
        if both {
            backends.insert(
                0,
                BackendRuns {
                    backend: Backend::Kvm,
                    accel: Some("kvm".into()),
                    runs: runs(&[(Phase::StartVmToConnected, 1000.0)], 3),
                    failures: vec!["run 4: guest did not connect".into()],
                },
            );
        }
        Report {
            runs_requested: 3,
            warmup: 1,
            userland: "default".into(),
            memory_gb: 1.0,
            cpus: 2,
            host_kernel: "6.1.0-test".into(),
            backends,
        }
    }

    #[test]
    fn json_has_every_phase_with_nulls_for_the_absent() {
        let v = report(false).to_json();
        assert_eq!(v["schema"], SCHEMA);
        assert_eq!(v["runs"], 3);
        assert_eq!(v["warmup"], 1);
        assert!(v["ratios"].is_null());
        let b = &v["backends"][0];
        assert_eq!(b["backend"], "qemu");
        assert_eq!(b["accel"], "tcg");
        assert_eq!(b["runs"].as_array().unwrap().len(), 3);
        for ph in Phase::ALL {
            assert!(b["runs"][0].get(ph.key()).is_some(), "{}", ph.key());
            assert!(b["summary"].get(ph.key()).is_some(), "{}", ph.key());
        }
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
        assert!(Report::from_json(&json!({"schema": "other"})).is_err());
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
        assert!(t.contains("kvm (kvm) median / p90"), "{t}");
        assert!(t.contains("0.25×"), "{t}");
        assert!(t.contains("absent"), "{t}");
        assert!(t.contains("failed: run 4"), "{t}");
    }
}
