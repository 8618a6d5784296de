//! Throwaway Debian systems for the package tests (`tests/package_deb.rs`): an
//! `mmdebstrap --variant=apt` root of a Debian suite, from the Debian archive
//! of this host's apt sources, cached as a tarball and unpacked into a
//! temporary directory per test; commands run in it with `chroot`, inside a
//! private mount namespace with its own `/proc` (`unshare --mount
//! --propagation private`), so this machine's own dpkg state, mounts, udev
//! and kernel are never touched.
//!
//! The gate: the tests need root, `mmdebstrap`, `unshare` and the Debian
//! archive. Where one is missing they skip with a framed notice, unless
//! [`PACKAGE_TESTS_ENV`] is `1`, which makes it a failure (CI).
//!
//! The cache: `<guest cache>/package-test/<suite>-apt-<key>.tar` (about
//! 220 MB; the key covers the suite, the architecture, the mirrors and the
//! recipe), built once (about 25 s) under a lock; a new key replaces the
//! suite's older tarballs. Its package lists are kept, so `apt-get -s` can
//! resolve against the archive; delete the tarball to refresh it.

use std::io::Write;
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::fs::{chown, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use std::{env, fs};

use super::nested::{guest_cache_dir, loud_notice, run_with_timeout, TimedOutput};

/// Environment variable that makes a missing prerequisite of the package
/// tests a failure instead of a skip.
pub const PACKAGE_TESTS_ENV: &str = "COWORK_PACKAGE_TESTS";

/// The unprivileged user every root gets (what the client runs as).
pub const USER: &str = "user";
pub const USER_UID: u32 = 1000;
pub const USER_GID: u32 = 1000;
pub const USER_HOME: &str = "/home/user";
/// Its `XDG_RUNTIME_DIR` (0700, owned by the user), as logind makes it.
pub const USER_RUNTIME_DIR: &str = "/run/user/1000";

/// Bumped when the tarball's recipe changes (a new cache key).
const RECIPE_VERSION: u32 = 1;
/// Limit of one command in a root (apt over the network included).
const COMMAND_LIMIT: Duration = Duration::from_secs(600);

/// Whether [`PACKAGE_TESTS_ENV`] is `1`.
pub fn package_tests_required() -> bool {
    env::var(PACKAGE_TESTS_ENV).is_ok_and(|v| v == "1")
}

/// Whether `test` may run given what is `missing` (one reason each, `None`
/// for what is there): panics when the package tests are required,
/// otherwise prints the skip notice and returns `false`.
pub fn package_gate(test: &str, missing: impl IntoIterator<Item = Option<String>>) -> bool {
    let missing: Vec<String> = missing.into_iter().flatten().collect();
    if missing.is_empty() {
        return true;
    }
    assert!(
        !package_tests_required(),
        "{PACKAGE_TESTS_ENV}=1 but {test} cannot run: {}",
        missing.join("; ")
    );
    loud_notice(&format!(
        "SKIPPED {test}: {}\n(set {PACKAGE_TESTS_ENV}=1 to make this a failure)",
        missing.join("; ")
    ));
    false
}

/// What keeps the package tests from running here, one reason each.
pub fn missing_prerequisites() -> Vec<Option<String>> {
    let mut missing = vec![
        // SAFETY: geteuid has no preconditions.
        (unsafe { libc::geteuid() } != 0).then(|| {
            "needs root (dpkg in a chroot, mmdebstrap's root mode, mount namespaces)".to_string()
        }),
    ];
    for (cmd, hint) in [
        ("mmdebstrap", "apt-get install mmdebstrap"),
        ("dpkg-deb", "apt-get install dpkg"),
        ("unshare", "apt-get install util-linux"),
        ("chroot", "apt-get install coreutils"),
        ("tar", "apt-get install tar"),
    ] {
        missing.push((!on_path(cmd)).then(|| format!("'{cmd}' not found ({hint})")));
    }
    if missing.iter().all(Option::is_none) {
        let ns = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "true"])
            .output();
        missing.push(match ns {
            Ok(o) if o.status.success() => None,
            Ok(o) => Some(format!(
                "cannot make a mount namespace (unshare --mount: {})",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => Some(format!("cannot run unshare: {e}")),
        });
    }
    missing.push(match host_mirrors() {
        Ok(m) => archive_reachable(&m.archive).err(),
        Err(e) => Some(e),
    });
    missing
}

fn on_path(cmd: &str) -> bool {
    env::var_os("PATH")
        .map(|p| env::split_paths(&p).any(|d| d.join(cmd).is_file()))
        .unwrap_or(false)
}

/// The Debian archive and security archive of this host's apt sources.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mirrors {
    pub archive: String,
    pub security: Option<String>,
}

/// `(URI, suite)` of every `deb` source of this host, one-line `.list` and
/// deb822 `.sources` alike (what `scripts/mkrootfs.sh` reads too).
fn host_sources() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lists = vec![PathBuf::from("/etc/apt/sources.list")];
    let mut deb822 = Vec::new();
    if let Ok(dir) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut names: Vec<PathBuf> = dir.flatten().map(|e| e.path()).collect();
        names.sort();
        for p in names {
            match p.extension().and_then(|e| e.to_str()) {
                Some("list") => lists.push(p),
                Some("sources") => deb822.push(p),
                _ => {}
            }
        }
    }
    for p in lists {
        for line in fs::read_to_string(&p).unwrap_or_default().lines() {
            let mut words = line.split_whitespace().peekable();
            if words.next() != Some("deb") {
                continue;
            }
            if words.peek().is_some_and(|w| w.starts_with('[')) {
                for w in words.by_ref() {
                    if w.ends_with(']') {
                        break;
                    }
                }
            }
            if let (Some(uri), Some(suite)) = (words.next(), words.next()) {
                out.push((uri.to_string(), suite.to_string()));
            }
        }
    }
    for p in deb822 {
        let text = fs::read_to_string(&p).unwrap_or_default();
        for stanza in text.split("\n\n") {
            let (mut deb, mut enabled) = (false, true);
            let (mut uris, mut suites) = (Vec::new(), Vec::new());
            for line in stanza.lines().filter(|l| !l.starts_with('#')) {
                let Some((key, value)) = line.split_once(':') else {
                    continue;
                };
                let values = value.split_whitespace().map(str::to_string);
                match key.trim().to_ascii_lowercase().as_str() {
                    "types" => deb = value.split_whitespace().any(|t| t == "deb"),
                    "enabled" => enabled = !value.trim().eq_ignore_ascii_case("no"),
                    "uris" => uris.extend(values),
                    "suites" => suites.extend(values),
                    _ => {}
                }
            }
            if deb && enabled {
                for u in &uris {
                    for s in &suites {
                        out.push((u.clone(), s.clone()));
                    }
                }
            }
        }
    }
    out
}

/// The first Debian archive (a URI ending in `/debian`) and security archive
/// of this host's apt sources.
pub fn host_mirrors() -> Result<Mirrors, String> {
    let sources = host_sources();
    let archive = sources
        .iter()
        .find(|(u, s)| !s.ends_with("-security") && u.trim_end_matches('/').ends_with("/debian"))
        .map(|(u, _)| u.clone())
        .ok_or("no Debian archive in this host's apt sources (/etc/apt/sources.list*)")?;
    let security = sources
        .iter()
        .find(|(_, s)| s.ends_with("-security"))
        .map(|(u, _)| u.clone());
    Ok(Mirrors { archive, security })
}

/// Whether the archive at `uri` (http or https) accepts a TCP connection.
pub fn archive_reachable(uri: &str) -> Result<(), String> {
    let (scheme, rest) = uri
        .split_once("://")
        .ok_or_else(|| format!("cannot read the archive URI '{uri}'"))?;
    let host = rest.split('/').next().unwrap_or_default();
    let addr = if host.contains(':') {
        host.to_string()
    } else {
        format!("{host}:{}", if scheme == "https" { 443 } else { 80 })
    };
    let unreachable = |why: String| format!("the Debian archive {uri} is unreachable: {why}");
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| unreachable(e.to_string()))?
        .collect();
    let mut last = String::from("no address");
    for a in addrs {
        match TcpStream::connect_timeout(&a, Duration::from_secs(5)) {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
    }
    Err(unreachable(last))
}

/// FNV-1a: a short, stable cache key.
fn fnv64(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn dpkg_arch() -> String {
    let out = Command::new("dpkg")
        .arg("--print-architecture")
        .output()
        .expect("run dpkg --print-architecture");
    assert!(out.status.success(), "dpkg --print-architecture failed");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The cached `mmdebstrap --variant=apt` tarball of `suite` (built, under a
/// lock, when missing). Panics with mmdebstrap's output when it fails.
pub fn base_tarball(suite: &str) -> PathBuf {
    let mirrors = host_mirrors().unwrap_or_else(|e| panic!("{e}"));
    let arch = dpkg_arch();
    let mut sources = vec![
        format!("deb {} {suite} main", mirrors.archive),
        format!("deb {} {suite}-updates main", mirrors.archive),
    ];
    if let Some(sec) = &mirrors.security {
        sources.push(format!("deb {sec} {suite}-security main"));
    }
    let key = fnv64(&format!(
        "{RECIPE_VERSION}|{suite}|{arch}|{}",
        sources.join("|")
    ));
    let dir = guest_cache_dir().join("package-test");
    fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    let tarball = dir.join(format!("{suite}-apt-{key:016x}.tar"));
    // One build at a time, across test threads and processes (each open file
    // description is its own flock).
    let lock = fs::File::create(dir.join(".lock")).expect("create the cache lock");
    // SAFETY: flock on a descriptor we own; released when `lock` is dropped.
    assert_eq!(
        // SAFETY: flock on a descriptor this function owns; no pointers.
        unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) },
        0,
        "flock {}",
        dir.display()
    );
    if tarball.is_file() {
        return tarball;
    }
    let tmp = dir.join(format!(".{suite}-{}.tar", std::process::id()));
    eprintln!(
        "package tests: building the {suite} base root with mmdebstrap into {} (once; about half a minute)",
        tarball.display()
    );
    let mut cmd = Command::new("mmdebstrap");
    cmd.args([
        "--variant=apt",
        "--mode=root",
        "--format=tar",
        // apt-get -s resolves the package's Recommends against these.
        "--skip=cleanup/apt/lists",
        "--quiet",
        suite,
    ])
    .arg(&tmp)
    .args(&sources);
    let out = run_with_timeout(&mut cmd, Duration::from_secs(900)).expect("run mmdebstrap");
    if !out.status.success() || out.timed_out {
        let _ = fs::remove_file(&tmp);
        panic!(
            "mmdebstrap of {suite} failed ({}{}):\n{}{}",
            out.status,
            if out.timed_out { ", timed out" } else { "" },
            out.stdout,
            out.stderr
        );
    }
    // Older recipes or mirrors of this suite go.
    for e in fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(&format!("{suite}-apt-")) && name.ends_with(".tar") {
            let _ = fs::remove_file(e.path());
        }
    }
    fs::rename(&tmp, &tarball).expect("move the tarball into the cache");
    tarball
}

/// What a command in a root did.
#[derive(Debug)]
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// The command line, for messages.
    pub what: String,
}

impl Run {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// stdout and stderr, for a failure message.
    pub fn output(&self) -> String {
        format!(
            "`{}` exited {:?}\n--- stdout ---\n{}--- stderr ---\n{}",
            self.what, self.code, self.stdout, self.stderr
        )
    }
}

/// One unpacked root of a Debian suite, removed when dropped.
pub struct DebRoot {
    _tmp: tempfile::TempDir,
    /// The root directory on this host.
    pub root: PathBuf,
    pub suite: String,
}

/// `unshare`'s shell: mounts a fresh `/proc` in the root (the namespace's
/// mounts vanish with its last process), then chroots. `$1` is the root,
/// the rest chroot's arguments after it.
const ENTER: &str = r#"root="$1"; shift
mount -t proc proc "$root/proc" || exit 125
exec chroot "$@""#;

impl DebRoot {
    /// A fresh root of `suite` with the user [`USER`] (home and runtime
    /// directory made).
    pub fn new(suite: &str) -> DebRoot {
        let tarball = base_tarball(suite);
        let tmp = tempfile::Builder::new()
            .prefix("cowork-debroot-")
            .tempdir()
            .expect("tempdir");
        // The user connects to the helper's socket under it.
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let root = tmp.path().join("root");
        fs::create_dir(&root).unwrap();
        let out = run_with_timeout(
            Command::new("tar")
                .arg("-C")
                .arg(&root)
                .args(["--numeric-owner", "-xf"])
                .arg(&tarball),
            COMMAND_LIMIT,
        )
        .expect("run tar");
        assert!(
            out.status.success(),
            "unpacking {} failed: {}",
            tarball.display(),
            out.stderr
        );
        let r = DebRoot {
            _tmp: tmp,
            root,
            suite: suite.to_string(),
        };
        r.append(
            "/etc/passwd",
            &format!("{USER}:x:{USER_UID}:{USER_GID}:cowork test user:{USER_HOME}:/bin/sh\n"),
        );
        r.append("/etc/group", &format!("{USER}:x:{USER_GID}:\n"));
        for (dir, mode) in [(USER_HOME, 0o755), (USER_RUNTIME_DIR, 0o700)] {
            let p = r.path(dir);
            fs::create_dir_all(&p).unwrap();
            chown(&p, Some(USER_UID), Some(USER_GID)).unwrap();
            fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        }
        r
    }

    /// Host path of `p` inside the root.
    pub fn path(&self, p: &str) -> PathBuf {
        self.root.join(p.trim_start_matches('/'))
    }

    /// The root's file `p` as text; panics saying which file could not be read.
    pub fn read(&self, p: &str) -> String {
        fs::read_to_string(self.path(p))
            .unwrap_or_else(|e| panic!("cannot read {p} in the {} root: {e}", self.suite))
    }

    /// Where the root's symlink `p` points; panics when it is not one.
    pub fn read_link(&self, p: &str) -> PathBuf {
        fs::read_link(self.path(p))
            .unwrap_or_else(|e| panic!("{p} in the {} root is not a symlink: {e}", self.suite))
    }

    /// Appends `text` to the root's file `p`.
    pub fn append(&self, p: &str, text: &str) {
        fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(self.path(p))
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .unwrap_or_else(|e| panic!("append to {p}: {e}"));
    }

    /// Writes `text` to the root's file `p` with `mode` (parents made).
    pub fn write(&self, p: &str, text: &str, mode: u32) {
        let host = self.path(p);
        fs::create_dir_all(host.parent().unwrap()).unwrap();
        fs::write(&host, text).unwrap_or_else(|e| panic!("write {p}: {e}"));
        fs::set_permissions(&host, fs::Permissions::from_mode(mode)).unwrap();
    }

    /// Copies the host file `from` to `/tmp/<its name>` in the root (mode
    /// 0644, so apt's unprivileged user can read it); returns that path.
    pub fn copy_in(&self, from: &Path) -> String {
        let name = from.file_name().unwrap().to_string_lossy().into_owned();
        let inside = format!("/tmp/{name}");
        fs::copy(from, self.path(&inside))
            .unwrap_or_else(|e| panic!("copy {} into the root: {e}", from.display()));
        fs::set_permissions(self.path(&inside), fs::Permissions::from_mode(0o644)).unwrap();
        inside
    }

    /// The command running `argv` in the root: as root, or as [`USER`] when
    /// `as_user`, with a clean environment plus `env`.
    pub fn command(&self, as_user: bool, env: &[(&str, &str)], argv: &[&str]) -> Command {
        let mut cmd = Command::new("unshare");
        cmd.args(["--mount", "--propagation", "private", "--", "/bin/sh", "-c"])
            .arg(ENTER)
            .arg("sh")
            .arg(&self.root);
        if as_user {
            cmd.arg(format!("--userspec={USER_UID}:{USER_GID}"));
        }
        cmd.arg(&self.root).args(["/usr/bin/env", "-i"]);
        let home = if as_user { USER_HOME } else { "/root" };
        cmd.arg("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .arg(format!("HOME={home}"))
            .arg("LC_ALL=C.UTF-8")
            .arg("DEBIAN_FRONTEND=noninteractive");
        if as_user {
            cmd.arg(format!("USER={USER}"))
                .arg(format!("LOGNAME={USER}"))
                .arg(format!("XDG_RUNTIME_DIR={USER_RUNTIME_DIR}"));
        }
        for (k, v) in env {
            cmd.arg(format!("{k}={v}"));
        }
        cmd.args(argv);
        cmd
    }

    fn run_cmd(&self, mut cmd: Command, what: String) -> Run {
        let TimedOutput {
            status,
            stdout,
            stderr,
            timed_out,
        } = run_with_timeout(&mut cmd, COMMAND_LIMIT)
            .unwrap_or_else(|e| panic!("cannot run `{what}` in the {} root: {e}", self.suite));
        assert!(
            !timed_out,
            "`{what}` did not finish within {COMMAND_LIMIT:?}:\n{stdout}{stderr}"
        );
        Run {
            code: status.code(),
            stdout,
            stderr,
            what,
        }
    }

    /// Runs `argv` as root in the root.
    pub fn run(&self, argv: &[&str]) -> Run {
        self.run_cmd(self.command(false, &[], argv), argv.join(" "))
    }

    /// Runs `argv` as [`USER`] in the root.
    pub fn run_as_user(&self, argv: &[&str]) -> Run {
        self.run_cmd(self.command(true, &[], argv), argv.join(" "))
    }

    /// Runs `argv` as root and asserts it succeeded; returns its stdout.
    pub fn ok(&self, argv: &[&str]) -> String {
        let r = self.run(argv);
        assert!(r.success(), "in the {} root: {}", self.suite, r.output());
        r.stdout
    }

    /// `sh -c script` as root.
    pub fn sh(&self, script: &str) -> Run {
        let mut r = self.run(&["/bin/sh", "-c", script]);
        r.what = script.to_string();
        r
    }

    /// `sh -c script` as root, asserted to succeed; returns its stdout.
    pub fn sh_ok(&self, script: &str) -> String {
        let r = self.sh(script);
        assert!(r.success(), "in the {} root: {}", self.suite, r.output());
        r.stdout
    }
}
