//! Replays the committed fuzz corpora of this crate's targets (`fuzz/corpus/`
//! and `fuzz/regressions/`) through the same functions the fuzzers call, so
//! `cargo test` checks every input the fuzzers kept, with no libFuzzer and
//! no nightly compiler. A missing corpus fails (see `fuzzing::replay`).

use bulkhead_kernels::fuzzing;

#[test]
fn every_gguf_corpus_input_parses_or_is_refused_without_panicking() {
    let ran = fuzzing::replay("gguf", fuzzing::gguf, &[]);
    assert!(ran > 0);
}

#[test]
fn every_tokenizer_corpus_input_encodes_and_decodes_without_panicking() {
    let ran = fuzzing::replay("tokenizer", fuzzing::tokenizer, &[]);
    assert!(ran > 0);
}

#[test]
fn the_seed_inputs_pass_their_targets() {
    // The seeds are regenerated from code, so they are checked even when the
    // minimized corpus no longer keeps them.
    for (_, bytes) in fuzzing::gguf_seeds() {
        fuzzing::gguf(&bytes);
    }
    for (_, bytes) in fuzzing::tokenizer_seeds() {
        fuzzing::tokenizer(&bytes);
    }
}

/// Seeds the corpora: `cargo test -p bulkhead-kernels --test fuzz_corpora --
/// --ignored writes_the_seed_corpora` (fuzz/README.md).
#[test]
#[ignore = "writes into fuzz/corpus; run by hand to seed the corpora"]
fn writes_the_seed_corpora() {
    fuzzing::write_seeds("gguf", &fuzzing::gguf_seeds()).expect("write gguf seeds");
    fuzzing::write_seeds("tokenizer", &fuzzing::tokenizer_seeds()).expect("write tokenizer seeds");
}
