//! A rule the build enforces: in every crate of the workspace, the
//! top-level modules import each other without a circle (`vmm`'s machine,
//! devices and vcpu once did, through `ExitReason`; `cli` and `doctor` once
//! did through the backend choice). Imports point one way, which is what
//! lets a reader take the modules in order.
//!
//! How: each module file's `crate::<module>` paths (and a top-level
//! module's `super::<module>`) outside comments and its `#[cfg(test)]`
//! tail give the edges between top-level modules; a circle is a strongly
//! connected component of more than one module.
//!
//! Limits: a textual scan, not the compiler's resolution: a `use` through
//! a re-export counts as an edge to the re-exporting module, and code in
//! `tests`/`fuzzing` modules is left out (test code may look anywhere).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates' source roots, relative to the workspace.
const CRATES: [&str; 4] = ["src", "vmm/src", "devices/src", "guest-agent/src"];
/// Modules whose code may reach anywhere (test support).
const EXEMPT: [&str; 2] = ["tests", "fuzzing"];

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read source directory") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of `file` under the crate root `root` (`[]` for the
/// crate root itself).
fn module_of(root: &Path, file: &Path) -> Vec<String> {
    let rel = file
        .strip_prefix(root)
        .expect("under the root")
        .with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if parts == ["lib"] || parts == ["main"] {
        parts.clear();
    }
    parts
}

/// The source a module's edges are read from: no comment lines, no test tail.
fn code_of(text: &str) -> String {
    let text = text
        .find("#[cfg(test)]\nmod tests")
        .map_or(text, |at| &text[..at]);
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Names following `prefix` (`crate::` or `super::`) in `code`.
fn targets<'a>(code: &'a str, prefix: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    code.match_indices(prefix).filter_map(move |(at, _)| {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            return None;
        }
        let rest = &code[at + prefix.len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(rest.len());
        (end > 0).then(|| &rest[..end])
    })
}

/// The top-level module graph of the crate rooted at `root`.
fn graph(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let module = module_of(root, &file);
        if module.iter().any(|m| EXEMPT.contains(&m.as_str())) {
            continue;
        }
        let Some(top) = module.first().cloned() else {
            continue;
        };
        let code = code_of(&std::fs::read_to_string(&file).expect("read source"));
        let mut add = |to: &str| {
            if to != top && to != "self" && to != "super" {
                edges.entry(top.clone()).or_default().insert(to.to_string());
            }
        };
        targets(&code, "crate::").for_each(&mut add);
        if module.len() == 1 {
            targets(&code, "super::").for_each(&mut add);
        }
    }
    edges
}

/// The strongly connected components of more than one node (Tarjan).
fn circles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        next: usize,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on_stack.insert(v);
        let next: Vec<&'a str> =
            s.g.get(v)
                .map_or(Vec::new(), |e| e.iter().map(String::as_str).collect());
        for w in next {
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.push(component);
            }
        }
    }
    let mut s = State {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        found: Vec::new(),
    };
    for v in g.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.found
}

#[test]
fn no_crate_has_an_import_circle_between_its_modules() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut failures = Vec::new();
    for krate in CRATES {
        let g = graph(&workspace.join(krate));
        assert!(
            !g.is_empty(),
            "{krate}: no module imports found: is the scan broken?"
        );
        for circle in circles(&g) {
            let detail: Vec<String> = circle
                .iter()
                .map(|m| {
                    let into: Vec<&String> = g[m].iter().filter(|t| circle.contains(t)).collect();
                    format!("{m} -> {into:?}")
                })
                .collect();
            failures.push(format!("{krate}: {}", detail.join(", ")));
        }
    }
    assert!(
        failures.is_empty(),
        "module import circles:\n{}",
        failures.join("\n")
    );
}

#[test]
fn the_scan_finds_a_circle_when_there_is_one() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    g.entry("c".into()).or_default().insert("a".into());
    g.entry("d".into()).or_default().insert("a".into());
    assert_eq!(circles(&g), [["a", "b", "c"]]);
    let code = code_of("use crate::x::Y;\n// crate::z in a comment\nfn f() { super::w(); mycrate::q(); }\n#[cfg(test)]\nmod tests { use crate::t; }");
    assert_eq!(targets(&code, "crate::").collect::<Vec<_>>(), ["x"]);
    assert_eq!(targets(&code, "super::").collect::<Vec<_>>(), ["w"]);
}
