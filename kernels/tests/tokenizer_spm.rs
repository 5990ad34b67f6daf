//! SentencePiece (`llama`) encoding and byte-level streaming on a hand-built vocabulary.
//!
//! No SentencePiece model ships with the repo, so the vocabulary is built here and
//! every expected id is worked out by hand in the comments (llama.cpp's
//! `llm_tokenizer_spm` rules: highest score merges first, leftmost on ties; only
//! pairs whose concatenation is a text token merge; leftovers fall back to bytes).

use bulkhead_kernels::tokenizer::{
    DecodeOptions, EncodeOptions, Tokenizer, TokenizerError, VocabSpec,
};

const UNK: u32 = 0;
const BOS: u32 = 1;
const EOS: u32 = 2;
/// `<0x00>` is id 3, so byte `b` is id `3 + b`.
const BYTE0: u32 = 3;
const SPACE: u32 = 259; // "▁"
const HELLO: u32 = 276;
const WOR: u32 = 274; // "▁wor"
const LD: u32 = 275;
const H_PREFIXED: u32 = 270; // "▁h"
const LT_S: u32 = 277; // "<s", a normal piece one merge away from the control "<s>"

const PLAIN: EncodeOptions = EncodeOptions {
    add_bos: false,
    parse_special: false,
};
const RENDER: DecodeOptions = DecodeOptions {
    skip_special: false,
};
const SKIP: DecodeOptions = DecodeOptions { skip_special: true };

fn byte(b: u8) -> u32 {
    BYTE0 + u32::from(b)
}

/// `<unk> <s> </s>`, the 256 byte tokens, then these pieces with their scores.
const PIECES: [(&str, f32); 19] = [
    ("▁", -1.0),     // 259
    ("h", -10.0),    // 260
    ("e", -10.0),    // 261
    ("l", -10.0),    // 262
    ("o", -10.0),    // 263
    ("w", -10.0),    // 264
    ("r", -10.0),    // 265
    ("d", -10.0),    // 266
    ("ll", -1.0),    // 267
    ("he", -2.0),    // 268
    ("hell", -3.0),  // 269
    ("▁h", -5.0),    // 270
    ("s", -10.0),    // 271
    ("▁w", -1.5),    // 272
    ("or", -2.5),    // 273
    ("▁wor", -1.8),  // 274
    ("ld", -2.2),    // 275
    ("hello", -0.5), // 276
    ("<s", -1.0),    // 277
];

fn spec() -> VocabSpec {
    let mut tokens = vec!["<unk>".to_owned(), "<s>".to_owned(), "</s>".to_owned()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0, 0.0, 0.0];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for (text, score) in PIECES {
        tokens.push(text.to_owned());
        types.push(1);
        scores.push(score);
    }
    VocabSpec {
        model: "llama".into(),
        tokens,
        token_types: Some(types),
        scores: Some(scores),
        bos: Some(BOS),
        eos: Some(EOS),
        unk: Some(UNK),
        add_bos: true,
        add_space_prefix: true,
        ..VocabSpec::default()
    }
}

fn tok() -> Tokenizer {
    Tokenizer::new(spec()).unwrap()
}

#[test]
fn merges_by_score_highest_first() {
    // "▁hello▁world": ll(-1), ▁w(-1.5), he(-2), ld(-2.2), or(-2.5), then ▁w+or=▁wor(-1.8),
    // he+ll=hell(-3), hell+o=hello(-0.5); ▁h(-5) is stale by then; "▁world" is no token.
    assert_eq!(
        tok().encode("hello world", PLAIN).unwrap(),
        [SPACE, HELLO, WOR, LD]
    );
}

#[test]
fn falls_back_to_byte_tokens_for_unknown_characters() {
    // "▁hi▁你": ▁h merges; 'i' and '你' (E4 BD A0) are not pieces.
    let ids = tok().encode("hi 你", PLAIN).unwrap();
    let want = [
        H_PREFIXED,
        byte(b'i'),
        SPACE,
        byte(0xE4),
        byte(0xBD),
        byte(0xA0),
    ];
    assert_eq!(ids, want);
    assert_eq!(tok().decode(&ids, RENDER).unwrap(), "hi 你");
}

#[test]
fn falls_back_to_unk_without_byte_tokens_and_errors_without_either() {
    let mut spec = spec();
    let types = spec.token_types.as_mut().unwrap();
    for t in &mut types[BYTE0 as usize..BYTE0 as usize + 256] {
        *t = 1; // The "<0xNN>" spellings become plain text pieces.
    }
    let with_unk = Tokenizer::new(spec.clone()).unwrap();
    assert_eq!(with_unk.encode("hi", PLAIN).unwrap(), [H_PREFIXED, UNK]);
    spec.unk = None;
    spec.token_types.as_mut().unwrap()[0] = 1;
    let without = Tokenizer::new(spec).unwrap();
    assert_eq!(
        without.encode("hi", PLAIN),
        Err(TokenizerError::UnencodableByte { byte: b'i' })
    );
}

#[test]
fn adds_space_prefix_only_when_the_vocab_says_so() {
    let mut spec = spec();
    spec.add_space_prefix = false;
    let tok = Tokenizer::new(spec).unwrap();
    // "hello▁world" has no leading ▁; "o▁" is no piece, so ▁w still merges.
    assert_eq!(tok.encode("hello world", PLAIN).unwrap(), [HELLO, WOR, LD]);
    assert_eq!(
        tok.decode(&[HELLO, WOR, LD], RENDER).unwrap(),
        "hello world"
    );
}

#[test]
fn encodes_empty_text_to_nothing() {
    assert_eq!(tok().encode("", PLAIN).unwrap(), Vec::<u32>::new());
    let bos = EncodeOptions {
        add_bos: true,
        parse_special: false,
    };
    assert_eq!(tok().encode("", bos).unwrap(), [BOS]);
}

#[test]
fn never_merges_user_text_into_a_control_token() {
    // "▁<s>hello": "<s"(-1) wins the tie with "ll"(-1) by position; "<s"+">" would be
    // the control "<s>", which text may not become, so ">" falls back to a byte.
    let ids = tok().encode("<s>hello", PLAIN).unwrap();
    assert_eq!(ids, [SPACE, LT_S, byte(b'>'), HELLO]);
    assert!(!ids.contains(&BOS));
}

#[test]
fn parses_control_tokens_from_templates_with_a_space_prefix_after_each() {
    let template = EncodeOptions {
        add_bos: false,
        parse_special: true,
    };
    let ids = tok().encode("<s>hello</s>", template).unwrap();
    assert_eq!(ids, [BOS, SPACE, HELLO, EOS]);
    assert_eq!(tok().decode(&ids, SKIP).unwrap(), "hello");
    assert_eq!(tok().decode(&ids, RENDER).unwrap(), "<s> hello</s>");
    assert!(tok().is_eog(EOS) && !tok().is_eog(BOS));
}

#[test]
fn strips_only_the_first_leading_space_when_decoding() {
    let tok = tok();
    assert_eq!(
        tok.decode(&[SPACE, SPACE, HELLO], RENDER).unwrap(),
        " hello"
    );
    assert_eq!(tok.decode(&[BOS, SPACE, HELLO], SKIP).unwrap(), "hello");
}

#[test]
fn streams_a_character_split_over_byte_tokens_only_once_complete() {
    let tok = tok();
    let mut d = tok.detokenizer(RENDER);
    assert_eq!(d.push(byte(0xE4)).unwrap(), "");
    assert_eq!(d.push(byte(0xBD)).unwrap(), "");
    assert_eq!(d.pending_bytes(), 2);
    assert_eq!(d.push(byte(0xA0)).unwrap(), "你");
    for b in [0xF0, 0x9F, 0x98] {
        assert_eq!(d.push(byte(b)).unwrap(), "");
    }
    assert_eq!(d.push(byte(0x80)).unwrap(), "😀");
    assert_eq!(d.pending_bytes(), 0);
    assert_eq!(d.finish(), "");
}

#[test]
fn replaces_only_provably_invalid_bytes() {
    let tok = tok();
    let mut d = tok.detokenizer(RENDER);
    // 0xFF can never start a character: replaced at once.
    assert_eq!(d.push(byte(0xFF)).unwrap(), "\u{FFFD}");
    // 0xE4 might still complete: held back until 'hello' proves it cannot.
    assert_eq!(d.push(byte(0xE4)).unwrap(), "");
    assert_eq!(d.push(HELLO).unwrap(), "\u{FFFD}hello");
    // Bytes still incomplete when the stream ends are replaced by `finish`.
    assert_eq!(d.push(byte(0xF0)).unwrap(), "");
    assert_eq!(d.push(byte(0x9F)).unwrap(), "");
    assert_eq!(d.finish(), "\u{FFFD}");
}

#[test]
fn decode_agrees_with_from_utf8_lossy_on_arbitrary_bytes() {
    let tok = tok();
    let raw: Vec<u8> = vec![
        0xC0, 0x80, b'a', 0xED, 0xA0, 0x80, 0xF4, 0x90, 0xE2, 0x82, b'z',
    ];
    let ids: Vec<u32> = raw.iter().map(|&b| byte(b)).collect();
    assert_eq!(
        tok.decode(&ids, RENDER).unwrap(),
        String::from_utf8_lossy(&raw)
    );
}

#[test]
fn rejects_ids_outside_the_vocab_when_streaming_without_losing_state() {
    let tok = tok();
    let mut d = tok.detokenizer(RENDER);
    assert_eq!(d.push(byte(0xE4)).unwrap(), "");
    let past_end = tok.vocab_len() as u32;
    assert!(matches!(
        d.push(past_end),
        Err(TokenizerError::UnknownTokenId { .. })
    ));
    assert_eq!(d.push(byte(0xBD)).unwrap(), "");
    assert_eq!(d.push(byte(0xA0)).unwrap(), "你");
}

#[test]
fn text_bytes_per_token_max_bounds_the_token_count_from_below() {
    let tok = Tokenizer::new(spec()).unwrap();
    // "hello" (5 bytes) and "▁wor" (6 bytes escaped) are the longest pieces.
    assert_eq!(tok.text_bytes_per_token_max(), 6);
    for text in [
        "hello world",
        "hellohellohello",
        "  wor  wor",
        "ŧ€xt ☃",
        "",
        "h",
    ] {
        let ids = tok.encode(text, PLAIN).unwrap();
        assert!(ids.len() * 6 >= text.len(), "{text:?}: {ids:?}");
    }
}
