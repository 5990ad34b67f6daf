//! Token sampling: greedy at temperature 0, otherwise temperature, top-k and
//! top-p (nucleus) over a seeded generator, so a seed reproduces a completion.
//!
//! Before either, the logits are adjusted: a token of the prompt or the
//! output so far has its logit divided by `repetition_penalty` (multiplied,
//! where negative: the CTRL paper's rule, as vLLM, TGI and llama.cpp apply
//! it); then, as OpenAI defines them, a token the sequence has generated `c`
//! times loses `c × frequency_penalty`, plus `presence_penalty` once (`c`
//! counts this request's generated tokens, not the prompt's, as vLLM counts
//! them), and each `logit_bias` entry is added to its token's logit. When
//! sampling, `min_p` drops the tokens less likely than that fraction of the
//! likeliest (after temperature and top-k, before top-p).
//!
//! Until `min_tokens` tokens are generated, the tokens that would end the
//! output (end-of-generation, unless `ignore_eos`, and `stop_token_ids`) are
//! never picked, as vLLM's `min_tokens` works.

use super::json::Json;
use super::schema::Schema;
use bulkhead_kernels::backend::adjust::adjust;
use bulkhead_kernels::backend::{Adjust, Draw, Logits, Pick};
use bulkhead_kernels::rng::SplitMix64;
use bulkhead_kernels::threads::Threads;
use bulkhead_kernels::tokenizer::{TokenType, Tokenizer};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Largest top-k honoured; larger values are clamped (the vocabulary is the real bound).
pub const TOP_K_MAX: usize = 1 << 16;
/// Most `logit_bias` entries a request may carry.
pub const LOGIT_BIAS_MAX: usize = 1024;
/// The bound of a `logit_bias` value (either sign): ±100 bans or forces a token.
pub const LOGIT_BIAS_LIMIT: f32 = 100.0;
/// The bound of `presence_penalty` and `frequency_penalty` (either sign).
pub const PENALTY_LIMIT: f32 = 2.0;
/// The largest `repetition_penalty` (1 is none; 1.1 to 1.3 are usual).
pub const REPETITION_PENALTY_MAX: f32 = 2.0;
/// Most alternatives a token's log probabilities may list (`top_logprobs`).
pub const TOP_LOGPROBS_MAX: u8 = bulkhead_kernels::backend::logprobs::TOP_LOGPROBS_MAX as u8;
/// Most `stop_token_ids` a request may carry.
pub const STOP_TOKEN_IDS_MAX: usize = 64;

/// How to pick the next token.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy; otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1 = no limit).
    pub top_p: f32,
    /// Seed of the generator.
    pub seed: u64,
    /// Subtracted from a generated token's logit once it has appeared.
    pub presence_penalty: f32,
    /// Subtracted from a generated token's logit per time it has appeared.
    pub frequency_penalty: f32,
    /// Added to the logits of these tokens (ids in ascending order, each
    /// once; an id past the vocabulary is ignored: the API refuses them).
    pub logit_bias: Vec<(u32, f32)>,
    /// Report each generated token's log probability and this many of the
    /// likeliest alternatives' (at most [`TOP_LOGPROBS_MAX`]); `None`: none.
    pub logprobs: Option<u8>,
    /// Structured output: the output is a JSON text this schema accepts
    /// (JSON mode's is any object; see [`super::json`]).
    pub json: Option<Arc<Schema>>,
    /// Keep only tokens at least this likely relative to the likeliest (0: all).
    pub min_p: f32,
    /// Divides the positive logits of tokens already in the prompt or the
    /// output (multiplies the negative ones); 1: none.
    pub repetition_penalty: f32,
    /// An end-of-generation token does not end the output (it shows no text).
    pub ignore_eos: bool,
    /// Tokens that end the output as an end-of-generation token does, not
    /// shown (ids in ascending order, each once; the API checks them
    /// against the vocabulary).
    pub stop_token_ids: Vec<u32>,
    /// Until this many tokens are generated, no token that would end the
    /// output is picked, and stop sequences are not looked for.
    pub min_tokens: u32,
    /// Report each prompt token's log probability after the tokens before
    /// it (from the second on) and this many of the likeliest
    /// alternatives' (at most [`TOP_LOGPROBS_MAX`]); `None`: none. The
    /// prompt is then computed whole here (no cached page, no prefill peer).
    pub prompt_logprobs: Option<u8>,
}

pub use bulkhead_kernels::backend::logprobs::Logprobs;

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            logprobs: None,
            json: None,
            min_p: 0.0,
            repetition_penalty: 1.0,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            min_tokens: 0,
            prompt_logprobs: None,
        }
    }
}

impl SamplingParams {
    fn penalizes(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// The penalty of a token generated `count` times: 0 (not -0) where none.
fn penalty_of(presence: f32, frequency: f32, count: u32) -> f32 {
    let penalty = presence + frequency * count as f32;
    if penalty != 0.0 {
        penalty
    } else {
        0.0
    }
}

/// A row's sample: its token, the token's log probabilities when asked
/// for, and the time sampling it took, on whichever thread ran it (what the
/// engine charges to the sequence's tenant in its counts).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The token picked.
    pub token: u32,
    /// Its log probabilities, when the request asked for them.
    pub logprobs: Option<Logprobs>,
    /// How long picking it (and its log probabilities) took.
    pub took: Duration,
}

/// Samples the next token of each `(sampler, row)` pair from that row of `logits`, with
/// its logprobs when asked. Every sequence has its own sampler (state and
/// seed), so the rows are independent: with `threads` (the backend's,
/// idle between steps) they run in parallel, and requests whose sampling is
/// expensive (JSON mode, a wide nucleus, many logprobs), a tenant's many of
/// them say, lengthen the step every tenant waits on by their cost over the
/// threads rather than by their whole cost. The tokens are the same either
/// way.
pub fn sample_rows(
    threads: Option<&Threads>,
    samplers: Vec<(&mut Sampler, usize)>,
    logits: &Logits<'_>,
) -> Vec<Sampled> {
    let sample = |sampler: &mut Sampler, row: usize| {
        let started = Instant::now();
        let (token, logprobs) = match logits.pick(row) {
            // Picked on the backend's side: a row its sampler's `pick`
            // asked for the token of, with its log probabilities where the
            // request wants them (the step asked the backend for them).
            Some(id) => {
                let logprobs = sampler.params.logprobs.map(|_| {
                    logits
                        .scored(row)
                        .cloned()
                        .expect("a picked row's log probabilities come with it")
                });
                (sampler.take_pick(id), logprobs)
            }
            None => {
                let token = sampler.sample(logits.row(row));
                (token, sampler.logprobs(logits.row(row), token))
            }
        };
        Sampled {
            token,
            logprobs,
            took: started.elapsed(),
        }
    };
    let threads = threads.filter(|t| samplers.len() > 1 && t.threads_count() > 1);
    let Some(threads) = threads else {
        return samplers
            .into_iter()
            .map(|(sampler, row)| sample(sampler, row))
            .collect();
    };
    type Slot<'a> = Mutex<(Option<(&'a mut Sampler, usize)>, Option<Sampled>)>;
    let slots: Vec<Slot<'_>> = samplers
        .into_iter()
        .map(|sampler| Mutex::new((Some(sampler), None)))
        .collect();
    threads.run(slots.len(), &|i, _worker| {
        let mut slot = slots[i].lock().unwrap_or_else(|e| e.into_inner());
        let (sampler, row) = slot.0.take().expect("each row is sampled once");
        slot.1 = Some(sample(sampler, row));
    });
    slots
        .into_iter()
        .map(|slot| {
            let (_, sampled) = slot.into_inner().unwrap_or_else(|e| e.into_inner());
            sampled.expect("every row was sampled")
        })
        .collect()
}

/// The log probabilities of each `(row, token, top)`: `token`'s under that
/// row of `logits`, with `top` alternatives (a prompt's tokens, each scored
/// by the position before it), as the backend gave them where it scored a
/// row itself ([`Logits::scored`]). Rows are independent, so with
/// `threads` they are spread over them, as [`sample_rows`] does.
pub fn score_rows(
    threads: Option<&Threads>,
    rows: &[(usize, u32, usize)],
    logits: &Logits<'_>,
) -> Vec<Logprobs> {
    // A row the backend scored (a GPU's, where the row lies) is taken as
    // it gave it; a row given in full is scored here.
    let score = |&(row, token, top): &(usize, u32, usize)| match logits.scored(row) {
        Some(scored) => scored.clone(),
        None => Logprobs::of(logits.row(row), token, top),
    };
    let threads = threads.filter(|t| rows.len() > 1 && t.threads_count() > 1);
    let Some(threads) = threads else {
        return rows.iter().map(score).collect();
    };
    let slots: Vec<Mutex<Option<Logprobs>>> = rows.iter().map(|_| Mutex::new(None)).collect();
    threads.run(rows.len(), &|i, _worker| {
        let scored = score(&rows[i]);
        *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(scored);
    });
    slots
        .into_iter()
        .map(|slot| {
            let scored = slot.into_inner().unwrap_or_else(|e| e.into_inner());
            scored.expect("every row was scored")
        })
        .collect()
}

/// A sampler with its own generator state (one per sequence).
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    candidates: Vec<(u32, f32)>,
    /// How often each token was generated (kept only under a penalty).
    generated: BTreeMap<u32, u32>,
    /// This step's adjustments ([`Sampler::adjustments`]), by id, once made.
    adjust: Vec<Adjust>,
    /// Whether `adjust` is made for this step: made whole once, then kept
    /// by each token counted (its own entry), made whole again where the
    /// ban of `min_tokens` lifts.
    adjust_made: bool,
    /// The adjusted logits, when there is anything to adjust.
    adjusted: Vec<f32>,
    /// JSON mode's recognizer and the vocabulary it reads tokens' bytes from.
    json: Option<(Json, Arc<Tokenizer>)>,
    /// The tokens of the prompt and the output so far (kept only under a
    /// repetition penalty).
    seen: BTreeSet<u32>,
    /// The tokens that end the output (ascending): never picked before
    /// `min_tokens` (kept only when `min_tokens` is above 0).
    ends: Vec<u32>,
    /// Tokens picked so far.
    sampled: u32,
    /// The uniform of the step in flight, once drawn ([`Sampler::pick`]
    /// hands it to the backend; the host's draw of the same step uses it).
    pending: Option<f64>,
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler::with_eog(params, &[])
    }

    /// A sampler for `params` over a vocabulary whose end-of-generation
    /// tokens are `eog` (ascending).
    fn with_eog(params: SamplingParams, eog: &[u32]) -> Sampler {
        let mut ends = Vec::new();
        if params.min_tokens > 0 {
            ends.extend_from_slice(&params.stop_token_ids);
            if !params.ignore_eos {
                ends.extend_from_slice(eog);
            }
            ends.sort_unstable();
            ends.dedup();
        }
        Sampler {
            rng: SplitMix64(params.seed),
            params,
            candidates: Vec::new(),
            generated: BTreeMap::new(),
            adjust: Vec::new(),
            adjust_made: false,
            adjusted: Vec::new(),
            json: None,
            seen: BTreeSet::new(),
            ends,
            sampled: 0,
            pending: None,
        }
    }

    /// A sampler for `params` over `tokenizer`'s vocabulary, after `prompt`:
    /// under a schema it picks only tokens that keep the output a prefix of
    /// a JSON text the schema accepts, and an end-of-generation token once
    /// the value is complete (or, where it may go on, as the model likes).
    pub fn for_request(
        params: SamplingParams,
        tokenizer: &Arc<Tokenizer>,
        prompt: &[u32],
    ) -> Sampler {
        let json = (params.json.as_ref())
            .map(|schema| (Json::new(Arc::clone(schema)), Arc::clone(tokenizer)));
        let seen = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            BTreeSet::new()
        };
        Sampler {
            json,
            seen,
            ..Sampler::with_eog(params, tokenizer.eog_tokens())
        }
    }

    /// Whether `token` (the one just sampled; `is_eog` says whether it is an
    /// end-of-generation token) ends the output: an end-of-generation token
    /// unless `ignore_eos`, or one of `stop_token_ids`, once `min_tokens`
    /// tokens came before it. Such a token is not part of the output.
    pub fn ends_output(&self, token: u32, is_eog: bool) -> bool {
        let ends =
            (is_eog && !self.params.ignore_eos) || self.params.stop_token_ids.contains(&token);
        ends && self.sampled > self.params.min_tokens
    }

    /// Whether stop sequences are looked for in the text of the token just
    /// sampled: once `min_tokens` tokens are generated, as vLLM does (a stop
    /// sequence wholly in the text of earlier tokens does not count).
    pub fn looks_for_stops(&self) -> bool {
        self.sampled >= self.params.min_tokens
    }

    /// The log probabilities of `token` (just sampled from `logits`), when
    /// the request asked for them.
    pub fn logprobs(&self, logits: &[f32], token: u32) -> Option<Logprobs> {
        let top = self.params.logprobs?;
        Some(Logprobs::of(logits, token, usize::from(top)))
    }

    /// Picks the next token from `logits` (`[vocab]`), and counts it for the
    /// penalties of the next.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        assert!(!logits.is_empty(), "the vocabulary is never empty");
        let token = if !self.adjusts() {
            self.pick_within(logits)
        } else {
            self.make_adjustments();
            let mut adjusted = std::mem::take(&mut self.adjusted);
            adjusted.clear();
            adjusted.extend_from_slice(logits);
            adjust(&mut adjusted, &self.adjust);
            let token = self.pick_within(&adjusted);
            self.adjusted = adjusted;
            token
        };
        self.count(token);
        token
    }

    /// How the backend may give this step's row ([`SeqStep::pick`]): as
    /// its token (and its log probabilities, where the request wants them:
    /// [`SeqStep::logprobs`]) where that is all that is read of it, that is
    /// without a schema: greedy, its argmax
    /// ([`Pick::Argmax`]); sampled, this step's draw ([`Pick::Draw`], the
    /// step's uniform drawn now and kept for it); either after this step's
    /// adjustments (biases, penalties, `min_tokens`' ban), made now
    /// ([`Sampler::adjustments`], the step's [`SeqStep::adjust`]). A GPU
    /// then copies 4 bytes for the row, not the row;
    /// [`Sampler::take_pick`] takes the token, and [`Sampler::sample`] of
    /// the row, where the backend gave it anyway, picks the same.
    ///
    /// [`SeqStep::pick`]: bulkhead_kernels::backend::SeqStep::pick
    /// [`SeqStep::adjust`]: bulkhead_kernels::backend::SeqStep::adjust
    /// [`SeqStep::logprobs`]: bulkhead_kernels::backend::SeqStep::logprobs
    pub fn pick(&mut self) -> Pick {
        if self.json.is_some() {
            return Pick::Row;
        }
        self.make_adjustments();
        if self.params.temperature <= 0.0 {
            Pick::Argmax
        } else {
            Pick::Draw(self.draw_params())
        }
    }

    /// Takes `token`, the one the backend picked for a row this sampler
    /// asked it to ([`Sampler::pick`]): what [`Sampler::sample`] of that
    /// row would return, and counted as it counts.
    pub fn take_pick(&mut self, token: u32) -> u32 {
        debug_assert!(
            self.json.is_none(),
            "a pick for a sampler that reads the row"
        );
        self.pending = None;
        self.count(token);
        token
    }

    /// Makes the next pick's adjustments whole rather than keep them
    /// (`bulkhead bench sampling` times both).
    #[doc(hidden)]
    pub fn forget_adjustments(&mut self) {
        self.adjust_made = false;
    }

    /// Whether `min_tokens` still bans the tokens that end the output.
    fn banning(&self) -> bool {
        self.sampled < self.params.min_tokens && !self.ends.is_empty()
    }

    /// The request's sampling parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The adjustments of the step [`Sampler::pick`] was last asked about,
    /// by ascending id, one entry an id (empty: none), where it asked for
    /// a token ([`Pick::Argmax`], [`Pick::Draw`]).
    pub fn adjustments(&self) -> &[Adjust] {
        &self.adjust
    }

    /// This step's adjustments into `adjust`, by id: each token of the
    /// prompt and output so far under a repetition penalty, each generated
    /// one under a presence or frequency penalty, each biased one, and
    /// each that would end the output while `min_tokens` bans them. Made
    /// whole once (and where the ban lifts); after that each token counted
    /// changes its own entry alone ([`Sampler::count`]): a list of a long
    /// prompt's 3,000 tokens is some 20 us to make, a step of 128 such
    /// sequences 2.9 ms on this VM, where a GPU's step is about that.
    fn make_adjustments(&mut self) {
        if self.adjust_made {
            return;
        }
        self.adjust_made = true;
        let list = &mut self.adjust;
        list.clear();
        let repetition = self.params.repetition_penalty;
        list.extend(self.seen.iter().map(|&id| Adjust {
            repetition,
            ..Adjust::none(id)
        }));
        let (presence, frequency) = (self.params.presence_penalty, self.params.frequency_penalty);
        list.extend(self.generated.iter().map(|(&id, &count)| Adjust {
            penalty: penalty_of(presence, frequency, count),
            ..Adjust::none(id)
        }));
        list.extend(self.params.logit_bias.iter().map(|&(id, bias)| Adjust {
            bias,
            ..Adjust::none(id)
        }));
        if self.sampled < self.params.min_tokens {
            list.extend(self.ends.iter().map(|&id| Adjust {
                ban: true,
                ..Adjust::none(id)
            }));
        }
        // Stable: an id's biases (were there several) add in their order.
        list.sort_by_key(|a| a.id);
        list.dedup_by(|later, kept| {
            if later.id != kept.id {
                return false;
            }
            if later.repetition != 1.0 {
                kept.repetition = later.repetition;
            }
            if later.penalty != 0.0 {
                kept.penalty = later.penalty;
            }
            kept.bias += later.bias;
            kept.ban |= later.ban;
            true
        });
    }

    /// Whether the logits are adjusted before the pick.
    fn adjusts(&self) -> bool {
        !self.params.logit_bias.is_empty()
            || !self.generated.is_empty()
            || !self.seen.is_empty()
            || self.banning()
    }

    /// Counts `token`, just picked, for the penalties and `min_tokens`,
    /// and changes its entry of the adjustments to what making them whole
    /// would make it: under a repetition penalty, seen; under a presence
    /// or frequency penalty, its count's. Where that lifts the ban of
    /// `min_tokens`, they are made whole again at the next pick.
    fn count(&mut self, token: u32) {
        let banning = self.banning();
        let (repetition, penalizes) = (self.params.repetition_penalty, self.params.penalizes());
        let mut count = 0;
        if penalizes {
            let n = self.generated.entry(token).or_insert(0);
            *n += 1;
            count = *n;
        }
        if repetition != 1.0 {
            self.seen.insert(token);
        }
        self.sampled = self.sampled.saturating_add(1);
        if banning != self.banning() {
            self.adjust_made = false;
        }
        if !self.adjust_made || (repetition == 1.0 && !penalizes) {
            return;
        }
        let at = match self.adjust.binary_search_by_key(&token, |a| a.id) {
            Ok(at) => at,
            Err(at) => {
                self.adjust.insert(at, Adjust::none(token));
                at
            }
        };
        let entry = &mut self.adjust[at];
        if repetition != 1.0 {
            entry.repetition = repetition;
        }
        if penalizes {
            let (presence, frequency) =
                (self.params.presence_penalty, self.params.frequency_penalty);
            entry.penalty = penalty_of(presence, frequency, count);
        }
    }

    /// [`Sampler::pick_free`], within the schema's constraint when there is one.
    fn pick_within(&mut self, logits: &[f32]) -> u32 {
        let Some((json, tokenizer)) = self.json.take() else {
            return self.pick_free(logits, &|_| true);
        };
        let (json, token) = if json.is_done() {
            // The value is complete: the output ends.
            let eog = (0..logits.len() as u32)
                .filter(|&id| tokenizer.is_eog(id))
                .max_by(|&a, &b| {
                    logits[a as usize]
                        .total_cmp(&logits[b as usize])
                        .then(b.cmp(&a))
                });
            match eog {
                Some(token) => (json, token),
                None => (json, self.pick_free(logits, &|_| true)),
            }
        } else {
            // A byte the recognizer refuses refuses every token it starts:
            // one table (256 one-byte checks, made at the first refusal)
            // spares most refused tokens their walk.
            let first_bytes = std::cell::OnceCell::new();
            // A top-level number or literal may end or go on.
            let may_end = json.may_end();
            let fits = |id: u32| {
                if may_end && tokenizer.is_eog(id) {
                    return true;
                }
                matches!(
                    tokenizer.token_type(id),
                    Ok(TokenType::Normal | TokenType::Byte)
                ) && tokenizer.token_to_piece_bytes(id).is_ok_and(|bytes| {
                    let Some(&first) = bytes.first() else {
                        return false;
                    };
                    if first_bytes
                        .get()
                        .is_some_and(|table: &[bool; 256]| !table[usize::from(first)])
                    {
                        return false;
                    }
                    let fits = json.accepts(bytes);
                    if !fits {
                        first_bytes
                            .get_or_init(|| std::array::from_fn(|b| json.accepts(&[b as u8])));
                    }
                    fits
                })
            };
            let token = self.pick_free(logits, &fits);
            let mut json = json;
            if let Ok(bytes) = tokenizer.token_to_piece_bytes(token) {
                json.push(bytes);
            }
            (json, token)
        };
        self.json = Some((json, tokenizer));
        token
    }

    /// Greedy, or temperature, top-k, min-p and top-p, among the tokens that
    /// `fits`: greedy checks the likeliest token, then, where it does not
    /// fit, only the tokens likelier than the best that fits so far; a draw
    /// checks the token drawn, then races the rest ([`race`]). So a
    /// constraint costs a check per token that could have won, rather than
    /// one per vocabulary entry. Where no candidate fits, the likeliest
    /// token of the whole vocabulary that fits wins (or, where none does,
    /// the likeliest).
    ///
    /// What a token costs stays a few passes over the vocabulary whatever
    /// the request asks (never a sort of it): the engine's thread samples
    /// every sequence of a step while the others wait
    /// (`bulkhead bench sampling` measures each option).
    fn pick_free(&mut self, logits: &[f32], fits: &dyn Fn(u32) -> bool) -> u32 {
        if self.params.temperature <= 0.0 {
            let best = argmax(logits);
            if fits(best) {
                return best;
            }
            return best_fitting(logits, fits).unwrap_or(best);
        }
        self.draw(logits, fits)
            .or_else(|| best_fitting(logits, fits))
            .unwrap_or_else(|| argmax(logits))
    }

    /// A draw among the temperature's, top-k's, min-p's and top-p's
    /// candidates that fit; `None` when none does.
    ///
    /// The draw is [`Draw`]'s (the one a GPU makes where a step asks it
    /// to): its uniform falls on the candidates in id order, an order that
    /// depends only on the logits, so a seed reproduces a completion. Where
    /// the token it falls on does not fit, a race among the rest.
    fn draw(&mut self, logits: &[f32], fits: &dyn Fn(u32) -> bool) -> Option<u32> {
        let draw = self.draw_params();
        self.pending = None;
        let c = &mut self.candidates;
        draw.candidates(logits, c);
        let token = c[Draw::walk(c, draw.u)?].0;
        if fits(token) {
            return Some(token);
        }
        race(&mut self.rng, c, fits)
    }

    /// This step's draw: the request's options and the step's uniform,
    /// drawn once a step (kept until the step's token is taken, whether it
    /// is drawn here or by the backend).
    fn draw_params(&mut self) -> Draw {
        let u = *self.pending.get_or_insert_with(|| self.rng.next_f64());
        Draw {
            inv_t: 1.0 / self.params.temperature,
            top_k: self.params.top_k.min(TOP_K_MAX) as u32,
            top_p: self.params.top_p.clamp(0.0, 1.0),
            min_p: self.params.min_p,
            u,
        }
    }
}

/// A draw among the candidates (weights) that fit, each in proportion to its
/// weight, in one pass: an exponential race (each candidate arrives after an
/// exponential time of rate its weight; the first to arrive of those that fit
/// wins). Exact, unlike a draw from a truncated list, and cheap: as in
/// Efraimidis and Spirakis' reservoir sampling with jumps, the candidates
/// that would arrive after the best so far are passed over by drawing how
/// much weight to pass, so only the few that would arrive first are drawn
/// and checked. A request whose likeliest tokens never fit cannot make a
/// step check the vocabulary.
fn race(rng: &mut SplitMix64, c: &[(u32, f32)], fits: &dyn Fn(u32) -> bool) -> Option<u32> {
    // Exp(1), from a uniform in [0, 1).
    let exponential = |rng: &mut SplitMix64| -(-rng.next_f64()).ln_1p();
    let mut best: Option<(f64, u32)> = None;
    // Weight still to pass before the next candidate that beats the best:
    // the first point of a Poisson process of rate `best` over the
    // candidates' weights laid end to end.
    let mut skip = 0.0f64;
    for &(id, weight) in c {
        if weight.is_nan() || weight <= 0.0 {
            continue;
        }
        let weight = f64::from(weight);
        let arrival = match best {
            None => exponential(rng) / weight,
            Some((first, _)) => {
                if skip >= weight {
                    skip -= weight;
                    continue;
                }
                // It arrives before `first`: when, given that.
                let before = -(-weight * first).exp_m1();
                -(-rng.next_f64() * before).ln_1p() / weight
            }
        };
        if fits(id) {
            best = Some((arrival, id));
        }
        if let Some((first, _)) = best {
            skip = exponential(rng) / first;
        }
    }
    best.map(|(_, id)| id)
}

/// The likeliest token that `fits` (the lowest id among ties), in one pass:
/// only a token likelier than the best found so far is checked.
fn best_fitting(logits: &[f32], fits: &dyn Fn(u32) -> bool) -> Option<u32> {
    let mut best: Option<u32> = None;
    for (id, &logit) in logits.iter().enumerate() {
        let id = id as u32;
        if best.is_none_or(|b| logit > logits[b as usize]) && fits(id) {
            best = Some(id);
        }
    }
    best
}

/// Index of the largest logit (the lowest index among ties), as a backend
/// picks a greedy row's.
pub use bulkhead_kernels::backend::argmax;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjustments_kept_token_by_token_are_the_ones_made_whole() {
        // Every part: a repetition penalty over a prompt, presence and
        // frequency penalties whose sum passes through 0 (1 - 0.5 x 2),
        // biases (one id twice), and min_tokens' ban lifting at token 6.
        let mut rng = bulkhead_kernels::rng::SplitMix64(5);
        let vocab = 40u64;
        let params = SamplingParams {
            temperature: 0.7,
            repetition_penalty: 1.3,
            presence_penalty: 1.0,
            frequency_penalty: -0.5,
            logit_bias: vec![(3, 2.0), (17, -1.0), (3, 0.5), (39, 4.0)],
            min_tokens: 6,
            stop_token_ids: vec![7, 21],
            ..SamplingParams::default()
        };
        let cases = [
            params.clone(),
            SamplingParams {
                repetition_penalty: 1.0,
                ..params.clone()
            },
            SamplingParams {
                presence_penalty: 0.0,
                frequency_penalty: 0.0,
                ..params.clone()
            },
            SamplingParams {
                logit_bias: Vec::new(),
                min_tokens: 0,
                ..params
            },
        ];
        for params in cases {
            let prompt: Vec<u32> = (0..12).map(|_| (rng.next_u64() % vocab) as u32).collect();
            let new = || {
                let mut s = Sampler::with_eog(params.clone(), &[]);
                if params.repetition_penalty != 1.0 {
                    s.seen = prompt.iter().copied().collect();
                }
                s
            };
            let (mut kept, mut whole) = (new(), new());
            let mut changed = 0;
            for step in 0..60 {
                let _ = kept.pick();
                whole.adjust_made = false;
                let _ = whole.pick();
                assert_eq!(kept.adjustments(), whole.adjustments(), "step {step}");
                let before = kept.adjustments().to_vec();
                // Tokens seen before and not, again and again.
                let token = (rng.next_u64() % vocab) as u32;
                kept.take_pick(token);
                whole.take_pick(token);
                let _ = kept.pick();
                changed += usize::from(kept.adjustments() != before);
            }
            assert!(changed >= 20, "{changed} steps changed the list");
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax_of_the_raw_logits_with_the_likeliest_first() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        let exact = |i: usize| (f64::from(logits[i]) - z.ln()) as f32;
        let lp = Logprobs::of(&logits, 2, 3);
        assert_eq!(lp.token, 2);
        assert!((lp.logprob - exact(2)).abs() < 1e-6);
        // Ties (ids 1 and 3) in id order, then the next.
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 2]);
        for (id, logprob) in &lp.top {
            assert!((logprob - exact(*id as usize)).abs() < 1e-6);
        }
        let total: f64 = (0..5).map(|i| f64::from(exact(i)).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(Logprobs::of(&logits, 0, 0).top.is_empty());
        assert_eq!(Logprobs::of(&logits, 0, 99).top.len(), 5);
        // Not the biased or tempered distribution: the model's own.
        let s = Sampler::new(SamplingParams {
            temperature: 2.0,
            logit_bias: vec![(4, 100.0)],
            logprobs: Some(1),
            ..SamplingParams::default()
        });
        let lp = s.logprobs(&logits, 4).unwrap();
        assert!((lp.logprob - exact(4)).abs() < 1e-6);
        assert_eq!(lp.top[0].0, 1);
        assert_eq!(
            Sampler::new(SamplingParams::default()).logprobs(&logits, 1),
            None
        );
    }

    fn tiny_tokenizer() -> Arc<Tokenizer> {
        use bulkhead_kernels::testing::{tiny_llama, TinySpec};
        let gguf =
            bulkhead_kernels::gguf::Gguf::from_bytes(tiny_llama(&TinySpec::default())).unwrap();
        Arc::new(Tokenizer::from_gguf(&gguf).unwrap())
    }

    #[test]
    fn json_mode_keeps_the_output_a_json_object_and_ends_it_once_closed() {
        let tokenizer = tiny_tokenizer();
        let vocab = tokenizer.vocab_len();
        let id = |text: &str| {
            let ids = tokenizer
                .encode(text, bulkhead_kernels::tokenizer::EncodeOptions::default())
                .unwrap();
            assert_eq!(ids.len(), 1, "{text:?}");
            ids[0]
        };
        // "x" is the model's favourite (never JSON but in a string), then a
        // quote; after 40 tokens, a ranking that closes whatever is open
        // takes over.
        let (x, closers) = (id("x"), [id("\""), id("}"), id("]"), id(":"), id("0")]);
        for (temperature, seed) in [(0.0, 1), (1.0, 2), (1.5, 3)] {
            let mut sampler = Sampler::for_request(
                SamplingParams {
                    temperature,
                    seed,
                    json: Some(Arc::new(Schema::object())),
                    ..SamplingParams::default()
                },
                &tokenizer,
                &[],
            );
            let mut rng = SplitMix64(seed);
            let mut out = Vec::new();
            let mut ended = false;
            for step in 0..400 {
                let mut logits: Vec<f32> =
                    (0..vocab).map(|_| rng.next_f64() as f32 * 4.0).collect();
                logits[x as usize] = 30.0;
                logits[closers[0] as usize] = 20.0;
                if step >= 40 {
                    for (rank, &c) in closers.iter().enumerate() {
                        logits[c as usize] = 60.0 - 4.0 * rank as f32;
                    }
                }
                let token = sampler.sample(&logits);
                if tokenizer.is_eog(token) {
                    ended = true;
                    break;
                }
                assert!(
                    matches!(
                        tokenizer.token_type(token),
                        Ok(TokenType::Normal | TokenType::Byte)
                    ),
                    "a control token in JSON"
                );
                out.extend_from_slice(tokenizer.token_to_piece_bytes(token).unwrap());
                let mut prefix = Json::new(Arc::new(Schema::object()));
                assert!(
                    prefix.push(&out),
                    "not a JSON prefix: {:?}",
                    String::from_utf8_lossy(&out)
                );
            }
            assert!(ended, "never closed: {:?}", String::from_utf8_lossy(&out));
            let text = String::from_utf8(out).unwrap();
            let value: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert!(value.is_object(), "{text:?}");
            // "x" was taken where JSON allows it: inside strings.
            assert!(text.contains('x'), "{text:?}");
        }
    }

    #[test]
    fn a_schema_keeps_the_output_an_instance_and_ends_where_the_value_may() {
        let tokenizer = tiny_tokenizer();
        let vocab = tokenizer.vocab_len();
        let id = |text: &str| {
            let ids = tokenizer
                .encode(text, bulkhead_kernels::tokenizer::EncodeOptions::default())
                .unwrap();
            assert_eq!(ids.len(), 1, "{text:?}");
            ids[0]
        };
        let schema =
            |document: serde_json::Value| Some(Arc::new(Schema::compile(&document).unwrap()));
        let object = schema(serde_json::json!({
            "type": "object",
            "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                           "tag": {"enum": ["x", "y"]}, "maybe": {"type": "null"}},
            "required": ["n", "ok", "tag"]
        }));
        // Random logits, "x" the favourite; after 20 tokens a ranking that
        // closes what is open (a string, a container, a number) takes over.
        let closers = [id("\""), id("}"), id(","), id("0")];
        for (temperature, seed) in [(0.0, 1), (1.0, 2), (1.5, 3)] {
            let params = SamplingParams {
                temperature,
                seed,
                json: object.clone(),
                ..SamplingParams::default()
            };
            let mut sampler = Sampler::for_request(params, &tokenizer, &[]);
            let mut rng = SplitMix64(seed);
            let mut out = Vec::new();
            let mut ended = false;
            for step in 0..400 {
                let mut logits: Vec<f32> =
                    (0..vocab).map(|_| rng.next_f64() as f32 * 4.0).collect();
                logits[id("x") as usize] = 30.0;
                if step >= 20 {
                    for (rank, &c) in closers.iter().enumerate() {
                        logits[c as usize] = 60.0 - 4.0 * rank as f32;
                    }
                }
                let token = sampler.sample(&logits);
                if tokenizer.is_eog(token) {
                    ended = true;
                    break;
                }
                out.extend_from_slice(tokenizer.token_to_piece_bytes(token).unwrap());
            }
            let text = String::from_utf8(out).unwrap();
            assert!(ended, "never ended: {text:?}");
            let value: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert!(value["n"].is_i64(), "{text}");
            assert!(value["ok"].is_boolean(), "{text}");
            assert!(value["tag"] == "x" || value["tag"] == "y", "{text}");
            assert!(value.get("maybe").is_none_or(|m| m.is_null()), "{text}");
            assert!(value.as_object().unwrap().len() <= 4, "{text}");
        }
        // A top-level integer may end after any digit: the model's
        // end-of-generation is among what fits from then on, not before.
        let eog = tokenizer.eog_tokens()[0];
        let mut sampler = Sampler::for_request(
            SamplingParams {
                json: schema(serde_json::json!({"type": "integer"})),
                ..SamplingParams::default()
            },
            &tokenizer,
            &[],
        );
        let mut logits = vec![0.0f32; vocab];
        logits[eog as usize] = 50.0;
        logits[id("7") as usize] = 40.0;
        assert_eq!(sampler.sample(&logits), id("7"));
        assert_eq!(sampler.sample(&logits), eog);
    }

    #[test]
    fn the_race_draws_in_proportion_among_what_fits_and_checks_few() {
        let c = [
            (0, 4.0f32),
            (1, 2.0),
            (2, 1.0),
            (3, 1.0),
            (4, 8.0),
            (5, 0.0),
        ];
        let fits = |id: u32| id != 2 && id != 4;
        let mut rng = SplitMix64(9);
        let draws = 70_000;
        let mut counts = [0u32; 6];
        for _ in 0..draws {
            counts[race(&mut rng, &c, &fits).unwrap() as usize] += 1;
        }
        assert_eq!((counts[2], counts[4], counts[5]), (0, 0, 0), "{counts:?}");
        // 4 : 2 : 1 among tokens 0, 1 and 3.
        for (id, expected) in [(0, 4.0 / 7.0), (1, 2.0 / 7.0), (3, 1.0 / 7.0)] {
            let share = f64::from(counts[id]) / f64::from(draws);
            assert!(
                (share - expected).abs() < 0.01,
                "token {id}: {share} vs {expected}"
            );
        }
        assert_eq!(race(&mut rng, &c, &|_| false), None);
        assert_eq!(race(&mut rng, &[(7, 0.0)], &|_| true), None);
        // Over a vocabulary of equals, only the few that would arrive first
        // are checked, not the vocabulary.
        let vocabulary: Vec<(u32, f32)> = (0..49_152).map(|id| (id, 1.0)).collect();
        let checked = std::cell::Cell::new(0u32);
        for _ in 0..20 {
            checked.set(0);
            let counting = |id: u32| {
                checked.set(checked.get() + 1);
                id.is_multiple_of(2)
            };
            assert_eq!(race(&mut rng, &vocabulary, &counting).unwrap() % 2, 0);
            assert!(checked.get() < 100, "{} checks", checked.get());
        }
    }

    #[test]
    fn min_tokens_withholds_the_tokens_that_end_the_output_until_enough_came() {
        // Token 3 (end of generation) is the likeliest, then 5 (a stop
        // token), then 1: greedy and at temperature 1 alike, neither comes
        // before 3 tokens are out, and 3 ends the output only from then.
        let logits = [0.0, 1.0, 0.0, 9.0, 0.0, 5.0];
        for temperature in [0.0, 1.0] {
            let params = SamplingParams {
                temperature,
                stop_token_ids: vec![5],
                min_tokens: 3,
                seed: 9,
                ..SamplingParams::default()
            };
            let mut s = Sampler::with_eog(params.clone(), &[3]);
            for n in 0..3 {
                // Stops are looked for from the third token's text on.
                assert!(!s.looks_for_stops(), "before token {n}");
                let token = s.sample(&logits);
                assert!(![3, 5].contains(&token), "token {n}: {token}");
                assert!(!s.ends_output(token, token == 3));
                // Even where it would end it, it does not yet.
                assert!(!s.ends_output(3, true) && !s.ends_output(5, false));
            }
            assert!(s.looks_for_stops());
            let fourth = s.sample(&logits);
            if temperature == 0.0 {
                assert_eq!(fourth, 3);
            }
            assert!(s.ends_output(3, true) && s.ends_output(5, false));
            assert!(!s.ends_output(1, false));
            // Under ignore_eos only the stop token is withheld and ends.
            let mut s = Sampler::with_eog(
                SamplingParams {
                    ignore_eos: true,
                    ..params.clone()
                },
                &[3],
            );
            let first = s.sample(&logits);
            assert_ne!(first, 5);
            if temperature == 0.0 {
                assert_eq!(first, 3);
            }
            assert!(!s.ends_output(3, true));
        }
        // Without min_tokens nothing is withheld: greedy takes the end.
        let mut s = Sampler::with_eog(
            SamplingParams {
                stop_token_ids: vec![5],
                ..SamplingParams::default()
            },
            &[3],
        );
        assert!(s.looks_for_stops());
        assert_eq!(s.sample(&logits), 3);
        assert!(s.ends_output(3, true) && s.ends_output(5, false));
    }

    #[test]
    fn a_draw_whose_likeliest_tokens_never_fit_still_draws_among_the_rest() {
        // Tokens 0..16 hold almost all the weight and never fit; 16..20
        // share the rest 1 : 1 : 2 : 0 (token 19's weight is 0 in f32).
        let mut logits = vec![10.0f32; 16];
        logits.extend([0.0, 0.0, 2f32.ln(), -200.0]);
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 5,
            ..SamplingParams::default()
        });
        let fits = |id: u32| id >= 16;
        let mut counts = [0u32; 20];
        for _ in 0..8_000 {
            counts[s.pick_free(&logits, &fits) as usize] += 1;
        }
        assert!(counts[..16].iter().all(|&n| n == 0), "{counts:?}");
        let share = |id: usize| f64::from(counts[id]) / 8_000.0;
        assert!((share(16) - 0.25).abs() < 0.03, "{counts:?}");
        assert!((share(17) - 0.25).abs() < 0.03, "{counts:?}");
        assert!((share(18) - 0.5).abs() < 0.03, "{counts:?}");
    }

    #[test]
    fn a_wide_nucleus_is_the_same_shortest_run_of_the_likeliest() {
        // 5,000 equals: the nucleus of 0.5 is the lower 2,500 ids (ties go
        // to the lower id), found past the first 64 and 1,024 looked at.
        let logits = vec![1.0f32; 5_000];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: 2,
            ..SamplingParams::default()
        });
        let picks: Vec<u32> = (0..4_000).map(|_| s.sample(&logits)).collect();
        assert!(picks.iter().all(|&t| t < 2_500), "{:?}", picks.iter().max());
        assert!(picks.iter().any(|&t| t >= 1_024) && picks.iter().any(|&t| t < 64));
        // 100 likely tokens among 5,000: a nucleus of 0.9 is some of them.
        let mut logits = vec![0.0f32; 5_000];
        for id in (0..5_000).step_by(50) {
            logits[id] = 20.0;
        }
        let picks: Vec<u32> = (0..2_000).map(|_| s.sample(&logits)).collect();
        assert!(picks.iter().all(|&t| t % 50 == 0), "{picks:?}");
    }

    #[test]
    fn min_p_drops_what_is_less_likely_than_its_share_of_the_likeliest() {
        // Relative to token 1: token 2 at e^-0.5 = 0.61, token 0 at e^-2 =
        // 0.14, token 3 at e^-4 = 0.02.
        let logits = [2.0, 4.0, 3.5, 0.0];
        let picks = |min_p| {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                min_p,
                seed: 11,
                ..SamplingParams::default()
            });
            (0..400)
                .map(|_| s.sample(&logits))
                .collect::<std::collections::HashSet<u32>>()
        };
        assert_eq!(picks(0.0), std::collections::HashSet::from([0, 1, 2, 3]));
        assert_eq!(picks(0.1), std::collections::HashSet::from([0, 1, 2]));
        assert_eq!(picks(0.5), std::collections::HashSet::from([1, 2]));
        assert_eq!(picks(1.0), std::collections::HashSet::from([1]));
    }

    #[test]
    fn repetition_penalty_scales_the_prompts_and_the_outputs_tokens() {
        let tokenizer = tiny_tokenizer();
        let greedy = |repetition_penalty, prompt: &[u32]| {
            let mut s = Sampler::for_request(
                SamplingParams {
                    repetition_penalty,
                    ..SamplingParams::default()
                },
                &tokenizer,
                prompt,
            );
            (0..4)
                .map(|_| s.sample(&[3.0, 2.0, -1.0, -1.2]))
                .collect::<Vec<_>>()
        };
        assert_eq!(greedy(1.0, &[0]), [0; 4]);
        // 3.0 / 2 = 1.5 < 2.0: a prompt token loses to token 1, which,
        // once generated, falls to 1.0; then 0 (1.5) and 1 (1.0) stay
        // penalized once, not per use.
        assert_eq!(greedy(2.0, &[0]), [1, 0, 0, 0]);
        // Negative logits are multiplied: -1.0 * 2 = -2.0 < -1.2.
        let mut s = Sampler::for_request(
            SamplingParams {
                repetition_penalty: 2.0,
                ..SamplingParams::default()
            },
            &tokenizer,
            &[0, 1, 2],
        );
        assert_eq!(s.sample(&[-5.0, -5.0, -1.0, -1.2]), 3);
    }

    #[test]
    fn logit_bias_bans_and_forces_tokens_greedy_or_not() {
        let logits = [1.0, 5.0, 4.9, -3.0];
        let params = |temperature, logit_bias| SamplingParams {
            temperature,
            logit_bias,
            seed: 3,
            ..SamplingParams::default()
        };
        // -100 bans the greedy choice: the runner-up wins.
        let mut s = Sampler::new(params(0.0, vec![(1, -100.0)]));
        assert!((0..5).all(|_| s.sample(&logits) == 2));
        // +100 forces the least likely token, at any temperature.
        let mut s = Sampler::new(params(2.0, vec![(3, 100.0)]));
        assert!((0..50).all(|_| s.sample(&logits) == 3));
        // Ids past the vocabulary change nothing (and do not panic).
        let mut s = Sampler::new(params(0.0, vec![(4, 100.0), (u32::MAX, 100.0)]));
        assert_eq!(s.sample(&logits), 1);
    }

    #[test]
    fn penalties_count_this_sequences_generated_tokens_as_openai_defines_them() {
        // Token 0 leads token 1 by 1.0; token 2 trails token 1 by 0.25.
        let logits = [3.0, 2.0, 1.75];
        let run = |presence_penalty, frequency_penalty| {
            let mut s = Sampler::new(SamplingParams {
                presence_penalty,
                frequency_penalty,
                ..SamplingParams::default()
            });
            (0..6).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(0.0, 0.0), [0; 6]);
        // Presence: once a token appeared it loses 1.5 for good: 0 (3.0 ->
        // 1.5), then 1 (2.0 -> 0.5), then 2 (1.75 -> 0.25), then 0 again (1.5).
        assert_eq!(run(1.5, 0.0), [0, 1, 2, 0, 0, 0]);
        // Frequency: 0.6 per appearance: 0 at 3.0, at 2.4 (still ahead of
        // 2.0), then at 1.8, behind token 1; and so on, as computed here.
        let mut expected = Vec::new();
        let mut counts = [0u32; 3];
        for _ in 0..6 {
            let adjusted: Vec<f32> = (0..3).map(|i| logits[i] - 0.6 * counts[i] as f32).collect();
            let best = argmax(&adjusted);
            counts[best as usize] += 1;
            expected.push(best);
        }
        assert_eq!(run(0.0, 0.6), expected);
        assert_eq!(&expected[..3], [0, 0, 1]);
        // A negative penalty favours repeats: token 0 only.
        assert_eq!(run(-2.0, -2.0), [0; 6]);
    }

    #[test]
    fn greedy_picks_the_largest_and_the_first_of_ties() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0]), 1);
    }

    #[test]
    fn a_pick_is_taken_only_where_sample_would_pick_the_same() {
        // Rows with many ties: the pick is the argmax or the draw a backend
        // gives for them, of the row adjusted as the sampler says.
        let mut rng = SplitMix64(7);
        let rows: Vec<Vec<f32>> = (0..24)
            .map(|_| (0..64).map(|_| (rng.next_u64() % 9) as f32).collect())
            .collect();
        let sampled = SamplingParams {
            temperature: 1.0,
            seed: 3,
            ..SamplingParams::default()
        };
        // (name, parameters, rows the backend picks, whether adjustments
        // change some token from the unadjusted row's pick)
        let cases = [
            ("greedy", SamplingParams::default(), 24, false),
            ("sampled", sampled.clone(), 24, false),
            (
                "sampled, every filter",
                SamplingParams {
                    temperature: 0.7,
                    top_k: 20,
                    top_p: 0.8,
                    min_p: 0.05,
                    seed: 4,
                    ..SamplingParams::default()
                },
                24,
                false,
            ),
            (
                "sampled with a penalty",
                SamplingParams {
                    frequency_penalty: 0.5,
                    ..sampled.clone()
                },
                24,
                true,
            ),
            // The backend gives the token's log probabilities with it.
            (
                "log probabilities",
                SamplingParams {
                    logprobs: Some(2),
                    ..SamplingParams::default()
                },
                24,
                false,
            ),
            (
                "a bias",
                SamplingParams {
                    logit_bias: vec![(3, 1.0)],
                    ..SamplingParams::default()
                },
                24,
                true,
            ),
            (
                "a presence penalty",
                SamplingParams {
                    presence_penalty: 0.5,
                    ..SamplingParams::default()
                },
                24,
                true,
            ),
            (
                "min_tokens",
                SamplingParams {
                    min_tokens: 3,
                    stop_token_ids: vec![5],
                    ..SamplingParams::default()
                },
                24,
                false,
            ),
            (
                "sampled with a repetition penalty over the prompt",
                SamplingParams {
                    repetition_penalty: 1.5,
                    ..sampled.clone()
                },
                24,
                true,
            ),
            (
                "everything at once, a token under all four",
                SamplingParams {
                    presence_penalty: 0.3,
                    frequency_penalty: -0.2,
                    repetition_penalty: 0.8,
                    logit_bias: vec![(0, -1.0), (5, 2.5), (63, 100.0)],
                    min_tokens: 30,
                    stop_token_ids: vec![5, 63],
                    ..sampled.clone()
                },
                24,
                true,
            ),
        ];
        let tokenizer = tiny_tokenizer();
        let prompt: Vec<u32> = (0..40).step_by(3).collect();
        for (name, params, picks_expected, moves) in cases {
            // One sampler samples every row (as from the CPU backend, which
            // gives rows in full whatever is asked); the other takes the
            // backend's pick wherever it may: the same tokens, the same state.
            let sampler = |params| Sampler::for_request(params, &tokenizer, &prompt);
            let (mut sampling, mut picking) = (sampler(params.clone()), sampler(params));
            let (mut picks, mut elsewhere, mut moved) = (0, 0, 0);
            let mut candidates = Vec::new();
            for row in &rows {
                let pick = picking.pick();
                let adjustments = picking.adjustments().to_vec();
                // Asked twice (a step retried), the same draw and adjustments.
                assert_eq!(picking.pick(), pick, "{name}");
                assert_eq!(picking.adjustments(), adjustments, "{name}");
                assert_eq!(sampling.pick(), pick, "{name}");
                picks += usize::from(pick.is_token());
                // As the backend picks: the row adjusted where it lies.
                let mut adjusted = row.clone();
                adjust(&mut adjusted, &adjustments);
                let mut pick_from = |row: &[f32]| match pick {
                    Pick::Row => None,
                    Pick::Argmax => Some(argmax(row)),
                    Pick::Draw(draw) => Some(draw.pick(row, &mut candidates)),
                };
                moved += usize::from(pick_from(&adjusted) != pick_from(row));
                let token = match pick_from(&adjusted) {
                    None => picking.sample(row),
                    Some(id) => picking.take_pick(id),
                };
                elsewhere += usize::from(token != argmax(row));
                assert_eq!(token, sampling.sample(row), "{name}");
            }
            assert_eq!(picks, picks_expected, "{name}");
            if sampling.params.temperature > 0.0 {
                assert!(elsewhere > 0, "{name}: a draw that never leaves the argmax");
            }
            assert_eq!(moved > 0, moves, "{name}: adjustments that matter");
        }
        // A schema reads every row.
        let schema = Arc::new(Schema::compile(&serde_json::json!({"type": "integer"})).unwrap());
        let params = SamplingParams {
            json: Some(schema),
            ..SamplingParams::default()
        };
        assert_eq!(
            Sampler::for_request(params, &tiny_tokenizer(), &[]).pick(),
            Pick::Row
        );
    }

    #[test]
    fn same_seed_same_tokens_and_other_seed_differs() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let params = SamplingParams {
            temperature: 1.0,
            seed: 42,
            ..SamplingParams::default()
        };
        let run = |params: SamplingParams| {
            let mut s = Sampler::new(params);
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(params.clone()), run(params.clone()));
        assert_ne!(
            run(params.clone()),
            run(SamplingParams { seed: 43, ..params })
        );
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_never_leaves_the_nucleus() {
        let logits = [1.0, 5.0, 4.9, -3.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 1,
            ..SamplingParams::default()
        });
        assert!((0..20).all(|_| s.sample(&logits) == 1));
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            seed: 7,
            ..SamplingParams::default()
        });
        let picks: Vec<u32> = (0..200).map(|_| s.sample(&logits)).collect();
        assert!(picks.iter().all(|&t| t == 1 || t == 2));
        assert!(picks.contains(&1) && picks.contains(&2));
    }
}
