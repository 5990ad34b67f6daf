#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bulkhead::fuzzing::policy_toml(data));
