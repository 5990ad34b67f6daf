//! Pre-tokenizers for byte-level BPE: split text into words before merging.
//!
//! Each `tokenizer.ggml.pre` name maps to an ordered list of split rules, as in
//! llama.cpp's `llama_vocab` (`regex_exprs`) and HF `pre_tokenizers.Sequence`:
//!
//! 1. Every rule splits every piece the previous rule produced; matches *and* the gaps
//!    between them become pieces (HF's `SplitDelimiterBehavior::Isolated`).
//! 2. The reference patterns end in `\s+(?!\S)|\s+`. The look-ahead forces
//!    fancy-regex's backtracking VM, which is slow and gives up (backtrack limit) on long
//!    whitespace runs. We run the same pattern *without* the look-ahead branch, which
//!    lets fancy-regex hand the whole search to the `regex` crate's DFA, and apply the
//!    look-ahead by hand: a match produced by the trailing `\s+` branch that is two or
//!    more characters long and is followed by more text gives back its last character.
//!    That is exactly what `\s+(?!\S)` does (it backtracks one character so that the next
//!    word keeps its leading space). `tests/tokenizer_pretokenize.rs` checks the
//!    equivalence against the look-ahead pattern on random text.
//! 3. Which matches came from the trailing `\s+` branch is decided per pattern
//!    ([`WsBranch`]); every other branch of these patterns needs a non-space character,
//!    except llama-3's `\s*[\r\n]+`, whose matches always end in a line break.

use fancy_regex::Regex;

use super::TokenizerError;

/// GPT-2's pattern (HF `ByteLevel(use_regex=true)`) without its `\s+(?!\S)` branch.
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// Llama-3's pattern, case-insensitive contractions spelled out as llama.cpp does,
/// without its `\s+(?!\S)` branch.
const LLAMA3_PATTERN: &str = concat!(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])",
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+"
);

/// Qwen2's pattern: llama-3's with single digits.
const QWEN2_PATTERN: &str = concat!(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])",
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+"
);

/// HF `Digits(individual_digits=true)`: every numeric character is its own piece.
const DIGITS_PATTERN: &str = r"\p{N}";

/// Which all-whitespace matches came from a pattern's trailing `\s+` branch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WsBranch {
    /// The pattern has no look-ahead branch to emulate.
    None,
    /// Every all-whitespace match (GPT-2: no other branch matches only whitespace).
    AllWhitespace,
    /// All-whitespace matches that do not end in `\r` or `\n` (llama-3: `\s*[\r\n]+`
    /// comes first and takes every run that contains a line break).
    NoLineBreak,
}

#[derive(Debug)]
struct SplitRule {
    regex: Regex,
    ws_branch: WsBranch,
}

/// The pre-tokenizer named by `tokenizer.ggml.pre`.
#[derive(Debug)]
pub(super) struct PreTokenizer {
    rules: Vec<SplitRule>,
    /// llama.cpp's `ignore_merges`: a word that is itself a token is not merged.
    pub(super) ignore_merges: bool,
}

impl PreTokenizer {
    /// Resolves a `tokenizer.ggml.pre` name. Unknown names are an error: a wrong
    /// split silently changes every id the model sees.
    pub(super) fn for_name(pre: Option<&str>) -> Result<PreTokenizer, TokenizerError> {
        let (rules, ignore_merges): (&[(&str, WsBranch)], bool) = match pre {
            None | Some("default") | Some("gpt2") => {
                (&[(GPT2_PATTERN, WsBranch::AllWhitespace)], false)
            }
            Some("smollm") => (
                &[
                    (DIGITS_PATTERN, WsBranch::None),
                    (GPT2_PATTERN, WsBranch::AllWhitespace),
                ],
                false,
            ),
            Some("llama-bpe") => (&[(LLAMA3_PATTERN, WsBranch::NoLineBreak)], true),
            Some("qwen2") => (&[(QWEN2_PATTERN, WsBranch::NoLineBreak)], false),
            Some(other) => return Err(TokenizerError::UnknownPreTokenizer(other.to_owned())),
        };
        let rules = rules
            .iter()
            .map(|&(pattern, ws_branch)| {
                let regex =
                    Regex::new(pattern).map_err(|e| TokenizerError::Regex(e.to_string()))?;
                Ok(SplitRule { regex, ws_branch })
            })
            .collect::<Result<Vec<_>, TokenizerError>>()?;
        Ok(PreTokenizer {
            rules,
            ignore_merges,
        })
    }

    /// Splits `text` into words, appended to `words` in order; their concatenation is
    /// `text`.
    pub(super) fn split<'t>(
        &self,
        text: &'t str,
        words: &mut Vec<&'t str>,
    ) -> Result<(), TokenizerError> {
        let mut pieces = vec![text];
        let mut next = Vec::new();
        for rule in &self.rules {
            next.clear();
            for piece in &pieces {
                rule.split(piece, &mut next)?;
            }
            std::mem::swap(&mut pieces, &mut next);
        }
        words.extend_from_slice(&pieces);
        Ok(())
    }
}

impl SplitRule {
    fn split<'t>(&self, text: &'t str, out: &mut Vec<&'t str>) -> Result<(), TokenizerError> {
        let mut gap_start = 0;
        let mut pos = 0;
        while pos < text.len() {
            let found = self
                .regex
                .find_from_pos(text, pos)
                .map_err(|e| TokenizerError::Regex(e.to_string()))?;
            let Some(m) = found else { break };
            let end = self.lookahead_end(text, m.start(), m.end());
            if m.start() > gap_start {
                out.push(&text[gap_start..m.start()]);
            }
            if end > m.start() {
                out.push(&text[m.start()..end]);
                pos = end;
            } else {
                // An empty match; none of our patterns produce one, but stepping one
                // character keeps the loop finite if one ever does.
                pos = m.start() + text[m.start()..].chars().next().map_or(1, char::len_utf8);
            }
            gap_start = end.max(gap_start);
        }
        if gap_start < text.len() {
            out.push(&text[gap_start..]);
        }
        Ok(())
    }

    /// Where the match `start..end` ends once `\s+(?!\S)` is emulated (module doc, 2).
    fn lookahead_end(&self, text: &str, start: usize, end: usize) -> usize {
        let matched = &text[start..end];
        let from_ws_branch = match self.ws_branch {
            WsBranch::None => false,
            WsBranch::AllWhitespace => matched.chars().all(char::is_whitespace),
            WsBranch::NoLineBreak => {
                matched.chars().all(char::is_whitespace) && !matched.ends_with(['\r', '\n'])
            }
        };
        if !from_ws_branch || end == text.len() {
            return end;
        }
        let mut chars = matched.char_indices();
        match (chars.next_back(), chars.next()) {
            // Two or more characters: give the last one back to the next word.
            (Some((last_start, _)), Some(_)) => start + last_start,
            _ => end,
        }
    }
}
