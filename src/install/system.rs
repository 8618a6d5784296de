//! The system files `install` writes beside the client's helper path, and
//! `uninstall` removes: the same three the Debian package ships (their
//! texts live in `packaging/`, shared with `scripts/build-deb.sh`).
//!
//! - a udev rule giving the logged-in user `/dev/vhost-vsock` as systemd
//!   gives `/dev/kvm` (the client's support check wants it);
//! - a modules-load entry for `vhost_vsock`;
//! - where AppArmor 4 is installed, a profile attached to this helper's
//!   executable that allows user namespaces (Ubuntu 24.04 restricts them
//!   for unprivileged programs; the sandbox backend needs them).
//!
//! Every file starts with [`HEADER`]; `uninstall` removes only files that
//! do. On the running system (`root` is `/`) udev is reloaded, the module
//! loaded and the profile loaded or unloaded, each best-effort: a failure
//! there is reported, never fatal (a container or chroot has no udev).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::under;

/// First line of every file `install` writes.
pub const HEADER: &str =
    "# Written by `cowork-helper install`; `cowork-helper uninstall` removes it.\n";
/// The udev rule (see `packaging/70-cowork-helper.rules`).
pub const UDEV_RULE: &str = include_str!("../../packaging/70-cowork-helper.rules");
/// The modules-load entry (see `packaging/modules-load.conf`).
pub const MODULES_LOAD: &str = include_str!("../../packaging/modules-load.conf");
/// The AppArmor profile, `@HELPER@` standing for the executable's path.
pub const APPARMOR_TEMPLATE: &str = include_str!("../../packaging/apparmor.in");
/// Where `install` puts the udev rule.
pub const UDEV_RULE_PATH: &str = "/etc/udev/rules.d/70-cowork-helper.rules";
/// Where `install` puts the modules-load entry.
pub const MODULES_LOAD_PATH: &str = "/etc/modules-load.d/cowork-helper.conf";
/// Where `install` puts the AppArmor profile.
pub const APPARMOR_PATH: &str = "/etc/apparmor.d/cowork-helper";
/// Present only where AppArmor 4 (which knows the `userns` rule) is.
pub const APPARMOR_ABI4: &str = "/etc/apparmor.d/abi/4.0";
/// Present when AppArmor is enabled in the running kernel.
const APPARMOR_SECURITYFS: &str = "/sys/kernel/security/apparmor";
/// The kernel module providing `/dev/vhost-vsock`.
const VHOST_VSOCK_MODULE: &str = "vhost_vsock";

/// Whether to touch system files at all (`--no-system-files` turns it off).
#[derive(Clone, Copy, Debug)]
pub struct SystemFiles {
    pub write: bool,
}

impl Default for SystemFiles {
    fn default() -> Self {
        SystemFiles { write: true }
    }
}

/// A system file could not be written or removed.
#[derive(Debug, thiserror::Error)]
pub enum SystemError {
    #[error("cannot write {path}: {source}{hint}")]
    Write {
        path: PathBuf,
        source: io::Error,
        hint: &'static str,
    },
    #[error("cannot remove {path}: {source}")]
    Remove { path: PathBuf, source: io::Error },
}

fn permission_hint(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) => " (run it as root, or pass --no-system-files)",
        _ => "",
    }
}

/// The AppArmor profile for the helper at `exe`.
pub fn apparmor_profile(exe: &Path) -> String {
    // AppArmor paths with spaces must be quoted.
    let exe = exe.to_string_lossy();
    let attach = if exe.contains(char::is_whitespace) {
        format!("\"{exe}\"")
    } else {
        exe.into_owned()
    };
    APPARMOR_TEMPLATE.replace("@HELPER@", &attach)
}

/// The files to write for the helper `exe` on the system under `root`.
fn files(root: &Path, exe: &Path) -> Vec<(PathBuf, String)> {
    let mut out = vec![
        (
            under(root, Path::new(UDEV_RULE_PATH)),
            UDEV_RULE.to_string(),
        ),
        (
            under(root, Path::new(MODULES_LOAD_PATH)),
            MODULES_LOAD.to_string(),
        ),
    ];
    if under(root, Path::new(APPARMOR_ABI4)).exists() {
        out.push((under(root, Path::new(APPARMOR_PATH)), apparmor_profile(exe)));
    }
    out
}

fn write_file(path: &Path, body: &str) -> Result<(), SystemError> {
    let err = |source: io::Error| SystemError::Write {
        path: path.to_path_buf(),
        hint: permission_hint(&source),
        source,
    };
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(err)?;
    }
    let tmp = path.with_extension("cowork-helper-tmp");
    fs::write(&tmp, format!("{HEADER}{body}")).map_err(err)?;
    fs::rename(&tmp, path).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        err(e)
    })
}

/// Whether `path` is a file `install` wrote.
fn is_ours(path: &Path) -> bool {
    fs::read_to_string(path)
        .map(|t| t.starts_with(HEADER))
        .unwrap_or(false)
}

/// Writes the files (see the module doc) and, on the running system,
/// applies them; returns what it did, line by line.
pub fn install(root: &Path, exe: &Path, opts: &SystemFiles) -> Result<Vec<String>, SystemError> {
    let mut lines = Vec::new();
    if !opts.write {
        lines.push("system files left alone (--no-system-files): /dev/vhost-vsock may stay inaccessible to the client's support check".into());
        return Ok(lines);
    }
    let files = files(root, exe);
    for (path, body) in &files {
        if path.exists() && !is_ours(path) {
            lines.push(format!(
                "left {} alone: it exists and was not written by cowork-helper",
                path.display()
            ));
            continue;
        }
        write_file(path, body)?;
        lines.push(format!("wrote {}", path.display()));
    }
    if !under(root, Path::new(APPARMOR_ABI4)).exists() {
        lines.push("no AppArmor profile: AppArmor 4 is not installed here (no /etc/apparmor.d/abi/4.0), and older AppArmor neither restricts user namespaces nor parses the rule".into());
    }
    if root == Path::new("/") {
        lines.extend(apply_installed());
    }
    Ok(lines)
}

/// Removes the files `install` wrote (unloading the profile first on the
/// running system); returns what it did.
pub fn uninstall(root: &Path, opts: &SystemFiles) -> Result<Vec<String>, SystemError> {
    let mut lines = Vec::new();
    if !opts.write {
        return Ok(lines);
    }
    for rel in [UDEV_RULE_PATH, MODULES_LOAD_PATH, APPARMOR_PATH] {
        let path = under(root, Path::new(rel));
        if !is_ours(&path) {
            continue;
        }
        if rel == APPARMOR_PATH && root == Path::new("/") && apparmor_enabled() {
            lines.push(run_quietly(
                "unloaded the AppArmor profile",
                Command::new("apparmor_parser").arg("-R").arg(&path),
            ));
        }
        fs::remove_file(&path).map_err(|source| SystemError::Remove {
            path: path.clone(),
            source,
        })?;
        lines.push(format!("removed {}", path.display()));
    }
    if root == Path::new("/") {
        lines.push(run_quietly(
            "reloaded udev's rules",
            Command::new("udevadm").args(["control", "--reload"]),
        ));
    }
    Ok(lines)
}

fn apparmor_enabled() -> bool {
    Path::new(APPARMOR_SECURITYFS).is_dir()
}

/// Applies the installed files on the running system.
fn apply_installed() -> Vec<String> {
    let mut lines = Vec::new();
    lines.push(run_quietly(
        "reloaded udev's rules",
        Command::new("udevadm").args(["control", "--reload"]),
    ));
    if !Path::new("/sys/module").join(VHOST_VSOCK_MODULE).exists() {
        lines.push(run_quietly(
            "loaded vhost_vsock",
            Command::new("modprobe").arg(VHOST_VSOCK_MODULE),
        ));
    }
    lines.push(run_quietly(
        "applied the udev rule to /dev/vhost-vsock",
        Command::new("udevadm").args([
            "trigger",
            "--action=add",
            "--subsystem-match=misc",
            "--sysname-match=vhost-vsock",
        ]),
    ));
    let profile = Path::new(APPARMOR_PATH);
    if profile.exists() && apparmor_enabled() {
        lines.push(run_quietly(
            "loaded the AppArmor profile",
            Command::new("apparmor_parser")
                .args(["-r", "-W"])
                .arg(profile),
        ));
    }
    lines
}

/// Runs `cmd`; `done` on success, else a note saying what failed.
fn run_quietly(done: &str, cmd: &mut Command) -> String {
    let program = cmd.get_program().to_string_lossy().into_owned();
    match cmd.output() {
        Ok(out) if out.status.success() => done.to_string(),
        Ok(out) => format!(
            "note: {program} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
        ),
        Err(e) => format!("note: could not run {program}: {e}"),
    }
}
