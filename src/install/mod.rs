//! `cowork-helper install` and `uninstall`: put this helper where the
//! desktop client starts its helper, for clients installed without our
//! Debian package (a tarball, AUR, an RPM repack, by hand), and take it
//! away again.
//!
//! The client always starts `<client dir>/cowork-linux-helper` (with the
//! official `.deb`, `/usr/lib/claude-desktop/resources`). `install` does
//! what the package's maintainer scripts do with `dpkg-divert --rename`:
//!
//! 1. the official helper at that path is renamed to
//!    `cowork-linux-helper.official` ([`KEPT_SUFFIX`], the name the package
//!    diverts it to), so it is kept byte for byte, inode and all;
//! 2. a symlink to this helper's executable takes its place (the helper
//!    resolves `/proc/self/exe`, so it finds its guest image wherever the
//!    client started it from);
//! 3. the system files the client's support check needs and we do not
//!    ship otherwise ([`system`]): a udev rule for `/dev/vhost-vsock`, a
//!    modules-load entry, and on AppArmor 4 systems a profile allowing user
//!    namespaces.
//!
//! `uninstall` renames the kept helper back over our symlink (so it is
//! restored exactly) and removes the files `install` wrote. Both are
//! idempotent. What is at the client's path is classified first
//! ([`inspect`]): this helper or another build of it, the official helper,
//! a dangling symlink, or something else, which is never overwritten: the
//! command stops with one line saying what it found and what to do.
//!
//! Limits: a package manager that owns the client's directory (pacman,
//! rpm, dpkg without our package) puts the official helper back on the
//! client's next upgrade; `install` says so and must be run again then
//! (the README shows a pacman hook). Where our Debian package manages the
//! path (its diversion exists), both commands refuse and point at apt.
//! What counts as "the official helper": a file a package manager lists,
//! or an executable ELF file that is not ours; scripts, symlinks elsewhere
//! and other files are someone else's.

pub mod system;

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The directory the official Debian package installs the client's
/// resources in (`process.resourcesPath` of the Electron app).
pub const CLIENT_DIR: &str = "/usr/lib/claude-desktop/resources";
/// The file name the client starts as its helper.
pub const CLIENT_HELPER: &str = "cowork-linux-helper";
/// Appended to [`CLIENT_HELPER`] for the kept official helper; the Debian
/// package diverts the client's file to the same name.
pub const KEPT_SUFFIX: &str = ".official";
/// Our Debian package's name (owner of its dpkg diversion).
pub const PACKAGE: &str = "cowork-helper";
/// Bytes every build of this helper carries (see [`is_cowork_helper`]):
/// how a copy of the helper at the client's path is told from a foreign
/// program. Never change it: older builds are recognised by it.
pub const IDENTITY: &[u8] =
    b"cowork-helper identity: the Claude cowork VM helper (cowork-helper project)";
/// dpkg's diversion database, relative to the root.
const DPKG_DIVERSIONS: &str = "var/lib/dpkg/diversions";
/// dpkg's per-package file lists, relative to the root.
const DPKG_INFO: &str = "var/lib/dpkg/info";
/// pacman's local package database, relative to the root.
const PACMAN_LOCAL: &str = "var/lib/pacman/local";
/// The ELF magic number.
const ELF_MAGIC: &[u8; 4] = b"\x7fELF";
/// Bytes of a foreign file quoted when saying what it is.
const QUOTE_LEN: usize = 60;

/// Why `install` or `uninstall` stopped. Each message says what was found
/// and what to do; nothing was left half done.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{dir} does not exist: is the Claude desktop client installed? Install it first, or pass --client-dir with the directory that holds its {CLIENT_HELPER}")]
    NoClientDir { dir: PathBuf },
    #[error("{0} is not a directory; pass --client-dir with the directory that holds the client's {CLIENT_HELPER}")]
    NotADirectory(PathBuf),
    #[error("{path} is {what}: it is neither the client's official helper nor cowork-helper, so it is left alone; move it away (or reinstall the client) and run this again")]
    Foreign { path: PathBuf, what: String },
    #[error("{path} is a dangling symlink to {target}: remove it (rm {path}) or reinstall the client, then run this again")]
    Dangling { path: PathBuf, target: PathBuf },
    #[error("our Debian package manages {path} (dpkg diversion to {kept}): {hint}")]
    PackageManaged {
        path: PathBuf,
        kept: PathBuf,
        hint: &'static str,
    },
    #[error(
        "{path} is {what}, which is not a kept official helper; move it away and run this again"
    )]
    KeptSlotTaken { path: PathBuf, what: String },
    #[error("{path} is not ours ({what}); nothing to uninstall there{kept_note}")]
    NotOurs {
        path: PathBuf,
        what: String,
        kept_note: String,
    },
    #[error("{what} {path}: permission denied; run it as root (sudo cowork-helper ...)")]
    PermissionDenied { what: &'static str, path: PathBuf },
    #[error("{what} {path}: read-only file system{hint}")]
    ReadOnly {
        what: &'static str,
        path: PathBuf,
        hint: &'static str,
    },
    #[error("cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot locate this helper's executable: {0}")]
    OwnExe(io::Error),
    #[error("this helper runs from the client's directory ({0}); run install from the helper's own location (e.g. /usr/local/bin/cowork-helper)")]
    RunFromClientDir(PathBuf),
    #[error(transparent)]
    System(#[from] system::SystemError),
}

/// Wraps an I/O error with what was being done, mapping permission and
/// read-only errors to their own, actionable messages.
fn io_error(what: &'static str, path: &Path, source: io::Error) -> InstallError {
    let path = path.to_path_buf();
    match source.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) => InstallError::PermissionDenied { what, path },
        Some(libc::EROFS) => InstallError::ReadOnly {
            what,
            path,
            hint: "; a Nix store or a read-only /usr cannot be changed in place: put the helper there through the client's own package (see README)",
        },
        _ => InstallError::Io { what, path, source },
    }
}

/// What `install` and `uninstall` work on.
#[derive(Clone, Debug)]
pub struct Target {
    /// The root of the system (`/`, or an image's root with `--root`).
    pub root: PathBuf,
    /// The client's resources directory, as seen from the running system.
    pub client_dir: PathBuf,
    /// This helper's executable, resolved.
    pub exe: PathBuf,
}

impl Target {
    /// The target for `--client-dir` (default [`CLIENT_DIR`]) under `root`.
    pub fn new(root: &Path, client_dir: Option<&Path>, exe: PathBuf) -> Target {
        let client_dir = client_dir
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(CLIENT_DIR));
        Target {
            root: root.to_path_buf(),
            client_dir,
            exe,
        }
    }

    /// The client's directory on this host's file system.
    pub fn dir(&self) -> PathBuf {
        under(&self.root, &self.client_dir)
    }

    /// The client's helper path on this host's file system.
    pub fn helper_path(&self) -> PathBuf {
        self.dir().join(CLIENT_HELPER)
    }

    /// Where the official helper is kept.
    pub fn kept_path(&self) -> PathBuf {
        self.dir().join(format!("{CLIENT_HELPER}{KEPT_SUFFIX}"))
    }

    /// The client's helper path as the running system names it (for
    /// package databases, which list paths from their own root).
    fn system_helper_path(&self) -> PathBuf {
        self.client_dir.join(CLIENT_HELPER)
    }
}

/// `path` (absolute, as the system under `root` names it) on this host.
pub fn under(root: &Path, path: &Path) -> PathBuf {
    match path.strip_prefix("/") {
        Ok(rel) => root.join(rel),
        Err(_) => root.join(path),
    }
}

/// What is at the client's helper path (or the kept path).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// Nothing, not even a symlink.
    Absent,
    /// This helper (a symlink to this executable, or this very file).
    ThisHelper,
    /// Another build of cowork-helper (a symlink to it, or a copy): `what`.
    OtherBuild(String),
    /// The client's own helper: `what` says why we think so.
    Official(String),
    /// A symlink whose target does not exist.
    Dangling(PathBuf),
    /// Anything else: `what` describes it.
    Foreign(String),
}

impl Found {
    /// Whether this is cowork-helper, this build or another.
    pub fn is_ours(&self) -> bool {
        matches!(self, Found::ThisHelper | Found::OtherBuild(_))
    }

    /// A few words for messages.
    pub fn describe(&self) -> String {
        match self {
            Found::Absent => "missing".into(),
            Found::ThisHelper => "this cowork-helper".into(),
            Found::OtherBuild(what) | Found::Official(what) | Found::Foreign(what) => what.clone(),
            Found::Dangling(t) => format!("a dangling symlink to {}", t.display()),
        }
    }
}

/// Who owns a file, according to a package manager.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    /// `dpkg`, `pacman` or `rpm`.
    pub manager: &'static str,
    /// The owning package.
    pub package: String,
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} package {}", self.manager, self.package)
    }
}

/// Whether `file` is a build of cowork-helper (carries [`IDENTITY`]).
pub fn is_cowork_helper(file: &Path) -> io::Result<bool> {
    let mut f = fs::File::open(file)?;
    let mut head = [0u8; 4];
    let n = f.read(&mut head)?;
    if n < 4 || &head != ELF_MAGIC {
        return Ok(false);
    }
    let mut rest = Vec::new();
    f.read_to_end(&mut rest)?;
    Ok(contains(&rest, IDENTITY))
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    let Some((&first, tail)) = needle.split_first() else {
        return true;
    };
    let mut at = 0;
    while let Some(i) = haystack[at..].iter().position(|&b| b == first) {
        let start = at + i + 1;
        if haystack.get(start..start + tail.len()) == Some(tail) {
            return true;
        }
        at = start;
    }
    false
}

/// Classifies what is at `path` for the helper `exe` on the system under
/// `root` (`system_path` is `path` as that system names it).
pub fn inspect(root: &Path, path: &Path, system_path: &Path, exe: &Path) -> Found {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Found::Absent,
        Err(e) => return Found::Foreign(format!("unreadable ({e})")),
    };
    if meta.file_type().is_symlink() {
        let target = fs::read_link(path).unwrap_or_default();
        let resolved = match fs::canonicalize(path) {
            Ok(r) => r,
            Err(_) => return Found::Dangling(target),
        };
        if same_file(&resolved, exe) {
            return Found::ThisHelper;
        }
        return match is_cowork_helper(&resolved) {
            Ok(true) => Found::OtherBuild(format!(
                "a symlink to another cowork-helper, {}",
                resolved.display()
            )),
            _ => Found::Foreign(format!(
                "a symlink to {} ({})",
                target.display(),
                describe_file(&resolved)
            )),
        };
    }
    if same_file(path, exe) {
        return Found::ThisHelper;
    }
    if !meta.is_file() {
        return Found::Foreign(describe_file(path));
    }
    if let Ok(true) = is_cowork_helper(path) {
        return Found::OtherBuild(format!("a copy of cowork-helper ({} bytes)", meta.len()));
    }
    if let Some(owner) = owner_of(root, system_path) {
        return Found::Official(format!("the client's helper (owned by {owner})"));
    }
    if meta.mode() & 0o111 != 0 && starts_with(path, ELF_MAGIC) {
        return Found::Official(format!(
            "the client's helper (an executable ELF file of {} bytes)",
            meta.len()
        ));
    }
    Found::Foreign(describe_file(path))
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

fn starts_with(path: &Path, magic: &[u8]) -> bool {
    let mut buf = vec![0u8; magic.len()];
    fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut buf))
        .is_ok()
        && buf == magic
}

/// A few words on what kind of file `path` is.
fn describe_file(path: &Path) -> String {
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) => return format!("unreadable ({e})"),
    };
    if meta.is_dir() {
        return "a directory".into();
    }
    if !meta.is_file() {
        return "a special file".into();
    }
    if meta.len() == 0 {
        return "an empty file".into();
    }
    let mut head = vec![0u8; QUOTE_LEN];
    let n = fs::File::open(path)
        .and_then(|mut f| f.read(&mut head))
        .unwrap_or(0);
    head.truncate(n);
    let exec = if meta.mode() & 0o111 != 0 {
        "an executable"
    } else {
        "a non-executable"
    };
    if head.starts_with(b"#!") {
        let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
        return format!(
            "{exec} script starting {:?}",
            String::from_utf8_lossy(line).trim_end()
        );
    }
    if head.starts_with(ELF_MAGIC) {
        return format!("{exec} ELF file of {} bytes", meta.len());
    }
    format!("{exec} file of {} bytes", meta.len())
}

/// The package that owns `system_path` on the system under `root`, from
/// dpkg's and pacman's databases (read directly, so `--root` works) or,
/// on the running system, `rpm -qf`.
pub fn owner_of(root: &Path, system_path: &Path) -> Option<Owner> {
    let wanted = system_path.to_string_lossy().into_owned();
    if let Ok(entries) = fs::read_dir(root.join(DPKG_INFO)) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(pkg) = name.strip_suffix(".list") else {
                continue;
            };
            if pkg.split(':').next() == Some(PACKAGE) {
                continue;
            }
            if let Ok(text) = fs::read_to_string(e.path()) {
                if text.lines().any(|l| l == wanted) {
                    let package = pkg.split(':').next().unwrap_or(pkg).to_string();
                    return Some(Owner {
                        manager: "dpkg",
                        package,
                    });
                }
            }
        }
    }
    let relative = wanted.trim_start_matches('/');
    if let Ok(entries) = fs::read_dir(root.join(PACMAN_LOCAL)) {
        for e in entries.flatten() {
            if let Ok(text) = fs::read_to_string(e.path().join("files")) {
                if text.lines().any(|l| l.trim_end_matches('/') == relative) {
                    let dir = e.file_name().to_string_lossy().into_owned();
                    // name-version-release
                    let package = dir.rsplitn(3, '-').nth(2).unwrap_or(&dir).to_string();
                    return Some(Owner {
                        manager: "pacman",
                        package,
                    });
                }
            }
        }
    }
    if root == Path::new("/") {
        let out = std::process::Command::new("rpm")
            .args(["-qf", "--queryformat", "%{NAME}"])
            .arg(system_path)
            .stderr(std::process::Stdio::null())
            .output()
            .ok()?;
        let name = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !name.is_empty() {
            return Some(Owner {
                manager: "rpm",
                package: name,
            });
        }
    }
    None
}

/// The diversion our Debian package made of `system_path`, if any: where
/// dpkg keeps the diverted file.
pub fn package_diversion(root: &Path, system_path: &Path) -> Option<PathBuf> {
    let text = fs::read_to_string(root.join(DPKG_DIVERSIONS)).ok()?;
    let lines: Vec<&str> = text.lines().collect();
    lines.chunks(3).find_map(|entry| match entry {
        [from, to, package] if Path::new(from) == system_path && *package == PACKAGE => {
            Some(PathBuf::from(to))
        }
        _ => None,
    })
}

/// What `install` or `uninstall` did, line by line, for the user.
#[derive(Debug, Default)]
pub struct Report {
    pub lines: Vec<String>,
}

impl Report {
    fn say(&mut self, line: impl Into<String>) {
        self.lines.push(line.into());
    }
}

/// Refuses when our Debian package manages the path.
fn refuse_if_packaged(t: &Target, hint: &'static str) -> Result<(), InstallError> {
    match package_diversion(&t.root, &t.system_helper_path()) {
        Some(kept) => Err(InstallError::PackageManaged {
            path: t.helper_path(),
            kept,
            hint,
        }),
        None => Ok(()),
    }
}

/// `install`: see the module doc. `system_files` also writes the udev,
/// modules-load and AppArmor files (see [`system`]).
pub fn install(t: &Target, system_files: &system::SystemFiles) -> Result<Report, InstallError> {
    let mut report = Report::default();
    if t.exe.starts_with(t.dir()) {
        return Err(InstallError::RunFromClientDir(t.exe.clone()));
    }
    let dir = t.dir();
    match fs::metadata(&dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(InstallError::NotADirectory(dir)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(InstallError::NoClientDir { dir })
        }
        Err(e) => return Err(io_error("inspect", &dir, e)),
    }
    if let Err(e) = refuse_if_packaged(
        t,
        "nothing to do here; `apt install cowork-helper` keeps it up to date, `apt remove cowork-helper` undoes it",
    ) {
        return match inspect(&t.root, &t.helper_path(), &t.system_helper_path(), &t.exe) {
            found if found.is_ours() => {
                report.say(format!(
                    "{} is already cowork-helper, managed by our Debian package",
                    t.helper_path().display()
                ));
                Ok(report)
            }
            _ => Err(e),
        };
    }
    let path = t.helper_path();
    let kept = t.kept_path();
    let found = inspect(&t.root, &path, &t.system_helper_path(), &t.exe);
    let kept_before = kept_official(&kept)?;
    match found {
        Found::Foreign(what) => return Err(InstallError::Foreign { path, what }),
        Found::Dangling(target) => return Err(InstallError::Dangling { path, target }),
        Found::Official(what) => {
            // Kept aside first; an older kept copy (the client was upgraded
            // since) is replaced by the current one in the same rename.
            let replacing = kept_before;
            fs::rename(&path, &kept)
                .map_err(|e| io_error("keep the official helper as", &kept, e))?;
            report.say(format!(
                "kept the official helper ({what}) as {}{}",
                kept.display(),
                if replacing {
                    " (replacing the older copy kept before the client's last upgrade)"
                } else {
                    ""
                }
            ));
            if let Err(e) = place_link(&path, &t.exe) {
                // Put it back: never leave the client without a helper.
                let _ = fs::rename(&kept, &path);
                return Err(e);
            }
            report.say(format!("{} -> {}", path.display(), t.exe.display()));
        }
        Found::Absent => {
            place_link(&path, &t.exe)?;
            report.say(format!("{} -> {}", path.display(), t.exe.display()));
            if !kept_before {
                report.say(format!(
                    "note: there was no official helper at {}; uninstall will leave the path empty",
                    path.display()
                ));
            }
        }
        Found::ThisHelper => report.say(format!(
            "{} already runs this helper ({})",
            path.display(),
            t.exe.display()
        )),
        Found::OtherBuild(what) => {
            place_link(&path, &t.exe)?;
            report.say(format!(
                "{} -> {} (was {what})",
                path.display(),
                t.exe.display()
            ));
        }
    }
    if let Some(owner) =
        owner_of(&t.root, &t.system_helper_path()).or_else(|| owner_of(&t.root, &t.client_dir))
    {
        report.say(format!(
            "note: {owner} owns {}: its next upgrade puts the official helper back at {}; run `sudo cowork-helper install` again after upgrading it (or use a package-manager hook, see README)",
            t.client_dir.display(),
            path.display()
        ));
    }
    for line in system::install(&t.root, &t.exe, system_files)? {
        report.say(line);
    }
    Ok(report)
}

/// Whether the kept slot holds a kept official helper. It is our name, so
/// any regular file there is one (an earlier install's, or dpkg's when our
/// package was removed without its scripts); anything else is refused.
fn kept_official(kept: &Path) -> Result<bool, InstallError> {
    match fs::symlink_metadata(kept) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_error("inspect", kept, e)),
        Ok(m) if m.is_file() && !matches!(is_cowork_helper(kept), Ok(true)) => Ok(true),
        Ok(m) => Err(InstallError::KeptSlotTaken {
            path: kept.to_path_buf(),
            what: if m.file_type().is_symlink() {
                format!(
                    "a symlink to {}",
                    fs::read_link(kept).unwrap_or_default().display()
                )
            } else if m.is_file() {
                "a copy of cowork-helper".into()
            } else {
                describe_file(kept)
            },
        }),
    }
}

/// Puts a symlink to `exe` at `path`, replacing what is there in one
/// rename (a temporary name beside it first).
fn place_link(path: &Path, exe: &Path) -> Result<(), InstallError> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    let tmp = dir.join(format!(
        ".{CLIENT_HELPER}.cowork-helper-{}",
        std::process::id()
    ));
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(exe, &tmp).map_err(|e| io_error("create a symlink in", dir, e))?;
    fs::rename(&tmp, path).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        io_error("replace", path, e)
    })
}

/// `uninstall`: see the module doc.
pub fn uninstall(t: &Target, system_files: &system::SystemFiles) -> Result<Report, InstallError> {
    let mut report = Report::default();
    refuse_if_packaged(
        t,
        "remove the package instead (`sudo apt remove cowork-helper`), which puts the official helper back",
    )?;
    let path = t.helper_path();
    let kept = t.kept_path();
    let found = inspect(&t.root, &path, &t.system_helper_path(), &t.exe);
    let kept_exists = fs::symlink_metadata(&kept).is_ok();
    let restore = |report: &mut Report| -> Result<(), InstallError> {
        fs::rename(&kept, &path)
            .map_err(|e| io_error("restore the official helper to", &path, e))?;
        report.say(format!(
            "restored the official helper to {} (from {})",
            path.display(),
            kept.display()
        ));
        Ok(())
    };
    match found {
        found if found.is_ours() => {
            if kept_exists {
                restore(&mut report)?;
            } else {
                fs::remove_file(&path).map_err(|e| io_error("remove", &path, e))?;
                report.say(format!(
                    "removed {}; no official helper had been kept: reinstall the client to get it back",
                    path.display()
                ));
            }
        }
        Found::Absent if kept_exists => restore(&mut report)?,
        Found::Absent => report.say(format!(
            "{} is not installed at {}; nothing to restore",
            PACKAGE,
            path.display()
        )),
        Found::Official(what) => {
            // The client was upgraded since install: its new helper is in
            // place, and the copy we kept is an older one of ours to drop.
            if kept_exists {
                fs::remove_file(&kept).map_err(|e| io_error("remove", &kept, e))?;
                report.say(format!(
                    "{} is already the official helper ({what}); removed the older copy kept at {}",
                    path.display(),
                    kept.display()
                ));
            } else {
                report.say(format!(
                    "{} is already the official helper ({what})",
                    path.display()
                ));
            }
        }
        other => {
            return Err(InstallError::NotOurs {
                path,
                what: other.describe(),
                kept_note: if kept_exists {
                    format!("; the official helper is still kept at {}", kept.display())
                } else {
                    String::new()
                },
            })
        }
    }
    for line in system::uninstall(&t.root, system_files)? {
        report.say(line);
    }
    Ok(report)
}

#[cfg(test)]
mod tests;
