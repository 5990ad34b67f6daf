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
//! 3. `min_p`: those weighing at least `min_p` (the likeliest weighs 1).
//! 4. `top_p`: the shortest run of the likeliest whose weight reaches
//!    `top_p` of what is still kept.
//!
//! The uniform `u` then falls on the kept tokens laid end to end **in id
//! order**, each as long as its weight: an order that depends on the
//! logits alone, which a GPU finds with a prefix sum and no sort. A row
//! holding a NaN, or whose weights sum to nothing or to no number (an
//! infinite logit), gives its [`argmax`] instead.

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
    /// (cleared first); empty for a row holding a NaN.
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
        let mut reordered = false;
        let k = self.top_k as usize;
        if k > 0 && k < c.len() {
            c.select_nth_unstable_by(k - 1, likelier);
            c.truncate(k);
            reordered = true;
        }
        let max = c
            .iter()
            .map(|cand| cand.1)
            .fold(f32::NEG_INFINITY, f32::max);
        for cand in c.iter_mut() {
            cand.1 = weight(cand.1 - max);
        }
        if self.min_p > 0.0 {
            c.retain(|cand| cand.1 >= self.min_p);
        }
        let top_p = self.top_p.clamp(0.0, 1.0);
        if top_p < 1.0 {
            nucleus(c, f64::from(top_p));
            reordered = true;
        }
        if reordered {
            c.sort_unstable_by_key(|cand| cand.0);
        }
    }

    /// The index into `c` (kept candidates in id order, see
    /// [`Draw::candidates`]) that `u` falls on; `None` where their weights
    /// sum to nothing or to no number.
    pub fn walk(c: &[(u32, f32)], u: f64) -> Option<usize> {
        let kept = weight_sum(c);
        if c.is_empty() || kept.is_nan() || kept <= 0.0 {
            return None;
        }
        let mut target = u * kept;
        for (i, cand) in c.iter().enumerate() {
            target -= f64::from(cand.1);
            if target <= 0.0 {
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

/// `e^x` for `x <= 0`, and 0 below f32's smallest normal weight (a biased
/// or peaked row would otherwise spend its time in exp's underflow path).
pub fn weight(x: f32) -> f32 {
    if x < -87.0 {
        0.0
    } else {
        x.exp()
    }
}

/// Candidates' order of likelihood: the likelier first, then the lower id.
fn likelier(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The candidates' weights summed (in their order).
pub fn weight_sum(c: &[(u32, f32)]) -> f64 {
    c.iter().map(|cand| f64::from(cand.1)).sum()
}

/// Keeps the nucleus of `c` (weights): the shortest run of the likeliest
/// whose weight reaches `top_p` of the whole. The likeliest 64 are looked at
/// first, then 16 times as many at each round until they hold the nucleus:
/// a nucleus is usually small, and only the run looked at is sorted.
fn nucleus(c: &mut Vec<(u32, f32)>, top_p: f64) {
    let target = top_p * weight_sum(c);
    let mut head = 64;
    loop {
        let h = head.min(c.len());
        if h == 0 {
            return;
        }
        if h < c.len() {
            c.select_nth_unstable_by(h - 1, likelier);
        }
        if h == c.len() || weight_sum(&c[..h]) >= target {
            c[..h].sort_unstable_by(likelier);
            let mut kept = 0.0f64;
            let mut keep = h;
            for (i, cand) in c[..h].iter().enumerate() {
                kept += f64::from(cand.1);
                if kept >= target {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
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
