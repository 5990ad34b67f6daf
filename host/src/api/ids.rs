//! Request ids that tell a client nothing about anyone else's traffic.
//!
//! A shared counter would let a tenant read every tenant's request rate from
//! the gaps between its own ids. Ids are a keyed permutation of a counter
//! instead: a four-round Feistel network over 64 bits whose round function is
//! SHA-256 under a key drawn at start-up. A permutation never repeats a value,
//! so ids stay unique within the process (the KV pool uses them as sequence
//! ids), and without the key consecutive ids look unrelated.

use crate::engine::request::RequestId;
use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicU64, Ordering};

/// Feistel rounds (four make a pseudorandom permutation from a pseudorandom function).
const ROUNDS: u8 = 4;

/// Hands out request ids.
pub struct RequestIds {
    next: AtomicU64,
    key: [u8; 32],
}

impl RequestIds {
    /// Ids under `key` (random at start-up).
    pub fn new(key: [u8; 32]) -> RequestIds {
        RequestIds {
            next: AtomicU64::new(0),
            key,
        }
    }

    /// Ids under a key from the operating system's generator.
    pub fn random() -> std::io::Result<RequestIds> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| std::io::Error::other(format!("randomness: {e}")))?;
        Ok(RequestIds::new(key))
    }

    /// The next id.
    pub fn next(&self) -> RequestId {
        RequestId(self.permute(self.next.fetch_add(1, Ordering::Relaxed)))
    }

    fn round(&self, round: u8, half: u32) -> u32 {
        let digest = Sha256::new()
            .chain_update(self.key)
            .chain_update([round])
            .chain_update(half.to_le_bytes())
            .finalize();
        u32::from_le_bytes([digest[0], digest[1], digest[2], digest[3]])
    }

    fn permute(&self, counter: u64) -> u64 {
        let (mut left, mut right) = ((counter >> 32) as u32, counter as u32);
        for round in 0..ROUNDS {
            (left, right) = (right, left ^ self.round(round, right));
        }
        (u64::from(left) << 32) | u64::from(right)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn ids_are_unique_and_their_gaps_say_nothing() {
        let ids = RequestIds::new([7; 32]);
        let drawn: Vec<u64> = (0..100_000).map(|_| ids.next().0).collect();
        let unique: HashSet<u64> = drawn.iter().copied().collect();
        assert_eq!(unique.len(), drawn.len(), "a permutation never repeats");
        // Consecutive ids are far apart and not in order.
        let ascending = drawn.windows(2).filter(|w| w[1] > w[0]).count();
        assert!(
            (40_000..60_000).contains(&ascending),
            "{ascending} of 99999 steps go up"
        );
        let small_gaps = drawn
            .windows(2)
            .filter(|w| w[1].abs_diff(w[0]) < 1 << 32)
            .count();
        assert!(small_gaps < 10, "{small_gaps} gaps below 2^32");
        // Another key, another sequence.
        let other = RequestIds::new([8; 32]);
        assert_ne!(other.next().0, drawn[0]);
    }
}
