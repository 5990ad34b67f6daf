//! Compute backends: the one interface the scheduler sees.
//!
//! A backend runs one *step*: a batch of sequences, each bringing either a
//! prefill chunk or a single decode token, over KV that lives only in pool
//! pages reached through each sequence's page table. The CPU backend is always
//! present; a CUDA backend joins behind the same trait without the scheduler
//! changing.

pub mod adjust;
pub mod cpu;
pub mod cuda;
pub mod draw;
pub mod logprobs;
pub mod vector;

pub use adjust::Adjust;
pub use draw::Draw;
pub use logprobs::Logprobs;

use crate::kv::{PageTable, Pool};
use crate::model::ModelConfig;
use crate::threads::Threads;
use std::sync::Arc;

/// One sequence's share of a step.
pub struct SeqStep<'a> {
    /// The sequence's pages; the backend writes new K/V into them and reads
    /// attention only through them.
    pub pages: &'a PageTable,
    /// Tokens already in the sequence's KV (the position of `tokens[0]`).
    pub pos_start: usize,
    /// New tokens: a prefill chunk or one decode token. Never empty.
    pub tokens: &'a [u32],
    /// How many of the last of `tokens` want their logits: 0 none, 1 the
    /// last (to sample the next token from), more for a prompt's log
    /// probabilities (each position's logits score the token after it); at
    /// most `tokens.len()`.
    pub logits: usize,
    /// How the last of those rows (the one sampled from) is wanted. Nothing
    /// when `logits` is 0.
    pub pick: Pick,
    /// What to change in that row before its token is picked, by ascending
    /// id, one entry an id ([`Adjust`]); read only with a [`Pick`] of the
    /// token. A backend that gives the row in full gives it unadjusted: its
    /// caller adjusts it by the same entries (the host's sampler does).
    pub adjust: &'a [Adjust],
    /// With a [`Pick`] of the token: that token's log probability and this
    /// many alternatives' (at most [`logprobs::TOP_LOGPROBS_MAX`]) are
    /// wanted too, in the row's own distribution (before its adjustments).
    /// A backend that gives the row as its token gives them with it
    /// ([`Logits::scored`]); one that gives the row in full leaves them to
    /// its caller.
    pub logprobs: Option<u8>,
    /// The first of `logits`' rows wanted for a prompt's log probabilities
    /// alone: each row's score of the token after its position (see
    /// [`PromptScores`]). Empty for a step that scores no prompt.
    pub scores: PromptScores<'a>,
}

impl<'a> SeqStep<'a> {
    /// `tokens` of the sequence on `pages` from position `pos_start`, the
    /// last one's row of logits wanted in full, nothing else asked: the
    /// plainest step, whose other fields a caller sets by struct update
    /// (`SeqStep { logits: 0, ..SeqStep::new(pages, 0, &prompt) }`).
    pub fn new(pages: &'a PageTable, pos_start: usize, tokens: &'a [u32]) -> SeqStep<'a> {
        SeqStep {
            pages,
            pos_start,
            tokens,
            logits: 1,
            pick: Pick::Row,
            adjust: &[],
            logprobs: None,
            scores: PromptScores::NONE,
        }
    }
}

/// A sequence's first rows of logits in a step wanted for the log
/// probability of a given token each (the prompt's next), with `top`
/// alternatives: what a prompt's `logprobs` (`echo`, vLLM's
/// `prompt_logprobs`) asks. A backend may give such a row as its scores
/// alone ([`Logits::scored`], with `targets[i]` as its pick): on a GPU 168
/// bytes cross to the host where the row is the vocabulary's 4-byte
/// logits, and the host scores nothing. A backend may also give the row in
/// full (the CPU's does): its caller then scores it ([`Logprobs::of`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PromptScores<'a> {
    /// The token each row scores, one a row from the sequence's first row
    /// of logits; at most [`SeqStep::logits`] of them, fewer where the last
    /// row is sampled from ([`SeqStep::pick`] a token).
    pub targets: &'a [u32],
    /// Alternatives wanted with each (at most [`logprobs::TOP_LOGPROBS_MAX`]).
    pub top: u8,
}

impl PromptScores<'_> {
    /// No row scored.
    pub const NONE: PromptScores<'static> = PromptScores {
        targets: &[],
        top: 0,
    };
}

/// How a step's sampled row is wanted: in full, or for its token alone.
/// A backend may give a row wanted for its token as that token's id
/// ([`Logits::pick`]) rather than the row: on a GPU 4 bytes cross to the
/// host where the row is the vocabulary's 4-byte logits (25 MB a step for
/// 128 sequences of SmolLM2). A backend may also give such a row in full
/// (the CPU's does, and the CUDA backend where a row's adjustments outgrow
/// its share of the step buffer): its caller then finds the same token
/// from the row, adjusted as the step says.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Pick {
    /// The whole row (log probabilities, a schema).
    #[default]
    Row,
    /// Its largest logit's id, the lowest among ties ([`argmax`]), after
    /// the step's adjustments ([`SeqStep::adjust`]): a greedy sampler's
    /// choice.
    Argmax,
    /// The token of this draw ([`Draw::pick`]) after the step's
    /// adjustments: a sampler's choice.
    Draw(Draw),
}

impl Pick {
    /// Whether the row is wanted for its token alone.
    pub fn is_token(&self) -> bool {
        !matches!(self, Pick::Row)
    }
}

/// Rows of logits one step may compute beyond one a sequence: a prompt's
/// log probabilities come in chunks of at most this many positions (the
/// output head is a large product per row, and its rows are scratch that
/// the backend holds for the step).
pub const SCORED_ROWS_MAX: usize = 64;

/// Why a step was refused. The pool and the sequences are unchanged when a step
/// is refused before it starts, which every variant here is.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StepError {
    /// More tokens in one step than the backend's scratch was sized for.
    #[error("step has {tokens} tokens; backend limit is {tokens_max}")]
    TooManyTokens {
        /// Tokens in the step.
        tokens: usize,
        /// The configured limit.
        tokens_max: usize,
    },
    /// More sequences in one step than the backend's scratch was sized for.
    #[error("step has {seqs} sequences; backend limit is {seqs_max}")]
    TooManySequences {
        /// Sequences in the step.
        seqs: usize,
        /// The configured limit.
        seqs_max: usize,
    },
    /// A sequence brought no tokens.
    #[error("sequence {index} in the step has no tokens")]
    EmptySequence {
        /// Its index in the step.
        index: usize,
    },
    /// A sequence asked for the logits of more tokens than it brought.
    #[error("sequence {index} in the step asks for {logits} rows of logits over {tokens} tokens")]
    LogitsPastTokens {
        /// Its index in the step.
        index: usize,
        /// Rows asked for.
        logits: usize,
        /// Tokens brought.
        tokens: usize,
    },
    /// More rows of logits in one step than the backend's scratch holds.
    #[error("step asks for {rows} rows of logits; backend limit is {rows_max}")]
    TooManyLogits {
        /// Rows in the step.
        rows: usize,
        /// The limit.
        rows_max: usize,
    },
    /// A sequence asked for more of its rows to be scored than it asked
    /// rows for, or for its sampled row to be scored.
    #[error(
        "sequence {index} in the step asks for {scored} rows scored of {logits} rows of logits{sampled}",
        sampled = if *sampled { ", the last sampled from" } else { "" }
    )]
    ScoresPastLogits {
        /// Its index in the step.
        index: usize,
        /// Rows asked to be scored.
        scored: usize,
        /// Rows of logits asked for.
        logits: usize,
        /// Whether its last row is sampled from.
        sampled: bool,
    },
    /// A token id outside the vocabulary.
    #[error(
        "sequence {index} in the step has token id {token}, outside the vocabulary of {vocab_len}"
    )]
    TokenOutOfRange {
        /// Its sequence's index in the step.
        index: usize,
        /// The id.
        token: u32,
        /// Vocabulary size.
        vocab_len: usize,
    },
    /// A page of the sequence's table is no longer leased to it.
    #[error("sequence {index} in the step holds a stale page handle")]
    StaleHandle {
        /// Its index in the step.
        index: usize,
    },
    /// The step would write KV into a shared (prefix-cache) page, which is
    /// read-only: its positions are already in it.
    #[error("sequence {index} in the step would write into shared page {page}")]
    SharedPage {
        /// Its index in the step.
        index: usize,
        /// The page's index in the sequence's table.
        page: usize,
    },
    /// The pool's pages are not where this backend computes (host memory
    /// for the CPU backend, this device's memory for the CUDA backend).
    #[error("the KV pool's pages are not where this backend computes")]
    DeviceStorage,
    /// The device failed during the step (a launch or a copy); the step's
    /// pages may hold partial writes, and its sequences fail.
    #[error("device: {0}")]
    Device(String),
    /// The device was lost during the step (one of CUDA's sticky errors):
    /// nothing more can run on it in this process. The engine stops (a
    /// panic, which its supervisor answers: its requests end, and a rebuild
    /// on the lost device is refused).
    #[error("device lost: {0}")]
    DeviceLost(String),
    /// Positions past the model's context or the sequence's pages.
    #[error("sequence {index} in the step has positions up to {end}, past capacity {capacity} ({limit})")]
    PositionOutOfRange {
        /// Its sequence's index in the step.
        index: usize,
        /// One past the last position the step would write.
        end: usize,
        /// The capacity it broke.
        capacity: usize,
        /// Which capacity: "model context" or "page table".
        limit: &'static str,
    },
}

impl StepError {
    /// The index in the step of the one sequence that caused the refusal, when
    /// one did; `None` when the step as a whole was at fault (its size) or the
    /// pool was. A scheduler fails only that sequence and steps the rest again.
    pub fn sequence(&self) -> Option<usize> {
        match *self {
            StepError::EmptySequence { index }
            | StepError::LogitsPastTokens { index, .. }
            | StepError::ScoresPastLogits { index, .. }
            | StepError::TokenOutOfRange { index, .. }
            | StepError::StaleHandle { index }
            | StepError::SharedPage { index, .. }
            | StepError::PositionOutOfRange { index, .. } => Some(index),
            StepError::TooManyTokens { .. }
            | StepError::TooManySequences { .. }
            | StepError::TooManyLogits { .. }
            | StepError::DeviceStorage
            | StepError::Device(_)
            | StepError::DeviceLost(_) => None,
        }
    }
}

/// Logits of one step: `[rows][vocab]`, each sequence's [`SeqStep::logits`]
/// rows in step order, a sequence's in the order of its tokens; a row
/// wanted for its token alone (see [`SeqStep::pick`]) may be given as that
/// token's id.
pub struct Logits<'a> {
    /// Row-major values of the rows given in full, in row order.
    pub values: &'a [f32],
    /// Vocabulary size (row length).
    pub vocab_len: usize,
    /// The rows given as their token's id alone ([`Pick::Argmax`],
    /// [`Pick::Draw`]), as `(row, id)` in row order; empty from a backend
    /// that gives every row in full.
    pub picks: &'a [(u32, u32)],
    /// The log probabilities of those rows given as their token whose step
    /// asked for them ([`SeqStep::logprobs`]), and of the rows given as
    /// their scores alone ([`SeqStep::scores`]; their target is their
    /// pick), as `(row, log probabilities)` in row order.
    pub scored: &'a [(u32, Logprobs)],
}

impl Logits<'_> {
    /// The `i`-th row. Panics for a row given as its pick alone: its caller
    /// asked for the pick.
    pub fn row(&self, i: usize) -> &[f32] {
        let picked_before = self.picks.partition_point(|&(row, _)| (row as usize) < i);
        assert!(
            self.picks
                .get(picked_before)
                .is_none_or(|&(row, _)| row as usize != i),
            "row {i} was given as its token's id alone"
        );
        let k = i - picked_before;
        &self.values[k * self.vocab_len..(k + 1) * self.vocab_len]
    }

    /// The token the backend picked for the `i`-th row where it gave that
    /// alone (see [`Pick`]); `None` where it gave the row.
    pub fn pick(&self, i: usize) -> Option<u32> {
        self.picks
            .binary_search_by_key(&i, |&(row, _)| row as usize)
            .ok()
            .map(|k| self.picks[k].1)
    }

    /// The `i`-th row's log probabilities, where it was given as its token
    /// with them ([`Logits::scored`]).
    pub fn scored(&self, i: usize) -> Option<&Logprobs> {
        self.scored
            .binary_search_by_key(&i, |&(row, _)| row as usize)
            .ok()
            .map(|k| &self.scored[k].1)
    }

    /// Number of rows.
    pub fn rows_count(&self) -> usize {
        self.values.len() / self.vocab_len + self.picks.len()
    }
}

/// Index of the largest logit, the lowest index among ties: the first
/// index whose value no later one exceeds (a NaN is never larger, and one
/// at index 0 is never exceeded). The CUDA backend's `pick` kernel gives
/// the same index for the same values.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// A compute backend.
pub trait Backend: Send {
    /// A short name for logs and the capacity table ("cpu-avx512", "cuda").
    fn name(&self) -> String;

    /// Largest number of tokens one step may carry.
    fn step_tokens_max(&self) -> usize;

    /// Largest number of rows of logits one step may ask for (at least
    /// one a sequence; see [`SCORED_ROWS_MAX`]).
    fn step_logits_max(&self) -> usize;

    /// Runs one step: writes the new tokens' K/V into their pages and returns
    /// logits for the sequences that asked.
    fn step(&mut self, steps: &[SeqStep<'_>], pool: &mut Pool) -> Result<Logits<'_>, StepError>;

    /// The backend's compute threads, idle between steps, which the caller
    /// may lend the work on a step's outputs (sampling each sequence's
    /// token); `None` when the backend has none on the host.
    fn threads(&self) -> Option<Arc<Threads>> {
        None
    }

    /// How it runs, where its name does not say all an operator may want to
    /// know (the CUDA backend: "graphs on, tensor cores on"); `None` where
    /// the name says it all.
    fn modes(&self) -> Option<String> {
        None
    }
}

/// The size of the largest step a backend's scratch holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepLimits {
    /// Most tokens in one step.
    pub step_tokens_max: usize,
    /// Most sequences in one step.
    pub step_seqs_max: usize,
}

impl StepLimits {
    /// Most rows of logits in one step: one a sequence, and
    /// [`SCORED_ROWS_MAX`] more (never more than the step's tokens).
    pub fn step_logits_max(&self) -> usize {
        (self.step_seqs_max + SCORED_ROWS_MAX).min(self.step_tokens_max.max(self.step_seqs_max))
    }
}

/// The checks every backend makes before a step touches anything: its
/// size, each sequence's tokens and positions against the model and its
/// page table, and every page it touches a live lease of the sequence, the
/// pages it writes its own (not shared). Returns the step's token count.
/// The pool stays borrowed by the caller for the whole step, so the checks
/// hold until it ends.
pub fn validate_step(
    c: &ModelConfig,
    limits: &StepLimits,
    steps: &[SeqStep<'_>],
    page_tokens: usize,
    pool: &Pool,
) -> Result<usize, StepError> {
    if steps.len() > limits.step_seqs_max {
        return Err(StepError::TooManySequences {
            seqs: steps.len(),
            seqs_max: limits.step_seqs_max,
        });
    }
    let (mut tokens, mut rows) = (0usize, 0usize);
    for (index, step) in steps.iter().enumerate() {
        if step.tokens.is_empty() {
            return Err(StepError::EmptySequence { index });
        }
        if step.logits > step.tokens.len() {
            return Err(StepError::LogitsPastTokens {
                index,
                logits: step.logits,
                tokens: step.tokens.len(),
            });
        }
        let scored = step.scores.targets.len();
        let sampled = step.pick.is_token() && step.logits > 0;
        if scored + usize::from(sampled) > step.logits {
            return Err(StepError::ScoresPastLogits {
                index,
                scored,
                logits: step.logits,
                sampled,
            });
        }
        rows += step.logits;
        let mut ids = step.tokens.iter().chain(step.scores.targets);
        if let Some(&token) = ids.find(|&&t| t as usize >= c.vocab_len) {
            return Err(StepError::TokenOutOfRange {
                index,
                token,
                vocab_len: c.vocab_len,
            });
        }
        let end = step.pos_start.saturating_add(step.tokens.len());
        if end > c.context_len {
            return Err(StepError::PositionOutOfRange {
                index,
                end,
                capacity: c.context_len,
                limit: "model context",
            });
        }
        let capacity = step.pages.pages_count() * page_tokens;
        if end > capacity {
            return Err(StepError::PositionOutOfRange {
                index,
                end,
                capacity,
                limit: "page table",
            });
        }
        // Every page the step touches must be a live lease, and every page
        // it writes its own, not shared.
        let first_written = step.pos_start / page_tokens;
        for page in 0..end.div_ceil(page_tokens) {
            let lease = step.pages.lease(page).expect("page count checked above");
            let writable = pool
                .is_writable(lease)
                .map_err(|_| StepError::StaleHandle { index })?;
            if page >= first_written && !writable {
                return Err(StepError::SharedPage { index, page });
            }
        }
        tokens += step.tokens.len();
    }
    if tokens > limits.step_tokens_max {
        return Err(StepError::TooManyTokens {
            tokens,
            tokens_max: limits.step_tokens_max,
        });
    }
    if rows > limits.step_logits_max() {
        return Err(StepError::TooManyLogits {
            rows,
            rows_max: limits.step_logits_max(),
        });
    }
    Ok(tokens)
}

impl Backend for Box<dyn Backend> {
    fn name(&self) -> String {
        (**self).name()
    }

    fn step_tokens_max(&self) -> usize {
        (**self).step_tokens_max()
    }

    fn step_logits_max(&self) -> usize {
        (**self).step_logits_max()
    }

    fn step(&mut self, steps: &[SeqStep<'_>], pool: &mut Pool) -> Result<Logits<'_>, StepError> {
        (**self).step(steps, pool)
    }

    fn threads(&self) -> Option<Arc<Threads>> {
        (**self).threads()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_given_as_their_pick_are_skipped_in_the_values() {
        // Rows 0, 2 and 4 in full; 1 and 3 as their ids.
        let values: Vec<f32> = [[0.0, 1.0], [2.0, 3.0], [5.0, 4.0]].concat();
        let picks = [(1, 7), (3, 9)];
        let scored = [(
            3,
            Logprobs {
                token: 9,
                logprob: -0.5,
                top: vec![(9, -0.5)],
            },
        )];
        let logits = Logits {
            values: &values,
            vocab_len: 2,
            picks: &picks,
            scored: &scored,
        };
        assert_eq!(logits.rows_count(), 5);
        assert_eq!(logits.scored(3).map(|s| s.logprob), Some(-0.5));
        assert_eq!(logits.scored(1), None);
        assert_eq!(logits.row(0), [0.0, 1.0]);
        assert_eq!(logits.row(2), [2.0, 3.0]);
        assert_eq!(logits.row(4), [5.0, 4.0]);
        assert_eq!(
            (logits.pick(0), logits.pick(1), logits.pick(3)),
            (None, Some(7), Some(9))
        );
        let greedy: Vec<u32> = (0..5)
            .map(|i| logits.pick(i).unwrap_or_else(|| argmax(logits.row(i))))
            .collect();
        assert_eq!(greedy, [1, 7, 1, 9, 0]);
        let given = std::panic::catch_unwind(|| logits.row(3).to_vec());
        assert!(given.is_err(), "a picked row has no values");
    }

    #[test]
    fn argmax_is_the_first_of_the_largest_and_a_nan_never_wins() {
        assert_eq!(argmax(&[0.1, 3.0, -1.0, 3.0]), 1);
        assert_eq!(argmax(&[1.0, f32::NAN, 2.0]), 2);
        assert_eq!(argmax(&[f32::NAN, 5.0]), 0);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3]), 0);
    }
}
