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

/// Gemma's SentencePiece setting, `add_space_prefix = false`, on llama.cpp's
/// SentencePiece test vocabulary (no Gemma 2/3 vocabulary ships with its
/// tests): llama.cpp's ids for the same texts under that setting are a
/// committed fixture (`scripts/llama_fixtures.py`). Decoding gives the text
/// back, with no leading space taken off.
#[test]
fn sentencepiece_without_the_space_prefix_tokenizes_as_llama_cpp() {
    use bulkhead_kernels::gguf::{GgufWriter, Value};
    use bulkhead_kernels::tokenizer::DecodeOptions;
    let path = common::repo_root().join(".cache/llama.cpp/vocab/ggml-vocab-llama-spm.gguf");
    if cases("llama-spm").is_none() {
        return;
    }
    let vocab = Gguf::open(&path).unwrap();
    let mut writer = GgufWriter::new();
    for (key, value) in vocab.metadata() {
        writer.metadata(key, value.clone());
    }
    writer.metadata("tokenizer.ggml.add_space_prefix", Value::Bool(false));
    let variant = Gguf::from_bytes(writer.to_bytes()).unwrap();
    let tokenizer = Tokenizer::from_gguf(&variant).unwrap();
    let fixture =
        common::repo_root().join("kernels/tests/fixtures/tokenizer/spm-no-space-prefix.json");
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let options = EncodeOptions {
        add_bos: false,
        parse_special: false,
    };
    let cases = fixture["cases"].as_array().unwrap();
    let mut failed = Vec::new();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let expected: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|id| id.as_u64().unwrap() as u32)
            .collect();
        let ours = tokenizer.encode(text, options).unwrap();
        if ours != expected {
            failed.push(format!("{text:?}: ours {ours:?}, llama.cpp {expected:?}"));
            continue;
        }
        let decoded = tokenizer
            .decode(
                &ours,
                DecodeOptions {
                    skip_special: false,
                },
            )
            .unwrap();
        if decoded != text {
            failed.push(format!("{text:?} decodes to {decoded:?}"));
        }
    }
    eprintln!(
        "spm without the space prefix: {} of {} texts agree",
        cases.len() - failed.len(),
        cases.len()
    );
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    // The setting matters: with the prefix, " Hello" and "Hello" part ways.
    let with_prefix = Tokenizer::from_gguf(&vocab).unwrap();
    assert_ne!(
        with_prefix.encode("Hello", options).unwrap(),
        tokenizer.encode("Hello", options).unwrap()
    );
}
