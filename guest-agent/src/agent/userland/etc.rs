//! The machine setup no init system does for us, whichever userland the
//! agent runs sessions in: what systemd (never started here) or the image's
//! boot scripts would otherwise provide.
//!
//! * `/dev/fd`, `/dev/stdin`, `/dev/stdout`, `/dev/stderr` as links into
//!   `/proc/self/fd` ([`DEV_LINKS`]; devtmpfs has only device nodes, and bash
//!   process substitution and many scripts use them);
//! * the host name [`HOSTNAME`] (`sethostname`), `/etc/hostname` and
//!   `/etc/hosts`;
//! * a real `/etc/resolv.conf` ([`RESOLV_CONF`]) naming the agent's DNS stub
//!   ([`crate::egress::dns`]) on loopback: the Ubuntu bundle's is a link to
//!   systemd-resolved's stub file, which dangles without systemd;
//! * an empty `/etc/machine-id` when there is none;
//! * a higher open-file limit for PID 1, inherited by every session
//!   ([`nofile_limits`]);
//! * the link protections ([`SYSCTLS`]: `fs.protected_hardlinks` and
//!   `fs.protected_symlinks`), which Debian sets through systemd's
//!   `sysctl.d` and the kernel leaves off: several session users share
//!   `/tmp` and `/dev/shm`.
//!
//! The files are written on the userland's writable layer (a tmpfs upper,
//! or the initramfs itself), never on the read-only image.
//!
//! Limits: no network configuration (the VM's only link is vsock; the
//! agent's egress relay and capture carry connections to the host), so the
//! resolver file names only the agent's stub, which answers while the agent
//! runs; existing `/dev` links are kept as they are.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::{symlink, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The machine's host name (the official guest's too).
pub const HOSTNAME: &str = "claude";

/// `/etc/hosts`: loopback names and the host name on 127.0.1.1, as Debian
/// writes it.
pub const HOSTS: &str = "127.0.0.1\tlocalhost\n\
127.0.1.1\tclaude\n\
::1\tlocalhost ip6-localhost ip6-loopback\n\
ff02::1\tip6-allnodes\n\
ff02::2\tip6-allrouters\n";

/// `/etc/resolv.conf`: the agent's DNS stub on loopback
/// ([`crate::egress::dns::STUB_ADDR`]), which answers every host name with
/// a fake address whose connections the agent relays to the host by name.
/// Only the stub: the VM has no other network, so nothing else could answer.
pub const RESOLV_CONF: &str =
    "# Written by the cowork guest agent at boot. The agent's DNS stub answers\n\
# here: it gives each name a stand-in address, and connections to it go to\n\
# the host's egress proxy by name (the VM's only link to the host is vsock).\n\
nameserver 127.0.0.1\n";

/// Links created in `/dev` (name, target) when missing.
pub const DEV_LINKS: [(&str, &str); 4] = [
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
];

/// Hard open-file limit wanted for PID 1 and everything it starts
/// (systemd's default hard limit; the kernel starts init with 4096).
pub const NOFILE_HARD: u64 = 524_288;

/// Soft open-file limit wanted: enough for node, bun and git on large
/// trees without each raising it.
pub const NOFILE_SOFT: u64 = 65_536;

/// The kernel's ceiling on any process's open-file limit.
pub const NR_OPEN_PATH: &str = "/proc/sys/fs/nr_open";

/// Where procfs is mounted on the running machine (the kernel's sysctls are
/// below its `sys/`).
pub const PROC_DIR: &str = "/proc";

/// Sysctls set at boot: (file below [`PROC_DIR`], value). Sessions run as
/// different users that share the sticky, world-writable `/tmp` and
/// `/dev/shm`:
/// * `fs.protected_symlinks=1`: a symlink there is followed only by its
///   owner or when the directory's owner owns it, so a link one session
///   plants cannot redirect another session's (or the agent's) open;
/// * `fs.protected_hardlinks=1`: no one may hard-link a file they cannot
///   read and write, so a session cannot pin another user's file under a
///   name of its own choosing.
pub const SYSCTLS: [(&str, &str); 2] = [
    ("sys/fs/protected_hardlinks", "1"),
    ("sys/fs/protected_symlinks", "1"),
];

/// Mode of the files written in `/etc`.
const ETC_FILE_MODE: u32 = 0o644;

/// Mode of `/etc/machine-id` (read-only, as systemd leaves it).
const MACHINE_ID_MODE: u32 = 0o444;

/// Errors of one setup step (each is logged; none stops the others).
#[derive(Debug, thiserror::Error)]
pub enum EtcError {
    #[error("cannot create {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot remove {path} to replace it: {source}")]
    Remove { path: PathBuf, source: io::Error },
    #[error("cannot link {path} -> {target}: {source}")]
    Link {
        path: PathBuf,
        target: &'static str,
        source: io::Error,
    },
    #[error("cannot set {path} to {value}: {source}")]
    Sysctl {
        path: PathBuf,
        value: &'static str,
        source: io::Error,
    },
    #[error("cannot set the host name to {HOSTNAME:?}: {0}")]
    Hostname(io::Error),
    #[error("cannot raise the open-file limit to {soft}/{hard}: {source}")]
    Nofile {
        soft: u64,
        hard: u64,
        source: io::Error,
    },
}

/// Creates the [`DEV_LINKS`] missing in `dev`.
pub fn make_dev_links(dev: &Path) -> Vec<EtcError> {
    DEV_LINKS
        .iter()
        .filter_map(|(name, target)| {
            let path = dev.join(name);
            match symlink(target, &path) {
                Ok(()) => None,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => None,
                Err(source) => Some(EtcError::Link {
                    path,
                    target,
                    source,
                }),
            }
        })
        .collect()
}

/// Writes `contents` to `path` as a new regular file with `mode`, first
/// removing whatever non-directory is there (a link is replaced, never
/// written through).
pub fn replace_file(path: &Path, contents: &[u8], mode: u32) -> Result<(), EtcError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.is_dir() => std::fs::remove_file(path).map_err(|source| EtcError::Remove {
            path: path.to_path_buf(),
            source,
        })?,
        _ => {}
    }
    let write = || -> io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)?;
        f.write_all(contents)?;
        // The umask may have narrowed the mode.
        f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))
    };
    write().map_err(|source| EtcError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Writes `etc/hostname`, `etc/hosts` and `etc/resolv.conf` below `root`
/// (replacing links such as Ubuntu's dangling resolv.conf), and an empty
/// `etc/machine-id` when none resolves. Creates `etc` if missing.
pub fn write_identity_files(root: &Path) -> Vec<EtcError> {
    let etc = root.join("etc");
    if let Err(source) = std::fs::create_dir_all(&etc) {
        return vec![EtcError::Write { path: etc, source }];
    }
    let hostname = format!("{HOSTNAME}\n");
    let mut errors: Vec<EtcError> = [
        ("hostname", hostname.as_bytes()),
        ("hosts", HOSTS.as_bytes()),
        ("resolv.conf", RESOLV_CONF.as_bytes()),
    ]
    .into_iter()
    .filter_map(|(name, contents)| replace_file(&etc.join(name), contents, ETC_FILE_MODE).err())
    .collect();
    // `exists` follows links: a dangling machine-id link is replaced too.
    let machine_id = etc.join("machine-id");
    if !machine_id.exists() {
        errors.extend(replace_file(&machine_id, b"", MACHINE_ID_MODE).err());
    }
    errors
}

/// Sets the kernel's host name to [`HOSTNAME`].
pub fn set_hostname() -> Result<(), EtcError> {
    // SAFETY: a valid buffer and its length.
    let r = unsafe { libc::sethostname(HOSTNAME.as_ptr().cast(), HOSTNAME.len()) };
    if r == 0 {
        Ok(())
    } else {
        Err(EtcError::Hostname(io::Error::last_os_error()))
    }
}

/// The (soft, hard) open-file limits to set, given the kernel's ceiling
/// `nr_open` (unknown: no ceiling known) and the current limits: the wanted
/// [`NOFILE_SOFT`]/[`NOFILE_HARD`] within the ceiling, never lower than now.
pub fn nofile_limits(nr_open: Option<u64>, current: (u64, u64)) -> (u64, u64) {
    let ceiling = nr_open.unwrap_or(NOFILE_HARD);
    let hard = NOFILE_HARD.min(ceiling).max(current.1);
    let soft = NOFILE_SOFT.min(hard).max(current.0);
    (soft, hard)
}

/// Raises this process's `RLIMIT_NOFILE` per [`nofile_limits`] (children
/// inherit it). Without the privilege to raise the hard limit (not PID 1 of
/// a VM), raises the soft limit up to the current hard one instead. Returns
/// the limits now in force.
pub fn raise_nofile(nr_open_path: &Path) -> Result<(u64, u64), EtcError> {
    let nr_open = std::fs::read_to_string(nr_open_path)
        .ok()
        .and_then(|s| s.trim().parse().ok());
    // SAFETY: rlimit is plain data; getrlimit fills it.
    let mut cur: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut cur) };
    let (soft, hard) = nofile_limits(nr_open, (cur.rlim_cur, cur.rlim_max));
    let set = |soft: u64, hard: u64| {
        if (soft, hard) == (cur.rlim_cur, cur.rlim_max) {
            return Ok((soft, hard));
        }
        let want = libc::rlimit {
            rlim_cur: soft,
            rlim_max: hard,
        };
        // SAFETY: a valid rlimit.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            Ok((soft, hard))
        } else {
            Err(EtcError::Nofile {
                soft,
                hard,
                source: io::Error::last_os_error(),
            })
        }
    };
    set(soft, hard).or_else(|e| match &e {
        EtcError::Nofile { source, .. } if source.raw_os_error() == Some(libc::EPERM) => {
            set(soft.min(cur.rlim_max), cur.rlim_max)
        }
        _ => Err(e),
    })
}

/// Writes the [`SYSCTLS`] below `proc_dir` (procfs; the files must exist:
/// nothing is created). Returns one error per sysctl not set.
pub fn write_sysctls(proc_dir: &Path) -> Vec<EtcError> {
    SYSCTLS
        .iter()
        .filter_map(|&(name, value)| {
            let path = proc_dir.join(name);
            // Truncating as a shell's `>` does (procfs ignores it).
            OpenOptions::new()
                .write(true)
                .truncate(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
                .and_then(|mut f| f.write_all(value.as_bytes()))
                .err()
                .map(|source| EtcError::Sysctl {
                    path,
                    value,
                    source,
                })
        })
        .collect()
}

/// Everything above on the running machine (root `/`), logging each
/// failure on its own line.
pub fn prepare_machine() {
    let mut errors = make_dev_links(Path::new("/dev"));
    errors.extend(write_identity_files(Path::new("/")));
    errors.extend(set_hostname().err());
    errors.extend(write_sysctls(Path::new(PROC_DIR)));
    match raise_nofile(Path::new(NR_OPEN_PATH)) {
        Ok((soft, hard)) => tracing::debug!(soft, hard, "open-file limit"),
        Err(e) => errors.push(e),
    }
    for e in errors {
        tracing::warn!(error = %e, "machine setup step failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn dev_links_are_made_once_and_existing_ones_kept() {
        let t = tempfile::tempdir().unwrap();
        symlink("/elsewhere", t.path().join("stdin")).unwrap();
        assert!(make_dev_links(t.path()).is_empty());
        assert_eq!(
            std::fs::read_link(t.path().join("fd")).unwrap(),
            Path::new("/proc/self/fd")
        );
        assert_eq!(
            std::fs::read_link(t.path().join("stderr")).unwrap(),
            Path::new("/proc/self/fd/2")
        );
        assert_eq!(
            std::fs::read_link(t.path().join("stdin")).unwrap(),
            Path::new("/elsewhere")
        );
        // Idempotent.
        assert!(make_dev_links(t.path()).is_empty());
        // A missing directory is an error per link, not a panic.
        assert_eq!(
            make_dev_links(&t.path().join("nope")).len(),
            DEV_LINKS.len()
        );
    }

    #[test]
    fn ubuntus_dangling_resolv_conf_is_replaced_not_written_through() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        let etc = root.join("etc");
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::create_dir_all(root.join("run")).unwrap();
        // The bundle's link, relative, into a systemd directory that is absent.
        symlink(
            "../run/systemd/resolve/stub-resolv.conf",
            etc.join("resolv.conf"),
        )
        .unwrap();
        // A hosts link to a file that exists must not be written through.
        std::fs::write(t.path().join("outside"), b"keep").unwrap();
        symlink(t.path().join("outside"), etc.join("hosts")).unwrap();
        // An existing machine-id is kept.
        std::fs::write(etc.join("machine-id"), b"0123\n").unwrap();
        assert!(write_identity_files(&root).is_empty());
        let resolv = std::fs::symlink_metadata(etc.join("resolv.conf")).unwrap();
        assert!(resolv.is_file());
        assert_eq!(resolv.permissions().mode() & 0o777, ETC_FILE_MODE);
        assert_eq!(
            std::fs::read_to_string(etc.join("resolv.conf")).unwrap(),
            RESOLV_CONF
        );
        // The one nameserver is the agent's stub.
        let servers: Vec<&str> = RESOLV_CONF
            .lines()
            .filter_map(|l| l.strip_prefix("nameserver "))
            .collect();
        assert_eq!(
            servers,
            [crate::egress::dns::STUB_ADDR.ip().to_string().as_str()]
        );
        assert_eq!(crate::egress::dns::STUB_ADDR.port(), 53);
        assert!(RESOLV_CONF.contains("DNS stub"));
        assert_eq!(std::fs::read_to_string(etc.join("hosts")).unwrap(), HOSTS);
        assert_eq!(std::fs::read(t.path().join("outside")).unwrap(), b"keep");
        assert_eq!(
            std::fs::read_to_string(etc.join("hostname")).unwrap(),
            "claude\n"
        );
        assert_eq!(std::fs::read(etc.join("machine-id")).unwrap(), b"0123\n");
        assert!(!root.join("run/systemd").exists());
    }

    #[test]
    fn an_initramfs_without_etc_gets_one_and_an_empty_machine_id() {
        let t = tempfile::tempdir().unwrap();
        assert!(write_identity_files(t.path()).is_empty());
        let id = std::fs::metadata(t.path().join("etc/machine-id")).unwrap();
        assert_eq!((id.len(), id.permissions().mode() & 0o777), (0, 0o444));
        assert!(HOSTS.contains("127.0.1.1\tclaude\n"));
        // A dangling machine-id link is replaced by the empty file.
        std::fs::remove_file(t.path().join("etc/machine-id")).unwrap();
        symlink("/run/nowhere", t.path().join("etc/machine-id")).unwrap();
        assert!(write_identity_files(t.path()).is_empty());
        assert!(std::fs::symlink_metadata(t.path().join("etc/machine-id"))
            .unwrap()
            .is_file());
        // A directory in the way is reported.
        let t2 = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t2.path().join("etc/hosts")).unwrap();
        let errors = write_identity_files(t2.path());
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].to_string().contains("etc/hosts"), "{}", errors[0]);
    }

    #[test]
    fn link_protections_are_written_to_existing_sysctls_only() {
        let t = tempfile::tempdir().unwrap();
        let fs = t.path().join("sys/fs");
        std::fs::create_dir_all(&fs).unwrap();
        for name in ["protected_hardlinks", "protected_symlinks"] {
            std::fs::write(fs.join(name), b"0\n").unwrap();
        }
        assert!(write_sysctls(t.path()).is_empty());
        for name in ["protected_hardlinks", "protected_symlinks"] {
            assert_eq!(std::fs::read(fs.join(name)).unwrap(), b"1", "{name}");
        }
        // Without procfs (or on a kernel without one of them): an error per
        // sysctl naming its file, and nothing created.
        std::fs::remove_file(fs.join("protected_symlinks")).unwrap();
        let errors = write_sysctls(t.path());
        assert_eq!(errors.len(), 1, "{errors:?}");
        let shown = errors[0].to_string();
        assert!(shown.contains("sys/fs/protected_symlinks to 1"), "{shown}");
        assert!(!fs.join("protected_symlinks").exists());
        assert_eq!(write_sysctls(&t.path().join("noproc")).len(), SYSCTLS.len());
    }

    #[test]
    fn nofile_limits_stay_within_the_kernel_and_never_drop() {
        // The kernel's default ceiling, init's default limits.
        assert_eq!(
            nofile_limits(Some(1_048_576), (1024, 4096)),
            (NOFILE_SOFT, NOFILE_HARD)
        );
        // A lower ceiling caps both.
        assert_eq!(nofile_limits(Some(32_768), (1024, 4096)), (32_768, 32_768));
        // Limits already higher are kept.
        assert_eq!(
            nofile_limits(Some(1_048_576), (100_000, 1_048_576)),
            (100_000, 1_048_576)
        );
        assert_eq!(
            nofile_limits(None, (1024, 4096)),
            (NOFILE_SOFT, NOFILE_HARD)
        );
    }

    #[test]
    fn raising_the_limit_takes_effect_for_this_process() {
        // SAFETY: rlimit is plain data; getrlimit fills it.
        let mut before: libc::rlimit = unsafe { std::mem::zeroed() };
        // SAFETY: a valid out-pointer.
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut before) };
        let (soft, hard) = raise_nofile(Path::new(NR_OPEN_PATH)).unwrap();
        // SAFETY: as above.
        let mut now: libc::rlimit = unsafe { std::mem::zeroed() };
        // SAFETY: a valid out-pointer.
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut now) };
        assert_eq!((now.rlim_cur, now.rlim_max), (soft, hard));
        // The hard limit rose to the target when allowed (PID 1 of a VM),
        // else stayed; the soft one reached the target within it.
        assert!(hard == before.rlim_max.max(NOFILE_HARD) || hard == before.rlim_max);
        assert_eq!(
            soft,
            NOFILE_SOFT.min(hard).max(before.rlim_cur),
            "{soft}/{hard}"
        );
    }
}
