//! The in-process KVM microVM (x86_64) of cowork-helper.
//!
//! [`machine::Vm::build`] turns a [`machine::Config`] (kernel, initrd,
//! command line, memory, vCPUs, virtio-mmio devices) into a KVM VM with an
//! in-kernel irqchip and PIT, ACPI and MP tables, a COM1 UART, an i8042 for
//! reset, a boot-timing port and the ACPI sleep registers;
//! [`machine::Vm::run`] runs it to an [`ExitReason`].
//! [`cli::vm_run`] is the `cowork-helper vm run` command, [`mod@bench`] the
//! boot benchmark, and [`kvm_check::linux_capable`] tells whether this
//! host's KVM can boot Linux at all.
//!
//! Module map: [`layout`] (addresses), [`memory`], [`boot`], [`cpuid`],
//! [`acpi`], [`mptable`], [`devices`], [`exit`] (why a VM stops), [`bus`], [`vcpu`], [`machine`], [`seccomp`] (per-thread
//! system call filters), [`threadfs`] (a thread's own umask),
//! [`virtio`] (transport, separate work), [`snapshot`] (pausing a VM to
//! files and restoring it: [`machine::Vm::snapshot`],
//! [`machine::Vm::restore`]).

pub mod acpi;
pub mod bench;
pub mod boot;
pub mod bus;
pub mod cli;
pub mod cpuid;
pub mod devices;
pub mod exit;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod kvm_check;
pub mod layout;
pub mod machine;
pub mod memory;
pub mod mptable;
pub mod seccomp;
pub mod snapshot;
pub mod sparse;
pub mod sync;
pub mod threadfs;
pub mod vcpu;
pub mod virtio;

pub use exit::ExitReason;
pub use machine::{Config, PauseHandle, StopHandle, Vm, VmError};
pub use snapshot::{SnapshotError, SnapshotInfo};
