//! Loading the guest image's kernel modules as PID 1.
//!
//! The image ships plain (uncompressed) `.ko` files under
//! `/lib/modules/<release>/` and a `modules.dep` in depmod's format
//! (`path: dep-path dep-path ...`, paths relative to that directory), written
//! by `scripts/mkinitramfs.sh` from each module's own `depends=` field since
//! Debian's kernel package ships no `modules.dep`. Every module listed there
//! is loaded with `finit_module(2)`, dependencies first
//! ([`load_order`], a pure function), each module as soon as all of its
//! dependencies are in ([`load_plan`], [`run_plan`]), one thread each (at
//! most [`MAX_PARALLEL_LOADS`] at once), so their init functions (device
//! probes) overlap on the guest's vCPUs instead of running one after
//! another, and a slow module (`fuse`, `overlay`) holds up only what
//! depends on it: `virtio_mmio`, whose load probes every device, starts as
//! soon as `virtio` is in. Devices are still found whichever
//! of a transport (`virtio_mmio`, `virtio_pci`) and a driver
//! (`virtio_blk`, ...) registers first: the kernel binds them either way
//! before both loads return. A module that is already loaded or
//! built in (`EEXIST`) counts as loaded; any other failure is reported and
//! the remaining modules are still tried (a missing device is not fatal to
//! the agent, the host sees what is missing in the console log).
//!
//! As the VM's init the agent loads them in the background
//! ([`start_all`]: the plan is read and every file opened first, so the
//! root may be switched away from the initramfs while they load) and waits
//! only for what its next step needs ([`ModuleLoads::wait_for`]), then for
//! the rest ([`ModuleLoads::finish`]).
//!
//! Modules the kernel's command line names in `module_blacklist=` (which
//! the kernel would refuse) are not tried: the kvm backend lists the PCI
//! transport there, since its machine has no PCI bus ([`blacklist_of`]).
//!
//! Limits: no `modprobe.d` options, aliases or soft dependencies at run time
//! (the image script resolves soft `pre:` dependencies into `modules.dep`);
//! compressed modules are refused with a clear error rather than
//! decompressed in the guest.

use std::collections::HashMap;
use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use crate::sys;

/// Directory holding the per-release module trees.
pub const MODULES_ROOT: &str = "/lib/modules";

/// Name of the dependency file inside a module tree.
pub const MODULES_DEP: &str = "modules.dep";

/// The kernel's command line, for `module_blacklist=`.
pub const PROC_CMDLINE: &str = "/proc/cmdline";

/// The kernel parameter listing modules it must not load (comma-separated).
const BLACKLIST_PARAM: &str = "module_blacklist=";

/// Longest `modules.dep` accepted (a whole distro kernel's is about 1 MiB).
const MAX_DEP_FILE: u64 = 16 * 1024 * 1024;

/// Most modules loaded at once: the guest image has about ten without
/// dependencies between them, and each load is CPU work (signature check,
/// relocation, init) that many more threads than vCPUs would only
/// interleave.
pub const MAX_PARALLEL_LOADS: usize = 8;

/// Errors of reading the dependency file and loading modules.
#[derive(Debug, thiserror::Error)]
pub enum ModulesError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path} is larger than {MAX_DEP_FILE} bytes; not a modules.dep")]
    TooLarge { path: PathBuf },
    #[error("modules.dep line {line}: expected 'module.ko: dependencies...', got {text:?}")]
    Syntax { line: usize, text: String },
    #[error("module dependency cycle: {}", .0.join(" -> "))]
    Cycle(Vec<String>),
    #[error("{path} is compressed; the image must ship plain .ko files (rebuild it with scripts/mkguestimage.sh)")]
    Compressed { path: PathBuf },
    #[error("cannot load {path}: {source}")]
    Load { path: PathBuf, source: io::Error },
}

/// One line of `modules.dep`: a module and what it needs, as tree-relative paths.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleDeps {
    pub path: String,
    pub deps: Vec<String>,
}

/// Parses depmod's `modules.dep` format. Blank lines and `#` comments are
/// skipped; a line without `:` or with an empty module path is an error.
pub fn parse_modules_dep(text: &str) -> Result<Vec<ModuleDeps>, ModulesError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let syntax = || ModulesError::Syntax {
            line: i + 1,
            text: line.chars().take(200).collect(),
        };
        let (path, deps) = line.split_once(':').ok_or_else(syntax)?;
        let path = path.trim();
        if path.is_empty() || path.contains(char::is_whitespace) {
            return Err(syntax());
        }
        out.push(ModuleDeps {
            path: path.to_string(),
            deps: deps.split_whitespace().map(str::to_string).collect(),
        });
    }
    Ok(out)
}

/// Orders every module of `entries` (and every dependency they name) so
/// that each comes after all of its dependencies. Modules without an order
/// between them keep the order of `entries` (and, for dependencies without a
/// line of their own, the order they are named in). Duplicate lines are
/// merged. A cycle is an error naming it.
pub fn load_order(entries: &[ModuleDeps]) -> Result<Vec<String>, ModulesError> {
    let mut deps_of: HashMap<&str, Vec<&str>> = HashMap::new();
    for e in entries {
        let slot = deps_of.entry(e.path.as_str()).or_default();
        for d in &e.deps {
            if !slot.contains(&d.as_str()) {
                slot.push(d.as_str());
            }
        }
    }
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Visiting,
        Done,
    }
    let mut marks: HashMap<&str, Mark> = HashMap::new();
    let mut order = Vec::new();
    for root in entries.iter().map(|e| e.path.as_str()) {
        if marks.contains_key(root) {
            continue;
        }
        // Iterative depth-first search; `stack` holds (module, next dependency index).
        let mut stack: Vec<(&str, usize)> = vec![(root, 0)];
        marks.insert(root, Mark::Visiting);
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            let deps = deps_of.get(node).map(Vec::as_slice).unwrap_or(&[]);
            if let Some(&dep) = deps.get(*next) {
                *next += 1;
                match marks.get(dep) {
                    Some(Mark::Done) => {}
                    Some(Mark::Visiting) => {
                        let start = stack.iter().position(|(n, _)| *n == dep).unwrap_or(0);
                        let mut cycle: Vec<String> =
                            stack[start..].iter().map(|(n, _)| n.to_string()).collect();
                        cycle.push(dep.to_string());
                        return Err(ModulesError::Cycle(cycle));
                    }
                    None => {
                        marks.insert(dep, Mark::Visiting);
                        stack.push((dep, 0));
                    }
                }
            } else {
                marks.insert(node, Mark::Done);
                order.push(node.to_string());
                stack.pop();
            }
        }
    }
    Ok(order)
}

/// Every module of `entries` in [`load_order`], with the indices (into
/// that order) of its direct dependencies, for [`run_plan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadPlan {
    /// Modules, each after all of its dependencies.
    pub modules: Vec<String>,
    /// `deps[i]`: indices of `modules[i]`'s dependencies (all `< i`).
    pub deps: Vec<Vec<usize>>,
}

/// The [`LoadPlan`] of `entries`; a cycle is an error naming it.
pub fn load_plan(entries: &[ModuleDeps]) -> Result<LoadPlan, ModulesError> {
    let modules = load_order(entries)?;
    let index: HashMap<&str, usize> = modules
        .iter()
        .enumerate()
        .map(|(i, m)| (m.as_str(), i))
        .collect();
    let mut deps = vec![Vec::new(); modules.len()];
    for e in entries {
        let Some(&i) = index.get(e.path.as_str()) else {
            continue;
        };
        for d in &e.deps {
            if let Some(&j) = index.get(d.as_str()) {
                if !deps[i].contains(&j) {
                    deps[i].push(j);
                }
            }
        }
    }
    Ok(LoadPlan { modules, deps })
}

/// Runs `load(i)` for every `i < deps.len()`, each once all of `deps[i]`
/// have returned (whatever they returned: a module whose dependency
/// failed fails on its own, with its own error), at most `max` at once on
/// scoped threads. Returns the results in completion order, `Err` for a
/// load that panicked. A thread that cannot be started runs its load on
/// this one.
pub fn run_plan<T: Send>(
    deps: &[Vec<usize>],
    max: usize,
    load: impl Fn(usize) -> T + Sync,
) -> Vec<(usize, std::thread::Result<T>)> {
    run_plan_observed(deps, max, load, |_| {})
}

/// [`run_plan`], calling `done(i)` on the calling thread as each load `i`
/// returns (in completion order, before any load that waited for it
/// starts).
pub fn run_plan_observed<T: Send>(
    deps: &[Vec<usize>],
    max: usize,
    load: impl Fn(usize) -> T + Sync,
    mut done: impl FnMut(usize),
) -> Vec<(usize, std::thread::Result<T>)> {
    let n = deps.len();
    let mut waiting_on = vec![0usize; n];
    let mut dependents = vec![Vec::new(); n];
    for (i, ds) in deps.iter().enumerate() {
        for &d in ds.iter().filter(|&&d| d < n) {
            waiting_on[i] += 1;
            dependents[d].push(i);
        }
    }
    let mut ready: std::collections::VecDeque<usize> =
        (0..n).filter(|&i| waiting_on[i] == 0).collect();
    let mut results = Vec::with_capacity(n);
    let (tx, rx) = std::sync::mpsc::channel();
    let run = |i: usize| {
        (
            i,
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load(i))),
        )
    };
    let run = &run;
    std::thread::scope(|scope| {
        let mut running = 0usize;
        while results.len() < n {
            while running < max.max(1) {
                let Some(i) = ready.pop_front() else { break };
                let to_thread = tx.clone();
                let spawned = std::thread::Builder::new()
                    .name("modprobe".into())
                    .spawn_scoped(scope, move || {
                        let _ = to_thread.send(run(i));
                    });
                if spawned.is_err() {
                    let _ = tx.send(run(i));
                }
                running += 1;
            }
            // Nothing running and nothing ready: only a dependency cycle
            // could leave modules behind, and load_order refuses those.
            if running == 0 {
                break;
            }
            let Ok((i, out)) = rx.recv() else { break };
            running -= 1;
            done(i);
            for &j in &dependents[i] {
                waiting_on[j] -= 1;
                if waiting_on[j] == 0 {
                    ready.push_back(j);
                }
            }
            results.push((i, out));
        }
    });
    results
}

/// The module name of a tree path (`kernel/net/vmw_vsock/vsock.ko` -> `vsock`).
pub fn module_name(path: &str) -> &str {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.split_once(".ko").map_or(file, |(stem, _)| stem)
}

/// What happened to one module.
#[derive(Debug)]
pub enum LoadOutcome {
    Loaded(String),
    AlreadyPresent(String),
    /// Named in the kernel's `module_blacklist=`: not tried.
    Skipped(String),
    Failed(ModulesError),
}

/// The module names of every `module_blacklist=` word of a kernel command
/// line, with `-` spelled `_` as the kernel compares them.
pub fn blacklist_of(cmdline: &str) -> Vec<String> {
    cmdline
        .split_whitespace()
        .filter_map(|w| w.strip_prefix(BLACKLIST_PARAM))
        .flat_map(|list| list.split(','))
        .filter(|m| !m.is_empty())
        .map(normalized)
        .collect()
}

/// Reads `<tree>/modules.dep` and returns the modules' full paths in load order.
pub fn planned_loads(tree: &Path) -> Result<Vec<PathBuf>, ModulesError> {
    let (paths, _) = planned(tree)?;
    Ok(paths)
}

/// Reads `<tree>/modules.dep`: the modules' full paths in load order and
/// each one's dependencies ([`load_plan`]).
fn planned(tree: &Path) -> Result<(Vec<PathBuf>, Vec<Vec<usize>>), ModulesError> {
    let dep = tree.join(MODULES_DEP);
    let read = |source| ModulesError::Read {
        path: dep.clone(),
        source,
    };
    let len = std::fs::metadata(&dep).map_err(read)?.len();
    if len > MAX_DEP_FILE {
        return Err(ModulesError::TooLarge { path: dep });
    }
    let text = std::fs::read_to_string(&dep).map_err(read)?;
    let plan = load_plan(&parse_modules_dep(&text)?)?;
    let paths = plan.modules.iter().map(|rel| tree.join(rel)).collect();
    Ok((paths, plan.deps))
}

/// Loads one module from its open file and logs (debug) how long the
/// kernel took.
fn outcome(path: &Path, file: Result<OwnedFd, ModulesError>) -> LoadOutcome {
    let started = std::time::Instant::now();
    let name = module_name(&path.to_string_lossy()).to_string();
    let result = file.and_then(|fd| load_module_file(path, &fd));
    tracing::debug!(
        module = %name,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "finit_module returned"
    );
    match result {
        Ok(true) => LoadOutcome::Loaded(name),
        Ok(false) => LoadOutcome::AlreadyPresent(name),
        Err(e) => LoadOutcome::Failed(e),
    }
}

/// Loads every module of `tree` but those named in `skip`
/// ([`blacklist_of`]), each once its dependencies are in ([`run_plan`], at
/// most [`MAX_PARALLEL_LOADS`] threads); one outcome per module, in
/// completion order.
pub fn load_tree(tree: &Path, skip: &[String]) -> Result<Vec<LoadOutcome>, ModulesError> {
    let plan = OpenPlan::read(tree, skip, &[])?;
    Ok(plan.load(|_| {}))
}

/// A tree's plan ([`planned`]) with every module file already open (none
/// for the skipped ones), so the loads do not depend on the tree's path
/// staying reachable: PID 1 may switch root while they run ([`start_all`]).
struct OpenPlan {
    paths: Vec<PathBuf>,
    /// [`normalized`] module names, by plan index.
    names: Vec<String>,
    deps: Vec<Vec<usize>>,
    /// Each slot is taken by the one load of its module; `None` for a
    /// module named in `module_blacklist=`.
    files: Vec<Mutex<Option<Result<OwnedFd, ModulesError>>>>,
}

impl OpenPlan {
    /// The plan of `tree` without the modules in `skip`; the modules named
    /// in `first` and their dependencies load before any other
    /// ([`first_then_rest`]).
    fn read(tree: &Path, skip: &[String], first: &[&str]) -> Result<OpenPlan, ModulesError> {
        let (paths, mut deps) = planned(tree)?;
        let names: Vec<String> = paths
            .iter()
            .map(|p| normalized(module_name(&p.to_string_lossy())))
            .collect();
        first_then_rest(&names, &mut deps, first);
        let files = paths
            .iter()
            .zip(&names)
            .map(|(p, name)| Mutex::new((!skip.contains(name)).then(|| open_module(p))))
            .collect();
        Ok(OpenPlan {
            paths,
            names,
            deps,
            files,
        })
    }

    /// Runs every load ([`run_plan_observed`]), calling `done` with each
    /// module's name as its load returns.
    fn load(&self, mut done: impl FnMut(&str)) -> Vec<LoadOutcome> {
        let outcomes = run_plan_observed(
            &self.deps,
            MAX_PARALLEL_LOADS,
            |i| match self.files[i].lock().ok().and_then(|mut f| f.take()) {
                Some(file) => outcome(&self.paths[i], file),
                None => LoadOutcome::Skipped(self.names[i].clone()),
            },
            |i| done(&self.names[i]),
        );
        outcomes
            .into_iter()
            .map(|(i, out)| {
                out.unwrap_or_else(|_| {
                    LoadOutcome::Failed(ModulesError::Load {
                        path: self.paths[i].clone(),
                        source: io::Error::other("the loading thread panicked"),
                    })
                })
            })
            .collect()
    }
}

/// Makes every module outside `first` (and outside what those depend on)
/// wait for all of them: with `first` the userland's modules
/// ([`crate::agent::userland::MODULES`]), the virtio transport's load then
/// probes only the block devices (the only driver registered by then), and
/// the other devices (vsock, virtio-fs, balloon, rng) are probed when their
/// own drivers load, after the transport, while PID 1 already mounts the
/// disks. Without it whichever drivers happened to be in when the transport
/// loaded were probed inside its load, which the userland waits for.
/// `names[i]` is module `i`'s name as the kernel spells it (`_`), `deps` as
/// [`LoadPlan::deps`]; adds no cycle, since the first group depends on
/// nothing outside itself.
pub fn first_then_rest(names: &[String], deps: &mut [Vec<usize>], first: &[&str]) {
    let first: Vec<String> = first.iter().map(|n| normalized(n)).collect();
    let mut group: Vec<usize> = (0..names.len())
        .filter(|&i| first.contains(&names[i]))
        .collect();
    let mut k = 0;
    while k < group.len() {
        for &d in &deps[group[k]] {
            if d < names.len() && !group.contains(&d) {
                group.push(d);
            }
        }
        k += 1;
    }
    for (i, ds) in deps.iter_mut().enumerate() {
        if !group.contains(&i) {
            for &g in &group {
                if !ds.contains(&g) {
                    ds.push(g);
                }
            }
        }
    }
}

/// A module's name as the kernel compares it (`-` spelled `_`).
fn normalized(name: &str) -> String {
    name.replace('-', "_")
}

/// Opens a plain `.ko` for [`load_module_file`]; a compressed one is refused.
fn open_module(path: &Path) -> Result<OwnedFd, ModulesError> {
    if !path.to_string_lossy().ends_with(".ko") {
        return Err(ModulesError::Compressed {
            path: path.to_path_buf(),
        });
    }
    sys::open(path, libc::O_RDONLY | libc::O_CLOEXEC).map_err(|source| ModulesError::Load {
        path: path.to_path_buf(),
        source,
    })
}

/// Loads one plain `.ko` with `finit_module(2)`. Returns false when the
/// kernel already has it (`EEXIST`).
pub fn load_module(path: &Path) -> Result<bool, ModulesError> {
    load_module_file(path, &open_module(path)?)
}

/// `finit_module(2)` on the open module file `file` (named `path` in errors).
fn load_module_file(path: &Path, file: &OwnedFd) -> Result<bool, ModulesError> {
    let params: &CStr = c"";
    // SAFETY: finit_module with an open descriptor, a NUL-terminated empty
    // parameter string and no flags.
    let r = unsafe {
        libc::syscall(
            libc::SYS_finit_module,
            file.as_raw_fd(),
            params.as_ptr(),
            0 as libc::c_int,
        )
    };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EEXIST) {
        Ok(false)
    } else {
        Err(ModulesError::Load {
            path: path.to_path_buf(),
            source: e,
        })
    }
}

/// The module tree of the running kernel.
pub fn running_tree() -> PathBuf {
    Path::new(MODULES_ROOT).join(sys::kernel_release())
}

/// The running kernel's modules loading on a thread of their own
/// ([`start_all`]), so PID 1 can go on with whatever needs only some of them
/// ([`ModuleLoads::wait_for`]) and collect the rest later
/// ([`ModuleLoads::finish`]).
pub struct ModuleLoads {
    progress: Arc<Progress>,
    /// The loading thread; `None` when there was nothing to load in the
    /// background (no tree, or the thread could not be started and the
    /// loads ran in [`start_all`]).
    thread: Option<std::thread::JoinHandle<Vec<LoadOutcome>>>,
    /// Outcomes of loads that ran in [`start_all`] itself.
    outcomes: Vec<LoadOutcome>,
    started: std::time::Instant,
}

/// Which modules have not finished loading yet ([`normalized`] names).
struct Progress {
    pending: Mutex<Vec<String>>,
    changed: Condvar,
}

impl Progress {
    fn finished(&self, name: &str) {
        if let Ok(mut pending) = self.pending.lock() {
            pending.retain(|p| p != name);
        }
        self.changed.notify_all();
    }

    /// Nothing is pending any more (also when the loading thread ends
    /// without reporting every module, so no waiter waits forever).
    fn clear(&self) {
        if let Ok(mut pending) = self.pending.lock() {
            pending.clear();
        }
        self.changed.notify_all();
    }
}

/// Clears [`Progress`] when the loading thread ends, however it ends.
struct ClearOnExit(Arc<Progress>);

impl Drop for ClearOnExit {
    fn drop(&mut self) {
        self.0.clear();
    }
}

/// Starts loading the running kernel's modules ([`load_tree`]'s order and
/// parallelism, `module_blacklist=` honoured) on a thread of its own
/// ([`start_tree`]). A tree without `modules.dep` means an image without
/// modules: nothing to do.
pub fn start_all() -> ModuleLoads {
    let tree = running_tree();
    if !tree.join(MODULES_DEP).exists() {
        tracing::info!(tree = %tree.display(), "no modules.dep; no kernel modules to load");
        return ModuleLoads::nothing();
    }
    let skip = blacklist_of(&std::fs::read_to_string(PROC_CMDLINE).unwrap_or_default());
    start_tree(&tree, &skip, crate::agent::userland::MODULES)
}

/// Reads `tree`'s plan (the modules in `first` and their dependencies
/// before all others, [`first_then_rest`]) and opens every module file on
/// this thread, then loads them on a thread of its own; once this
/// returns, the tree's path is no longer needed. When the thread cannot be
/// started the modules are loaded here, before this returns.
pub fn start_tree(tree: &Path, skip: &[String], first: &[&str]) -> ModuleLoads {
    let mut loads = ModuleLoads::nothing();
    let plan = match OpenPlan::read(tree, skip, first) {
        Ok(plan) => plan,
        Err(e) => {
            tracing::error!(error = %e, "kernel modules not loaded");
            return loads;
        }
    };
    if let Ok(mut pending) = loads.progress.pending.lock() {
        pending.clone_from(&plan.names);
    }
    let plan = Arc::new(plan);
    let (for_thread, progress) = (plan.clone(), loads.progress.clone());
    let spawned = std::thread::Builder::new()
        .name("modules".into())
        .spawn(move || {
            let _clear = ClearOnExit(progress.clone());
            for_thread.load(|name| progress.finished(name))
        });
    match spawned {
        Ok(handle) => loads.thread = Some(handle),
        Err(e) => {
            tracing::debug!(error = %e, "no thread for the module loads; loading them first");
            loads.outcomes = plan.load(|_| {});
            loads.progress.clear();
        }
    }
    loads
}

impl ModuleLoads {
    /// Loads with nothing to load.
    fn nothing() -> ModuleLoads {
        ModuleLoads {
            progress: Arc::new(Progress {
                pending: Mutex::new(Vec::new()),
                changed: Condvar::new(),
            }),
            thread: None,
            outcomes: Vec::new(),
            started: std::time::Instant::now(),
        }
    }

    /// Waits until every module of `names` that is being loaded has
    /// finished (loaded, failed or skipped); names not in the tree (built
    /// in, or not shipped) are not waited for.
    pub fn wait_for(&self, names: &[&str]) {
        let wanted: Vec<String> = names.iter().map(|n| normalized(n)).collect();
        let Ok(mut pending) = self.progress.pending.lock() else {
            return;
        };
        while pending.iter().any(|p| wanted.contains(p)) {
            pending = match self.progress.changed.wait(pending) {
                Ok(p) => p,
                Err(_) => return,
            };
        }
    }

    /// Waits for every load and logs one line for all of them (each module
    /// at debug level, a warning per failure). Returns every outcome.
    pub fn finish(self) -> Vec<LoadOutcome> {
        let mut outcomes = self.outcomes;
        if let Some(thread) = self.thread {
            match thread.join() {
                Ok(o) => outcomes.extend(o),
                Err(_) => tracing::error!("the module loading thread panicked"),
            }
        }
        if outcomes.is_empty() {
            return outcomes;
        }
        let (mut loaded, mut present, mut skipped, mut failed) = (0, 0, 0, 0);
        for o in &outcomes {
            match o {
                LoadOutcome::Loaded(name) => {
                    loaded += 1;
                    tracing::debug!(module = %name, "module loaded")
                }
                LoadOutcome::AlreadyPresent(name) => {
                    present += 1;
                    tracing::debug!(module = %name, "module already present")
                }
                LoadOutcome::Skipped(name) => {
                    skipped += 1;
                    tracing::debug!(module = %name, "module blacklisted on the kernel command line; not loaded")
                }
                LoadOutcome::Failed(e) => {
                    failed += 1;
                    tracing::warn!(error = %e, "module not loaded")
                }
            }
        }
        let ms = self.started.elapsed().as_millis() as u64;
        tracing::info!(
            loaded,
            present,
            skipped,
            failed,
            ms,
            "kernel modules loaded"
        );
        outcomes
    }

    /// Modules not finished yet.
    #[cfg(test)]
    fn pending(&self) -> Vec<String> {
        self.progress.pending.lock().unwrap().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deps(text: &str) -> Vec<ModuleDeps> {
        parse_modules_dep(text).unwrap()
    }

    #[test]
    fn parses_depmod_format() {
        let d = deps(
            "# comment\n\nkernel/a.ko: kernel/b.ko kernel/c.ko\n  kernel/b.ko:\nkernel/c.ko:kernel/b.ko\n",
        );
        assert_eq!(
            d,
            vec![
                ModuleDeps {
                    path: "kernel/a.ko".into(),
                    deps: vec!["kernel/b.ko".into(), "kernel/c.ko".into()]
                },
                ModuleDeps {
                    path: "kernel/b.ko".into(),
                    deps: vec![]
                },
                ModuleDeps {
                    path: "kernel/c.ko".into(),
                    deps: vec!["kernel/b.ko".into()]
                },
            ]
        );
        for bad in ["kernel/a.ko kernel/b.ko", ": kernel/b.ko", "a b.ko: c.ko"] {
            let e = parse_modules_dep(bad).unwrap_err();
            assert!(
                matches!(e, ModulesError::Syntax { line: 1, .. }),
                "{bad}: {e}"
            );
        }
    }

    /// Position of `m` in `order`.
    fn pos(order: &[String], m: &str) -> usize {
        order
            .iter()
            .position(|x| x == m)
            .unwrap_or_else(|| panic!("{m} missing from {order:?}"))
    }

    #[test]
    fn dependencies_come_first_whatever_the_file_order() {
        // The guest image's real chain, listed dependents first (worst case).
        let d = deps(
            "vmw_vsock_virtio_transport.ko: vmw_vsock_virtio_transport_common.ko vsock.ko virtio.ko virtio_ring.ko\n\
             virtio_pci.ko: virtio_pci_modern_dev.ko virtio_pci_legacy_dev.ko virtio.ko virtio_ring.ko\n\
             virtiofs.ko: fuse.ko virtio.ko virtio_ring.ko\n\
             vmw_vsock_virtio_transport_common.ko: vsock.ko\n\
             ext4.ko: jbd2.ko mbcache.ko crc16.ko\n\
             jbd2.ko:\nmbcache.ko:\ncrc16.ko:\nfuse.ko:\nvsock.ko:\nvirtio.ko: virtio_ring.ko\nvirtio_ring.ko:\n\
             virtio_pci_modern_dev.ko:\nvirtio_pci_legacy_dev.ko:\n",
        );
        let order = load_order(&d).unwrap();
        assert_eq!(order.len(), 14, "{order:?}");
        for e in &d {
            for dep in &e.deps {
                assert!(
                    pos(&order, dep) < pos(&order, &e.path),
                    "{dep} before {}",
                    e.path
                );
            }
        }
        // Independent modules keep the file's order.
        assert!(pos(&order, "vmw_vsock_virtio_transport.ko") < pos(&order, "virtio_pci.ko"));
        assert!(pos(&order, "virtio_pci.ko") < pos(&order, "virtiofs.ko"));
    }

    #[test]
    fn already_ordered_input_is_kept_and_duplicates_merge() {
        let d = deps("a.ko:\nb.ko: a.ko\nc.ko: b.ko a.ko\nb.ko: a.ko\n");
        assert_eq!(load_order(&d).unwrap(), ["a.ko", "b.ko", "c.ko"]);
    }

    #[test]
    fn dependencies_without_their_own_line_are_loaded_too() {
        let d = deps("top.ko: mid.ko base.ko\nmid.ko: base.ko\n");
        assert_eq!(load_order(&d).unwrap(), ["base.ko", "mid.ko", "top.ko"]);
    }

    #[test]
    fn cycles_are_named() {
        let d = deps("a.ko: b.ko\nb.ko: c.ko\nc.ko: a.ko\nd.ko:\n");
        match load_order(&d) {
            Err(ModulesError::Cycle(c)) => assert_eq!(c, ["a.ko", "b.ko", "c.ko", "a.ko"]),
            other => panic!("expected a cycle, got {other:?}"),
        }
        let selfdep = deps("x.ko: x.ko\n");
        assert!(matches!(load_order(&selfdep), Err(ModulesError::Cycle(_))));
    }

    #[test]
    fn deep_chains_do_not_recurse() {
        let n = 20_000;
        let text: String = (0..n)
            .map(|i| format!("m{i}.ko: m{}.ko\n", i + 1))
            .collect();
        let order = load_order(&deps(&text)).unwrap();
        assert_eq!(order.len(), n + 1);
        assert_eq!(order[0], format!("m{n}.ko"));
        assert_eq!(order[n], "m0.ko");
    }

    #[test]
    fn plans_index_each_module_after_all_of_its_dependencies() {
        let d = deps(
            "vmw_vsock_virtio_transport.ko: vmw_vsock_virtio_transport_common.ko vsock.ko virtio.ko virtio_ring.ko\n\
             virtio_blk.ko: virtio.ko virtio_ring.ko\n\
             vmw_vsock_virtio_transport_common.ko: vsock.ko\n\
             virtio.ko: virtio_ring.ko\nvirtio_ring.ko:\nvsock.ko:\noverlay.ko:\n",
        );
        let plan = load_plan(&d).unwrap();
        assert_eq!(plan.modules, load_order(&d).unwrap());
        let at = |m: &str| plan.modules.iter().position(|x| x == m).unwrap();
        for e in &d {
            let mut want: Vec<usize> = e.deps.iter().map(|dep| at(dep)).collect();
            let mut got = plan.deps[at(&e.path)].clone();
            want.sort_unstable();
            got.sort_unstable();
            assert_eq!(got, want, "{}", e.path);
            assert!(got.iter().all(|&j| j < at(&e.path)));
        }
        assert!(matches!(
            load_plan(&deps("a.ko: b.ko\nb.ko: a.ko\n")),
            Err(ModulesError::Cycle(_))
        ));
    }

    #[test]
    fn a_module_starts_once_its_own_dependencies_are_in_not_a_whole_wave() {
        // 0 = slow (fuse), 1 = virtio, 2 = virtio_mmio (needs 1). The slow
        // module's load only returns once 2 has run: a wave-by-wave loader
        // (2 waiting for all of 0 and 1) would never get there, and the
        // wait gives up after 10 s, failing the test instead of hanging.
        let deps = vec![vec![], vec![], vec![1]];
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let rx = std::sync::Mutex::new(rx);
        let tx = std::sync::Mutex::new(tx);
        let started = std::sync::Mutex::new(Vec::new());
        let results = run_plan(&deps, 8, |i| {
            started.lock().unwrap().push(i);
            match i {
                0 => rx
                    .lock()
                    .unwrap()
                    .recv_timeout(std::time::Duration::from_secs(10))
                    .is_ok(),
                2 => tx.lock().unwrap().send(()).is_ok(),
                _ => true,
            }
        });
        let order: Vec<usize> = results.iter().map(|(i, _)| *i).collect();
        assert_eq!(results.len(), 3);
        assert!(
            results.iter().all(|(_, r)| matches!(r, Ok(true))),
            "the slow module never saw its dependent's dependent load: {order:?}"
        );
        // 1 finished before 2 started, and so before 0 could finish (0 and
        // 2 may finish in either order: 0 wakes as 2 returns).
        let s = started.lock().unwrap().clone();
        let pos = |v: &[usize], x| v.iter().position(|&y| y == x).unwrap();
        assert!(pos(&order, 1) < pos(&order, 2));
        assert!(pos(&order, 1) < pos(&order, 0));
        assert!(pos(&s, 1) < pos(&s, 2));
    }

    #[test]
    fn a_plan_runs_every_load_once_within_the_limit_and_survives_a_panic() {
        // A diamond and a chain: 0 <- {1, 2} <- 3 <- 4, plus 5 alone.
        let deps = vec![vec![], vec![0], vec![0], vec![1, 2], vec![3], vec![]];
        let live = std::sync::atomic::AtomicUsize::new(0);
        let peak = std::sync::atomic::AtomicUsize::new(0);
        let done = std::sync::Mutex::new(Vec::new());
        let results = run_plan(&deps, 2, |i| {
            use std::sync::atomic::Ordering::SeqCst;
            let now = live.fetch_add(1, SeqCst) + 1;
            peak.fetch_max(now, SeqCst);
            {
                let done = done.lock().unwrap();
                for &d in &deps[i] {
                    assert!(done.contains(&d), "{i} ran before its dependency {d}");
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
            done.lock().unwrap().push(i);
            live.fetch_sub(1, SeqCst);
            if i == 5 {
                panic!("a load that panics");
            }
            i * 10
        });
        let mut seen: Vec<usize> = results.iter().map(|(i, _)| *i).collect();
        seen.sort_unstable();
        assert_eq!(seen, [0, 1, 2, 3, 4, 5]);
        for (i, r) in &results {
            match i {
                5 => assert!(r.is_err()),
                _ => assert_eq!(*r.as_ref().unwrap(), i * 10),
            }
        }
        assert!(peak.load(std::sync::atomic::Ordering::SeqCst) <= 2);
    }

    /// A tree of files that are not modules (finit_module fails on each:
    /// EPERM when not root, ENOEXEC as root), `c` and `d` after `a`.
    fn fake_tree() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(MODULES_DEP),
            "c.ko: a.ko\nb-x.ko:\na.ko:\nd.ko: a.ko\n",
        )
        .unwrap();
        for m in ["a", "b-x", "c", "d"] {
            std::fs::write(dir.path().join(format!("{m}.ko")), b"not a module").unwrap();
        }
        dir
    }

    #[test]
    fn a_tree_loads_every_module_and_reports_each() {
        // Every failed load is still reported, a dependent after its
        // dependency.
        let dir = fake_tree();
        let outcomes = load_tree(dir.path(), &[]).unwrap();
        let paths: Vec<String> = outcomes
            .iter()
            .map(|o| match o {
                LoadOutcome::Failed(ModulesError::Load { path, .. }) => {
                    module_name(&path.to_string_lossy()).to_string()
                }
                other => panic!("a non-module loaded: {other:?}"),
            })
            .collect();
        let mut sorted = paths.clone();
        sorted.sort();
        assert_eq!(sorted, ["a", "b-x", "c", "d"]);
        let pos = |m: &str| paths.iter().position(|p| p == m).unwrap();
        assert!(pos("a") < pos("c") && pos("a") < pos("d"), "{paths:?}");
    }

    #[test]
    fn background_loads_can_be_waited_for_by_name_and_all_are_reported() {
        let dir = fake_tree();
        let loads = start_tree(dir.path(), &blacklist_of("module_blacklist=d"), &[]);
        // Names are compared as the kernel spells them; a module the tree
        // does not have is not waited for.
        loads.wait_for(&["c", "b-x", "built_in_elsewhere"]);
        let pending = loads.pending();
        for done in ["a", "b_x", "c"] {
            assert!(
                !pending.contains(&done.to_string()),
                "{done} still pending: {pending:?}"
            );
        }
        let mut names: Vec<String> = loads
            .finish()
            .into_iter()
            .map(|o| match o {
                LoadOutcome::Failed(ModulesError::Load { path, .. }) => {
                    module_name(&path.to_string_lossy()).to_string()
                }
                LoadOutcome::Skipped(name) => format!("skipped {name}"),
                other => panic!("a non-module loaded: {other:?}"),
            })
            .collect();
        names.sort();
        assert_eq!(names, ["a", "b-x", "c", "skipped d"]);
    }

    #[test]
    fn the_first_group_and_its_dependencies_load_before_everything_else() {
        // The guest image's shape: two transports, the block driver and
        // overlay first; the other drivers after all of them.
        let text = "virtio_ring.ko:\nvirtio.ko: virtio_ring.ko\n\
            virtio_mmio.ko: virtio.ko virtio_ring.ko\n\
            virtio_pci_modern_dev.ko:\n\
            virtio_pci.ko: virtio_pci_modern_dev.ko virtio.ko virtio_ring.ko\n\
            virtio_blk.ko: virtio.ko virtio_ring.ko\nvirtio-rng.ko: virtio.ko virtio_ring.ko\n\
            vsock.ko:\nfuse.ko:\nvirtiofs.ko: fuse.ko virtio.ko virtio_ring.ko\noverlay.ko:\n";
        let plan = load_plan(&deps(text)).unwrap();
        let names: Vec<String> = plan
            .modules
            .iter()
            .map(|m| normalized(module_name(m)))
            .collect();
        let mut d = plan.deps.clone();
        first_then_rest(
            &names,
            &mut d,
            &[
                "virtio_mmio",
                "virtio_pci",
                "virtio-blk",
                "overlay",
                "absent",
            ],
        );
        let first = [
            "virtio_ring",
            "virtio",
            "virtio_mmio",
            "virtio_pci_modern_dev",
            "virtio_pci",
            "virtio_blk",
            "overlay",
        ];
        let idx = |n: &str| names.iter().position(|m| m == n).unwrap();
        for (i, name) in names.iter().enumerate() {
            if first.contains(&name.as_str()) {
                // Unchanged: only their own dependencies.
                assert_eq!(d[i], plan.deps[i], "{name}");
            } else {
                for f in first {
                    assert!(d[i].contains(&idx(f)), "{name} does not wait for {f}");
                }
            }
        }
        // Still runnable: every load happens once, a first-group module
        // before any other.
        let order: Vec<usize> = run_plan(&d, 4, |i| i).into_iter().map(|(i, _)| i).collect();
        assert_eq!(order.len(), names.len());
        let last_first = order
            .iter()
            .rposition(|&i| first.contains(&names[i].as_str()));
        let first_rest = order
            .iter()
            .position(|&i| !first.contains(&names[i].as_str()));
        assert!(last_first < first_rest, "{order:?}");
        // No group: the plan is untouched.
        let mut same = plan.deps.clone();
        first_then_rest(&names, &mut same, &[]);
        assert_eq!(same, plan.deps);
    }

    #[test]
    fn background_loads_do_not_need_the_tree_once_started() {
        // PID 1 switches root (and frees the initramfs) while modules load:
        // every file was opened before start_tree returned.
        let dir = fake_tree();
        let loads = start_tree(dir.path(), &[], &[]);
        drop(dir);
        let outcomes = loads.finish();
        assert_eq!(outcomes.len(), 4);
        for o in outcomes {
            match o {
                LoadOutcome::Failed(ModulesError::Load { source, .. }) => {
                    assert_ne!(source.kind(), io::ErrorKind::NotFound, "{source}")
                }
                other => panic!("unexpected outcome {other:?}"),
            }
        }
    }

    #[test]
    fn a_tree_that_cannot_be_read_waits_for_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let loads = start_tree(&dir.path().join("missing"), &[], &[]);
        loads.wait_for(&["virtio_blk"]);
        assert!(loads.finish().is_empty());
    }

    #[test]
    fn blacklisted_modules_are_skipped_and_reported_as_such() {
        assert_eq!(
            blacklist_of("console=ttyS0 module_blacklist=virtio_pci,virtio-pci-legacy-dev quiet module_blacklist=,x"),
            ["virtio_pci", "virtio_pci_legacy_dev", "x"]
        );
        assert!(blacklist_of("console=ttyS0 quiet").is_empty());
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(MODULES_DEP),
            "b.ko: a-x.ko\na-x.ko:\nc.ko:\n",
        )
        .unwrap();
        for m in ["a-x", "b", "c"] {
            std::fs::write(dir.path().join(format!("{m}.ko")), b"not a module").unwrap();
        }
        let outcomes = load_tree(dir.path(), &blacklist_of("module_blacklist=a_x")).unwrap();
        assert_eq!(outcomes.len(), 3);
        let skipped: Vec<&str> = outcomes
            .iter()
            .filter_map(|o| match o {
                LoadOutcome::Skipped(n) => Some(n.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(skipped, ["a_x"]);
        // The others were tried (and fail: not modules), b after a-x's turn.
        let failed = outcomes
            .iter()
            .filter(|o| matches!(o, LoadOutcome::Failed(_)))
            .count();
        assert_eq!(failed, 2);
    }

    #[test]
    fn names_and_plans() {
        assert_eq!(module_name("kernel/net/vmw_vsock/vsock.ko"), "vsock");
        assert_eq!(module_name("kernel/fs/fuse/virtiofs.ko.xz"), "virtiofs");
        assert_eq!(module_name("crc16.ko"), "crc16");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(MODULES_DEP),
            "kernel/b.ko: kernel/a.ko\nkernel/a.ko:\n",
        )
        .unwrap();
        assert_eq!(
            planned_loads(dir.path()).unwrap(),
            [
                dir.path().join("kernel/a.ko"),
                dir.path().join("kernel/b.ko")
            ]
        );
        let missing = planned_loads(&dir.path().join("nope")).unwrap_err();
        assert!(matches!(missing, ModulesError::Read { .. }), "{missing}");
    }

    #[test]
    fn loading_refuses_compressed_and_reports_missing_files() {
        let e = load_module(Path::new("/nonexistent/x.ko.zst")).unwrap_err();
        assert!(matches!(e, ModulesError::Compressed { .. }), "{e}");
        let e = load_module(Path::new("/nonexistent/x.ko")).unwrap_err();
        assert!(
            matches!(&e, ModulesError::Load { source, .. } if source.kind() == io::ErrorKind::NotFound),
            "{e}"
        );
    }
}
