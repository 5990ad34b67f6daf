//! Page content digests: XXH64 over the bits of the used KV values.
//!
//! For integrity, not secrecy (I5): a transfer's receiver recomputes the digest of every
//! page and compares before the first decode step; identity (owner, sequence, token and
//! page counts) is checked separately. XXH64 is hand-written here (transfer
//! verification is the product's core): sixty lines, checked against the reference
//! implementation's outputs, and 11-13 times the speed of the byte-at-a-time FNV-1a it
//! replaced: an 8k-token prompt's 180 MiB of SmolLM2 pages hash in ~17 ms instead of
//! ~210 ms (`bulkhead bench digest`, BENCHMARKS.md "Page digests"). Alone that is a
//! third to a half of a loopback transfer of the same bytes; hashed by the receiver as
//! each page arrives it adds nothing measurable, so a sender should hash as it sends.
//!
//! What is hashed for a page with `tokens_used` filled slots:
//!
//! ```text
//! tokens_used as u32 LE
//! for layer in 0..layers:
//!     K[layer][0..tokens_used][kv_dim]  as stored bits, LE (2 bytes f16, 4 f32)
//!     V[layer][0..tokens_used][kv_dim]  as stored bits, LE
//! ```
//!
//! Unused slots are not covered, so a page's digest does not depend on what the sender
//! left in slots it never wrote. Bits, not values: `-0.0` and `0.0` differ, and NaNs
//! are compared by payload.

use super::geometry::PageLayout;
use super::storage::KvValue;

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

/// A streaming XXH64 hasher (seed 0): the same digest however the input is
/// split across [`Xxh64::write`] calls.
#[derive(Clone, Debug)]
pub struct Xxh64 {
    lanes: [u64; 4],
    buffer: [u8; 32],
    buffered: usize,
    total: u64,
}

impl Default for Xxh64 {
    fn default() -> Self {
        Xxh64::new()
    }
}

fn round(lane: u64, input: u64) -> u64 {
    lane.wrapping_add(input.wrapping_mul(P2))
        .rotate_left(31)
        .wrapping_mul(P1)
}

fn merge(hash: u64, lane: u64) -> u64 {
    (hash ^ round(0, lane)).wrapping_mul(P1).wrapping_add(P4)
}

fn word(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(word)
}

impl Xxh64 {
    /// A hasher with seed 0.
    pub fn new() -> Self {
        Xxh64 {
            lanes: [P1.wrapping_add(P2), P2, 0, 0u64.wrapping_sub(P1)],
            buffer: [0; 32],
            buffered: 0,
            total: 0,
        }
    }

    fn stripe(lanes: &mut [u64; 4], stripe: &[u8]) {
        for (i, lane) in lanes.iter_mut().enumerate() {
            *lane = round(*lane, word(&stripe[i * 8..]));
        }
    }

    /// Hashes bytes in order.
    pub fn write(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        if self.buffered > 0 {
            let take = (32 - self.buffered).min(bytes.len());
            self.buffer[self.buffered..self.buffered + take].copy_from_slice(&bytes[..take]);
            self.buffered += take;
            bytes = &bytes[take..];
            if self.buffered < 32 {
                return;
            }
            let buffer = self.buffer;
            Self::stripe(&mut self.lanes, &buffer);
            self.buffered = 0;
        }
        let mut stripes = bytes.chunks_exact(32);
        for stripe in &mut stripes {
            Self::stripe(&mut self.lanes, stripe);
        }
        let rest = stripes.remainder();
        self.buffer[..rest.len()].copy_from_slice(rest);
        self.buffered = rest.len();
    }

    /// Hashes 16-bit values as their little-endian bytes, in order: the same
    /// digest as [`Xxh64::write`] of those bytes, without making them (whole
    /// stripes are read straight from the values).
    pub fn write_u16s(&mut self, mut values: &[u16]) {
        while self.buffered != 0 && !values.is_empty() {
            self.write(&values[0].to_le_bytes());
            values = &values[1..];
        }
        let mut stripes = values.chunks_exact(16);
        for stripe in &mut stripes {
            for (i, lane) in self.lanes.iter_mut().enumerate() {
                let w = &stripe[i * 4..i * 4 + 4];
                let word = u64::from(w[0])
                    | u64::from(w[1]) << 16
                    | u64::from(w[2]) << 32
                    | u64::from(w[3]) << 48;
                *lane = round(*lane, word);
            }
        }
        self.total += (values.len() - stripes.remainder().len()) as u64 * 2;
        for value in stripes.remainder() {
            self.write(&value.to_le_bytes());
        }
    }

    /// Hashes a u32 as its 4 little-endian bytes.
    pub fn write_u32(&mut self, value: u32) {
        self.write(&value.to_le_bytes());
    }

    /// The digest so far.
    pub fn finish(&self) -> u64 {
        let [v1, v2, v3, v4] = self.lanes;
        let mut hash = if self.total >= 32 {
            let hash = v1
                .rotate_left(1)
                .wrapping_add(v2.rotate_left(7))
                .wrapping_add(v3.rotate_left(12))
                .wrapping_add(v4.rotate_left(18));
            [v1, v2, v3, v4].into_iter().fold(hash, merge)
        } else {
            P5
        };
        hash = hash.wrapping_add(self.total);
        let mut tail = &self.buffer[..self.buffered];
        while tail.len() >= 8 {
            hash ^= round(0, word(tail));
            hash = hash.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
            tail = &tail[8..];
        }
        if tail.len() >= 4 {
            let half = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
            hash ^= u64::from(half).wrapping_mul(P1);
            hash = hash.rotate_left(23).wrapping_mul(P2).wrapping_add(P3);
            tail = &tail[4..];
        }
        for &byte in tail {
            hash ^= u64::from(byte).wrapping_mul(P5);
            hash = hash.rotate_left(11).wrapping_mul(P1);
        }
        hash ^= hash >> 33;
        hash = hash.wrapping_mul(P2);
        hash ^= hash >> 29;
        hash = hash.wrapping_mul(P3);
        hash ^ (hash >> 32)
    }
}

/// FNV-1a-64, byte at a time: the page digest before XXH64, kept only as the
/// baseline `bulkhead bench digest` measures against.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut state: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in bytes {
        state ^= u64::from(byte);
        state = state.wrapping_mul(0x0000_0100_0000_01b3);
    }
    state
}

/// The digest of one page's used contents.
///
/// `page` is one page's values, `// [layer][k|v][page_tokens][kv_dim]`; the transfer
/// receiver calls this on the values it received, the pool on the values it holds.
pub fn digest_page<T: KvValue>(layout: &PageLayout, page: &[T], tokens_used: u32) -> u64 {
    assert_eq!(page.len(), layout.page_values(), "not one page");
    let layers = (0..layout.geometry().layers).map(|layer| {
        let (k, v) = (layout.k_offset(layer), layout.v_offset(layer));
        let slab = layout.slab_values();
        (&page[k..k + slab], &page[v..v + slab])
    });
    digest_slabs(layout, tokens_used, layers)
}

/// The same digest from each layer's K and V slabs (`// [page_tokens][kv_dim]`
/// each, in layer order), wherever storage keeps them.
pub fn digest_slabs<'a, T: KvValue>(
    layout: &PageLayout,
    tokens_used: u32,
    layers: impl Iterator<Item = (&'a [T], &'a [T])>,
) -> u64 {
    let geometry = layout.geometry();
    assert_eq!(T::TYPE, geometry.kv_type, "values of another type");
    assert!(
        tokens_used <= geometry.page_tokens,
        "tokens_used {tokens_used} above page_tokens {}",
        geometry.page_tokens
    );
    let used = tokens_used as usize * layout.kv_dim();
    let mut hasher = Xxh64::new();
    hasher.write_u32(tokens_used);
    let mut count = 0;
    for (k, v) in layers {
        T::hash_into(&k[..used], &mut hasher);
        T::hash_into(&v[..used], &mut hasher);
        count += 1;
    }
    assert_eq!(count, geometry.layers, "one K and V slab per layer");
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvType, PoolGeometry};

    fn xxh64(bytes: &[u8]) -> u64 {
        let mut hasher = Xxh64::new();
        hasher.write(bytes);
        hasher.finish()
    }

    #[test]
    fn xxh64_matches_the_reference_implementation() {
        // From the reference implementation (python-xxhash 3.x, seed 0).
        assert_eq!(xxh64(b""), 0xef46_db37_51d8_e999);
        assert_eq!(xxh64(b"a"), 0xd24e_c4f1_a98c_6e5b);
        assert_eq!(xxh64(b"abc"), 0x44bc_2cf5_ad77_0999);
        assert_eq!(
            xxh64(b"Nobody inspects the spammish repetition"),
            0xfbce_a83c_8a37_8bf1
        );
        let long: Vec<u8> = (0..=255u8).cycle().take(768).chain(*b"xyz12").collect();
        assert_eq!(xxh64(&long), 0x9b7d_50c0_4781_8b1b);
        // From 16-bit values, at any alignment with what came before.
        for lead in [0, 1, 2, 5, 31] {
            let values: Vec<u16> = long[lead..]
                .chunks_exact(2)
                .map(|p| u16::from_le_bytes([p[0], p[1]]))
                .collect();
            let mut bytes = long[..lead].to_vec();
            bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
            let mut hasher = Xxh64::new();
            hasher.write(&long[..lead]);
            hasher.write_u16s(&values);
            assert_eq!(hasher.finish(), xxh64(&bytes), "after {lead} bytes");
        }
        // However the input is split across writes.
        for split in [1, 3, 31, 32, 33, 100] {
            let mut hasher = Xxh64::new();
            for piece in long.chunks(split) {
                hasher.write(piece);
            }
            assert_eq!(hasher.finish(), 0x9b7d_50c0_4781_8b1b, "pieces of {split}");
        }
    }

    #[test]
    fn fnv1a64_matches_reference_vectors() {
        // From the FNV reference test suite (draft-eastlake-fnv).
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    fn layout() -> PageLayout {
        PoolGeometry {
            pages_count: 1,
            page_tokens: 4,
            layers: 2,
            kv_heads: 1,
            head_dim: 2,
            kv_type: KvType::F32,
        }
        .layout()
        .unwrap()
    }

    #[test]
    fn digest_ignores_unused_slots() {
        let layout = layout();
        let mut page = vec![0.0f32; layout.page_values()];
        page[layout.k_offset(1)] = 1.5; // slot 0 of layer 1's K
        let before = digest_page(&layout, &page, 1);
        page[layout.v_offset(1) + layout.slot_offset(3)] = 9.0; // slot 3, unused
        assert_eq!(digest_page(&layout, &page, 1), before);
    }

    #[test]
    fn digest_changes_with_used_contents_and_token_count() {
        let layout = layout();
        let mut page = vec![0.0f32; layout.page_values()];
        let zero_one = digest_page(&layout, &page, 1);
        assert_ne!(digest_page(&layout, &page, 2), zero_one);
        page[layout.v_offset(0) + 1] = -0.0;
        assert_ne!(digest_page(&layout, &page, 1), zero_one);
    }
}
