//! The in-process KVM microVM (x86_64). See issue "vmm: an in-process KVM microVM".

pub mod bus;
pub mod virtio;
