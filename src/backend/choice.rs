//! Which backend runs the sessions: `--backend`'s choice and `auto`'s rule
//! over what this host has (a KVM that runs Linux, a guest image, QEMU).
//! `cli` parses the choice, the daemon serves what it resolves to, and
//! `doctor` explains it.
//!
//! Limits: `auto` looks at the host once, at start; a guest image installed
//! later is used by the next helper.

use clap::ValueEnum;

use super::{BackendKind, BootOptions};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// Pick the best backend available here (see `resolve_backend`).
    Auto,
    /// Linux namespaces on the host; no VM.
    Sandbox,
    /// A Linux guest under QEMU (KVM where it can run Linux, else TCG).
    Qemu,
    /// A Linux guest under the in-process VMM (needs a KVM that runs Linux).
    Kvm,
}

/// Resolves `auto` to a concrete backend, with the reason.
///
/// `auto` prefers the in-process VM (`kvm`) when `/dev/kvm` can run Linux
/// and a guest image is present; else QEMU when QEMU and a guest image are
/// present (and `/dev/kvm` cannot run Linux); else the sandbox. Mind that on
/// a host like the CI machine (PVM KVM) building the guest image switches
/// `auto` to QEMU under TCG, which starts in seconds where the sandbox takes
/// milliseconds; the test suites and `bench` pass `--backend` explicitly.
/// `machine` says where QEMU and the guest image are looked for (the
/// daemon's settings).
pub fn resolve_backend(
    choice: BackendChoice,
    machine: &BootOptions,
) -> (BackendKind, &'static str) {
    match choice {
        BackendChoice::Sandbox => (BackendKind::Sandbox, "requested with --backend sandbox"),
        BackendChoice::Qemu => (BackendKind::Qemu, "requested with --backend qemu"),
        BackendChoice::Kvm => (BackendKind::Kvm, "requested with --backend kvm"),
        BackendChoice::Auto => {
            use super::qemu;
            auto_backend(
                qemu::find_qemu(machine.qemu.as_deref(), &machine.host).is_ok(),
                machine.images.locate(None).is_ok(),
                super::guest::kvm_for_linux().is_ok(),
            )
        }
    }
}

/// `auto`'s rule over the facts it depends on (see [`resolve_backend`]).
pub fn auto_backend(
    qemu_found: bool,
    image_found: bool,
    kvm_runs_linux: bool,
) -> (BackendKind, &'static str) {
    match (qemu_found, image_found, kvm_runs_linux) {
        (_, true, true) => (
            BackendKind::Kvm,
            "auto: /dev/kvm can run Linux and a guest image is present, so the guest runs under the in-process VMM",
        ),
        (true, true, false) => (
            BackendKind::Qemu,
            "auto: QEMU and a guest image are present and /dev/kvm cannot run Linux, so the guest runs under QEMU (TCG)",
        ),
        (_, false, true) => (
            BackendKind::Sandbox,
            "auto: /dev/kvm can run Linux but no guest image was found (install the cowork-helper package, or scripts/setup.sh in a checkout), so the namespace sandbox",
        ),
        (false, _, false) => (
            BackendKind::Sandbox,
            "auto: no QEMU found, so the namespace sandbox",
        ),
        (true, false, false) => (
            BackendKind::Sandbox,
            "auto: no guest image found (install the cowork-helper package, or scripts/setup.sh in a checkout), so the namespace sandbox",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_prefers_kvm_then_qemu_then_the_sandbox() {
        assert_eq!(auto_backend(true, true, true).0, BackendKind::Kvm);
        assert_eq!(auto_backend(false, true, true).0, BackendKind::Kvm);
        assert_eq!(auto_backend(true, true, false).0, BackendKind::Qemu);
        for (q, i, k) in [
            (false, true, false),
            (true, false, false),
            (false, false, true),
            (true, false, true),
        ] {
            let (kind, why) = auto_backend(q, i, k);
            assert_eq!(kind, BackendKind::Sandbox, "{q} {i} {k}");
            assert!(why.starts_with("auto: "), "{why}");
        }
        assert!(auto_backend(false, true, false).1.contains("no QEMU"));
        assert!(auto_backend(true, false, false)
            .1
            .contains("cowork-helper package"));
        assert!(auto_backend(true, false, true).1.contains("no guest image"));
        let machine = BootOptions::default();
        assert_eq!(
            resolve_backend(BackendChoice::Qemu, &machine),
            (BackendKind::Qemu, "requested with --backend qemu")
        );
        assert_eq!(
            resolve_backend(BackendChoice::Kvm, &machine),
            (BackendKind::Kvm, "requested with --backend kvm")
        );
    }
}
