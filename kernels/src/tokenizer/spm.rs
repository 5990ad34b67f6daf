//! SentencePiece-style (`llama`) vocabularies: score-driven merging with byte fallback.
//!
//! This follows llama.cpp's `llm_tokenizer_spm`:
//!
//! 1. The caller escapes spaces as `▁` (and prefixes one when `add_space_prefix` says
//!    so); every character starts as its own symbol.
//! 2. Every adjacent pair whose concatenation is a text token (normal or user-defined)
//!    is a candidate bigram keyed by that token's score. The highest score merges
//!    first, the leftmost on ties; candidates whose symbols changed are skipped.
//! 3. A final symbol that is a token is emitted; one that is not (a character the
//!    vocabulary lacks) is emitted byte by byte as `<0xNN>` tokens, or as the unknown
//!    token where the vocabulary has no byte tokens.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::{TokenType, TokenizerError};

/// SentencePiece's visible space.
pub(super) const SPACE_MARK: char = '\u{2581}';

/// Parses a byte token spelling `<0xNN>`.
pub(super) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// SentencePiece tables.
#[derive(Debug)]
pub(super) struct SentencePiece {
    byte_tokens: [Option<u32>; 256],
    unk: Option<u32>,
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// Max-heap order: higher score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// The state of one encode call: the escaped text, its symbols and candidates.
struct Session<'a> {
    text: &'a str,
    ids: &'a HashMap<String, u32>,
    types: &'a [TokenType],
    scores: &'a [f32],
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Bigram>,
}

impl SentencePiece {
    /// Finds the byte tokens (type byte, spelled `<0xNN>`).
    pub(super) fn new(
        tokens: &[String],
        types: &[TokenType],
        unk: Option<u32>,
    ) -> Result<SentencePiece, TokenizerError> {
        let mut byte_tokens = [None; 256];
        for (id, (text, ty)) in tokens.iter().zip(types).enumerate() {
            if *ty != TokenType::Byte {
                continue;
            }
            // Vocabulary length is checked against VOCAB_TOKENS_MAX before this runs.
            let id = id as u32;
            let byte = parse_byte_token(text).ok_or(TokenizerError::MalformedByteToken { id })?;
            byte_tokens[byte as usize].get_or_insert(id);
        }
        Ok(SentencePiece { byte_tokens, unk })
    }

    /// Appends the ids of `escaped` (spaces already `▁`) to `out`.
    pub(super) fn encode(
        &self,
        escaped: &str,
        ids: &HashMap<String, u32>,
        types: &[TokenType],
        scores: &[f32],
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let mut session = Session {
            text: escaped,
            ids,
            types,
            scores,
            symbols: Vec::with_capacity(escaped.len()),
            heap: BinaryHeap::new(),
        };
        session.load();
        session.merge();
        let mut pos = if session.symbols.is_empty() { NONE } else { 0 };
        while pos != NONE {
            let s = session.symbols[pos];
            let piece = &escaped[s.start..s.start + s.len];
            match session.text_token(piece) {
                Some(id) => out.push(id),
                None => self.fall_back(piece, out)?,
            }
            pos = s.next;
        }
        Ok(())
    }

    fn fall_back(&self, piece: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        for byte in piece.bytes() {
            let id = self.byte_tokens[byte as usize]
                .or(self.unk)
                .ok_or(TokenizerError::UnencodableByte { byte })?;
            out.push(id);
        }
        Ok(())
    }
}

impl Session<'_> {
    fn text_token(&self, piece: &str) -> Option<u32> {
        let id = *self.ids.get(piece)?;
        self.types[id as usize].is_text().then_some(id)
    }

    fn load(&mut self) {
        let count = self.text.chars().count();
        for (index, (start, c)) in self.text.char_indices().enumerate() {
            self.symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: index.wrapping_sub(1),
                next: if index + 1 == count { NONE } else { index + 1 },
            });
        }
        for right in 1..self.symbols.len() {
            self.try_add_bigram(right - 1, right);
        }
    }

    fn try_add_bigram(&mut self, left: usize, right: usize) {
        let (l, r) = (self.symbols[left], self.symbols[right]);
        let len = l.len + r.len;
        if let Some(id) = self.text_token(&self.text[l.start..l.start + len]) {
            self.heap.push(Bigram {
                score: self.scores[id as usize],
                left,
                right,
                len,
            });
        }
    }

    fn merge(&mut self) {
        while let Some(bigram) = self.heap.pop() {
            let (l, r) = (self.symbols[bigram.left], self.symbols[bigram.right]);
            // Skip candidates whose symbols were merged away or grew since.
            if l.len == 0 || r.len == 0 || l.len + r.len != bigram.len || l.next != bigram.right {
                continue;
            }
            self.symbols[bigram.left].len = bigram.len;
            self.symbols[bigram.left].next = r.next;
            self.symbols[bigram.right].len = 0;
            if r.next != NONE {
                self.symbols[r.next].prev = bigram.left;
                self.try_add_bigram(bigram.left, r.next);
            }
            if l.prev != NONE {
                self.try_add_bigram(l.prev, bigram.left);
            }
        }
    }
}
