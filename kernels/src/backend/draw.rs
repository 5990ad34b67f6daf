//! A sampled token's draw: temperature, top-k, min-p and top-p over one row
//! of logits, then one uniform number walked over what is kept.
//!
//! One definition for every place a token is drawn: the host's sampler
//! draws with it from a row the backend gave in full, and the CUDA
//! backend's `pick` kernel (`kernels/cuda/sample.cu`) draws the same token
//! on the device, from the same row and the same uniform, where the step
//! asks it to ([`Pick::Draw`](super::Pick::Draw)): a sampled row then
//! crosses to the host as 4 bytes, not as its vocabulary's logits.
//!
//! What is kept, in this order (vLLM's and llama.cpp's meaning of each):
//!
//! 1. `top_k`: the `k` likeliest (larger value first, the lower id among
//!    ties); 0 keeps every token.
//! 2. Each kept token weighs `e^(x - max)`, `x` its logit over the
//!    temperature (0 below e^-87, f32's smallest normal).
//! 3. `min_p`: those weighing at least `min_p` (the likeliest weighs 1),
//!    and any of a larger logit (below: a weight can fall by an ulp where
//!    the logit rises).
//! 4. `top_p`: the shortest run of the likeliest whose weight reaches
//!    `top_p` of what is still kept.
//!
//! The uniform `u` then falls on the kept tokens laid end to end **in id
//! order**, each as long as its weight: an order that depends on the
//! logits alone, which a GPU finds with a prefix sum and no sort. A row
//! holding a NaN, or whose largest value is infinite, or whose kept weights
//! sum to nothing, gives its [`argmax`] instead.
//!
//! The device draws the same token from the same row and `u`, bit for bit
//! and not just nearly: a weight is [`exp_rn`] of `x - max` (single
//! operations each rounded once, none fused, where the device's `expf` is
//! within 2 ulp of `e^x` and libm's within 1), and weights are summed in
//! fixed point, as integers of 2^-40 of the likeliest's ([`fixed`]), so a
//! sum is exact in any order. Top-p's target and the walk's are
//! `ceil(p * total)` of those integers, in f64, on both sides; min-p keeps
//! the tokens whose logit is at or above the least logit (of the whole row)
//! weighing at least `min_p`.

use super::argmax;
use std::cmp::Ordering;

/// A draw's parameters and its uniform number.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    /// One over the temperature (above 0).
    pub inv_t: f32,
    /// Keep the likeliest this many; 0 (or the vocabulary or more) keeps all.
    pub top_k: u32,
    /// Keep the likeliest run reaching this share of the weight; 1 keeps all.
    pub top_p: f32,
    /// Keep tokens at least this fraction as likely as the likeliest; 0 keeps all.
    pub min_p: f32,
    /// The uniform number, in [0, 1), that picks among the kept.
    pub u: f64,
}

impl Draw {
    /// The kept tokens of `row` as `(id, weight)`, in id order, into `c`
    /// (cleared first); empty for a row holding a NaN or whose largest
    /// value is infinite.
    pub fn candidates(&self, row: &[f32], c: &mut Vec<(u32, f32)>) {
        c.clear();
        let mut nan = false;
        c.extend(row.iter().enumerate().map(|(i, &l)| {
            let x = l * self.inv_t;
            nan |= x.is_nan();
            (i as u32, x)
        }));
        if nan {
            c.clear();
            return;
        }
        // Each candidate holds its logit over the temperature, `x`, until
        // its weight replaces it; after that its `x` is read from the row.
        let x_of = |id: u32| row[id as usize] * self.inv_t;
        let mut reordered = false;
        // Whether a token top-k drops weighs at least min_p: then min-p's
        // least logit is below every token top-k keeps.
        let mut dropped_weighs = false;
        let k = self.top_k as usize;
        if k > 0 && k < c.len() {
            c.select_nth_unstable_by(k - 1, likelier);
            let max = largest(&c[..k]);
            if self.min_p > 0.0 && max.is_finite() {
                let floor = max + (self.min_p.ln() - 1.0);
                dropped_weighs = c[k..]
                    .iter()
                    .any(|cand| cand.1 >= floor && weight(cand.1 - max) >= self.min_p);
            }
            c.truncate(k);
            reordered = true;
        }
        let max = largest(c);
        if !max.is_finite() {
            c.clear();
            return;
        }
        for cand in c.iter_mut() {
            cand.1 = weight(cand.1 - max);
        }
        if self.min_p > 0.0 && !dropped_weighs {
            min_p(c, self.min_p, x_of);
        }
        let top_p = self.top_p.clamp(0.0, 1.0);
        if top_p < 1.0 {
            nucleus(c, max, top_p, x_of);
            reordered = true;
        }
        if reordered {
            c.sort_unstable_by_key(|cand| cand.0);
        }
    }

    /// The index into `c` (kept candidates in id order, see
    /// [`Draw::candidates`]) that `u` falls on: the first whose running sum
    /// of [`fixed`] weights reaches `ceil(u * total)`; `None` where they sum
    /// to nothing.
    pub fn walk(c: &[(u32, f32)], u: f64) -> Option<usize> {
        let kept: u64 = c.iter().map(|cand| fixed(cand.1)).sum();
        if kept == 0 {
            return None;
        }
        let target = (u * kept as f64).ceil() as u64;
        let mut sum = 0u64;
        for (i, cand) in c.iter().enumerate() {
            sum += fixed(cand.1);
            if sum >= target {
                return Some(i);
            }
        }
        Some(c.len() - 1)
    }

    /// The token this draw picks from `row` (`c` is scratch): the kept
    /// token `u` falls on, or the row's argmax where nothing is kept.
    pub fn pick(&self, row: &[f32], c: &mut Vec<(u32, f32)>) -> u32 {
        self.candidates(row, c);
        match Draw::walk(c, self.u) {
            Some(i) => c[i].0,
            None => argmax(row),
        }
    }
}

/// A token's weight: `e^x` ([`exp_rn`]) of `x`, its logit less the row's
/// largest (at most 0, not NaN), and 0 below f32's smallest normal weight
/// (a biased or peaked row would otherwise spend its time in exp's
/// underflow path). No branch, so that a loop of it vectorizes.
#[inline]
fn weight(x: f32) -> f32 {
    let w = exp_rn(x.max(-87.0));
    if x < -87.0 {
        0.0
    } else {
        w
    }
}

/// `e^x` for `x` in [-87, 88], within 1.2 ulp, in single operations each
/// rounded once and none fused, as the `pick` kernel's `exp_rn`
/// (`kernels/cuda/sample.cu`) computes it, constant for constant and
/// operation for operation: `x = n ln 2 + r` with `|r| <= ln 2 / 2` (ln 2
/// in two parts, the first exact times any such `n`), `e^r` by Taylor's
/// polynomial to `r^7`, times `2^n`.
#[inline]
pub fn exp_rn(x: f32) -> f32 {
    const LOG2_E: u32 = 0x3fb8_aa3b;
    const LN2_HIGH: u32 = 0x3f31_7200;
    const LN2_LOW: u32 = 0x35bf_be8e;
    // 1/7!, 1/6!, ... 1/2!, 1, 1.
    const TAYLOR: [u32; 8] = [
        0x3950_0d01,
        0x3ab6_0b61,
        0x3c08_8889,
        0x3d2a_aaab,
        0x3e2a_aaab,
        0x3f00_0000,
        0x3f80_0000,
        0x3f80_0000,
    ];
    // Rounded to the nearest integer (ties to even) by adding 1.5 * 2^23,
    // where no fraction survives, and taking it away: the integer is then
    // also the low bits of the sum, so 2^n is made from those (integer
    // operations, which vectorize where `rintf` and a float's conversion
    // do not).
    const ROUND: f32 = 12_582_912.0;
    let shifted = x * f32::from_bits(LOG2_E) + ROUND;
    let n = shifted - ROUND;
    let r = x - n * f32::from_bits(LN2_HIGH);
    let r = r - n * f32::from_bits(LN2_LOW);
    let mut p = f32::from_bits(TAYLOR[0]);
    for bits in &TAYLOR[1..] {
        p = p * r + f32::from_bits(*bits);
    }
    let two_to_n = shifted
        .to_bits()
        .wrapping_sub(ROUND.to_bits())
        .wrapping_add(127)
        << 23;
    p * f32::from_bits(two_to_n)
}

/// A weight (at most 1) in fixed point: whole units of 2^-40 (below
/// 2^-40, none). The device's `fixed`.
#[inline]
pub fn fixed(weight: f32) -> u64 {
    // A weight is at most 1, so the units fit an i64 (whose conversion is
    // one instruction where a u64's is several).
    (weight * FIXED_ONE) as i64 as u64
}

/// A weight of 1 in fixed point.
const FIXED_ONE: f32 = (1u64 << 40) as f32;

/// The largest of the candidates' values (none a NaN).
fn largest(c: &[(u32, f32)]) -> f32 {
    c.iter().fold(
        f32::NEG_INFINITY,
        |m, cand| if cand.1 > m { cand.1 } else { m },
    )
}

/// Candidates' order of likelihood: the likelier first, then the lower id.
fn likelier(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Keeps the candidates (weights; `x_of` their logits) whose logit is at or
/// above the least logit of them weighing at least `min_p` (none where
/// `min_p` is above 1: the largest weighs 1). Not simply those weighing at
/// least `min_p`: [`exp_rn`] can fall by an ulp where `x` rises, and the
/// device keeps logits. A weight below `min_p` by more than that is not
/// looked at again.
fn min_p(c: &mut Vec<(u32, f32)>, min_p: f32, x_of: impl Fn(u32) -> f32) {
    // Logits as integers ordered as `total_cmp` orders them; i32::MAX for
    // a token not weighing enough (no branch, in a pass over the row).
    let key = |x: f32| {
        let bits = x.to_bits() as i32;
        bits ^ ((((bits >> 31) as u32) >> 1) as i32)
    };
    let least = c
        .iter()
        .map(|cand| {
            if cand.1 >= min_p {
                key(x_of(cand.0))
            } else {
                i32::MAX
            }
        })
        .min()
        .unwrap_or(i32::MAX);
    if least == i32::MAX {
        // No weight reaches min_p (a NaN's key is above every logit's).
        c.clear();
        return;
    }
    let near = min_p * (1.0 - 1.0 / 1024.0); // far below exp_rn's falls (2^-22)
    c.retain(|cand| cand.1 >= min_p || (cand.1 >= near && key(x_of(cand.0)) >= least));
}

/// Keeps the nucleus of `c` (weights; `x_of` their logits, the largest
/// `max`): the shortest run of the likeliest (the larger logit first, then
/// the lower id) whose fixed-point weight reaches `ceil(top_p * total)` (at
/// least one). The likeliest 64 are looked at first, then 16 times as many
/// at each round until they hold the nucleus: a nucleus is usually small,
/// and only the run looked at is sorted. Meanwhile the candidates hold
/// their logits, and the run's weights are made again from them.
fn nucleus(c: &mut Vec<(u32, f32)>, max: f32, top_p: f32, x_of: impl Fn(u32) -> f32) {
    let total: u64 = c.iter().map(|cand| fixed(cand.1)).sum();
    let target = (f64::from(top_p) * total as f64).ceil() as u64;
    for cand in c.iter_mut() {
        cand.1 = x_of(cand.0);
    }
    let fixed_of = |cand: &(u32, f32)| fixed(weight(cand.1 - max));
    let mut head = 64;
    loop {
        let h = head.min(c.len());
        if h == 0 {
            return;
        }
        if h < c.len() {
            c.select_nth_unstable_by(h - 1, likelier);
        }
        if h == c.len() || c[..h].iter().map(fixed_of).sum::<u64>() >= target {
            c[..h].sort_unstable_by(likelier);
            let mut kept = 0u64;
            let mut keep = h;
            for (i, cand) in c[..h].iter().enumerate() {
                kept += fixed_of(cand);
                if kept >= target {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
            for cand in c.iter_mut() {
                cand.1 = weight(cand.1 - max);
            }
            return;
        }
        head *= 16;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(top_k: u32, top_p: f32, min_p: f32, u: f64) -> Draw {
        Draw {
            inv_t: 1.0,
            top_k,
            top_p,
            min_p,
            u,
        }
    }

    fn kept(d: Draw, row: &[f32]) -> Vec<u32> {
        let mut c = Vec::new();
        d.candidates(row, &mut c);
        c.iter().map(|cand| cand.0).collect()
    }

    #[test]
    fn each_filter_keeps_its_share_in_id_order() {
        // Weights e^0 = 1 (ids 1, 4), e^-1 (ids 0, 3), e^-3 (id 2).
        let row = [2.0, 3.0, 0.0, 2.0, 3.0];
        assert_eq!(kept(draw(0, 1.0, 0.0, 0.0), &row), [0, 1, 2, 3, 4]);
        // Ties go to the lower id: the third likeliest is id 0, not 3.
        assert_eq!(kept(draw(3, 1.0, 0.0, 0.0), &row), [0, 1, 4]);
        assert_eq!(kept(draw(1, 1.0, 0.0, 0.0), &row), [1]);
        assert_eq!(kept(draw(9, 1.0, 0.0, 0.0), &row), [0, 1, 2, 3, 4]);
        // min_p 0.3 keeps e^-1 = 0.37, not e^-3.
        assert_eq!(kept(draw(0, 1.0, 0.3, 0.0), &row), [0, 1, 3, 4]);
        // Total 2 + 2e^-1 + e^-3 = 2.79: top_p 0.7 needs 1.95, past ids 1
        // and 4 (2.0); top_p 0.8 needs 2.23, one more (id 0).
        assert_eq!(kept(draw(0, 0.7, 0.0, 0.0), &row), [1, 4]);
        assert_eq!(kept(draw(0, 0.8, 0.0, 0.0), &row), [0, 1, 4]);
        // top_p 0 keeps the likeliest alone.
        assert_eq!(kept(draw(0, 0.0, 0.0, 0.0), &row), [1]);
        // Applied in order: top-k 4, then the nucleus of what it kept.
        assert_eq!(kept(draw(4, 0.9, 0.0, 0.0), &row), [0, 1, 3, 4]);
    }

    #[test]
    fn the_uniform_walks_the_kept_in_id_order() {
        // Kept ids 1 and 4 weigh 1 each: u below a half picks id 1.
        let row = [2.0, 3.0, 0.0, 2.0, 3.0];
        let mut c = Vec::new();
        let picks: Vec<u32> = [0.0, 0.49, 0.51, 0.999]
            .iter()
            .map(|&u| draw(0, 0.7, 0.0, u).pick(&row, &mut c))
            .collect();
        assert_eq!(picks, [1, 1, 4, 4]);
        // The temperature divides the logits: at a huge one, all weigh ~1.
        let hot = Draw {
            inv_t: 1e-6,
            ..draw(0, 1.0, 0.0, 0.5)
        };
        assert_eq!(hot.pick(&row, &mut c), 2);
    }

    #[test]
    fn exp_rn_is_within_1_2_ulp_of_e_to_the_x() {
        let ulp = |y: f64| 2f64.powi(y.log2().floor() as i32 - 23);
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = f64::from(x).exp();
            worst = worst.max((f64::from(exp_rn(x)) - want).abs() / ulp(want));
            x += 0.000_71;
        }
        assert!(worst <= 1.2, "{worst} ulp");
        assert_eq!(exp_rn(0.0), 1.0);
        assert_eq!(exp_rn(-0.0), 1.0);
        // Below the range, no weight.
        assert_eq!(weight(-87.5), 0.0);
        assert_eq!(weight(-87.0), exp_rn(-87.0));
    }

    /// Every f32 in [-87, 0]: exp_rn may fall as x rises (it does, by an
    /// ulp, at -0.24999812: so min-p keeps logits, not weights), but never
    /// below 1 - 2^-22 of any weight before it (what [`min_p`] takes for
    /// "near"). About 1.1e9 values: `cargo test --release -p
    /// bulkhead-kernels --lib exp_rn_falls -- --ignored`.
    #[test]
    #[ignore]
    fn exp_rn_falls_by_at_most_2_ulp_over_every_f32_of_its_weights() {
        assert_eq!(
            worst_fall((-87.0f32).to_bits(), 0x8000_0000, 1),
            Some(-0.24999812)
        );
    }

    /// The first x (every `step`-th f32 from `from` up to `to`) where
    /// exp_rn falls; panics where it falls by more than 2^-22.
    fn worst_fall(from: u32, to: u32, step: usize) -> Option<f32> {
        // Negative floats rise as their bits fall, down to -0.
        let (mut high, mut first) = (0.0f32, None);
        for bits in (to..=from).rev().step_by(step) {
            let x = f32::from_bits(bits);
            let w = exp_rn(x);
            if w < high {
                assert!(
                    w >= high * (1.0 - 2f32.powi(-22)),
                    "exp_rn({x:e}) = {w:e}, below {high:e}"
                );
                first.get_or_insert(x);
            }
            high = high.max(w);
        }
        first
    }

    #[test]
    fn exp_rn_falls_by_at_most_2_ulp_over_a_sample_of_its_weights() {
        // Every 4,099th f32 of [-87, 0], and every one of [-0.5, -0.125].
        worst_fall((-87.0f32).to_bits(), 0x8000_0000, 4099);
        let fell = worst_fall((-0.5f32).to_bits(), (-0.125f32).to_bits(), 1);
        assert_eq!(fell, Some(-0.24999812));
    }

    #[test]
    fn weights_sum_in_fixed_point_so_the_order_of_terms_changes_nothing() {
        assert_eq!(fixed(1.0), 1 << 40);
        assert_eq!(fixed(0.5), 1 << 39);
        assert_eq!(fixed(2f32.powi(-41)), 0, "below a unit, none");
        // Weights whose f64 sums differ with their order: the walk's target
        // and every running sum are integers, the same either way.
        let weights = [1.0f32, 3e-8, 0.3, 1e-12, 0.7, 1.1e-7];
        let sum = |ws: &[f32]| ws.iter().map(|&w| fixed(w)).sum::<u64>();
        let mut reversed = weights;
        reversed.reverse();
        assert_eq!(sum(&weights), sum(&reversed));
        // A weight below 2^-40 is kept but never drawn, but where u is 0
        // and it comes first (as on the device: the first kept token).
        let c = [(0, 1e-13f32), (1, 1.0), (2, 1.0)];
        assert_eq!(Draw::walk(&c, 0.0), Some(0));
        assert_eq!(Draw::walk(&c, 1e-9), Some(1));
        assert_eq!(Draw::walk(&c, 0.5), Some(1));
        assert_eq!(Draw::walk(&c, 0.500_001), Some(2));
        assert_eq!(Draw::walk(&[(0, 1e-13)], 0.5), None, "nothing to walk");
    }

    #[test]
    fn min_p_keeps_every_logit_at_or_above_the_least_that_weighs_enough() {
        // Weights 1, e^-1, e^-1, e^-3 (ids 1, 0 and 3, 2): min_p e^-1 keeps
        // both e^-1 tokens, and a min_p above 1 keeps nothing (the argmax).
        let row = [2.0, 3.0, 0.0, 2.0];
        let e1 = weight(-1.0);
        assert_eq!(kept(draw(0, 1.0, e1, 0.0), &row), [0, 1, 3]);
        assert_eq!(kept(draw(0, 1.0, e1 * 1.000_001, 0.0), &row), [1]);
        assert_eq!(kept(draw(0, 1.0, 1.5, 0.0), &row), Vec::<u32>::new());
        assert_eq!(draw(0, 1.0, 1.5, 0.99).pick(&row, &mut Vec::new()), 1);
        // The least logit is the whole row's: after top-k 2 (ids 1 and 0),
        // min_p keeps id 0 (weighing e^-1).
        assert_eq!(kept(draw(2, 1.0, e1, 0.0), &row), [0, 1]);
        // Where exp_rn falls as x rises, min-p keeps the larger logit that
        // weighs a little less (as the device, which compares logits).
        let fall = -0.249_998_12f32;
        let below = (1..64)
            .map(|ulps| f32::from_bits(fall.to_bits() + ulps))
            .find(|&x| exp_rn(x) > exp_rn(fall))
            .expect("exp_rn falls at -0.24999812");
        let row = [0.0, fall, below, -5.0];
        assert_eq!(kept(draw(0, 1.0, exp_rn(below), 0.0), &row), [0, 1, 2]);
        assert_eq!(kept(draw(2, 1.0, exp_rn(below), 0.0), &row), [0, 1]);
    }

    #[test]
    fn the_nucleus_orders_equal_weights_by_their_logits() {
        // Ids 0 and 1 both weigh 1 (e^-1e-9 rounds to 1), but id 1's logit
        // is the larger: the likeliest, which a nucleus of one keeps.
        let row = [-2e-9, -1e-9, -5.0];
        assert_eq!(weight(-1e-9), weight(0.0));
        assert_eq!(kept(draw(0, 0.3, 0.0, 0.0), &row), [1]);
        assert_eq!(kept(draw(0, 0.6, 0.0, 0.0), &row), [0, 1]);
    }

    #[test]
    fn a_row_without_a_draw_gives_its_argmax() {
        let mut c = Vec::new();
        let nan = [1.0, f32::NAN, 2.0];
        assert_eq!(draw(0, 1.0, 0.0, 0.9).pick(&nan, &mut c), 2);
        let infinite = [1.0, f32::INFINITY, 2.0];
        assert_eq!(draw(0, 1.0, 0.0, 0.9).pick(&infinite, &mut c), 1);
        let none = [f32::NEG_INFINITY; 3];
        assert_eq!(draw(0, 1.0, 0.0, 0.9).pick(&none, &mut c), 0);
        // A finite row draws (the same infinite row under min_p keeps nothing).
        assert_eq!(draw(0, 1.0, 0.5, 0.9).pick(&infinite, &mut c), 1);
        assert_eq!(draw(0, 1.0, 0.0, 0.99).pick(&[0.0, 0.0], &mut c), 1);
    }
}
