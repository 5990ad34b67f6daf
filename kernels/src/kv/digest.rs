//! Page content digests: FNV-1a-64 over the bits of the used KV values.
//!
//! For integrity, not secrecy (I5): a transfer's receiver recomputes the digest of every
//! page and compares before the first decode step; identity (owner, sequence, token and
//! page counts) is checked separately. FNV-1a is hand-written here because it is ten
//! lines, has published test vectors, and needs no dependency.
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

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// An FNV-1a-64 hasher.
#[derive(Clone, Copy, Debug)]
pub struct Fnv1a64 {
    state: u64,
}

impl Default for Fnv1a64 {
    fn default() -> Self {
        Fnv1a64::new()
    }
}

impl Fnv1a64 {
    /// A hasher at the FNV offset basis.
    pub fn new() -> Self {
        Fnv1a64 {
            state: FNV_OFFSET_BASIS,
        }
    }

    /// Hashes bytes in order.
    pub fn write_bytes(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.state ^= u64::from(byte);
            self.state = self.state.wrapping_mul(FNV_PRIME);
        }
    }

    /// Hashes a u32 as its 4 little-endian bytes.
    pub fn write_u32(&mut self, value: u32) {
        self.write_bytes(&value.to_le_bytes());
    }

    /// The digest so far.
    pub fn finish(&self) -> u64 {
        self.state
    }
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
    let mut hasher = Fnv1a64::new();
    hasher.write_u32(tokens_used);
    let mut count = 0;
    for (k, v) in layers {
        for value in k[..used].iter().chain(&v[..used]) {
            value.hash_into(&mut hasher);
        }
        count += 1;
    }
    assert_eq!(count, geometry.layers, "one K and V slab per layer");
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvType, PoolGeometry};

    fn fnv(bytes: &[u8]) -> u64 {
        let mut hasher = Fnv1a64::new();
        hasher.write_bytes(bytes);
        hasher.finish()
    }

    #[test]
    fn fnv1a64_matches_reference_vectors() {
        // From the FNV reference test suite (draft-eastlake-fnv).
        assert_eq!(fnv(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv(b"foobar"), 0x8594_4171_f739_67e8);
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
