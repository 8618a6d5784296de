//! `cowork-helper doctor`: what a VM started here would get, and what the
//! desktop client needs before it starts this helper at all.
//!
//! One `key: value` line per fact, for people (and `grep`):
//!
//! - this helper, the backend `auto` picks and why, the guest image found
//!   (and where: [`ImageSearch`] is the one list of places), the client's
//!   bundle and whether its `rootfs.img` validates, the userland a VM gets,
//!   seccomp, the sandbox, the sandbox's resource limits (`sandbox
//!   limits:`, one line per limit that would not hold), whether user
//!   namespaces are restricted, kvm and qemu;
//! - `client helper:` whether the client's helper path resolves to this
//!   helper (see [`crate::install`]);
//! - `client check:` each input of the client's own support check (QEMU on
//!   `PATH`, the OVMF pair, a virtiofsd, `/dev/kvm` and `/dev/vhost-vsock`
//!   usable by the caller), with the command that fixes a failing one;
//! - `result:` whether a VM can start. The exit status is 1 when it cannot
//!   (for `--backend sandbox`: when the sandbox cannot), else 0.
//!
//! Limits: the client's support check is re-created from public reports
//! (`shared/research/install.md`); a server-side flag of the client can
//! still veto it, which nothing here can see. Fix commands name Debian's,
//! Fedora's or Arch's packages, whichever package manager is found.

use std::ffi::CString;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::backend::choice::{resolve_backend, BackendChoice};
use crate::backend::image::{GuestImage, ImageSearch};
use crate::backend::userland::{self, UserlandChoice, UserlandKind, BUNDLE_ROOTFS_FILE};
use crate::backend::BackendKind;
use crate::backend::BootOptions;
use crate::hostfs::{is_executable, HostEnv};
use crate::install::{self, Found};

/// The client's bundle directory under its user data directory
/// (`~/.config/Claude`), which the client passes as `startVM.bundlePath`.
pub const CLIENT_BUNDLE_SUBDIR: &str = "Claude/vm_bundles/claudevm.bundle";
/// OVMF firmware pairs the client's check accepts, in its order.
const OVMF_PAIRS: [(&str, &str); 2] = [
    (
        "/usr/share/OVMF/OVMF_CODE_4M.fd",
        "/usr/share/OVMF/OVMF_VARS_4M.fd",
    ),
    (
        "/usr/share/OVMF/OVMF_CODE.fd",
        "/usr/share/OVMF/OVMF_VARS.fd",
    ),
];
/// Where the client's check looks for virtiofsd.
const VIRTIOFSD_PATHS: [&str; 2] = ["/usr/libexec/virtiofsd", "/usr/bin/virtiofsd"];
/// Debian 12's and Ubuntu 22.04's QEMU copy of virtiofsd, which the
/// client's check does not look at.
const QEMU_VIRTIOFSD: &str = "/usr/lib/qemu/virtiofsd";
/// The KVM device.
const DEV_KVM: &str = "/dev/kvm";
/// The vhost-vsock device the official helper's QEMU needs.
const DEV_VHOST_VSOCK: &str = "/dev/vhost-vsock";
/// Ubuntu's switch restricting unprivileged user namespaces to programs
/// with an AppArmor profile allowing them.
const APPARMOR_USERNS_SYSCTL: &str = "/proc/sys/kernel/apparmor_restrict_unprivileged_userns";
/// Debian's older switch for unprivileged user namespaces.
const USERNS_CLONE_SYSCTL: &str = "/proc/sys/kernel/unprivileged_userns_clone";
/// The most user namespaces a user may own (0: none).
const MAX_USERNS_SYSCTL: &str = "/proc/sys/user/max_user_namespaces";
/// The profiles AppArmor has loaded.
const APPARMOR_PROFILES: &str = "/sys/kernel/security/apparmor/profiles";
/// This process's AppArmor confinement.
const APPARMOR_CURRENT: &str = "/proc/self/attr/current";

/// What `doctor` explains.
#[derive(Clone, Debug)]
pub struct Options {
    pub backend: BackendChoice,
    /// What a VM would get: the daemon's machine settings (userland,
    /// seccomp, the image search, QEMU, test hooks, the host's `PATH` and
    /// directories), as the top-level options and the environment say.
    pub machine: BootOptions,
    /// The client's resources directory.
    pub client_dir: PathBuf,
    /// The client's bundle directory (default: the client's own, when the
    /// user's config directory is known).
    pub bundle: Option<PathBuf>,
}

/// The client's bundle directory for this user (`host`'s
/// `$XDG_CONFIG_HOME` or `~/.config`).
pub fn default_client_bundle(host: &HostEnv) -> Option<PathBuf> {
    Some(host.config_dir()?.join(CLIENT_BUNDLE_SUBDIR))
}

/// Runs the report; returns the exit status.
pub fn run(opts: &Options) -> i32 {
    // A report for people, often piped into `head` or `grep -q`: a reader
    // that goes away ends it quietly, as it does any Unix filter, instead of
    // println! panicking on EPIPE. (Only here: the daemon keeps SIGPIPE
    // ignored and handles EPIPE on its sockets.)
    // SAFETY: restoring the default disposition of one signal.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let exe = std::env::current_exe().ok();
    println!(
        "helper: cowork-helper {} ({})",
        env!("CARGO_PKG_VERSION"),
        exe.as_deref()
            .map_or("executable unknown".into(), |e| e.display().to_string())
    );
    let machine = &opts.machine;
    let (kind, why) = resolve_backend(opts.backend, machine);
    println!("auto picks: {} ({why})", kind.as_str());
    let image = machine.images.locate(None);
    match &image {
        Ok(img) => println!(
            "guest image: {} ({})",
            img.dir.display(),
            machine
                .images
                .place_of(&img.dir)
                .map_or("given", |p| p.describe())
        ),
        Err(e) => println!("guest image: none: {e}"),
    }
    let bundle = bundle_line(
        opts.bundle
            .clone()
            .or_else(|| default_client_bundle(&machine.host)),
    );
    println!("client bundle: {}", bundle.line);
    println!(
        "userland: {}",
        userland_line(
            machine.userland,
            image.as_ref().ok(),
            bundle.usable_dir(),
            &machine.images
        )
    );
    println!("seccomp: {}", seccomp_line(machine.seccomp));
    let sandbox = crate::backend::sandbox::probe();
    match &sandbox {
        Ok(()) => {
            println!("sandbox: available (user, mount, pid, ipc and uts namespaces can be created)")
        }
        Err(e) => println!("sandbox: UNAVAILABLE: {e}"),
    }
    for line in sandbox_limits_lines(machine) {
        println!("sandbox limits: {line}");
    }
    println!("user namespaces: {}", userns_line());
    let kvm = crate::backend::kvm::Probe::run(&machine.images);
    println!("kvm: {}", kvm_line(&kvm));
    let qemu = crate::backend::qemu::Probe::run(machine);
    println!("qemu: {}", qemu_line(&qemu));
    println!(
        "client helper: {}",
        client_helper_line(&opts.client_dir, exe.as_deref())
    );
    let checks = client_checks(&machine.host);
    let failing = checks.iter().filter(|c| !c.ok).count();
    for c in &checks {
        println!("client check: {}", c.line());
    }
    if failing > 0 {
        println!(
            "client check: {failing} of {} inputs fail: the client will call Cowork unsupported here and never start a helper until they are fixed",
            checks.len()
        );
    }
    let (ok, result) = verdict(
        opts.backend,
        kind,
        kvm.usable(),
        qemu.usable(),
        sandbox.is_ok(),
    );
    println!("result: {result}");
    if ok {
        0
    } else {
        1
    }
}

/// The `sandbox limits:` lines: what a sandbox of the default size would
/// get here (a cgroup is created and removed again, or a systemd probe
/// scope runs), then one line per limit that would not hold as asked.
fn sandbox_limits_lines(machine: &BootOptions) -> Vec<String> {
    use crate::backend::sandbox::cgroup;
    use crate::backend::sandbox::limits::Limits;
    let limits = Limits::default();
    let exe = std::env::current_exe().unwrap_or_default();
    let facts = cgroup::HostFacts::read(&machine.host, machine.sandbox_cgroup_disabled);
    let placement = cgroup::place(&limits, &facts, &exe);
    let place = placement.cgroup.as_ref().map_or_else(
        || "no cgroup of its own".to_string(),
        |c| format!("in {}", c.describe()),
    );
    if let Some(cg) = &placement.cgroup {
        if let Err(e) = cg.remove() {
            tracing::warn!(error = %e, "doctor's trial cgroup left behind");
        }
    }
    let e = &placement.enforcement;
    let verdict = if e.complete() {
        "all enforced"
    } else {
        "INCOMPLETE"
    };
    let mut lines = vec![format!(
        "{verdict}: {}; {place} (for the default size; startVM's memoryGB and cpuCount set \
         them)",
        e.summary(&limits)
    )];
    lines.extend(
        e.shortfalls()
            .into_iter()
            .map(|(limit, line)| format!("{limit}: {line}")),
    );
    lines
}

/// Whether the backend chosen can start, and the `result:` line. A
/// missing VM is a failure unless the sandbox was asked for by name.
pub fn verdict(
    choice: BackendChoice,
    picked: BackendKind,
    kvm: bool,
    qemu: bool,
    sandbox: bool,
) -> (bool, String) {
    match choice {
        BackendChoice::Sandbox if sandbox => (
            true,
            "sessions run in the namespace sandbox (--backend sandbox; no VM)".into(),
        ),
        BackendChoice::Sandbox => (false, "the namespace sandbox cannot start here (see sandbox:)".into()),
        BackendChoice::Kvm if kvm => (true, "a VM can start (kvm)".into()),
        BackendChoice::Qemu if qemu => (true, "a VM can start (qemu)".into()),
        BackendChoice::Kvm | BackendChoice::Qemu => (
            false,
            format!(
                "NO VM CAN START with --backend {} (see {}:)",
                picked.as_str(),
                picked.as_str()
            ),
        ),
        BackendChoice::Auto if matches!(picked, BackendKind::Kvm | BackendKind::Qemu) => {
            (true, format!("a VM can start ({})", picked.as_str()))
        }
        BackendChoice::Auto => (
            false,
            "NO VM CAN START here: sessions would run in the namespace sandbox (see kvm: and qemu: for what is missing)".into(),
        ),
    }
}

/// The client bundle's line, and whether its userland is usable.
struct Bundle {
    line: String,
    dir: Option<PathBuf>,
    valid: bool,
}

impl Bundle {
    /// The directory to offer the userland plan: one that validates.
    fn usable_dir(&self) -> Option<&Path> {
        self.dir.as_deref().filter(|_| self.valid)
    }
}

/// `dir`: the bundle directory given, else the client's own for this user.
fn bundle_line(dir: Option<PathBuf>) -> Bundle {
    let Some(dir) = dir else {
        return Bundle {
            line: "none (no HOME to find the client's bundle in)".into(),
            dir: None,
            valid: false,
        };
    };
    let rootfs = dir.join(BUNDLE_ROOTFS_FILE);
    if !rootfs.exists() {
        return Bundle {
            line: format!(
                "none at {} (the client downloads it once its support check passes; VMs get our userland meanwhile)",
                dir.display()
            ),
            dir: None,
            valid: false,
        };
    }
    match userland::inspect_bundle(&rootfs) {
        Ok(root) => Bundle {
            line: format!(
                "{}: rootfs.img validates (GPT partition {}, {} MiB ext4 labelled {:?})",
                dir.display(),
                root.index,
                root.len >> 20,
                userland::BUNDLE_ROOTFS_LABEL
            ),
            dir: Some(dir),
            valid: true,
        },
        Err(e) => Bundle {
            line: format!("{}: rootfs.img does NOT validate: {e}", dir.display()),
            dir: Some(dir),
            valid: false,
        },
    }
}

/// What `doctor` says about the userland the VM backends give sessions.
fn userland_line(
    choice: UserlandChoice,
    image: Option<&GuestImage>,
    bundle: Option<&Path>,
    images: &ImageSearch,
) -> String {
    let Some(image) = image else {
        return "none: no guest image (see guest image:)".into();
    };
    let plan = match userland::plan(choice, image, bundle) {
        Ok(p) => p,
        Err(e) => return format!("UNUSABLE: {e}"),
    };
    let forced = match choice {
        UserlandChoice::Auto => "",
        _ => " (forced with --userland)",
    };
    match plan.disks.first() {
        Some(disk) if disk.kind == UserlandKind::Bundle => format!(
            "bundle: the client's {} (Ubuntu, read-only under a tmpfs overlay; sessions as their own users){forced}",
            disk.path.display()
        ),
        Some(disk) => {
            let size = std::fs::metadata(&disk.path)
                .map(|m| m.len() >> 20)
                .unwrap_or(0);
            let from = disk
                .path
                .parent()
                .and_then(|d| images.place_of(d))
                .map_or(String::new(), |p| format!(", from {}", p.describe()));
            format!(
                "default: our Debian userland {} ({size} MiB{from}; read-only under a tmpfs overlay; sessions as their own users){forced}",
                disk.path.display()
            )
        }
        None => format!(
            "initramfs (busybox only: no bash, python or node){}{forced}; `cowork-helper image build` builds our Debian userland",
            plan.skipped
                .iter()
                .map(|why| format!("; {why}"))
                .collect::<String>()
        ),
    }
}

/// The `doctor` line about seccomp: the mode, and whether this kernel
/// takes our filters (installed for real on a throwaway thread).
pub fn seccomp_line(mode: vmm::seccomp::Mode) -> String {
    use vmm::seccomp::{Filter, ThreadClass};
    if mode == vmm::seccomp::Mode::Off {
        return "off (--seccomp=off or COWORK_SECCOMP=off): the VM backends' device and vCPU threads may make any system call".into();
    }
    // One throwaway thread per class: a filter cannot be removed, and none
    // allows installing another.
    let check = ThreadClass::ALL.into_iter().try_for_each(|class| {
        std::thread::spawn(move || -> Result<(), String> {
            match Filter::new(class, mode).map_err(|e| e.to_string())? {
                Some(f) => f.install().map_err(|e| e.to_string()),
                None => Ok(()),
            }
        })
        .join()
        .unwrap_or_else(|_| Err("checking it failed (a bug)".into()))
    });
    match check {
        Ok(()) => format!(
            "{mode} (kvm backend: vCPU, VMM event loop, device worker, virtio-fs worker filters; qemu backend: vhost-user filter; this kernel accepts them)"
        ),
        Err(e) => format!("{mode}, but UNUSABLE here: {e}"),
    }
}

fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Whether unprivileged user namespaces are restricted, and whether this
/// helper is allowed them anyway.
fn userns_line() -> String {
    // SAFETY: geteuid takes no arguments and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if read_trimmed(MAX_USERNS_SYSCTL).as_deref() == Some("0") {
        return "DISABLED (user.max_user_namespaces=0): the sandbox backend cannot start; fix: sudo sysctl -w user.max_user_namespaces=15000".into();
    }
    if read_trimmed(USERNS_CLONE_SYSCTL).as_deref() == Some("0") && !root {
        return "DISABLED for unprivileged users (kernel.unprivileged_userns_clone=0); fix: sudo sysctl -w kernel.unprivileged_userns_clone=1".into();
    }
    if read_trimmed(APPARMOR_USERNS_SYSCTL).as_deref() != Some("1") {
        return "not restricted".into();
    }
    let confinement = read_trimmed(APPARMOR_CURRENT).unwrap_or_default();
    let profile_loaded = std::fs::read_to_string(APPARMOR_PROFILES)
        .map(|t| t.lines().any(|l| l.starts_with("cowork-helper ")))
        .ok();
    let attached = confinement.starts_with("cowork-helper");
    match (attached, profile_loaded) {
        (true, _) => "restricted by AppArmor (kernel.apparmor_restrict_unprivileged_userns=1), and allowed for this helper by its profile".into(),
        (false, _) if root => "restricted by AppArmor for unprivileged users (kernel.apparmor_restrict_unprivileged_userns=1); root is not affected, but the client runs the helper as you: check as your user".into(),
        (false, Some(true)) => format!(
            "RESTRICTED by AppArmor (kernel.apparmor_restrict_unprivileged_userns=1): the cowork-helper profile is loaded but does not cover this executable ({confinement}); run the installed helper (/usr/bin/cowork-helper)"
        ),
        (false, _) => "RESTRICTED by AppArmor (kernel.apparmor_restrict_unprivileged_userns=1) and no cowork-helper profile is loaded: the sandbox backend cannot start for you; fix: install the cowork-helper package, or run `sudo cowork-helper install` (writes /etc/apparmor.d/cowork-helper)".into(),
    }
}

fn kvm_line(kvm: &crate::backend::kvm::Probe) -> String {
    match (&kvm.kvm, &kvm.image) {
        (Ok(()), Ok(img)) => format!(
            "available (in-process VM, guest image {}, kernel {})",
            img.dir.display(),
            crate::backend::kvm::kernel_of(img).display()
        ),
        _ => {
            use crate::backend::guest::KvmUnavailable;
            let kvm_why = kvm.kvm.as_ref().err().map(|e| match e {
                KvmUnavailable::Unusable(e) => format!("/dev/kvm unusable: {e}"),
                KvmUnavailable::NotForLinux(e) => {
                    format!("/dev/kvm works for small guests (`vm run`) but NOT for Linux: {e}")
                }
            });
            let missing: Vec<String> = [kvm_why, kvm.image.as_ref().err().map(ToString::to_string)]
                .into_iter()
                .flatten()
                .collect();
            format!("UNAVAILABLE: {}", missing.join("; "))
        }
    }
}

fn qemu_line(probe: &crate::backend::qemu::Probe) -> String {
    match (&probe.qemu, &probe.image, &probe.accel) {
        (Ok(q), Ok(img), Ok((accel, why))) => format!(
            "available ({}, guest image {}, accel {}: {why})",
            q.display(),
            img.dir.display(),
            accel.as_str()
        ),
        _ => {
            let missing: Vec<String> = [
                probe.qemu.as_ref().err().map(ToString::to_string),
                probe.image.as_ref().err().map(ToString::to_string),
                probe.accel.as_ref().err().map(ToString::to_string),
            ]
            .into_iter()
            .flatten()
            .collect();
            format!("UNAVAILABLE: {}", missing.join("; "))
        }
    }
}

/// Whether the client's helper path in `client_dir` runs this helper.
pub fn client_helper_line(client_dir: &Path, exe: Option<&Path>) -> String {
    let path = client_dir.join(install::CLIENT_HELPER);
    if !client_dir.is_dir() {
        return format!(
            "no client at {} (not installed, or elsewhere: pass --client-dir)",
            client_dir.display()
        );
    }
    let Some(exe) = exe else {
        return "cannot tell: this helper's executable is unknown".into();
    };
    let root = Path::new("/");
    let kept = client_dir.join(format!(
        "{}{}",
        install::CLIENT_HELPER,
        install::KEPT_SUFFIX
    ));
    let kept_note = if kept.exists() {
        format!("; the official helper is kept at {}", kept.display())
    } else {
        String::new()
    };
    let managed = install::package_diversion(root, &path)
        .map_or(String::new(), |_| " (by our Debian package)".into());
    match install::inspect(root, &path, &path, exe) {
        Found::ThisHelper => format!("{} runs this helper{managed}{kept_note}", path.display()),
        Found::OtherBuild(what) => format!(
            "{} runs {what}, not this one{kept_note}; fix: sudo {} install",
            path.display(),
            exe.display()
        ),
        Found::Official(what) => format!(
            "{} is {what}: the client runs the official helper, not this one; fix: install the cowork-helper package, or sudo {} install",
            path.display(),
            exe.display()
        ),
        Found::Absent => format!(
            "{} is missing: the client has no helper to start; fix: sudo {} install",
            path.display(),
            exe.display()
        ),
        other => format!(
            "{} is {}: the client cannot start this helper; fix: move it away, then sudo {} install",
            path.display(),
            other.describe(),
            exe.display()
        ),
    }
}

/// One input of the client's support check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    /// What was found, or what is wrong.
    pub detail: String,
    /// The command that fixes it (failing checks only).
    pub fix: Option<String>,
}

impl Check {
    fn line(&self) -> String {
        match (&self.fix, self.ok) {
            (_, true) => format!("{}: ok ({})", self.name, self.detail),
            (Some(fix), false) => format!("{}: {}; fix: {fix}", self.name, self.detail),
            (None, false) => format!("{}: {}", self.name, self.detail),
        }
    }
}

/// The package managers fix commands are written for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackageManager {
    Apt,
    Dnf,
    Pacman,
}

impl PackageManager {
    /// The one found on `host`'s `PATH` (apt first).
    pub fn detect(host: &HostEnv) -> Option<PackageManager> {
        [
            ("apt-get", PackageManager::Apt),
            ("dnf", PackageManager::Dnf),
            ("pacman", PackageManager::Pacman),
        ]
        .into_iter()
        .find(|(cmd, _)| host.on_path(cmd).is_some())
        .map(|(_, pm)| pm)
    }

    /// The command installing `what` (`qemu`, `ovmf`, `virtiofsd`).
    pub fn install(pm: Option<PackageManager>, what: &str) -> String {
        let arm = cfg!(target_arch = "aarch64");
        let (cmd, pkg) = match (pm, what) {
            (Some(PackageManager::Apt) | None, "qemu") if arm => {
                ("sudo apt install", "qemu-system-arm")
            }
            (Some(PackageManager::Apt) | None, "qemu") => ("sudo apt install", "qemu-system-x86"),
            (Some(PackageManager::Apt) | None, "ovmf") if arm => {
                ("sudo apt install", "qemu-efi-aarch64")
            }
            (Some(PackageManager::Apt) | None, "ovmf") => ("sudo apt install", "ovmf"),
            (Some(PackageManager::Apt) | None, _) => ("sudo apt install", "virtiofsd"),
            (Some(PackageManager::Dnf), "qemu") => ("sudo dnf install", "qemu-kvm"),
            (Some(PackageManager::Dnf), "ovmf") => ("sudo dnf install", "edk2-ovmf"),
            (Some(PackageManager::Dnf), _) => ("sudo dnf install", "virtiofsd"),
            (Some(PackageManager::Pacman), "qemu") => ("sudo pacman -S", "qemu-base"),
            (Some(PackageManager::Pacman), "ovmf") => ("sudo pacman -S", "edk2-ovmf"),
            (Some(PackageManager::Pacman), _) => ("sudo pacman -S", "virtiofsd"),
        };
        format!("{cmd} {pkg}")
    }
}

/// The client's support check, input by input, on this host (`host`: the
/// `PATH` the client would search, the caller's).
pub fn client_checks(host: &HostEnv) -> Vec<Check> {
    let pm = PackageManager::detect(host);
    let mut checks = vec![qemu_check(pm, host), ovmf_check(pm), virtiofsd_check(pm)];
    checks.push(device_check(
        DEV_KVM,
        "load KVM (sudo modprobe kvm_intel, or kvm_amd) after enabling virtualization in the firmware",
        "sudo usermod -aG kvm $USER, then log out and in",
    ));
    checks.push(device_check(
        DEV_VHOST_VSOCK,
        "sudo modprobe vhost_vsock (the cowork-helper package, or `sudo cowork-helper install`, loads it at every boot)",
        "install the cowork-helper package or run `sudo cowork-helper install` (udev rule), then sudo udevadm trigger --sysname-match=vhost-vsock; at once: sudo setfacl -m u:$USER:rw /dev/vhost-vsock",
    ));
    checks
}

fn qemu_check(pm: Option<PackageManager>, host: &HostEnv) -> Check {
    let found = host.path_dirs().find_map(|d| {
        let entries = std::fs::read_dir(&d).ok()?;
        entries.flatten().map(|e| e.path()).find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("qemu-system-"))
                && is_executable(p)
        })
    });
    match found {
        Some(p) => Check {
            name: "QEMU",
            ok: true,
            detail: p.display().to_string(),
            fix: None,
        },
        None => Check {
            name: "QEMU",
            ok: false,
            detail: "no qemu-system-* on PATH".into(),
            fix: Some(PackageManager::install(pm, "qemu")),
        },
    }
}

fn ovmf_check(pm: Option<PackageManager>) -> Check {
    match OVMF_PAIRS
        .iter()
        .find(|(code, vars)| Path::new(code).is_file() && Path::new(vars).is_file())
    {
        Some((code, vars)) => Check {
            name: "OVMF",
            ok: true,
            detail: format!("{code} and {vars}"),
            fix: None,
        },
        None => Check {
            name: "OVMF",
            ok: false,
            detail: format!("no firmware pair {} / {}", OVMF_PAIRS[0].0, OVMF_PAIRS[1].0),
            fix: Some(PackageManager::install(pm, "ovmf")),
        },
    }
}

fn virtiofsd_check(pm: Option<PackageManager>) -> Check {
    match VIRTIOFSD_PATHS.iter().find(|p| is_executable(Path::new(p))) {
        Some(p) => Check {
            name: "virtiofsd",
            ok: true,
            detail: p.to_string(),
            fix: None,
        },
        None => Check {
            name: "virtiofsd",
            ok: false,
            detail: if Path::new(QEMU_VIRTIOFSD).exists() {
                format!(
                    "not at {} ({QEMU_VIRTIOFSD} exists, but the client does not look there)",
                    VIRTIOFSD_PATHS.join(" or ")
                )
            } else {
                format!("not at {}", VIRTIOFSD_PATHS.join(" or "))
            },
            fix: Some(PackageManager::install(pm, "virtiofsd")),
        },
    }
}

/// Whether the calling user can open `dev` for reading and writing.
fn device_check(dev: &'static str, missing_fix: &str, access_fix: &str) -> Check {
    let meta = match std::fs::metadata(dev) {
        Ok(m) if m.file_type().is_char_device() => m,
        Ok(_) => {
            return Check {
                name: dev,
                ok: false,
                detail: "exists but is not a character device".into(),
                fix: Some(missing_fix.into()),
            }
        }
        Err(_) => {
            return Check {
                name: dev,
                ok: false,
                detail: "MISSING".into(),
                fix: Some(missing_fix.into()),
            }
        }
    };
    let path = CString::new(dev).unwrap_or_default();
    // SAFETY: a NUL-terminated path; access() only reads it.
    let usable = unsafe { libc::access(path.as_ptr(), libc::R_OK | libc::W_OK) } == 0;
    if usable {
        Check {
            name: dev,
            ok: true,
            detail: "read and write for you".into(),
            fix: None,
        }
    } else {
        Check {
            name: dev,
            ok: false,
            detail: format!(
                "NO ACCESS for you (mode {:o}, owner {}, group {})",
                meta.mode() & 0o777,
                meta.uid(),
                meta.gid()
            ),
            fix: Some(access_fix.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verdict_fails_only_without_a_vm_or_the_sandbox_asked_for() {
        use BackendChoice as C;
        use BackendKind as K;
        assert!(verdict(C::Auto, K::Kvm, true, false, true).0);
        assert!(verdict(C::Auto, K::Qemu, false, true, true).0);
        let (ok, why) = verdict(C::Auto, K::Sandbox, false, false, true);
        assert!(!ok && why.contains("NO VM CAN START"), "{why}");
        assert!(verdict(C::Sandbox, K::Sandbox, false, false, true).0);
        assert!(!verdict(C::Sandbox, K::Sandbox, true, true, false).0);
        assert!(!verdict(C::Kvm, K::Kvm, false, true, true).0);
        assert!(verdict(C::Qemu, K::Qemu, false, true, false).0);
    }

    #[test]
    fn fix_commands_name_each_package_managers_packages() {
        let apt = PackageManager::install(Some(PackageManager::Apt), "ovmf");
        assert_eq!(apt, "sudo apt install ovmf");
        assert_eq!(
            PackageManager::install(Some(PackageManager::Dnf), "ovmf"),
            "sudo dnf install edk2-ovmf"
        );
        assert_eq!(
            PackageManager::install(Some(PackageManager::Pacman), "virtiofsd"),
            "sudo pacman -S virtiofsd"
        );
        assert!(PackageManager::install(None, "qemu").starts_with("sudo apt install qemu-system-"));
    }

    #[test]
    fn a_failing_check_names_its_fix() {
        let c = Check {
            name: "OVMF",
            ok: false,
            detail: "no firmware pair".into(),
            fix: Some("sudo apt install ovmf".into()),
        };
        assert_eq!(
            c.line(),
            "OVMF: no firmware pair; fix: sudo apt install ovmf"
        );
        let missing = device_check("/dev/cowork-no-such-device", "load it", "chmod it");
        assert!(!missing.ok);
        assert_eq!(
            missing.line(),
            "/dev/cowork-no-such-device: MISSING; fix: load it"
        );
        // /dev/null is a character device everyone may read and write.
        let null = device_check("/dev/null", "x", "y");
        assert!(null.ok, "{null:?}");
    }

    #[test]
    fn the_client_helper_line_says_what_the_client_runs() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("cowork-helper");
        std::fs::write(&exe, b"\x7fELF helper").unwrap();
        let client = dir.path().join("resources");
        let line = client_helper_line(&client, Some(&exe));
        assert!(line.starts_with("no client at"), "{line}");
        std::fs::create_dir(&client).unwrap();
        let line = client_helper_line(&client, Some(&exe));
        assert!(
            line.contains("is missing") && line.contains("install"),
            "{line}"
        );
        std::os::unix::fs::symlink(&exe, client.join(install::CLIENT_HELPER)).unwrap();
        let line = client_helper_line(&client, Some(&exe));
        assert!(line.contains("runs this helper"), "{line}");
    }
}
