//! The helper process of the VM-backend end-to-end tests (`qemu_e2e`,
//! `qemu_disk`, `qemu_userland`, `kvm_backend`): started with a given
//! backend on a socket in a directory of the test's, stdout and stderr in a
//! log file there; stopped with SIGTERM, or killed on drop with its log
//! printed when the test is failing. (The sandbox protocol tests use
//! [`super::daemon`], which keeps the log in memory and runs many helpers at
//! once; both are built on [`super::helper_process`].)

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

pub use super::helper_process::built_helper;
use super::helper_process::{print_log_if_failing, stop_child, wait_listening};

/// The guest image the helper binary `exe` will use, or why there is none.
pub fn image_for(exe: &Path) -> Result<cowork_helper::backend::image::GuestImage, String> {
    use cowork_helper::backend::image::{ImageSearch, IMAGE_DIR_ENV};
    ImageSearch::new(
        std::env::var_os(IMAGE_DIR_ENV).map(Into::into),
        Some(exe.to_path_buf()),
        None,
    )
    .locate(None)
    .map_err(|e| e.to_string())
}

/// Why the guest image `exe` uses cannot run sessions in its default
/// userland (no image, or one without `rootfs.img`); `None` when it can.
pub fn userland_image_missing(exe: &Path) -> Option<String> {
    match image_for(exe) {
        Ok(img) if img.rootfs.is_some() => None,
        Ok(img) => Some(format!(
            "the guest image {} has no rootfs.img; build it with scripts/setup.sh",
            img.dir.display()
        )),
        Err(e) => Some(format!(
            "no guest image ({e}); build it with scripts/setup.sh"
        )),
    }
}

/// The helper's data directory (`--data-dir`) when it was started in `dir`.
pub fn data_dir(dir: &Path) -> PathBuf {
    dir.join("data")
}

/// Environment variable that makes the QEMU suites print a helper's whole
/// log (guest console included) when they stop it.
pub const QEMU_VERBOSE_ENV: &str = "COWORK_QEMU_E2E_VERBOSE";

/// How long a QEMU-backend helper gets to listen on its socket (it starts
/// no VM before startVM; the machine is shared).
const QEMU_LISTEN_LIMIT: Duration = Duration::from_secs(15);

/// How long a stopping helper gets after SIGTERM before it is killed.
const STOP_LIMIT: Duration = Duration::from_secs(30);

/// The qemu backend's snapshot directory every QEMU suite's helper uses
/// (`COWORK_SNAPSHOT_DIR`, unless set): `qemu-snapshots` beside the helper
/// binary (`target/<profile>/`), so the first qemu start of a run boots cold and takes
/// the boot snapshot and the suites after it run on restored machines
/// (issue 24: the VM suites against warm starts too). A suite that must
/// boot cold or own its snapshots passes `--snapshot off` or its own
/// `--snapshot-dir` (flags win over the environment).
pub fn shared_qemu_snapshot_dir(exe: &Path) -> PathBuf {
    exe.parent()
        .unwrap_or_else(|| Path::new("."))
        .join("qemu-snapshots")
}

/// A running helper.
pub struct VmHelper {
    child: Option<Child>,
    /// Its socket.
    pub socket: PathBuf,
    /// The directory holding its socket, log, runtime and data directories.
    pub dir: PathBuf,
    log: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl VmHelper {
    /// Starts `exe --backend <backend>` with its files in `dir` (socket
    /// `<name>.sock`, log `<name>.log`, data `dir/data`, runtime `dir/run`)
    /// and waits up to `listen_limit` for the socket to answer.
    pub fn start_in(
        exe: &Path,
        dir: &Path,
        name: &str,
        backend: &str,
        listen_limit: Duration,
    ) -> VmHelper {
        Self::start_in_with(exe, dir, name, backend, &[], listen_limit)
    }

    /// [`VmHelper::start_in`] with extra helper arguments.
    pub fn start_in_with(
        exe: &Path,
        dir: &Path,
        name: &str,
        backend: &str,
        extra_args: &[&str],
        listen_limit: Duration,
    ) -> VmHelper {
        let socket = dir.join(format!("{name}.sock"));
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let mut cmd = Command::new(exe);
        if backend == "qemu" && std::env::var_os("COWORK_SNAPSHOT_DIR").is_none() {
            cmd.env("COWORK_SNAPSHOT_DIR", shared_qemu_snapshot_dir(exe));
        }
        let child = cmd
            .arg("--socket")
            .arg(&socket)
            .args(["--backend", backend, "--data-dir"])
            .arg(data_dir(dir))
            .args(extra_args)
            .env_remove("COWORK_BACKEND")
            .env_remove("COWORK_USERLAND")
            .env("COWORK_LOG", "info,cowork_helper=debug")
            .env("XDG_RUNTIME_DIR", dir.join("run"))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("start cowork-helper");
        let h = VmHelper {
            child: Some(child),
            socket,
            dir: dir.to_path_buf(),
            log,
            _tmp: None,
        };
        wait_listening(&h.socket, listen_limit, || h.log_text());
        h
    }

    /// [`VmHelper::start_in`] a new temporary directory under `base`,
    /// removed when the helper is dropped.
    pub fn start_temp(
        exe: &Path,
        prefix: &str,
        base: &Path,
        backend: &str,
        listen_limit: Duration,
    ) -> VmHelper {
        Self::start_temp_with(exe, prefix, base, backend, &[], listen_limit)
    }

    /// [`VmHelper::start_temp`] with extra helper arguments.
    pub fn start_temp_with(
        exe: &Path,
        prefix: &str,
        base: &Path,
        backend: &str,
        extra_args: &[&str],
        listen_limit: Duration,
    ) -> VmHelper {
        let tmp = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in(base)
            .expect("tempdir");
        let mut h =
            Self::start_in_with(exe, tmp.path(), "helper", backend, extra_args, listen_limit);
        h._tmp = Some(tmp);
        h
    }

    /// The [`built_helper`] with `--backend qemu` in a new temporary
    /// directory (named `prefix…`) under the system's, with `extra_args`.
    pub fn start_qemu(prefix: &str, extra_args: &[&str]) -> VmHelper {
        Self::start_temp_with(
            &built_helper(),
            prefix,
            &std::env::temp_dir(),
            "qemu",
            extra_args,
            QEMU_LISTEN_LIMIT,
        )
    }

    /// The helper's pid (0 once it was stopped or taken).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Everything the helper logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Takes the child, for a test that ends the helper its own way.
    pub fn take_child(&mut self) -> Option<Child> {
        self.child.take()
    }

    /// SIGTERM, then the exit status (killed after [`STOP_LIMIT`]).
    pub fn stop(&mut self) -> Option<ExitStatus> {
        stop_child(&mut self.child.take()?, STOP_LIMIT)
    }

    /// [`VmHelper::stop`], then asserts a clean exit; prints the whole log
    /// first when `verbose_env` is set.
    pub fn stop_clean(&mut self, verbose_env: &str) {
        let status = self.stop();
        if std::env::var_os(verbose_env).is_some() {
            eprintln!("---- helper log ----\n{}---- end ----", self.log_text());
        }
        let status = status.expect("helper exit status");
        assert!(
            status.success(),
            "helper exit: {status}\n{}",
            self.log_text()
        );
    }
}

impl Drop for VmHelper {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        print_log_if_failing(&self.log_text(), None);
    }
}
