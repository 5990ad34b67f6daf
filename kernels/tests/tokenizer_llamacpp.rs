//! Our tokenizers against llama.cpp's own tokenizer test vectors
//! (`models/ggml-vocab-NAME.gguf` with `.inp` texts and `.out` ids, from
//! llama.cpp's `test-tokenizer-0`): vocabulary-only GGUF files of each
//! family's real tokenizer, tokenized without BOS and without parsing special
//! tokens, as that test does.
//!
//! The files come with the llama.cpp sources that `scripts/setup.sh` fetches
//! (PyPI's `llama-cpp-python` 0.3.36 sdist, pinned by hash) into
//! `.cache/llama.cpp/vocab/`; without them the test says "skipped".

mod common;

use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::tokenizer::{EncodeOptions, Tokenizer};

/// The vocabularies checked: the families the engine runs, and the others
/// whose pre-tokenizer it implements.
const VOCABS: [&str; 4] = ["llama-bpe", "qwen2", "phi-3", "llama-spm"];

/// Each test text and llama.cpp's ids for it.
type Cases = Vec<(String, Vec<u32>)>;

fn cases(name: &str) -> Option<(Tokenizer, Cases)> {
    let dir = common::repo_root().join(".cache/llama.cpp/vocab");
    let path = dir.join(format!("ggml-vocab-{name}.gguf"));
    if !path.exists() {
        assert!(
            std::env::var_os("BULKHEAD_REQUIRE_MODEL").is_none(),
            "BULKHEAD_REQUIRE_MODEL is set but {} is missing: run scripts/setup.sh",
            path.display()
        );
        eprintln!(
            "skipped: {} is missing; run scripts/setup.sh",
            path.display()
        );
        return None;
    }
    let tokenizer =
        Tokenizer::from_gguf(&Gguf::open(&path).unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let inp = std::fs::read_to_string(path.with_extension("gguf.inp")).unwrap();
    let out = std::fs::read_to_string(path.with_extension("gguf.out")).unwrap();
    // As test-tokenizer-0 splits it: the file ends with a separator.
    let inp = inp.strip_suffix("\n__ggml_vocab_test__\n").unwrap_or(&inp);
    let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect();
    assert_eq!(texts.len(), ids.len(), "{name}: .inp and .out disagree");
    Some((
        tokenizer,
        texts.into_iter().map(String::from).zip(ids).collect(),
    ))
}

#[test]
fn every_family_tokenizes_as_llama_cpp() {
    let options = EncodeOptions {
        add_bos: false,
        parse_special: false,
    };
    for name in VOCABS {
        let Some((tokenizer, cases)) = cases(name) else {
            continue;
        };
        let mut failed = Vec::new();
        for (text, expected) in &cases {
            let ours = tokenizer.encode(text, options).unwrap();
            if &ours != expected {
                failed.push(format!("{text:?}: ours {ours:?}, llama.cpp {expected:?}"));
            }
        }
        eprintln!(
            "{name}: {} of {} texts agree",
            cases.len() - failed.len(),
            cases.len()
        );
        assert!(failed.is_empty(), "{name}:\n{}", failed.join("\n"));
    }
}
