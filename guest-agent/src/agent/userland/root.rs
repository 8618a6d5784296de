//! Checking that a mounted root filesystem can run sessions, and naming it.
//!
//! [`validate`] looks inside a mounted root (before anything is switched) for
//! what the Claude Code CLI and the client's session commands cannot do
//! without: GNU bash (busybox ash is refused by the CLI) at `/bin/bash` or
//! `/usr/bin/bash`, and the x86-64 dynamic loader. Every path is resolved
//! with `openat2(RESOLVE_IN_ROOT)` from the root's own directory, so
//! usr-merge symlinks (`/bin -> usr/bin`) and absolute links inside the image
//! resolve as they will after the switch, never into the initramfs.
//! [`pretty_name`] reads `PRETTY_NAME` from the root's `os-release`.
//!
//! Limits: a bash that exists but cannot run (wrong architecture, missing
//! libraries) passes; python, node and the rest are not checked (a
//! userland without them still runs the CLI).

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use crate::sys;

/// Where GNU bash may be, relative to the root, in order of preference.
pub const BASH_PATHS: [&str; 2] = ["bin/bash", "usr/bin/bash"];

/// The x86-64 glibc dynamic loader every dynamically linked program (the
/// CLI included) names as its interpreter.
pub const LOADER_PATH: &str = "lib64/ld-linux-x86-64.so.2";

/// Bytes GNU bash carries in its version string (`GNU bash, version …`);
/// busybox and other shells linked as `bash` do not.
pub const GNU_BASH_MARK: &[u8] = b"GNU bash";

/// Largest file read when looking for [`GNU_BASH_MARK`] (bash is ~1.3 MB).
pub const MAX_BASH_BYTES: u64 = 16 << 20;

/// Where `os-release` may be, relative to the root, in order.
pub const OS_RELEASE_PATHS: [&str; 2] = ["etc/os-release", "usr/lib/os-release"];

/// Largest `os-release` read.
const MAX_OS_RELEASE_BYTES: u64 = 64 * 1024;

/// Longest `PRETTY_NAME` reported (it goes to the host's log).
pub const MAX_PRETTY_NAME: usize = 128;

/// The four bytes every ELF file starts with.
const ELF_MAGIC: [u8; 4] = *b"\x7fELF";

/// Resolution for paths inside a root: `..` and absolute symlinks stay in it.
const RESOLVE_IN_ROOT: u64 = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;

/// Why a root cannot run sessions.
#[derive(Debug, thiserror::Error)]
pub enum RootError {
    #[error("cannot open the root {root}: {source}")]
    Open { root: PathBuf, source: io::Error },
    #[error("has no GNU bash (no executable /{} or /{})", BASH_PATHS[0], BASH_PATHS[1])]
    NoBash,
    #[error("/{path} is not GNU bash (busybox and other shells are refused by the CLI)")]
    NotGnuBash { path: &'static str },
    #[error("has no dynamic loader /{LOADER_PATH}: {source}")]
    NoLoader { source: io::Error },
    #[error("/{LOADER_PATH} is not an ELF file")]
    LoaderNotElf,
}

/// What [`validate`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Validated {
    /// Which of [`BASH_PATHS`] is GNU bash.
    pub bash: &'static str,
}

/// Opens the root directory `root` for resolving paths inside it.
fn open_root(root: &Path) -> Result<OwnedFd, RootError> {
    sys::open(root, libc::O_PATH | libc::O_DIRECTORY).map_err(|source| RootError::Open {
        root: root.to_path_buf(),
        source,
    })
}

/// Opens `path` (relative) for reading inside the root `dir`; a regular file only.
fn open_in_root(dir: &OwnedFd, path: &str) -> io::Result<File> {
    let c = sys::cstring(path)?;
    let fd = sys::openat2(
        dir.as_fd(),
        &c,
        libc::O_RDONLY | libc::O_NOCTTY,
        RESOLVE_IN_ROOT,
    )?;
    let st = sys::fstat(fd.as_fd())?;
    if !st.is_file() {
        return Err(io::Error::from_raw_os_error(libc::EISDIR));
    }
    Ok(File::from(fd))
}

/// Whether `haystack` contains `needle`.
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// Checks that the root mounted at `root` has GNU bash and the dynamic loader.
pub fn validate(root: &Path) -> Result<Validated, RootError> {
    let dir = open_root(root)?;
    let mut not_gnu = None;
    let mut bash = None;
    for path in BASH_PATHS {
        let Ok(file) = open_in_root(&dir, path) else {
            continue;
        };
        let executable = sys::fstat(file.as_fd()).is_ok_and(|st| st.mode & 0o111 != 0);
        let mut bytes = Vec::new();
        let read = file.take(MAX_BASH_BYTES).read_to_end(&mut bytes);
        if executable && read.is_ok() && contains(&bytes, GNU_BASH_MARK) {
            bash = Some(path);
            break;
        }
        not_gnu.get_or_insert(path);
    }
    let Some(bash) = bash else {
        return Err(match not_gnu {
            Some(path) => RootError::NotGnuBash { path },
            None => RootError::NoBash,
        });
    };
    let mut magic = [0u8; 4];
    open_in_root(&dir, LOADER_PATH)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map_err(|source| RootError::NoLoader { source })?;
    if magic != ELF_MAGIC {
        return Err(RootError::LoaderNotElf);
    }
    Ok(Validated { bash })
}

/// The `PRETTY_NAME` of the root mounted at `root`, from the first readable
/// of [`OS_RELEASE_PATHS`].
pub fn pretty_name(root: &Path) -> Option<String> {
    let dir = open_root(root).ok()?;
    OS_RELEASE_PATHS.iter().find_map(|path| {
        let mut text = String::new();
        open_in_root(&dir, path)
            .ok()?
            .take(MAX_OS_RELEASE_BYTES)
            .read_to_string(&mut text)
            .ok()?;
        parse_pretty_name(&text)
    })
}

/// `PRETTY_NAME` from `os-release` text (shell-style `KEY=value` lines,
/// value optionally in single or double quotes, backslash escapes in double
/// quotes). Control characters are dropped and the result is cut at
/// [`MAX_PRETTY_NAME`] characters; an empty value is `None`.
pub fn parse_pretty_name(text: &str) -> Option<String> {
    let raw = text
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("PRETTY_NAME="))?;
    let value: String = if let Some(inner) = raw.strip_prefix('"') {
        let mut out = String::new();
        let mut chars = inner.chars();
        while let Some(c) = chars.next() {
            match c {
                '"' => break,
                '\\' => out.extend(chars.next()),
                c => out.push(c),
            }
        }
        out
    } else if let Some(inner) = raw.strip_prefix('\'') {
        inner.split('\'').next().unwrap_or_default().to_string()
    } else {
        raw.to_string()
    };
    let clean: String = value
        .chars()
        .filter(|c| !c.is_control())
        .take(MAX_PRETTY_NAME)
        .collect();
    let clean = clean.trim();
    (!clean.is_empty()).then(|| clean.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, PermissionsExt};

    /// Writes `bytes` at `root/path` with `mode`, creating parents.
    fn put(root: &Path, path: &str, bytes: &[u8], mode: u32) {
        let p = root.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, bytes).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// A usr-merged root like Debian's: `/bin`, `/lib64` are links into `/usr`,
    /// and the loader link in `/usr/lib64` is absolute.
    fn merged_root(root: &Path) {
        put(
            root,
            "usr/bin/bash",
            b"\x7fELF...GNU bash, version 5.2",
            0o755,
        );
        put(
            root,
            "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
            b"\x7fELF\x02\x01",
            0o755,
        );
        std::fs::create_dir_all(root.join("usr/lib64")).unwrap();
        symlink(
            "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
            root.join("usr/lib64/ld-linux-x86-64.so.2"),
        )
        .unwrap();
        symlink("usr/bin", root.join("bin")).unwrap();
        symlink("usr/lib64", root.join("lib64")).unwrap();
    }

    #[test]
    fn a_usr_merged_root_with_absolute_links_is_valid() {
        let t = tempfile::tempdir().unwrap();
        merged_root(t.path());
        assert_eq!(validate(t.path()).unwrap(), Validated { bash: "bin/bash" });
    }

    #[test]
    fn links_resolve_inside_the_root_never_outside() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        // Outside the root, at the path an absolute link names: a valid bash.
        put(t.path(), "usr/bin/bash", b"GNU bash", 0o755);
        std::fs::create_dir_all(root.join("bin")).unwrap();
        // bin/bash -> the host's absolute path: resolves inside the root (missing).
        let abs = t.path().join("usr/bin/bash");
        symlink(&abs, root.join("bin/bash")).unwrap();
        // Escapes through .. stay at the root too.
        std::fs::create_dir_all(root.join("usr/bin")).unwrap();
        symlink("../../../usr/bin/bash", root.join("usr/bin/bash")).unwrap();
        assert!(matches!(validate(&root), Err(RootError::NoBash)));
    }

    #[test]
    fn busybox_bash_and_missing_loader_are_refused() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        // The initramfs's shape: bash is a link to busybox.
        put(root, "bin/busybox", b"\x7fELF BusyBox v1.36", 0o755);
        symlink("busybox", root.join("bin/bash")).unwrap();
        assert!(matches!(
            validate(root),
            Err(RootError::NotGnuBash { path: "bin/bash" })
        ));
        // A GNU bash that is not executable does not count either.
        put(root, "usr/bin/bash", b"GNU bash", 0o644);
        assert!(matches!(validate(root), Err(RootError::NotGnuBash { .. })));
        // A real bash at the second place, no loader.
        std::fs::set_permissions(
            root.join("usr/bin/bash"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        let e = validate(root).unwrap_err();
        assert!(matches!(e, RootError::NoLoader { .. }), "{e}");
        assert!(e.to_string().contains("/lib64/ld-linux-x86-64.so.2"), "{e}");
        // A loader that is not ELF; then a real one.
        put(root, "lib64/ld-linux-x86-64.so.2", b"#!/bin/sh", 0o755);
        assert!(matches!(validate(root), Err(RootError::LoaderNotElf)));
        put(root, "lib64/ld-linux-x86-64.so.2", b"\x7fELF", 0o755);
        assert_eq!(validate(root).unwrap().bash, "usr/bin/bash");
        // A directory is not bash; a missing root is an error naming it.
        assert!(matches!(
            validate(&root.join("nope")),
            Err(RootError::Open { .. })
        ));
    }

    #[test]
    fn the_real_hosts_bash_passes_when_there_is_one() {
        // This machine's own root: bash and the loader as the guest will see
        // them in a Debian or Ubuntu image.
        if !Path::new("/bin/bash").exists() || !Path::new("/lib64/ld-linux-x86-64.so.2").exists() {
            eprintln!("skipping: no GNU bash or x86-64 loader on this host");
            return;
        }
        validate(Path::new("/")).unwrap();
    }

    #[test]
    fn pretty_names_are_parsed_like_a_shell_would() {
        let debian = "PRETTY_NAME=\"Debian GNU/Linux 13 (trixie)\"\nNAME=\"Debian GNU/Linux\"\n";
        assert_eq!(
            parse_pretty_name(debian).as_deref(),
            Some("Debian GNU/Linux 13 (trixie)")
        );
        assert_eq!(
            parse_pretty_name("PRETTY_NAME='Ubuntu 22.04.5 LTS'").as_deref(),
            Some("Ubuntu 22.04.5 LTS")
        );
        assert_eq!(
            parse_pretty_name("PRETTY_NAME=Plain").as_deref(),
            Some("Plain")
        );
        assert_eq!(
            parse_pretty_name(r#"PRETTY_NAME="say \"hi\" \\o/""#).as_deref(),
            Some(r#"say "hi" \o/"#)
        );
        assert_eq!(parse_pretty_name("NAME=x\nPRETTY_NAME=\"\"\n"), None);
        assert_eq!(parse_pretty_name("NAME=x"), None);
        let long = format!("PRETTY_NAME=\"{}\x1b[31m\"", "a".repeat(500));
        let got = parse_pretty_name(&long).unwrap();
        assert_eq!(got.len(), MAX_PRETTY_NAME);
        assert!(!got.contains('\x1b'));
    }

    #[test]
    fn pretty_name_falls_back_to_usr_lib_and_stays_in_the_root() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        assert_eq!(pretty_name(root), None);
        put(
            root,
            "usr/lib/os-release",
            b"PRETTY_NAME=\"Debian GNU/Linux 13 (trixie)\"\n",
            0o644,
        );
        // Debian's /etc/os-release is a relative link to it.
        std::fs::create_dir_all(root.join("etc")).unwrap();
        symlink("../usr/lib/os-release", root.join("etc/os-release")).unwrap();
        assert_eq!(
            pretty_name(root).as_deref(),
            Some("Debian GNU/Linux 13 (trixie)")
        );
    }
}
