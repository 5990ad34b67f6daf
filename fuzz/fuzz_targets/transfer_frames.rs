#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bulkhead::fuzzing::transfer_frames(data));
