//! The sandbox's root file system, built by its PID 1 inside the fresh user,
//! mount and pid namespaces, then entered with `pivot_root`.
//!
//! The root is a tmpfs, mounted at [`STAGE`] of the sandbox's own (private)
//! mount namespace, holding:
//!
//! | path | what |
//! | --- | --- |
//! | `/usr`, `/etc`, `/bin`, `/sbin`, `/lib*` | host's, recursive binds, read-only (symlinks stay symlinks) |
//! | `/usr/local/bin` | empty writable tmpfs (the agent installs the CLI there) |
//! | `/proc` | a new proc of the sandbox's pid namespace |
//! | `/dev` | tmpfs with the host's null, zero, full, random, urandom, tty; devpts; shm |
//! | `/tmp`, `/run` | empty private tmpfs (`/run` carries a `/etc/resolv.conf` that links into it) |
//! | `/sessions` | host sessions directory, recursive read-write bind, shared propagation |
//! | `/.host` | host `/`, recursive read-write bind, for the agent only |
//!
//! The root itself is then made read-only. Read-only binds keep the
//! `nosuid`/`nodev`/`noexec`/atime flags of their source, which a user
//! namespace may not clear, and cover every submount.
//!
//! Limits: needs a proc mount of the host that is fully visible (container
//! runtimes that mask parts of `/proc` forbid mounting a new one) and a root
//! that `pivot_root` accepts (not an initramfs rootfs). A host `/usr/local/bin`
//! is hidden by the writable tmpfs; without one the agent cannot install there.

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::sys;
use super::wire::{Context, Failure, Stage};
use super::HOST_ROOT;

/// Where the root tmpfs is mounted before `pivot_root`. This is a mount in the
/// sandbox's private mount namespace: the host's `/tmp` is untouched.
const STAGE: &str = "/tmp";

/// Host directories exposed read-only, when present.
const SYSTEM_DIRS: [&str; 8] = [
    "usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32",
];

/// Device nodes bound from the host's `/dev`, when present.
const DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

/// Symlinks created in `/dev` (name, target).
const DEV_LINKS: [(&str, &str); 4] = [
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
];

/// Files of `/etc` that may link into `/run` (systemd-resolved's DNS stub);
/// their targets are carried into the private `/run`.
const ETC_FILES_LINKING_INTO_RUN: [&str; 1] = ["resolv.conf"];

/// Options of the root tmpfs; it only holds directories and symlinks.
const ROOT_TMPFS: &str = "mode=0755,size=1m";

/// Options of `/tmp` and `/dev/shm`.
const STICKY_TMPFS: &str = "mode=1777";

/// Options of `/dev`, `/run` and `/usr/local/bin`.
const PLAIN_TMPFS: &str = "mode=0755";

/// Options of the sandbox's own devpts instance.
const DEVPTS: &str = "newinstance,ptmxmode=0666,mode=0620";

/// Builds the root and enters it. On return the process's root and working
/// directory are the sandbox's `/`, and the host's tree is only reachable at
/// [`HOST_ROOT`].
pub fn build_and_enter(sessions_dir: &Path) -> Result<(), Failure> {
    // Opened before anything is mounted over `/tmp`, where it may live.
    let sessions = sys::open(sessions_dir, libc::O_PATH | libc::O_DIRECTORY)
        .context(Stage::Root, || {
            format!("open the sessions directory {}", sessions_dir.display())
        })?;
    let sessions_src = PathBuf::from(format!("/proc/self/fd/{}", sessions.as_raw_fd()));
    // Canonical, so the copy of it under `/.host` is addressed without
    // following a symlink out of `/.host`.
    let stage = fs::canonicalize(STAGE).context(Stage::Root, || format!("resolve {STAGE}"))?;
    let root = stage.as_path();

    tmpfs(root, libc::MS_NOSUID | libc::MS_NODEV, ROOT_TMPFS)?;

    bind_host_root(root, &stage)?;
    let readonly = bind_system_dirs(root)?;
    remount_readonly_trees(&readonly)?;
    usr_local_bin(root)?;

    let proc_dir = mkdir(root, "proc")?;
    sys::mount(
        Some(Path::new("proc")),
        &proc_dir,
        Some("proc"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    )
    .context(Stage::Root, || {
        "mount a new /proc (needs a fully visible /proc on the host: container runtimes that mask \
         /proc paths forbid it)"
            .to_string()
    })?;

    dev(root)?;
    let tmp = mkdir(root, "tmp")?;
    tmpfs(&tmp, libc::MS_NOSUID | libc::MS_NODEV, STICKY_TMPFS)?;
    let run = mkdir(root, "run")?;
    tmpfs(&run, libc::MS_NOSUID | libc::MS_NODEV, PLAIN_TMPFS)?;
    carry_run_links(root);

    let sessions_dst = mkdir(root, "sessions")?;
    bind(&sessions_src, &sessions_dst)?;
    // Mounts the agent adds later under /sessions reach the mount
    // namespaces of the session processes.
    sys::mount(
        None,
        &sessions_dst,
        None,
        libc::MS_SHARED | libc::MS_REC,
        None,
    )
    .context(Stage::Root, || "make /sessions a shared mount".to_string())?;
    drop(sessions);

    sys::mount(
        None,
        root,
        None,
        libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
        None,
    )
    .context(Stage::Root, || {
        "make the sandbox root read-only".to_string()
    })?;

    enter(root)
}

/// Binds the host's `/` at `/.host`, before anything else is mounted in the
/// root: the recursive copy then holds one copy of the (empty) root tmpfs
/// itself, at `.host/<stage>`, which is removed to uncover the host's own.
fn bind_host_root(root: &Path, stage: &Path) -> Result<(), Failure> {
    let host = mkdir(root, HOST_ROOT.trim_start_matches('/'))?;
    bind(Path::new("/"), &host)?;
    let copy = host.join(stage.strip_prefix("/").unwrap_or(stage));
    sys::umount2(&copy, libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW).context(Stage::Root, || {
        format!("remove the sandbox root's own copy at {}", copy.display())
    })
}

/// Binds or re-links the host's system directories; returns the bound ones.
fn bind_system_dirs(root: &Path) -> Result<Vec<PathBuf>, Failure> {
    let mut bound = Vec::new();
    for name in SYSTEM_DIRS {
        let src = Path::new("/").join(name);
        let meta = match fs::symlink_metadata(&src) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(Failure::new(
                    Stage::Root,
                    format!("inspect {}", src.display()),
                    &e,
                ))
            }
        };
        let dst = root.join(name);
        if meta.file_type().is_symlink() {
            // Merged-/usr systems: /bin -> usr/bin and the like.
            let target = fs::read_link(&src)
                .context(Stage::Root, || format!("read the link {}", src.display()))?;
            std::os::unix::fs::symlink(&target, &dst).context(Stage::Root, || {
                format!("link {} -> {}", dst.display(), target.display())
            })?;
        } else if meta.is_dir() {
            let dst = mkdir(root, name)?;
            bind(&src, &dst)?;
            bound.push(dst);
        } else {
            tracing::warn!(path = %src.display(), "not a directory or symlink; left out of the sandbox");
        }
    }
    Ok(bound)
}

/// An empty writable tmpfs over the read-only `/usr/local/bin`.
fn usr_local_bin(root: &Path) -> Result<(), Failure> {
    let dir = root.join("usr/local/bin");
    if dir.is_dir() {
        tmpfs(&dir, libc::MS_NOSUID | libc::MS_NODEV, PLAIN_TMPFS)
    } else {
        tracing::warn!("the host has no /usr/local/bin; the sandbox has no writable one");
        Ok(())
    }
}

/// `/dev`: a tmpfs with the host's harmless device nodes, a private devpts
/// (best effort: some kernels refuse it in a user namespace) and `/dev/shm`.
fn dev(root: &Path) -> Result<(), Failure> {
    let dev = mkdir(root, "dev")?;
    tmpfs(&dev, libc::MS_NOSUID | libc::MS_NOEXEC, PLAIN_TMPFS)?;
    for name in DEVICES {
        let src = Path::new("/dev").join(name);
        if !src.exists() {
            continue;
        }
        let dst = dev.join(name);
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&dst)
            .context(Stage::Root, || format!("create {}", dst.display()))?;
        bind(&src, &dst)?;
    }
    for (name, target) in DEV_LINKS {
        let link = dev.join(name);
        std::os::unix::fs::symlink(target, &link).context(Stage::Root, || {
            format!("link {} -> {target}", link.display())
        })?;
    }
    let pts = mkdir(&dev, "pts")?;
    match sys::mount(
        Some(Path::new("devpts")),
        &pts,
        Some("devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some(DEVPTS),
    ) {
        Ok(()) => {
            let ptmx = dev.join("ptmx");
            std::os::unix::fs::symlink("pts/ptmx", &ptmx).context(Stage::Root, || {
                format!("link {} -> pts/ptmx", ptmx.display())
            })?;
        }
        Err(e) => {
            tracing::warn!(error = %e, "no private devpts; the sandbox has no pseudo-terminals")
        }
    }
    let shm = mkdir(&dev, "shm")?;
    tmpfs(&shm, libc::MS_NOSUID | libc::MS_NODEV, STICKY_TMPFS)
}

/// Binds into the private `/run` the files that `/etc` entries link to there
/// (read-only), so DNS keeps working on systemd-resolved hosts. Best effort.
fn carry_run_links(root: &Path) {
    for name in ETC_FILES_LINKING_INTO_RUN {
        let link = Path::new("/etc").join(name);
        let is_link = fs::symlink_metadata(&link)
            .map(|m| m.file_type().is_symlink())
            .unwrap_or(false);
        if !is_link {
            continue;
        }
        let Ok(target) = fs::canonicalize(&link) else {
            continue;
        };
        if !target.starts_with("/run") || !target.is_file() {
            continue;
        }
        let dst = root.join(target.strip_prefix("/").unwrap_or(&target));
        let result = dst
            .parent()
            .map_or(Ok(()), fs::create_dir_all)
            .and_then(|()| {
                fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .mode(0o644)
                    .open(&dst)
                    .map(drop)
            })
            .map_err(|e| Failure::new(Stage::Root, format!("create {}", dst.display()), &e))
            .and_then(|()| bind(&target, &dst))
            .and_then(|()| remount_readonly_trees(std::slice::from_ref(&dst)));
        if let Err(f) = result {
            tracing::warn!(file = %link.display(), "not carried into the sandbox's /run: {f}");
        }
    }
}

/// Enters `root`: `pivot_root` onto itself, then detaches the old root that
/// is stacked below.
fn enter(root: &Path) -> Result<(), Failure> {
    std::env::set_current_dir(root).context(Stage::Root, || format!("chdir {}", root.display()))?;
    sys::pivot_root(Path::new("."), Path::new(".")).context(Stage::Root, || {
        format!("pivot_root into {}", root.display())
    })?;
    sys::umount2(Path::new("."), libc::MNT_DETACH)
        .context(Stage::Root, || "detach the host's root".to_string())?;
    std::env::set_current_dir("/").context(Stage::Root, || "chdir /".to_string())
}

/// Creates `parent/name` (mode 0755) and returns its path.
fn mkdir(parent: &Path, name: &str) -> Result<PathBuf, Failure> {
    let dir = parent.join(name);
    fs::DirBuilder::new()
        .mode(0o755)
        .create(&dir)
        .context(Stage::Root, || format!("create {}", dir.display()))?;
    Ok(dir)
}

fn tmpfs(target: &Path, flags: libc::c_ulong, options: &str) -> Result<(), Failure> {
    sys::mount(
        Some(Path::new("tmpfs")),
        target,
        Some("tmpfs"),
        flags,
        Some(options),
    )
    .context(Stage::Root, || {
        format!("mount a tmpfs on {}", target.display())
    })
}

/// Recursive bind of `src` on `dst`.
fn bind(src: &Path, dst: &Path) -> Result<(), Failure> {
    sys::mount(Some(src), dst, None, libc::MS_BIND | libc::MS_REC, None)
        .context(Stage::Root, || {
            format!("bind {} on {}", src.display(), dst.display())
        })
}

/// Makes each mount at or below the given points read-only, keeping the
/// flags the source had.
fn remount_readonly_trees(tops: &[PathBuf]) -> Result<(), Failure> {
    if tops.is_empty() {
        return Ok(());
    }
    let info = fs::read_to_string("/proc/self/mountinfo")
        .context(Stage::Root, || "read /proc/self/mountinfo".to_string())?;
    for point in mounts_under(&info, tops) {
        let flags = sys::preserved_mount_flags(&point).context(Stage::Root, || {
            format!("read the mount flags of {}", point.display())
        })?;
        sys::mount(
            None,
            &point,
            None,
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | flags,
            None,
        )
        .context(Stage::Root, || {
            format!("make {} read-only", point.display())
        })?;
    }
    Ok(())
}

/// Mount points of `mountinfo` that are one of `tops` or below one, parents
/// first, each once.
fn mounts_under(mountinfo: &str, tops: &[PathBuf]) -> Vec<PathBuf> {
    let mut points: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape_mountinfo(field)))
        .filter(|p| tops.iter().any(|top| p.starts_with(top)))
        .collect();
    points.sort();
    points.dedup();
    points
}

/// Undoes the octal escapes (`\040` for space, ...) of a mountinfo field.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                let value = d.iter().fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
                out.push(u8::try_from(value).unwrap_or(b'?'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:40 / /tmp rw,nosuid,nodev - tmpfs tmpfs rw
31 30 254:0 /usr /tmp/usr ro,relatime - ext4 /dev/vda rw
32 31 0:41 / /tmp/usr/local/share\\040x rw - tmpfs tmpfs rw
33 30 254:0 /usr /tmp/usr2 ro - ext4 /dev/vda rw
34 30 254:0 /etc /tmp/etc ro - ext4 /dev/vda rw
35 31 0:42 / /tmp/usr rw - tmpfs tmpfs rw
";

    #[test]
    fn finds_submounts_parents_first() {
        let points = mounts_under(
            MOUNTINFO,
            &[PathBuf::from("/tmp/usr"), PathBuf::from("/tmp/etc")],
        );
        assert_eq!(
            points,
            vec![
                PathBuf::from("/tmp/etc"),
                PathBuf::from("/tmp/usr"),
                PathBuf::from("/tmp/usr/local/share x"),
            ]
        );
    }

    #[test]
    fn unescapes_octal() {
        assert_eq!(unescape_mountinfo("/a\\040b\\011c\\134d"), "/a b\tc\\d");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        // A backslash not followed by three octal digits is kept.
        assert_eq!(unescape_mountinfo("/a\\9"), "/a\\9");
    }
}
