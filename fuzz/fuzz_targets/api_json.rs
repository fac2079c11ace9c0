#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| warren_fuzz::api::api_json(data));
