//! End-to-end tests of the session userland under `--backend qemu`: the
//! helper binary boots the guest image under QEMU (TCG here), the agent
//! switches root into a read-only userland disk and sessions run as their
//! own users.
//!
//! * `default_userland_sessions`: our Debian image (`rootfs.img`): GNU bash
//!   as the spawn command, python3 with ssl/sqlite3/venv, node, git, curl,
//!   jq, file, a non-root user per session with a closed home, `/usr` not
//!   writable; then the client's real CLI after `installSdk` prints its
//!   version (`scripts/fetch-claude-cli.sh` fetches it with npm and caches
//!   it); then startVM → connected with the rootfs against the
//!   initramfs-only guest in the same run, and the guest's memory use.
//! * `client_bundle_rootfs`: a client-style bundle built here (GPT disk,
//!   ext4 partition `cloudimg-rootfs` with a journal and a marker file,
//!   decoy `vmlinuz`/`initrd` that are not kernels) boots with our kernel,
//!   sessions see the marker and write files, and the bundle's bytes are
//!   unchanged afterwards; a corrupt `rootfs.img` falls back to our image
//!   with a log line saying why.
//!
//! Gate: QEMU and a guest image *with* `rootfs.img` (`scripts/setup.sh`);
//! with `COWORK_QEMU_TESTS=1` a missing prerequisite fails instead of
//! skipping. The CLI check skips loudly only where npm cannot reach its
//! registry and `COWORK_QEMU_TESTS` is not 1.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cowork_helper::client::{Pipe, Subscription};
use serde_json::{json, Value};
use support::claude_cli;
use support::gate::{qemu_gate, qemu_missing};
use support::procfs::{children_named, status_kib};
use support::session::{self, assert_exit_0, bash, ok, rel, run};
use support::session_checks;
use support::vm_helper::{self, built_helper, VmHelper, QEMU_VERBOSE_ENV};

/// Limit for startVM (a TCG boot takes seconds; the machine is shared).
const START_LIMIT: Duration = Duration::from_secs(180);
/// Limit for one session command (python and node start slowly under TCG).
const T: Duration = Duration::from_secs(120);
/// Limit for `claude --version` (a 370 MB binary read over virtio-fs under TCG).
const CLI_LIMIT: Duration = Duration::from_secs(300);
/// One VM at a time: TCG is CPU heavy and the machine is shared.
static ONE_VM: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Our guest image's rootfs.img, when the test may run; panics when it
/// must run but cannot.
fn prerequisites(test: &str) -> Option<PathBuf> {
    let (rootfs, no_rootfs) = match vm_helper::image_for(&built_helper()) {
        Ok(img) => match img.rootfs {
            Some(r) => (Some(r), None),
            None => (
                None,
                Some(format!(
                    "the guest image {} has no rootfs.img; build it with scripts/setup.sh",
                    img.dir.display()
                )),
            ),
        },
        Err(e) => (None, Some(format!("no guest image ({e})"))),
    };
    if qemu_gate(test, test, [qemu_missing(), no_rootfs]) {
        rootfs
    } else {
        None
    }
}

/// A connected client of `helper`'s profile `profile`.
async fn client(helper: &VmHelper, profile: &str) -> (Pipe, Subscription) {
    session::client(
        helper,
        profile,
        &format!("/tmp/{profile}-profile"),
        START_LIMIT,
    )
    .await
}

/// startVM with `params`; returns how long it took.
async fn start(pipe: &Pipe, helper: &VmHelper, params: Value) -> Duration {
    session::start_vm(pipe, helper, params, START_LIMIT, "startVM").await
}

/// Resident memory the guest uses after boot, as it sees it (MemTotal −
/// MemAvailable), in MiB.
async fn guest_used_mib(pipe: &Pipe, sub: &mut Subscription, id: &str) -> u64 {
    // /bin/sh: the initramfs userland has no bash.
    let script =
        "awk '/^MemTotal/{t=$2} /^MemAvailable/{a=$2} END{print int((t-a)/1024)}' /proc/meminfo";
    let out = run(pipe, sub, session::sh(id, "mem", script), T).await;
    assert_exit_0(id, &out);
    out.stdout_str().trim().parse().expect("MiB")
}

/// Resident set of the helper's QEMU child, in MiB.
fn qemu_rss_mib(helper_pid: u32) -> Option<u64> {
    let qemu = *children_named(helper_pid, "qemu-system").first()?;
    Some(status_kib(qemu, "VmRSS")? / 1024)
}

/// `installSdk` of the real CLI, laid out as the client does
/// (`<sdk>/<version>/claude`), then `claude --version` in a session.
async fn real_cli(pipe: &Pipe, sub: &mut Subscription, host_dir: &Path) {
    let Some(claude_cli::ClaudeCli { path: cli, version }) =
        claude_cli::fetch_or_skip("the real-CLI check")
    else {
        return;
    };
    let sdk = host_dir.join("sdk");
    let dir = sdk.join(&version);
    std::fs::create_dir_all(&dir).expect("sdk dir");
    if std::fs::hard_link(&cli, dir.join("claude")).is_err() {
        std::fs::copy(&cli, dir.join("claude")).expect("copy the CLI");
    }
    pipe.call(
        "installSdk",
        json!({"sdkSubpath": rel(&sdk), "version": version}),
    )
    .await
    .expect("installSdk");
    let t0 = Instant::now();
    let out = run(
        pipe,
        sub,
        bash("cli-version", "cli", "command -v claude; claude --version"),
        CLI_LIMIT,
    )
    .await;
    eprintln!("qemu_userland: claude --version took {:?}", t0.elapsed());
    assert_exit_0("claude --version", &out);
    let text = out.stdout_str();
    assert!(
        text.starts_with("/usr/local/bin/claude\n")
            && text.contains(&format!("{version} (Claude Code)")),
        "{text:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_userland_sessions() {
    if prerequisites("default_userland_sessions").is_none() {
        return;
    }
    let _one = ONE_VM.lock().await;
    let host = tempfile::Builder::new()
        .prefix("cowork-userland-")
        .tempdir()
        .expect("tempdir");
    let mut helper = VmHelper::start_qemu("cowork-qemu-userland-", &[]);
    let (pipe, mut sub) = client(&helper, "userland").await;
    let boot_rootfs = start(&pipe, &helper, json!({"memoryGB": 2, "cpuCount": 2})).await;
    let log = helper.log_text();
    assert!(
        log.contains("userland default"),
        "not the default userland: {log}"
    );
    let used_rootfs = guest_used_mib(&pipe, &mut sub, "mem-1").await;
    let rss_rootfs = qemu_rss_mib(helper.pid());

    session_checks::default_userland(&pipe, &mut sub, "ud", T).await;
    real_cli(&pipe, &mut sub, host.path()).await;

    // The overlay is gone after stopVM, the session disk is not.
    ok(
        &pipe,
        &mut sub,
        "w-etc",
        "ud-a",
        "echo keep > ~/kept.txt",
        T,
    )
    .await;
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    drop(sub);
    drop(pipe);
    helper.stop_clean(QEMU_VERBOSE_ENV);

    // Same helper binary, initramfs-only userland, same machine: the boot
    // figure to compare with.
    let mut initramfs_helper =
        VmHelper::start_qemu("cowork-qemu-initramfs-", &["--userland", "initramfs"]);
    let (pipe, mut sub) = client(&initramfs_helper, "initramfs").await;
    let boot_initramfs = start(
        &pipe,
        &initramfs_helper,
        json!({"memoryGB": 2, "cpuCount": 2}),
    )
    .await;
    assert!(
        initramfs_helper.log_text().contains("userland initramfs"),
        "{}",
        initramfs_helper.log_text()
    );
    let used_initramfs = guest_used_mib(&pipe, &mut sub, "mem-2").await;
    let rss_initramfs = qemu_rss_mib(initramfs_helper.pid());
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    drop(sub);
    drop(pipe);
    initramfs_helper.stop();
    eprintln!(
        "qemu_userland: startVM -> agent connected: rootfs {boot_rootfs:?}, initramfs-only {boot_initramfs:?}; \
         guest memory in use after boot: rootfs {used_rootfs} MiB, initramfs-only {used_initramfs} MiB; \
         QEMU RSS after boot: rootfs {rss_rootfs:?} MiB, initramfs-only {rss_initramfs:?} MiB"
    );
}

/// `tool args…`, asserting success.
fn sh(tool: &str, args: &[&str]) {
    let out = Command::new(tool)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {tool}: {e}"));
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// SHA-256 of a file, via sha256sum.
fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// A bundle directory as the client lays it out: `rootfs.img` (GPT: a small
/// BIOS-boot-like partition, then the ext4 root labelled `cloudimg-rootfs`,
/// with a journal, holding our userland plus a marker file) and decoy
/// `vmlinuz`/`initrd` that are not kernels.
fn client_bundle(dir: &Path, rootfs: &Path) {
    let part = dir.join("p1.ext4");
    sh(
        "cp",
        &[
            "--sparse=always",
            rootfs.to_str().unwrap(),
            part.to_str().unwrap(),
        ],
    );
    sh(
        "tune2fs",
        &[
            "-L",
            "cloudimg-rootfs",
            "-O",
            "has_journal",
            part.to_str().unwrap(),
        ],
    );
    let marker = dir.join("marker");
    std::fs::write(&marker, "bundle-marker-1\n").unwrap();
    sh(
        "debugfs",
        &[
            "-w",
            "-R",
            &format!("write {} /cowork-bundle-marker", marker.display()),
            part.to_str().unwrap(),
        ],
    );
    let part_len = std::fs::metadata(&part).unwrap().len();
    let sectors = part_len.div_ceil(512);
    // 1 MiB alignment, 4 MiB for the first partition, the root at 5 MiB,
    // 1 MiB at the end for the backup GPT.
    let root_start = 5 * 2048;
    let img = dir.join("rootfs.img");
    let total = (root_start + sectors) * 512 + (1 << 20);
    let f = std::fs::File::create(&img).unwrap();
    f.set_len(total).unwrap();
    drop(f);
    let script = format!(
        "label: gpt\nstart=2048, size=8192, type=21686148-6449-6E6F-744E-656564454649, name=bios\n\
         start={root_start}, size={sectors}, type=0FC63DAF-8483-4772-8E79-3D69D8477DE4, name=root\n"
    );
    let mut child = Command::new("sfdisk")
        .args(["--quiet", "--no-reread", "--no-tell-kernel"])
        .arg(&img)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("sfdisk (apt-get install fdisk)");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success(), "sfdisk failed");
    sh(
        "dd",
        &[
            &format!("if={}", part.display()),
            &format!("of={}", img.display()),
            "bs=1M",
            &format!("seek={}", root_start * 512 / (1 << 20)),
            "conv=notrunc,sparse",
            "status=none",
        ],
    );
    std::fs::remove_file(&part).unwrap();
    std::fs::write(dir.join("vmlinuz"), b"this is not a kernel\n").unwrap();
    std::fs::write(dir.join("initrd"), b"this is not an initrd\n").unwrap();
}

/// A helper (in a temporary directory `prefix…`) whose profile `profile`
/// started its VM with the client's bundle at `bundle`, and that client.
async fn boot_bundle(prefix: &str, profile: &str, bundle: &Path) -> (VmHelper, Pipe, Subscription) {
    let helper = VmHelper::start_qemu(prefix, &[]);
    let (pipe, sub) = client(&helper, profile).await;
    start(
        &pipe,
        &helper,
        json!({"memoryGB": 1, "cpuCount": 1, "bundlePath": rel(bundle)}),
    )
    .await;
    (helper, pipe, sub)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_bundle_rootfs() {
    let Some(rootfs) = prerequisites("client_bundle_rootfs") else {
        return;
    };
    let _one = ONE_VM.lock().await;
    let bundle = tempfile::Builder::new()
        .prefix("cowork-bundle-")
        .tempdir()
        .expect("tempdir");
    client_bundle(bundle.path(), &rootfs);
    let img = bundle.path().join("rootfs.img");
    let before = sha256(&img);

    let (mut helper, pipe, mut sub) =
        boot_bundle("cowork-qemu-bundle-", "bundle", bundle.path()).await;
    let log = helper.log_text();
    assert!(
        log.contains("userland bundle"),
        "not the bundle's userland: {log}"
    );
    let out = ok(
        &pipe,
        &mut sub,
        "b-1",
        "bun",
        "cat /cowork-bundle-marker; uname -r; id -u; echo data > ~/f.txt; echo more > /tmp/t",
        T,
    )
    .await;
    assert!(out.starts_with("bundle-marker-1\n"), "{out:?}");
    assert!(out.contains("cloud-amd64"), "not our kernel: {out:?}");
    assert!(!out.contains("\n0\n"), "root session: {out:?}");
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    drop(sub);
    drop(pipe);
    helper.stop_clean(QEMU_VERBOSE_ENV);
    assert_eq!(sha256(&img), before, "the bundle's rootfs.img changed");

    // A corrupt rootfs.img: our image, with the reason in the log.
    std::fs::write(&img, vec![0x5Au8; 1 << 20]).unwrap();
    let (mut helper, pipe, mut sub) =
        boot_bundle("cowork-qemu-bundle-bad-", "badbundle", bundle.path()).await;
    let log = helper.log_text();
    assert!(
        log.contains("userland candidate skipped") && log.contains("not a GPT disk"),
        "no reason for the fallback: {log}"
    );
    assert!(log.contains("userland default"), "{log}");
    let out = ok(
        &pipe,
        &mut sub,
        "b-2",
        "bun2",
        "test -e /cowork-bundle-marker || echo ours",
        T,
    )
    .await;
    assert_eq!(out, "ours\n");
    pipe.call("stopVM", json!({})).await.expect("stopVM");
    drop(sub);
    drop(pipe);
    helper.stop_clean(QEMU_VERBOSE_ENV);
}
