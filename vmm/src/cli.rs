//! `cowork-helper vm run`: boot a kernel, stream its serial console to
//! stdout, print a boot timeline to stderr, and map the exit to a process
//! status. The daemon binary parses the flags (clap) into [`VmRunArgs`].
//!
//! Exit status: 0 when the guest resets or powers off; 1 when the guest
//! fails (triple fault, KVM emulation error, ...) or is stopped; 2 when the
//! VM cannot be built (bad kernel, missing KVM capability, ...); 3 when the
//! payload is a Linux kernel and this host's KVM cannot run Linux (PVM or no
//! VT-x/AMD-V, see [`crate::kvm_check::linux_capable`]).
//!
//! The Linux check only blocks Linux payloads: a bzImage, or an ELF carrying
//! a `Linux` ELF note (every vmlinux does). Small freestanding test guests
//! still run on such hosts with a warning; `allow_unsuitable_kvm` forces a
//! Linux boot anyway (it will most likely die on an emulation failure).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::exit::ExitReason;
use crate::kvm_check;
use crate::machine::{Config, Timeline, Vm, DEFAULT_CMDLINE};
use crate::memory::Backing;
use crate::seccomp;

/// Arguments of `vm run`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmRunArgs {
    /// Kernel image (ELF vmlinux or bzImage).
    pub kernel: PathBuf,
    /// Optional initramfs.
    pub initrd: Option<PathBuf>,
    /// Command line; `None` uses [`DEFAULT_CMDLINE`].
    pub cmdline: Option<String>,
    /// Guest memory in MiB.
    pub mem_mib: u64,
    /// vCPU count.
    pub cpus: u8,
    /// Boot a Linux payload even if [`kvm_check::linux_capable`] says no.
    pub allow_unsuitable_kvm: bool,
    /// How guest memory is backed (the helper's `--guest-thp`).
    pub memory_backing: Backing,
    /// Seccomp filters of the VM's threads (the helper's `--seccomp`).
    pub seccomp: seccomp::Mode,
}

impl VmRunArgs {
    /// Defaults: 256 MiB, 1 vCPU, default command line, huge pages advised,
    /// seccomp on.
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        Self {
            kernel: kernel.into(),
            initrd: None,
            cmdline: None,
            mem_mib: 256,
            cpus: 1,
            allow_unsuitable_kvm: false,
            memory_backing: Backing::Anonymous,
            seccomp: seccomp::Mode::On,
        }
    }
}

/// Exit status: guest reset or powered off.
pub const EXIT_OK: i32 = 0;
/// Exit status: guest error or stopped.
pub const EXIT_GUEST_FAILED: i32 = 1;
/// Exit status: the VM could not be built.
pub const EXIT_BUILD_FAILED: i32 = 2;
/// Exit status: Linux payload on a KVM that cannot run Linux.
pub const EXIT_KVM_UNSUITABLE: i32 = 3;

/// Runs `vm run` and returns the process exit status.
pub fn vm_run(args: VmRunArgs) -> i32 {
    let stderr = std::io::stderr();
    let mut err = stderr.lock();
    if let Err(unsuitable) = kvm_check::linux_capable() {
        match payload_is_linux(&args.kernel) {
            Ok(true) if !args.allow_unsuitable_kvm => {
                let _ = writeln!(err, "vm: error: {unsuitable}");
                return EXIT_KVM_UNSUITABLE;
            }
            Ok(true) => {
                let _ = writeln!(err, "vm: warning: {unsuitable} (continuing as requested)");
            }
            Ok(false) => {
                let _ = writeln!(
                    err,
                    "vm: warning: {unsuitable} (continuing: the payload is not a Linux kernel)"
                );
            }
            Err(e) => {
                let _ = writeln!(
                    err,
                    "vm: error: cannot read kernel {}: {e}",
                    args.kernel.display()
                );
                return EXIT_BUILD_FAILED;
            }
        }
    }
    let mut config = Config::new(&args.kernel);
    config.initrd = args.initrd.clone();
    config.cmdline = args
        .cmdline
        .clone()
        .unwrap_or_else(|| DEFAULT_CMDLINE.to_string());
    config.mem_mib = args.mem_mib;
    config.vcpus = args.cpus;
    config.memory_backing = args.memory_backing;
    config.seccomp = args.seccomp;
    config.serial = Some(Box::new(std::io::stdout()));
    drop(err);

    let mut vm = match Vm::build(config) {
        Ok(vm) => vm,
        Err(e) => {
            eprintln!("vm: error: {e}");
            return EXIT_BUILD_FAILED;
        }
    };
    let result = vm.run();
    let _ = std::io::stdout().flush();
    eprint!("{}", format_timeline(vm.timeline(), result.as_ref().ok()));
    match result {
        Ok(ExitReason::Reset) | Ok(ExitReason::Shutdown) => EXIT_OK,
        Ok(ExitReason::GuestError(msg)) => {
            eprintln!("vm: guest error: {msg}");
            EXIT_GUEST_FAILED
        }
        // Nothing pauses a `vm run`; counted as a host stop.
        Ok(ExitReason::Stopped) | Ok(ExitReason::Paused) => {
            eprintln!("vm: stopped by the host");
            EXIT_GUEST_FAILED
        }
        Err(e) => {
            eprintln!("vm: error: {e}");
            EXIT_GUEST_FAILED
        }
    }
}

fn ms(d: Duration) -> String {
    format!("{:8.3} ms", d.as_secs_f64() * 1e3)
}

/// The boot timeline as printed on stderr (times since `Vm::build` began).
pub fn format_timeline(t: &Timeline, reason: Option<&ExitReason>) -> String {
    let mut s = String::new();
    let entry = match t.entry {
        Some(crate::boot::EntryKind::Pvh) => "PVH entry",
        Some(crate::boot::EntryKind::Linux64) => "64-bit Linux boot protocol",
        None => "?",
    };
    s += &format!(
        "vm: timeline (from VM build start)\nvm:   {} built ({entry})\n",
        ms(t.build)
    );
    if let Some(f) = t.first_run {
        s += &format!("vm:   {} first KVM_RUN\n", ms(f));
    }
    for m in &t.boot_marks {
        s += &format!("vm:   {} boot port write {:#x}\n", ms(m.at), m.value);
    }
    if let Some(e) = t.exit {
        let r = match reason {
            Some(ExitReason::Reset) => "guest reset".to_string(),
            Some(ExitReason::Shutdown) => "guest powered off".to_string(),
            Some(ExitReason::GuestError(_)) => "guest error".to_string(),
            Some(ExitReason::Stopped) => "stopped by host".to_string(),
            Some(ExitReason::Paused) => "paused by host".to_string(),
            None => "VMM error".to_string(),
        };
        s += &format!("vm:   {} exit: {r}\n", ms(e));
    }
    if let Some(d) = t.teardown {
        s += &format!("vm:   {} teardown (threads joined, VM closed)\n", ms(d));
    }
    s
}

/// Whether the image at `path` is a Linux kernel: a bzImage (`HdrS` boot
/// header), or an ELF with a note named `Linux` (vmlinux carries several).
pub fn payload_is_linux(path: &Path) -> std::io::Result<bool> {
    let mut f = File::open(path)?;
    let mut head = [0u8; 64];
    let n = read_up_to(&mut f, &mut head)?;
    if n >= 4 && &head[..4] == b"\x7fELF" {
        return elf_has_linux_note(&mut f, &head[..n]);
    }
    let mut hdr = [0u8; 4];
    f.seek(SeekFrom::Start(0x202))?;
    Ok(read_up_to(&mut f, &mut hdr)? == 4 && &hdr == b"HdrS")
}

fn read_up_to(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Largest PT_NOTE segment we scan (vmlinux notes are a few hundred bytes).
const MAX_NOTE_SEGMENT: u64 = 64 * 1024;

fn elf_has_linux_note(f: &mut File, ehdr: &[u8]) -> std::io::Result<bool> {
    // ELF64 little-endian only (EI_CLASS=2, EI_DATA=1).
    if ehdr.len() < 64 || ehdr[4] != 2 || ehdr[5] != 1 {
        return Ok(false);
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or([0; 4]));
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
    let phoff = u64_at(ehdr, 32);
    let phentsize = u64::from(u16_at(ehdr, 54));
    let phnum = u64::from(u16_at(ehdr, 56));
    if phentsize < 56 {
        return Ok(false);
    }
    for i in 0..phnum.min(64) {
        let mut ph = [0u8; 56];
        f.seek(SeekFrom::Start(phoff.saturating_add(i * phentsize)))?;
        if read_up_to(f, &mut ph)? < 56 || u32_at(&ph, 0) != 4 {
            continue; // not PT_NOTE
        }
        let (off, size) = (u64_at(&ph, 8), u64_at(&ph, 32).min(MAX_NOTE_SEGMENT));
        let mut notes = vec![0u8; size as usize];
        f.seek(SeekFrom::Start(off))?;
        let got = read_up_to(f, &mut notes)?;
        notes.truncate(got);
        let mut p = 0usize;
        while p + 12 <= notes.len() {
            let namesz = u32_at(&notes, p) as usize;
            let descsz = u32_at(&notes, p + 4) as usize;
            let name_start = p + 12;
            let Some(name_end) = name_start.checked_add(namesz) else {
                break;
            };
            if name_end > notes.len() {
                break;
            }
            let name = &notes[name_start..name_end];
            if name.strip_suffix(b"\0").unwrap_or(name) == b"Linux" {
                return Ok(true);
            }
            let Some(next) = name_start
                .checked_add(namesz.div_ceil(4) * 4)
                .and_then(|x| x.checked_add(descsz.div_ceil(4) * 4))
            else {
                break;
            };
            p = next;
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str, data: &[u8]) -> PathBuf {
        let p = std::env::temp_dir().join(format!("vmm-cli-{}-{name}", std::process::id()));
        std::fs::write(&p, data).unwrap();
        p
    }

    /// A minimal ELF64 with one PT_NOTE segment holding `note_name`.
    fn elf_with_note(note_name: &[u8]) -> Vec<u8> {
        let mut note = Vec::new();
        note.extend_from_slice(&(note_name.len() as u32 + 1).to_le_bytes());
        note.extend_from_slice(&4u32.to_le_bytes());
        note.extend_from_slice(&6u32.to_le_bytes());
        note.extend_from_slice(note_name);
        note.push(0);
        while note.len() % 4 != 0 {
            note.push(0);
        }
        note.extend_from_slice(&[1, 2, 3, 4]);
        let mut e = vec![0u8; 64 + 56];
        e[..4].copy_from_slice(b"\x7fELF");
        e[4] = 2;
        e[5] = 1;
        e[32..40].copy_from_slice(&64u64.to_le_bytes()); // phoff
        e[54..56].copy_from_slice(&56u16.to_le_bytes());
        e[56..58].copy_from_slice(&1u16.to_le_bytes());
        e[64..68].copy_from_slice(&4u32.to_le_bytes()); // PT_NOTE
        e[64 + 8..64 + 16].copy_from_slice(&120u64.to_le_bytes());
        e[64 + 32..64 + 40].copy_from_slice(&(note.len() as u64).to_le_bytes());
        e.extend_from_slice(&note);
        e
    }

    #[test]
    fn linux_payload_detection() {
        let linux = tmp("linux.elf", &elf_with_note(b"Linux"));
        let xen = tmp("xen.elf", &elf_with_note(b"Xen"));
        let mut bz = vec![0u8; 0x300];
        bz[0x202..0x206].copy_from_slice(b"HdrS");
        let bz = tmp("bz", &bz);
        let junk = tmp("junk", b"\x7fELF\x02");
        assert!(payload_is_linux(&linux).unwrap());
        assert!(!payload_is_linux(&xen).unwrap());
        assert!(payload_is_linux(&bz).unwrap());
        assert!(!payload_is_linux(&junk).unwrap());
        assert!(payload_is_linux(Path::new("/nonexistent/kernel")).is_err());
        // Hostile note sizes do not panic.
        let mut evil = elf_with_note(b"Linux");
        evil[120..124].copy_from_slice(&u32::MAX.to_le_bytes());
        let evil = tmp("evil", &evil);
        assert!(!payload_is_linux(&evil).unwrap());
        for p in [linux, xen, bz, junk, evil] {
            std::fs::remove_file(p).unwrap();
        }
    }

    #[test]
    fn timeline_text() {
        let t = Timeline {
            build: Duration::from_micros(1500),
            first_run: Some(Duration::from_micros(1600)),
            boot_marks: vec![crate::devices::boot_timer::BootMark {
                at: Duration::from_micros(2000),
                value: 0x10,
            }],
            exit: Some(Duration::from_micros(3000)),
            teardown: Some(Duration::from_micros(20_000)),
            entry: Some(crate::boot::EntryKind::Pvh),
            restore: None,
        };
        let s = format_timeline(&t, Some(&ExitReason::Reset));
        assert!(s.contains("1.500 ms built (PVH entry)"), "{s}");
        assert!(s.contains("1.600 ms first KVM_RUN"));
        assert!(s.contains("2.000 ms boot port write 0x10"));
        assert!(s.contains("3.000 ms exit: guest reset"));
        assert!(s.contains("20.000 ms teardown"), "{s}");
    }
}
