//! SessionFs through the `FileSystem` API: grant table, virtual tree,
//! cross-grant refusals, runtime add/remove.

use fuse_backend_rs::api::filesystem::ROOT_ID;

use super::*;
use crate::fs::testutil::*;

fn session_fs() -> SessionFs {
    session_fs_with(SessionFsOptions::default())
}

fn session_fs_with(opts: SessionFsOptions) -> SessionFs {
    let fs = SessionFs::new(opts);
    fs.init(FsOptions::empty()).unwrap();
    fs
}

fn xattr_session_fs() -> SessionFs {
    session_fs_with(SessionFsOptions {
        xattr: true,
        ..SessionFsOptions::default()
    })
}

fn lookup(fs: &SessionFs, parent: u64, name: &str) -> io::Result<Entry> {
    fs.lookup(&ctx(), parent, &c(name))
}

fn walk(fs: &SessionFs, path: &str) -> io::Result<Entry> {
    let mut e = fs.getattr(&ctx(), ROOT_ID, None).map(|(attr, _)| Entry {
        inode: ROOT_ID,
        attr,
        ..Entry::default()
    })?;
    for part in path.split('/').filter(|p| !p.is_empty()) {
        e = lookup(fs, e.inode, part)?;
    }
    Ok(e)
}

fn names(fs: &SessionFs, dir: u64) -> Vec<String> {
    let (h, _) = fs.opendir(&ctx(), dir, 0).unwrap();
    let mut out = Vec::new();
    fs.readdir(&ctx(), dir, h.unwrap_or(0), 4096, 0, &mut |d| {
        out.push(String::from_utf8_lossy(d.name).into_owned());
        Ok(1)
    })
    .unwrap();
    fs.releasedir(&ctx(), dir, 0, h.unwrap_or(0)).unwrap();
    out.retain(|n| n != "." && n != "..");
    out.sort();
    out
}

fn mode_of(e: &Entry) -> u32 {
    e.attr.st_mode & libc::S_IFMT
}

#[test]
fn grants_are_validated() {
    let fx = Fixture::new();
    let fs = session_fs();
    let host = fx.host();
    let bad_sessions = ["", ".", "..", "a/b", "a\0b", "a\nb"];
    for s in bad_sessions {
        assert!(
            matches!(
                fs.add_grant(s, "m", &host, GrantMode::Ro),
                Err(SessionFsError::InvalidSession { .. })
            ),
            "{s:?}"
        );
    }
    assert!(fs
        .add_grant(&"x".repeat(256), "m", &host, GrantMode::Ro)
        .is_err());
    for m in ["", "/abs", "a/", "a//b", "a/../b", "..", "./a", "a/./b"] {
        assert!(
            matches!(
                fs.add_grant("s", m, &host, GrantMode::Ro),
                Err(SessionFsError::InvalidMountName { .. })
            ),
            "{m:?}"
        );
    }
    assert!(matches!(
        fs.add_grant("s", "m", Path::new("relative/path"), GrantMode::Ro),
        Err(SessionFsError::RelativeHostPath(_))
    ));
    assert!(matches!(
        fs.add_grant("s", "m", &host.join("missing"), GrantMode::Ro),
        Err(SessionFsError::HostPath { .. })
    ));
    assert!(matches!(
        fs.add_grant("s", "m", Path::new("/"), GrantMode::Ro),
        Err(SessionFsError::HostRoot(_))
    ));
    assert!(matches!(
        fs.add_grant("s", "m", &host.join("sub/.."), GrantMode::Ro)
            .map(|_| ()),
        Ok(())
    ));
    assert!(matches!(
        fs.add_grant("s", "null", Path::new("/dev/null"), GrantMode::Ro),
        Err(SessionFsError::UnsupportedFileType(_))
    ));
    // Nesting inside or around an existing grant of the same session.
    assert!(matches!(
        fs.add_grant("s", "m/inner", &host, GrantMode::Ro),
        Err(SessionFsError::Nested { .. })
    ));
    fs.add_grant("s", "n/inner", &host, GrantMode::Ro).unwrap();
    assert!(matches!(
        fs.add_grant("s", "n", &host, GrantMode::Ro),
        Err(SessionFsError::Nested { .. })
    ));
    // Same names in another session are independent; "m2" is no prefix clash.
    fs.add_grant("t", "m/inner", &host, GrantMode::Ro).unwrap();
    fs.add_grant("s", "m2", &host, GrantMode::Ro).unwrap();
    // A symlinked host path is resolved once, at grant time.
    let id = fs
        .add_grant("s", "via-link", &host.join("abs_out"), GrantMode::Ro)
        .unwrap();
    let info = fs.grants().into_iter().find(|g| g.id == id).unwrap();
    assert_eq!(info.host_path, fx.outside().canonicalize().unwrap());
    assert_eq!(info.guest_path, "/s/via-link");
    assert_eq!(fs.grants().len(), 5);
}

#[test]
fn the_tree_is_built_from_grants() {
    let fx = Fixture::new();
    let fs = session_fs();
    fs.add_grant("s1", "proj", &fx.host(), GrantMode::Ro)
        .unwrap();
    fs.add_grant(
        "s1",
        ".claude/skills",
        &fx.host().join("sub"),
        GrantMode::Rw,
    )
    .unwrap();
    fs.add_grant(
        "s2",
        "notes.txt",
        &fx.host().join("pre.txt"),
        GrantMode::Rwd,
    )
    .unwrap();

    assert_eq!(names(&fs, ROOT_ID), ["s1", "s2"]);
    let s1 = walk(&fs, "s1").unwrap();
    assert_eq!(mode_of(&s1), libc::S_IFDIR);
    assert_eq!(s1.attr.st_mode & 0o7777, VIRTUAL_DIR_PERMS);
    assert_eq!(s1.entry_timeout, VIRTUAL_DIR_TTL);
    assert_eq!(names(&fs, s1.inode), [".claude", "proj"]);
    let skills = walk(&fs, "s1/.claude/skills").unwrap();
    assert_eq!(names(&fs, skills.inode), ["inner.txt"]);
    let inner = lookup(&fs, skills.inode, "inner.txt").unwrap();
    assert_eq!(inner.attr.st_size as usize, INNER.len());
    assert_ne!(fs_index(inner.inode), 0);
    let notes = walk(&fs, "s2/notes.txt").unwrap();
    assert_eq!(mode_of(&notes), libc::S_IFREG);
    let proj = walk(&fs, "s1/proj").unwrap();
    assert_eq!(
        names(&fs, proj.inode),
        ["abs_out", "pre.txt", "rel_out", "sub"]
    );
    assert_ne!(fs_index(proj.inode), fs_index(skills.inode));

    // READDIRPLUS of a virtual directory presents grant roots with live
    // attributes and virtual children as read-only directories.
    let mut seen = Vec::new();
    fs.readdirplus(&ctx(), s1.inode, 0, 4096, 0, &mut |d, e| {
        seen.push((String::from_utf8_lossy(d.name).into_owned(), e));
        Ok(1)
    })
    .unwrap();
    seen.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].1.attr.st_mode, libc::S_IFDIR | VIRTUAL_DIR_PERMS);
    assert_eq!(seen[1].1.inode, proj.inode);
    assert_eq!(seen[1].1.attr.st_nlink, proj.attr.st_nlink);
}

#[test]
fn a_grant_root_shows_live_attributes() {
    let fx = Fixture::new();
    let fs = session_fs();
    fs.add_grant("s", "notes.txt", &fx.host().join("pre.txt"), GrantMode::Ro)
        .unwrap();
    assert_eq!(
        walk(&fs, "s/notes.txt").unwrap().attr.st_size as usize,
        PRE.len()
    );
    std::fs::write(fx.host().join("pre.txt"), b"grown by the host user").unwrap();
    let e = walk(&fs, "s/notes.txt").unwrap();
    assert_eq!(
        e.attr.st_size, 22,
        "the attributes captured at mount time are refreshed"
    );
    let (attr, _) = fs.getattr(&ctx(), e.inode, None).unwrap();
    assert_eq!(attr.st_size, 22);
}

#[test]
fn xattr_requests_are_enosys_unless_enabled() {
    let fx = Fixture::new();
    std::fs::write(fx.host().join("f"), b"x").unwrap();
    let fs = session_fs();
    fs.add_grant("s", "g", &fx.host(), GrantMode::Rwd).unwrap();
    let x = ctx();
    let file = walk(&fs, "s/g/f").unwrap().inode;
    let enosys = libc::ENOSYS;
    for ino in [ROOT_ID, file] {
        assert_eq!(errno_of(fs.getxattr(&x, ino, &c("user.k"), 64)), enosys);
        assert_eq!(errno_of(fs.listxattr(&x, ino, 0)), enosys);
        assert_eq!(
            errno_of(fs.setxattr(&x, ino, &c("user.k"), b"v", 0)),
            enosys
        );
        assert_eq!(errno_of(fs.removexattr(&x, ino, &c("user.k"))), enosys);
    }
    let fs = xattr_session_fs();
    fs.add_grant("s", "g", &fx.host(), GrantMode::Rwd).unwrap();
    let file = walk(&fs, "s/g/f").unwrap().inode;
    fs.setxattr(&x, file, &c("user.k"), b"v", 0).unwrap();
    assert!(matches!(
        fs.getxattr(&x, file, &c("user.k"), 64).unwrap(),
        GetxattrReply::Value(v) if v == b"v"
    ));
}

#[test]
fn the_virtual_tree_is_read_only() {
    let fx = Fixture::new();
    let fs = xattr_session_fs();
    fs.add_grant("s", "a/b", &fx.host(), GrantMode::Rwd)
        .unwrap();
    let x = ctx();
    let s = walk(&fs, "s").unwrap().inode;
    let a = walk(&fs, "s/a").unwrap().inode;
    let erofs = libc::EROFS;
    for dir in [ROOT_ID, s, a] {
        assert_eq!(errno_of(fs.mkdir(&x, dir, &c("d"), 0o755, 0)), erofs);
        assert_eq!(
            errno_of(fs.create(&x, dir, &c("f"), create_args(libc::O_RDWR, 0o644))),
            erofs
        );
        assert_eq!(
            errno_of(fs.mknod(&x, dir, &c("f"), libc::S_IFIFO | 0o644, 0, 0)),
            erofs
        );
        assert_eq!(errno_of(fs.symlink(&x, &c("/"), dir, &c("l"))), erofs);
        assert_eq!(errno_of(fs.unlink(&x, dir, &c("b"))), erofs);
        assert_eq!(errno_of(fs.rmdir(&x, dir, &c("a"))), erofs);
        assert_eq!(errno_of(fs.setxattr(&x, dir, &c("user.k"), b"v", 0)), erofs);
        assert_eq!(errno_of(fs.removexattr(&x, dir, &c("user.k"))), erofs);
        // SAFETY: stat64 is plain data.
        let attr: stat64 = unsafe { std::mem::zeroed() };
        assert_eq!(
            errno_of(fs.setattr(&x, dir, attr, None, SetattrValid::MODE)),
            erofs
        );
        assert_eq!(errno_of(fs.access(&x, dir, libc::W_OK as u32)), erofs);
        fs.access(&x, dir, (libc::R_OK | libc::X_OK) as u32)
            .unwrap();
        // Never ENOSYS: the Linux client would disable these for the mount.
        assert_eq!(
            errno_of(fs.getxattr(&x, dir, &c("user.k"), 64)),
            libc::ENODATA
        );
        assert!(matches!(
            fs.listxattr(&x, dir, 0).unwrap(),
            ListxattrReply::Count(0)
        ));
        assert_eq!(
            errno_of(fs.open(&x, dir, libc::O_RDONLY as u32, 0)),
            libc::EISDIR
        );
        fs.opendir(&x, dir, 0).unwrap();
        fs.fsyncdir(&x, dir, false, 0).unwrap();
    }
    assert_eq!(
        errno_of(fs.rename(&x, s, &c("a"), ROOT_ID, &c("a2"), 0)),
        erofs
    );
    assert_eq!(names(&fs, s), ["a"]);
}

#[test]
fn renames_and_links_across_grants_fail_with_exdev() {
    let fx = Fixture::new();
    std::fs::create_dir(fx.dir.path().join("other")).unwrap();
    let fs = session_fs();
    fs.add_grant("s", "one", &fx.host(), GrantMode::Rwd)
        .unwrap();
    fs.add_grant("s", "two", &fx.dir.path().join("other"), GrantMode::Rwd)
        .unwrap();
    // The same host directory granted twice is still two grants.
    fs.add_grant("s", "again", &fx.host(), GrantMode::Rwd)
        .unwrap();
    let x = ctx();
    let one = walk(&fs, "s/one").unwrap().inode;
    let two = walk(&fs, "s/two").unwrap().inode;
    let again = walk(&fs, "s/again").unwrap().inode;
    let pre = lookup(&fs, one, "pre.txt").unwrap().inode;
    for dest in [two, again] {
        assert_eq!(
            errno_of(fs.rename(&x, one, &c("pre.txt"), dest, &c("moved"), 0)),
            libc::EXDEV
        );
        assert_eq!(errno_of(fs.link(&x, pre, dest, &c("hard"))), libc::EXDEV);
    }
    // Into or out of the virtual tree: read-only.
    let s = walk(&fs, "s").unwrap().inode;
    assert_eq!(
        errno_of(fs.rename(&x, one, &c("pre.txt"), s, &c("moved"), 0)),
        libc::EROFS
    );
    assert_eq!(errno_of(fs.link(&x, pre, s, &c("hard"))), libc::EROFS);
    // Within one grant they work.
    fs.rename(&x, one, &c("pre.txt"), one, &c("renamed"), 0)
        .unwrap();
    assert!(fx.host().join("renamed").exists());
    assert!(std::fs::read_dir(fx.dir.path().join("other"))
        .unwrap()
        .next()
        .is_none());
}

#[test]
fn dot_and_dotdot_never_climb_out_of_a_grant() {
    let fx = Fixture::new();
    let fs = session_fs();
    fs.add_grant("s", "m", &fx.host().join("sub"), GrantMode::Rwd)
        .unwrap();
    let root = walk(&fs, "s/m").unwrap().inode;
    for dir in [ROOT_ID, walk(&fs, "s").unwrap().inode, root] {
        assert_eq!(errno_of(lookup(&fs, dir, "..")), libc::EINVAL);
        assert_eq!(errno_of(lookup(&fs, dir, ".")), libc::EINVAL);
    }
    // The grant root's host parent holds pre.txt; it is not reachable.
    assert_eq!(errno_of(lookup(&fs, root, "pre.txt")), libc::ENOENT);
    assert_eq!(errno_of(lookup(&fs, root, "../pre.txt")), libc::EINVAL);
}

#[test]
fn grants_come_and_go_at_runtime() {
    let fx = Fixture::new();
    let fs = session_fs();
    let x = ctx();
    let a = fs
        .add_grant("s", ".claude/skills", &fx.host(), GrantMode::Ro)
        .unwrap();
    fs.add_grant("s", "out", &fx.host().join("sub"), GrantMode::Rw)
        .unwrap();
    fs.add_grant("other", "m", &fx.host(), GrantMode::Ro)
        .unwrap();
    let skills = walk(&fs, "s/.claude/skills").unwrap();
    let pre = lookup(&fs, skills.inode, "pre.txt").unwrap();
    let claude = walk(&fs, "s/.claude").unwrap();

    // Removing one grant prunes the virtual directories only it needed.
    fs.remove_grant(a).unwrap();
    assert!(matches!(
        fs.remove_grant(a),
        Err(SessionFsError::UnknownGrant(_))
    ));
    assert_eq!(names(&fs, walk(&fs, "s").unwrap().inode), ["out"]);
    assert_eq!(errno_of(walk(&fs, "s/.claude")), libc::ENOENT);
    // Inodes the guest still holds are dead.
    assert!(fs.getattr(&x, pre.inode, None).is_err());
    assert!(fs.open(&x, pre.inode, libc::O_RDONLY as u32, 0).is_err());
    assert!(fs.getattr(&x, claude.inode, None).is_err());
    assert!(lookup(&fs, skills.inode, "pre.txt").is_err());

    // Removing a session removes its directory; others stay.
    assert_eq!(fs.remove_session("s"), 1);
    assert_eq!(fs.remove_session("s"), 0);
    assert_eq!(names(&fs, ROOT_ID), ["other"]);
    assert_eq!(errno_of(walk(&fs, "s")), libc::ENOENT);

    // Adding again works, with fresh inode numbers.
    fs.add_grant("s", ".claude/skills", &fx.host(), GrantMode::Rwd)
        .unwrap();
    let again = walk(&fs, "s/.claude/skills").unwrap();
    assert_ne!(again.inode, skills.inode);
    assert_eq!(
        lookup(&fs, again.inode, "pre.txt").unwrap().attr.st_size as usize,
        PRE.len()
    );
    assert_eq!(names(&fs, ROOT_ID), ["other", "s"]);
}

#[test]
fn adding_at_an_existing_name_replaces_the_grant() {
    let fx = Fixture::new();
    let fs = session_fs();
    let first = fs.add_grant("s", "m", &fx.host(), GrantMode::Ro).unwrap();
    let old_root = walk(&fs, "s/m").unwrap().inode;
    let second = fs
        .add_grant("s", "m", &fx.host().join("sub"), GrantMode::Rwd)
        .unwrap();
    assert_ne!(first, second);
    assert_eq!(fs.grants().len(), 1);
    assert_eq!(fs.grants()[0].mode, GrantMode::Rwd);
    let root = walk(&fs, "s/m").unwrap().inode;
    assert_eq!(names(&fs, root), ["inner.txt"]);
    assert!(fs.getattr(&ctx(), old_root, None).is_err());
}

#[test]
fn the_grant_limit_is_enforced() {
    let fx = Fixture::new();
    let fs = session_fs();
    for i in 0..MAX_GRANTS {
        fs.add_grant("s", &format!("m{i}"), &fx.host(), GrantMode::Ro)
            .unwrap();
    }
    assert!(matches!(
        fs.add_grant("s", "one-too-many", &fx.host(), GrantMode::Ro),
        Err(SessionFsError::TooManyGrants { .. })
    ));
    // Replacing at the limit still works, and so does adding after removal.
    fs.add_grant("s", "m0", &fx.host(), GrantMode::Rw).unwrap();
    assert_eq!(fs.remove_session("s"), MAX_GRANTS);
    fs.add_grant("s", "m", &fx.host(), GrantMode::Ro).unwrap();
    assert_eq!(names(&fs, walk(&fs, "s").unwrap().inode), ["m"]);
}

#[test]
fn forged_inode_numbers_reach_nothing() {
    let fx = Fixture::new();
    let fs = session_fs();
    fs.add_grant("s", "m", &fx.host(), GrantMode::Rwd).unwrap();
    let x = ctx();
    let live = fs_index(walk(&fs, "s/m").unwrap().inode);
    let forged = [
        0,
        12345,
        (live << FS_INDEX_SHIFT) | 999,
        ((live + 1) << FS_INDEX_SHIFT) | 1,
        (200 << FS_INDEX_SHIFT) | 1,
        u64::MAX,
    ];
    for ino in forged {
        assert!(fs.getattr(&x, ino, None).is_err(), "{ino:#x}");
        assert!(lookup(&fs, ino, "secret.txt").is_err());
        assert!(fs.open(&x, ino, libc::O_RDONLY as u32, 0).is_err());
        assert!(fs.readlink(&x, ino).is_err());
        fs.forget(&x, ino, 1);
    }
    fx.assert_outside_untouched();
}

#[test]
fn a_second_init_resets_the_session() {
    let fx = Fixture::new();
    let fs = session_fs();
    fs.add_grant("s", "m", &fx.host(), GrantMode::Ro).unwrap();
    let pre = walk(&fs, "s/m/pre.txt").unwrap();
    // A rebooted guest sends INIT again without DESTROY.
    fs.init(FsOptions::empty()).unwrap();
    assert!(
        fs.getattr(&ctx(), pre.inode, None).is_err(),
        "old inodes are gone"
    );
    let pre = walk(&fs, "s/m/pre.txt").unwrap();
    assert_eq!(pre.attr.st_size as usize, PRE.len());
}

#[test]
fn helper_credentials_ignore_guest_ids() {
    let fs = SessionFs::new(SessionFsOptions::default());
    let mut x = Context {
        uid: 1234,
        gid: 5678,
        pid: 1,
    };
    fs.id_remap(&mut x).unwrap();
    assert_eq!((x.uid, x.gid), (0, 0));
    let fs = SessionFs::new(SessionFsOptions {
        credentials: Credentials::Guest,
        ..SessionFsOptions::default()
    });
    let mut x = Context {
        uid: 1234,
        gid: 5678,
        pid: 1,
    };
    fs.id_remap(&mut x).unwrap();
    assert_eq!((x.uid, x.gid), (1234, 5678));
}

#[test]
fn negotiated_options_keep_the_server_in_control() {
    let fs = SessionFs::new(SessionFsOptions::default());
    let opts = fs.init(FsOptions::all()).unwrap();
    // Real opens (the policy sees every open's flags), no guest write-back
    // cache, no NFS export (no lookups of "." / ".." by handle), no DAX.
    for refused in [
        FsOptions::ZERO_MESSAGE_OPEN,
        FsOptions::ZERO_MESSAGE_OPENDIR,
        FsOptions::WRITEBACK_CACHE,
        FsOptions::EXPORT_SUPPORT,
        FsOptions::PERFILE_DAX,
    ] {
        assert!(!opts.contains(refused), "{refused:?} negotiated");
    }
    assert!(opts.contains(FsOptions::DO_READDIRPLUS));
    assert!(opts.contains(FsOptions::MAX_PAGES));
    // The server kills set-ID bits on write and truncation itself (tested
    // over /dev/fuse in devices/tests/fs_host.rs).
    assert!(opts.contains(FsOptions::HANDLE_KILLPRIV_V2));
}

#[test]
fn grants_present_their_owner_and_the_virtual_tree_stays_roots() {
    use std::os::unix::fs::MetadataExt;
    let fx = Fixture::new();
    let fs = session_fs();
    let a = GrantOwner::same(4321);
    let b = GrantOwner {
        uid: 5001,
        gid: 5002,
    };
    let real = std::fs::metadata(fx.host()).unwrap();
    let real = (real.uid(), real.gid());
    let id = fs
        .add_grant_with_owner("s1", "proj", &fx.host(), GrantMode::Rw, Some(a))
        .unwrap();
    fs.add_grant_with_owner(
        "s1",
        "deep/notes.txt",
        &fx.host().join("pre.txt"),
        GrantMode::Ro,
        Some(a),
    )
    .unwrap();
    fs.add_grant_with_owner("s2", "sub", &fx.host().join("sub"), GrantMode::Rwd, Some(b))
        .unwrap();
    fs.add_grant("s3", "plain", &fx.host(), GrantMode::Ro)
        .unwrap();
    let info = fs.grants().into_iter().find(|g| g.id == id).unwrap();
    assert_eq!(info.owner, Some(a));
    let owner = |attr: &stat64| (attr.st_uid, attr.st_gid);
    let ids = |o: GrantOwner| (o.uid, o.gid);

    // Virtual directories: root, by lookup, getattr and readdirplus.
    for path in ["s1", "s1/deep", "s2", "s3"] {
        let e = walk(&fs, path).unwrap();
        assert_eq!(owner(&e.attr), (0, 0), "{path}");
        assert_eq!(owner(&fs.getattr(&ctx(), e.inode, None).unwrap().0), (0, 0));
    }
    assert_eq!(owner(&fs.getattr(&ctx(), ROOT_ID, None).unwrap().0), (0, 0));
    // Grant roots as their virtual parents show them, then inside.
    for (path, o) in [
        ("s1/proj", ids(a)),
        ("s1/deep/notes.txt", ids(a)),
        ("s2/sub", ids(b)),
        ("s1/proj/pre.txt", ids(a)),
        ("s1/proj/sub/inner.txt", ids(a)),
        ("s2/sub/inner.txt", ids(b)),
        ("s3/plain", real),
        ("s3/plain/pre.txt", real),
    ] {
        let e = walk(&fs, path).unwrap();
        assert_eq!(owner(&e.attr), o, "lookup {path}");
        assert_eq!(
            owner(&fs.getattr(&ctx(), e.inode, None).unwrap().0),
            o,
            "getattr {path}"
        );
    }
    let s1 = walk(&fs, "s1").unwrap();
    let mut seen = Vec::new();
    fs.readdirplus(&ctx(), s1.inode, 0, 4096, 0, &mut |d, e| {
        seen.push((String::from_utf8_lossy(d.name).into_owned(), owner(&e.attr)));
        Ok(1)
    })
    .unwrap();
    seen.sort();
    assert_eq!(
        seen,
        [("deep".to_string(), (0, 0)), ("proj".to_string(), ids(a))]
    );
    // Entry replies through the SessionFs (create, mkdir, symlink, link,
    // mknod) and setattr replies carry the owner; chown follows the rule.
    let x = ctx();
    let proj = walk(&fs, "s1/proj").unwrap().inode;
    let (e, h, _, _) = fs
        .create(&x, proj, &c("new"), create_args(libc::O_RDWR, 0o644))
        .unwrap();
    assert_eq!(owner(&e.attr), ids(a));
    fs.release(&x, e.inode, 0, h.unwrap(), false, false, None)
        .unwrap();
    let d = fs.mkdir(&x, proj, &c("d"), 0o755, 0).unwrap();
    assert_eq!(owner(&d.attr), ids(a));
    let l = fs.symlink(&x, &c("new"), proj, &c("l")).unwrap();
    assert_eq!(owner(&l.attr), ids(a));
    let n = fs
        .mknod(&x, d.inode, &c("fifo"), libc::S_IFIFO | 0o600, 0, 0)
        .unwrap();
    assert_eq!(owner(&n.attr), ids(a));
    let hard = fs.link(&x, e.inode, d.inode, &c("hard")).unwrap();
    assert_eq!(owner(&hard.attr), ids(a));
    // SAFETY: stat64 is plain data; all-zero is a valid value.
    let mut attr: stat64 = unsafe { std::mem::zeroed() };
    attr.st_uid = a.uid;
    let (out, _) = fs
        .setattr(&x, e.inode, attr, None, SetattrValid::UID)
        .unwrap();
    assert_eq!(owner(&out), ids(a));
    attr.st_uid = b.uid;
    assert_eq!(
        errno_of(fs.setattr(&x, e.inode, attr, None, SetattrValid::UID)),
        libc::EPERM
    );
    assert_eq!(
        std::fs::metadata(fx.host().join("new")).unwrap().uid(),
        real.0
    );
    // Replacing a grant replaces its owner.
    fs.add_grant("s1", "proj", &fx.host(), GrantMode::Rw)
        .unwrap();
    assert_eq!(owner(&walk(&fs, "s1/proj/pre.txt").unwrap().attr), real);
}
