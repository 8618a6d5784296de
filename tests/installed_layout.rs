//! The helper as a package installs it, booted for real under `--backend
//! qemu`: the binary in `<prefix>/bin`, the guest image WITHOUT a userland
//! in `<prefix>/lib/cowork-helper/guest-image` (what the .deb ships), no
//! `COWORK_GUEST_IMAGE_DIR`; `cowork-helper image build` puts our Debian
//! userland in the data directory; `doctor` names both places, and a VM
//! boots into that userland.
//!
//! Gate: QEMU and the userland in the build cache (`scripts/setup.sh`
//! built it; `image build` then reuses it offline, as a user's second
//! build does); mandatory under `COWORK_QEMU_TESTS=1`.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use support::gate::{qemu_gate, qemu_missing};
use support::nested::guest_cache_dir;
use support::session::{self, assert_booted};
use support::session_checks;
use support::vm_helper::{self, built_helper, VmHelper, QEMU_VERBOSE_ENV};

/// Limit for startVM (a TCG boot takes seconds; the machine is shared).
const START_LIMIT: Duration = Duration::from_secs(180);
/// Limit for one session command under TCG.
const T: Duration = Duration::from_secs(120);
/// The files the package ships of the guest image (no rootfs.img).
const PACKAGED_IMAGE_FILES: [&str; 4] = ["vmlinuz", "vmlinux", "initramfs", "image-info"];

/// Hard link (same file system) or copy `src` to `dst`.
fn place(src: &Path, dst: &Path) {
    if std::fs::hard_link(src, dst).is_err() {
        std::fs::copy(src, dst).unwrap_or_else(|e| panic!("copy {}: {e}", src.display()));
    }
}

/// The checkout's guest image directory, when the test may run.
fn prerequisites() -> Option<PathBuf> {
    let (dir, no_rootfs) = match vm_helper::image_for(&built_helper()) {
        Ok(img) if img.rootfs.is_some() => (Some(img.dir), None),
        Ok(img) => (
            None,
            Some(format!(
                "the guest image {} has no rootfs.img, so the build cache has no userland; build it with scripts/setup.sh",
                img.dir.display()
            )),
        ),
        Err(e) => (None, Some(format!("no guest image ({e})"))),
    };
    let test = "installed_layout";
    if qemu_gate(test, test, [qemu_missing(), no_rootfs]) {
        dir
    } else {
        None
    }
}

fn doctor(exe: &Path, data: &Path) -> String {
    let out = Command::new(exe)
        .arg("--data-dir")
        .arg(data)
        .arg("doctor")
        .output()
        .expect("doctor");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn line<'a>(report: &'a str, key: &str) -> &'a str {
    report
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}: ")))
        .unwrap_or_else(|| panic!("no {key}: line in\n{report}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packaged_layout_with_a_built_userland_boots_into_it() {
    let Some(checkout_image) = prerequisites() else {
        return;
    };
    // SAFETY (edition 2021: safe): set before any helper starts; the
    // packaged helper must find its image without the variable.
    std::env::remove_var(cowork_helper::backend::image::IMAGE_DIR_ENV);

    let tmp = tempfile::Builder::new()
        .prefix("cowork-installed-")
        .tempdir()
        .unwrap();
    let prefix = tmp.path().join("prefix");
    let exe = prefix.join("bin/cowork-helper");
    std::fs::create_dir_all(exe.parent().unwrap()).unwrap();
    std::fs::copy(built_helper(), &exe).unwrap();
    let image = prefix.join("lib/cowork-helper/guest-image");
    std::fs::create_dir_all(&image).unwrap();
    for f in PACKAGED_IMAGE_FILES {
        let src = checkout_image.join(f);
        if src.exists() {
            place(&src, &image.join(f));
        }
    }
    let helper_dir = tmp.path().join("h");
    let data = vm_helper::data_dir(&helper_dir);

    // Before image build: the packaged image, and no userland but the initramfs.
    let report = doctor(&exe, &data);
    assert_eq!(
        line(&report, "guest image"),
        format!("{} (the installed system directory)", image.display()),
        "{report}"
    );
    assert!(
        line(&report, "userland").starts_with("initramfs"),
        "{report}"
    );

    let userland = data.join("userland");
    let out = Command::new(&exe)
        .arg("--data-dir")
        .arg(&data)
        .args(["image", "build", "--output"])
        .arg(&userland)
        .arg("--cache")
        .arg(guest_cache_dir())
        .output()
        .expect("image build");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "image build failed: {stderr}");
    let built = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert_eq!(built, userland.join("rootfs.img"), "{stderr}");
    assert!(stderr.contains("image build: done in"), "{stderr}");

    let report = doctor(&exe, &data);
    let said = line(&report, "userland");
    assert!(
        said.starts_with(&format!("default: our Debian userland {}", built.display()))
            && said.contains("from your data directory"),
        "{report}"
    );

    // A VM of the installed helper boots into that userland.
    let mut helper = VmHelper::start_in(&exe, &helper_dir, "helper", "qemu", START_LIMIT);
    let (pipe, mut sub) =
        session::client(&helper, "installed", "/tmp/installed-profile", START_LIMIT).await;
    session::start_vm(
        &pipe,
        &helper,
        serde_json::json!({"memoryGB": 1}),
        START_LIMIT,
        "startVM",
    )
    .await;
    assert_booted(&pipe, &mut sub, &helper, "qemu", START_LIMIT).await;
    session_checks::default_userland(&pipe, &mut sub, "inst", T).await;
    pipe.call("stopVM", serde_json::json!({}))
        .await
        .expect("stopVM");
    helper.stop_clean(QEMU_VERBOSE_ENV);
}
