#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| warren_fuzz::egress::tls_client_hello(data));
