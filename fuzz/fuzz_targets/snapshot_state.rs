#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| vmm::fuzzing::snapshot_state(data));
