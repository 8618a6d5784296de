//! Test support: builds the tiny guests in `tests/guests/` from source with
//! the system assembler and linker (`as`, `ld` from binutils) and captures
//! serial output. Shared by the KVM integration tests and the boot bench
//! (`#[path]`-included there).

#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

/// Directory holding the guest sources.
pub fn guests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/guests")
}

fn run(cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e} (install binutils)"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Assembles and links `tests/guests/<name>.s` into an ELF under `out_dir`
/// (once per process and guest) and returns its path.
pub fn build_guest_in(name: &str, out_dir: &Path) -> PathBuf {
    static BUILT: OnceLock<Mutex<Vec<(String, PathBuf)>>> = OnceLock::new();
    let built = BUILT.get_or_init(|| Mutex::new(Vec::new()));
    let mut built = built.lock().unwrap();
    if let Some((_, p)) = built.iter().find(|(n, _)| n == name) {
        return p.clone();
    }
    std::fs::create_dir_all(out_dir).unwrap();
    let src = guests_dir().join(format!("{name}.s"));
    let tag = format!("{name}-{}", std::process::id());
    let obj = out_dir.join(format!("{tag}.o"));
    let elf = out_dir.join(format!("{tag}.elf"));
    run(Command::new("as")
        .arg("--64")
        .arg("-I")
        .arg(guests_dir())
        .arg("-o")
        .arg(&obj)
        .arg(&src));
    run(Command::new("ld")
        .args([
            "-m",
            "elf_x86_64",
            "-static",
            "-nostdlib",
            "--build-id=none",
        ])
        .args(["-z", "noexecstack", "-z", "max-page-size=4096", "-T"])
        .arg(guests_dir().join("asm_guest.ld"))
        .arg("-o")
        .arg(&elf)
        .arg(&obj));
    built.push((name.to_string(), elf.clone()));
    elf
}

/// [`build_guest_in`] under Cargo's per-target temporary directory.
pub fn build_guest(name: &str) -> PathBuf {
    build_guest_in(name, &Path::new(env!("CARGO_TARGET_TMPDIR")).join("guests"))
}

/// Compiles and links the C guest into an ELF (once per test process).
pub fn build_c_guest() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("guests");
            std::fs::create_dir_all(&dir).unwrap();
            let src = guests_dir().join("virtio_driver.c");
            let ld = guests_dir().join("virtio_driver.ld");
            let elf = dir.join(format!("virtio_driver-{}.elf", std::process::id()));
            let out = Command::new("gcc")
                .args([
                    "-O2",
                    "-std=gnu11",
                    "-Wall",
                    "-Wextra",
                    "-Werror",
                    // Freestanding, kernel-like code generation.
                    "-ffreestanding",
                    "-fno-pic",
                    "-fno-pie",
                    "-no-pie",
                    "-mno-red-zone",
                    // Required by __attribute__((interrupt)); no FPU state
                    // is set up in the guest anyway.
                    "-mgeneral-regs-only",
                    "-fno-stack-protector",
                    "-fno-asynchronous-unwind-tables",
                    "-fcf-protection=none",
                    // Keep loops as loops (no implicit memset calls).
                    "-fno-tree-loop-distribute-patterns",
                    "-nostdlib",
                    "-static",
                    "-Wl,--build-id=none",
                    "-Wl,-z,noexecstack",
                    "-Wl,-z,max-page-size=4096",
                    "-Wl,--no-warn-rwx-segments",
                ])
                .arg(format!("-Wl,-T,{}", ld.display()))
                .arg("-o")
                .arg(&elf)
                .arg(&src)
                .output()
                .unwrap_or_else(|e| panic!("cannot run gcc: {e} (install gcc)"));
            assert!(
                out.status.success(),
                "gcc failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            elf
        })
        .clone()
}

/// A serial sink whose contents tests can read while the VM runs.
#[derive(Clone, Default)]
pub struct Capture(pub Arc<Mutex<Vec<u8>>>);

impl Capture {
    /// Everything written so far, lossily as UTF-8.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl Write for Capture {
    fn write(&mut self, d: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(d);
        Ok(d.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Parses a `0x...` hex token.
pub fn hex(s: &str) -> u64 {
    u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap_or_else(|_| panic!("bad hex {s:?}"))
}

/// The `e820 <addr> <size> <type>` lines of a guest report.
pub fn e820_lines(out: &str) -> Vec<(u64, u64, u32)> {
    out.lines()
        .filter(|l| l.starts_with("e820 0x"))
        .map(|l| {
            let t: Vec<&str> = l.split_whitespace().collect();
            (hex(t[1]), hex(t[2]), hex(t[3]) as u32)
        })
        .collect()
}
