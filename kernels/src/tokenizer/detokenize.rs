//! Incremental detokenization: token ids in, complete UTF-8 text out.
//!
//! A token is a run of bytes, not of characters: byte-level BPE splits an emoji over
//! several tokens and SentencePiece emits `<0xNN>` byte tokens one at a time. So:
//!
//! 1. Each pushed token's bytes join a pending buffer.
//! 2. The longest valid UTF-8 prefix of the buffer is returned.
//! 3. A sequence that is provably invalid (`Utf8Error::error_len` is `Some`) becomes one
//!    U+FFFD per maximal invalid subpart, as `String::from_utf8_lossy` does; an
//!    incomplete sequence at the end stays pending. At most 3 bytes ever stay pending.
//! 4. [`Detokenizer::finish`] flushes what is left; incomplete bytes become U+FFFD.
//!
//! [`Tokenizer::decode`] is this loop run over a whole slice, so the two always agree.

use super::{DecodeOptions, Tokenizer, TokenizerError};
use std::ops::Deref;

/// The longest incomplete UTF-8 sequence: a 4-byte lead and two continuation bytes.
const PENDING_BYTES_MAX: usize = 3;

/// Stateful streaming decoder; see the module doc. `T` is how it holds the
/// tokenizer: a borrow (`&Tokenizer`) or shared ownership (`Arc<Tokenizer>`), so a
/// long-lived sequence can keep its decoder without borrowing its scheduler.
#[derive(Debug)]
pub struct Detokenizer<T: Deref<Target = Tokenizer>> {
    tokenizer: T,
    options: DecodeOptions,
    pending: Vec<u8>,
    /// SentencePiece with `add_space_prefix`: drop the space that encoding added.
    strip_leading_space: bool,
}

impl<T: Deref<Target = Tokenizer>> Detokenizer<T> {
    /// A decoder over `tokenizer`.
    pub fn new(tokenizer: T, options: DecodeOptions) -> Detokenizer<T> {
        let strip_leading_space = tokenizer.strips_leading_space();
        Detokenizer {
            tokenizer,
            options,
            pending: Vec::with_capacity(64),
            strip_leading_space,
        }
    }

    /// Adds one token; returns the text it completes (possibly empty, never a partial
    /// character). An id outside the vocabulary is an error and changes nothing.
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        let mut bytes = self.tokenizer.rendered_bytes(id, self.options)?;
        if self.strip_leading_space && !bytes.is_empty() {
            self.strip_leading_space = false;
            if let Some(rest) = bytes.strip_prefix(b" ") {
                bytes = rest;
            }
        }
        self.pending.extend_from_slice(bytes);
        let mut text = String::with_capacity(self.pending.len());
        let consumed = drain_utf8(&self.pending, &mut text);
        self.pending.drain(..consumed);
        assert!(self.pending.len() <= PENDING_BYTES_MAX);
        Ok(text)
    }

    /// Bytes held back because they may begin a character not yet complete.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    /// Ends the stream: incomplete bytes left over become U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

/// Appends the decodable prefix of `bytes` to `text` (module doc, 2 and 3); returns how
/// many bytes it consumed. What remains is an incomplete sequence at the end.
fn drain_utf8(bytes: &[u8], text: &mut String) -> usize {
    let mut start = 0;
    loop {
        match std::str::from_utf8(&bytes[start..]) {
            Ok(valid) => {
                text.push_str(valid);
                return bytes.len();
            }
            Err(error) => {
                let valid_end = start + error.valid_up_to();
                // `valid_up_to` promises this prefix is valid UTF-8; the lossy call
                // cannot substitute anything and borrows without copying twice.
                text.push_str(&String::from_utf8_lossy(&bytes[start..valid_end]));
                match error.error_len() {
                    Some(invalid_len) => {
                        text.push(char::REPLACEMENT_CHARACTER);
                        start = valid_end + invalid_len;
                    }
                    None => return valid_end,
                }
            }
        }
    }
}
