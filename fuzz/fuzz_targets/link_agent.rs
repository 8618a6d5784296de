#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| guest_agent::fuzzing::link_agent(data));
