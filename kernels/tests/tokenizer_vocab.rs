//! Vocabulary validation and byte-level BPE merging on tiny hand-built vocabularies.
//!
//! Every malformed vocabulary must come back as a typed error, never a panic: the GGUF
//! file is untrusted input. A property test throws random small vocabularies and texts
//! at `Tokenizer::new`, `encode` and `decode` to back that up.

use std::cell::Cell;

use bulkhead_kernels::tokenizer::{
    DecodeOptions, EncodeOptions, Tokenizer, TokenizerError, VocabSpec, TOKEN_BYTES_MAX,
};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

const PLAIN: EncodeOptions = EncodeOptions {
    add_bos: false,
    parse_special: false,
};
const TEMPLATE: EncodeOptions = EncodeOptions {
    add_bos: false,
    parse_special: true,
};
const RENDER: DecodeOptions = DecodeOptions {
    skip_special: false,
};

/// GPT-2's byte-level alphabet, ids 0..256 in byte order.
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

/// Byte alphabet + `extra` normal tokens + `specials` control tokens, with `merges`.
fn bpe(extra: &[&str], specials: &[&str], merges: &[&str]) -> VocabSpec {
    let mut tokens = byte_level_tokens();
    tokens.extend(extra.iter().map(|s| s.to_string()));
    let mut types = vec![1; tokens.len()];
    tokens.extend(specials.iter().map(|s| s.to_string()));
    types.resize(tokens.len(), 3);
    VocabSpec {
        model: "gpt2".into(),
        pre: Some("gpt2".into()),
        tokens,
        token_types: Some(types),
        merges: Some(merges.iter().map(|s| s.to_string()).collect()),
        ..VocabSpec::default()
    }
}

fn err(spec: VocabSpec) -> TokenizerError {
    Tokenizer::new(spec).expect_err("vocabulary must be rejected")
}

#[test]
fn merges_lowest_rank_first_and_leftmost_on_ties() {
    // Ranks: "a a"=0, "b c"=1, "aa b"=2. "aab c" is not reached: "b c" (1) beats
    // "aa b" (2), leaving aa|bc. "aaa": the leftmost "a a" merges first -> aa|a.
    let spec = bpe(&["aa", "bc", "aab"], &[], &["a a", "b c", "aa b"]);
    let tok = Tokenizer::new(spec).unwrap();
    let (aa, bc) = (tok.token_id("aa").unwrap(), tok.token_id("bc").unwrap());
    let a = tok.token_id("a").unwrap();
    assert_eq!(tok.encode("aabc", PLAIN).unwrap(), [aa, bc]);
    assert_eq!(tok.encode("aaa", PLAIN).unwrap(), [aa, a]);
    assert_eq!(tok.decode(&[aa, bc], RENDER).unwrap(), "aabc");
}

#[test]
fn never_merges_user_text_into_a_control_token() {
    // All punctuation, so "<||>" is one pre-token and the merge chain reaches "<||" + ">",
    // whose result is the control token: that last merge must not apply to text.
    let spec = bpe(&["<|", "<||"], &["<||>"], &["< |", "<| |", "<|| >"]);
    let tok = Tokenizer::new(spec).unwrap();
    let control = tok.token_id("<||>").unwrap();
    let ids = tok.encode("<||>", PLAIN).unwrap();
    assert_eq!(
        ids,
        [tok.token_id("<||").unwrap(), tok.token_id(">").unwrap()]
    );
    assert_eq!(tok.encode("<||>", TEMPLATE).unwrap(), [control]);
}

#[test]
fn splits_specials_leftmost_longest() {
    let spec = bpe(&[], &["<a>", "<a><b>", "b>"], &[]);
    let tok = Tokenizer::new(spec).unwrap();
    let id = |s: &str| tok.token_id(s).unwrap();
    let ids = tok.encode("x<a><b>b><a>", TEMPLATE).unwrap();
    assert_eq!(ids, [id("x"), id("<a><b>"), id("b>"), id("<a>")]);
}

#[test]
fn encode_into_stops_at_its_budget_even_when_the_bos_alone_exceeds_it() {
    // Found by fuzzing (fuzz/regressions/tokenizer/bos-alone-over-budget): an
    // empty text has no fragment, so the per-fragment check never ran and the
    // BOS went over a budget of 0 unrefused.
    let mut spec = bpe(&[], &["<s>"], &[]);
    spec.bos = Some(256);
    let tokenizer = Tokenizer::new(spec).unwrap();
    let with_bos = EncodeOptions {
        add_bos: true,
        parse_special: false,
    };
    let mut out = Vec::new();
    assert_eq!(
        tokenizer.encode_into("", with_bos, 0, &mut out),
        Err(TokenizerError::TooManyTokens { max: 0 })
    );
    let mut out = Vec::new();
    assert_eq!(tokenizer.encode_into("", with_bos, 1, &mut out), Ok(()));
    assert_eq!(out, [256]);
}

#[test]
fn encode_into_until_stops_after_the_word_where_it_was_asked_to() {
    // A server stops tokenizing the prompt of a request whose client left.
    let tokenizer = Tokenizer::new(bpe(&[], &[], &[])).unwrap();
    let plain = EncodeOptions {
        add_bos: false,
        parse_special: false,
    };
    let text = "one two three four five six seven eight";
    let whole = tokenizer.encode(text, plain).unwrap();
    let asked = Cell::new(0);
    let stop_at_third = || {
        asked.set(asked.get() + 1);
        asked.get() >= 3
    };
    let mut out = Vec::new();
    assert_eq!(
        tokenizer.encode_into_until(text, plain, usize::MAX, &mut out, &stop_at_third),
        Err(TokenizerError::Stopped)
    );
    assert_eq!(
        asked.get(),
        3,
        "asked once per word, and not after it said stop"
    );
    assert_eq!(
        out,
        whole[..out.len()],
        "what it did encode is the text's start"
    );
    assert_eq!(
        out.len(),
        "one two three".len(),
        "three words, one token per byte"
    );
    let mut out = Vec::new();
    assert_eq!(
        tokenizer.encode_into_until(text, plain, usize::MAX, &mut out, &|| false),
        Ok(())
    );
    assert_eq!(out, whole);
}

#[test]
fn rejects_an_empty_vocabulary() {
    let spec = VocabSpec {
        model: "gpt2".into(),
        merges: Some(Vec::new()),
        ..VocabSpec::default()
    };
    assert_eq!(err(spec), TokenizerError::EmptyVocab);
}

#[test]
fn rejects_an_empty_token() {
    let mut spec = bpe(&[], &[], &[]);
    spec.tokens[7] = String::new();
    assert_eq!(err(spec), TokenizerError::EmptyToken { id: 7 });
}

#[test]
fn rejects_a_token_over_the_length_limit() {
    let long = "x".repeat(TOKEN_BYTES_MAX + 1);
    let spec = bpe(&[&long], &[], &[]);
    assert!(matches!(
        err(spec),
        TokenizerError::TokenTooLong { id: 256, .. }
    ));
}

#[test]
fn rejects_duplicate_tokens() {
    let spec = bpe(&["ab", "ab"], &[], &[]);
    assert_eq!(
        err(spec),
        TokenizerError::DuplicateToken {
            id: 257,
            first: 256
        }
    );
}

#[test]
fn rejects_merges_naming_missing_tokens() {
    // The parts are missing, then the merged result is.
    for merge in ["q zz", "zz q", "a b"] {
        let spec = bpe(&[], &[], &[merge]);
        assert_eq!(
            err(spec),
            TokenizerError::MergeTokenMissing {
                index: 0,
                merge: merge.into()
            },
            "{merge}"
        );
    }
}

#[test]
fn rejects_malformed_merges() {
    for merge in ["ab", "a  b", "a b c", " a", ""] {
        let spec = bpe(&["ab"], &[], &[merge]);
        assert!(
            matches!(err(spec), TokenizerError::MalformedMerge { index: 0, .. }),
            "{merge:?}"
        );
    }
}

#[test]
fn rejects_special_ids_outside_the_vocabulary() {
    let mut spec = bpe(&[], &[], &[]);
    spec.eos = Some(256);
    assert_eq!(
        err(spec),
        TokenizerError::SpecialIdOutOfRange {
            role: "eos",
            id: 256,
            vocab_len: 256
        }
    );
    let mut spec = bpe(&[], &[], &[]);
    spec.unk = Some(u32::MAX);
    assert!(matches!(
        err(spec),
        TokenizerError::SpecialIdOutOfRange { role: "unk", .. }
    ));
}

#[test]
fn rejects_per_token_arrays_of_the_wrong_length_or_value() {
    let mut spec = bpe(&[], &[], &[]);
    spec.token_types.as_mut().unwrap().pop();
    assert!(matches!(
        err(spec),
        TokenizerError::LengthMismatch {
            field: "token_types",
            ..
        }
    ));
    let mut spec = bpe(&[], &[], &[]);
    spec.token_types.as_mut().unwrap()[3] = 9;
    assert_eq!(
        err(spec),
        TokenizerError::InvalidTokenType { id: 3, value: 9 }
    );
}

#[test]
fn rejects_unknown_models_and_missing_model_data() {
    let mut spec = bpe(&[], &[], &[]);
    spec.model = "bert".into();
    assert_eq!(err(spec), TokenizerError::UnknownModel("bert".into()));
    let mut spec = bpe(&[], &[], &[]);
    spec.merges = None;
    assert_eq!(err(spec), TokenizerError::MissingMerges);
    let mut spec = bpe(&[], &[], &[]);
    spec.model = "llama".into();
    assert_eq!(err(spec.clone()), TokenizerError::MissingScores);
    spec.scores = Some(vec![0.0; 255]);
    assert!(matches!(
        err(spec.clone()),
        TokenizerError::LengthMismatch {
            field: "scores",
            ..
        }
    ));
    spec.scores = Some(vec![0.0; 256]);
    spec.scores.as_mut().unwrap()[5] = f32::NAN;
    assert_eq!(err(spec), TokenizerError::InvalidScore { id: 5 });
}

#[test]
fn rejects_byte_tokens_not_spelled_as_bytes() {
    let tokens = vec!["<unk>".to_owned(), "<0xZZ>".to_owned()];
    let spec = VocabSpec {
        model: "llama".into(),
        tokens,
        token_types: Some(vec![2, 6]),
        scores: Some(vec![0.0, 0.0]),
        ..VocabSpec::default()
    };
    assert_eq!(err(spec), TokenizerError::MalformedByteToken { id: 1 });
}

#[test]
fn rejects_add_bos_without_a_bos_token() {
    let tok = Tokenizer::new(bpe(&[], &[], &[])).unwrap();
    let options = EncodeOptions {
        add_bos: true,
        parse_special: false,
    };
    assert_eq!(tok.encode("a", options), Err(TokenizerError::MissingBos));
}

#[test]
fn defaults_token_types_when_absent() {
    let mut spec = bpe(&["<|end|>"], &[], &[]);
    spec.token_types = None;
    spec.eos = Some(0);
    let tok = Tokenizer::new(spec).unwrap();
    assert!(tok.is_eog(0), "EOS ends generation");
    let end = tok.token_id("<|end|>").unwrap();
    assert!(
        !tok.is_eog(end),
        "a normal token is never an end marker by name"
    );
}

/// A small random vocabulary over a tiny alphabet: mostly unique non-empty tokens with
/// merges between them (so construction often succeeds and merging runs), and now and
/// then an empty or duplicate token, a bad type, a stray id or a malformed merge.
fn hostile_spec() -> impl Strategy<Value = VocabSpec> {
    (
        prop::sample::select(vec!["gpt2", "gpt2", "llama", "bert"]),
        prop::collection::btree_set("[ab<>|▁é]{1,4}", 1..24),
        prop::option::weighted(0.2, "[ab<>|▁ ]{0,3}"),
        prop::collection::vec((0usize..24, 0usize..24, prop::bool::weighted(0.9)), 0..12),
        prop::option::weighted(0.2, "[ab ]{0,3}"),
        prop::collection::vec(prop::option::weighted(0.05, -1i32..8), 24),
        prop::option::of(0u32..30),
        any::<bool>(),
    )
        .prop_map(
            |(model, tokens, stray, pairs, bad_merge, types, eos, prefix)| {
                let mut tokens: Vec<String> = tokens.into_iter().collect();
                let mut merges = Vec::new();
                for (l, r, add_result) in pairs {
                    let (l, r) = (&tokens[l % tokens.len()], &tokens[r % tokens.len()]);
                    let (merge, result) = (format!("{l} {r}"), format!("{l}{r}"));
                    if add_result && !tokens.contains(&result) {
                        tokens.push(result);
                    }
                    merges.push(merge);
                }
                tokens.extend(stray);
                merges.extend(bad_merge);
                let types = (0..tokens.len())
                    .map(|i| types.get(i).copied().flatten().unwrap_or(1))
                    .collect();
                let scores = (0..tokens.len()).map(|i| -(i as f32)).collect();
                VocabSpec {
                    model: model.into(),
                    pre: None,
                    token_types: Some(types),
                    scores: Some(scores),
                    tokens,
                    merges: Some(merges),
                    eos,
                    add_space_prefix: prefix,
                    ..VocabSpec::default()
                }
            },
        )
}

#[test]
fn hostile_vocabularies_fail_with_typed_errors_not_panics() {
    let mut runner = TestRunner::new(ProptestConfig::with_cases(1000));
    let built = Cell::new(0usize);
    let inputs = (
        hostile_spec(),
        "[ab<>|▁ \u{4}é😀]{0,16}",
        prop::collection::vec(0u32..40, 0..8),
    );
    runner
        .run(&inputs, |(spec, text, ids)| {
            let Ok(tok) = Tokenizer::new(spec) else {
                return Ok(());
            };
            built.set(built.get() + 1);
            for parse_special in [false, true] {
                let options = EncodeOptions {
                    add_bos: false,
                    parse_special,
                };
                if let Ok(encoded) = tok.encode(&text, options) {
                    prop_assert!(encoded.iter().all(|&id| (id as usize) < tok.vocab_len()));
                }
            }
            let _ = tok.decode(&ids, RENDER);
            Ok(())
        })
        .unwrap();
    // A canary for the generator: if it stops producing valid vocabularies, this test
    // would only ever exercise the error paths.
    assert!(
        built.get() >= 100,
        "only {} vocabularies built",
        built.get()
    );
}
