//! Token sampling: greedy at temperature 0, otherwise temperature, top-k and
//! top-p (nucleus) over a seeded generator, so a seed reproduces a completion.

use bulkhead_kernels::rng::SplitMix64;

/// Largest top-k honoured; larger values are clamped (the vocabulary is the real bound).
pub const TOP_K_MAX: usize = 1 << 16;

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
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// A sampler with its own generator state (one per sequence).
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler {
            rng: SplitMix64(params.seed),
            params,
            candidates: Vec::new(),
        }
    }

    /// Picks the next token from `logits` (`[vocab]`).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        assert!(!logits.is_empty(), "the vocabulary is never empty");
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
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
        let mut target = self.rng.next_f64() * kept;
        for cand in c.iter() {
            target -= f64::from(cand.1);
            if target <= 0.0 {
                return cand.0;
            }
        }
        c[c.len() - 1].0
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
