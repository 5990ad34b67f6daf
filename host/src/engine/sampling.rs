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

use super::json::Json;
use bulkhead_kernels::rng::SplitMix64;
use bulkhead_kernels::tokenizer::{TokenType, Tokenizer};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

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
pub const TOP_LOGPROBS_MAX: u8 = 20;

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
    /// JSON mode: the output is a JSON object (see [`super::json`]).
    pub json: bool,
    /// Keep only tokens at least this likely relative to the likeliest (0: all).
    pub min_p: f32,
    /// Divides the positive logits of tokens already in the prompt or the
    /// output (multiplies the negative ones); 1: none.
    pub repetition_penalty: f32,
    /// An end-of-generation token does not end the output (it shows no text).
    pub ignore_eos: bool,
}

/// A generated token's log probability and its likeliest alternatives', in
/// the model's own distribution: the log-softmax of its logits, before bias,
/// penalties, temperature, top-k or top-p (vLLM's default, and what a client
/// comparing answers or scoring a label wants).
#[derive(Clone, Debug, PartialEq)]
pub struct Logprobs {
    /// The token generated.
    pub token: u32,
    /// Its log probability.
    pub logprob: f32,
    /// The likeliest tokens, most likely first (ties: the lower id first).
    pub top: Vec<(u32, f32)>,
}

impl Logprobs {
    /// `token`'s entry over `logits`, with `top` alternatives.
    pub fn of(logits: &[f32], token: u32, top: usize) -> Logprobs {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
        let log_z = max + sum.ln() as f32;
        let logprob = |id: u32| logits[id as usize] - log_z;
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let top = top.min(ids.len());
        let order = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        if top > 0 && top < ids.len() {
            ids.select_nth_unstable_by(top - 1, order);
        }
        ids.truncate(top);
        ids.sort_unstable_by(order);
        Logprobs {
            token,
            logprob: logprob(token),
            top: ids.into_iter().map(|id| (id, logprob(id))).collect(),
        }
    }
}

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
            json: false,
            min_p: 0.0,
            repetition_penalty: 1.0,
            ignore_eos: false,
        }
    }
}

impl SamplingParams {
    fn penalizes(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// A sampler with its own generator state (one per sequence).
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    candidates: Vec<(u32, f32)>,
    /// How often each token was generated (kept only under a penalty).
    generated: HashMap<u32, u32>,
    /// The adjusted logits, when there is anything to adjust.
    adjusted: Vec<f32>,
    /// JSON mode's recognizer and the vocabulary it reads tokens' bytes from.
    json: Option<(Json, Arc<Tokenizer>)>,
    /// The tokens of the prompt and the output so far (kept only under a
    /// repetition penalty).
    seen: HashSet<u32>,
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler {
            rng: SplitMix64(params.seed),
            params,
            candidates: Vec::new(),
            generated: HashMap::new(),
            adjusted: Vec::new(),
            json: None,
            seen: HashSet::new(),
        }
    }

    /// A sampler for `params` over `tokenizer`'s vocabulary, after `prompt`:
    /// in JSON mode it picks only tokens that keep the output a prefix of a
    /// JSON object, and an end-of-generation token once the object is closed.
    pub fn for_request(
        params: SamplingParams,
        tokenizer: &Arc<Tokenizer>,
        prompt: &[u32],
    ) -> Sampler {
        let json = params.json.then(|| (Json::new(), Arc::clone(tokenizer)));
        let seen = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Sampler {
            json,
            seen,
            ..Sampler::new(params)
        }
    }

    /// Whether an end-of-generation token leaves the output going.
    pub fn ignores_eos(&self) -> bool {
        self.params.ignore_eos
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
        let token = if self.params.logit_bias.is_empty()
            && self.generated.is_empty()
            && self.seen.is_empty()
        {
            self.pick(logits)
        } else {
            let mut adjusted = std::mem::take(&mut self.adjusted);
            adjusted.clear();
            adjusted.extend_from_slice(logits);
            let repetition = self.params.repetition_penalty;
            for &id in &self.seen {
                if let Some(logit) = adjusted.get_mut(id as usize) {
                    *logit = if *logit > 0.0 {
                        *logit / repetition
                    } else {
                        *logit * repetition
                    };
                }
            }
            let (presence, frequency) =
                (self.params.presence_penalty, self.params.frequency_penalty);
            for (&id, &count) in &self.generated {
                if let Some(logit) = adjusted.get_mut(id as usize) {
                    *logit -= presence + frequency * count as f32;
                }
            }
            for &(id, bias) in &self.params.logit_bias {
                if let Some(logit) = adjusted.get_mut(id as usize) {
                    *logit += bias;
                }
            }
            let token = self.pick(&adjusted);
            self.adjusted = adjusted;
            token
        };
        if self.params.penalizes() {
            *self.generated.entry(token).or_insert(0) += 1;
        }
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token);
        }
        token
    }

    /// [`Sampler::pick_free`], within JSON mode's constraint when it is on.
    fn pick(&mut self, logits: &[f32]) -> u32 {
        let Some((json, tokenizer)) = self.json.take() else {
            return self.pick_free(logits, &|_| true);
        };
        let (json, token) = if json.is_done() {
            // The object is closed: the output ends.
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
            let fits = |id: u32| {
                matches!(
                    tokenizer.token_type(id),
                    Ok(TokenType::Normal | TokenType::Byte)
                ) && tokenizer
                    .token_to_piece_bytes(id)
                    .is_ok_and(|bytes| !bytes.is_empty() && json.accepts(bytes))
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

    /// Greedy, or temperature, top-k and top-p, among the tokens that `fits`:
    /// the likeliest is tried first and a draw that does not fit is drawn
    /// again without it, so a constraint costs a check per rejected token
    /// rather than one per vocabulary entry; when every candidate was
    /// rejected, the likeliest token that fits of the whole vocabulary wins
    /// (or, where none fits, the likeliest).
    fn pick_free(&mut self, logits: &[f32], fits: &dyn Fn(u32) -> bool) -> u32 {
        // The likeliest tokens first: the best 64 (usually enough), then the rest.
        let best_fitting = |logits: &[f32]| {
            let order = |a: &u32, b: &u32| {
                logits[*b as usize]
                    .total_cmp(&logits[*a as usize])
                    .then(a.cmp(b))
            };
            let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
            let head = 64.min(ids.len());
            if head < ids.len() {
                ids.select_nth_unstable_by(head - 1, order);
            }
            let (first, rest) = ids.split_at_mut(head);
            first.sort_unstable_by(order);
            if let Some(&id) = first.iter().find(|&&id| fits(id)) {
                return Some(id);
            }
            rest.sort_unstable_by(order);
            rest.iter().copied().find(|&id| fits(id))
        };
        if self.params.temperature <= 0.0 {
            let best = argmax(logits);
            if fits(best) {
                return best;
            }
            return best_fitting(logits).unwrap_or(best);
        }
        let token = self.draw(logits, fits);
        token
            .or_else(|| best_fitting(logits))
            .unwrap_or_else(|| argmax(logits))
    }

    /// A draw among the temperature's, top-k's and top-p's candidates that
    /// fit; `None` when none does.
    fn draw(&mut self, logits: &[f32], fits: &dyn Fn(u32) -> bool) -> Option<u32> {
        let inv_t = 1.0 / self.params.temperature;
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, l * inv_t)),
        );
        let k = match self.params.top_k {
            0 => c.len(),
            k => k.min(TOP_K_MAX).min(c.len()),
        };
        if k < c.len() {
            c.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
            c.truncate(k);
        }
        c.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let max = c[0].1;
        let mut sum = 0.0f64;
        for cand in c.iter_mut() {
            cand.1 = (cand.1 - max).exp();
            sum += f64::from(cand.1);
        }
        // min-p: relative to the likeliest, whose weight is 1 (sorted: a prefix stays).
        let min_p = self.params.min_p;
        if min_p > 0.0 {
            let keep = c.partition_point(|cand| cand.1 >= min_p).max(1);
            sum -= c[keep..].iter().map(|cand| f64::from(cand.1)).sum::<f64>();
            c.truncate(keep);
        }
        // Nucleus: the shortest prefix whose mass reaches top_p.
        let top_p = f64::from(self.params.top_p.clamp(0.0, 1.0));
        let mut kept = 0.0f64;
        let mut keep = c.len();
        for (i, cand) in c.iter().enumerate() {
            kept += f64::from(cand.1);
            if kept >= top_p * sum {
                keep = i + 1;
                break;
            }
        }
        c.truncate(keep);
        // Draws until one fits; one that does not is taken out of the draw.
        while !c.is_empty() && kept > 0.0 {
            let mut target = self.rng.next_f64() * kept;
            let mut at = c.len() - 1;
            for (i, cand) in c.iter().enumerate() {
                target -= f64::from(cand.1);
                if target <= 0.0 {
                    at = i;
                    break;
                }
            }
            let token = c[at].0;
            if fits(token) {
                return Some(token);
            }
            kept -= f64::from(c[at].1);
            c.remove(at);
        }
        None
    }
}

/// Index of the largest logit (the lowest index among ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

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
                    json: true,
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
                let mut prefix = Json::new();
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
                .collect::<HashSet<u32>>()
        };
        assert_eq!(picks(0.0), HashSet::from([0, 1, 2, 3]));
        assert_eq!(picks(0.1), HashSet::from([0, 1, 2]));
        assert_eq!(picks(0.5), HashSet::from([1, 2]));
        assert_eq!(picks(1.0), HashSet::from([1]));
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
