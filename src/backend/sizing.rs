//! How big a VM backend makes the guest: memory from `startVM.memoryGB`
//! and vCPUs from `startVM.cpuCount`, with the bounds both VM backends
//! apply. Each backend keeps its own default memory (QEMU's and the
//! in-process VM's differ).
//!
//! Limits: memory is clamped to [`MIN_MEMORY_MIB`]..=[`MAX_MEMORY_MIB`];
//! vCPUs never exceed the host's CPU count (a backend may cap them lower).

/// Smallest guest memory accepted.
pub const MIN_MEMORY_MIB: u64 = 256;
/// Largest guest memory accepted.
pub const MAX_MEMORY_MIB: u64 = 64 * 1024;
/// vCPUs when `startVM` does not say (capped at the host's CPU count).
pub const DEFAULT_CPUS: u32 = 2;

/// Guest memory for a `startVM.memoryGB` value; `default_mib` when it is
/// absent or not a positive number.
pub fn memory_mib(memory_gb: Option<f64>, default_mib: u64) -> u64 {
    match memory_gb {
        Some(gb) if gb.is_finite() && gb > 0.0 => {
            ((gb * 1024.0).round() as u64).clamp(MIN_MEMORY_MIB, MAX_MEMORY_MIB)
        }
        _ => default_mib,
    }
}

/// vCPUs for a `startVM.cpuCount` value, at most `host_cpus`.
pub fn cpu_count(requested: Option<u32>, host_cpus: u32) -> u32 {
    requested
        .filter(|&n| n > 0)
        .unwrap_or(DEFAULT_CPUS)
        .min(host_cpus.max(1))
}

/// The host's CPU count (1 when it cannot be read).
pub fn host_cpus() -> u32 {
    std::thread::available_parallelism()
        .map(|n| u32::try_from(n.get()).unwrap_or(u32::MAX))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_and_cpus() {
        assert_eq!(memory_mib(None, 2048), 2048);
        assert_eq!(memory_mib(Some(4.0), 2048), 4096);
        assert_eq!(memory_mib(Some(0.5), 2048), 512);
        assert_eq!(memory_mib(Some(0.01), 1024), MIN_MEMORY_MIB);
        assert_eq!(memory_mib(Some(1e12), 1024), MAX_MEMORY_MIB);
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -2.0, 0.0] {
            assert_eq!(memory_mib(Some(bad), 1024), 1024, "{bad}");
        }
        assert_eq!(cpu_count(None, 8), DEFAULT_CPUS);
        assert_eq!(cpu_count(Some(4), 2), 2);
        assert_eq!(cpu_count(Some(0), 8), DEFAULT_CPUS);
        assert_eq!(cpu_count(Some(3), 0), 1);
        assert!(host_cpus() >= 1);
    }
}
