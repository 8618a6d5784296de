//! GrantFs through the `FileSystem` API: mode policy and the server-side
//! escape guarantees (what a host `/dev/fuse` mount cannot show, because
//! the host kernel resolves symlinks itself).

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use fuse_backend_rs::api::filesystem::{FileSystem, SetattrValid, ROOT_ID};
use fuse_backend_rs::api::BackendFileSystem;

use super::*;
use crate::fs::testutil::*;

fn grant(fx: &Fixture, mode: GrantMode) -> GrantFs {
    GrantFs::new(&fx.host(), mode, true, format!("test/{mode}")).unwrap()
}

fn lookup(fs: &GrantFs, parent: u64, name: &str) -> io::Result<Entry> {
    fs.lookup(&ctx(), parent, &c(name))
}

fn ino(fs: &GrantFs, parent: u64, name: &str) -> u64 {
    lookup(fs, parent, name).unwrap().inode
}

fn create(fs: &GrantFs, parent: u64, name: &str) -> io::Result<(Entry, u64)> {
    let (e, h, _, _) = fs.create(&ctx(), parent, &c(name), create_args(libc::O_RDWR, 0o644))?;
    Ok((e, h.expect("a handle")))
}

fn write_all(fs: &GrantFs, inode: u64, handle: u64, data: &[u8]) -> io::Result<usize> {
    let mut r = DataReader::new(data);
    fs.write(
        &ctx(),
        inode,
        handle,
        &mut r,
        data.len() as u32,
        0,
        None,
        false,
        0,
        0,
    )
}

fn read_all(fs: &GrantFs, inode: u64) -> io::Result<Vec<u8>> {
    let (h, _, _) = fs.open(&ctx(), inode, libc::O_RDONLY as u32, 0)?;
    let h = h.expect("a handle");
    let mut w = DataWriter::default();
    let res = fs.read(&ctx(), inode, h, &mut w, 1 << 20, 0, None, 0);
    fs.release(&ctx(), inode, 0, h, false, false, None)?;
    res.map(|_| w.data)
}

fn rename(fs: &GrantFs, a: (u64, &str), b: (u64, &str), flags: u32) -> io::Result<()> {
    fs.rename(&ctx(), a.0, &c(a.1), b.0, &c(b.1), flags)
}

fn set_mode(fs: &GrantFs, inode: u64, mode: u32) -> io::Result<(stat64, Duration)> {
    // SAFETY: stat64 is plain data; all-zero is a valid value.
    let mut attr: stat64 = unsafe { std::mem::zeroed() };
    attr.st_mode = mode;
    fs.setattr(&ctx(), inode, attr, None, SetattrValid::MODE)
}

/// A snapshot of a host tree: (relative path, content or link target).
fn snapshot(root: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            let data = if meta.file_type().is_symlink() {
                std::fs::read_link(&p)
                    .unwrap()
                    .into_os_string()
                    .into_encoded_bytes()
            } else if meta.is_dir() {
                stack.push(p.clone());
                b"<dir>".to_vec()
            } else {
                std::fs::read(&p).unwrap()
            };
            out.push((format!("{rel} {:o}", meta.mode()), data));
        }
    }
    out.sort();
    out
}

#[test]
fn ro_grant_refuses_every_mutation_and_reads_work() {
    let fx = Fixture::new();
    let before = snapshot(&fx.host());
    let fs = grant(&fx, GrantMode::Ro);
    let pre = ino(&fs, ROOT_ID, "pre.txt");
    let sub = ino(&fs, ROOT_ID, "sub");
    let x = ctx();
    let erofs = libc::EROFS;

    assert_eq!(read_all(&fs, pre).unwrap(), PRE);
    assert_eq!(errno_of(create(&fs, ROOT_ID, "new")), erofs);
    assert_eq!(errno_of(fs.mkdir(&x, ROOT_ID, &c("d"), 0o755, 0)), erofs);
    assert_eq!(
        errno_of(fs.mknod(&x, ROOT_ID, &c("fifo"), libc::S_IFIFO | 0o644, 0, 0)),
        erofs
    );
    assert_eq!(
        errno_of(fs.symlink(&x, &c("pre.txt"), ROOT_ID, &c("l"))),
        erofs
    );
    assert_eq!(errno_of(fs.link(&x, pre, ROOT_ID, &c("hard"))), erofs);
    assert_eq!(errno_of(fs.unlink(&x, ROOT_ID, &c("pre.txt"))), erofs);
    assert_eq!(errno_of(fs.rmdir(&x, ROOT_ID, &c("sub"))), erofs);
    assert_eq!(
        errno_of(rename(&fs, (ROOT_ID, "pre.txt"), (sub, "moved"), 0)),
        erofs
    );
    assert_eq!(errno_of(set_mode(&fs, pre, libc::S_IFREG | 0o777)), erofs);
    // SAFETY: stat64 is plain data.
    let mut attr: stat64 = unsafe { std::mem::zeroed() };
    attr.st_size = 0;
    assert_eq!(
        errno_of(fs.setattr(&x, pre, attr, None, SetattrValid::SIZE)),
        erofs
    );
    assert_eq!(errno_of(fs.setxattr(&x, pre, &c("user.k"), b"v", 0)), erofs);
    assert_eq!(errno_of(fs.removexattr(&x, pre, &c("user.k"))), erofs);
    for flags in [
        libc::O_WRONLY,
        libc::O_RDWR,
        libc::O_RDONLY | libc::O_TRUNC,
        libc::O_ACCMODE,
    ] {
        assert_eq!(
            errno_of(fs.open(&x, pre, flags as u32, 0)),
            erofs,
            "open flags {flags:#x}"
        );
    }
    assert_eq!(errno_of(fs.access(&x, pre, libc::W_OK as u32)), erofs);
    fs.access(&x, pre, libc::R_OK as u32).unwrap();
    // Even on a read-only handle, WRITE and FALLOCATE are refused by the
    // policy (a hostile driver can send them on any handle).
    let (h, _, _) = fs.open(&x, pre, libc::O_RDONLY as u32, 0).unwrap();
    let h = h.unwrap();
    assert_eq!(errno_of(write_all(&fs, pre, h, b"evil")), erofs);
    assert_eq!(errno_of(fs.fallocate(&x, pre, h, 0, 0, 4096)), erofs);
    fs.release(&x, pre, 0, h, false, false, None).unwrap();

    assert_eq!(snapshot(&fx.host()), before, "the host tree changed");
    fx.assert_outside_untouched();
}

#[test]
fn rw_grant_writes_but_never_deletes_preexisting_entries() {
    let fx = Fixture::new();
    let fs = grant(&fx, GrantMode::Rw);
    let x = ctx();
    let eperm = libc::EPERM;
    let pre = ino(&fs, ROOT_ID, "pre.txt");
    let sub = ino(&fs, ROOT_ID, "sub");

    // Writing a pre-existing file is allowed.
    let (h, _, _) = fs.open(&x, pre, libc::O_RDWR as u32, 0).unwrap();
    assert_eq!(write_all(&fs, pre, h.unwrap(), b"PRE").unwrap(), 3);
    fs.release(&x, pre, 0, h.unwrap(), false, false, None)
        .unwrap();
    assert_eq!(
        std::fs::read(fx.host().join("pre.txt")).unwrap(),
        b"PRE-existing"
    );

    // Removing, renaming or replacing pre-existing entries is not.
    assert_eq!(errno_of(fs.unlink(&x, ROOT_ID, &c("pre.txt"))), eperm);
    assert_eq!(errno_of(fs.unlink(&x, sub, &c("inner.txt"))), eperm);
    assert_eq!(errno_of(fs.rmdir(&x, ROOT_ID, &c("sub"))), eperm);
    assert_eq!(errno_of(fs.unlink(&x, ROOT_ID, &c("rel_out"))), eperm);
    assert_eq!(
        errno_of(rename(&fs, (ROOT_ID, "pre.txt"), (ROOT_ID, "p2"), 0)),
        eperm
    );
    let (new, nh) = create(&fs, ROOT_ID, "new.txt").unwrap();
    fs.release(&x, new.inode, 0, nh, false, false, None)
        .unwrap();
    assert_eq!(
        errno_of(rename(&fs, (ROOT_ID, "new.txt"), (ROOT_ID, "pre.txt"), 0)),
        eperm,
        "replacing a pre-existing file"
    );
    assert_eq!(
        errno_of(rename(
            &fs,
            (ROOT_ID, "new.txt"),
            (ROOT_ID, "pre.txt"),
            libc::RENAME_EXCHANGE
        )),
        eperm,
        "exchanging with a pre-existing file"
    );
    assert_eq!(
        errno_of(rename(
            &fs,
            (ROOT_ID, "new.txt"),
            (ROOT_ID, "pre.txt"),
            libc::RENAME_NOREPLACE
        )),
        libc::EEXIST
    );
    // A hard link to a pre-existing file can be made but not removed.
    fs.link(&x, pre, ROOT_ID, &c("pre-link")).unwrap();
    assert_eq!(errno_of(fs.unlink(&x, ROOT_ID, &c("pre-link"))), eperm);
    // CREATE of an existing name opens it; that does not make it "created".
    let (e, h, _, _) = fs
        .create(&x, ROOT_ID, &c("pre.txt"), create_args(libc::O_RDWR, 0o644))
        .unwrap();
    assert_eq!(
        e.attr.st_ino,
        std::fs::metadata(fx.host().join("pre.txt")).unwrap().ino()
    );
    fs.release(&x, e.inode, 0, h.unwrap(), false, false, None)
        .unwrap();
    assert_eq!(errno_of(fs.unlink(&x, ROOT_ID, &c("pre.txt"))), eperm);
    // With O_EXCL it fails as usual.
    assert_eq!(
        errno_of(fs.create(
            &x,
            ROOT_ID,
            &c("pre.txt"),
            create_args(libc::O_RDWR | libc::O_EXCL, 0o644)
        )),
        libc::EEXIST
    );

    // What the guest created it may rename and delete.
    rename(&fs, (ROOT_ID, "new.txt"), (ROOT_ID, "renamed.txt"), 0).unwrap();
    let d = fs.mkdir(&x, ROOT_ID, &c("d"), 0o755, 0).unwrap();
    let (f, fh) = create(&fs, d.inode, "f").unwrap();
    fs.release(&x, f.inode, 0, fh, false, false, None).unwrap();
    fs.symlink(&x, &c("f"), d.inode, &c("l")).unwrap();
    let (g, gh) = create(&fs, d.inode, "g").unwrap();
    fs.release(&x, g.inode, 0, gh, false, false, None).unwrap();
    rename(&fs, (d.inode, "g"), (d.inode, "f"), 0).unwrap();
    // renamed.txt, d, l, and g (now named f); the replaced f is forgotten.
    assert_eq!(fs.created_count(), 4);
    fs.unlink(&x, d.inode, &c("f")).unwrap();
    fs.unlink(&x, d.inode, &c("l")).unwrap();
    assert_eq!(errno_of(fs.rmdir(&x, ROOT_ID, &c("sub"))), eperm);
    fs.rmdir(&x, ROOT_ID, &c("d")).unwrap();
    fs.unlink(&x, ROOT_ID, &c("renamed.txt")).unwrap();
    assert_eq!(
        fs.created_count(),
        0,
        "identities of removed entries are forgotten"
    );

    assert_eq!(
        std::fs::read(fx.host().join("sub/inner.txt")).unwrap(),
        INNER
    );
    assert!(fx.host().join("pre-link").exists());
    fx.assert_outside_untouched();
}

#[test]
fn rwd_grant_allows_deletion() {
    let fx = Fixture::new();
    let fs = grant(&fx, GrantMode::Rwd);
    let x = ctx();
    let sub = ino(&fs, ROOT_ID, "sub");
    rename(&fs, (ROOT_ID, "pre.txt"), (sub, "moved.txt"), 0).unwrap();
    fs.unlink(&x, sub, &c("inner.txt")).unwrap();
    fs.unlink(&x, sub, &c("moved.txt")).unwrap();
    fs.rmdir(&x, ROOT_ID, &c("sub")).unwrap();
    fs.unlink(&x, ROOT_ID, &c("rel_out")).unwrap();
    assert!(!fx.host().join("sub").exists());
    assert!(!fx.host().join("pre.txt").exists());
    assert_eq!(fs.created_count(), 0, "rwd does not track");
    fx.assert_outside_untouched();
}

#[test]
fn dot_and_dotdot_lookups_are_refused() {
    let fx = Fixture::new();
    let fs = grant(&fx, GrantMode::Rwd);
    let sub = ino(&fs, ROOT_ID, "sub");
    for (parent, name) in [(ROOT_ID, ".."), (ROOT_ID, "."), (sub, ".."), (sub, ".")] {
        assert_eq!(errno_of(lookup(&fs, parent, name)), libc::EINVAL, "{name}");
    }
    // Names with a slash never walk either.
    assert_eq!(errno_of(lookup(&fs, ROOT_ID, "../outside")), libc::EINVAL);
    assert_eq!(errno_of(lookup(&fs, ROOT_ID, "sub/../..")), libc::EINVAL);
}

#[test]
fn preexisting_symlinks_are_returned_not_followed() {
    let fx = Fixture::new();
    let fs = grant(&fx, GrantMode::Rwd);
    let x = ctx();
    let rel = lookup(&fs, ROOT_ID, "rel_out").unwrap();
    assert_eq!(rel.attr.st_mode & libc::S_IFMT, libc::S_IFLNK);
    assert_eq!(
        fs.readlink(&x, rel.inode).unwrap(),
        b"../outside/secret.txt"
    );
    // Opening the symlink inode does not open its target.
    assert!(fs.open(&x, rel.inode, libc::O_RDONLY as u32, 0).is_err());
    assert!(fs.open(&x, rel.inode, libc::O_RDWR as u32, 0).is_err());

    let abs = lookup(&fs, ROOT_ID, "abs_out").unwrap();
    assert_eq!(abs.attr.st_mode & libc::S_IFMT, libc::S_IFLNK);
    assert_eq!(
        fs.readlink(&x, abs.inode).unwrap(),
        fx.outside().as_os_str().as_encoded_bytes()
    );
    // Using the symlink as a directory does not reach the outside directory.
    assert_eq!(
        errno_of(lookup(&fs, abs.inode, "secret.txt")),
        libc::ENOTDIR
    );
    assert!(create(&fs, abs.inode, "planted").is_err());
    assert!(fs.mkdir(&x, abs.inode, &c("planted"), 0o755, 0).is_err());
    assert!(fs.opendir(&x, abs.inode, 0).is_err());
    fx.assert_outside_untouched();
}

#[test]
fn guest_planted_symlinks_never_redirect_host_operations() {
    let fx = Fixture::new();
    let fs = grant(&fx, GrantMode::Rwd);
    let x = ctx();
    let target = fx.outside().join("secret.txt");
    let target_c = c(target.to_str().unwrap());
    let link = fs.symlink(&x, &target_c, ROOT_ID, &c("planted")).unwrap();
    assert_eq!(link.attr.st_mode & libc::S_IFMT, libc::S_IFLNK);
    assert_eq!(fs.readlink(&x, link.inode).unwrap(), target_c.as_bytes());

    // chmod of the link: refused (a symlink has no mode), target untouched.
    assert_eq!(
        errno_of(set_mode(&fs, link.inode, libc::S_IFREG | 0o777)),
        libc::EOPNOTSUPP
    );
    // utimes of the link change the link, not the target.
    let mtime_before = std::fs::metadata(&target).unwrap().mtime();
    // SAFETY: stat64 is plain data.
    let mut attr: stat64 = unsafe { std::mem::zeroed() };
    attr.st_mtime = 1_000_000;
    attr.st_atime = 1_000_000;
    fs.setattr(
        &x,
        link.inode,
        attr,
        None,
        SetattrValid::MTIME | SetattrValid::ATIME,
    )
    .unwrap();
    assert_eq!(std::fs::metadata(&target).unwrap().mtime(), mtime_before);
    assert_eq!(
        std::fs::symlink_metadata(fx.host().join("planted"))
            .unwrap()
            .mtime(),
        1_000_000
    );
    // truncate through the link: refused, target untouched.
    attr.st_size = 0;
    assert!(fs
        .setattr(&x, link.inode, attr, None, SetattrValid::SIZE)
        .is_err());
    // xattrs: not applied to the target (the kernel refuses user.* on links).
    let _ = fs.setxattr(&x, link.inode, &c("user.evil"), b"1", 0);
    // CREATE over the planted name does not truncate or open the target.
    assert!(fs
        .create(
            &x,
            ROOT_ID,
            &c("planted"),
            create_args(libc::O_RDWR | libc::O_TRUNC, 0o644)
        )
        .is_err());
    // A hard link of the symlink is a link to the symlink itself.
    let hard = fs.link(&x, link.inode, ROOT_ID, &c("planted2")).unwrap();
    assert_eq!(hard.attr.st_mode & libc::S_IFMT, libc::S_IFLNK);
    // Opening the symlink inode for writing does not open the target.
    assert!(fs.open(&x, link.inode, libc::O_RDWR as u32, 0).is_err());
    fx.assert_outside_untouched();
}

#[test]
fn a_directory_swapped_for_a_symlink_does_not_redirect() {
    let fx = Fixture::new();
    let fs = grant(&fx, GrantMode::Rwd);
    let x = ctx();
    let sub = ino(&fs, ROOT_ID, "sub");
    // A host process (or a race) swaps `sub` for a symlink to the outside.
    std::fs::rename(fx.host().join("sub"), fx.host().join("sub-real")).unwrap();
    std::os::unix::fs::symlink(fx.outside(), fx.host().join("sub")).unwrap();

    // The inode the guest holds still is the real directory...
    let (f, fh) = create(&fs, sub, "made-through-old-inode").unwrap();
    fs.release(&x, f.inode, 0, fh, false, false, None).unwrap();
    assert!(fx.host().join("sub-real/made-through-old-inode").exists());
    // ...and a fresh lookup returns the symlink, which does not resolve.
    let swapped = lookup(&fs, ROOT_ID, "sub").unwrap();
    assert_eq!(swapped.attr.st_mode & libc::S_IFMT, libc::S_IFLNK);
    assert_eq!(
        errno_of(lookup(&fs, swapped.inode, "secret.txt")),
        libc::ENOTDIR
    );
    fx.assert_outside_untouched();
}

#[test]
fn forged_inode_numbers_reach_nothing() {
    let fx = Fixture::new();
    let fs = grant(&fx, GrantMode::Rwd);
    let x = ctx();
    for forged in [0u64, 2, 3, 1000, 1 << 40, VFS_MAX_INO, u64::MAX] {
        assert!(fs.getattr(&x, forged, None).is_err(), "{forged}");
        assert!(fs.open(&x, forged, libc::O_RDONLY as u32, 0).is_err());
        assert!(lookup(&fs, forged, "secret.txt").is_err());
        assert!(fs.readlink(&x, forged).is_err());
    }
    // Forged handles as well.
    let pre = ino(&fs, ROOT_ID, "pre.txt");
    let mut w = DataWriter::default();
    assert!(fs.read(&x, pre, 4242, &mut w, 10, 0, None, 0).is_err());
    fx.assert_outside_untouched();
}

#[test]
fn no_device_nodes_no_setid_bits_no_privileged_xattrs() {
    let fx = Fixture::new();
    let fs = grant(&fx, GrantMode::Rwd);
    let x = ctx();
    for kind in [libc::S_IFCHR, libc::S_IFBLK, libc::S_IFDIR, libc::S_IFLNK] {
        assert_eq!(
            errno_of(fs.mknod(&x, ROOT_ID, &c("node"), kind | 0o666, 0x0801, 0)),
            libc::EPERM,
            "type {kind:o}"
        );
    }
    assert!(!fx.host().join("node").exists());
    let fifo = fs
        .mknod(&x, ROOT_ID, &c("fifo"), libc::S_IFIFO | 0o4644, 0, 0)
        .unwrap();
    assert_eq!(fifo.attr.st_mode & libc::S_IFMT, libc::S_IFIFO);

    let (f, fh) = fs
        .create(&x, ROOT_ID, &c("suid"), create_args(libc::O_RDWR, 0o6755))
        .map(|(e, h, _, _)| (e, h.unwrap()))
        .unwrap();
    fs.release(&x, f.inode, 0, fh, false, false, None).unwrap();
    let mode = |p: &str| {
        std::fs::metadata(fx.host().join(p))
            .unwrap()
            .permissions()
            .mode()
    };
    assert_eq!(mode("suid") & 0o7000, 0);
    set_mode(&fs, f.inode, libc::S_IFREG | 0o6777).unwrap();
    assert_eq!(mode("suid") & 0o7777, 0o777);
    // The type bits in the request are ignored: chmod cannot turn a file
    // into anything else.
    set_mode(&fs, f.inode, libc::S_IFDIR | 0o4755).unwrap();
    assert_eq!(mode("suid"), libc::S_IFREG | 0o755);
    let d = fs.mkdir(&x, ROOT_ID, &c("dir"), 0o7755, 0).unwrap();
    assert_eq!(mode("dir") & libc::S_ISUID, 0);
    set_mode(&fs, d.inode, libc::S_IFDIR | 0o6755).unwrap();
    assert_eq!(
        mode("dir") & 0o7777,
        0o2755,
        "set-group-ID kept on a directory"
    );

    fs.setxattr(&x, f.inode, &c("user.note"), b"hello", 0)
        .unwrap();
    assert_eq!(
        list_xattrs(&fx.host().join("suid")),
        vec!["user.note".to_string()]
    );
    for name in [
        "security.capability",
        "trusted.overlay.opaque",
        "system.other",
        "user.",
    ] {
        assert_eq!(
            errno_of(fs.setxattr(&x, f.inode, &c(name), b"x", 0)),
            libc::EPERM,
            "{name}"
        );
        assert_eq!(errno_of(fs.removexattr(&x, f.inode, &c(name))), libc::EPERM);
    }
    fs.removexattr(&x, f.inode, &c("user.note")).unwrap();
    assert!(list_xattrs(&fx.host().join("suid")).is_empty());
    assert_eq!(
        errno_of(rename(
            &fs,
            (ROOT_ID, "suid"),
            (ROOT_ID, "w"),
            libc::RENAME_WHITEOUT
        )),
        libc::EINVAL
    );
}

#[test]
fn a_granted_file_is_its_own_root() {
    let fx = Fixture::new();
    let file = fx.host().join("pre.txt");
    let fs = GrantFs::new(&file, GrantMode::Ro, true, "test/file".into()).unwrap();
    let (root, max) = fs.mount().unwrap();
    assert_eq!(root.inode, ROOT_ID);
    assert_eq!(max, VFS_MAX_INO);
    assert_eq!(root.attr.st_mode & libc::S_IFMT, libc::S_IFREG);
    assert_eq!(root.attr.st_size as usize, PRE.len());
    assert_eq!(read_all(&fs, ROOT_ID).unwrap(), PRE);
    assert_eq!(errno_of(lookup(&fs, ROOT_ID, "x")), libc::ENOTDIR);
    assert_eq!(
        errno_of(fs.open(&ctx(), ROOT_ID, libc::O_WRONLY as u32, 0)),
        libc::EROFS
    );
}

#[test]
fn closes_cost_no_flush_where_a_flush_would_do_nothing() {
    assert!(
        !close_is_noop_on(Path::new("/proc")),
        "procfs is not listed"
    );
    assert!(close_is_noop_on(Path::new("/dev/shm")), "tmpfs is local");
    let fx = Fixture::new();
    let local = close_is_noop_on(&fx.host());
    let noflush = |opts: OpenOptions| opts.bits() & FOPEN_NOFLUSH != 0;
    // A writable file on another device (something mounted inside the
    // grant) keeps its FLUSH even when the grant root is local.
    let mut fs = grant(&fx, GrantMode::Rwd);
    fs.local_dev = Some(7);
    assert!(noflush(
        fs.open_options(OpenOptions::empty(), true, || Some(7))
    ));
    assert!(!noflush(fs.open_options(
        OpenOptions::empty(),
        true,
        || Some(8)
    )));
    assert!(!noflush(fs.open_options(
        OpenOptions::empty(),
        true,
        || None
    )));
    assert!(noflush(fs.open_options(
        OpenOptions::empty(),
        false,
        || Some(8)
    )));
    fs.local_dev = None;
    assert!(!noflush(fs.open_options(
        OpenOptions::empty(),
        true,
        || Some(7)
    )));
    for mode in [GrantMode::Ro, GrantMode::Rw, GrantMode::Rwd] {
        let fs = grant(&fx, mode);
        let x = ctx();
        let pre = ino(&fs, ROOT_ID, "pre.txt");
        // Read-only opens never need a FLUSH: nothing was written through
        // them and the server holds no locks.
        let (h, opts, _) = fs.open(&x, pre, libc::O_RDONLY as u32, 0).unwrap();
        assert!(noflush(opts), "{mode}: read-only open");
        fs.release(&x, pre, 0, h.unwrap(), false, false, None)
            .unwrap();
        if mode == GrantMode::Ro {
            continue;
        }
        // Writable ones skip it only on a local host filesystem.
        let (h, opts, _) = fs.open(&x, pre, libc::O_RDWR as u32, 0).unwrap();
        assert_eq!(noflush(opts), local, "{mode}: writable open");
        fs.release(&x, pre, 0, h.unwrap(), false, false, None)
            .unwrap();
        let name = format!("new-{mode}");
        let (e, h, opts, _) = fs
            .create(&x, ROOT_ID, &c(&name), create_args(libc::O_RDWR, 0o644))
            .unwrap();
        assert_eq!(noflush(opts), local, "{mode}: create");
        fs.release(&x, e.inode, 0, h.unwrap(), false, false, None)
            .unwrap();
        // FLUSH still works for a kernel that sends it anyway.
        let (h, _, _) = fs.open(&x, pre, libc::O_RDWR as u32, 0).unwrap();
        fs.flush(&x, pre, h.unwrap(), 0).unwrap();
        fs.release(&x, pre, 0, h.unwrap(), false, false, None)
            .unwrap();
    }
}

/// Owner presented by the owner tests: not the test's own uid or gid.
const SHOWN: GrantOwner = GrantOwner {
    uid: 4321,
    gid: 4322,
};

/// A setattr request changing only the owner to `uid` and/or `gid`.
fn chown(
    fs: &GrantFs,
    inode: u64,
    uid: Option<u32>,
    gid: Option<u32>,
) -> io::Result<(stat64, Duration)> {
    // SAFETY: stat64 is plain data; all-zero is a valid value.
    let mut attr: stat64 = unsafe { std::mem::zeroed() };
    let mut valid = SetattrValid::empty();
    if let Some(uid) = uid {
        attr.st_uid = uid;
        valid |= SetattrValid::UID;
    }
    if let Some(gid) = gid {
        attr.st_gid = gid;
        valid |= SetattrValid::GID;
    }
    fs.setattr(&ctx(), inode, attr, None, valid)
}

fn owner_of(attr: &stat64) -> (u32, u32) {
    (attr.st_uid, attr.st_gid)
}

fn host_owner(p: &Path) -> (u32, u32) {
    let m = std::fs::symlink_metadata(p).unwrap();
    (m.uid(), m.gid())
}

#[test]
fn a_presented_owner_is_on_every_reply() {
    let fx = Fixture::new();
    let host = fx.host();
    let real = host_owner(&host.join("pre.txt"));
    assert_ne!(real, (SHOWN.uid, SHOWN.gid), "pick another test owner");
    let shown = (SHOWN.uid, SHOWN.gid);
    for mode in [GrantMode::Rw, GrantMode::Rwd] {
        let fs = grant(&fx, mode).with_owner(Some(SHOWN));
        assert_eq!(fs.owner(), Some(SHOWN));
        let x = ctx();
        let (root, _) = fs.mount().unwrap();
        assert_eq!(owner_of(&root.attr), shown, "{mode}: mount entry");
        let pre = lookup(&fs, ROOT_ID, "pre.txt").unwrap();
        assert_eq!(owner_of(&pre.attr), shown, "{mode}: lookup");
        let (attr, _) = fs.getattr(&x, pre.inode, None).unwrap();
        assert_eq!(owner_of(&attr), shown, "{mode}: getattr");
        // The mode bits stay the host's.
        let host_mode = std::fs::metadata(host.join("pre.txt")).unwrap().mode();
        assert_eq!(attr.st_mode, host_mode, "{mode}: mode bits");
        let (attr, _) = set_mode(&fs, pre.inode, libc::S_IFREG | 0o640).unwrap();
        assert_eq!(owner_of(&attr), shown, "{mode}: setattr");
        assert_eq!(attr.st_mode & 0o7777, 0o640);

        let name = format!("created-{mode}");
        let (e, h) = create(&fs, ROOT_ID, &name).unwrap();
        assert_eq!(owner_of(&e.attr), shown, "{mode}: create");
        fs.release(&x, e.inode, 0, h, false, false, None).unwrap();
        // Creating an existing name without O_EXCL opens it (the rw
        // tracking path) and is presented too.
        let (e, h) = create(&fs, ROOT_ID, &name).unwrap();
        assert_eq!(
            owner_of(&e.attr),
            shown,
            "{mode}: create of an existing name"
        );
        fs.release(&x, e.inode, 0, h, false, false, None).unwrap();
        let dir = format!("dir-{mode}");
        let d = fs.mkdir(&x, ROOT_ID, &c(&dir), 0o755, 0).unwrap();
        assert_eq!(owner_of(&d.attr), shown, "{mode}: mkdir");
        let f = fs
            .mknod(&x, d.inode, &c("fifo"), libc::S_IFIFO | 0o644, 0, 0)
            .unwrap();
        assert_eq!(owner_of(&f.attr), shown, "{mode}: mknod");
        let l = fs.symlink(&x, &c("../pre.txt"), d.inode, &c("l")).unwrap();
        assert_eq!(owner_of(&l.attr), shown, "{mode}: symlink");
        let hard = fs.link(&x, e.inode, d.inode, &c("hard")).unwrap();
        assert_eq!(owner_of(&hard.attr), shown, "{mode}: link");

        // READDIRPLUS entries, of the root and of a new directory.
        for (dir_ino, expected) in [(ROOT_ID, 6), (d.inode, 3)] {
            let (h, _) = fs.opendir(&x, dir_ino, 0).unwrap();
            let h = h.unwrap_or(0);
            let mut seen = Vec::new();
            fs.readdirplus(&x, dir_ino, h, 4096, 0, &mut |de, e| {
                seen.push((String::from_utf8_lossy(de.name).into_owned(), e));
                Ok(1)
            })
            .unwrap();
            fs.releasedir(&x, dir_ino, 0, h).unwrap();
            seen.retain(|(n, _)| n != "." && n != "..");
            assert!(seen.len() >= expected, "{mode}: {seen:?}");
            for (n, e) in &seen {
                assert_eq!(owner_of(&e.attr), shown, "{mode}: readdirplus {n}");
            }
        }

        // On the host, everything still belongs to whoever made it: the
        // helper's user (this test's), and the pre-existing file its owner.
        let me = host_owner(fx.dir.path());
        for p in [&name, &dir, &format!("{dir}/fifo"), &format!("{dir}/l")] {
            assert_eq!(host_owner(&host.join(p)), me, "{mode}: host owner of {p}");
        }
        assert_eq!(host_owner(&host.join("pre.txt")), real);
        // What the guest created it may still delete (tracking uses the
        // host's identity, not the presented attributes).
        fs.unlink(&x, d.inode, &c("hard")).unwrap();
        fs.unlink(&x, ROOT_ID, &c(&name)).unwrap();
    }
    // Without an owner the host's ids are shown.
    let fs = grant(&fx, GrantMode::Rwd);
    assert_eq!(fs.owner(), None);
    assert_eq!(
        owner_of(&lookup(&fs, ROOT_ID, "pre.txt").unwrap().attr),
        real
    );
    assert_eq!(owner_of(&fs.mount().unwrap().0.attr), host_owner(&host));
    fx.assert_outside_untouched();
}

#[test]
fn chown_to_the_presented_owner_is_a_no_op_and_others_are_refused() {
    let fx = Fixture::new();
    let host = fx.host();
    let real = host_owner(&host.join("pre.txt"));
    let shown = (SHOWN.uid, SHOWN.gid);
    let unchanged = u32::MAX;
    for mode in [GrantMode::Rw, GrantMode::Rwd] {
        let fs = grant(&fx, mode).with_owner(Some(SHOWN));
        let pre = ino(&fs, ROOT_ID, "pre.txt");
        let link = ino(&fs, ROOT_ID, "rel_out");
        for target in [pre, link, ROOT_ID] {
            for (uid, gid) in [
                (Some(SHOWN.uid), Some(SHOWN.gid)),
                (Some(SHOWN.uid), None),
                (None, Some(SHOWN.gid)),
                (Some(unchanged), Some(SHOWN.gid)),
                (Some(SHOWN.uid), Some(unchanged)),
            ] {
                let (attr, _) = chown(&fs, target, uid, gid).unwrap();
                assert_eq!(owner_of(&attr), shown, "{mode}: chown {uid:?}:{gid:?}");
            }
            for (uid, gid) in [
                (Some(0), None),
                (None, Some(0)),
                (Some(real.0 + 1), None),
                (Some(SHOWN.uid), Some(SHOWN.gid + 1)),
                (Some(SHOWN.gid), Some(SHOWN.uid)),
            ] {
                assert_eq!(
                    errno_of(chown(&fs, target, uid, gid)),
                    libc::EPERM,
                    "{mode}: chown {uid:?}:{gid:?}"
                );
            }
        }
        // A chown combined with another change applies the other change.
        // SAFETY: stat64 is plain data.
        let mut attr: stat64 = unsafe { std::mem::zeroed() };
        attr.st_uid = SHOWN.uid;
        attr.st_mode = libc::S_IFREG | 0o600;
        let (out, _) = fs
            .setattr(
                &ctx(),
                pre,
                attr,
                None,
                SetattrValid::UID | SetattrValid::MODE,
            )
            .unwrap();
        assert_eq!(out.st_mode & 0o7777, 0o600);
        assert_eq!(owner_of(&out), shown);
        assert_eq!(
            std::fs::metadata(host.join("pre.txt")).unwrap().mode() & 0o7777,
            0o600
        );
        // The host owners never changed.
        assert_eq!(host_owner(&host.join("pre.txt")), real);
        assert_eq!(host_owner(&host.join("rel_out")), real);
    }
    // A read-only grant refuses even the no-op.
    let fs = grant(&fx, GrantMode::Ro).with_owner(Some(SHOWN));
    let pre = ino(&fs, ROOT_ID, "pre.txt");
    assert_eq!(owner_of(&fs.getattr(&ctx(), pre, None).unwrap().0), shown);
    assert_eq!(
        errno_of(chown(&fs, pre, Some(SHOWN.uid), Some(SHOWN.gid))),
        libc::EROFS
    );
    // Without an owner, chown goes to the host as before (the test runs as
    // root in CI; unprivileged, the host refuses with EPERM).
    let fs = grant(&fx, GrantMode::Rwd);
    let sub = ino(&fs, ROOT_ID, "sub");
    let target = real.0 + 7;
    match chown(&fs, sub, Some(target), None) {
        Ok((attr, _)) => {
            assert_eq!(attr.st_uid, target);
            assert_eq!(host_owner(&host.join("sub")).0, target);
        }
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EPERM)),
    }
    fx.assert_outside_untouched();
}

/// The umask of thread `tid` of this process.
fn umask_of(tid: libc::pid_t) -> u32 {
    vmm::threadfs::umask_of(tid).unwrap()
}

/// This thread's id.
fn gettid() -> libc::pid_t {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

#[test]
fn opening_a_grants_root_never_changes_the_helpers_umask() {
    // What `PassthroughFs::import` does to the umask, run the way a grant's
    // root is opened, while this (ordinary, shared-umask) thread watches.
    let caller = gettid();
    let before = umask_of(caller);
    let sentinel = if before == 0o077 { 0o070 } else { 0o077 };
    let (own, callers) = with_private_umask(|| {
        // SAFETY: sets only this thread's umask (which is private here).
        unsafe { libc::umask(sentinel) };
        (umask_of(gettid()), umask_of(caller))
    })
    .unwrap();
    assert_eq!(own, sentinel);
    assert_eq!(
        callers, before,
        "the helper's umask changed while a grant root opened"
    );
    assert_eq!(umask_of(caller), before);

    // On a thread with its own context (a virtio-fs worker) it runs in place
    // and the thread's umask is put back.
    std::thread::spawn(move || {
        vmm::threadfs::unshare_once().unwrap();
        let me = gettid();
        let mine = umask_of(me);
        let inside = with_private_umask(|| (gettid(), umask_of(gettid()))).unwrap();
        assert_eq!(inside, (me, 0), "ran elsewhere, or not with umask 0");
        assert_eq!(umask_of(me), mine);
        assert_eq!(umask_of(caller), before);
    })
    .join()
    .unwrap();

    // A real grant opens and resets (DESTROY) without touching it either.
    let fx = Fixture::new();
    let fs = grant(&fx, GrantMode::Rw);
    fs.destroy();
    assert_eq!(umask_of(caller), before);
}
