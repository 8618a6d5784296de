//! Session homes and per-session users.
//!
//! Every session has a home, `<sessions-root>/<name>`, laid out as
//!
//! | path | owner | mode | what |
//! | --- | --- | --- | --- |
//! | `<name>/` | the session | 0700 | `HOME`; `/etc/skel` is copied in when it is created |
//! | `<name>/tmp/` | the session | 0700 | `TMPDIR` (pruned by the janitor) |
//! | `<name>/mnt/` | the agent (root) | 0755 | mount points of the session's grants |
//!
//! `mnt/` belongs to the agent so the session cannot create, remove or
//! replace mount points in it, yet it can use what is mounted there (the
//! grant's own permissions apply). The session can still rename `mnt/`
//! itself inside its home; the mount code then refuses a `mnt` it does not
//! own (see `mounts::ensure_session_dir`).
//!
//! In a VM (the agent is the machine's init, [`UserDb`] is in use) each
//! session also gets its own user: uid = gid = [`proto::session_uid`] of the
//! name, a group of the same name and id, a locked password, shell
//! `/bin/bash` (or `/bin/sh` without bash), home `<sessions-root>/<name>`. The
//! entries are added to `passwd`, `group` and `shadow` (and `gshadow` when the
//! userland has one) by rewriting each file atomically (a new file in the same
//! directory with the old one's mode and owner, then `rename`), and only when
//! missing, so repeating it changes nothing. `/etc` lives on the writable
//! overlay (or the initramfs) and is rebuilt at every boot; the session disk
//! keeps the files' numeric owners, and the pure uid function gives the same
//! user back. The login name is the session name when it is a valid user
//! name ([`is_valid_login`]) and no other account or group has it, otherwise
//! a derived one (see [`derived_login`]).
//!
//! A uid collision (two session names hashing to the same uid) is refused,
//! never shared: the spawn fails when the uid already belongs to another
//! account or group, or owns another directory in the sessions root.
//!
//! A home that exists but belongs to someone else (made as root by an older
//! agent, or before the session had a user) is handed over once: it and
//! everything below it are chowned to the user, without following symlinks,
//! without entering mount points and leaving `mnt/` to the agent. This runs
//! before any process of the session runs as its user, so nothing inside
//! can change under the walk.
//!
//! Outside a VM (the sandbox backend, tests) sessions run as the agent's own
//! user: the layout is the same, all of it owned by the agent.
//!
//! Limits: the agent is the only writer of the account files (no `lckpwdf`
//! locking against other tools); a session name containing `:` cannot have a
//! user (the home would not fit `/etc/passwd`) and its spawns are refused.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::names;
use crate::proto;
use crate::sync::MutexExt;
use crate::sys;

/// Where the account database lives in the guest.
pub const ETC_DIR: &str = "/etc";

/// Files copied into every new home, below the etc directory.
pub const SKEL_SUBDIR: &str = "skel";

/// Login shell and `SHELL` of sessions when the userland has GNU bash (the
/// CLI refuses other shells, busybox's ash included).
pub const BASH: &str = "/bin/bash";

/// Login shell when the userland has no bash (the initramfs fallback).
pub const SH: &str = "/bin/sh";

/// Mode of a session's home: nobody else may enter it.
pub const HOME_MODE: libc::mode_t = 0o700;

/// Mode of a session's `tmp/`, private like the home.
pub const TMP_MODE: libc::mode_t = 0o700;

/// Mode of a session's `mnt/`: owned by the agent, enterable by the session.
pub const MNT_MODE: libc::mode_t = 0o755;

/// Mode of a sessions root the agent creates (the session disk's root).
const ROOT_MODE: u32 = 0o755;

/// Name of the directory of a home holding mount points.
pub const MNT_DIR: &str = "mnt";

/// Name of the directory of a home holding temporary files.
pub const TMP_DIR: &str = crate::janitor::TMP_DIR;

/// Longest login name we create (the limit `useradd` and utmp share).
pub const MAX_LOGIN_NAME: usize = 32;

/// Prefix of derived login names (a letter, so the name is valid).
const DERIVED_PREFIX: &str = "s_";

/// Characters of the session name kept in a derived login name: with the
/// prefix, a separator and 8 hex digits of the uid it stays within
/// [`MAX_LOGIN_NAME`].
const DERIVED_STEM_LEN: usize = 20;

/// The comment (GECOS) field of session users.
const GECOS: &str = "cowork session";

/// Mode of `passwd` and `group` when the agent creates them.
const PUBLIC_DB_MODE: u32 = 0o644;

/// Mode of `shadow` and `gshadow` when the agent creates them and a
/// `shadow` group exists (Debian's convention: readable by that group).
const SHADOW_MODE: u32 = 0o640;

/// Mode of `shadow` when no `shadow` group exists.
const SHADOW_MODE_NO_GROUP: u32 = 0o600;

/// The group that may read `shadow` on Debian-like userlands.
const SHADOW_GROUP: &str = "shadow";

/// Suffix of the temporary file an account file is rewritten through.
const NEW_SUFFIX: &str = ".cowork-new";

/// Entries written to account files that do not exist yet, so that `root`
/// keeps a name (the initramfs fallback has no account files).
const ROOT_PASSWD: &str = "root:x:0:0:root:/root:/bin/sh";
const ROOT_GROUP: &str = "root:x:0:";
const ROOT_SHADOW: &str = "root:*:::::::";
const ROOT_GSHADOW: &str = "root:*::";

/// Serializes every home and account change of this agent.
static LOCK: Mutex<()> = Mutex::new(());

/// Why a session's home or user could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error(transparent)]
    Name(#[from] names::NameError),
    #[error("session {session:?} cannot have its own user: its name contains ':', which /etc/passwd cannot hold; use another session name")]
    Unrepresentable { session: String },
    #[error("session {session:?} would run as uid {uid}, but that uid already belongs to {other:?} in {file}; the two names collide, use another session name")]
    UidTaken {
        session: String,
        uid: u32,
        other: String,
        file: &'static str,
    },
    #[error("session {session:?} would run as uid {uid}, but {other} is owned by that uid; the two session names collide, use another session name")]
    HomeTaken {
        session: String,
        uid: u32,
        other: String,
    },
    #[error("session {session:?}: neither {preferred:?} nor {derived:?} is free as a user and group name")]
    LoginTaken {
        session: String,
        preferred: String,
        derived: String,
    },
    #[error("cannot update {path}: {source}")]
    Database { path: String, source: io::Error },
    #[error("session home {path} is a symlink or not a directory")]
    UnsafeHome { path: String },
    #[error("cannot prepare the session home {path}: {source}")]
    Home { path: String, source: io::Error },
}

/// A session's user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionUser {
    pub login: String,
    pub uid: u32,
    /// Always equal to `uid`.
    pub gid: u32,
    pub home: PathBuf,
    pub shell: String,
}

/// A prepared home, with the user its processes run as (none outside a VM).
#[derive(Clone, Debug)]
pub struct Home {
    pub dir: PathBuf,
    pub user: Option<SessionUser>,
    /// Whether the home was created by this call.
    pub created: bool,
}

/// The account files session users are added to.
#[derive(Debug)]
pub struct UserDb {
    etc_dir: PathBuf,
    shell: String,
    /// Sessions whose user was ensured since the agent started.
    known: Mutex<HashMap<String, SessionUser>>,
}

/// `/bin/bash` when it exists (for `SHELL`), else `None`.
pub fn bash() -> Option<&'static str> {
    Path::new(BASH).is_file().then_some(BASH)
}

/// The login shell of session users: [`BASH`] when present, else [`SH`].
pub fn login_shell() -> &'static str {
    bash().unwrap_or(SH)
}

/// Whether `name` can be used as a login name as is: `[a-z_][a-z0-9_-]*`,
/// at most [`MAX_LOGIN_NAME`] bytes (Debian's portable default rule).
pub fn is_valid_login(name: &str) -> bool {
    let mut bytes = name.bytes();
    let Some(first) = bytes.next() else {
        return false;
    };
    name.len() <= MAX_LOGIN_NAME
        && (first.is_ascii_lowercase() || first == b'_')
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// The login name of a session whose name is not a valid one (or is taken):
/// `s_` + the first 20 characters of the name, lowercased, each character
/// outside `[a-z0-9_-]` replaced by `_` + `_` + the uid as 8 hex digits.
/// Unique as long as uids are (collisions are refused anyway) and readable.
pub fn derived_login(session: &str, uid: u32) -> String {
    let stem: String = session
        .chars()
        .take(DERIVED_STEM_LEN)
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{DERIVED_PREFIX}{stem}_{uid:08x}")
}

fn lock() -> std::sync::MutexGuard<'static, ()> {
    LOCK.locked()
}

/// Creates (if needed) the home of `session` below `sessions_root` with its
/// layout, and with `users` the session's user first (see the module doc).
pub fn prepare(
    sessions_root: &Path,
    session: &str,
    skel: Option<&Path>,
    users: Option<&UserDb>,
) -> Result<Home, UserError> {
    names::session_name(session)?;
    let _guard = lock();
    let user = match users {
        Some(db) => Some(db.ensure_locked(sessions_root, session)?),
        None => None,
    };
    let (dir, created) = prepare_home(sessions_root, session, skel, user.as_ref())?;
    Ok(Home { dir, user, created })
}

/// One parsed line of an account file: its name and numeric id (the third
/// field of `passwd` and `group`).
struct Entry {
    name: String,
    id: Option<u32>,
}

/// An account file's text and entries (missing file: empty).
struct Db {
    path: PathBuf,
    file: &'static str,
    text: Option<String>,
    entries: Vec<Entry>,
}

impl Db {
    fn read(etc: &Path, file: &'static str) -> Result<Db, UserError> {
        let path = etc.join(file);
        let text = match fs::read_to_string(&path) {
            Ok(t) => Some(t),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(UserError::Database {
                    path: path.display().to_string(),
                    source,
                })
            }
        };
        let entries = text
            .as_deref()
            .unwrap_or("")
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .filter_map(|l| {
                let mut fields = l.split(':');
                let name = fields.next()?.to_string();
                let id = fields.nth(1).and_then(|f| f.parse().ok());
                Some(Entry { name, id })
            })
            .collect();
        Ok(Db {
            path,
            file,
            text,
            entries,
        })
    }

    fn find(&self, name: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Whether `name` is absent or already has id `id`.
    fn free_or_ours(&self, name: &str, id: u32) -> bool {
        self.find(name).is_none_or(|e| e.id == Some(id))
    }

    /// Appends `line` unless an entry named `name` exists. A missing file is
    /// created with `seed` first, mode `mode` and group `gid`.
    fn add(
        &self,
        name: &str,
        line: &str,
        seed: &str,
        mode: u32,
        gid: u32,
    ) -> Result<bool, UserError> {
        if self.find(name).is_some() {
            return Ok(false);
        }
        let mut text = match &self.text {
            Some(t) => t.clone(),
            None => format!("{seed}\n"),
        };
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(line);
        text.push('\n');
        rewrite(&self.path, text.as_bytes(), mode, gid).map_err(|source| UserError::Database {
            path: self.path.display().to_string(),
            source,
        })?;
        Ok(true)
    }
}

/// Replaces `path` with `contents` atomically: a new file next to it gets
/// the old file's mode and owner (or `mode`, the agent's uid and `gid` when
/// there is no old file), is synced, then renamed over it.
fn rewrite(path: &Path, contents: &[u8], mode: u32, gid: u32) -> io::Result<()> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let (mode, uid, gid) = match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_file() => (m.mode() & 0o7777, m.uid(), m.gid()),
        Ok(_) => return Err(io::Error::other("not a regular file")),
        Err(e) if e.kind() == io::ErrorKind::NotFound => (mode, euid, gid),
        Err(e) => return Err(e),
    };
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(NEW_SUFFIX);
    let tmp = path.with_file_name(tmp_name);
    if let Some(dir) = path.parent().filter(|d| !d.is_dir()) {
        // A bare initramfs may have no /etc at all.
        fs::DirBuilder::new()
            .recursive(true)
            .mode(ROOT_MODE)
            .create(dir)?;
    }
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(contents)?;
        let meta = f.metadata()?;
        if (meta.uid(), meta.gid()) != (uid, gid) {
            std::os::unix::fs::fchown(&f, Some(uid), Some(gid))?;
        }
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result?;
    if let Some(dir) = path.parent() {
        // Durability of the rename; the overlay's upper is a tmpfs anyway.
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

impl UserDb {
    /// The account files in `etc_dir`; session users get `shell`.
    pub fn new(etc_dir: impl Into<PathBuf>, shell: impl Into<String>) -> Self {
        Self {
            etc_dir: etc_dir.into(),
            shell: shell.into(),
            known: Mutex::default(),
        }
    }

    /// The guest's own account files ([`ETC_DIR`], [`login_shell`]).
    pub fn system() -> Self {
        Self::new(ETC_DIR, login_shell())
    }

    /// `/etc/skel` of these account files.
    pub fn skel_dir(&self) -> PathBuf {
        self.etc_dir.join(SKEL_SUBDIR)
    }

    fn known(&self) -> std::sync::MutexGuard<'_, HashMap<String, SessionUser>> {
        self.known.locked()
    }

    /// Makes sure `session`'s user exists (see the module doc). Refuses uid
    /// collisions. Caller holds [`LOCK`].
    fn ensure_locked(&self, sessions_root: &Path, session: &str) -> Result<SessionUser, UserError> {
        if let Some(u) = self.known().get(session) {
            return Ok(u.clone());
        }
        let home = sessions_root.join(session);
        if home.as_os_str().as_encoded_bytes().contains(&b':') {
            return Err(UserError::Unrepresentable {
                session: session.to_string(),
            });
        }
        let uid = proto::session_uid(session);
        let gid = uid;
        let passwd = Db::read(&self.etc_dir, "passwd")?;
        let group = Db::read(&self.etc_dir, "group")?;
        let login = choose_login(session, uid, &passwd, &group)?;
        for (db, id) in [(&passwd, uid), (&group, gid)] {
            if let Some(other) = db
                .entries
                .iter()
                .find(|e| e.id == Some(id) && e.name != login)
            {
                return Err(UserError::UidTaken {
                    session: session.to_string(),
                    uid,
                    other: other.name.clone(),
                    file: db.file,
                });
            }
        }
        check_other_homes(sessions_root, session, uid)?;
        let user = SessionUser {
            login: login.clone(),
            uid,
            gid,
            home: home.clone(),
            shell: self.shell.clone(),
        };
        let home_text = home.display().to_string();
        let mut added = Vec::new();
        let passwd_line = format!("{login}:x:{uid}:{gid}:{GECOS}:{home_text}:{}", self.shell);
        if passwd.add(&login, &passwd_line, ROOT_PASSWD, PUBLIC_DB_MODE, 0)? {
            added.push("passwd");
        }
        if group.add(
            &login,
            &format!("{login}:x:{gid}:"),
            ROOT_GROUP,
            PUBLIC_DB_MODE,
            0,
        )? {
            added.push("group");
        }
        let shadow_gid = group.find(SHADOW_GROUP).and_then(|e| e.id);
        let (shadow_mode, shadow_gid) = match shadow_gid {
            Some(g) => (SHADOW_MODE, g),
            None => (SHADOW_MODE_NO_GROUP, 0),
        };
        let shadow = Db::read(&self.etc_dir, "shadow")?;
        // Locked password ("!"), no aging.
        let shadow_line = format!("{login}:!:::::::");
        if shadow.add(&login, &shadow_line, ROOT_SHADOW, shadow_mode, shadow_gid)? {
            added.push("shadow");
        }
        let gshadow = Db::read(&self.etc_dir, "gshadow")?;
        if gshadow.text.is_some()
            && gshadow.add(
                &login,
                &format!("{login}:!::"),
                ROOT_GSHADOW,
                shadow_mode,
                shadow_gid,
            )?
        {
            added.push("gshadow");
        }
        if added.is_empty() {
            tracing::debug!(session, login = %login, uid, "session user already present");
        } else {
            tracing::info!(session, login = %login, uid, files = ?added, "session user added");
        }
        self.known().insert(session.to_string(), user.clone());
        Ok(user)
    }
}

/// The session name when it is a valid, free login name, else the derived one.
fn choose_login(session: &str, uid: u32, passwd: &Db, group: &Db) -> Result<String, UserError> {
    let free = |n: &str| passwd.free_or_ours(n, uid) && group.free_or_ours(n, uid);
    let derived = derived_login(session, uid);
    if is_valid_login(session) && free(session) {
        return Ok(session.to_string());
    }
    if free(&derived) {
        return Ok(derived);
    }
    Err(UserError::LoginTaken {
        session: session.to_string(),
        preferred: session.to_string(),
        derived,
    })
}

/// Refuses `uid` when it owns a directory in the sessions root other than
/// `session`'s home (another session that hashes to the same uid).
fn check_other_homes(sessions_root: &Path, session: &str, uid: u32) -> Result<(), UserError> {
    let entries = match fs::read_dir(sessions_root) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(UserError::Home {
                path: sessions_root.display().to_string(),
                source,
            })
        }
    };
    for entry in entries.flatten() {
        if entry.file_name() == session {
            continue;
        }
        let path = entry.path();
        if let Ok(m) = fs::symlink_metadata(&path) {
            if m.is_dir() && m.uid() == uid {
                return Err(UserError::HomeTaken {
                    session: session.to_string(),
                    uid,
                    other: path.display().to_string(),
                });
            }
        }
    }
    Ok(())
}

/// The agent's effective uid and gid.
fn agent_ids() -> (u32, u32) {
    // SAFETY: geteuid/getegid have no preconditions.
    unsafe { (libc::geteuid(), libc::getegid()) }
}

fn fchownat(dir: &OwnedFd, name: &CString, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: plain syscall on a descriptor we own and a NUL-terminated name.
    sys::cvt(unsafe {
        libc::fchownat(
            dir.as_raw_fd(),
            name.as_ptr(),
            uid,
            gid,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })
    .map(drop)
}

/// Creates `name` in `dir` with `mode` when missing; returns whether it did.
fn mkdirat_new(dir: &OwnedFd, name: &CString, mode: libc::mode_t) -> io::Result<bool> {
    // SAFETY: plain syscall on a descriptor we own and a NUL-terminated name.
    match sys::cvt(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode) }) {
        Ok(_) => Ok(true),
        Err(e) if sys::errno_of(&e) == libc::EEXIST => Ok(false),
        Err(e) => Err(e),
    }
}

/// Creates the home and its layout; returns its path and whether it is new.
fn prepare_home(
    sessions_root: &Path,
    session: &str,
    skel: Option<&Path>,
    user: Option<&SessionUser>,
) -> Result<(PathBuf, bool), UserError> {
    let dir = sessions_root.join(session);
    let err = |source: io::Error| UserError::Home {
        path: dir.display().to_string(),
        source,
    };
    let (uid, gid) = user.map_or_else(agent_ids, |u| (u.uid, u.gid));
    if !sessions_root.is_dir() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(ROOT_MODE)
            .create(sessions_root)
            .map_err(err)?;
    }
    let root = sys::open(sessions_root, libc::O_PATH | libc::O_DIRECTORY).map_err(err)?;
    let name = sys::cstring(session).map_err(err)?;
    let created = mkdirat_new(&root, &name, HOME_MODE).map_err(err)?;
    let home = sys::openat(
        root.as_fd(),
        &name,
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        0,
    )
    .map_err(|e| match sys::errno_of(&e) {
        libc::ELOOP | libc::ENOTDIR => UserError::UnsafeHome {
            path: dir.display().to_string(),
        },
        _ => err(e),
    })?;
    let home_file = fs::File::from(home);
    let meta = home_file.metadata().map_err(err)?;
    if created {
        if (meta.uid(), meta.gid()) != (uid, gid) {
            std::os::unix::fs::fchown(&home_file, Some(uid), Some(gid)).map_err(err)?;
        }
        // The umask may have narrowed the mode; say it exactly.
        home_file
            .set_permissions(fs::Permissions::from_mode(HOME_MODE))
            .map_err(err)?;
        if let Some(skel) = skel {
            if let Err(e) = copy_skel(skel, &dir, uid, gid) {
                tracing::warn!(session, skel = %skel.display(), error = %e, "home created without all of /etc/skel");
            }
        }
        tracing::info!(session, uid, home = %dir.display(), "session home created");
    } else if user.is_some() && meta.uid() != uid {
        tracing::info!(session, from_uid = meta.uid(), uid, home = %dir.display(), "handing an existing home to its session user");
        let changed = chown_tree(&dir, uid, gid).map_err(err)?;
        home_file
            .set_permissions(fs::Permissions::from_mode(HOME_MODE))
            .map_err(err)?;
        tracing::info!(session, entries = changed, "home handed over");
    }
    let home = OwnedFd::from(home_file);
    let tmp = sys::cstring(TMP_DIR).map_err(err)?;
    if mkdirat_new(&home, &tmp, TMP_MODE).map_err(err)? && (uid, gid) != agent_ids() {
        fchownat(&home, &tmp, uid, gid).map_err(err)?;
    }
    let mnt = sys::cstring(MNT_DIR).map_err(err)?;
    mkdirat_new(&home, &mnt, MNT_MODE).map_err(err)?;
    Ok((dir, created))
}

/// Copies the entries of `skel` (files, directories, symlinks; modes kept)
/// into the new home `home`, owned by `uid:gid`. `tmp` and `mnt` are skipped:
/// they are part of the layout.
fn copy_skel(skel: &Path, home: &Path, uid: u32, gid: u32) -> io::Result<()> {
    let entries = match fs::read_dir(skel) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let mut stack: Vec<(PathBuf, PathBuf)> = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        if name == TMP_DIR || name == MNT_DIR {
            continue;
        }
        stack.push((entry.path(), home.join(name)));
    }
    while let Some((src, dst)) = stack.pop() {
        let meta = fs::symlink_metadata(&src)?;
        let ft = meta.file_type();
        if ft.is_dir() {
            fs::DirBuilder::new()
                .mode(meta.mode() & 0o7777)
                .create(&dst)?;
            for entry in fs::read_dir(&src)? {
                let entry = entry?;
                stack.push((entry.path(), dst.join(entry.file_name())));
            }
        } else if ft.is_file() {
            let mut from = fs::File::open(&src)?;
            let mut to = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(meta.mode() & 0o777)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&dst)?;
            io::copy(&mut from, &mut to)?;
        } else if ft.is_symlink() {
            std::os::unix::fs::symlink(fs::read_link(&src)?, &dst)?;
        } else {
            continue; // devices, sockets and fifos have no place in a home
        }
        std::os::unix::fs::lchown(&dst, Some(uid), Some(gid))?;
        if ft.is_dir() {
            // mkdir is subject to the umask.
            fs::set_permissions(&dst, fs::Permissions::from_mode(meta.mode() & 0o7777))?;
        }
    }
    Ok(())
}

/// Chowns `home` and everything below it to `uid:gid` without following
/// symlinks, without entering mount points and without touching the home's
/// `mnt/`. Returns how many entries were changed.
fn chown_tree(home: &Path, uid: u32, gid: u32) -> io::Result<usize> {
    let base = sys::lstat(home)?;
    std::os::unix::fs::lchown(home, Some(uid), Some(gid))?;
    let mut changed = 1;
    let mut stack = vec![home.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot list while handing a home over");
                continue;
            }
        };
        for entry in entries {
            let Ok(entry) = entry else { continue };
            if dir == home && entry.file_name() == MNT_DIR {
                continue;
            }
            let path = entry.path();
            let st = match sys::lstat(&path) {
                Ok(st) => st,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot examine while handing a home over");
                    continue;
                }
            };
            if st.crosses_mount_from(&base) {
                continue;
            }
            std::os::unix::fs::lchown(&path, Some(uid), Some(gid))?;
            changed += 1;
            if st.is_dir() {
                stack.push(path);
            }
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    const DEBIAN_PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n\
        # a comment the agent keeps\n\
        ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash\n";
    const DEBIAN_GROUP: &str = "root:x:0:\nshadow:x:42:\nsudo:x:27:ubuntu\nubuntu:x:1000:\n";
    const DEBIAN_SHADOW: &str = "root:*:19000:0:99999:7:::\nubuntu:!:19000:0:99999:7:::";

    fn is_root() -> bool {
        agent_ids().0 == 0
    }

    /// An etc directory with Debian-like account files, and a sessions root.
    fn fixture() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let t = tempfile::tempdir().unwrap();
        let etc = t.path().join("etc");
        fs::create_dir_all(etc.join("skel/.config/app")).unwrap();
        fs::write(etc.join("passwd"), DEBIAN_PASSWD).unwrap();
        fs::write(etc.join("group"), DEBIAN_GROUP).unwrap();
        fs::write(etc.join("shadow"), DEBIAN_SHADOW).unwrap();
        fs::set_permissions(etc.join("shadow"), fs::Permissions::from_mode(0o640)).unwrap();
        fs::write(etc.join("skel/.bashrc"), b"# bashrc\n").unwrap();
        fs::write(etc.join("skel/.config/app/conf"), b"k=v\n").unwrap();
        symlink(".bashrc", etc.join("skel/.bashrc-link")).unwrap();
        let root = t.path().join("sessions");
        (t, etc, root)
    }

    fn lines(path: &Path) -> Vec<String> {
        fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(String::from)
            .collect()
    }

    fn owner(path: &Path) -> (u32, u32) {
        let m = fs::symlink_metadata(path).unwrap();
        (m.uid(), m.gid())
    }

    fn mode(path: &Path) -> u32 {
        fs::symlink_metadata(path).unwrap().mode() & 0o7777
    }

    #[test]
    fn login_names() {
        for ok in [
            "a",
            "_x",
            "amazing-youthful-hopper",
            "s1_2-3",
            &"a".repeat(32),
        ] {
            assert!(is_valid_login(ok), "{ok}");
        }
        for bad in [
            "",
            "1abc",
            "-a",
            "Abc",
            "a b",
            "a.b",
            "a:b",
            "é",
            &"a".repeat(33),
        ] {
            assert!(!is_valid_login(bad), "{bad}");
        }
        let uid = proto::session_uid("My Session: ÉTÉ 2026 / long long long name");
        let d = derived_login("My Session: ÉTÉ 2026 / long long long name", uid);
        assert_eq!(d, format!("s_my_session___t__2026_{uid:08x}"));
        assert!(is_valid_login(&d) && d.len() <= MAX_LOGIN_NAME, "{d}");
        assert!(is_valid_login(&derived_login("X", proto::session_uid("X"))));
    }

    #[test]
    fn users_are_added_once_and_other_lines_are_kept() {
        let (_t, etc, root) = fixture();
        if is_root() {
            std::os::unix::fs::chown(etc.join("shadow"), Some(0), Some(42)).unwrap();
        }
        let shadow_owner = owner(&etc.join("shadow"));
        let passwd_mode = mode(&etc.join("passwd"));
        let db = UserDb::new(&etc, "/bin/bash");
        let home = prepare(&root, "amazing-youthful-hopper", None, Some(&db)).unwrap();
        let uid = proto::session_uid("amazing-youthful-hopper");
        let want = SessionUser {
            login: "amazing-youthful-hopper".into(),
            uid,
            gid: uid,
            home: root.join("amazing-youthful-hopper"),
            shell: "/bin/bash".into(),
        };
        assert_eq!(home.user.as_ref(), Some(&want));
        let passwd_line = format!(
            "amazing-youthful-hopper:x:{uid}:{uid}:cowork session:{}:/bin/bash",
            root.join("amazing-youthful-hopper").display()
        );
        let mut want_passwd: Vec<String> = DEBIAN_PASSWD.lines().map(String::from).collect();
        want_passwd.push(passwd_line);
        assert_eq!(lines(&etc.join("passwd")), want_passwd);
        let mut want_group: Vec<String> = DEBIAN_GROUP.lines().map(String::from).collect();
        want_group.push(format!("amazing-youthful-hopper:x:{uid}:"));
        assert_eq!(lines(&etc.join("group")), want_group);
        // The shadow file had no final newline: the old last line stays whole.
        let mut want_shadow: Vec<String> = DEBIAN_SHADOW.lines().map(String::from).collect();
        want_shadow.push("amazing-youthful-hopper:!:::::::".into());
        assert_eq!(lines(&etc.join("shadow")), want_shadow);
        assert_eq!(
            lines(&etc.join("shadow"))
                .last()
                .unwrap()
                .matches(':')
                .count(),
            8,
            "shadow has 9 fields"
        );
        assert_eq!(mode(&etc.join("shadow")), 0o640);
        assert_eq!(owner(&etc.join("shadow")), shadow_owner);
        assert_eq!(mode(&etc.join("passwd")), passwd_mode);
        // No temporary file is left behind.
        let names: Vec<_> = fs::read_dir(&etc)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(!names.iter().any(|n| n.contains(NEW_SUFFIX)), "{names:?}");

        // Idempotent: a second agent (fresh cache) finds everything in place.
        let before: Vec<_> = ["passwd", "group", "shadow"]
            .iter()
            .map(|f| fs::read(etc.join(f)).unwrap())
            .collect();
        let db2 = UserDb::new(&etc, "/bin/bash");
        let again = prepare(&root, "amazing-youthful-hopper", None, Some(&db2)).unwrap();
        assert_eq!(again.user, Some(want));
        assert!(!again.created);
        let after: Vec<_> = ["passwd", "group", "shadow"]
            .iter()
            .map(|f| fs::read(etc.join(f)).unwrap())
            .collect();
        assert_eq!(before, after);
    }

    #[test]
    fn missing_account_files_are_created_with_root() {
        let t = tempfile::tempdir().unwrap();
        // Not even the directory exists (a bare initramfs).
        let etc = t.path().join("etc");
        let db = UserDb::new(&etc, "/bin/sh");
        let u = prepare(&t.path().join("s"), "s1", None, Some(&db))
            .unwrap()
            .user
            .unwrap();
        let passwd = lines(&etc.join("passwd"));
        assert_eq!(passwd[0], ROOT_PASSWD);
        assert!(passwd[1].starts_with(&format!("s1:x:{}:{}:", u.uid, u.uid)));
        assert!(passwd[1].ends_with(":/bin/sh"));
        assert_eq!(lines(&etc.join("group"))[0], ROOT_GROUP);
        assert_eq!(lines(&etc.join("shadow"))[0], ROOT_SHADOW);
        assert_eq!(mode(&etc.join("shadow")), SHADOW_MODE_NO_GROUP);
        assert_eq!(mode(&etc.join("passwd")), PUBLIC_DB_MODE);
        // No gshadow is created where the userland has none.
        assert!(!etc.join("gshadow").exists());
    }

    #[test]
    fn names_that_cannot_be_logins_get_derived_ones() {
        let (_t, etc, root) = fixture();
        fs::write(etc.join("gshadow"), "root:*::\n").unwrap();
        let db = UserDb::new(&etc, "/bin/bash");
        // Invalid as a login name.
        let u = prepare(&root, "Session 1", None, Some(&db))
            .unwrap()
            .user
            .unwrap();
        assert_eq!(u.login, derived_login("Session 1", u.uid));
        // Valid, but an existing account ("ubuntu") or group ("sudo") has it.
        for taken in ["ubuntu", "sudo"] {
            let u = prepare(&root, taken, None, Some(&db))
                .unwrap()
                .user
                .unwrap();
            assert_eq!(u.login, derived_login(taken, u.uid), "{taken}");
        }
        let gshadow = lines(&etc.join("gshadow"));
        assert!(gshadow.contains(&format!("{}:!::", u.login)), "{gshadow:?}");
        // Names that are not path components, or that passwd cannot hold.
        assert!(matches!(
            prepare(&root, "..", None, Some(&db)),
            Err(UserError::Name(_))
        ));
        let err = prepare(&root, "a:b", None, Some(&db)).unwrap_err();
        assert!(matches!(err, UserError::Unrepresentable { .. }), "{err}");
        assert!(!root.join("a:b").exists());
    }

    #[test]
    fn uid_collisions_are_refused() {
        let (_t, etc, root) = fixture();
        let uid = proto::session_uid("victim");
        // Another account already has the uid.
        let mut passwd = fs::read_to_string(etc.join("passwd")).unwrap();
        passwd.push_str(&format!("intruder:x:{uid}:{uid}::/:/bin/sh\n"));
        fs::write(etc.join("passwd"), &passwd).unwrap();
        let db = UserDb::new(&etc, "/bin/bash");
        let err = prepare(&root, "victim", None, Some(&db)).unwrap_err();
        assert!(
            matches!(&err, UserError::UidTaken { other, file: "passwd", .. } if other == "intruder"),
            "{err}"
        );
        assert!(err.to_string().contains("collide"), "{err}");
        assert!(
            !root.join("victim").exists(),
            "no home for a refused session"
        );
        fs::write(etc.join("passwd"), DEBIAN_PASSWD).unwrap();
        // Another group has the gid.
        let mut group = fs::read_to_string(etc.join("group")).unwrap();
        group.push_str(&format!("grp:x:{uid}:\n"));
        fs::write(etc.join("group"), &group).unwrap();
        let err = prepare(&root, "victim", None, Some(&db)).unwrap_err();
        assert!(
            matches!(err, UserError::UidTaken { file: "group", .. }),
            "{err}"
        );
        fs::write(etc.join("group"), DEBIAN_GROUP).unwrap();
        if !is_root() {
            eprintln!("SKIPPED the home-owner collision check: needs root to chown");
            return;
        }
        // Another session's home (from an earlier boot) is owned by the uid.
        fs::create_dir_all(root.join("other")).unwrap();
        std::os::unix::fs::chown(root.join("other"), Some(uid), Some(uid)).unwrap();
        let err = prepare(&root, "victim", None, Some(&db)).unwrap_err();
        assert!(matches!(err, UserError::HomeTaken { .. }), "{err}");
        assert!(err.to_string().contains("other"), "{err}");
        assert!(!lines(&etc.join("passwd"))
            .iter()
            .any(|l| l.starts_with("victim:")));
        // Without the other home the same session gets its user.
        fs::remove_dir(root.join("other")).unwrap();
        assert_eq!(
            prepare(&root, "victim", None, Some(&db))
                .unwrap()
                .user
                .unwrap()
                .uid,
            uid
        );
    }

    #[test]
    fn new_homes_get_the_layout_and_skel_once() {
        if !is_root() {
            eprintln!("SKIPPED: needs root to create homes owned by session users");
            return;
        }
        let (_t, etc, root) = fixture();
        let db = UserDb::new(&etc, "/bin/bash");
        let skel = db.skel_dir();
        let home = prepare(&root, "s1", Some(&skel), Some(&db)).unwrap();
        assert!(home.created);
        let uid = home.user.unwrap().uid;
        let h = root.join("s1");
        assert_eq!((owner(&h), mode(&h)), ((uid, uid), 0o700));
        assert_eq!(
            (owner(&h.join("tmp")), mode(&h.join("tmp"))),
            ((uid, uid), 0o700)
        );
        assert_eq!(
            (owner(&h.join("mnt")), mode(&h.join("mnt"))),
            ((0, 0), 0o755)
        );
        assert_eq!(fs::read(h.join(".bashrc")).unwrap(), b"# bashrc\n");
        assert_eq!(fs::read(h.join(".config/app/conf")).unwrap(), b"k=v\n");
        assert_eq!(
            fs::read_link(h.join(".bashrc-link")).unwrap(),
            Path::new(".bashrc")
        );
        for p in [
            ".bashrc",
            ".config",
            ".config/app",
            ".config/app/conf",
            ".bashrc-link",
        ] {
            assert_eq!(owner(&h.join(p)), (uid, uid), "{p}");
        }
        assert_eq!(mode(&h.join(".config")), mode(&skel.join(".config")));
        // Only a new home is populated: a deleted dotfile stays deleted.
        fs::remove_file(h.join(".bashrc")).unwrap();
        fs::remove_dir(h.join("tmp")).unwrap();
        let again = prepare(&root, "s1", Some(&skel), Some(&db)).unwrap();
        assert!(!again.created);
        assert!(!h.join(".bashrc").exists());
        // ... but the layout is restored.
        assert_eq!(owner(&h.join("tmp")), (uid, uid));
        // A home that is a symlink is refused.
        symlink(&h, root.join("s2")).unwrap();
        let err = prepare(&root, "s2", Some(&skel), Some(&db)).unwrap_err();
        assert!(matches!(err, UserError::UnsafeHome { .. }), "{err}");
    }

    #[test]
    fn without_users_the_layout_belongs_to_the_agent() {
        let (_t, etc, root) = fixture();
        let home = prepare(&root, "s1", Some(&etc.join("skel")), None).unwrap();
        assert!(home.user.is_none() && home.created);
        let h = root.join("s1");
        let me = agent_ids();
        for (p, m) in [
            ("", 0o700),
            ("tmp", 0o700),
            ("mnt", 0o755),
            (".bashrc", 0o644),
        ] {
            assert_eq!(owner(&h.join(p)), me, "{p}");
            assert_eq!(mode(&h.join(p)), m, "{p}");
        }
        // Nothing is written to the account files.
        assert_eq!(
            fs::read_to_string(etc.join("passwd")).unwrap(),
            DEBIAN_PASSWD
        );
    }

    #[test]
    fn an_old_root_owned_home_is_handed_over_without_leaving_it() {
        if !is_root() {
            eprintln!("SKIPPED: needs root to chown");
            return;
        }
        let (t, etc, root) = fixture();
        let h = root.join("old");
        fs::create_dir_all(h.join("work/deep")).unwrap();
        fs::create_dir_all(h.join("mnt/outputs")).unwrap();
        fs::write(h.join("work/deep/f"), b"x").unwrap();
        let outside = t.path().join("outside");
        fs::write(&outside, b"not the session's").unwrap();
        symlink(&outside, h.join("link-out")).unwrap();
        fs::set_permissions(&h, fs::Permissions::from_mode(0o755)).unwrap();
        // A mounted folder below the home must keep its owner. Mounts are made
        // in a mount namespace of this test thread only.
        let mounted = t.path().join("mounted");
        fs::create_dir_all(&mounted).unwrap();
        fs::write(mounted.join("g"), b"grant").unwrap();
        fs::create_dir_all(h.join("work/bound")).unwrap();
        let bound = private_bind(&mounted, &h.join("work/bound"));
        if !bound {
            eprintln!("SKIPPED the mount-point part: cannot make a private mount namespace");
        }
        let db = UserDb::new(&etc, "/bin/bash");
        let home = prepare(&root, "old", Some(&etc.join("skel")), Some(&db)).unwrap();
        assert!(!home.created);
        let uid = home.user.unwrap().uid;
        for p in ["", "work", "work/deep", "work/deep/f", "link-out", "tmp"] {
            assert_eq!(owner(&h.join(p)), (uid, uid), "{p}");
        }
        assert_eq!(mode(&h), 0o700);
        // Not followed, not entered, not the agent's mount directory.
        assert_eq!(owner(&outside), (0, 0));
        assert_eq!(owner(&h.join("mnt")), (0, 0));
        assert_eq!(owner(&h.join("mnt/outputs")), (0, 0));
        // An existing home is not repopulated from /etc/skel.
        assert!(!h.join(".bashrc").exists());
        if bound {
            assert_eq!(owner(&h.join("work/bound/g")), (0, 0));
            assert_eq!(owner(&h.join("work/bound")), (0, 0));
            let target = sys::cstring(h.join("work/bound")).unwrap();
            sys::umount2(&target, libc::MNT_DETACH).unwrap();
        }
    }

    /// Binds `src` onto `dst` in a new mount namespace of the calling thread;
    /// false when that is not possible here.
    fn private_bind(src: &Path, dst: &Path) -> bool {
        // SAFETY: unshare of the mount namespace affects this thread only
        // (it implies CLONE_FS, which the thread then owns alone).
        if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
            return false;
        }
        let private = sys::mount(None, c"/", None, libc::MS_REC | libc::MS_PRIVATE, None);
        let (s, d) = (sys::cstring(src).unwrap(), sys::cstring(dst).unwrap());
        private.is_ok() && sys::mount(Some(&s), &d, None, libc::MS_BIND, None).is_ok()
    }
}
