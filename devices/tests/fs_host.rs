//! The virtio-fs `SessionFs`, mounted on the host over `/dev/fuse` (the same
//! `FileSystem` the device serves), with real programs run against it.
//!
//! Needs root and `/dev/fuse` (CI runs as root). What a host mount can and
//! cannot show: path resolution on a host mount is done by the *host*
//! kernel, so `..` past the mount root and symlink targets resolve in the
//! host's namespace, not the guest's. These tests therefore check what the
//! server controls — the tree it presents (a grant's parent is its virtual
//! session directory), that symlinks come back as symlinks with their
//! literal targets, that operations on a directory a client holds are not
//! redirected when its name is swapped for a symlink, and the mode policy
//! and `EXDEV` answers. That the server itself never follows a symlink or
//! climbs with `..` is tested through the `FileSystem` API in the unit
//! tests (`devices/src/fs/{policy,session}/tests.rs`).

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use devices::fs::fusedev::HostMount;
use devices::fs::{
    GrantMode, GrantOwner, SessionFs, SessionFsOptions, GRANT_ENTRY_TTL, VIRTUAL_DIR_TTL,
};

/// Worker threads per test mount.
const WORKERS: usize = 2;

/// A mounted SessionFs with session `s` holding three grants:
/// `s/ro`, `s/rw`, `s/rwd`, each over its own host directory that holds
/// `pre.txt` and `dir/inner.txt`. A file `outside/secret.txt` sits next to
/// the granted directories on the host, ungranted.
struct Env {
    data: tempfile::TempDir,
    _mnt_dir: tempfile::TempDir,
    fs: Arc<SessionFs>,
    mount: Option<HostMount>,
}

impl Env {
    /// The grants served with the options the helper uses.
    fn new() -> Self {
        Self::with_options(SessionFsOptions::default())
    }

    /// The grants served with extended attributes on.
    fn with_xattrs() -> Self {
        Self::with_options(SessionFsOptions {
            xattr: true,
            ..SessionFsOptions::default()
        })
    }

    fn with_options(opts: SessionFsOptions) -> Self {
        Self::build(opts, None)
    }

    /// The grants presenting `owner` as the owner of their files, mounted
    /// for every host user (`allow_other`) on a mount point they can reach,
    /// so programs can run as the owner's uid the way a session runs in a
    /// guest. The granted host directories are root-owned, mode 0755.
    fn with_owner(owner: GrantOwner) -> Self {
        Self::build(SessionFsOptions::default(), Some(owner))
    }

    fn build(opts: SessionFsOptions, owner: Option<GrantOwner>) -> Self {
        let data = tempfile::tempdir().unwrap();
        for g in ["ro", "rw", "rwd"] {
            let d = data.path().join(g);
            std::fs::create_dir_all(d.join("dir")).unwrap();
            std::fs::write(d.join("pre.txt"), format!("{g} pre-existing\n")).unwrap();
            std::fs::write(d.join("dir/inner.txt"), b"inner\n").unwrap();
        }
        std::fs::create_dir(data.path().join("outside")).unwrap();
        std::fs::write(data.path().join("outside/secret.txt"), b"secret\n").unwrap();
        let fs = Arc::new(SessionFs::new(opts));
        for (g, mode) in [
            ("ro", GrantMode::Ro),
            ("rw", GrantMode::Rw),
            ("rwd", GrantMode::Rwd),
        ] {
            let host = data.path().join(g);
            if owner.is_some() {
                std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
            fs.add_grant_with_owner("s", g, &host, mode, owner).unwrap();
        }
        // The mount point lives in its own temp dir: nothing of the data
        // dir is reachable from it through the host's own `..`.
        let mnt_dir = tempfile::tempdir().unwrap();
        let mount = if owner.is_some() {
            // Other users must be able to reach the mount point.
            std::fs::set_permissions(mnt_dir.path(), std::fs::Permissions::from_mode(0o755))
                .unwrap();
            HostMount::mount_for_everyone(fs.clone(), mnt_dir.path(), WORKERS)
        } else {
            HostMount::mount(fs.clone(), mnt_dir.path(), WORKERS)
        }
        .expect("mounting over /dev/fuse needs root and /dev/fuse (CI runs as root)");
        Self {
            data,
            _mnt_dir: mnt_dir,
            fs,
            mount: Some(mount),
        }
    }

    /// Mount root.
    fn mnt(&self) -> PathBuf {
        self.mount.as_ref().unwrap().mountpoint().to_path_buf()
    }

    /// A path in session `s` through the mount.
    fn m(&self, rel: &str) -> PathBuf {
        self.mnt().join("s").join(rel)
    }

    /// A path in the host data dir.
    fn host(&self, rel: &str) -> PathBuf {
        self.data.path().join(rel)
    }

    fn assert_outside_untouched(&self) {
        assert_eq!(
            std::fs::read(self.host("outside/secret.txt")).unwrap(),
            b"secret\n"
        );
        assert_eq!(std::fs::read_dir(self.host("outside")).unwrap().count(), 1);
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some(m) = self.mount.take() {
            m.unmount().expect("unmount");
        }
    }
}

/// Runs `script` with `sh -e` in `cwd`; returns (success, stdout, stderr).
fn sh(cwd: &Path, script: &str) -> (bool, String, String) {
    run(Command::new("sh").arg("-ec").arg(script), cwd)
}

/// Runs `cmd` in `cwd`; returns (success, stdout, stderr).
fn run(cmd: &mut Command, cwd: &Path) -> (bool, String, String) {
    let out = cmd
        .current_dir(cwd)
        .env("LC_ALL", "C")
        .output()
        .expect("run a command");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `script`, which must succeed; returns its stdout.
fn ok(cwd: &Path, script: &str) -> String {
    let (success, stdout, stderr) = sh(cwd, script);
    assert!(success, "`{script}` failed: {stderr}");
    stdout
}

/// Runs `script`, which must fail with `message` on stderr.
fn fails(cwd: &Path, script: &str, message: &str) {
    let (success, _, stderr) = sh(cwd, script);
    assert!(!success, "`{script}` succeeded");
    assert!(
        stderr.contains(message),
        "`{script}`: expected {message:?}, got {stderr:?}"
    );
}

fn errno(r: io::Result<impl Sized>) -> i32 {
    r.err().and_then(|e| e.raw_os_error()).expect("an OS error")
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).unwrap()
}

fn setxattr(p: &Path, name: &str, value: &[u8]) -> io::Result<()> {
    let (p, n) = (cpath(p), CString::new(name).unwrap());
    // SAFETY: valid NUL-terminated strings and a valid buffer.
    let r = unsafe {
        libc::setxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn getxattr(p: &Path, name: &str) -> io::Result<Vec<u8>> {
    let (p, n) = (cpath(p), CString::new(name).unwrap());
    let mut buf = vec![0u8; 256];
    // SAFETY: valid NUL-terminated strings and a valid buffer.
    let r = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(r as usize);
    Ok(buf)
}

#[test]
fn everyday_commands_in_an_rwd_grant() {
    let env = Env::new();
    let g = env.m("rwd");
    ok(
        &g,
        "echo hello > a.txt
         cat a.txt > b.txt
         echo more >> b.txt
         mv b.txt c.txt
         mkdir -p deep/er/est
         cp c.txt deep/er/est/copy.txt
         ln -s deep/er/est/copy.txt link
         ln c.txt hard
         chmod 640 c.txt
         truncate -s 3 a.txt
         mkfifo fifo
         rm pre.txt
         rm -r dir",
    );
    assert_eq!(ok(&g, "cat link"), "hello\nmore\n");
    assert_eq!(ok(&g, "readlink link"), "deep/er/est/copy.txt\n");
    assert_eq!(ok(&g, "stat -c %a c.txt"), "640\n");
    assert_eq!(ok(&g, "stat -c %h c.txt"), "2\n");
    assert_eq!(ok(&g, "ls"), "a.txt\nc.txt\ndeep\nfifo\nhard\nlink\n");
    // The host sees it all.
    let h = env.host("rwd");
    assert_eq!(std::fs::read(h.join("a.txt")).unwrap(), b"hel");
    assert_eq!(
        std::fs::read(h.join("deep/er/est/copy.txt")).unwrap(),
        b"hello\nmore\n"
    );
    assert_eq!(
        std::fs::metadata(h.join("c.txt")).unwrap().mode() & 0o777,
        0o640
    );
    assert_eq!(
        std::fs::read_link(h.join("link")).unwrap(),
        Path::new("deep/er/est/copy.txt")
    );
    assert!(!h.join("pre.txt").exists() && !h.join("dir").exists());
    // No set-user-ID files and no device nodes from the guest.
    ok(&g, "chmod 4755 c.txt");
    assert_eq!(
        std::fs::metadata(h.join("c.txt")).unwrap().mode() & 0o7777,
        0o755
    );
    fails(&g, "mknod null c 1 3", "Operation not permitted");
    env.assert_outside_untouched();
}

#[test]
fn xattrs_are_not_served_by_default() {
    let env = Env::new();
    let g = env.m("rwd");
    let h = env.host("rwd");
    std::fs::write(h.join("tagged.txt"), b"x").unwrap();
    setxattr(&h.join("tagged.txt"), "user.origin", b"host").unwrap();
    // The kernel turns the server's ENOSYS into "not supported", for good.
    for _ in 0..2 {
        assert_eq!(
            errno(getxattr(&g.join("tagged.txt"), "user.origin")),
            libc::EOPNOTSUPP
        );
        assert_eq!(
            errno(setxattr(&g.join("tagged.txt"), "user.x", b"1")),
            libc::EOPNOTSUPP
        );
    }
    // Tools that copy xattrs when they can still work, and writes leave the
    // host file's attributes alone.
    ok(
        &g,
        "cp -a tagged.txt copy.txt && echo more >> tagged.txt && ls -l >/dev/null",
    );
    assert_eq!(
        getxattr(&h.join("tagged.txt"), "user.origin").unwrap(),
        b"host"
    );
    assert_eq!(std::fs::read(h.join("copy.txt")).unwrap(), b"x");
    env.assert_outside_untouched();
}

#[test]
fn user_xattrs_when_enabled() {
    let env = Env::with_xattrs();
    let g = env.m("rwd");
    let h = env.host("rwd");
    ok(&g, "echo hi > c.txt");
    setxattr(&g.join("c.txt"), "user.origin", b"guest").unwrap();
    assert_eq!(getxattr(&g.join("c.txt"), "user.origin").unwrap(), b"guest");
    assert_eq!(getxattr(&h.join("c.txt"), "user.origin").unwrap(), b"guest");
    assert_eq!(
        errno(setxattr(&g.join("c.txt"), "trusted.x", b"1")),
        libc::EPERM
    );
    assert_eq!(
        errno(setxattr(&g.join("c.txt"), "security.evil", b"1")),
        libc::EPERM
    );
    // Read-only grants refuse xattr changes.
    assert_eq!(
        errno(setxattr(&env.m("ro").join("pre.txt"), "user.x", b"1")),
        libc::EROFS
    );
    env.assert_outside_untouched();
}

#[test]
fn host_changes_reach_a_file_the_guest_holds_open() {
    use std::io::{Read, Seek, SeekFrom};
    let env = Env::new();
    let h = env.host("rwd").join("live.txt");
    std::fs::write(&h, b"first version\n").unwrap();
    let mut f = std::fs::File::open(env.m("rwd").join("live.txt")).unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "first version\n");
    // A host editor rewrites it (longer); once the guest's attributes
    // expire, the cached pages are dropped and the new bytes read.
    std::fs::write(&h, b"second, longer version\n").unwrap();
    std::thread::sleep(GRANT_ENTRY_TTL + std::time::Duration::from_millis(300));
    f.seek(SeekFrom::Start(0)).unwrap();
    s.clear();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "second, longer version\n");
}

#[test]
fn tar_round_trip() {
    let env = Env::new();
    let g = env.m("rwd");
    ok(
        &g,
        "mkdir -p src/a/b src/empty
         i=0; while [ $i -lt 50 ]; do echo \"file $i\" > src/a/f$i; i=$((i+1)); done
         head -c 300000 /dev/urandom > src/a/b/blob
         ln -s ../a/f1 src/empty/rel-link
         chmod 700 src/a/b
         tar -cf archive.tar src
         mkdir out
         tar -C out -xf archive.tar
         diff -r src out/src
         cmp src/a/b/blob out/src/a/b/blob",
    );
    assert_eq!(ok(&g, "tar -tf archive.tar | wc -l").trim(), "56");
    // Compared on the host side too.
    let (same, _, diff) = sh(&env.host("rwd"), "diff -r src out/src");
    assert!(same, "{diff}");
    assert_eq!(ok(&env.host("rwd"), "stat -c %a out/src/a/b"), "700\n");
}

#[test]
fn git_init_and_commit_in_an_rw_grant() {
    let env = Env::new();
    let g = env.m("rw");
    // Everything git touches here it created itself, so rw (no deletion of
    // pre-existing entries) is enough: lock files, index renames, objects.
    ok(
        &g,
        "mkdir repo && cd repo
         git init -q -b main
         git config user.email t@example.com
         git config user.name tester
         echo one > README
         git add README
         git commit -q -m first
         echo two >> README
         mkdir src && echo 'fn main() {}' > src/main.rs
         git add -A
         git commit -q -m second
         git fsck --no-progress
         git status --porcelain",
    );
    assert_eq!(
        ok(&g.join("repo"), "git log --format=%s"),
        "second\nfirst\n"
    );
    // The host sees a valid repository.
    assert_eq!(
        ok(&env.host("rw/repo"), "git log --format=%s"),
        "second\nfirst\n"
    );
    assert_eq!(
        ok(&env.host("rw/repo"), "git show HEAD:README"),
        "one\ntwo\n"
    );
}

#[test]
fn an_ro_grant_refuses_writes() {
    let env = Env::new();
    let g = env.m("ro");
    assert_eq!(
        ok(&g, "cat pre.txt dir/inner.txt"),
        "ro pre-existing\ninner\n"
    );
    let rofs = "Read-only file system";
    fails(&g, "echo x > new.txt", rofs);
    fails(&g, "echo x >> pre.txt", rofs);
    fails(&g, "truncate -s 0 pre.txt", rofs);
    fails(&g, "rm pre.txt", rofs);
    fails(&g, "rm -r dir", rofs);
    fails(&g, "mv pre.txt moved.txt", rofs);
    fails(&g, "mkdir d", rofs);
    fails(&g, "ln -s pre.txt l", rofs);
    fails(&g, "ln pre.txt h", rofs);
    fails(&g, "chmod 777 pre.txt", rofs);
    fails(&g, "touch pre.txt", rofs);
    fails(&g, "mkfifo f", rofs);
    // The virtual directories are read-only too.
    fails(&env.mnt(), "mkdir new-session", rofs);
    fails(&env.m(""), "touch s.txt", rofs);
    fails(&env.m(""), "rmdir ro", rofs);
    let h = env.host("ro");
    assert_eq!(
        std::fs::read(h.join("pre.txt")).unwrap(),
        b"ro pre-existing\n"
    );
    assert_eq!(std::fs::read_dir(&h).unwrap().count(), 2);
}

#[test]
fn an_rw_grant_keeps_preexisting_entries() {
    let env = Env::new();
    let g = env.m("rw");
    let eperm = "Operation not permitted";
    ok(
        &g,
        "echo appended >> pre.txt; echo new > new.txt; mkdir mine; echo x > mine/f",
    );
    fails(&g, "rm pre.txt", eperm);
    fails(&g, "rm dir/inner.txt", eperm);
    fails(&g, "rmdir dir", eperm);
    fails(&g, "mv pre.txt renamed.txt", eperm);
    fails(&g, "mv -f new.txt pre.txt", eperm);
    // What the guest made, it may rename and delete.
    ok(&g, "mv new.txt newer.txt; rm newer.txt; rm -r mine");
    assert_eq!(ok(&g, "ls"), "dir\npre.txt\n");
    assert_eq!(
        std::fs::read(env.host("rw/pre.txt")).unwrap(),
        b"rw pre-existing\nappended\n"
    );
}

#[test]
fn renames_and_links_out_of_a_grant_fail_with_exdev() {
    let env = Env::new();
    ok(&env.m("rw"), "echo mine > mine.txt");
    let exdev = libc::EXDEV;
    assert_eq!(
        errno(std::fs::rename(env.m("rw/mine.txt"), env.m("rwd/mine.txt"))),
        exdev
    );
    assert_eq!(
        errno(std::fs::rename(env.m("rwd/pre.txt"), env.m("rw/pre2.txt"))),
        exdev
    );
    assert_eq!(
        errno(std::fs::hard_link(env.m("rw/pre.txt"), env.m("rwd/h"))),
        exdev
    );
    assert_eq!(
        errno(std::fs::hard_link(env.m("rwd/pre.txt"), env.m("ro/h"))),
        exdev
    );
    // Into the virtual tree: read-only.
    assert_eq!(
        errno(std::fs::rename(env.m("rwd/pre.txt"), env.m("pre.txt"))),
        libc::EROFS
    );
    // mv falls back to copy + delete, and each half obeys its grant: the
    // copy lands, deleting the pre-existing source in rw is refused.
    fails(
        &env.mnt(),
        "mv s/rw/pre.txt s/rwd/moved.txt",
        "Operation not permitted",
    );
    assert!(env.host("rw/pre.txt").exists());
    assert!(env.host("rwd/moved.txt").exists());
    // A guest-created file may move out of rw (copy + delete both allowed).
    ok(&env.mnt(), "mv s/rw/mine.txt s/rwd/mine.txt");
    assert!(!env.host("rw/mine.txt").exists());
    assert_eq!(std::fs::read(env.host("rwd/mine.txt")).unwrap(), b"mine\n");
}

#[test]
fn escape_attempts_stay_inside_the_grants() {
    let env = Env::new();
    let g = env.m("rwd");
    // `..` from a grant root is the virtual session directory, never the
    // host directory that holds the granted one (where `outside/` is).
    assert_eq!(ok(&g, "ls .."), "ro\nrw\nrwd\n");
    assert_eq!(ok(&g, "ls dir/../.."), "ro\nrw\nrwd\n");
    assert_eq!(ok(&g, "cd ../..; ls"), "s\n");
    let (found, _, _) = sh(&g, "ls ../outside || ls ../../outside");
    assert!(!found, "the host parent is not reachable");

    // Symlinks are stored and returned verbatim; the server never resolves
    // them (on a host mount the host kernel then resolves them in its own
    // namespace, in a guest the guest kernel does, in the guest's).
    let secret = env.host("outside/secret.txt");
    ok(
        &g,
        &format!(
            "ln -s {} abs; ln -s ../../../outside/secret.txt rel",
            secret.display()
        ),
    );
    assert_eq!(std::fs::read_link(g.join("abs")).unwrap(), secret);
    assert_eq!(std::fs::read_link(env.host("rwd/abs")).unwrap(), secret);
    assert!(std::fs::symlink_metadata(env.host("rwd/abs"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(
        std::fs::read_link(env.host("rwd/rel")).unwrap(),
        Path::new("../../../outside/secret.txt")
    );
    // A relative symlink into another grant is resolved by the client to a
    // path of that grant, whose policy applies.
    ok(&g, "ln -s ../ro/pre.txt to-ro");
    fails(&g, "echo x > to-ro", "Read-only file system");
    assert_eq!(ok(&g, "cat to-ro"), "ro pre-existing\n");

    // Swap a directory the client holds open for a symlink to the outside:
    // creating through the held directory still lands in the real one.
    ok(&g, "mkdir held");
    let held = std::fs::File::open(g.join("held")).unwrap();
    ok(
        &g,
        &format!(
            "mv held held-real; ln -s {} held",
            env.host("outside").display()
        ),
    );
    let name = CString::new("created-via-fd").unwrap();
    // SAFETY: valid directory fd and NUL-terminated name.
    let fd = unsafe {
        libc::openat(
            held.as_raw_fd(),
            name.as_ptr(),
            libc::O_CREAT | libc::O_WRONLY,
            0o644,
        )
    };
    assert!(fd >= 0, "openat: {}", io::Error::last_os_error());
    // SAFETY: fd was just opened by us.
    unsafe { libc::close(fd) };
    assert!(env.host("rwd/held-real/created-via-fd").exists());
    // Same for a hard link: the source must be in the same grant.
    assert_eq!(
        errno(std::fs::hard_link(env.m("ro/pre.txt"), g.join("stolen"))),
        libc::EXDEV
    );
    env.assert_outside_untouched();
}

#[test]
fn grants_appear_and_vanish_while_mounted() {
    let env = Env::new();
    let mnt = env.mnt();
    std::fs::create_dir_all(env.host("late/skills")).unwrap();
    std::fs::write(env.host("late/skills/s.md"), b"skill\n").unwrap();
    assert_eq!(ok(&mnt, "ls"), "s\n");

    // Added at runtime: visible at once, no remount.
    env.fs
        .add_grant(
            "s2",
            ".claude/skills",
            &env.host("late/skills"),
            GrantMode::Rw,
        )
        .unwrap();
    let notes = env
        .fs
        .add_grant("s2", "notes.txt", &env.host("rw/pre.txt"), GrantMode::Ro)
        .unwrap();
    assert_eq!(ok(&mnt, "ls"), "s\ns2\n");
    assert_eq!(ok(&mnt, "ls s2/.claude"), "skills\n");
    assert_eq!(
        ok(&mnt, "cat s2/.claude/skills/s.md s2/notes.txt"),
        "skill\nrw pre-existing\n"
    );
    ok(&mnt, "echo new > s2/.claude/skills/new.md");
    assert!(env.host("late/skills/new.md").exists());
    fails(&mnt, "echo x >> s2/notes.txt", "Read-only file system");

    // Removing a grant, then the session, while the mount is in use.
    let held = std::fs::File::open(mnt.join("s2/.claude/skills/s.md")).unwrap();
    env.fs.remove_grant(notes).unwrap();
    assert_eq!(env.fs.remove_session("s2"), 1);
    assert_eq!(ok(&mnt, "ls"), "s\n");
    // An open file of a removed grant is dead.
    let mut buf = [0u8; 8];
    // SAFETY: valid fd and buffer.
    let n = unsafe { libc::pread(held.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    assert!(n < 0, "read from a removed grant succeeded");
    // Names cached by the host kernel expire within their lifetimes.
    std::thread::sleep(VIRTUAL_DIR_TTL.max(GRANT_ENTRY_TTL) + Duration::from_millis(300));
    assert!(!mnt.join("s2").exists());
    assert!(!mnt.join("s2/.claude/skills/s.md").exists());
    // The other session is unaffected; the session can come back.
    assert_eq!(ok(&mnt, "cat s/ro/pre.txt"), "ro pre-existing\n");
    env.fs
        .add_grant("s2", "again", &env.host("late"), GrantMode::Ro)
        .unwrap();
    assert_eq!(ok(&mnt, "cat s2/again/skills/s.md"), "skill\n");
    assert_eq!(env.fs.grants().len(), 4);
    let mode = std::fs::metadata(mnt.join("s2"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o555, "virtual directories are read-only");
}

/// The server negotiates HANDLE_KILLPRIV_V2, so the client kernel leaves it
/// to the server to clear set-ID bits of pre-existing host files that a
/// writer without CAP_FSETID writes or truncates, although the server (like
/// a root helper) holds CAP_FSETID itself.
#[test]
fn writes_and_truncations_clear_set_id_bits_on_the_host() {
    /// Runs the quoted script without CAP_FSETID (as root otherwise).
    const NO_FSETID: &str = "setpriv --bounding-set=-fsetid sh -ec";
    let env = Env::new();
    for g in ["rw", "rwd"] {
        let host = env.host(&format!("{g}/pre.txt"));
        std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o6755)).unwrap();
        ok(
            &env.mnt(),
            &format!("{NO_FSETID} 'echo more >> s/{g}/pre.txt'"),
        );
        let mode = std::fs::metadata(&host).unwrap().mode();
        assert_eq!(mode & 0o6000, 0, "{g}: write kept set-ID bits: {mode:o}");
        assert_eq!(
            std::fs::read_to_string(&host).unwrap(),
            format!("{g} pre-existing\nmore\n")
        );
        std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o4755)).unwrap();
        ok(&env.mnt(), &format!("{NO_FSETID} ': > s/{g}/pre.txt'"));
        let mode = std::fs::metadata(&host).unwrap().mode();
        assert_eq!(
            mode & 0o6000,
            0,
            "{g}: truncation kept set-ID bits: {mode:o}"
        );
        assert_eq!(std::fs::metadata(&host).unwrap().len(), 0);
    }
    // Without a write, the bits stay (reads are not modifications).
    let host = env.host("rwd/dir/inner.txt");
    std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o4755)).unwrap();
    ok(&env.mnt(), "cat s/rwd/dir/inner.txt >/dev/null");
    assert_eq!(std::fs::metadata(&host).unwrap().mode() & 0o7777, 0o4755);
    env.assert_outside_untouched();
}

/// The uid (and gid) of the session user in the ownership tests: neither
/// root nor a user the host is likely to have.
const SESSION_ID: u32 = 43_210;

/// Runs `script` with `sh -e` in `cwd` as user and group `id`, without
/// supplementary groups or capabilities (as a session process in a guest).
fn sh_as(id: u32, cwd: &Path, script: &str) -> (bool, String, String) {
    run(
        Command::new("setpriv")
            .arg(format!("--reuid={id}"))
            .arg(format!("--regid={id}"))
            .arg("--clear-groups")
            .arg("--inh-caps=-all")
            .args(["sh", "-ec", script])
            .env("HOME", "/"),
        cwd,
    )
}

/// [`sh_as`], which must succeed; returns its stdout.
fn ok_as(id: u32, cwd: &Path, script: &str) -> String {
    let (success, stdout, stderr) = sh_as(id, cwd, script);
    assert!(success, "`{script}` as {id} failed: {stderr}");
    stdout
}

/// [`sh_as`], which must fail with `message` on stderr.
fn fails_as(id: u32, cwd: &Path, script: &str, message: &str) {
    let (success, _, stderr) = sh_as(id, cwd, script);
    assert!(!success, "`{script}` as {id} succeeded");
    assert!(
        stderr.contains(message),
        "`{script}` as {id}: expected {message:?}, got {stderr:?}"
    );
}

#[test]
fn a_session_user_uses_grants_presented_as_its_own() {
    let id = SESSION_ID;
    let env = Env::with_owner(GrantOwner::same(id));
    let me = std::fs::metadata(env.data.path()).unwrap();
    let helper = (me.uid(), me.gid());
    assert_ne!(helper.0, id);
    for g in ["ro", "rw", "rwd"] {
        let host = std::fs::metadata(env.host(g)).unwrap();
        assert_eq!((host.uid(), host.mode() & 0o777), (helper.0, 0o755));
    }
    let shown = format!("{id}:{id}");
    // Everyone sees the presented owner on the grants, and root on the
    // virtual directories.
    assert_eq!(
        ok(&env.m(""), "stat -c %u:%g rw ro/pre.txt rwd/dir/inner.txt"),
        format!("{shown}\n{shown}\n{shown}\n")
    );
    assert_eq!(ok(&env.mnt(), "stat -c %u:%g:%a s"), "0:0:555\n");

    // The session user writes in rw (a 0755 directory of another host
    // user), and sees its own ids on everything it lists and creates.
    let rw = env.m("rw");
    ok_as(
        id,
        &rw,
        // Its own umask: another test's grant import sets the process-wide
        // umask to 0 for a moment (fuse-backend-rs), and a child forked
        // then would inherit it.
        "umask 022
         echo new > new.txt
         echo more >> pre.txt
         mkdir d
         ln -s new.txt d/l
         ln new.txt d/h
         mkfifo d/f
         cp -p new.txt copy.txt
         touch -d @86400 new.txt
         chmod 600 copy.txt
         chown $(id -u) new.txt
         chgrp $(id -g) new.txt
         chown -h $(id -u):$(id -g) d/l
         chown -R $(id -u):$(id -g) d",
    );
    let listed = ok_as(id, &rw, "ls -lnA . d | awk 'NF > 4 { print $3 \":\" $4 }'");
    assert_eq!(listed.lines().count(), 8, "{listed}");
    assert!(listed.lines().all(|l| l == shown), "{listed}");
    assert_eq!(
        ok_as(id, &rw, "stat -c %u:%g:%a new.txt copy.txt d"),
        format!("{shown}:644\n{shown}:600\n{shown}:755\n")
    );
    // Other owners are refused: by the host kernel for the session user,
    // by the server for root (which the kernel would let through).
    fails_as(id, &rw, "chown 0 new.txt", "Operation not permitted");
    fails(&rw, "chown 4242 new.txt", "Operation not permitted");
    fails(&rw, "chgrp 4242 new.txt", "Operation not permitted");
    ok(&rw, &format!("chown {shown} new.txt"));
    // Root keeps owners when archiving and extracting (a chown to the
    // presented owner).
    ok(
        &rw,
        "tar -cf a.tar new.txt d && mkdir x && tar -C x -xpf a.tar --same-owner && cp -a d y",
    );
    assert_eq!(
        ok(&rw, "stat -c %u:%g x/new.txt x/d y"),
        format!("{shown}\n{shown}\n{shown}\n")
    );
    // On the host, what the session made belongs to the helper's user and
    // the pre-existing file kept its owner.
    for p in [
        "new.txt",
        "copy.txt",
        "d",
        "d/l",
        "d/f",
        "x/new.txt",
        "pre.txt",
    ] {
        let m = std::fs::symlink_metadata(env.host("rw").join(p)).unwrap();
        assert_eq!((m.uid(), m.gid()), helper, "host owner of {p}");
    }
    assert_eq!(
        std::fs::read(env.host("rw/pre.txt")).unwrap(),
        b"rw pre-existing\nmore\n"
    );
    // rw still keeps pre-existing entries; rwd lets the user delete them.
    fails_as(id, &rw, "rm pre.txt", "Operation not permitted");
    ok_as(id, &rw, "rm new.txt copy.txt && rm -r d");
    ok_as(id, &env.m("rwd"), "rm pre.txt && rm -r dir && echo x > y");

    // The read-only grant reads but refuses every write.
    let ro = env.m("ro");
    assert_eq!(ok_as(id, &ro, "cat pre.txt"), "ro pre-existing\n");
    let rofs = "Read-only file system";
    fails_as(id, &ro, "echo x > new.txt", rofs);
    fails_as(id, &ro, "echo x >> pre.txt", rofs);
    fails_as(id, &ro, "mkdir d", rofs);
    fails_as(id, &ro, "chmod 600 pre.txt", rofs);
    fails_as(id, &ro, "chown $(id -u) pre.txt", rofs);
    // The virtual directories stay read-only for the session user.
    fails_as(id, &env.m(""), "mkdir x", "Permission denied");
    assert_eq!(std::fs::read_dir(env.host("ro")).unwrap().count(), 2);
    env.assert_outside_untouched();
}

#[test]
fn a_root_owned_read_only_grant_runs_for_a_session_user() {
    // How the SDK is granted: read-only, presented as root's, its binary
    // mode 0755 on the host.
    let data = tempfile::tempdir().unwrap();
    let bin = data.path().join("tool");
    std::fs::write(&bin, b"#!/bin/sh\necho ran as $(id -u)\n").unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(data.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let fs = Arc::new(SessionFs::new(SessionFsOptions::default()));
    fs.add_grant_with_owner(
        ".sdk",
        "current",
        data.path(),
        GrantMode::Ro,
        Some(GrantOwner::same(0)),
    )
    .unwrap();
    let mnt_dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(mnt_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mount = HostMount::mount_for_everyone(fs, mnt_dir.path(), WORKERS)
        .expect("mounting over /dev/fuse needs root and /dev/fuse (CI runs as root)");
    let dir = mount.mountpoint().join(".sdk/current");
    let id = SESSION_ID;
    assert_eq!(ok_as(id, &dir, "./tool"), format!("ran as {id}\n"));
    assert_eq!(ok_as(id, &dir, "stat -c %u:%g:%a tool"), "0:0:755\n");
    fails_as(id, &dir, "echo x >> tool", "Permission denied");
    fails_as(id, &dir, "chown $(id -u) tool", "Operation not permitted");
    mount.unmount().unwrap();
}
