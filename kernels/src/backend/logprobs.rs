//! A row's log probabilities: a token's, and its likeliest alternatives',
//! in the model's own distribution. One definition for both sides: the
//! host computes them from a row it was given in full ([`Logprobs::of`]),
//! and the CUDA backend's `pick` kernel computes them on the device, where
//! the row lies, for a row it gives as its token alone
//! ([`SeqStep::logprobs`](super::SeqStep::logprobs)): the same top tokens
//! in the same order, each log probability within float rounding of the
//! host's (the device sums its weights in another order, and CUDA's `expf`
//! is within 2 ulp of e^x, libm's within 1).

/// Most alternatives a row's log probabilities may list (OpenAI's
/// `top_logprobs` bound).
pub const TOP_LOGPROBS_MAX: usize = 20;

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
        let sum: f64 = logits.iter().map(|&l| f64::from(weight(l - max))).sum();
        let log_z = max + sum.ln() as f32;
        let logprob = |id: u32| logits[id as usize] - log_z;
        // The likeliest `top` in one pass, kept in order (ids come in
        // ascending order, so a tie never displaces an earlier id).
        let top = top.min(logits.len()).min(TOP_LOGPROBS_MAX);
        let mut ids: Vec<u32> = Vec::with_capacity(top + 1);
        if top > 0 {
            for (id, &l) in logits.iter().enumerate() {
                if ids.len() == top && l.total_cmp(&logits[ids[top - 1] as usize]).is_le() {
                    continue;
                }
                let at = ids.partition_point(|&b| logits[b as usize].total_cmp(&l).is_ge());
                ids.insert(at, id as u32);
                ids.truncate(top);
            }
        }
        Logprobs {
            token,
            logprob: logprob(token),
            top: ids.into_iter().map(|id| (id, logprob(id))).collect(),
        }
    }
}

/// `e^x` for `x <= 0` (libm's: a log probability needs no device's bits,
/// unlike a draw's weight, [`super::draw::exp_rn`]), and 0 below f32's
/// smallest normal weight.
fn weight(x: f32) -> f32 {
    if x < -87.0 {
        0.0
    } else {
        x.exp()
    }
}
