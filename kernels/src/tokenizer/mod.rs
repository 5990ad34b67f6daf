//! Tokenizers built from GGUF tokenizer metadata, given as plain data ([`VocabSpec`]).
//!
//! Lifecycle:
//!
//! 1. [`Tokenizer::new`] validates the whole vocabulary up front (lengths, ids, types,
//!    duplicates, merges, limits) and returns a typed error rather than panicking on a
//!    hostile file. After that, encoding and decoding cannot fail on vocabulary shape.
//! 2. [`Tokenizer::encode`] first splits out special tokens (only when
//!    [`EncodeOptions::parse_special`] is set), then encodes each text fragment with the
//!    model: byte-level BPE (`gpt2`, `bpe` after `pretokenize`) or SentencePiece
//!    (`llama`, `spm`).
//! 3. [`Tokenizer::decode`] and the streaming [`Detokenizer`] turn ids back into text,
//!    never splitting a UTF-8 character.
//!
//! Invariants:
//!
//! - Control and user-defined tokens (`<|im_start|>`, `<|endoftext|>`, …) come out of
//!   `encode` only from [`EncodeOptions::parse_special`] splitting, which a caller
//!   enables for text it rendered itself (a chat template) and never for user content.
//!   Merges that would produce a control token are dropped at construction, and
//!   SentencePiece merges only into text tokens, so user text cannot spell one.
//!   (llama.cpp always splits user-defined tokens out of text; we do not.)
//! - Every token id handed out is `< vocab_len()`; every id taken in is checked.
//! - Inputs are bounded: [`TEXT_BYTES_MAX`] per encode call, [`VOCAB_TOKENS_MAX`]
//!   tokens, [`TOKEN_BYTES_MAX`] bytes per token, [`MERGES_MAX`] merges.

mod bpe;
mod detokenize;
mod from_gguf;
mod pretokenize;
mod spm;

use std::collections::HashMap;

pub use detokenize::Detokenizer;
pub use from_gguf::LoadError;

use bpe::BytePairs;
use pretokenize::PreTokenizer;
use spm::{SentencePiece, SPACE_MARK};

/// Longest text one [`Tokenizer::encode`] call accepts, in bytes.
pub const TEXT_BYTES_MAX: usize = 4 << 20;
/// Most tokens a vocabulary may have (the largest real ones have about 262k).
pub const VOCAB_TOKENS_MAX: usize = 1 << 20;
/// Longest token spelling, in bytes.
pub const TOKEN_BYTES_MAX: usize = 4096;
/// Most BPE merges a vocabulary may have.
pub const MERGES_MAX: usize = VOCAB_TOKENS_MAX;

const _: () = assert!(VOCAB_TOKENS_MAX < u32::MAX as usize);
const _: () = assert!(TEXT_BYTES_MAX < u32::MAX as usize);

/// End-of-generation markers recognised by name, besides the EOS id.
const EOG_NAMES: [&str; 6] = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
];

/// Tokenizer metadata as stored in a GGUF file (`tokenizer.ggml.*`).
#[derive(Clone, Debug, Default)]
pub struct VocabSpec {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: pre-tokenizer name for `gpt2` (`None` means `"default"`).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`, indexed by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined,
    /// 5 unused, 6 byte). Absent: all normal, except BOS/EOS/PAD control and UNK unknown.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.scores` (required for `llama`).
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.merges`, `"left right"` in rank order (required for `gpt2`).
    pub merges: Option<Vec<String>>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`: the model's preference, see [`Tokenizer::add_bos`].
    pub add_bos: bool,
    /// `tokenizer.ggml.add_space_prefix` (SentencePiece only).
    pub add_space_prefix: bool,
}

/// A token's role (GGUF `tokenizer.ggml.token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    /// Ordinary text (GGUF 1, and 0 "undefined").
    Normal,
    /// The unknown token (2).
    Unknown,
    /// Control tokens such as `<|im_start|>` (3).
    Control,
    /// Added tokens such as tool markers (4).
    UserDefined,
    /// Reserved, never produced (5).
    Unused,
    /// SentencePiece byte fallback `<0xNN>` (6).
    Byte,
}

impl TokenType {
    fn from_gguf(value: i32) -> Option<TokenType> {
        Some(match value {
            0 | 1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }

    /// Tokens that ordinary text may be merged into.
    fn is_text(self) -> bool {
        matches!(self, TokenType::Normal | TokenType::UserDefined)
    }

    /// Tokens split out of text by `parse_special`.
    fn is_parsed_special(self) -> bool {
        matches!(self, TokenType::Control | TokenType::UserDefined)
    }

    /// Tokens that [`DecodeOptions::skip_special`] leaves out.
    fn is_skippable(self) -> bool {
        matches!(
            self,
            TokenType::Control | TokenType::Unknown | TokenType::Unused
        )
    }
}

/// How to encode one text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Prepend the BOS token (error if the vocabulary has none).
    pub add_bos: bool,
    /// Split control and user-defined token spellings out as single tokens. Only for
    /// text the server rendered itself; never for user content.
    pub parse_special: bool,
}

/// How to decode ids.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Leave out control, unknown and unused tokens instead of rendering their text.
    pub skip_special: bool,
}

/// Everything that can go wrong building or using a tokenizer.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum TokenizerError {
    /// `tokenizer.ggml.model` is neither `gpt2` nor `llama`.
    #[error("unsupported tokenizer model {0:?}")]
    UnknownModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer we do not implement.
    #[error("unsupported pre-tokenizer {0:?}")]
    UnknownPreTokenizer(String),
    /// No tokens at all.
    #[error("vocabulary is empty")]
    EmptyVocab,
    /// More than [`VOCAB_TOKENS_MAX`] tokens.
    #[error("vocabulary has {count} tokens, more than {max}")]
    VocabTooLarge {
        /// Tokens in the spec.
        count: usize,
        /// [`VOCAB_TOKENS_MAX`].
        max: usize,
    },
    /// A token spelled as the empty string.
    #[error("token {id} is empty")]
    EmptyToken {
        /// The token.
        id: u32,
    },
    /// A token longer than [`TOKEN_BYTES_MAX`].
    #[error("token {id} is {bytes} bytes, more than {max}")]
    TokenTooLong {
        /// The token.
        id: u32,
        /// Its length.
        bytes: usize,
        /// [`TOKEN_BYTES_MAX`].
        max: usize,
    },
    /// Two ids with the same spelling.
    #[error("token {id} has the same text as token {first}")]
    DuplicateToken {
        /// The later id.
        id: u32,
        /// The earlier id.
        first: u32,
    },
    /// A per-token array whose length differs from the token list.
    #[error("{field} has {len} entries but the vocabulary has {vocab_len} tokens")]
    LengthMismatch {
        /// `token_types` or `scores`.
        field: &'static str,
        /// Its length.
        len: usize,
        /// Tokens in the vocabulary.
        vocab_len: usize,
    },
    /// A token type outside 0..=6.
    #[error("token {id} has invalid type {value}")]
    InvalidTokenType {
        /// The token.
        id: u32,
        /// The stored type.
        value: i32,
    },
    /// A NaN score.
    #[error("token {id} has a NaN score")]
    InvalidScore {
        /// The token.
        id: u32,
    },
    /// A byte-type token not spelled `<0xNN>`.
    #[error("byte token {id} is not spelled <0xNN>")]
    MalformedByteToken {
        /// The token.
        id: u32,
    },
    /// A BOS/EOS/UNK/PAD id outside the vocabulary.
    #[error("{role} token id {id} is outside the vocabulary of {vocab_len}")]
    SpecialIdOutOfRange {
        /// `bos`, `eos`, `unk` or `pad`.
        role: &'static str,
        /// The id.
        id: u32,
        /// Tokens in the vocabulary.
        vocab_len: usize,
    },
    /// `gpt2` without `tokenizer.ggml.merges`.
    #[error("byte-level BPE vocabulary has no merges")]
    MissingMerges,
    /// `llama` without `tokenizer.ggml.scores`.
    #[error("SentencePiece vocabulary has no scores")]
    MissingScores,
    /// More than [`MERGES_MAX`] merges.
    #[error("{count} merges, more than {max}")]
    TooManyMerges {
        /// Merges in the spec.
        count: usize,
        /// [`MERGES_MAX`].
        max: usize,
    },
    /// A merge that is not two non-empty tokens separated by one space.
    #[error("merge {index} {merge:?} is not two tokens separated by a space")]
    MalformedMerge {
        /// Its rank.
        index: usize,
        /// Its text.
        merge: String,
    },
    /// A merge whose parts or result are not tokens.
    #[error("merge {index} {merge:?} names a token that is not in the vocabulary")]
    MergeTokenMissing {
        /// Its rank.
        index: usize,
        /// Its text.
        merge: String,
    },
    /// Text longer than [`TEXT_BYTES_MAX`].
    #[error("text is {bytes} bytes, more than {max}")]
    TextTooLong {
        /// Its length.
        bytes: usize,
        /// [`TEXT_BYTES_MAX`].
        max: usize,
    },
    /// The text has more tokens than the caller's budget (`encode_into`).
    #[error("text has more than {max} tokens")]
    TooManyTokens {
        /// The budget.
        max: usize,
    },
    /// The caller asked to stop (`encode_into_until`).
    #[error("tokenizing was stopped by its caller")]
    Stopped,
    /// SentencePiece text with a byte that has neither a byte token nor UNK.
    #[error("no token for byte {byte:#04x} and no unknown token")]
    UnencodableByte {
        /// The byte.
        byte: u8,
    },
    /// [`EncodeOptions::add_bos`] with a vocabulary that has no BOS.
    #[error("BOS requested but the vocabulary has none")]
    MissingBos,
    /// A token id outside the vocabulary passed to decode.
    #[error("token id {id} is outside the vocabulary of {vocab_len}")]
    UnknownTokenId {
        /// The id.
        id: u32,
        /// Tokens in the vocabulary.
        vocab_len: usize,
    },
    /// The pre-tokenizer's regex failed (compilation or a match limit).
    #[error("pre-tokenizer regex: {0}")]
    Regex(String),
}

/// The merge algorithm and its tables (boxed: the byte tables are a few KiB).
#[derive(Debug)]
enum Model {
    BytePairs {
        bpe: Box<BytePairs>,
        pre: PreTokenizer,
    },
    SentencePiece {
        spm: Box<SentencePiece>,
        scores: Vec<f32>,
        add_space_prefix: bool,
    },
}

/// Special-token spellings indexed by first byte, longest first (leftmost-longest
/// matching, as HF's added-token splitter does).
#[derive(Debug)]
struct Specials {
    by_first_byte: Vec<Vec<u32>>,
}

/// A text or an already-resolved special token, in input order.
enum Fragment<'t> {
    Text(&'t str),
    Special(u32),
}

/// An immutable tokenizer; cheap to share across threads.
#[derive(Debug)]
pub struct Tokenizer {
    model: Model,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    ids: HashMap<String, u32>,
    // [token][rendered byte]: rendered bytes of token `i` are
    // `piece_bytes[piece_starts[i]..piece_starts[i + 1]]`.
    piece_bytes: Vec<u8>,
    piece_starts: Vec<usize>,
    specials: Specials,
    eog: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    text_bytes_per_token_max: usize,
}

impl Tokenizer {
    /// Validates `spec` and builds the tokenizer (module doc, lifecycle 1).
    pub fn new(spec: VocabSpec) -> Result<Tokenizer, TokenizerError> {
        let VocabSpec {
            model,
            pre,
            tokens,
            token_types,
            scores,
            merges,
            bos,
            eos,
            unk,
            pad,
            add_bos,
            add_space_prefix,
        } = spec;
        let vocab_len = tokens.len();
        check_tokens(&tokens)?;
        for (role, id) in [("bos", bos), ("eos", eos), ("unk", unk), ("pad", pad)] {
            if let Some(id) = id.filter(|&id| id as usize >= vocab_len) {
                return Err(TokenizerError::SpecialIdOutOfRange {
                    role,
                    id,
                    vocab_len,
                });
            }
        }
        let types = token_types_of(token_types, vocab_len, [bos, eos, pad], unk)?;
        let ids = index_tokens(&tokens)?;
        let model = build_model(
            &model,
            ModelData {
                pre,
                merges,
                scores,
                unk,
                add_space_prefix,
            },
            &tokens,
            &types,
            &ids,
        )?;
        let (piece_bytes, piece_starts) = render_pieces(&model, &tokens, &types);
        let text_bytes_per_token_max = text_bytes_per_token_max(&tokens, &types, &piece_starts);
        let specials = Specials::new(&tokens, &types);
        let mut eog: Vec<u32> = EOG_NAMES
            .iter()
            .filter_map(|name| ids.get(*name).copied())
            .filter(|&id| types[id as usize].is_parsed_special())
            .chain(eos)
            .collect();
        eog.sort_unstable();
        eog.dedup();
        Ok(Tokenizer {
            model,
            tokens,
            types,
            ids,
            piece_bytes,
            piece_starts,
            specials,
            eog,
            bos,
            eos,
            add_bos,
            text_bytes_per_token_max,
        })
    }

    /// The most bytes of plain text (no special tokens parsed) that one token
    /// can cover, so `ceil(text.len() / this)` is a lower bound on the tokens
    /// `encode` makes of it: an oversized prompt can be refused by its size
    /// alone, before any tokenization work. Every token `encode` emits for text
    /// is a text token (whose spelling, in its model's escaped or byte-mapped
    /// form, covers no more input bytes than the longer of its spelling and its
    /// rendering), a byte token or the unknown token (one byte each).
    pub fn text_bytes_per_token_max(&self) -> usize {
        self.text_bytes_per_token_max
    }

    /// Encodes `text` (module doc, lifecycle 2).
    pub fn encode(&self, text: &str, options: EncodeOptions) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len().min(TEXT_BYTES_MAX) / 3 + 2);
        self.encode_into(text, options, usize::MAX, &mut out)?;
        Ok(out)
    }

    /// Appends the tokens of `text` to `out`, and stops with
    /// [`TokenizerError::TooManyTokens`] as soon as `out` holds more than
    /// `tokens_max` (checked after each pre-tokenized word, so the work done on
    /// a text too long for its budget is bounded by the budget, not the text,
    /// and after the BOS, which a text with no fragment at all still adds).
    pub fn encode_into(
        &self,
        text: &str,
        options: EncodeOptions,
        tokens_max: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        self.encode_into_until(text, options, tokens_max, out, &|| false)
    }

    /// [`Tokenizer::encode_into`], which also stops with
    /// [`TokenizerError::Stopped`] once `stopped` says so (asked where the
    /// budget is checked: after each pre-tokenized word): a server stops
    /// tokenizing the prompt of a request whose client has left.
    pub fn encode_into_until(
        &self,
        text: &str,
        options: EncodeOptions,
        tokens_max: usize,
        out: &mut Vec<u32>,
        stopped: &dyn Fn() -> bool,
    ) -> Result<(), TokenizerError> {
        if text.len() > TEXT_BYTES_MAX {
            return Err(TokenizerError::TextTooLong {
                bytes: text.len(),
                max: TEXT_BYTES_MAX,
            });
        }
        if options.add_bos {
            out.push(self.bos.ok_or(TokenizerError::MissingBos)?);
            // An empty text has no fragment, so the loop below would never
            // look: the BOS alone can be over the budget (found by fuzzing,
            // fuzz/regressions/tokenizer/).
            if out.len() > tokens_max {
                return Err(TokenizerError::TooManyTokens { max: tokens_max });
            }
        }
        let mut after_special = true;
        for fragment in self.fragments(text, options.parse_special) {
            match fragment {
                Fragment::Special(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(part) => {
                    self.encode_fragment(part, after_special, tokens_max, out, stopped)?;
                    after_special = false;
                }
            }
            if out.len() > tokens_max {
                return Err(TokenizerError::TooManyTokens { max: tokens_max });
            }
            if stopped() {
                return Err(TokenizerError::Stopped);
            }
        }
        Ok(())
    }

    /// Splits the words byte-level BPE would merge; their concatenation is `text`.
    /// Empty for SentencePiece, which has no pre-tokenizer. For diagnostics and tests.
    pub fn pre_tokenize<'t>(&self, text: &'t str) -> Result<Vec<&'t str>, TokenizerError> {
        let mut words = Vec::new();
        if let Model::BytePairs { pre, .. } = &self.model {
            pre.split(text, &mut words)?;
        }
        Ok(words)
    }

    /// Decodes `ids` to text; invalid UTF-8 becomes U+FFFD. Same result as pushing
    /// every id through a [`Detokenizer`] and finishing it.
    pub fn decode(&self, ids: &[u32], options: DecodeOptions) -> Result<String, TokenizerError> {
        let mut detokenizer = self.detokenizer(options);
        let mut text = String::new();
        for &id in ids {
            text.push_str(&detokenizer.push(id)?);
        }
        text.push_str(&detokenizer.finish());
        Ok(text)
    }

    /// A streaming decoder for generated ids.
    pub fn detokenizer(&self, options: DecodeOptions) -> Detokenizer<&Tokenizer> {
        Detokenizer::new(self, options)
    }

    /// The bytes `id` renders as, special tokens included (their spelling).
    pub fn token_to_piece_bytes(&self, id: u32) -> Result<&[u8], TokenizerError> {
        let index = self.check_id(id)?;
        Ok(&self.piece_bytes[self.piece_starts[index]..self.piece_starts[index + 1]])
    }

    /// The token's spelling as stored in the vocabulary.
    pub fn token_text(&self, id: u32) -> Result<&str, TokenizerError> {
        Ok(&self.tokens[self.check_id(id)?])
    }

    /// The token's type.
    pub fn token_type(&self, id: u32) -> Result<TokenType, TokenizerError> {
        Ok(self.types[self.check_id(id)?])
    }

    /// The id of the token spelled exactly `text` (vocabulary spelling).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// Number of tokens; every valid id is below it.
    pub fn vocab_len(&self) -> usize {
        self.tokens.len()
    }

    /// The BOS token, if any.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The EOS token, if any.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Whether the model asks for BOS at the start of a prompt.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// End of generation: EOS, or a control token such as `<|im_end|>`,
    /// `<|endoftext|>` or `<|eot_id|>` present in this vocabulary.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// Every end-of-generation token ([`Tokenizer::is_eog`]), ascending.
    pub fn eog_tokens(&self) -> &[u32] {
        &self.eog
    }

    fn check_id(&self, id: u32) -> Result<usize, TokenizerError> {
        let index = id as usize;
        if index < self.tokens.len() {
            Ok(index)
        } else {
            Err(TokenizerError::UnknownTokenId {
                id,
                vocab_len: self.tokens.len(),
            })
        }
    }

    /// The bytes `id` contributes to decoded text under `options`.
    fn rendered_bytes(&self, id: u32, options: DecodeOptions) -> Result<&[u8], TokenizerError> {
        let bytes = self.token_to_piece_bytes(id)?;
        if options.skip_special && self.types[id as usize].is_skippable() {
            return Ok(&[]);
        }
        Ok(bytes)
    }

    fn strips_leading_space(&self) -> bool {
        matches!(
            self.model,
            Model::SentencePiece {
                add_space_prefix: true,
                ..
            }
        )
    }

    fn fragments<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut fragments = Vec::new();
        if !parse_special {
            // Empty text is no fragment: SentencePiece would otherwise emit a lone `▁`.
            if !text.is_empty() {
                fragments.push(Fragment::Text(text));
            }
            return fragments;
        }
        let bytes = text.as_bytes();
        let (mut text_start, mut pos) = (0, 0);
        while pos < bytes.len() {
            let Some(id) = self.specials.match_at(&self.tokens, bytes, pos) else {
                pos += 1;
                continue;
            };
            // A spelling is valid UTF-8, so a match starts and ends on char boundaries.
            if pos > text_start {
                fragments.push(Fragment::Text(&text[text_start..pos]));
            }
            fragments.push(Fragment::Special(id));
            pos += self.tokens[id as usize].len();
            text_start = pos;
        }
        if text_start < bytes.len() {
            fragments.push(Fragment::Text(&text[text_start..]));
        }
        fragments
    }

    fn encode_fragment(
        &self,
        text: &str,
        after_special: bool,
        tokens_max: usize,
        out: &mut Vec<u32>,
        stopped: &dyn Fn() -> bool,
    ) -> Result<(), TokenizerError> {
        match &self.model {
            Model::BytePairs { bpe, pre } => {
                let mut words = Vec::new();
                pre.split(text, &mut words)?;
                let whole_word = pre.ignore_merges.then_some(&self.ids);
                let mut scratch = bpe::Scratch::default();
                for word in words {
                    bpe.encode_word(word, whole_word, &mut scratch, out);
                    if out.len() > tokens_max {
                        return Err(TokenizerError::TooManyTokens { max: tokens_max });
                    }
                    if stopped() {
                        return Err(TokenizerError::Stopped);
                    }
                }
                Ok(())
            }
            Model::SentencePiece {
                spm,
                scores,
                add_space_prefix,
            } => {
                // llama.cpp adds the space prefix at the start and after each special.
                let prefix = *add_space_prefix && after_special;
                let mut escaped = String::with_capacity(text.len() + 3);
                if prefix {
                    escaped.push(SPACE_MARK);
                }
                escaped.extend(text.chars().map(|c| if c == ' ' { SPACE_MARK } else { c }));
                spm.encode(&escaped, &self.ids, &self.types, scores, out)
            }
        }
    }
}

impl Specials {
    fn new(tokens: &[String], types: &[TokenType]) -> Specials {
        let mut by_first_byte = vec![Vec::new(); 256];
        for (id, (text, ty)) in tokens.iter().zip(types).enumerate() {
            if let (true, Some(&first)) = (ty.is_parsed_special(), text.as_bytes().first()) {
                // The vocabulary length was checked against VOCAB_TOKENS_MAX.
                by_first_byte[first as usize].push(id as u32);
            }
        }
        for candidates in &mut by_first_byte {
            candidates.sort_by_key(|&id| std::cmp::Reverse(tokens[id as usize].len()));
        }
        Specials { by_first_byte }
    }

    fn match_at(&self, tokens: &[String], text: &[u8], pos: usize) -> Option<u32> {
        let candidates = &self.by_first_byte[text[pos] as usize];
        candidates
            .iter()
            .copied()
            .find(|&id| text[pos..].starts_with(tokens[id as usize].as_bytes()))
    }
}

/// The parts of a [`VocabSpec`] only one model kind uses.
struct ModelData {
    pre: Option<String>,
    merges: Option<Vec<String>>,
    scores: Option<Vec<f32>>,
    unk: Option<u32>,
    add_space_prefix: bool,
}

fn build_model(
    model: &str,
    data: ModelData,
    tokens: &[String],
    types: &[TokenType],
    ids: &HashMap<String, u32>,
) -> Result<Model, TokenizerError> {
    match model {
        "gpt2" => {
            let merges = data.merges.ok_or(TokenizerError::MissingMerges)?;
            if merges.len() > MERGES_MAX {
                return Err(TokenizerError::TooManyMerges {
                    count: merges.len(),
                    max: MERGES_MAX,
                });
            }
            let pre = PreTokenizer::for_name(data.pre.as_deref())?;
            let bpe = Box::new(BytePairs::new(ids, types, &merges)?);
            Ok(Model::BytePairs { bpe, pre })
        }
        "llama" => {
            let scores = data.scores.ok_or(TokenizerError::MissingScores)?;
            check_scores(&scores, tokens.len())?;
            let spm = Box::new(SentencePiece::new(tokens, types, data.unk)?);
            Ok(Model::SentencePiece {
                spm,
                scores,
                add_space_prefix: data.add_space_prefix,
            })
        }
        other => Err(TokenizerError::UnknownModel(other.to_owned())),
    }
}

fn check_tokens(tokens: &[String]) -> Result<(), TokenizerError> {
    if tokens.is_empty() {
        return Err(TokenizerError::EmptyVocab);
    }
    if tokens.len() > VOCAB_TOKENS_MAX {
        return Err(TokenizerError::VocabTooLarge {
            count: tokens.len(),
            max: VOCAB_TOKENS_MAX,
        });
    }
    for (id, text) in (0u32..).zip(tokens) {
        if text.is_empty() {
            return Err(TokenizerError::EmptyToken { id });
        }
        if text.len() > TOKEN_BYTES_MAX {
            return Err(TokenizerError::TokenTooLong {
                id,
                bytes: text.len(),
                max: TOKEN_BYTES_MAX,
            });
        }
    }
    Ok(())
}

fn index_tokens(tokens: &[String]) -> Result<HashMap<String, u32>, TokenizerError> {
    let mut ids = HashMap::with_capacity(tokens.len());
    for (id, text) in (0u32..).zip(tokens) {
        if let Some(&first) = ids.get(text.as_str()) {
            return Err(TokenizerError::DuplicateToken { id, first });
        }
        ids.insert(text.clone(), id);
    }
    Ok(ids)
}

/// Token types from the spec, or the defaults described on [`VocabSpec::token_types`].
fn token_types_of(
    raw: Option<Vec<i32>>,
    vocab_len: usize,
    control: [Option<u32>; 3],
    unk: Option<u32>,
) -> Result<Vec<TokenType>, TokenizerError> {
    let Some(raw) = raw else {
        let mut types = vec![TokenType::Normal; vocab_len];
        for id in control.into_iter().flatten() {
            types[id as usize] = TokenType::Control;
        }
        if let Some(id) = unk {
            types[id as usize] = TokenType::Unknown;
        }
        return Ok(types);
    };
    if raw.len() != vocab_len {
        return Err(TokenizerError::LengthMismatch {
            field: "token_types",
            len: raw.len(),
            vocab_len,
        });
    }
    (0u32..)
        .zip(raw)
        .map(|(id, value)| {
            TokenType::from_gguf(value).ok_or(TokenizerError::InvalidTokenType { id, value })
        })
        .collect()
}

fn check_scores(scores: &[f32], vocab_len: usize) -> Result<(), TokenizerError> {
    if scores.len() != vocab_len {
        return Err(TokenizerError::LengthMismatch {
            field: "scores",
            len: scores.len(),
            vocab_len,
        });
    }
    match (0u32..).zip(scores).find(|(_, s)| s.is_nan()) {
        Some((id, _)) => Err(TokenizerError::InvalidScore { id }),
        None => Ok(()),
    }
}

/// What each token renders as when decoded, flattened (see `Tokenizer::piece_bytes`).
fn text_bytes_per_token_max(
    tokens: &[String],
    types: &[TokenType],
    piece_starts: &[usize],
) -> usize {
    tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| types[*i].is_text())
        .map(|(i, text)| text.len().max(piece_starts[i + 1] - piece_starts[i]))
        .max()
        .unwrap_or(1)
        .max(1)
}

fn render_pieces(model: &Model, tokens: &[String], types: &[TokenType]) -> (Vec<u8>, Vec<usize>) {
    let char_to_byte = bpe::char_to_byte();
    let mut bytes = Vec::with_capacity(tokens.iter().map(String::len).sum());
    let mut starts = Vec::with_capacity(tokens.len() + 1);
    for (text, ty) in tokens.iter().zip(types) {
        starts.push(bytes.len());
        match (model, ty) {
            (Model::BytePairs { .. }, TokenType::Normal) => {
                bytes.extend(bpe::spelling_to_bytes(text, &char_to_byte));
            }
            (Model::SentencePiece { .. }, TokenType::Normal) => {
                bytes.extend(text.replace(SPACE_MARK, " ").as_bytes());
            }
            (_, TokenType::Byte) => match spm::parse_byte_token(text) {
                Some(byte) => bytes.push(byte),
                None => bytes.extend_from_slice(text.as_bytes()),
            },
            _ => bytes.extend_from_slice(text.as_bytes()),
        }
    }
    starts.push(bytes.len());
    (bytes, starts)
}
