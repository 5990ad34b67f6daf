//! Adjustments to a sampled row's logits before its token is picked: the
//! repetition, presence and frequency penalties, a request's logit bias
//! and `min_tokens`' ban, each token's as one entry.
//!
//! One definition for both sides, as [`Draw`](super::Draw) is for the
//! draw: the host's sampler adjusts a row it was given in full with
//! [`adjust`], and the CUDA backend's `pick` kernel
//! (`kernels/cuda/sample.cu`) adjusts the row where it lies, on the device,
//! by the same entries in the same f32 operations before it picks the
//! row's token ([`SeqStep::adjust`](super::SeqStep::adjust)). An adjusted
//! row then crosses to the host as its token's 4 bytes, not as its
//! vocabulary's logits.

/// One token's adjustment. Its parts apply in this order, each only where
/// it changes something: the repetition penalty, then the penalty, then
/// the bias; a ban makes the logit -inf whatever the others.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adjust {
    /// The token.
    pub id: u32,
    /// Divides the logit where it is positive, multiplies it elsewhere
    /// (vLLM's and the CTRL paper's repetition penalty); 1 is none.
    pub repetition: f32,
    /// Subtracted next (presence plus frequency times the token's count);
    /// 0 is none.
    pub penalty: f32,
    /// Added last; 0 is none.
    pub bias: f32,
    /// Never picked: the logit becomes -inf.
    pub ban: bool,
}

/// Words of an [`Adjust`] in the CUDA backend's step buffer (sample.cu's
/// `AdjustEntry`): the id with the ban in its top bit, then the
/// repetition, penalty and bias as f32 bits.
pub const ADJUST_WORDS: usize = 4;

impl Adjust {
    /// An entry for `id` that changes nothing.
    pub fn none(id: u32) -> Adjust {
        Adjust {
            id,
            repetition: 1.0,
            penalty: 0.0,
            bias: 0.0,
            ban: false,
        }
    }

    /// `logit`, adjusted.
    pub fn apply(&self, logit: f32) -> f32 {
        if self.ban {
            return f32::NEG_INFINITY;
        }
        let mut x = logit;
        if self.repetition != 1.0 {
            x = if x > 0.0 {
                x / self.repetition
            } else {
                x * self.repetition
            };
        }
        if self.penalty != 0.0 {
            x -= self.penalty;
        }
        if self.bias != 0.0 {
            x += self.bias;
        }
        x
    }

    /// The entry as sample.cu's `AdjustEntry`; `None` for an id no
    /// vocabulary reaches (2^31 and above: the top bit is the ban's), which
    /// changes nothing.
    pub fn words(&self) -> Option<[u32; ADJUST_WORDS]> {
        (self.id < 1 << 31).then(|| {
            [
                self.id | u32::from(self.ban) << 31,
                self.repetition.to_bits(),
                self.penalty.to_bits(),
                self.bias.to_bits(),
            ]
        })
    }
}

/// Applies `list` to `row`; an entry past the row's end changes nothing.
/// Entries of one id apply one after another (a sampler gives one entry an id).
pub fn adjust(row: &mut [f32], list: &[Adjust]) {
    for entry in list {
        if let Some(logit) = row.get_mut(entry.id as usize) {
            *logit = entry.apply(*logit);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_part_applies_in_order_and_only_where_it_changes_something() {
        let entry = |repetition, penalty, bias, ban| Adjust {
            id: 0,
            repetition,
            penalty,
            bias,
            ban,
        };
        // Repetition divides a positive logit and multiplies the rest.
        assert_eq!(entry(2.0, 0.0, 0.0, false).apply(3.0), 1.5);
        assert_eq!(entry(2.0, 0.0, 0.0, false).apply(-3.0), -6.0);
        assert_eq!(entry(2.0, 0.0, 0.0, false).apply(0.0), 0.0);
        // Then the penalty, then the bias: (3 / 2 - 0.5) + 4.
        assert_eq!(entry(2.0, 0.5, 4.0, false).apply(3.0), 5.0);
        // A ban wins over everything.
        assert_eq!(entry(2.0, 0.5, 100.0, true).apply(3.0), f32::NEG_INFINITY);
        // Nothing to do leaves every bit: -0 stays -0 (an added 0 would
        // make it +0).
        let none = Adjust::none(0);
        assert_eq!(none.apply(-0.0).to_bits(), (-0.0f32).to_bits());
        assert!(none.apply(f32::NAN).is_nan());
        // Past the row's end, nothing.
        let mut row = [1.0f32, 2.0];
        adjust(
            &mut row,
            &[
                Adjust {
                    id: 1,
                    ..entry(1.0, 0.0, 1.0, false)
                },
                Adjust {
                    id: 7,
                    ..entry(1.0, 0.0, 1.0, false)
                },
            ],
        );
        assert_eq!(row, [1.0, 3.0]);
    }

    #[test]
    fn words_carry_the_ban_in_the_ids_top_bit() {
        let entry = Adjust {
            id: 5,
            repetition: 1.25,
            penalty: -0.5,
            bias: 2.0,
            ban: true,
        };
        let words = entry.words().unwrap();
        assert_eq!(words[0], 5 | 1 << 31);
        assert_eq!(f32::from_bits(words[1]), 1.25);
        assert_eq!(f32::from_bits(words[2]), -0.5);
        assert_eq!(f32::from_bits(words[3]), 2.0);
        assert_eq!(Adjust::none(1 << 31).words(), None);
    }
}
