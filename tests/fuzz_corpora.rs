//! Replays the committed fuzzing corpora on stable: every file of
//! `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/` goes through
//! the same entry point the cargo-fuzz target calls (each crate's
//! `fuzzing` module), so a fixed crash stays fixed and the seeds keep
//! working without nightly or libFuzzer.
//!
//! Fails when a target has no corpus files, when a directory names no
//! known target, or when any input panics (the panic names the file).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A fuzz target's entry point.
type Entry = fn(&[u8]);

/// Every fuzz target and its entry point, as in `fuzz/fuzz_targets/`.
const TARGETS: &[(&str, Entry)] = &[
    ("client", cowork_helper::fuzzing::client),
    ("link_host", cowork_helper::fuzzing::link_host),
    ("egress", cowork_helper::fuzzing::egress),
    ("link_agent", guest_agent::fuzzing::link_agent),
    ("vsock", devices::fuzzing::vsock),
    ("blk", devices::fuzzing::blk),
    ("fs", devices::fuzzing::fs),
    ("mmio", vmm::fuzzing::mmio),
    ("acpi", vmm::fuzzing::acpi),
    ("snapshot_state", vmm::fuzzing::snapshot_state),
];

/// Committed inputs: seeds (minimized corpora) and regressions (inputs
/// that once failed).
const INPUT_DIRS: &[&str] = &["fuzz/corpus", "fuzz/regressions"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The files of `dir/<target>/` for every target directory under `dir`.
fn inputs(dir: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    let mut out = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries {
        let e = e.expect("readable directory entry");
        if !e.file_type().expect("file type").is_dir() {
            continue;
        }
        let name = e.file_name().to_string_lossy().into_owned();
        let mut files: Vec<PathBuf> = std::fs::read_dir(e.path())
            .expect("readable target directory")
            .map(|f| f.expect("readable entry").path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        out.insert(name, files);
    }
    out
}

fn replay(target: &str, run: Entry, files: &[PathBuf]) {
    for f in files {
        let data = std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let outcome = std::panic::catch_unwind(|| run(&data));
        assert!(
            outcome.is_ok(),
            "fuzz target {target} fails on {} (replay it with \
             `cargo +nightly fuzz run {target} {}` in fuzz/)",
            f.display(),
            f.display()
        );
    }
}

#[test]
fn every_corpus_directory_is_a_known_target() {
    let known: Vec<&str> = TARGETS.iter().map(|(n, _)| *n).collect();
    for dir in INPUT_DIRS {
        for name in inputs(&root().join(dir)).keys() {
            assert!(
                known.contains(&name.as_str()),
                "{dir}/{name} names no fuzz target (known: {known:?})"
            );
        }
    }
}

#[test]
fn every_target_has_a_corpus() {
    let corpus = inputs(&root().join(INPUT_DIRS[0]));
    for (name, _) in TARGETS {
        let n = corpus.get(*name).map_or(0, Vec::len);
        assert!(n > 0, "fuzz/corpus/{name}/ is missing or empty");
    }
}

/// One test per target, so a failure names it and targets replay in
/// parallel.
macro_rules! replay_tests {
    ($($test:ident => $target:literal),* $(,)?) => {$(
        #[test]
        fn $test() {
            let (name, run) = TARGETS
                .iter()
                .find(|(n, _)| *n == $target)
                .expect("target listed in TARGETS");
            for dir in INPUT_DIRS {
                let all = inputs(&root().join(dir));
                if let Some(files) = all.get(*name) {
                    replay(name, *run, files);
                }
            }
        }
    )*};
}

replay_tests! {
    replay_client => "client",
    replay_link_host => "link_host",
    replay_egress => "egress",
    replay_link_agent => "link_agent",
    replay_vsock => "vsock",
    replay_blk => "blk",
    replay_fs => "fs",
    replay_mmio => "mmio",
    replay_acpi => "acpi",
    replay_snapshot_state => "snapshot_state",
}
