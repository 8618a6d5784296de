#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| cowork_helper::fuzzing::link_host(data));
