//! Replays every file of `fuzz/corpus/<target>/` through its target function, without a fuzz
//! engine, so the ordinary test run re-checks every input the fuzzers kept (seeds, coverage
//! finds, fixed crashes). A missing or empty corpus directory fails, and so does a corpus
//! directory without a target.

use std::path::{Path, PathBuf};

fn corpus_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus")
}

fn replay(name: &str) {
    let (_, target) = warren_fuzz::TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no target {name}"));
    let dir = corpus_root().join(name);
    let entries =
        std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()));
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "corpus {} is empty", dir.display());
    for path in &files {
        let data = std::fs::read(path).expect("read corpus file");
        let outcome = std::panic::catch_unwind(|| target(&data));
        if outcome.is_err() {
            panic!("{name}: {} fails its target", path.display());
        }
    }
    eprintln!("{name}: {} inputs replayed", files.len());
}

macro_rules! replay_tests {
    ($($test:ident => $name:literal,)*) => {
        $(
            #[test]
            fn $test() {
                replay($name);
            }
        )*

        #[test]
        fn test_corpus_every_directory_and_target_paired() {
            let tested = [$($name),*];
            let mut targets: Vec<&str> = warren_fuzz::TARGETS.iter().map(|(n, _)| *n).collect();
            targets.sort();
            let mut sorted = tested.to_vec();
            sorted.sort();
            assert_eq!(targets, sorted, "a target without a replay test");
            for e in std::fs::read_dir(corpus_root()).expect("fuzz/corpus") {
                let name = e.expect("corpus entry").file_name();
                let name = name.to_string_lossy();
                assert!(tested.contains(&name.as_ref()), "corpus {name} has no target");
            }
        }
    };
}

replay_tests! {
    test_corpus_framing_replays => "framing",
    test_corpus_guest_messages_replays => "guest_messages",
    test_corpus_http1_replays => "http1",
    test_corpus_tls_client_hello_replays => "tls_client_hello",
    test_corpus_dns_query_replays => "dns_query",
    test_corpus_configs_replays => "configs",
    test_corpus_api_json_replays => "api_json",
}
