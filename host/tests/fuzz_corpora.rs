//! Replays the committed fuzz corpora of the host's targets (`fuzz/corpus/`
//! and `fuzz/regressions/`) through the same functions the fuzzers call, so
//! `cargo test` checks every input the fuzzers kept, with no libFuzzer and
//! no nightly compiler. A missing corpus fails (see `fuzzing::replay`).

use bulkhead::fuzzing;

#[test]
fn every_openai_corpus_body_parses_or_is_refused_without_panicking() {
    assert!(fuzzing::replay("openai", fuzzing::openai, &[]) > 0);
}

#[test]
fn every_admin_corpus_body_and_query_parses_or_is_refused_without_panicking() {
    assert!(fuzzing::replay("admin", fuzzing::admin, &[]) > 0);
}

#[test]
fn every_upload_corpus_component_compiles_or_is_refused_without_panicking() {
    assert!(fuzzing::replay("upload", fuzzing::upload, &[]) > 0);
}

#[test]
fn every_policy_corpus_file_parses_or_is_refused_without_panicking() {
    assert!(fuzzing::replay("policy_toml", fuzzing::policy_toml, &[]) > 0);
}

#[test]
fn every_store_corpus_record_decodes_or_is_refused_without_panicking() {
    assert!(fuzzing::replay("store_records", fuzzing::store_records, &[]) > 0);
}

#[test]
fn every_transfer_corpus_stream_imports_or_is_refused_without_panicking() {
    assert!(fuzzing::replay("transfer_frames", fuzzing::transfer_frames, &[]) > 0);
}

#[test]
fn the_seed_inputs_pass_their_targets() {
    // The seeds are regenerated from code, so they are checked even when the
    // minimized corpus no longer keeps them.
    type Seeds = fn() -> Vec<(&'static str, Vec<u8>)>;
    type Body = fn(&[u8]);
    let targets: [(Seeds, Body); 5] = [
        (fuzzing::transfer_frames_seeds, fuzzing::transfer_frames),
        (fuzzing::openai_seeds, fuzzing::openai),
        (fuzzing::admin_seeds, fuzzing::admin),
        (fuzzing::policy_toml_seeds, fuzzing::policy_toml),
        (fuzzing::store_records_seeds, fuzzing::store_records),
    ];
    for (seeds, body) in targets {
        for (_, bytes) in seeds() {
            body(&bytes);
        }
    }
    // The chat seeds are requests the server takes (the fuzzer starts from
    // what parses, tools and earlier calls included).
    for (name, bytes) in fuzzing::openai_seeds() {
        if name.starts_with("seed-chat") {
            let parsed = bulkhead::api::openai::ChatRequest::parse(&bytes);
            assert!(parsed.is_ok(), "{name}: {parsed:?}");
        }
    }
}

/// Seeds the corpora: `cargo test -p bulkhead --test fuzz_corpora --
/// --ignored writes_the_seed_corpora` (fuzz/README.md). The upload corpus
/// is seeded with the plugins `scripts/plugins.sh` builds.
#[test]
#[ignore = "writes into fuzz/corpus; run by hand to seed the corpora"]
fn writes_the_seed_corpora() {
    fuzzing::write_seeds("openai", &fuzzing::openai_seeds()).expect("openai seeds");
    fuzzing::write_seeds("admin", &fuzzing::admin_seeds()).expect("admin seeds");
    fuzzing::write_seeds("policy_toml", &fuzzing::policy_toml_seeds()).expect("policy seeds");
    fuzzing::write_seeds("store_records", &fuzzing::store_records_seeds()).expect("store seeds");
    fuzzing::write_seeds("transfer_frames", &fuzzing::transfer_frames_seeds())
        .expect("transfer seeds");
}
