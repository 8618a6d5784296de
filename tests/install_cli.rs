//! `cowork-helper install` / `uninstall` and `doctor`'s client checks, run
//! as a user runs them: the real binary on a throwaway system root
//! (`--root`), with a stand-in client whose helper prints its version.
//! The module tests in `src/install/tests.rs` cover every classification;
//! these check what only the real binary shows: the client's path then
//! runs this helper, doctor follows the symlink or the copy to the guest
//! image, a read-only or foreign-owned directory gets one clear line and
//! leaves the official helper where it was.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const HELPER: &str = env!("CARGO_BIN_EXE_cowork-helper");
const RESOURCES: &str = "usr/lib/claude-desktop/resources";
const OFFICIAL_SCRIPT: &str = "#!/bin/sh\necho official cowork-linux-helper 1.0\n";

/// A system root with the stand-in client installed (its helper listed in
/// a dpkg database, as the client's .deb leaves it).
fn client_root() -> tempfile::TempDir {
    let root = tempfile::tempdir().expect("tempdir");
    let resources = root.path().join(RESOURCES);
    std::fs::create_dir_all(&resources).unwrap();
    let helper = resources.join("cowork-linux-helper");
    std::fs::write(&helper, OFFICIAL_SCRIPT).unwrap();
    std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let info = root.path().join("var/lib/dpkg/info");
    std::fs::create_dir_all(&info).unwrap();
    std::fs::write(
        info.join("claude-desktop.list"),
        format!("/usr/lib/claude-desktop/resources\n/{RESOURCES}/cowork-linux-helper\n"),
    )
    .unwrap();
    root
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("run")
}

fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn helper(args: &[&str]) -> Command {
    let mut c = Command::new(HELPER);
    c.args(args).env_remove("COWORK_GUEST_IMAGE_DIR");
    c
}

fn root_arg(root: &Path) -> String {
    root.display().to_string()
}

/// The line of `doctor`'s report starting with `key: `.
fn line<'a>(report: &'a str, key: &str) -> &'a str {
    report
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}: ")))
        .unwrap_or_else(|| panic!("no {key}: line in\n{report}"))
}

fn is_root() -> bool {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn the_clients_path_runs_this_helper_until_uninstall_puts_the_official_one_back() {
    let root = client_root();
    let r = root_arg(root.path());
    let path = root.path().join(RESOURCES).join("cowork-linux-helper");
    let out = run(helper(&["install", "--root", &r]).env("PATH", "/usr/bin:/bin"));
    assert!(out.status.success(), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("kept the official helper"), "{said}");
    assert!(
        said.contains("owned by dpkg package claude-desktop"),
        "{said}"
    );
    assert!(
        said.contains("etc/udev/rules.d/70-cowork-helper.rules"),
        "{said}"
    );

    // The client's path now runs this helper, under any name.
    let version = run(Command::new(&path).arg("--version"));
    assert!(
        String::from_utf8_lossy(&version.stdout).starts_with("cowork-helper "),
        "{}",
        text(&version)
    );
    // doctor through the client's path resolves /proc/self/exe: the same
    // guest image as this helper run directly, and "runs this helper".
    let client_dir = root.path().join(RESOURCES);
    let dir_arg = client_dir.display().to_string();
    let via_client = run(Command::new(&path)
        .args(["doctor", "--client-dir", &dir_arg])
        .env_remove("COWORK_GUEST_IMAGE_DIR"));
    let direct = run(&mut helper(&["doctor", "--client-dir", &dir_arg]));
    let (via_client, direct) = (
        String::from_utf8_lossy(&via_client.stdout).into_owned(),
        String::from_utf8_lossy(&direct.stdout).into_owned(),
    );
    assert_eq!(
        line(&via_client, "guest image"),
        line(&direct, "guest image")
    );
    assert!(
        line(&via_client, "client helper").contains("runs this helper"),
        "{via_client}"
    );
    assert!(
        line(&via_client, "client helper").contains("official helper is kept"),
        "{via_client}"
    );

    let out = run(&mut helper(&["uninstall", "--root", &r]));
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), OFFICIAL_SCRIPT);
    let official = run(&mut Command::new(&path));
    assert_eq!(
        String::from_utf8_lossy(&official.stdout),
        "official cowork-linux-helper 1.0\n"
    );
    assert!(!root
        .path()
        .join("etc/udev/rules.d/70-cowork-helper.rules")
        .exists());
    // doctor looks at the running system's package database, which does
    // not list this throwaway root's client: its script is not ours.
    let direct = run(&mut helper(&["doctor", "--client-dir", &dir_arg]));
    let report = String::from_utf8_lossy(&direct.stdout);
    assert!(
        line(&report, "client helper").contains("the client cannot start this helper"),
        "{report}"
    );
}

#[test]
fn a_copy_at_the_clients_path_finds_the_image_in_the_data_directory() {
    let dir = tempfile::tempdir().unwrap();
    let resources = dir.path().join("resources");
    std::fs::create_dir_all(&resources).unwrap();
    let copy = resources.join("cowork-linux-helper");
    std::fs::copy(HELPER, &copy).unwrap();
    let data = dir.path().join("data");
    let image = data.join("guest-image");
    std::fs::create_dir_all(&image).unwrap();
    std::fs::write(image.join("vmlinuz"), b"k").unwrap();
    std::fs::write(image.join("initramfs"), b"i").unwrap();
    std::fs::write(image.join("image-info"), "cowork-guest-image/1\n").unwrap();
    let out = run(Command::new(&copy)
        .arg("--data-dir")
        .arg(&data)
        .args(["doctor", "--client-dir"])
        .arg(&resources)
        .env_remove("COWORK_GUEST_IMAGE_DIR"));
    let report = String::from_utf8_lossy(&out.stdout);
    // A copy outside any checkout or bin directory: the system directory
    // (absent on this machine unless the package is installed) comes
    // before the data directory.
    if !Path::new("/usr/lib/cowork-helper/guest-image/image-info").exists() {
        assert_eq!(
            line(&report, "guest image"),
            format!("{} (your data directory)", image.display()),
            "{report}"
        );
    }
    assert!(
        line(&report, "client helper").contains("runs this helper"),
        "{report}"
    );
    // No rootfs anywhere: the initramfs userland, with the way out named.
    assert!(
        line(&report, "userland").contains("cowork-helper image build"),
        "{report}"
    );
}

#[test]
fn foreign_and_missing_clients_get_one_clear_line() {
    let root = client_root();
    let r = root_arg(root.path());
    let path = root.path().join(RESOURCES).join("cowork-linux-helper");
    // Someone else's wrapper, not listed by any package.
    std::fs::remove_dir_all(root.path().join("var/lib/dpkg")).unwrap();
    std::fs::write(&path, "#!/bin/sh\nexec node /opt/other/helper.js \"$@\"\n").unwrap();
    let out = run(&mut helper(&["install", "--root", &r]));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("neither the client's official helper nor cowork-helper"),
        "{err}"
    );
    assert!(std::fs::read_to_string(&path)
        .unwrap()
        .contains("/opt/other/helper.js"));

    let out = run(&mut helper(&[
        "install",
        "--root",
        &r,
        "--client-dir",
        "/opt/nowhere",
    ]));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/opt/nowhere does not exist"), "{err}");
}

#[test]
fn a_read_only_client_directory_changes_nothing() {
    if !is_root() {
        eprintln!("SKIP: a read-only bind mount needs root (CI runs as root)");
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run this test as root"
        );
        return;
    }
    let root = client_root();
    let resources = root.path().join(RESOURCES);
    let path = resources.join("cowork-linux-helper");
    let script = format!(
        "mount --bind {d} {d} && mount -o remount,bind,ro {d} && exec {h} install --root {r}",
        d = resources.display(),
        h = HELPER,
        r = root.path().display()
    );
    let out = run(Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .env_remove("COWORK_GUEST_IMAGE_DIR"));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("read-only file system"), "{err}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), OFFICIAL_SCRIPT);
    assert!(!resources.join("cowork-linux-helper.official").exists());
    assert!(!root.path().join("etc/udev").exists(), "nothing half done");
}

#[test]
fn a_user_without_rights_is_told_to_use_root() {
    if !is_root() {
        eprintln!("SKIP: acting as another user needs root (CI runs as root)");
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run this test as root"
        );
        return;
    }
    let root = client_root();
    // Readable and searchable by nobody, writable by root only.
    let mut p = root.path().to_path_buf();
    let mut dirs: Vec<PathBuf> = vec![p.clone()];
    for part in RESOURCES.split('/') {
        p = p.join(part);
        dirs.push(p.clone());
    }
    for d in &dirs {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let out = run(Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", HELPER])
        .args(["install", "--root"])
        .arg(root.path())
        .env_remove("COWORK_GUEST_IMAGE_DIR"));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("permission denied; run it as root"), "{err}");
    assert_eq!(
        std::fs::read_to_string(root.path().join(RESOURCES).join("cowork-linux-helper")).unwrap(),
        OFFICIAL_SCRIPT
    );
}
