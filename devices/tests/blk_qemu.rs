//! Real-guest proof of the virtio-blk and virtio-rng models: QEMU (TCG) boots
//! Debian's cloud kernel with a busybox initramfs (`blk_guest/init`) and our
//! models served over vhost-user (`vhost-user-blk-pci`, `vhost-user-rng-pci`),
//! so the guest's own virtio drivers talk to our code.
//!
//! Two disks: the session disk (a sparse raw image made by
//! `create_sparse_image`, serial `cowork-sessions`) and a rootfs disk (an ext4
//! image made on the host, served read-only as the guest image's `rootfs.img`
//! is, serial `cowork-rootfs`). The first boot formats the session disk with
//! e2fsprogs' mke2fs (copied into the initramfs with its libraries), writes a
//! 4 MiB file there and reads a file of the rootfs disk, which the guest sees
//! read-only; the second boot, with new servers over the same files, reads
//! both back. The host then checks both
//! filesystems with `e2fsck -fn`, reads the file out of the session image with
//! `debugfs`, and checks the base image is byte-for-byte unchanged. The guest
//! also reads 16 bytes from `/dev/hwrng` with `virtio_rng` as the current
//! source.
//!
//! Needs qemu-system-x86_64, busybox-static, e2fsprogs, cpio and the cached
//! guest kernel (`scripts/fetch-kernel.sh`); skipped when any is missing
//! unless `COWORK_QEMU_TESTS=1`, which makes them mandatory. About a minute
//! of TCG CPU time.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use devices::blk::{create_sparse_image, BlkConfig, BlkStats, RawImage, SESSION_DISK_SERIAL};
use devices::vhost_user::blk::VhostUserBlkServer;
use devices::vhost_user::rng::VhostUserRngServer;
use vmm::sync::MutexExt;

/// Environment variable that makes missing prerequisites a failure.
const REQUIRE_ENV: &str = "COWORK_QEMU_TESTS";
/// Serial of the read-only rootfs disk.
const ROOTFS_SERIAL: &str = "cowork-rootfs";
/// Size of the session disk.
const SESSION_SIZE: u64 = 256 << 20;
/// Longest a boot may take.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
/// One VM at a time: QEMU TCG is CPU heavy and the machine is shared.
static ONE_VM: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Text the base image carries.
const BASE_TEXT: &str = "hello-from-the-base-image";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn which(cmd: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(cmd))
        .find(|p| p.is_file())
}

struct Prereqs {
    qemu: PathBuf,
    mke2fs: PathBuf,
    vmlinuz: PathBuf,
    modules_dir: PathBuf,
}

fn prereqs() -> Result<Prereqs, String> {
    let qemu = which("qemu-system-x86_64").ok_or("qemu-system-x86_64 not installed")?;
    let mke2fs = which("mke2fs").ok_or("e2fsprogs not installed")?;
    for cmd in ["e2fsck", "debugfs", "cpio", "ldd"] {
        which(cmd).ok_or(format!("{cmd} not installed"))?;
    }
    if !Path::new("/bin/busybox").is_file() {
        return Err("busybox-static not installed".into());
    }
    let out = Command::new(repo_root().join("scripts/fetch-kernel.sh"))
        .arg("--quiet")
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("scripts/fetch-kernel.sh: {e}"))?;
    if !out.status.success() {
        return Err("scripts/fetch-kernel.sh failed (kernel not cached?)".into());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let var = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .map(PathBuf::from)
            .ok_or(format!("fetch-kernel.sh printed no {k}"))
    };
    Ok(Prereqs {
        qemu,
        mke2fs,
        vmlinuz: var("VMLINUZ")?,
        modules_dir: var("MODULES_DIR")?,
    })
}

/// `--add` arguments copying `exe` to `dst` with the shared libraries and
/// loader it needs at their own paths.
fn add_dynamic(exe: &Path, dst: &str) -> Vec<String> {
    let out = Command::new("ldd").arg(exe).output().unwrap();
    assert!(out.status.success(), "ldd {}", exe.display());
    let mut adds = vec![format!("{}:{dst}", exe.display())];
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // "libx.so.1 => /lib/.../libx.so.1 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        let Some(path) = path.filter(|p| p.starts_with('/')) else {
            continue;
        };
        let real = fs::canonicalize(path).unwrap();
        adds.push(format!("{}:{path}", real.display()));
    }
    adds
}

fn build_initramfs(p: &Prereqs, out: &Path) {
    let mut cmd = Command::new(repo_root().join("scripts/mkinitramfs.sh"));
    cmd.arg("--output")
        .arg(out)
        .arg("--init")
        .arg(repo_root().join("devices/tests/blk_guest/init"))
        .args(["--module", "virtio_pci,virtio_blk,virtio_rng,ext4"])
        .arg("--modules-dir")
        .arg(&p.modules_dir);
    for add in add_dynamic(&p.mke2fs, "/sbin/mkfs.ext4") {
        cmd.arg("--add").arg(add);
    }
    if Path::new("/etc/mke2fs.conf").is_file() {
        cmd.args(["--add", "/etc/mke2fs.conf:/etc/mke2fs.conf"]);
    }
    let st = cmd.stderr(Stdio::null()).status().unwrap();
    assert!(st.success(), "mkinitramfs.sh failed");
}

struct Files {
    dir: PathBuf,
    initrd: PathBuf,
    session: PathBuf,
    base: PathBuf,
}

/// Boots the guest once with `plan` against fresh servers; returns the
/// serial console output and the session disk's counters.
fn boot(p: &Prereqs, f: &Files, plan: &str) -> (String, Arc<BlkStats>) {
    let sock = |n: &str| f.dir.join(format!("{n}.sock"));
    let session = VhostUserBlkServer::bind(
        &sock("session"),
        Box::new(RawImage::open(&f.session).unwrap()),
        &BlkConfig::new(SESSION_DISK_SERIAL),
    )
    .unwrap();
    let stats = session.stats();
    let session = session.spawn().unwrap();
    let rootfs = VhostUserBlkServer::bind(
        &sock("rootfs"),
        Box::new(RawImage::open_read_only(&f.base).unwrap()),
        &BlkConfig::new(ROOTFS_SERIAL),
    )
    .unwrap()
    .spawn()
    .unwrap();
    let rng = VhostUserRngServer::bind(&sock("rng"))
        .unwrap()
        .spawn()
        .unwrap();
    let log = f.dir.join(format!("{plan}.log"));
    let mut child = Command::new(&p.qemu)
        .args(["-accel", "tcg", "-M", "pc", "-smp", "1", "-m", "512M"])
        .args([
            "-nodefaults",
            "-nographic",
            "-no-reboot",
            "-serial",
            "stdio",
        ])
        .args(["-object", "memory-backend-memfd,id=mem,size=512M,share=on"])
        .args(["-numa", "node,memdev=mem"])
        .arg("-chardev")
        .arg(format!("socket,id=blk0,path={}", sock("session").display()))
        .args(["-device", "vhost-user-blk-pci,chardev=blk0,num-queues=1"])
        .arg("-chardev")
        .arg(format!("socket,id=blk1,path={}", sock("rootfs").display()))
        .args(["-device", "vhost-user-blk-pci,chardev=blk1,num-queues=1"])
        .arg("-chardev")
        .arg(format!("socket,id=rng0,path={}", sock("rng").display()))
        .args(["-device", "vhost-user-rng-pci,chardev=rng0"])
        .arg("-kernel")
        .arg(&p.vmlinuz)
        .arg("-initrd")
        .arg(&f.initrd)
        .arg("-append")
        .arg(format!("console=ttyS0 quiet panic=-1 blkt.plan={plan}"))
        .stdin(Stdio::null())
        .stdout(fs::File::create(&log).unwrap())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if start.elapsed() > BOOT_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let out = fs::read_to_string(&log).unwrap_or_default();
    eprintln!(
        "boot {plan}: {:.1} s, exit {status:?}",
        start.elapsed().as_secs_f64()
    );
    for l in out
        .lines()
        .filter(|l| l.starts_with("RESULT") || l.contains("insmod"))
    {
        eprintln!("  {l}");
    }
    for t in [session, rootfs] {
        t.join().unwrap().unwrap();
    }
    rng.join().unwrap().unwrap();
    assert!(
        out.contains("PLAN DONE"),
        "boot {plan} did not finish (status {status:?}); console:\n{out}\nqemu stderr:\n{err}"
    );
    eprintln!("  session disk: {stats:?}");
    (out, stats)
}

/// Value of `key=` on the first line starting with `RESULT <kind>`.
fn field<'a>(log: &'a str, kind: &str, key: &str) -> &'a str {
    let line = log
        .lines()
        .find(|l| l.starts_with(&format!("RESULT {kind} ")))
        .unwrap_or_else(|| panic!("no RESULT {kind} line in:\n{log}"));
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

fn host_cmd(cmd: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(which(cmd).unwrap())
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn guest_formats_writes_and_reads_back_disks_over_vhost_user() {
    let _one = ONE_VM.locked();
    let required = std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1");
    let p = match prereqs() {
        Ok(p) => p,
        Err(e) if required => panic!("{REQUIRE_ENV}=1 but {e}"),
        Err(e) => {
            eprintln!("skipping the QEMU blk/rng proof: {e}");
            return;
        }
    };
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().to_path_buf();
    let f = Files {
        initrd: dir.join("initrd"),
        session: dir.join("sessiondata.img"),
        base: dir.join("rootfs.img"),
        dir,
    };
    build_initramfs(&p, &f.initrd);
    assert_eq!(
        create_sparse_image(&f.session, SESSION_SIZE).unwrap(),
        SESSION_SIZE
    );
    let content = f.dir.join("basefs");
    fs::create_dir(&content).unwrap();
    fs::write(content.join("hello.txt"), BASE_TEXT).unwrap();
    let (ok, out) = host_cmd(
        "mke2fs",
        &[
            "-q",
            "-F",
            "-t",
            "ext4",
            "-L",
            ROOTFS_SERIAL,
            "-d",
            content.to_str().unwrap(),
            f.base.to_str().unwrap(),
            "64M",
        ],
    );
    assert!(ok, "host mke2fs: {out}");
    let base_before = fs::read(&f.base).unwrap();

    let (first, st) = boot(&p, &f, "first");
    // The guest's driver used FLUSH (ext4 journal commits, sync) and mke2fs
    // discarded the device first.
    assert!(st.flushes.load(Ordering::Relaxed) > 0);
    assert!(st.discards.load(Ordering::Relaxed) > 0);
    assert!(st.bytes_written.load(Ordering::Relaxed) >= 4 << 20);
    assert_eq!(st.malformed.load(Ordering::Relaxed), 0);
    assert_eq!(field(&first, "disks", "sessions_sectors"), "524288");
    assert_eq!(field(&first, "disks", "rootfs_sectors"), "131072");
    assert_eq!(field(&first, "disks", "rootfs_ro"), "1", "{first}");
    assert!(first.contains("RESULT mkfs ok"), "{first}");
    assert!(first.contains("RESULT umount ok"), "{first}");
    assert!(
        first.contains(&format!("RESULT base says {BASE_TEXT}")),
        "{first}"
    );
    let rng = field(&first, "rng", "current");
    assert!(rng.starts_with("virtio_rng"), "rng_current {rng}");
    let bytes = field(&first, "rng", "bytes");
    assert_eq!(bytes.len(), 32, "16 bytes from /dev/hwrng: {bytes}");
    let wrote = field(&first, "wrote", "md5").to_string();
    assert_eq!(wrote.len(), 32);

    let (second, st) = boot(&p, &f, "second");
    assert!(st.bytes_read.load(Ordering::Relaxed) >= 4 << 20);
    assert_eq!(st.errors.load(Ordering::Relaxed), 0);
    assert_eq!(field(&second, "read", "md5"), wrote, "{second}");
    assert!(
        second.contains(&format!("RESULT base says {BASE_TEXT}")),
        "{second}"
    );
    assert_ne!(field(&second, "rng", "bytes"), bytes, "fresh random bytes");

    // Host-side checks of what the guest left.
    let (ok, out) = host_cmd("e2fsck", &["-fn", f.session.to_str().unwrap()]);
    assert!(ok, "session filesystem not clean:\n{out}");
    let (ok, out) = host_cmd(
        "debugfs",
        &["-R", "stat /data", f.session.to_str().unwrap()],
    );
    assert!(ok && out.contains("Size: 4194304"), "debugfs: {out}");
    assert!(
        fs::read(&f.base).unwrap() == base_before,
        "base image modified"
    );
    let (ok, out) = host_cmd("e2fsck", &["-fn", f.base.to_str().unwrap()]);
    assert!(ok, "base filesystem not clean:\n{out}");
}

/// The guest image (`scripts/mkguestimage.sh`): `COWORK_GUEST_IMAGE_DIR`,
/// else `<repo>/target/guest-image`, if it is built and new enough to carry
/// mkfs.ext4 (the `/lib/cowork-mkfs` bundle, or `/sbin/mkfs.ext4` in older
/// images).
fn guest_image() -> Result<(PathBuf, PathBuf), String> {
    let dir = std::env::var_os("COWORK_GUEST_IMAGE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/guest-image"));
    let (vmlinuz, initramfs) = (dir.join("vmlinuz"), dir.join("initramfs"));
    if !vmlinuz.is_file() || !initramfs.is_file() {
        return Err(format!(
            "no guest image in {} (scripts/mkguestimage.sh)",
            dir.display()
        ));
    }
    let listing = Command::new("sh")
        .arg("-c")
        .arg("gzip -dcf \"$1\" | cpio -t --quiet")
        .arg("sh")
        .arg(&initramfs)
        .output()
        .map_err(|e| format!("cannot list {}: {e}", initramfs.display()))?;
    if !String::from_utf8_lossy(&listing.stdout)
        .lines()
        .any(|l| l == "lib/cowork-mkfs/mkfs.ext4" || l == "sbin/mkfs.ext4")
    {
        return Err(format!(
            "the guest image in {} has no mkfs.ext4 (lib/cowork-mkfs/ or sbin/); rebuild it with scripts/mkguestimage.sh",
            dir.display()
        ));
    }
    Ok((vmlinuz, initramfs))
}

/// Boots the guest image (the agent as /init) with only the session disk
/// until the console shows `want`, then stops QEMU; returns the console.
fn boot_agent(
    qemu: &Path,
    image: &(PathBuf, PathBuf),
    disk: &Path,
    dir: &Path,
    want: &str,
) -> String {
    let sock = dir.join("agent-session.sock");
    let server = VhostUserBlkServer::bind(
        &sock,
        Box::new(RawImage::open(disk).unwrap()),
        &BlkConfig::new(SESSION_DISK_SERIAL),
    )
    .unwrap()
    .spawn()
    .unwrap();
    let log = dir.join("agent.log");
    let mut child = Command::new(qemu)
        .args(["-accel", "tcg", "-M", "pc", "-smp", "1", "-m", "512M"])
        .args([
            "-nodefaults",
            "-nographic",
            "-no-reboot",
            "-serial",
            "stdio",
        ])
        .args(["-object", "memory-backend-memfd,id=mem,size=512M,share=on"])
        .args(["-numa", "node,memdev=mem"])
        .arg("-chardev")
        .arg(format!("socket,id=blk0,path={}", sock.display()))
        .args(["-device", "vhost-user-blk-pci,chardev=blk0,num-queues=1"])
        .arg("-kernel")
        .arg(&image.0)
        .arg("-initrd")
        .arg(&image.1)
        .args(["-append", "console=ttyS0 panic=-1 quiet"])
        .stdin(Stdio::null())
        .stdout(fs::File::create(&log).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let out = loop {
        let out = fs::read_to_string(&log).unwrap_or_default();
        let exited = child.try_wait().unwrap().is_some();
        if out.contains(want) || exited || start.elapsed() > BOOT_TIMEOUT {
            break out;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = child.kill();
    let _ = child.wait();
    server.join().unwrap().unwrap();
    eprintln!("agent boot: {:.1} s", start.elapsed().as_secs_f64());
    for l in out.lines().filter(|l| l.contains("session disk")) {
        eprintln!("  {l}");
    }
    assert!(out.contains(want), "no {want:?} on the console:\n{out}");
    out
}

/// The agent touches nothing per boot before the host's `Setup` (its
/// template point, see `guest_agent::agent::setup`): booted with a blank
/// session disk and no host to answer, it stops at the template point and
/// the disk stays blank. (Formatting a blank session disk after the
/// `Setup` is proved through the helper: `tests/warm_start.rs`,
/// `tests/qemu_disk.rs`, the data-safety suites.)
#[test]
fn agent_leaves_the_session_disk_alone_until_the_hosts_setup() {
    let _one = ONE_VM.locked();
    let required = std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1");
    let found = prereqs().and_then(|p| guest_image().map(|i| (p, i)));
    let (p, image) = match found {
        Ok(x) => x,
        Err(e) if required => panic!("{REQUIRE_ENV}=1 but {e}"),
        Err(e) => {
            eprintln!("skipping the agent session-disk proof: {e}");
            return;
        }
    };
    let t = tempfile::tempdir().unwrap();
    let disk = t.path().join("sessiondata.img");
    create_sparse_image(&disk, SESSION_SIZE).unwrap();
    let out = boot_agent(
        &p.qemu,
        &image,
        &disk,
        t.path(),
        "machine init done up to the template point",
    );
    assert!(!out.contains("formatting the blank session disk"), "{out}");
    // No filesystem was made: the superblock area is still zeroes.
    let mut sb = vec![0u8; 2048];
    fs::File::open(&disk).unwrap().read_exact(&mut sb).unwrap();
    assert!(sb.iter().all(|&b| b == 0), "the session disk was written");
}
