//! What the host KVM must offer, and whether it can run Linux at all.
//!
//! Two separate questions:
//! - [`check_capabilities`]: the ioctls/capabilities this VMM uses. Missing
//!   ones are a hard error naming the capability.
//! - [`linux_capable`]: whether `/dev/kvm` is backed by hardware
//!   virtualization (VT-x/AMD-V). PVM ("kvm_pvm", paravirtualized KVM used in
//!   nested cloud sandboxes) runs small hand-written guests but a stock Linux
//!   kernel dies early in emulation failures, so booting Linux there would
//!   only waste ~30 s before an opaque error. The daemon's `doctor` and
//!   `vm run` call this to say so up front.

use std::path::Path;

use kvm_ioctls::{Cap, Kvm};

/// Errors of the capability check.
#[derive(Debug, thiserror::Error)]
pub enum KvmCheckError {
    /// /dev/kvm could not be opened.
    #[error(
        "cannot open /dev/kvm: {0} (is the kvm module loaded and are you in the 'kvm' group?)"
    )]
    Open(#[source] kvm_ioctls::Error),
    /// Wrong API version.
    #[error("KVM API version {0} is not supported (need 12)")]
    ApiVersion(i32),
    /// A capability we depend on is absent.
    #[error("host KVM lacks {name} (needed for {why}); upgrade the host kernel")]
    MissingCap {
        /// Capability name.
        name: &'static str,
        /// What we use it for.
        why: &'static str,
    },
}

/// Capabilities the machine relies on, with the reason.
pub const REQUIRED_CAPS: &[(Cap, &str, &str)] = &[
    (
        Cap::Irqchip,
        "KVM_CAP_IRQCHIP",
        "the in-kernel LAPIC/IOAPIC/PIC",
    ),
    (Cap::Hlt, "KVM_CAP_HLT", "in-kernel HLT handling"),
    (Cap::UserMemory, "KVM_CAP_USER_MEMORY", "guest RAM"),
    (
        Cap::SetTssAddr,
        "KVM_CAP_SET_TSS_ADDR",
        "the VMX real-mode TSS",
    ),
    (Cap::Pit2, "KVM_CAP_PIT2", "the in-kernel i8254 PIT"),
    (
        Cap::PitState2,
        "KVM_CAP_PIT_STATE2",
        "the in-kernel i8254 PIT",
    ),
    (
        Cap::Ioeventfd,
        "KVM_CAP_IOEVENTFD",
        "virtio queue notifications",
    ),
    (Cap::Irqfd, "KVM_CAP_IRQFD", "device interrupts"),
    (
        Cap::ExtCpuid,
        "KVM_CAP_EXT_CPUID",
        "KVM_GET_SUPPORTED_CPUID",
    ),
    (
        Cap::ImmediateExit,
        "KVM_CAP_IMMEDIATE_EXIT",
        "stopping vCPUs from another thread",
    ),
];

/// Opens /dev/kvm and checks the API version and [`REQUIRED_CAPS`].
pub fn check_capabilities() -> Result<Kvm, KvmCheckError> {
    let kvm = Kvm::new().map_err(KvmCheckError::Open)?;
    check_kvm(&kvm)?;
    Ok(kvm)
}

/// Checks an already-open KVM handle.
pub fn check_kvm(kvm: &Kvm) -> Result<(), KvmCheckError> {
    let v = kvm.get_api_version();
    if v != 12 {
        return Err(KvmCheckError::ApiVersion(v));
    }
    for (cap, name, why) in REQUIRED_CAPS {
        if !kvm.check_extension(*cap) {
            return Err(KvmCheckError::MissingCap { name, why });
        }
    }
    Ok(())
}

/// Why this host's KVM cannot run a Linux guest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvmUnsuitable {
    /// No /dev/kvm.
    #[error("{path} is not available ({reason}): this host has no usable KVM. Enable VT-x/AMD-V (or nested virtualization) and load kvm_intel/kvm_amd")]
    NoDevice {
        /// Device path.
        path: String,
        /// Why.
        reason: String,
    },
    /// KVM is provided by PVM.
    #[error("this KVM is PVM (the kvm_pvm module is loaded and the CPU has no vmx/svm): it runs small test guests but cannot boot Linux (the kernel dies on emulation failures). Run on a host with VT-x/AMD-V, or inside the nested-KVM harness")]
    Pvm,
    /// CPU lacks vmx/svm but some KVM is present anyway.
    #[error("the CPU advertises neither vmx nor svm in /proc/cpuinfo, so /dev/kvm is not hardware-assisted and cannot boot Linux. Enable VT-x/AMD-V (or nested virtualization)")]
    NoHardwareVirt,
}

/// Whether `/dev/kvm` here can boot a Linux guest. `Ok(())` when the CPU
/// has vmx or svm and no PVM module provides KVM.
pub fn linux_capable() -> Result<(), KvmUnsuitable> {
    linux_capable_at(
        Path::new("/dev/kvm"),
        Path::new("/proc/cpuinfo"),
        Path::new("/sys/module/kvm_pvm"),
    )
}

/// [`linux_capable`] against explicit paths (for tests).
pub fn linux_capable_at(
    dev: &Path,
    cpuinfo: &Path,
    pvm_module: &Path,
) -> Result<(), KvmUnsuitable> {
    if let Err(e) = std::fs::metadata(dev) {
        return Err(KvmUnsuitable::NoDevice {
            path: dev.display().to_string(),
            reason: e.to_string(),
        });
    }
    let info = std::fs::read_to_string(cpuinfo).unwrap_or_default();
    let hw = has_hw_virt_flag(&info);
    if pvm_module.exists() && !hw {
        return Err(KvmUnsuitable::Pvm);
    }
    if !hw {
        return Err(KvmUnsuitable::NoHardwareVirt);
    }
    Ok(())
}

/// Whether a /proc/cpuinfo text lists `vmx` or `svm` in a `flags` line.
pub fn has_hw_virt_flag(cpuinfo: &str) -> bool {
    cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .filter_map(|l| l.split_once(':'))
        .any(|(_, flags)| flags.split_whitespace().any(|f| f == "vmx" || f == "svm"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_detection() {
        assert!(has_hw_virt_flag(
            "processor\t: 0\nflags\t\t: fpu vme svm sse\n"
        ));
        assert!(has_hw_virt_flag("flags\t: fpu vmx\n"));
        assert!(!has_hw_virt_flag(
            "flags\t: fpu vmxx hypervisor\nvmx flags\t: ept\n"
        ));
        assert!(!has_hw_virt_flag(""));
    }

    #[test]
    fn suitability_verdicts() {
        let dir = std::env::temp_dir().join(format!("vmm-kvmcheck-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("kvm_pvm")).unwrap();
        let dev = dir.join("kvm");
        std::fs::write(&dev, b"").unwrap();
        let with = dir.join("cpuinfo-svm");
        std::fs::write(&with, "flags\t: fpu svm\n").unwrap();
        let without = dir.join("cpuinfo-none");
        std::fs::write(&without, "flags\t: fpu hypervisor\n").unwrap();
        let pvm = dir.join("kvm_pvm");
        let nopvm = dir.join("absent");

        assert_eq!(linux_capable_at(&dev, &with, &nopvm), Ok(()));
        assert_eq!(
            linux_capable_at(&dev, &without, &pvm),
            Err(KvmUnsuitable::Pvm)
        );
        assert_eq!(
            linux_capable_at(&dev, &without, &nopvm),
            Err(KvmUnsuitable::NoHardwareVirt)
        );
        assert!(matches!(
            linux_capable_at(&dir.join("nope"), &with, &nopvm),
            Err(KvmUnsuitable::NoDevice { .. })
        ));
        let msg = KvmUnsuitable::Pvm.to_string();
        assert!(msg.contains("cannot boot Linux"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
