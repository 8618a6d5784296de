//! The Debian package (`scripts/build-deb.sh`) installed the way a user
//! installs it, in throwaway Debian roots (`support::debroot`: an
//! `mmdebstrap --variant=apt` root per test, dpkg and apt in a chroot inside
//! a private mount namespace; this machine's own dpkg state is never
//! touched), next to a stand-in `claude-desktop` package whose
//! `/usr/lib/claude-desktop/resources/cowork-linux-helper` is a script that
//! prints its version:
//!
//! - the client first, then ours with `apt-get install` (its Recommends
//!   resolve in the archive: `apt-get -s`): the client's path runs ours, the
//!   official helper is kept at `.official`, one diversion; `doctor` through
//!   the client's path finds the packaged guest image; the helper started as
//!   the client starts it (a user, stdin/stdout/stderr pipes, `-socket` in a
//!   0700 `XDG_RUNTIME_DIR`) answers a request and, once its stdin is
//!   closed, exits 0 and removes its socket within 10 s; a client upgrade
//!   keeps ours in place with the new official helper aside; an upgrade and
//!   a reinstall of ours keep one diversion; purge brings the official
//!   helper back and leaves no diversion and no file of ours;
//! - ours first (`cowork-helper install`/`uninstall` then leave the path to
//!   the package and say so), then the client; the client removed and
//!   installed again; ours removed (the diversion goes), purged (nothing
//!   more happens) and installed again;
//! - a foreign file and a dangling symlink at the client's path: kept aside
//!   and restored; the `.official` name taken, or a local diversion: one
//!   clear line and nothing changed; an unpack that fails after preinst
//!   diverted (a file conflict): `postrm abort-install` undoes it; the
//!   layouts `cowork-helper install` leaves (a symlink or a copy) are taken
//!   over cleanly;
//! - Debian 13 (trixie): installs; AppArmor 4 installed after us gets the
//!   profile (a dpkg trigger), which parses.
//!
//! Two checks were written before the work they check landed on main (the
//! packaged image lookup with `doctor`'s `guest image:` line, the stdin
//! end-of-file shutdown): they are made in passing and reported at the end
//! of their case, after every other check.
//!
//! The package: `$COWORK_TEST_DEB` when set (CI builds the release `.deb`
//! once), else `scripts/build-deb.sh --helper <this build's helper>`; the
//! upgrade is `build-deb.sh --version <version>.1` with the first package's
//! guest image. Gate: root, mmdebstrap and the Debian archive; a loud skip
//! without them unless `COWORK_PACKAGE_TESTS=1`.
//!
//! Not covered here: Ubuntu (no Ubuntu archive is reachable from the test
//! machines), a running udev, AppArmor loading and the `vhost_vsock` module
//! (skipped in a chroot by design, see `packaging/deb/postinst`), and an
//! upgrade of ours that fails halfway (`abort-upgrade` keeps the diversion
//! of the installed version; no file conflict can be staged for the upgrade
//! alone).

mod support;

use std::fs;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cowork_helper::client::Pipe;
use serde_json::{json, Value};
use support::debroot::{self, package_gate, DebRoot, Run, USER_GID, USER_RUNTIME_DIR, USER_UID};
use support::nested::{repo_root, run_with_timeout, script};
use vmm::sync::MutexExt;

const PACKAGE: &str = "cowork-helper";
/// Where the client starts its helper.
const CLIENT_HELPER: &str = "/usr/lib/claude-desktop/resources/cowork-linux-helper";
/// Where our diversion keeps the client's own helper.
const OFFICIAL: &str = "/usr/lib/claude-desktop/resources/cowork-linux-helper.official";
/// The packaged guest image.
const IMAGE_DIR: &str = "/usr/lib/cowork-helper/guest-image";
/// The line the stand-in client's helper prints.
fn official_line(version: &str) -> String {
    format!("official cowork-linux-helper {version}\n")
}
/// `dpkg-divert --list`'s line for our diversion.
fn our_diversion() -> String {
    format!("diversion of {CLIENT_HELPER} to {OFFICIAL} by {PACKAGE}")
}
/// apt-get options: no pty for dpkg's log (the roots have no /dev/pts).
const APT: [&str; 4] = ["apt-get", "-y", "-q", "-oDpkg::Use-Pty=0"];

fn prerequisites(test: &str) -> bool {
    package_gate(test, debroot::missing_prerequisites())
}

// --- the packages under test ---------------------------------------------------------------

/// Our two packages: the one under test and an upgrade of it.
struct Debs {
    ours: PathBuf,
    version: String,
    upgrade: PathBuf,
    upgrade_version: String,
}

fn deb_field(deb: &Path, field: &str) -> String {
    let out = Command::new("dpkg-deb")
        .arg("-f")
        .arg(deb)
        .arg(field)
        .output()
        .expect("run dpkg-deb -f");
    assert!(
        out.status.success(),
        "dpkg-deb -f {} {field}: {}",
        deb.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Where this test's packages are built: a directory of the target
/// directory that integration tests may use (replaced by every run).
fn scratch_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("package_deb")
}

/// `scripts/build-deb.sh args…` (quick gzip packages); the .deb it printed last.
fn build_deb(args: &[&str]) -> PathBuf {
    let mut cmd = Command::new(script("build-deb.sh"));
    cmd.args(args)
        .args(["--compression", "gzip", "--quiet", "--output"])
        .arg(scratch_dir())
        .arg("--helper")
        .arg(env!("CARGO_BIN_EXE_cowork-helper"));
    let out = run_with_timeout(&mut cmd, Duration::from_secs(1200)).expect("run build-deb.sh");
    assert!(
        out.status.success() && !out.timed_out,
        "build-deb.sh {args:?} failed ({}):\n{}{}",
        out.status,
        out.stdout,
        out.stderr
    );
    let deb = PathBuf::from(out.stdout.lines().last().unwrap_or_default());
    assert!(
        deb.is_file() && deb.extension().is_some_and(|e| e == "deb"),
        "build-deb.sh's last line is not a .deb: {:?}",
        out.stdout
    );
    deb
}

/// A guest image directory for build-deb.sh: `$COWORK_GUEST_IMAGE_DIR` or
/// the checkout's `target/guest-image` when it holds one (quick), else
/// none (build-deb.sh then builds an initramfs-only image).
fn image_dir_for_build() -> Option<PathBuf> {
    std::env::var_os("COWORK_GUEST_IMAGE_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .into_iter()
        .chain([repo_root().join("target/guest-image")])
        .find(|d| d.join("image-info").is_file())
}

fn debs() -> &'static Debs {
    static DEBS: OnceLock<Debs> = OnceLock::new();
    DEBS.get_or_init(|| {
        let ours = match std::env::var_os("COWORK_TEST_DEB").filter(|v| !v.is_empty()) {
            Some(d) => {
                let d = PathBuf::from(d);
                assert!(d.is_file(), "COWORK_TEST_DEB={} is not a file", d.display());
                d
            }
            None => {
                let image = image_dir_for_build();
                let mut args = Vec::new();
                if let Some(dir) = &image {
                    args = vec!["--image-dir", dir.to_str().expect("UTF-8 image path")];
                }
                build_deb(&args)
            }
        };
        let version = deb_field(&ours, "Version");
        // The upgrade: the same guest image, a higher version.
        let unpacked = tempfile::tempdir().expect("tempdir");
        let out = Command::new("dpkg-deb")
            .arg("-x")
            .arg(&ours)
            .arg(unpacked.path())
            .output()
            .expect("run dpkg-deb -x");
        assert!(out.status.success(), "dpkg-deb -x {}", ours.display());
        let image = unpacked.path().join(IMAGE_DIR.trim_start_matches('/'));
        let upgrade_version = format!("{version}.1");
        let upgrade = build_deb(&[
            "--version",
            &upgrade_version,
            "--image-dir",
            image.to_str().unwrap(),
        ]);
        Debs {
            ours,
            version,
            upgrade,
            upgrade_version,
        }
    })
}

/// A small `Architecture: all` package `name` of `version` holding `files`
/// (path, content, mode), built once per test run.
fn tiny_deb(name: &str, version: &str, files: &[(&str, &str, u32)]) -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    static LOCK: Mutex<()> = Mutex::new(());
    let _g = LOCK.locked();
    let dir = DIR.get_or_init(|| {
        let dir = scratch_dir().join("tiny");
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("mkdir the tiny packages' directory");
        dir
    });
    let deb = dir.join(format!("{name}_{version}_all.deb"));
    if deb.is_file() {
        return deb;
    }
    let tree = dir.join(format!("tree-{name}-{version}"));
    fs::create_dir_all(tree.join("DEBIAN")).expect("mkdir DEBIAN");
    fs::write(
        tree.join("DEBIAN/control"),
        format!(
            "Package: {name}\nVersion: {version}\nArchitecture: all\n\
             Maintainer: cowork-helper tests <tests@example.org>\n\
             Description: a package of cowork-helper's package tests\n"
        ),
    )
    .expect("write control");
    for (path, content, mode) in files {
        let host = tree.join(path.trim_start_matches('/'));
        fs::create_dir_all(host.parent().expect("a parent")).expect("mkdir");
        fs::write(&host, content).expect("write a file of the package");
        fs::set_permissions(&host, fs::Permissions::from_mode(*mode)).expect("chmod");
    }
    let out = Command::new("dpkg-deb")
        .args(["--root-owner-group", "-Zgzip", "--build"])
        .arg(&tree)
        .arg(&deb)
        .output()
        .expect("run dpkg-deb");
    assert!(
        out.status.success(),
        "building {name} {version}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    deb
}

/// The stand-in client package of `version`: the helper script, plus a file
/// of its own in the same directory.
fn client_deb(version: &str) -> PathBuf {
    let script = format!("#!/bin/sh\nprintf '%s' '{}'\n", official_line(version));
    tiny_deb(
        "claude-desktop",
        version,
        &[
            (CLIENT_HELPER, &script, 0o755),
            (
                "/usr/lib/claude-desktop/resources/app.asar",
                "stand-in\n",
                0o644,
            ),
        ],
    )
}

// --- checks on a root ------------------------------------------------------------------------

/// Installs `deb` with apt (dependencies from the archive, no Recommends);
/// returns how long it took.
fn apt_install(r: &DebRoot, deb: &Path) -> Duration {
    let inside = r.copy_in(deb);
    let t0 = Instant::now();
    let mut argv = APT.to_vec();
    argv.extend(["install", "--no-install-recommends", &inside]);
    r.ok(&argv);
    t0.elapsed()
}

/// `apt-get install` of `deb` that is expected to fail.
fn apt_install_fails(r: &DebRoot, deb: &Path) -> Run {
    let inside = r.copy_in(deb);
    let mut argv = APT.to_vec();
    argv.extend(["install", "--no-install-recommends", &inside]);
    let run = r.run(&argv);
    assert!(
        !run.success(),
        "the install should have failed: {}",
        run.output()
    );
    run
}

fn dpkg_i(r: &DebRoot, deb: &Path) {
    let inside = r.copy_in(deb);
    r.ok(&["dpkg", "-i", &inside]);
}

/// What `path` prints when run (with `--version`).
fn runs(r: &DebRoot, path: &str) -> String {
    let run = r.run(&[path, "--version"]);
    assert!(run.success(), "{}", run.output());
    run.stdout
}

fn assert_official_at(r: &DebRoot, path: &str, version: &str) {
    assert_eq!(
        runs(r, path),
        official_line(version),
        "{path} should be the client's official helper {version}"
    );
}

fn assert_ours_at_path(r: &DebRoot) {
    let host = r.path(CLIENT_HELPER);
    let target = r.read_link(CLIENT_HELPER);
    assert_eq!(
        host.parent().unwrap().join(&target).canonicalize().unwrap(),
        r.path("/usr/bin/cowork-helper").canonicalize().unwrap(),
        "{CLIENT_HELPER} -> {}",
        target.display()
    );
    let says = runs(r, CLIENT_HELPER);
    assert!(
        says.starts_with("cowork-helper "),
        "{CLIENT_HELPER} --version: {says:?}"
    );
}

/// `dpkg-divert --list` lines about the client's helper.
fn helper_diversions(r: &DebRoot) -> Vec<String> {
    r.ok(&["dpkg-divert", "--list"])
        .lines()
        .filter(|l| l.contains("cowork-linux-helper") || l.contains(PACKAGE))
        .map(str::to_string)
        .collect()
}

fn assert_one_diversion(r: &DebRoot) {
    assert_eq!(helper_diversions(r), vec![our_diversion()]);
}

fn assert_no_diversion(r: &DebRoot) {
    assert_eq!(helper_diversions(r), Vec::<String>::new());
}

fn present(p: &Path) -> bool {
    p.symlink_metadata().is_ok()
}

/// dpkg's status of our package (`not-installed` when it does not know it).
fn status(r: &DebRoot) -> String {
    let run = r.run(&[
        "dpkg-query",
        "-W",
        "--showformat=${db:Status-Status}",
        PACKAGE,
    ]);
    if run.success() {
        run.stdout
    } else {
        "not-installed".into()
    }
}

fn assert_audit_clean(r: &DebRoot) {
    let audit = r.ok(&["dpkg", "--audit"]);
    assert!(audit.trim().is_empty(), "dpkg --audit: {audit}");
}

/// Every line of a failed install that our maintainer scripts printed.
fn our_lines(run: &Run) -> Vec<String> {
    format!("{}{}", run.stdout, run.stderr)
        .lines()
        .filter(|l| l.starts_with(&format!("{PACKAGE}: ")))
        .map(str::to_string)
        .collect()
}

/// Purges ours and checks nothing of it is left: the paths `dpkg -L` listed
/// before are gone, or are directories another package owns (the client's
/// path holds the client's helper again, checked by the caller).
fn purge_and_check_nothing_left(r: &DebRoot) {
    let listed = r.ok(&["dpkg", "-L", PACKAGE]);
    let mut argv = APT.to_vec();
    argv.extend(["purge", PACKAGE]);
    r.ok(&argv);
    assert_no_diversion(r);
    assert!(
        !present(&r.path(OFFICIAL)),
        "{OFFICIAL} is left after the purge"
    );
    assert_eq!(status(r), "not-installed");
    for p in listed.lines().filter(|p| p.starts_with("/usr/")) {
        if p == CLIENT_HELPER {
            continue;
        }
        let host = r.path(p);
        if !present(&host) {
            continue;
        }
        assert!(
            host.is_dir(),
            "{p} (a file of ours) is left after the purge"
        );
        // A directory stays when another package owns it too, or when it
        // holds what is not ours (every file of ours is checked gone).
        let not_empty = fs::read_dir(&host).unwrap().next().is_some();
        assert!(
            not_empty || r.run(&["dpkg-query", "-S", p]).success(),
            "the empty directory {p} is left after the purge, owned by no other package"
        );
    }
    for p in [
        "/var/lib/cowork-helper",
        "/var/cache/cowork-helper",
        "/etc/apparmor.d/cowork-helper",
        "/usr/lib/udev/rules.d/70-cowork-helper.rules",
        "/usr/lib/modules-load.d/cowork-helper.conf",
        "/usr/bin/cowork-helper",
        IMAGE_DIR,
    ] {
        assert!(!present(&r.path(p)), "{p} is left after the purge");
    }
}

/// Whether `apt-get -s install` of `deb` (Recommends included) resolves
/// every Recommends in the root's archive.
fn assert_recommends_resolve(r: &DebRoot, deb: &Path) {
    let recommends = deb_field(deb, "Recommends");
    let arch = r.ok(&["dpkg", "--print-architecture"]).trim().to_string();
    let (qemu, firmware) = match arch.as_str() {
        "amd64" => ("qemu-system-x86", "ovmf"),
        "arm64" => ("qemu-system-arm", "qemu-efi-aarch64"),
        other => panic!("no expectation for architecture {other}"),
    };
    assert_eq!(
        recommends,
        format!(
            "{qemu}, {firmware}, virtiofsd | qemu-system-common, mmdebstrap, \
             debian-archive-keyring, uidmap"
        )
    );
    let inside = r.copy_in(deb);
    let mut argv = APT.to_vec();
    argv.extend(["-s", "install", &inside]);
    let sim = r.ok(&argv);
    let installs = |pkg: &str| sim.lines().any(|l| l.starts_with(&format!("Inst {pkg} ")));
    // debian-archive-keyring is there already on Debian (apt depends on it).
    for pkg in [qemu, firmware, "mmdebstrap", "uidmap", PACKAGE] {
        assert!(
            installs(pkg),
            "apt-get -s install does not install {pkg}:\n{sim}"
        );
    }
    assert!(
        installs("virtiofsd") || installs("qemu-system-common"),
        "apt-get -s install installs neither virtiofsd nor qemu-system-common:\n{sim}"
    );
}

fn assert_packaged_files(r: &DebRoot) {
    for f in ["vmlinuz", "initramfs", "image-info"] {
        assert!(
            r.path(IMAGE_DIR).join(f).is_file(),
            "{IMAGE_DIR}/{f} missing"
        );
    }
    let listed = r.ok(&["dpkg", "-L", PACKAGE]);
    assert!(
        !listed.contains("rootfs"),
        "the package holds a userland:\n{listed}"
    );
    let info = r.read(&format!("{IMAGE_DIR}/image-info"));
    assert!(
        info.starts_with("cowork-guest-image/1\n") && !info.contains("ROOTFS_"),
        "image-info: {info}"
    );
    let modules = r.read("/usr/lib/modules-load.d/cowork-helper.conf");
    assert!(
        modules.lines().any(|l| l.trim() == "vhost_vsock"),
        "{modules}"
    );
    let rule = r.read("/usr/lib/udev/rules.d/70-cowork-helper.rules");
    let rule_line = rule
        .lines()
        .find(|l| !l.starts_with('#') && !l.trim().is_empty())
        .unwrap_or_else(|| panic!("no rule in 70-cowork-helper.rules:\n{rule}"));
    for part in [
        r#"KERNEL=="vhost-vsock""#,
        r#"TAG+="uaccess""#,
        r#"GROUP="kvm""#,
        r#"MODE="0660""#,
    ] {
        assert!(
            rule_line.contains(part),
            "the udev rule lacks {part}: {rule_line}"
        );
    }
    let copyright = r.read("/usr/share/doc/cowork-helper/copyright");
    assert!(copyright.contains("License: Apache-2.0"), "{copyright}");
    let bin = fs::metadata(r.path("/usr/bin/cowork-helper")).unwrap();
    assert_eq!(bin.mode() & 0o7777, 0o755);
    assert_eq!((bin.uid(), bin.gid()), (0, 0));
}

// --- the helper as the client starts it ----------------------------------------------------

/// Runs `f` on a thread whose credentials are the root's user (Linux keeps
/// them per thread; the raw system calls change only this thread's), so
/// the helper's same-uid peer check lets it in.
fn as_user<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        // SAFETY: raw credential calls on this thread only; it ends after `f`.
        unsafe {
            assert_eq!(
                libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()),
                0
            );
            assert_eq!(
                libc::syscall(libc::SYS_setresgid, USER_GID, USER_GID, USER_GID),
                0
            );
            assert_eq!(
                libc::syscall(libc::SYS_setresuid, USER_UID, USER_UID, USER_UID),
                0
            );
        }
        f()
    })
    .join()
    .expect("the user's thread panicked")
}

/// The helper in a root, killed when dropped.
struct ChrootHelper {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Drop for ChrootHelper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- helper log ----\n{}", self.log.lock().unwrap());
        }
    }
}

/// Starts the helper through the client's path as the client does and
/// checks it serves (panics otherwise), then closes its stdin: `Err` says
/// how it did not exit 0 and remove its socket within 10 s.
fn client_session(r: &DebRoot) -> Result<(), String> {
    let socket_inside = format!("{USER_RUNTIME_DIR}/claude-cowork-vm.sock");
    let socket = r.path(&socket_inside);
    let mut cmd = r.command(
        true,
        &[],
        &[
            CLIENT_HELPER,
            "-socket",
            &socket_inside,
            "--backend",
            "sandbox",
        ],
    );
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start the helper in the root");
    let log = Arc::new(Mutex::new(String::new()));
    for stream in [
        Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
        Box::new(child.stderr.take().unwrap()),
    ] {
        let log = log.clone();
        std::thread::spawn(move || {
            let mut stream = stream;
            let mut buf = [0u8; 4096];
            while let Ok(n) = stream.read(&mut buf) {
                if n == 0 {
                    break;
                }
                log.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
    }
    let mut helper = ChrootHelper { child, log };
    let deadline = Instant::now() + Duration::from_secs(15);
    while !present(&socket) {
        if let Ok(Some(st)) = helper.child.try_wait() {
            panic!(
                "the helper exited ({st}) before making its socket:\n{}",
                helper.log.lock().unwrap()
            );
        }
        assert!(
            Instant::now() < deadline,
            "no socket at {socket_inside} within 15 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let meta = fs::symlink_metadata(&socket).expect("the socket's metadata");
    assert_eq!(
        meta.uid(),
        USER_UID,
        "the socket should belong to the user the helper runs as"
    );

    let sock = socket.clone();
    let reply: Result<Value, String> = as_user(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let pipe = Pipe::connect_profile(&sock, "package-test", "/home/user/.config/Claude")
                .await
                .map_err(|e| format!("connect and configure: {e}"))?;
            pipe.call("isRunning", json!({}))
                .await
                .map_err(|e| format!("isRunning: {e}"))
        })
    });
    let reply = reply.unwrap_or_else(|e| panic!("{e}\n{}", helper.log.lock().unwrap()));
    assert_eq!(reply["running"], json!(false), "isRunning: {reply}");

    // The client goes away: its end of the stdin pipe closes.
    drop(helper.child.stdin.take());
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = helper.child.try_wait().expect("wait for the helper") {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            return Err(format!(
                "the helper still ran 10 s after its stdin closed; its log:\n{}",
                helper.log.lock().unwrap()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = t0.elapsed();
    if status.code() != Some(0) {
        return Err(format!(
            "the helper exited with {status} after its stdin closed, not 0; its log:\n{}",
            helper.log.lock().unwrap()
        ));
    }
    if present(&socket) {
        return Err(format!(
            "the helper exited after its stdin closed but left its socket {socket_inside}"
        ));
    }
    eprintln!(
        "package_deb: the packaged helper exited {:.2} s after its stdin closed",
        took.as_secs_f64()
    );
    Ok(())
}

// --- the tests -------------------------------------------------------------------------------

#[test]
fn client_first_then_ours_upgrades_and_purge() {
    if !prerequisites("client_first_then_ours_upgrades_and_purge") {
        return;
    }
    let d = debs();
    let r = DebRoot::new("bookworm");
    // AppArmor 4's ABI marker (without AppArmor itself, which a chroot could
    // not load anyway): postinst installs the profile, postrm removes it.
    r.write("/etc/apparmor.d/abi/4.0", "", 0o644);

    dpkg_i(&r, &client_deb("1.0"));
    assert_official_at(&r, CLIENT_HELPER, "1.0");

    assert_recommends_resolve(&r, &d.ours);
    let took = apt_install(&r, &d.ours);
    eprintln!(
        "package_deb: {} is {} bytes ({:.1} MiB); apt-get install in the bookworm root took {:.1} s",
        d.ours.display(),
        fs::metadata(&d.ours).unwrap().len(),
        fs::metadata(&d.ours).unwrap().len() as f64 / 1048576.0,
        took.as_secs_f64()
    );
    assert_eq!(status(&r), "installed");
    assert_eq!(
        r.ok(&["dpkg-query", "-W", "--showformat=${Version}", PACKAGE]),
        d.version
    );
    assert_ours_at_path(&r);
    assert_official_at(&r, OFFICIAL, "1.0");
    assert_one_diversion(&r);
    assert_packaged_files(&r);
    assert_eq!(
        r.read("/etc/apparmor.d/cowork-helper"),
        r.read("/usr/share/cowork-helper/apparmor/cowork-helper"),
        "postinst should install the AppArmor profile where abi/4.0 exists"
    );

    // Two checks of work that lands on main on its own (the image lookup
    // with `doctor`'s line, the stdin end-of-file shutdown): their failures
    // are reported at the end, after every other check ran.
    let mut pending = Vec::new();
    // doctor through the client's path finds the packaged guest image.
    let doctor = r.run_as_user(&[CLIENT_HELPER, "doctor"]);
    match doctor
        .stdout
        .lines()
        .find(|l| l.starts_with("guest image: "))
    {
        None => pending.push(format!(
            "doctor has no 'guest image: ' line:\n{}",
            doctor.output()
        )),
        Some(line) => {
            let found = line.trim_start_matches("guest image: ");
            let ok = found == IMAGE_DIR
                || found
                    .strip_prefix(IMAGE_DIR)
                    .is_some_and(|rest| rest.starts_with([' ', '(', ';', ',']));
            if !ok {
                pending.push(format!(
                    "doctor through {CLIENT_HELPER} should find {IMAGE_DIR}: {line}"
                ));
            }
        }
    }

    if let Err(e) = client_session(&r) {
        pending.push(e);
    }

    // The client's upgrade lands aside; ours stays.
    dpkg_i(&r, &client_deb("1.1"));
    assert_ours_at_path(&r);
    assert_official_at(&r, OFFICIAL, "1.1");
    assert_one_diversion(&r);

    // Our upgrade, then a reinstall of it.
    apt_install(&r, &d.upgrade);
    assert_eq!(
        r.ok(&["dpkg-query", "-W", "--showformat=${Version}", PACKAGE]),
        d.upgrade_version
    );
    assert_one_diversion(&r);
    assert_ours_at_path(&r);
    assert_official_at(&r, OFFICIAL, "1.1");
    let inside = r.copy_in(&d.upgrade);
    let mut argv = APT.to_vec();
    argv.extend(["install", "--reinstall", &inside]);
    r.ok(&argv);
    assert_one_diversion(&r);
    assert_official_at(&r, OFFICIAL, "1.1");
    assert_audit_clean(&r);

    // What `image build` leaves as root goes with the purge.
    r.write("/var/lib/cowork-helper/userland/rootfs.img", "x", 0o644);
    r.write("/var/cache/cowork-helper/guest/x", "x", 0o644);
    purge_and_check_nothing_left(&r);
    assert_official_at(&r, CLIENT_HELPER, "1.1");
    assert_eq!(
        r.ok(&[
            "dpkg-query",
            "-W",
            "--showformat=${Version}",
            "claude-desktop"
        ]),
        "1.1"
    );
    assert_audit_clean(&r);
    assert!(
        pending.is_empty(),
        "everything else passed, but:\n{}",
        pending.join("\n")
    );
}

#[test]
fn ours_first_then_the_client_remove_purge_and_again() {
    if !prerequisites("ours_first_then_the_client_remove_purge_and_again") {
        return;
    }
    let d = debs();
    let r = DebRoot::new("bookworm");
    apt_install(&r, &d.ours);
    assert_ours_at_path(&r);
    assert!(!present(&r.path(OFFICIAL)), "{OFFICIAL} without a client");
    assert_one_diversion(&r);
    assert!(
        !present(&r.path("/etc/apparmor.d/cowork-helper")),
        "the AppArmor profile must not be installed without AppArmor 4 (abi/4.0)"
    );

    // `cowork-helper install` (for systems without the package) leaves the
    // packaged path alone and says the package manages it.
    let run = r.run(&["/usr/bin/cowork-helper", "install"]);
    assert!(
        format!("{}{}", run.stdout, run.stderr).contains("Debian package"),
        "cowork-helper install should say the package manages the path: {}",
        run.output()
    );
    let run = r.run(&["/usr/bin/cowork-helper", "uninstall"]);
    assert!(
        !run.success() && run.stderr.contains("apt remove"),
        "cowork-helper uninstall should refuse and point at apt: {}",
        run.output()
    );
    assert_ours_at_path(&r);
    assert_one_diversion(&r);
    assert!(!present(&r.path(OFFICIAL)), "install made {OFFICIAL}");
    for p in [
        "/etc/udev/rules.d/70-cowork-helper.rules",
        "/etc/modules-load.d/cowork-helper.conf",
    ] {
        assert!(!present(&r.path(p)), "install wrote {p} beside the package");
    }

    // The client comes after ours: its helper lands aside.
    dpkg_i(&r, &client_deb("1.0"));
    assert_ours_at_path(&r);
    assert_official_at(&r, OFFICIAL, "1.0");
    assert_one_diversion(&r);

    // The client goes and comes back (a newer one).
    r.ok(&["dpkg", "-r", "claude-desktop"]);
    assert!(
        !present(&r.path(OFFICIAL)),
        "the client's removal left {OFFICIAL}"
    );
    assert_ours_at_path(&r);
    assert_one_diversion(&r);
    dpkg_i(&r, &client_deb("1.1"));
    assert_official_at(&r, OFFICIAL, "1.1");
    assert_ours_at_path(&r);

    // Removed (not purged): the official helper is back, the diversion gone.
    r.ok(&["dpkg", "-r", PACKAGE]);
    assert_official_at(&r, CLIENT_HELPER, "1.1");
    assert!(!present(&r.path(OFFICIAL)));
    assert_no_diversion(&r);
    // The purge of the removed package changes nothing more.
    r.ok(&["dpkg", "-P", PACKAGE]);
    assert_official_at(&r, CLIENT_HELPER, "1.1");
    assert_no_diversion(&r);
    assert_eq!(status(&r), "not-installed");

    // And installed again.
    apt_install(&r, &d.upgrade);
    assert_ours_at_path(&r);
    assert_official_at(&r, OFFICIAL, "1.1");
    assert_one_diversion(&r);
    purge_and_check_nothing_left(&r);
    assert_official_at(&r, CLIENT_HELPER, "1.1");
    assert_audit_clean(&r);
}

#[test]
fn a_foreign_file_or_dangling_symlink_at_the_path_is_kept_aside() {
    if !prerequisites("a_foreign_file_or_dangling_symlink_at_the_path_is_kept_aside") {
        return;
    }
    let d = debs();
    let r = DebRoot::new("bookworm");
    let foreign = "#!/bin/sh\necho 'a helper copied here by hand'\n";
    r.write(CLIENT_HELPER, foreign, 0o750);

    apt_install(&r, &d.ours);
    assert_ours_at_path(&r);
    assert_eq!(r.read(OFFICIAL), foreign);
    assert_one_diversion(&r);
    purge_and_check_nothing_left(&r);
    assert_eq!(r.read(CLIENT_HELPER), foreign);
    assert_eq!(
        fs::metadata(r.path(CLIENT_HELPER)).unwrap().mode() & 0o7777,
        0o750
    );

    // A dangling symlink (say, to a helper since deleted).
    fs::remove_file(r.path(CLIENT_HELPER)).unwrap();
    std::os::unix::fs::symlink("/opt/gone/cowork-linux-helper", r.path(CLIENT_HELPER)).unwrap();
    apt_install(&r, &d.ours);
    assert_ours_at_path(&r);
    assert_eq!(
        r.read_link(OFFICIAL),
        PathBuf::from("/opt/gone/cowork-linux-helper")
    );
    assert_one_diversion(&r);
    purge_and_check_nothing_left(&r);
    assert_eq!(
        r.read_link(CLIENT_HELPER),
        PathBuf::from("/opt/gone/cowork-linux-helper")
    );
    assert_audit_clean(&r);
}

#[test]
fn refusals_and_failed_unpacks_leave_nothing_half_done() {
    if !prerequisites("refusals_and_failed_unpacks_leave_nothing_half_done") {
        return;
    }
    let d = debs();
    let r = DebRoot::new("bookworm");
    dpkg_i(&r, &client_deb("1.0"));

    // .official taken by something else.
    r.write(OFFICIAL, "not the official helper\n", 0o644);
    let run = apt_install_fails(&r, &d.ours);
    let lines = our_lines(&run);
    assert_eq!(
        lines.len(),
        1,
        "one line of ours expected: {}",
        run.output()
    );
    assert!(
        lines[0].contains(OFFICIAL) && lines[0].contains("then install cowork-helper again"),
        "{}",
        lines[0]
    );
    assert_eq!(status(&r), "not-installed", "{}", run.output());
    assert_no_diversion(&r);
    assert_official_at(&r, CLIENT_HELPER, "1.0");
    assert_eq!(r.read(OFFICIAL), "not the official helper\n");
    assert!(!present(&r.path("/usr/bin/cowork-helper")));
    assert_audit_clean(&r);
    fs::remove_file(r.path(OFFICIAL)).unwrap();

    // A local diversion of the path.
    r.ok(&[
        "dpkg-divert",
        "--local",
        "--rename",
        "--divert",
        &format!("{CLIENT_HELPER}.mine"),
        "--add",
        CLIENT_HELPER,
    ]);
    let run = apt_install_fails(&r, &d.ours);
    let lines = our_lines(&run);
    assert_eq!(
        lines.len(),
        1,
        "one line of ours expected: {}",
        run.output()
    );
    assert!(lines[0].contains("local diversion"), "{}", lines[0]);
    assert_eq!(status(&r), "not-installed");
    assert_eq!(
        r.ok(&["dpkg-divert", "--listpackage", CLIENT_HELPER])
            .trim(),
        "LOCAL"
    );
    assert_official_at(&r, &format!("{CLIENT_HELPER}.mine"), "1.0");
    assert_audit_clean(&r);
    r.ok(&[
        "dpkg-divert",
        "--local",
        "--rename",
        "--remove",
        CLIENT_HELPER,
    ]);
    assert_official_at(&r, CLIENT_HELPER, "1.0");

    // Unpacking fails after preinst diverted (another package owns a file of
    // ours): postrm abort-install puts the official helper back.
    dpkg_i(
        &r,
        &tiny_deb(
            "other-helper",
            "1",
            &[("/usr/bin/cowork-helper", "#!/bin/sh\necho other\n", 0o755)],
        ),
    );
    let run = apt_install_fails(&r, &d.ours);
    assert!(
        format!("{}{}", run.stdout, run.stderr)
            .contains("trying to overwrite '/usr/bin/cowork-helper'"),
        "the install should fail on the file conflict: {}",
        run.output()
    );
    assert_eq!(status(&r), "not-installed", "{}", run.output());
    assert_no_diversion(&r);
    assert_official_at(&r, CLIENT_HELPER, "1.0");
    assert!(!present(&r.path(OFFICIAL)), "abort-install left {OFFICIAL}");
    assert_audit_clean(&r);
    r.ok(&["dpkg", "-P", "other-helper"]);

    // What `cowork-helper install` leaves: the official helper at .official
    // and cowork-helper at the path, a symlink to it or a copy of it. Taken
    // over cleanly either way.
    for layout in ["symlink", "copy"] {
        fs::rename(r.path(CLIENT_HELPER), r.path(OFFICIAL)).unwrap();
        if layout == "symlink" {
            std::os::unix::fs::symlink("/usr/local/bin/cowork-helper", r.path(CLIENT_HELPER))
                .unwrap();
        } else {
            fs::copy(env!("CARGO_BIN_EXE_cowork-helper"), r.path(CLIENT_HELPER)).unwrap();
        }
        apt_install(&r, &d.ours);
        assert_ours_at_path(&r);
        assert_official_at(&r, OFFICIAL, "1.0");
        assert_one_diversion(&r);
        purge_and_check_nothing_left(&r);
        assert_official_at(&r, CLIENT_HELPER, "1.0");
        assert_audit_clean(&r);
    }
}

#[test]
fn installs_on_trixie_with_apparmor_4() {
    if !prerequisites("installs_on_trixie_with_apparmor_4") {
        return;
    }
    let d = debs();
    let r = DebRoot::new("trixie");
    // Fresh lists: the cached root may be older than the archive's packages.
    let mut argv = APT.to_vec();
    argv.push("update");
    r.ok(&argv);

    dpkg_i(&r, &client_deb("1.0"));
    assert_recommends_resolve(&r, &d.ours);
    let took = apt_install(&r, &d.ours);
    eprintln!(
        "package_deb: apt-get install in the trixie root took {:.1} s",
        took.as_secs_f64()
    );
    assert_ours_at_path(&r);
    assert_official_at(&r, OFFICIAL, "1.0");
    assert_one_diversion(&r);
    assert_packaged_files(&r);
    let profile = "/etc/apparmor.d/cowork-helper";
    assert!(
        !present(&r.path(profile)),
        "{profile} installed without AppArmor 4"
    );

    // AppArmor 4 comes after us: the trigger on /etc/apparmor.d/abi installs
    // the profile, which parses and names our profile.
    let mut argv = APT.to_vec();
    argv.extend(["install", "--no-install-recommends", "apparmor"]);
    r.ok(&argv);
    assert!(
        r.path("/etc/apparmor.d/abi/4.0").exists(),
        "trixie's apparmor has no abi/4.0"
    );
    assert!(
        present(&r.path(profile)),
        "installing apparmor after us did not install {profile} (the trigger)"
    );
    let names = r.ok(&["apparmor_parser", "--names", profile]);
    assert_eq!(names.trim(), "cowork-helper");
    r.ok(&[
        "apparmor_parser",
        "--skip-kernel-load",
        "--skip-cache",
        profile,
    ]);
    assert_audit_clean(&r);

    purge_and_check_nothing_left(&r);
    assert_official_at(&r, CLIENT_HELPER, "1.0");
    assert_audit_clean(&r);
}
