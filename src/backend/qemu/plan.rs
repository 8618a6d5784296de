//! QEMU's command line: which binary ([`find_qemu`]), which accelerator
//! ([`choose_accel`]) and the arguments of one machine ([`QemuPlan::args`]):
//! an i440fx `pc` machine with memfd-shared memory (vhost-user needs it),
//! no default devices, the serial console on stdout, and every device ours
//! over vhost-user sockets (vsock, virtio-fs, the session disk, rng, and
//! the read-only root disks) but QEMU's own virtio-balloon, for free page
//! reporting ([`BALLOON_DEVICE`]).
//!
//! Limits: x86_64 guests only; paths reach QEMU's option syntax escaped
//! ([`qemu_opt_escape`]), never the disk images themselves (our servers
//! open those).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::QemuError;
use crate::backend::guest::kvm_for_linux;
use crate::backend::image::GuestImage;
use crate::backend::userland::RootDisk;
use crate::hostfs::{is_executable, HostEnv};

/// Environment variable of `--qemu`, naming the QEMU binary (a path or a
/// name in `PATH`); read by [`crate::cli`], named in messages.
pub const QEMU_ENV: &str = "COWORK_QEMU";
/// QEMU binary looked up in `PATH` when `--qemu` ([`QEMU_ENV`]) is unset.
pub const DEFAULT_QEMU: &str = "qemu-system-x86_64";
/// Environment variable of `--qemu-accel`, forcing the accelerator (`kvm`
/// or `tcg`); read by [`crate::cli`], named in messages.
pub const ACCEL_ENV: &str = "COWORK_QEMU_ACCEL";

/// Kernel command line (the agent is `/init`; `panic=-1` plus `-no-reboot`
/// turn a guest panic into QEMU exiting), then the boot-time words both
/// backends use ([`crate::backend::guest::BOOT_TIME_CMDLINE`]).
pub const KERNEL_CMDLINE: &str = concat!(
    "console=ttyS0 panic=-1 quiet ",
    crate::backend::guest::boot_time_cmdline!()
);
/// QEMU's own balloon, last so the other devices keep their PCI slots. Free
/// page reporting: the guest reports runs of free memory (2 MiB and up) and
/// QEMU punches them out of the memfd, so QEMU's RSS falls again after the
/// guest frees memory; the balloon is never inflated.
pub const BALLOON_DEVICE: &str = "virtio-balloon-pci,free-page-reporting=on";
/// The VM generation ID device of the snapshot layout ([`Layout::Migratable`]):
/// QEMU makes a new random GUID in every process (`auto`), so each restore
/// of one snapshot shows the guest a new one and notifies it (ACPI), and a
/// kernel with the `vmgenid` driver reseeds its RNG at once. Debian's cloud
/// kernel has no such driver (the agent's `Setup` reseeds it instead); the
/// device costs nothing there.
pub const VMGENID_DEVICE: &str = "vmgenid,guid=auto";
/// Queue size of the virtio-fs device (QEMU's largest; deep queues let
/// the guest keep readahead and writeback requests in flight).
pub const FS_QUEUE_SIZE: u16 = 1024;

/// The QEMU binary: `wanted` (`--qemu`, [`QEMU_ENV`]: a path, or a name
/// looked up in `host`'s `PATH`; empty means unset) or
/// `qemu-system-x86_64` in `PATH`.
pub fn find_qemu(wanted: Option<&Path>, host: &HostEnv) -> Result<PathBuf, QemuError> {
    let wanted = wanted
        .filter(|v| !v.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_QEMU), Path::to_path_buf);
    if wanted.components().count() > 1 {
        return if is_executable(&wanted) {
            Ok(wanted)
        } else {
            Err(QemuError::NoQemu(format!(
                "{} is not an executable file",
                wanted.display()
            )))
        };
    }
    host.path_dirs()
        .map(|d| d.join(&wanted))
        .find(|p| is_executable(p))
        .ok_or_else(|| QemuError::NoQemu(format!("{} is not in PATH", wanted.display())))
}

/// QEMU's accelerator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// `requested` (`--qemu-accel`, [`ACCEL_ENV`]: `kvm` or `tcg`, anything
/// else is an error; empty means unset), else KVM when this host's
/// `/dev/kvm` can run Linux, else TCG; with the reason.
pub fn choose_accel(requested: Option<&str>) -> Result<(Accel, String), QemuError> {
    match requested.filter(|v| !v.is_empty()) {
        Some("kvm") => return Ok((Accel::Kvm, format!("{ACCEL_ENV}=kvm"))),
        Some("tcg") => return Ok((Accel::Tcg, format!("{ACCEL_ENV}=tcg"))),
        Some(v) => return Err(QemuError::BadAccel(v.to_string())),
        None => {}
    }
    Ok(match kvm_for_linux() {
        Ok(()) => (Accel::Kvm, "/dev/kvm can run Linux guests".into()),
        Err(why) => (Accel::Tcg, format!("TCG because {why}")),
    })
}

/// Everything QEMU is started with.
#[derive(Clone, Debug)]
pub struct QemuPlan {
    pub qemu: PathBuf,
    pub image: GuestImage,
    pub accel: Accel,
    pub memory_mib: u64,
    pub cpus: u32,
    pub vsock_socket: PathBuf,
    /// The vhost-user socket of the session share (virtio-fs).
    pub fs_socket: PathBuf,
    /// The vhost-user socket of the session disk (virtio-blk).
    pub blk_socket: PathBuf,
    /// The vhost-user socket of the entropy device (virtio-rng).
    pub rng_socket: PathBuf,
    /// The session disk image, served read-write on [`Self::blk_socket`].
    pub session_disk: PathBuf,
    /// Read-only root disks (the userland), each on its own vhost-user socket.
    pub root_disks: Vec<RootDiskSocket>,
    /// Extra kernel command-line words (`COWORK_LOG=...`).
    pub extra_cmdline: Vec<String>,
    /// Which devices are on the command line and where the RAM is.
    pub layout: Layout,
}

/// How a machine is laid out for QEMU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Every device on the command line, the RAM in QEMU's own memfd: a
    /// boot without snapshots.
    Full,
    /// The boot snapshot's layout (see `super::warm`): only what QEMU can
    /// migrate is on the command line (the disks and the balloon; the
    /// vsock, virtio-fs and entropy devices are hot-plugged,
    /// [`QemuPlan::hotplugs`]), the RAM is the helper's memfd `ram_fd`
    /// (inherited; the helper copies it into and out of the snapshot), QMP
    /// listens on `qmp`, and the agent is asked to say its template point
    /// on the console. With `incoming`, QEMU starts paused waiting for the
    /// snapshot's device state (`-S -incoming defer`).
    Migratable {
        ram_fd: i32,
        qmp: PathBuf,
        incoming: bool,
    },
}

/// A device the [`Layout::Migratable`] machine gets by hot-plug: its
/// vhost-user socket (a `chardev-add` named `chardev`) and the
/// `device_add` properties.
#[derive(Clone, Debug, PartialEq)]
pub struct Hotplug {
    pub chardev: &'static str,
    pub socket: PathBuf,
    pub driver: &'static str,
    pub props: Vec<(&'static str, serde_json::Value)>,
}

/// A read-only root disk and the vhost-user socket it is served on.
#[derive(Clone, Debug)]
pub struct RootDiskSocket {
    pub disk: RootDisk,
    pub socket: PathBuf,
}

impl QemuPlan {
    /// The kernel command line.
    pub fn cmdline(&self) -> String {
        let mut cmdline = KERNEL_CMDLINE.to_string();
        for w in &self.extra_cmdline {
            cmdline.push(' ');
            cmdline.push_str(w);
        }
        if matches!(self.layout, Layout::Migratable { .. }) {
            cmdline.push_str(&format!(
                " {}={}",
                guest_agent::proto::TEMPLATE_SIGNAL_ENV,
                guest_agent::proto::TEMPLATE_SIGNAL_CONSOLE
            ));
        }
        cmdline
    }

    /// The devices a [`Layout::Migratable`] machine gets after its snapshot
    /// (or restore), in `device_add` order: vsock last, so that the agent's
    /// dial (the device it polls for) finds the share already there.
    pub fn hotplugs(&self) -> Vec<Hotplug> {
        use serde_json::json;
        vec![
            Hotplug {
                chardev: "fs0",
                socket: self.fs_socket.clone(),
                driver: "vhost-user-fs-pci",
                props: vec![
                    ("tag", json!(guest_agent::proto::SESSIONS_FS_TAG)),
                    ("queue-size", json!(FS_QUEUE_SIZE)),
                ],
            },
            Hotplug {
                chardev: "rng0",
                socket: self.rng_socket.clone(),
                driver: "vhost-user-rng-pci",
                props: Vec::new(),
            },
            Hotplug {
                chardev: "vsock",
                socket: self.vsock_socket.clone(),
                driver: "vhost-user-vsock-pci",
                props: Vec::new(),
            },
        ]
    }

    /// QEMU's arguments.
    pub fn args(&self) -> Vec<OsString> {
        let mem = self.memory_mib;
        let cmdline = self.cmdline();
        let migratable = match &self.layout {
            Layout::Full => None,
            Layout::Migratable {
                ram_fd,
                qmp,
                incoming,
            } => Some((*ram_fd, qmp, *incoming)),
        };
        let cpu = match self.accel {
            Accel::Kvm => "host",
            Accel::Tcg => "max",
        };
        let mut a: Vec<OsString> = [
            "-name",
            "cowork-guest",
            "-nodefaults",
            "-nographic",
            "-no-user-config",
            "-no-reboot",
            "-accel",
            self.accel.as_str(),
            "-cpu",
            cpu,
            "-M",
            "pc",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        if matches!(migratable, Some((_, _, true))) {
            a.push("-S".into());
        }
        let mut push = |k: &str, v: String| {
            a.push(k.into());
            a.push(v.into());
        };
        push("-smp", self.cpus.to_string());
        push("-m", format!("{mem}M"));
        match migratable {
            None => push(
                "-object",
                format!("memory-backend-memfd,id=mem,size={mem}M,share=on"),
            ),
            // The helper's memfd, reopened through procfs (QEMU takes RAM
            // from a path, not a descriptor).
            Some((fd, _, _)) => push(
                "-object",
                format!(
                    "memory-backend-file,id=mem,size={mem}M,share=on,mem-path=/proc/self/fd/{fd}"
                ),
            ),
        }
        push("-numa", "node,memdev=mem".into());
        push("-serial", "stdio".into());
        if let Some((_, qmp, incoming)) = migratable {
            push(
                "-qmp",
                format!(
                    "unix:{},server=on,wait=off",
                    qemu_opt_escape(&qmp.to_string_lossy())
                ),
            );
            if incoming {
                // Paused after the state is in: hot-plug, then `cont`.
                push("-incoming", "defer".into());
            }
        } else {
            push("-chardev", chardev("vsock", &self.vsock_socket));
            push("-device", "vhost-user-vsock-pci,chardev=vsock".into());
            push("-chardev", chardev("fs0", &self.fs_socket));
            push(
                "-device",
                format!(
                    "vhost-user-fs-pci,chardev=fs0,tag={},queue-size={FS_QUEUE_SIZE}",
                    guest_agent::proto::SESSIONS_FS_TAG
                ),
            );
        }
        push("-chardev", chardev("blk0", &self.blk_socket));
        // One request queue: the device model serves exactly one.
        push(
            "-device",
            "vhost-user-blk-pci,chardev=blk0,num-queues=1".into(),
        );
        if migratable.is_none() {
            push("-chardev", chardev("rng0", &self.rng_socket));
            push("-device", "vhost-user-rng-pci,chardev=rng0".into());
        }
        for (i, root) in self.root_disks.iter().enumerate() {
            push("-chardev", chardev(&format!("root{i}"), &root.socket));
            // Read-only comes from the backend (VIRTIO_BLK_F_RO), the serial
            // from its GET_ID answer.
            push(
                "-device",
                format!("vhost-user-blk-pci,chardev=root{i},num-queues=1"),
            );
        }
        push("-device", BALLOON_DEVICE.into());
        if migratable.is_some() {
            push("-device", VMGENID_DEVICE.into());
        }
        a.push("-kernel".into());
        a.push(self.image.vmlinuz.clone().into());
        a.push("-initrd".into());
        a.push(self.image.initramfs.clone().into());
        a.push("-append".into());
        a.push(cmdline.into());
        a
    }
}

/// The `-chardev` value of a vhost-user socket: a client of `path` named `id`.
fn chardev(id: &str, path: &Path) -> String {
    format!(
        "socket,id={id},path={}",
        qemu_opt_escape(&path.to_string_lossy())
    )
}

/// Escapes a value for QEMU's `key=value,...` option syntax (commas double).
pub fn qemu_opt_escape(v: &str) -> String {
    v.replace(',', ",,")
}
