//! Test support for the nested-KVM harness and the guest-image scripts.
//!
//! This machine's own KVM cannot boot Linux, so tests that need a real Linux guest run their
//! VMM inside `scripts/nested-run.sh`: a QEMU TCG L1 guest with emulated AMD SVM whose root is
//! this host's `/` over virtiofs, where `/dev/kvm` does boot Linux. On hosts whose KVM can boot
//! Linux (vmx/svm in /proc/cpuinfo, not PVM) the same tests run directly.
//!
//! Part of the VM tests' support code (`mod support;`, then `support::nested`).
//!
//! Environment:
//! - `COWORK_NESTED_TESTS=1`: the tests are required; missing prerequisites fail instead of skip.
//! - `COWORK_NESTED_MODE=direct|nested`: force a mode instead of detecting it.
//! - `COWORK_GUEST_CACHE`, `XDG_CACHE_HOME`: where the kernel cache lives (see
//!   `scripts/lib/common.sh`; [`guest_cache_dir`] resolves it the same way).

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};
use std::{env, fmt, fs};

/// The repository root (the root package's manifest directory).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Absolute path of a script under `scripts/`.
pub fn script(name: &str) -> PathBuf {
    repo_root().join("scripts").join(name)
}

/// The guest cache directory, resolved like `scripts/lib/common.sh` does.
pub fn guest_cache_dir() -> PathBuf {
    if let Some(dir) = env::var_os("COWORK_GUEST_CACHE").filter(|v| !v.is_empty()) {
        return PathBuf::from(dir);
    }
    if let Some(dir) = env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(dir).join("cowork-helper/guest");
    }
    repo_root().join("target/guest-cache")
}

/// Where a VM test's helper keeps its socket and state: inside the harness
/// (`COWORK_NESTED_INSIDE`) `/` is the host's over virtiofs, so L1's own
/// tmpfs; elsewhere the system's temporary directory.
pub fn helper_base_dir() -> PathBuf {
    if env::var_os("COWORK_NESTED_INSIDE").is_some() {
        PathBuf::from("/dev/shm")
    } else {
        env::temp_dir()
    }
}

/// Whether `COWORK_NESTED_TESTS=1`: then missing prerequisites are failures, not skips.
pub fn nested_tests_required() -> bool {
    env::var("COWORK_NESTED_TESTS").is_ok_and(|v| v == "1")
}

/// Where a nested-KVM test runs its VMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// On this host's `/dev/kvm`.
    Direct,
    /// Inside the nested-KVM harness (`scripts/nested-run.sh`).
    Nested,
}

/// The mode `COWORK_NESTED_MODE` forces, else [`Mode::Direct`] where this
/// host's KVM boots Linux and [`Mode::Nested`] where it does not. Panics on
/// another value.
pub fn mode() -> Mode {
    match env::var("COWORK_NESTED_MODE").as_deref() {
        Ok("direct") => Mode::Direct,
        Ok("nested") => Mode::Nested,
        Ok("") | Err(_) => {
            if host_kvm_boots_linux().is_ok() {
                Mode::Direct
            } else {
                Mode::Nested
            }
        }
        Ok(other) => panic!("COWORK_NESTED_MODE must be 'direct' or 'nested', not '{other}'"),
    }
}

/// `test` cannot run for `reason`: a failure when the nested tests are
/// required ([`nested_tests_required`]), else a [`loud_skip`].
pub fn unavailable(test: &str, reason: &str) {
    assert!(
        !nested_tests_required(),
        "COWORK_NESTED_TESTS=1 but {test} cannot run: {reason}"
    );
    loud_skip(test, reason);
}

/// Print a skip notice that shows even though libtest captures test output.
pub fn loud_skip(test: &str, reason: &str) {
    loud_notice(&format!(
        "SKIPPED {test}: {reason}\n(set COWORK_NESTED_TESTS=1 to make this a failure)"
    ));
}

/// Print a framed notice straight to stderr, bypassing libtest's output capture.
pub fn loud_notice(text: &str) {
    use std::io::Write;
    let bar = "=".repeat(78);
    let _ = writeln!(io::stderr(), "\n{bar}\n{text}\n{bar}");
}

/// The Debian cloud kernel fetched by `scripts/fetch-kernel.sh`.
#[derive(Debug, Clone)]
pub struct Kernel {
    pub version: String,
    /// bzImage as shipped by Debian.
    pub vmlinuz: PathBuf,
    /// Uncompressed ELF kernel (has the PVH entry note).
    pub vmlinux: PathBuf,
    /// `lib/modules/<version>`.
    pub modules_dir: PathBuf,
}

impl Kernel {
    fn from_dir(dir: &Path) -> Option<Kernel> {
        if !dir.join(".complete").exists() {
            return None;
        }
        let version = fs::read_to_string(dir.join("version"))
            .ok()?
            .trim()
            .to_string();
        Some(Kernel {
            version,
            vmlinuz: dir.join("vmlinuz"),
            vmlinux: dir.join("vmlinux"),
            modules_dir: dir.join("modules"),
        })
    }
}

/// The cached kernel, if `scripts/fetch-kernel.sh` has run; never touches the network.
pub fn cached_kernel() -> Option<Kernel> {
    let current = fs::canonicalize(guest_cache_dir().join("current")).ok()?;
    Kernel::from_dir(&current)
}

/// Run `scripts/fetch-kernel.sh` (offline when the kernel is cached already).
pub fn fetch_kernel() -> Result<Kernel, String> {
    let out = Command::new(script("fetch-kernel.sh"))
        .arg("--quiet")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run fetch-kernel.sh: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "fetch-kernel.sh failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let vars = parse_key_values(&String::from_utf8_lossy(&out.stdout));
    let vmlinuz = vars
        .get("VMLINUZ")
        .ok_or("fetch-kernel.sh printed no VMLINUZ")?;
    let dir = Path::new(vmlinuz).parent().ok_or("bad VMLINUZ path")?;
    Kernel::from_dir(dir)
        .ok_or_else(|| format!("fetch-kernel.sh left no kernel in {}", dir.display()))
}

/// Build an initramfs with `scripts/mkinitramfs.sh`: busybox, `init` as /init, and `modules`
/// (with their dependencies) from the cached kernel.
pub fn build_initramfs(output: &Path, init: &Path, modules: &[&str]) -> Result<(), String> {
    let mut cmd = Command::new(script("mkinitramfs.sh"));
    cmd.arg("--output").arg(output).arg("--init").arg(init);
    for m in modules {
        cmd.arg("--module").arg(m);
    }
    let out = cmd
        .env("COWORK_QUIET", "1")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run mkinitramfs.sh: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "mkinitramfs.sh failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Can this host's `/dev/kvm` boot Linux directly? `Err` says why not.
///
/// Requires `/dev/kvm`, the vmx or svm CPU flag (absent under PVM and in plain TCG guests) and
/// no `kvm_pvm` module (PVM's KVM runs simple guests but not a Linux kernel).
pub fn host_kvm_boots_linux() -> Result<(), String> {
    if !Path::new("/dev/kvm").exists() {
        return Err("no /dev/kvm".into());
    }
    if Path::new("/sys/module/kvm_pvm").exists() {
        return Err("/dev/kvm is PVM (kvm_pvm), which cannot boot Linux".into());
    }
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").map_err(|e| format!("/proc/cpuinfo: {e}"))?;
    let virt = cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .flat_map(|l| l.split_whitespace())
        .any(|f| f == "vmx" || f == "svm");
    if !virt {
        return Err("no vmx/svm flag in /proc/cpuinfo".into());
    }
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map_err(|e| format!("cannot open /dev/kvm: {e}"))?;
    Ok(())
}

/// `scripts/nested-run.sh --check`: `Ok(summary)` when qemu, virtiofsd and the kernel are
/// there, `Err(what is missing)` otherwise.
pub fn harness_check() -> Result<String, String> {
    let out = Command::new(script("nested-run.sh"))
        .arg("--check")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run nested-run.sh: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!(
            "{text}{}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// What a command run in the nested guest produced.
#[derive(Debug, Clone)]
pub struct NestedOutput {
    /// The command's stdout and stderr, merged (they share the L1 serial console).
    pub stdout: String,
    /// The command's exit status.
    pub exit_code: i32,
    /// The harness's own messages (timings, warnings).
    pub harness_log: String,
    /// Timings reported by the harness, e.g. `l1_ready_s`, `command_s`, `total_s`.
    pub timings: BTreeMap<String, String>,
}

/// Why the harness could not produce a command result.
#[derive(Debug)]
pub enum NestedError {
    /// The harness timed out (boot included).
    Timeout {
        stdout: String,
        harness_log: String,
    },
    /// The L1 guest died under the command (after the retries): its kernel
    /// panicked (`l1-panic`; a soft lockup panics it too) or it stopped
    /// running (`l1-hang`: no heartbeat).
    L1Died {
        /// The harness's status, `l1-panic` or `l1-hang`.
        status: String,
        /// The harness's message.
        message: String,
        stdout: String,
        harness_log: String,
    },
    /// Anything else: prerequisites missing, QEMU failed, ...
    Harness {
        message: String,
        stdout: String,
        harness_log: String,
    },
    Io(io::Error),
}

impl fmt::Display for NestedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NestedError::Timeout {
                stdout,
                harness_log,
            } => {
                write!(f, "nested harness timed out\n--- output ---\n{stdout}\n--- harness ---\n{harness_log}")
            }
            NestedError::L1Died {
                status,
                message,
                stdout,
                harness_log,
            } => {
                write!(f, "the L1 guest died ({status}): {message}\n--- output ---\n{stdout}\n--- harness ---\n{harness_log}")
            }
            NestedError::Harness {
                message,
                stdout,
                harness_log,
            } => {
                write!(f, "nested harness failed: {message}\n--- output ---\n{stdout}\n--- harness ---\n{harness_log}")
            }
            NestedError::Io(e) => write!(f, "cannot run the nested harness: {e}"),
        }
    }
}

impl std::error::Error for NestedError {}

/// Options for [`run_in_nested_kvm_with`].
#[derive(Debug, Clone)]
pub struct NestedOptions {
    /// Whole-run limit, L1 boot included.
    pub timeout: Duration,
    /// How often to retry when the L1 guest dies: its kernel panics or it
    /// hangs (rare QEMU TCG SVM emulation faults).
    pub retries_on_l1_death: u32,
    /// L1 memory in MiB (None: the harness default, 2048).
    pub mem_mib: Option<u32>,
    /// L1 vCPUs (None: the harness default, 2).
    pub smp: Option<u32>,
    /// Working directory of the command (None: this process's).
    pub cwd: Option<PathBuf>,
}

impl Default for NestedOptions {
    fn default() -> Self {
        NestedOptions {
            timeout: Duration::from_secs(600),
            retries_on_l1_death: 1,
            mem_mib: None,
            smp: None,
            cwd: None,
        }
    }
}

/// Run `cmd` with `bash -c` inside the nested-KVM guest (in this process's working directory,
/// with its environment) and return its output and exit status. Retries once if the L1 guest
/// dies (a kernel panic or lock-up, or a hang the harness's heartbeat catches).
pub fn run_in_nested_kvm(cmd: &str, timeout: Duration) -> Result<NestedOutput, NestedError> {
    run_in_nested_kvm_with(
        cmd,
        &NestedOptions {
            timeout,
            ..NestedOptions::default()
        },
    )
}

/// [`run_in_nested_kvm`] with options.
pub fn run_in_nested_kvm_with(
    cmd: &str,
    opts: &NestedOptions,
) -> Result<NestedOutput, NestedError> {
    let mut attempt = 0;
    loop {
        match run_once(cmd, opts) {
            Err(NestedError::L1Died { status, .. }) if attempt < opts.retries_on_l1_death => {
                attempt += 1;
                eprintln!(
                    "nested harness: the L1 guest died ({status}); retrying ({attempt}/{})",
                    opts.retries_on_l1_death
                );
            }
            other => return other,
        }
    }
}

fn run_once(cmd: &str, opts: &NestedOptions) -> Result<NestedOutput, NestedError> {
    let dir = tempfile::tempdir().map_err(NestedError::Io)?;
    let result_file = dir.path().join("result");
    let mut command = Command::new(script("nested-run.sh"));
    command
        .arg("--timeout")
        .arg(opts.timeout.as_secs().max(1).to_string());
    command.arg("--result").arg(&result_file);
    if let Some(mem) = opts.mem_mib {
        command.arg("--mem").arg(mem.to_string());
    }
    if let Some(smp) = opts.smp {
        command.arg("--smp").arg(smp.to_string());
    }
    if let Some(cwd) = &opts.cwd {
        command.arg("--cwd").arg(cwd);
    }
    command.arg("-c").arg(cmd);
    // The script enforces the timeout itself; this is only a backstop.
    let out = run_with_timeout(&mut command, opts.timeout + Duration::from_secs(60))
        .map_err(NestedError::Io)?;
    let stdout = out.stdout;
    let harness_log = out.stderr;
    if out.timed_out {
        return Err(NestedError::Timeout {
            stdout,
            harness_log,
        });
    }
    let result = fs::read_to_string(&result_file).unwrap_or_default();
    let mut fields = parse_key_values(&result);
    let status = fields.remove("status").unwrap_or_default();
    let message = fields.remove("message").unwrap_or_default();
    match status.as_str() {
        "ok" => {
            let exit_code = fields
                .remove("rc")
                .and_then(|rc| rc.parse().ok())
                .ok_or_else(|| NestedError::Harness {
                    message: format!("no exit code in the result: {result:?}"),
                    stdout: stdout.clone(),
                    harness_log: harness_log.clone(),
                })?;
            Ok(NestedOutput {
                stdout,
                exit_code,
                harness_log,
                timings: fields,
            })
        }
        "timeout" => Err(NestedError::Timeout {
            stdout,
            harness_log,
        }),
        "l1-panic" | "l1-hang" => Err(NestedError::L1Died {
            status,
            message,
            stdout,
            harness_log,
        }),
        _ => Err(NestedError::Harness {
            message: if message.is_empty() {
                format!("nested-run.sh exited with {} and no result", out.status)
            } else {
                message
            },
            stdout,
            harness_log,
        }),
    }
}

/// Output of [`run_with_timeout`].
#[derive(Debug)]
pub struct TimedOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub timed_out: bool,
}

/// Run a command with piped stdout/stderr; on timeout send SIGTERM, then SIGKILL 10 s later.
pub fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> io::Result<TimedOutput> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut out_pipe = child.stdout.take().expect("piped stdout");
    let mut err_pipe = child.stderr.take().expect("piped stderr");
    let out_reader = thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = out_pipe.read_to_end(&mut buf);
        buf
    });
    let err_reader = thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = err_pipe.read_to_end(&mut buf);
        buf
    });
    let deadline = Instant::now() + timeout;
    let mut timed_out = false;
    let mut term_sent_at: Option<Instant> = None;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        let now = Instant::now();
        match term_sent_at {
            None if now >= deadline => {
                timed_out = true;
                // SIGTERM first so nested-run.sh's trap can stop QEMU and virtiofsd.
                // SAFETY: plain kill(2) on our own child's pid.
                unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
                term_sent_at = Some(now);
            }
            Some(t) if now >= t + Duration::from_secs(10) => {
                let _ = child.kill();
            }
            _ => {}
        }
        thread::sleep(Duration::from_millis(20));
    };
    let stdout = String::from_utf8_lossy(&out_reader.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&err_reader.join().unwrap_or_default()).into_owned();
    Ok(TimedOutput {
        status,
        stdout,
        stderr,
        timed_out,
    })
}

/// Quote a string for a POSIX shell command line.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Parse `KEY=VALUE` lines (as printed by fetch-kernel.sh and written by nested-run.sh).
pub fn parse_key_values(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.to_string()))
        .collect()
}

/// A test that re-runs itself inside the nested harness: see [`rerun_test`].
#[derive(Debug, Clone)]
pub struct Rerun<'a> {
    /// The test's name (what the re-run selects with `--exact`).
    pub test: &'a str,
    /// Set to 1 for the re-run: its body then runs directly.
    pub inside_env: &'a str,
    /// Line the body prints when all its checks passed.
    pub ok_marker: &'a str,
    /// Lines of the inner output containing this are echoed (with "nested").
    pub report_prefix: &'a str,
    /// When set in the environment, the whole inner output is printed.
    pub verbose_env: &'a str,
    /// Limit of the inner test run (`timeout` in L1).
    pub inner_timeout: Duration,
    /// Limit of the whole harness run (L1 boot included).
    pub harness_timeout: Duration,
    /// Attempts before giving up on QEMU TCG SVM emulation faults.
    pub attempts: u32,
}

/// How a test that needs a KVM able to boot Linux runs: `body` directly
/// when this is its re-run inside the harness (`spec.inside_env=1`) or when
/// this host's KVM boots Linux ([`mode`]); otherwise [`rerun_test`] inside
/// the nested harness. `missing` (why the test cannot run at all) is asked
/// outside the harness only: a reason, or an unusable harness, is
/// [`unavailable`] (a loud skip, or a failure under `COWORK_NESTED_TESTS=1`).
pub fn run_on_linux_kvm(
    spec: &Rerun<'_>,
    missing: impl FnOnce() -> Option<String>,
    body: impl FnOnce(),
) {
    if env::var(spec.inside_env).is_ok_and(|v| v == "1") {
        return body();
    }
    if let Some(why) = missing() {
        return unavailable(spec.test, &why);
    }
    match mode() {
        Mode::Direct => body(),
        Mode::Nested => match harness_check() {
            Ok(_) => rerun_test(spec),
            Err(why) => unavailable(
                spec.test,
                &format!("the nested-KVM harness is not usable: {why}"),
            ),
        },
    }
}

/// The kvm backend's snapshot directory every nested suite's helper uses
/// (`COWORK_SNAPSHOT_DIR`, unless the caller set one): `nested-snapshots`
/// beside the test binaries' `deps`, on the host's disk that L1 shares, so
/// the first kvm start of a run boots cold and takes the boot snapshot and
/// the suites after it run on restored machines (issue 24: the VM suites
/// against warm starts too). A suite that must boot cold or own its
/// snapshots passes `--snapshot off` or its own `--snapshot-dir`.
pub fn shared_snapshot_dir(exe: &Path) -> PathBuf {
    if let Some(dir) = env::var_os("COWORK_SNAPSHOT_DIR") {
        return PathBuf::from(dir);
    }
    exe.parent()
        .and_then(Path::parent)
        .unwrap_or_else(|| Path::new("."))
        .join("nested-snapshots")
}

/// Re-runs this test binary's `spec.test` inside the nested harness (in
/// direct mode, with `spec.inside_env=1`) and checks that it passed there;
/// retries L1 deaths and failed runs up to `spec.attempts` times (nested
/// boots are subject to QEMU TCG SVM emulation faults: L2 triple faults,
/// silent L1 resets), panics with the last report otherwise.
pub fn rerun_test(spec: &Rerun<'_>) {
    let test = spec.test;
    let exe = std::env::current_exe().expect("the test binary's path");
    let inner = format!(
        "{}=1 COWORK_NESTED_MODE=direct COWORK_SNAPSHOT_DIR={} timeout -k 5 {} {} --exact {test} --nocapture --test-threads=1 2>&1",
        spec.inside_env,
        shell_quote(&shared_snapshot_dir(&exe).to_string_lossy()),
        spec.inner_timeout.as_secs(),
        shell_quote(&exe.to_string_lossy())
    );
    for attempt in 1..=spec.attempts {
        let started = Instant::now();
        let out = match run_in_nested_kvm(&inner, spec.harness_timeout) {
            Ok(out) => out,
            // The L1 guest died under the command (a kernel panic or
            // lock-up, a hang caught by the heartbeat, or QEMU exiting on a
            // silent L1 reset): one more attempt. A timeout (already long)
            // or an I/O error fails at once.
            Err(e @ (NestedError::L1Died { .. } | NestedError::Harness { .. }))
                if attempt < spec.attempts =>
            {
                loud_notice(&format!(
                    "{test}: the nested-KVM harness failed: {e}\n{test}: attempt \
                     {attempt}/{} failed; trying again (nested boots are subject to QEMU \
                     TCG SVM emulation faults)",
                    spec.attempts
                ));
                continue;
            }
            Err(e) => panic!("the nested-KVM harness failed: {e}"),
        };
        let passed = out.exit_code == 0
            && out.stdout.lines().any(|l| l.trim() == spec.ok_marker)
            && out.stdout.contains("test result: ok. 1 passed");
        if passed {
            if std::env::var_os(spec.verbose_env).is_some() {
                eprintln!("---- inner run ----\n{}---- end ----", out.stdout);
            }
            // The inner output shares L1's serial console with the helper's
            // children; a report line may follow other text on its line.
            for l in out.stdout.lines().filter(|l| l.trim() != spec.ok_marker) {
                if let Some(i) = l.find(spec.report_prefix) {
                    eprintln!("{} (nested, TCG speed)", &l[i..]);
                }
            }
            eprintln!(
                "{test}: ok in the nested harness, {:.1} s wall; harness: {}",
                started.elapsed().as_secs_f64(),
                out.harness_log.trim()
            );
            return;
        }
        let report = format!(
            "{test}: the run inside the nested harness failed (exit {}{})\n--- output ---\n{}\n--- harness ---\n{}",
            out.exit_code,
            if out.exit_code == 124 { ", timed out" } else { "" },
            out.stdout,
            out.harness_log
        );
        if attempt == spec.attempts {
            panic!("{report}");
        }
        loud_notice(&format!(
            "{report}\n{test}: attempt {attempt}/{} failed; trying again (nested boots are \
             subject to QEMU TCG SVM emulation faults)",
            spec.attempts
        ));
    }
}
