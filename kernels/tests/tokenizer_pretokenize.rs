//! Pre-tokenizer splits against HF (Oniguruma) and against the look-ahead patterns.
//!
//! The library runs each pattern without its `\s+(?!\S)` branch and emulates the
//! look-ahead by hand (see `tokenizer/pretokenize.rs`). These tests pin that down two
//! ways: the committed fixture holds HF's splits of every fixture text for every
//! pre-tokenizer name, and a property test compares against fancy-regex running the
//! original look-ahead patterns on random text.

use std::path::PathBuf;
use std::sync::LazyLock;

use bulkhead_kernels::tokenizer::{Tokenizer, TokenizerError, VocabSpec};
use fancy_regex::Regex;
use proptest::prelude::*;
use serde_json::Value;

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3: &str = concat!(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const QWEN2: &str = concat!(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+",
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// `(pre name, reference patterns applied in sequence)`.
fn references() -> Vec<(&'static str, Vec<&'static str>)> {
    vec![
        ("gpt2", vec![GPT2]),
        ("smollm", vec![r"\p{N}", GPT2]),
        ("llama-bpe", vec![LLAMA3]),
        ("qwen2", vec![QWEN2]),
    ]
}

/// GPT-2's byte-level alphabet: the smallest valid byte-level BPE vocabulary.
fn byte_level_tokens() -> Vec<String> {
    let mut shifted = 0;
    (0u32..256)
        .map(|b| {
            let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
            let c = if printable {
                b
            } else {
                shifted += 1;
                255 + shifted
            };
            char::from_u32(c).unwrap().to_string()
        })
        .collect()
}

fn byte_level(pre: &str) -> Result<Tokenizer, TokenizerError> {
    Tokenizer::new(VocabSpec {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens: byte_level_tokens(),
        merges: Some(Vec::new()),
        ..VocabSpec::default()
    })
}

/// Every pre-tokenizer with its compiled reference patterns, built once.
static SPLITTERS: LazyLock<Vec<(&'static str, Tokenizer, Vec<Regex>)>> = LazyLock::new(|| {
    references()
        .into_iter()
        .map(|(name, patterns)| {
            let regexes = patterns.iter().map(|p| Regex::new(p).unwrap()).collect();
            (name, byte_level(name).unwrap(), regexes)
        })
        .collect()
});

/// Splits like HF's `Sequence([Split(pattern, "isolated"), ...])`.
fn reference_split(regexes: &[Regex], text: &str) -> Vec<String> {
    let mut pieces = vec![text.to_owned()];
    for re in regexes {
        let mut next = Vec::new();
        for piece in &pieces {
            let mut last = 0;
            for m in re.find_iter(piece) {
                let m = m.unwrap();
                if m.start() > last {
                    next.push(piece[last..m.start()].to_owned());
                }
                next.push(m.as_str().to_owned());
                last = m.end();
            }
            if last < piece.len() {
                next.push(piece[last..].to_owned());
            }
        }
        pieces = next;
    }
    pieces
}

#[test]
fn splits_fixture_texts_exactly_like_hf() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokens_smollm2.json");
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let texts: Vec<&str> = fixture["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    for (name, _) in references() {
        let tok = byte_level(name).unwrap();
        let expected = fixture["pre_tokenized"][name].as_array().unwrap();
        assert_eq!(expected.len(), texts.len());
        for (text, want) in texts.iter().zip(expected) {
            let want: Vec<&str> = want
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p.as_str().unwrap())
                .collect();
            assert_eq!(tok.pre_tokenize(text).unwrap(), want, "{name} on {text:?}");
        }
    }
}

#[test]
fn treats_absent_and_default_pre_as_gpt2() {
    let text = "it's  12345 a\t\tb  \n c";
    let gpt2 = byte_level("gpt2").unwrap();
    let default = byte_level("default").unwrap();
    let mut spec = VocabSpec {
        model: "gpt2".into(),
        tokens: byte_level_tokens(),
        merges: Some(Vec::new()),
        ..VocabSpec::default()
    };
    spec.pre = None;
    let absent = Tokenizer::new(spec).unwrap();
    let want = gpt2.pre_tokenize(text).unwrap();
    assert_eq!(default.pre_tokenize(text).unwrap(), want);
    assert_eq!(absent.pre_tokenize(text).unwrap(), want);
}

#[test]
fn rejects_unknown_pre_tokenizer_names() {
    for name in ["deepseek-llm", "SMOLLM", "", "llama3"] {
        assert_eq!(
            byte_level(name).unwrap_err(),
            TokenizerError::UnknownPreTokenizer(name.into())
        );
    }
}

#[test]
fn splits_a_megabyte_of_whitespace_without_hitting_a_backtrack_limit() {
    let text = format!("a{}b", " \t".repeat(1 << 19));
    for (name, _) in references() {
        let words = byte_level(name).unwrap().pre_tokenize(&text).unwrap();
        assert_eq!(words.concat(), text, "{name}");
        assert!(words.len() <= 4, "{name}: {} words", words.len());
    }
}

/// Characters chosen to hit every branch: contractions, letters of several scripts,
/// digits (ASCII and not), punctuation, every kind of whitespace, emoji and ZWJ.
fn soup() -> impl Strategy<Value = String> {
    let chars = prop::sample::select(vec![
        'a', 'Z', 's', 't', 'l', 'd', 'é', 'ß', '中', 'ñ', 'Я', '\'', '1', '9', '٣', '²', '½', '.',
        ',', '-', '(', '😀', '\u{200D}', '\u{FE0F}', ' ', ' ', ' ', '\t', '\n', '\r', '\u{A0}',
        '\u{3000}', '\u{2028}', '\u{B}',
    ]);
    prop::collection::vec(chars, 0..64).prop_map(|cs| cs.into_iter().collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn emulated_lookahead_splits_like_the_lookahead_pattern(text in soup()) {
        for (name, tok, regexes) in SPLITTERS.iter() {
            let ours: Vec<String> =
                tok.pre_tokenize(&text).unwrap().into_iter().map(str::to_owned).collect();
            prop_assert_eq!(ours, reference_split(regexes, &text), "pre {}", name);
        }
    }
}
