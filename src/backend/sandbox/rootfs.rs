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
//! | `/etc/hosts`, `/etc/resolv.conf` | the sandbox's own, read-only (see below) |
//! | `/tmp`, `/run` | empty private tmpfs |
//! | `/sessions` | host sessions directory, recursive read-write bind, shared propagation |
//! | `/.host` | host `/`, recursive read-write bind, for the agent only |
//! | `/.egress` | the daemon's run directory of this sandbox (egress proxy socket), read-only bind, for the agent only; only when the daemon serves one |
//!
//! Names: sessions must not see the host's own names (the host's
//! `/etc/hosts` may map names onto addresses sessions cannot reach anyway);
//! names are resolved on the host, by the egress proxy. So `/etc/hosts` only
//! names loopback and [`HOSTNAME`], and `/etc/resolv.conf` points at the
//! agent's DNS stub on 127.0.0.1. Each generated file is bound read-only
//! over the host's file, or over the target of the host's symlink (created in
//! the private `/run` when it points there, as with systemd-resolved's
//! `/run/systemd/resolve/stub-resolv.conf`). A host without such a file keeps
//! none (glibc then asks 127.0.0.1 anyway).
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
use super::{EGRESS_DIR, HOSTNAME, HOST_ROOT};

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

/// The sandbox's `/etc/resolv.conf`: the agent's DNS stub on loopback,
/// which answers with addresses the agent's capture sends to the egress
/// proxy by name.
const RESOLV_CONF: &str = "# The sandbox's resolver: the agent's DNS stub.\nnameserver 127.0.0.1\n";

/// Where generated files are staged in the root tmpfs before being bound
/// over their place; each is unlinked again right after.
const STAGED_PREFIX: &str = ".staged-";

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
pub fn build_and_enter(sessions_dir: &Path, egress_dir: Option<&Path>) -> Result<(), Failure> {
    // Opened before anything is mounted over `/tmp`, where they may live.
    let sessions = sys::open(sessions_dir, libc::O_PATH | libc::O_DIRECTORY)
        .context(Stage::Root, || {
            format!("open the sessions directory {}", sessions_dir.display())
        })?;
    let sessions_src = PathBuf::from(format!("/proc/self/fd/{}", sessions.as_raw_fd()));
    let egress = egress_dir
        .map(|dir| {
            sys::open(dir, libc::O_PATH | libc::O_DIRECTORY).context(Stage::Root, || {
                format!("open the sandbox run directory {}", dir.display())
            })
        })
        .transpose()?;
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
    sys::mount_path(
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
    own_name_files(root)?;

    let sessions_dst = mkdir(root, "sessions")?;
    bind(&sessions_src, &sessions_dst)?;
    // Mounts the agent adds later under /sessions reach the mount
    // namespaces of the session processes.
    sys::mount_path(
        None,
        &sessions_dst,
        None,
        libc::MS_SHARED | libc::MS_REC,
        None,
    )
    .context(Stage::Root, || "make /sessions a shared mount".to_string())?;
    drop(sessions);

    if let Some(fd) = egress {
        let src = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        let dst = mkdir(root, EGRESS_DIR.trim_start_matches('/'))?;
        bind(&src, &dst)?;
        remount_readonly_trees(std::slice::from_ref(&dst))?;
    }

    sys::mount_path(
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
    sys::cstring(&copy)
        .and_then(|c| sys::umount2(&c, libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW))
        .context(Stage::Root, || {
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
    match sys::mount_path(
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

/// The sandbox's `/etc/hosts`: loopback under the usual names and the
/// sandbox's host name, nothing of the host's.
fn hosts_file() -> String {
    format!(
        "# The sandbox's names: loopback only; other names resolve on the host.\n\
         127.0.0.1\tlocalhost {HOSTNAME}\n\
         ::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
}

/// Binds the sandbox's own `/etc/hosts` and `/etc/resolv.conf` (read-only)
/// over the host's; see the module doc. Needs `/etc` and the private `/run`
/// in place under `root`.
fn own_name_files(root: &Path) -> Result<(), Failure> {
    let files = [
        ("hosts", hosts_file()),
        ("resolv.conf", RESOLV_CONF.to_string()),
    ];
    for (name, content) in files {
        let host = Path::new("/etc").join(name);
        let Some(place) = place_in_root(&host, root)? else {
            tracing::info!(file = %host.display(), "no such file in the sandbox");
            continue;
        };
        let staged = root.join(format!("{STAGED_PREFIX}{name}"));
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&staged)
            .and_then(|mut f| io::Write::write_all(&mut f, content.as_bytes()))
            .context(Stage::Root, || format!("write {}", staged.display()))?;
        sys::mount_path(Some(&staged), &place, None, libc::MS_BIND, None).context(
            Stage::Root,
            || {
                format!(
                    "bind the sandbox's own {} on {}",
                    host.display(),
                    place.display()
                )
            },
        )?;
        remount_readonly_trees(std::slice::from_ref(&place))?;
        // The bind keeps the file; only the mount reaches it now.
        fs::remove_file(&staged).context(Stage::Root, || format!("remove {}", staged.display()))?;
    }
    Ok(())
}

/// Where, under `root`, the sandbox's version of the host file `host` (in
/// `/etc`) must be bound: the file itself, or the end of its symlink (made
/// as an empty file when it lies in the private `/run`). `None` when the
/// sandbox would see no such file anyway (none on the host, or a link to a
/// place the root does not hold).
fn place_in_root(host: &Path, root: &Path) -> Result<Option<PathBuf>, Failure> {
    let meta = match fs::symlink_metadata(host) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Failure::new(
                Stage::Root,
                format!("inspect {}", host.display()),
                &e,
            ))
        }
    };
    if !meta.file_type().is_symlink() {
        return Ok(Some(root.join(host.strip_prefix("/").unwrap_or(host))));
    }
    let target =
        fs::read_link(host).context(Stage::Root, || format!("read the link {}", host.display()))?;
    // The host's own resolution when the target exists there, else the
    // link's text made absolute (a dangling link into `/run`).
    let resolved = fs::canonicalize(host)
        .unwrap_or_else(|_| normalize(&host.parent().unwrap_or(Path::new("/")).join(target)));
    let place = root.join(resolved.strip_prefix("/").unwrap_or(&resolved));
    if resolved.starts_with("/run") {
        // The private `/run` is empty: make the file the link ends at.
        place
            .parent()
            .map_or(Ok(()), fs::create_dir_all)
            .and_then(|()| {
                fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .mode(0o644)
                    .open(&place)
                    .map(drop)
            })
            .context(Stage::Root, || format!("create {}", place.display()))?;
        return Ok(Some(place));
    }
    if fs::symlink_metadata(&place).is_ok_and(|m| m.is_file()) {
        return Ok(Some(place));
    }
    // Outside what the root holds (WSL's `/mnt/wsl/resolv.conf`, say): the
    // link dangles in the sandbox, which so sees no such file at all.
    tracing::info!(
        file = %host.display(),
        target = %resolved.display(),
        "the host's file links outside the sandbox; the sandbox has none"
    );
    Ok(None)
}

/// `path` without `.` and `..` components (lexically; `..` at `/` stays
/// at `/`).
fn normalize(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::from("/");
    for part in path.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(p) => out.push(p),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// Enters `root`: `pivot_root` onto itself, then detaches the old root that
/// is stacked below.
fn enter(root: &Path) -> Result<(), Failure> {
    std::env::set_current_dir(root).context(Stage::Root, || format!("chdir {}", root.display()))?;
    sys::pivot_root(Path::new("."), Path::new(".")).context(Stage::Root, || {
        format!("pivot_root into {}", root.display())
    })?;
    sys::umount2(c".", libc::MNT_DETACH)
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
    sys::mount_path(
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
    sys::mount_path(Some(src), dst, None, libc::MS_BIND | libc::MS_REC, None)
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
        sys::mount_path(
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
    fn names_are_the_sandbox_own() {
        let hosts = hosts_file();
        assert!(
            hosts.contains("127.0.0.1\tlocalhost cowork-sandbox\n"),
            "{hosts}"
        );
        assert!(hosts.contains("::1\tlocalhost"), "{hosts}");
        let entries: Vec<&str> = hosts.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(entries.len(), 2, "{hosts}");
        let servers: Vec<&str> = RESOLV_CONF
            .lines()
            .filter(|l| l.starts_with("nameserver"))
            .collect();
        assert_eq!(servers, vec!["nameserver 127.0.0.1"]);
    }

    #[test]
    fn link_targets_are_normalized() {
        assert_eq!(
            normalize(Path::new("/etc/../run/systemd/resolve/./stub-resolv.conf")),
            PathBuf::from("/run/systemd/resolve/stub-resolv.conf")
        );
        assert_eq!(normalize(Path::new("/../../x")), PathBuf::from("/x"));
    }

    #[test]
    fn places_follow_host_links() {
        let t = tempfile::tempdir().expect("tempdir");
        let root = t.path().join("root");
        fs::create_dir_all(root.join("etc")).expect("mkdir");
        let etc = t.path().join("etc");
        fs::create_dir_all(&etc).expect("mkdir");
        // A plain file is replaced in place.
        fs::write(etc.join("hosts"), "x").expect("write");
        assert_eq!(
            place_in_root(&etc.join("hosts"), &root).expect("place"),
            Some(root.join(etc.join("hosts").strip_prefix("/").expect("absolute")))
        );
        // Missing: nothing to replace.
        assert_eq!(
            place_in_root(&etc.join("none"), &root).expect("place"),
            None
        );
        // A dangling link into /run: made in the root's /run.
        let link = etc.join("resolv.conf");
        std::os::unix::fs::symlink("/run/cowork-test-missing/stub.conf", &link).expect("link");
        let place = place_in_root(&link, &root).expect("place").expect("some");
        assert_eq!(place, root.join("run/cowork-test-missing/stub.conf"));
        assert!(place.is_file());
        // A link elsewhere that the root does not hold: nothing to replace.
        let odd = etc.join("odd");
        std::os::unix::fs::symlink("/nonexistent-cowork/odd", &odd).expect("link");
        assert_eq!(place_in_root(&odd, &root).expect("place"), None);
    }

    #[test]
    fn unescapes_octal() {
        assert_eq!(unescape_mountinfo("/a\\040b\\011c\\134d"), "/a b\tc\\d");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        // A backslash not followed by three octal digits is kept.
        assert_eq!(unescape_mountinfo("/a\\9"), "/a\\9");
    }
}
