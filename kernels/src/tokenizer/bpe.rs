//! GPT-2 byte-level BPE: bytes map to printable characters, merges apply by rank.
//!
//! 1. Construction maps every byte to its byte-level character (GPT-2's
//!    `bytes_to_unicode`) and the token that spells it, and parses `"a b"` merges into
//!    `(left id, right id) -> (rank, merged id)`. A merge naming a token that is not in
//!    the vocabulary is an error, as in HF `tokenizers`.
//! 2. Encoding a word starts from one symbol per byte and repeatedly merges the adjacent
//!    pair with the lowest rank, leftmost first (a binary heap of candidate pairs; stale
//!    candidates are skipped when popped). This is HF's `Word::merge_all` without
//!    dropout, and gives the same result as GPT-2's reference loop.
//! 3. A byte with no token is dropped, as HF and llama.cpp both do (e.g. SmolLM2 has no
//!    token for the control byte 0x04).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::{TokenType, TokenizerError};

/// Characters that GPT-2's byte-level alphabet maps bytes onto: U+0000..U+0143.
const BYTE_CHARS_LEN: usize = 0x144;

/// GPT-2's `bytes_to_unicode`: printable Latin-1 bytes stand for themselves, the other
/// 68 bytes take U+0100.. in byte order.
pub(super) fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut shifted: u32 = 0;
    for (byte, slot) in (0u8..=255).zip(table.iter_mut()) {
        let printable = matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        *slot = if printable {
            char::from(byte)
        } else {
            shifted += 1;
            // 256 + shifted <= 256 + 68 is a valid scalar value; the fallback never runs.
            char::from_u32(255 + shifted).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
    }
    table
}

/// The inverse of [`byte_to_char`], indexed by character.
pub(super) fn char_to_byte() -> [Option<u8>; BYTE_CHARS_LEN] {
    let mut table = [None; BYTE_CHARS_LEN];
    for (byte, c) in (0u8..=255).zip(byte_to_char()) {
        table[c as usize] = Some(byte);
    }
    table
}

/// Decodes a byte-level token spelling to bytes. Characters outside the byte-level
/// alphabet (which a well-formed vocabulary never has in a normal token) decode to
/// their own UTF-8 rather than failing.
pub(super) fn spelling_to_bytes(spelling: &str, table: &[Option<u8>; BYTE_CHARS_LEN]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(spelling.len());
    for c in spelling.chars() {
        match table.get(c as usize).copied().flatten() {
            Some(b) => bytes.push(b),
            None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    bytes
}

#[derive(Clone, Copy, Debug)]
struct Merge {
    rank: u32,
    merged: u32,
}

/// Byte-level BPE tables.
#[derive(Debug)]
pub(super) struct BytePairs {
    /// The token spelling each byte, if the vocabulary has one.
    byte_tokens: [Option<u32>; 256],
    byte_chars: [char; 256],
    merges: HashMap<(u32, u32), Merge>,
}

/// Per-call scratch for [`BytePairs::encode_word`], reused across words.
#[derive(Default)]
pub(super) struct Scratch {
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Reverse<(u32, u32)>>,
    spelling: String,
}

/// A symbol of the word being merged: a token id and its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: u32,
    next: u32,
    alive: bool,
}

const NONE: u32 = u32::MAX;

impl BytePairs {
    /// Builds the tables; `ids` maps token text to id, `types` is per token.
    pub(super) fn new(
        ids: &HashMap<String, u32>,
        types: &[TokenType],
        merges: &[String],
    ) -> Result<BytePairs, TokenizerError> {
        let byte_chars = byte_to_char();
        let mut byte_tokens = [None; 256];
        for (slot, c) in byte_tokens.iter_mut().zip(byte_chars) {
            *slot = ids.get(c.encode_utf8(&mut [0; 4]) as &str).copied();
        }
        let mut table = HashMap::with_capacity(merges.len());
        let mut joined = String::new();
        for (index, merge) in merges.iter().enumerate() {
            let malformed = || TokenizerError::MalformedMerge {
                index,
                merge: merge.clone(),
            };
            let (left, right) = merge.split_once(' ').ok_or_else(malformed)?;
            if left.is_empty() || right.is_empty() || right.contains(' ') {
                return Err(malformed());
            }
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let lookup = |text: &str| {
                ids.get(text)
                    .copied()
                    .ok_or(TokenizerError::MergeTokenMissing {
                        index,
                        merge: merge.clone(),
                    })
            };
            let (left_id, right_id, merged) = (lookup(left)?, lookup(right)?, lookup(&joined)?);
            // Text must never merge into a control token (module doc of `tokenizer`).
            if !types[merged as usize].is_text() {
                continue;
            }
            let rank = u32::try_from(index).map_err(|_| malformed())?;
            // The first (lowest-rank) occurrence of a pair wins.
            table
                .entry((left_id, right_id))
                .or_insert(Merge { rank, merged });
        }
        Ok(BytePairs {
            byte_tokens,
            byte_chars,
            merges: table,
        })
    }

    /// Appends the ids of one pre-tokenized word to `out`.
    pub(super) fn encode_word(
        &self,
        word: &str,
        whole_word: Option<&HashMap<String, u32>>,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
    ) {
        if let Some(ids) = whole_word {
            scratch.spelling.clear();
            scratch
                .spelling
                .extend(word.bytes().map(|b| self.byte_chars[b as usize]));
            if let Some(&id) = ids.get(&scratch.spelling) {
                out.push(id);
                return;
            }
        }
        self.load_symbols(word, scratch);
        self.merge_symbols(scratch);
        out.extend(scratch.symbols.iter().filter(|s| s.alive).map(|s| s.id));
    }

    fn load_symbols(&self, word: &str, scratch: &mut Scratch) {
        scratch.symbols.clear();
        for id in word.bytes().filter_map(|b| self.byte_tokens[b as usize]) {
            // Word length is bounded by TEXT_BYTES_MAX, far below u32::MAX.
            let index = scratch.symbols.len() as u32;
            scratch.symbols.push(Symbol {
                id,
                prev: index.wrapping_sub(1),
                next: index + 1,
                alive: true,
            });
        }
        if let Some(last) = scratch.symbols.last_mut() {
            last.next = NONE;
        }
    }

    fn merge_symbols(&self, scratch: &mut Scratch) {
        let Scratch { symbols, heap, .. } = scratch;
        heap.clear();
        for pos in 1..symbols.len() {
            if let Some(m) = self.merges.get(&(symbols[pos - 1].id, symbols[pos].id)) {
                heap.push(Reverse((m.rank, pos as u32 - 1)));
            }
        }
        while let Some(Reverse((rank, pos))) = heap.pop() {
            let left = symbols[pos as usize];
            if !left.alive || left.next == NONE {
                continue;
            }
            let right = symbols[left.next as usize];
            let Some(m) = self.merges.get(&(left.id, right.id)) else {
                continue;
            };
            if m.rank != rank {
                continue; // Stale: this pair changed since the candidate was pushed.
            }
            symbols[pos as usize].id = m.merged;
            symbols[pos as usize].next = right.next;
            symbols[left.next as usize].alive = false;
            if right.next != NONE {
                symbols[right.next as usize].prev = pos;
                self.push_candidate(symbols, heap, pos, right.next);
            }
            if left.prev != NONE {
                self.push_candidate(symbols, heap, left.prev, pos);
            }
        }
    }

    fn push_candidate(
        &self,
        symbols: &[Symbol],
        heap: &mut BinaryHeap<Reverse<(u32, u32)>>,
        left: u32,
        right: u32,
    ) {
        let pair = (symbols[left as usize].id, symbols[right as usize].id);
        if let Some(m) = self.merges.get(&pair) {
            heap.push(Reverse((m.rank, left)));
        }
    }
}
