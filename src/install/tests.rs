//! `install`/`uninstall` on a throwaway root: every case the module doc
//! names, with the official helper checked byte for byte and by inode.

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use super::system::{self, SystemFiles};
use super::*;

/// A system root with a client directory, and a helper executable.
struct Rig {
    root: tempfile::TempDir,
    exe: PathBuf,
}

impl Rig {
    fn new() -> Rig {
        let root = tempfile::tempdir().unwrap();
        let bin = root.path().join("usr/local/bin");
        fs::create_dir_all(&bin).unwrap();
        let exe = bin.join("cowork-helper");
        fs::write(&exe, fake_helper()).unwrap();
        fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();
        fs::create_dir_all(root.path().join("usr/lib/claude-desktop/resources")).unwrap();
        Rig { root, exe }
    }

    fn target(&self) -> Target {
        Target::new(self.root.path(), None, self.exe.clone())
    }

    fn path(&self) -> PathBuf {
        self.target().helper_path()
    }

    fn kept(&self) -> PathBuf {
        self.target().kept_path()
    }

    fn etc(&self, rel: &str) -> PathBuf {
        under(self.root.path(), Path::new(rel))
    }

    fn install(&self) -> Result<Report, InstallError> {
        install(&self.target(), &SystemFiles::default())
    }

    fn uninstall(&self) -> Result<Report, InstallError> {
        uninstall(&self.target(), &SystemFiles::default())
    }
}

/// Bytes that look like a build of this helper.
fn fake_helper() -> Vec<u8> {
    let mut b = b"\x7fELF\x02\x01\x01 fake helper ".to_vec();
    b.extend_from_slice(IDENTITY);
    b.extend_from_slice(b" tail");
    b
}

/// Writes an official helper (an executable ELF file) of `version` at
/// `path` and returns its bytes.
fn official(path: &Path, version: &str) -> Vec<u8> {
    let bytes = format!("\x7fELF official cowork-linux-helper {version}").into_bytes();
    fs::write(path, &bytes).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
    bytes
}

fn text(r: &Report) -> String {
    r.lines.join("\n")
}

#[test]
fn install_keeps_the_official_helper_and_uninstall_restores_it_exactly() {
    let rig = Rig::new();
    let bytes = official(&rig.path(), "1.0");
    let before = fs::metadata(rig.path()).unwrap();

    let r = rig.install().unwrap();
    assert!(
        text(&r).contains("kept the official helper"),
        "{}",
        text(&r)
    );
    let link = fs::read_link(rig.path()).unwrap();
    assert_eq!(link, rig.exe);
    let kept = fs::metadata(rig.kept()).unwrap();
    assert_eq!((kept.ino(), kept.mode()), (before.ino(), before.mode()));
    assert_eq!(fs::read(rig.kept()).unwrap(), bytes);
    // The system files, each marked as ours.
    for rel in [system::UDEV_RULE_PATH, system::MODULES_LOAD_PATH] {
        let body = fs::read_to_string(rig.etc(rel)).unwrap();
        assert!(body.starts_with(system::HEADER), "{rel}: {body}");
    }
    assert!(fs::read_to_string(rig.etc(system::UDEV_RULE_PATH))
        .unwrap()
        .contains(r#"KERNEL=="vhost-vsock""#));
    assert!(fs::read_to_string(rig.etc(system::MODULES_LOAD_PATH))
        .unwrap()
        .lines()
        .any(|l| l == "vhost_vsock"));
    assert!(
        !rig.etc(system::APPARMOR_PATH).exists(),
        "no AppArmor 4 here: no profile"
    );

    // Again: nothing changes.
    let r = rig.install().unwrap();
    assert!(
        text(&r).contains("already runs this helper"),
        "{}",
        text(&r)
    );
    assert_eq!(fs::metadata(rig.kept()).unwrap().ino(), before.ino());

    let r = rig.uninstall().unwrap();
    assert!(
        text(&r).contains("restored the official helper"),
        "{}",
        text(&r)
    );
    let after = fs::metadata(rig.path()).unwrap();
    assert!(!fs::symlink_metadata(rig.path())
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(
        (after.ino(), after.mode(), after.mtime(), after.len()),
        (before.ino(), before.mode(), before.mtime(), before.len())
    );
    assert_eq!(fs::read(rig.path()).unwrap(), bytes);
    assert!(!rig.kept().exists());
    for rel in [system::UDEV_RULE_PATH, system::MODULES_LOAD_PATH] {
        assert!(!rig.etc(rel).exists(), "{rel} left behind");
    }
    // Again: nothing to undo.
    let r = rig.uninstall().unwrap();
    assert!(
        text(&r).contains("already the official helper"),
        "{}",
        text(&r)
    );
}

#[test]
fn a_client_upgrade_after_install_is_kept_on_reinstall_and_survives_uninstall() {
    let rig = Rig::new();
    official(&rig.path(), "1.0");
    rig.install().unwrap();
    // The client's package manager puts its new helper at the path.
    fs::remove_file(rig.path()).unwrap();
    let new = official(&rig.path(), "1.1");
    let r = rig.install().unwrap();
    assert!(
        text(&r).contains("replacing the older copy"),
        "{}",
        text(&r)
    );
    assert_eq!(fs::read(rig.kept()).unwrap(), new);
    assert_eq!(fs::read_link(rig.path()).unwrap(), rig.exe);

    // Upgraded again, then uninstalled without a reinstall: the current
    // official helper stays, the stale kept copy goes.
    fs::remove_file(rig.path()).unwrap();
    let newer = official(&rig.path(), "1.2");
    let r = rig.uninstall().unwrap();
    assert!(text(&r).contains("removed the older copy"), "{}", text(&r));
    assert_eq!(fs::read(rig.path()).unwrap(), newer);
    assert!(!rig.kept().exists());
}

#[test]
fn foreign_files_and_dangling_links_are_left_alone() {
    let rig = Rig::new();
    // A wrapper script nobody's package owns.
    fs::write(rig.path(), "#!/usr/bin/env node\nrequire('x')\n").unwrap();
    fs::set_permissions(rig.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let e = rig.install().unwrap_err().to_string();
    assert!(
        e.contains("neither the client's official helper nor cowork-helper")
            && e.contains("#!/usr/bin/env node"),
        "{e}"
    );
    assert_eq!(
        fs::read_to_string(rig.path()).unwrap(),
        "#!/usr/bin/env node\nrequire('x')\n"
    );
    assert!(!rig.kept().exists());
    assert!(
        !rig.etc(system::UDEV_RULE_PATH).exists(),
        "nothing half done"
    );
    let e = rig.uninstall().unwrap_err().to_string();
    assert!(e.contains("is not ours") && e.contains("script"), "{e}");

    // A directory.
    fs::remove_file(rig.path()).unwrap();
    fs::create_dir(rig.path()).unwrap();
    let e = rig.install().unwrap_err().to_string();
    assert!(e.contains("a directory"), "{e}");
    fs::remove_dir(rig.path()).unwrap();

    // A symlink to something else.
    let other = rig.root.path().join("other-helper");
    fs::write(&other, "#!/bin/sh\n").unwrap();
    std::os::unix::fs::symlink(&other, rig.path()).unwrap();
    let e = rig.install().unwrap_err().to_string();
    assert!(e.contains("a symlink to"), "{e}");
    fs::remove_file(rig.path()).unwrap();

    // A dangling symlink.
    std::os::unix::fs::symlink("/nonexistent/helper", rig.path()).unwrap();
    let e = rig.install().unwrap_err().to_string();
    assert!(
        e.contains("dangling symlink to /nonexistent/helper") && e.contains("rm "),
        "{e}"
    );
    assert_eq!(
        fs::read_link(rig.path()).unwrap(),
        PathBuf::from("/nonexistent/helper")
    );
}

#[test]
fn a_missing_client_or_a_taken_kept_name_is_refused() {
    let rig = Rig::new();
    let t = Target::new(
        rig.root.path(),
        Some(Path::new("/opt/Claude/resources")),
        rig.exe.clone(),
    );
    let e = install(&t, &SystemFiles::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("does not exist") && e.contains("--client-dir"),
        "{e}"
    );

    let bytes = official(&rig.path(), "1.0");
    fs::create_dir(rig.kept()).unwrap();
    let e = rig.install().unwrap_err().to_string();
    assert!(e.contains("not a kept official helper"), "{e}");
    assert_eq!(fs::read(rig.path()).unwrap(), bytes, "official untouched");

    // Our own executable inside the client's directory (a copy run from
    // there) cannot install itself.
    let t = Target::new(rig.root.path(), None, rig.path());
    let e = install(&t, &SystemFiles::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("runs from the client's directory"), "{e}");
}

#[test]
fn another_build_of_ours_is_replaced_and_a_missing_helper_is_noted() {
    let rig = Rig::new();
    let r = rig.install().unwrap();
    assert!(text(&r).contains("no official helper"), "{}", text(&r));
    assert_eq!(fs::read_link(rig.path()).unwrap(), rig.exe);
    // A copy of another build at the path.
    fs::remove_file(rig.path()).unwrap();
    fs::write(rig.path(), fake_helper()).unwrap();
    assert!(matches!(
        inspect(rig.root.path(), &rig.path(), &rig.path(), &rig.exe),
        Found::OtherBuild(_)
    ));
    let r = rig.install().unwrap();
    assert!(
        text(&r).contains("was a copy of cowork-helper"),
        "{}",
        text(&r)
    );
    let r = rig.uninstall().unwrap();
    assert!(text(&r).contains("reinstall the client"), "{}", text(&r));
    assert!(fs::symlink_metadata(rig.path()).is_err());
}

#[test]
fn package_managers_vouch_for_the_official_helper_and_are_named() {
    let rig = Rig::new();
    // A script (not an ELF file) that dpkg lists as the client's.
    fs::write(rig.path(), "#!/bin/sh\necho official 1.0\n").unwrap();
    fs::set_permissions(rig.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let info = rig.root.path().join(DPKG_INFO);
    fs::create_dir_all(&info).unwrap();
    fs::write(
        info.join("claude-desktop:amd64.list"),
        "/usr/lib/claude-desktop\n/usr/lib/claude-desktop/resources\n/usr/lib/claude-desktop/resources/cowork-linux-helper\n",
    )
    .unwrap();
    assert_eq!(
        owner_of(
            rig.root.path(),
            Path::new("/usr/lib/claude-desktop/resources")
        ),
        Some(Owner {
            manager: "dpkg",
            package: "claude-desktop".into()
        })
    );
    let r = rig.install().unwrap();
    let t = text(&r);
    assert!(t.contains("owned by dpkg package claude-desktop"), "{t}");
    assert!(
        t.contains("its next upgrade puts the official helper back"),
        "{t}"
    );
    rig.uninstall().unwrap();
    assert!(fs::read_to_string(rig.path())
        .unwrap()
        .contains("official 1.0"));

    // pacman's database names the package without version and release.
    let pacman = tempfile::tempdir().unwrap();
    let entry = pacman
        .path()
        .join(PACMAN_LOCAL)
        .join("claude-desktop-bin-1.2.3-1");
    fs::create_dir_all(&entry).unwrap();
    fs::write(
        entry.join("files"),
        "%FILES%\nusr/lib/claude-desktop/\nusr/lib/claude-desktop/resources/cowork-linux-helper\n",
    )
    .unwrap();
    assert_eq!(
        owner_of(
            pacman.path(),
            Path::new("/usr/lib/claude-desktop/resources/cowork-linux-helper")
        ),
        Some(Owner {
            manager: "pacman",
            package: "claude-desktop-bin".into()
        })
    );
}

#[test]
fn our_debian_package_keeps_the_path_to_itself() {
    let rig = Rig::new();
    official(&rig.kept(), "1.0");
    std::os::unix::fs::symlink(&rig.exe, rig.path()).unwrap();
    let diversions = rig.root.path().join(DPKG_DIVERSIONS);
    fs::create_dir_all(diversions.parent().unwrap()).unwrap();
    fs::write(
        &diversions,
        "/usr/lib/claude-desktop/resources/cowork-linux-helper\n/usr/lib/claude-desktop/resources/cowork-linux-helper.official\ncowork-helper\n",
    )
    .unwrap();
    let r = rig.install().unwrap();
    assert!(
        text(&r).contains("managed by our Debian package"),
        "{}",
        text(&r)
    );
    assert!(!rig.etc(system::UDEV_RULE_PATH).exists());
    let e = rig.uninstall().unwrap_err().to_string();
    assert!(e.contains("apt remove cowork-helper"), "{e}");
    assert!(rig.kept().exists() && fs::read_link(rig.path()).is_ok());
}

#[test]
fn apparmor_4_gets_a_profile_for_this_executable_and_foreign_files_stay() {
    let rig = Rig::new();
    official(&rig.path(), "1.0");
    let abi = rig.etc(system::APPARMOR_ABI4);
    fs::create_dir_all(abi.parent().unwrap()).unwrap();
    fs::write(&abi, "").unwrap();
    // An administrator's own udev rule of the same name is not ours.
    let rule = rig.etc(system::UDEV_RULE_PATH);
    fs::create_dir_all(rule.parent().unwrap()).unwrap();
    fs::write(&rule, "# mine\n").unwrap();
    let r = rig.install().unwrap();
    assert!(
        text(&r).contains("left") && text(&r).contains("alone"),
        "{}",
        text(&r)
    );
    let profile = fs::read_to_string(rig.etc(system::APPARMOR_PATH)).unwrap();
    assert!(profile.starts_with(system::HEADER));
    assert!(
        profile.contains(&format!(
            "profile cowork-helper {} flags=(unconfined)",
            rig.exe.display()
        )),
        "{profile}"
    );
    assert!(profile.contains("  userns,"), "{profile}");
    rig.uninstall().unwrap();
    assert!(!rig.etc(system::APPARMOR_PATH).exists());
    assert_eq!(fs::read_to_string(&rule).unwrap(), "# mine\n");
    // Paths with spaces are quoted.
    assert!(
        system::apparmor_profile(Path::new("/opt/my apps/cowork-helper"))
            .contains("\"/opt/my apps/cowork-helper\" flags")
    );
}

#[test]
fn no_system_files_means_none() {
    let rig = Rig::new();
    official(&rig.path(), "1.0");
    let r = install(&rig.target(), &SystemFiles { write: false }).unwrap();
    assert!(text(&r).contains("--no-system-files"), "{}", text(&r));
    assert!(!rig.etc(system::UDEV_RULE_PATH).exists());
}

#[test]
fn the_identity_is_found_in_a_real_build_only() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("x");
    fs::write(&f, fake_helper()).unwrap();
    assert!(is_cowork_helper(&f).unwrap());
    // Not an ELF file: a script quoting the identity is not the helper.
    let mut script = b"#!/bin/sh\n".to_vec();
    script.extend_from_slice(IDENTITY);
    fs::write(&f, script).unwrap();
    assert!(!is_cowork_helper(&f).unwrap());
    fs::write(&f, b"\x7fELF").unwrap();
    assert!(!is_cowork_helper(&f).unwrap());
    assert!(contains(b"aab", b"ab") && !contains(b"a", b"ab") && contains(b"x", b""));
}
