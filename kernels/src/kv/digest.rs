//! Page content digests: XXH3-64 over the bits of the used KV values, seeded
//! with the page's used slot count; XXH64 for the small digests (token ids, a
//! transfer's header and page digests, a model's fingerprint).
//!
//! For integrity, not secrecy (I5): a transfer's receiver recomputes the digest of every
//! page and compares before the first decode step; identity (owner, sequence, token and
//! page counts) is checked separately. Both hashes are hand-written here (transfer
//! verification is the product's core) and checked against the reference
//! implementation's outputs. The page digest was byte-at-a-time FNV-1a (~1 GB/s), then
//! XXH64 (~9 GB/s: still 8-11 % of a loopback transfer on 2 shared cores, BENCHMARKS.md
//! "Hashing off the engine thread"), now XXH3, whose long-input loop vectorizes:
//! several times XXH64's speed on the same core (`bulkhead bench digest`).
//!
//! What is hashed for a page with `tokens_used` filled slots, with seed
//! `tokens_used`:
//!
//! ```text
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

/// XXH3's default secret (the reference implementation's `XXH3_kSecret`).
const XXH3_SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
];

const P32_1: u64 = 0x9E37_79B1;
const P32_2: u64 = 0x85EB_CA77;
const P32_3: u64 = 0xC2B2_AE3D;
/// Bytes of one accumulation stripe.
const STRIPE: usize = 64;
/// Stripes between two scrambles: (192 - 64) / 8.
const STRIPES_PER_BLOCK: usize = 16;
const BLOCK: usize = STRIPE * STRIPES_PER_BLOCK;

fn read32(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u64::from(u32::from_le_bytes(word))
}

fn read64(bytes: &[u8], at: usize) -> u64 {
    word(&bytes[at..])
}

fn mul_fold(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

fn xxh64_avalanche(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

fn xxh3_avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

fn rrmxmx(mut h: u64, len: u64) -> u64 {
    h ^= h.rotate_left(49) ^ h.rotate_left(24);
    h = h.wrapping_mul(0x9FB2_1C65_1E98_DF25);
    h ^= (h >> 35).wrapping_add(len);
    h = h.wrapping_mul(0x9FB2_1C65_1E98_DF25);
    h ^ (h >> 28)
}

fn mix16(bytes: &[u8], at: usize, secret: &[u8], key: usize, seed: u64) -> u64 {
    mul_fold(
        read64(bytes, at) ^ read64(secret, key).wrapping_add(seed),
        read64(bytes, at + 8) ^ read64(secret, key + 8).wrapping_sub(seed),
    )
}

/// XXH3-64 of `bytes` with `seed`: the reference implementation's
/// `XXH3_64bits_withSeed`, bit for bit (checked against python-xxhash). Its
/// long-input loop is 32×32→64-bit multiplies over eight lanes, four to a
/// vector with AVX2: several times XXH64's speed on the same core
/// (`bulkhead bench digest`).
pub fn xxh3_64(bytes: &[u8], seed: u64) -> u64 {
    let len = bytes.len();
    let s = &XXH3_SECRET;
    let n = len as u64;
    if len <= 16 {
        if len > 8 {
            let flip1 = (read64(s, 24) ^ read64(s, 32)).wrapping_add(seed);
            let flip2 = (read64(s, 40) ^ read64(s, 48)).wrapping_sub(seed);
            let lo = read64(bytes, 0) ^ flip1;
            let hi = read64(bytes, len - 8) ^ flip2;
            let acc = n
                .wrapping_add(lo.swap_bytes())
                .wrapping_add(hi)
                .wrapping_add(mul_fold(lo, hi));
            return xxh3_avalanche(acc);
        }
        if len >= 4 {
            let seed = seed ^ (u64::from((seed as u32).swap_bytes()) << 32);
            let flip = (read64(s, 8) ^ read64(s, 16)).wrapping_sub(seed);
            let input = read32(bytes, len - 4).wrapping_add(read32(bytes, 0) << 32);
            return rrmxmx(input ^ flip, n);
        }
        if len > 0 {
            let combined = (u64::from(bytes[0]) << 16)
                | (u64::from(bytes[len >> 1]) << 24)
                | u64::from(bytes[len - 1])
                | (n << 8);
            let flip = (read32(s, 0) ^ read32(s, 4)).wrapping_add(seed);
            return xxh64_avalanche(combined ^ flip);
        }
        return xxh64_avalanche(seed ^ read64(s, 56) ^ read64(s, 64));
    }
    if len <= 128 {
        let mut acc = n.wrapping_mul(P1);
        if len > 32 {
            if len > 64 {
                if len > 96 {
                    acc = acc.wrapping_add(mix16(bytes, 48, s, 96, seed));
                    acc = acc.wrapping_add(mix16(bytes, len - 64, s, 112, seed));
                }
                acc = acc.wrapping_add(mix16(bytes, 32, s, 64, seed));
                acc = acc.wrapping_add(mix16(bytes, len - 48, s, 80, seed));
            }
            acc = acc.wrapping_add(mix16(bytes, 16, s, 32, seed));
            acc = acc.wrapping_add(mix16(bytes, len - 32, s, 48, seed));
        }
        acc = acc.wrapping_add(mix16(bytes, 0, s, 0, seed));
        acc = acc.wrapping_add(mix16(bytes, len - 16, s, 16, seed));
        return xxh3_avalanche(acc);
    }
    if len <= 240 {
        let mut acc = n.wrapping_mul(P1);
        for i in 0..8 {
            acc = acc.wrapping_add(mix16(bytes, 16 * i, s, 16 * i, seed));
        }
        acc = xxh3_avalanche(acc);
        for i in 8..len / 16 {
            acc = acc.wrapping_add(mix16(bytes, 16 * i, s, 16 * (i - 8) + 3, seed));
        }
        acc = acc.wrapping_add(mix16(bytes, len - 16, s, 136 - 17, seed));
        return xxh3_avalanche(acc);
    }
    let mut secret = XXH3_SECRET;
    if seed != 0 {
        for i in 0..12 {
            let lo = read64(&XXH3_SECRET, 16 * i).wrapping_add(seed);
            let hi = read64(&XXH3_SECRET, 16 * i + 8).wrapping_sub(seed);
            secret[16 * i..16 * i + 8].copy_from_slice(&lo.to_le_bytes());
            secret[16 * i + 8..16 * i + 16].copy_from_slice(&hi.to_le_bytes());
        }
    }
    let acc = long_accumulate(bytes, &secret);
    let mut result = n.wrapping_mul(P1);
    for i in 0..4 {
        result = result.wrapping_add(mul_fold(
            acc[2 * i] ^ read64(&secret, 11 + 16 * i),
            acc[2 * i + 1] ^ read64(&secret, 11 + 16 * i + 8),
        ));
    }
    xxh3_avalanche(result)
}

/// The eight lanes after every stripe of a long input (more than 240 bytes):
/// with AVX2 where the CPU has it (the reference implementation's AVX2 loop:
/// four lanes a vector, `vpmuludq` for the 32×32→64 products), else the
/// scalar body both are tested against.
fn long_accumulate(bytes: &[u8], secret: &[u8; 192]) -> [u64; 8] {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::quant::Isa::Avx2.is_available() {
            // SAFETY: AVX2 was detected on this CPU.
            return unsafe { long_accumulate_avx2(bytes, secret) };
        }
    }
    long_accumulate_body(bytes, secret)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn long_accumulate_avx2(bytes: &[u8], secret: &[u8; 192]) -> [u64; 8] {
    use std::arch::x86_64::*;
    let len = bytes.len();
    assert!(len > 240, "a long input");
    let load = |b: &[u8], at: usize| -> __m256i {
        let lane = &b[at..at + 32];
        // SAFETY: `lane` is 32 readable bytes; loadu needs no alignment.
        unsafe { _mm256_loadu_si256(lane.as_ptr().cast()) }
    };
    let init = [P32_3, P1, P2, P3, P4, P32_2, P5, P32_1];
    let mut acc = [0, 1].map(|i| {
        // SAFETY: `init` has 8 lanes; 4 are read from 4 * i.
        unsafe { _mm256_loadu_si256(init[4 * i..].as_ptr().cast()) }
    });
    let stripe = |acc: &mut [__m256i; 2], at: usize, key: usize| {
        for (i, lanes) in acc.iter_mut().enumerate() {
            let data = load(bytes, at + 32 * i);
            let keyed = _mm256_xor_si256(data, load(secret, key + 32 * i));
            // Each lane's high half beside its low half, multiplied.
            let high = _mm256_shuffle_epi32::<0b00_11_00_01>(keyed);
            let product = _mm256_mul_epu32(keyed, high);
            // acc[i ^ 1] += data[i]: the lanes of each pair swapped.
            let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(data);
            *lanes = _mm256_add_epi64(product, _mm256_add_epi64(*lanes, swapped));
        }
    };
    let prime = _mm256_set1_epi32(P32_1 as i32);
    let scramble = |acc: &mut [__m256i; 2]| {
        for (i, lanes) in acc.iter_mut().enumerate() {
            let mixed = _mm256_xor_si256(*lanes, _mm256_srli_epi64::<47>(*lanes));
            let keyed = _mm256_xor_si256(mixed, load(secret, 192 - STRIPE + 32 * i));
            let high = _mm256_shuffle_epi32::<0b00_11_00_01>(keyed);
            let low = _mm256_mul_epu32(keyed, prime);
            let high = _mm256_mul_epu32(high, prime);
            *lanes = _mm256_add_epi64(low, _mm256_slli_epi64::<32>(high));
        }
    };
    let blocks = (len - 1) / BLOCK;
    for block in 0..blocks {
        for s in 0..STRIPES_PER_BLOCK {
            stripe(&mut acc, block * BLOCK + s * STRIPE, 8 * s);
        }
        scramble(&mut acc);
    }
    let stripes = ((len - 1) - BLOCK * blocks) / STRIPE;
    for s in 0..stripes {
        stripe(&mut acc, blocks * BLOCK + s * STRIPE, 8 * s);
    }
    stripe(&mut acc, len - STRIPE, 192 - STRIPE - 7);
    let mut out = [0u64; 8];
    for (i, lanes) in acc.iter().enumerate() {
        // SAFETY: `out` has 8 lanes; 4 are written from 4 * i.
        unsafe { _mm256_storeu_si256(out[4 * i..].as_mut_ptr().cast(), *lanes) };
    }
    out
}

#[inline(always)]
fn long_accumulate_body(bytes: &[u8], secret: &[u8; 192]) -> [u64; 8] {
    let len = bytes.len();
    debug_assert!(len > 240);
    let mut acc = [P32_3, P1, P2, P3, P4, P32_2, P5, P32_1];
    let blocks = (len - 1) / BLOCK;
    for block in bytes[..blocks * BLOCK].chunks_exact(BLOCK) {
        for (s, stripe) in block.chunks_exact(STRIPE).enumerate() {
            accumulate_stripe(&mut acc, stripe, &secret[8 * s..8 * s + STRIPE]);
        }
        scramble(&mut acc, &secret[192 - STRIPE..]);
    }
    let stripes = ((len - 1) - BLOCK * blocks) / STRIPE;
    let rest = &bytes[blocks * BLOCK..];
    for (s, stripe) in rest.chunks_exact(STRIPE).take(stripes).enumerate() {
        accumulate_stripe(&mut acc, stripe, &secret[8 * s..8 * s + STRIPE]);
    }
    accumulate_stripe(
        &mut acc,
        &bytes[len - STRIPE..],
        &secret[192 - STRIPE - 7..192 - 7],
    );
    acc
}

#[inline(always)]
fn accumulate_stripe(acc: &mut [u64; 8], stripe: &[u8], key: &[u8]) {
    let (stripe, key) = (&stripe[..STRIPE], &key[..STRIPE]);
    let mut data = [0u64; 8];
    let mut keyed = [0u64; 8];
    for i in 0..8 {
        data[i] = read64(stripe, 8 * i);
        keyed[i] = data[i] ^ read64(key, 8 * i);
    }
    for i in 0..8 {
        acc[i ^ 1] = acc[i ^ 1].wrapping_add(data[i]);
        acc[i] = acc[i].wrapping_add((keyed[i] & 0xFFFF_FFFF) * (keyed[i] >> 32));
    }
}

#[inline(always)]
fn scramble(acc: &mut [u64; 8], key: &[u8]) {
    for (i, lane) in acc.iter_mut().enumerate() {
        let mut a = *lane;
        a ^= a >> 47;
        a ^= read64(key, 8 * i);
        *lane = a.wrapping_mul(P32_1);
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
    // The wire order, gathered: pages are hashed where they are contiguous
    // (a transfer's), and storage's digest is for audits and tests.
    let mut bytes =
        Vec::with_capacity(2 * used * geometry.layers as usize * geometry.kv_type.bytes() as usize);
    let mut count = 0;
    for (k, v) in layers {
        T::put_bits(&k[..used], &mut bytes);
        T::put_bits(&v[..used], &mut bytes);
        count += 1;
    }
    assert_eq!(count, geometry.layers, "one K and V slab per layer");
    xxh3_64(&bytes, u64::from(tokens_used))
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

    /// Bytes 0..n of a fixed pattern (the reference values below are
    /// python-xxhash 3.x's `xxh3_64_intdigest` of the same bytes).
    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| ((i * 31 + 7) & 0xff) as u8).collect()
    }

    #[test]
    fn xxh3_matches_the_reference_implementation_at_every_length_class() {
        // Every branch: 0, 1-3, 4-8, 9-16, 17-128, 129-240, and long inputs
        // within one block, across blocks, and an SmolLM2 page of one token.
        let reference: [(usize, u64, u64); 40] = [
            (0, 0, 0x2d06800538d394c2),
            (0, 16, 0xd6e8722abcda6801),
            (1, 0, 0x4c5cca45d0f4811f),
            (1, 16, 0x98e0645c9213a0da),
            (3, 0, 0x15f7093b173d005c),
            (3, 16, 0x037b20155ed675fe),
            (4, 0, 0xdca012f95811b6b9),
            (4, 16, 0x3ca513bf612505ef),
            (8, 0, 0xdec6a9a43575982e),
            (8, 16, 0xb59d796c50eb6fa9),
            (9, 0, 0xcbe393399f17ffbd),
            (9, 16, 0x8c35a29fca67579e),
            (16, 0, 0x7e484c18d74895d0),
            (16, 16, 0x8547e5e78268db5d),
            (17, 0, 0x208bde5ee2bed407),
            (17, 16, 0xb33a270ddfc4ac20),
            (64, 0, 0xdd30702ab46b3745),
            (64, 16, 0xbad7dc6bd968f2ad),
            (65, 0, 0xfab36b851b94ce20),
            (65, 16, 0x0f64c7c697a39897),
            (100, 0, 0x8c97158042fbf926),
            (100, 16, 0xfc8d0dbf41f3c9b4),
            (128, 0, 0xf92b70eaa21a6288),
            (128, 16, 0x4a8b1e0de665a2e0),
            (129, 0, 0xf8f76713f2bb60fa),
            (129, 16, 0x8cb58c17adfbc0bf),
            (200, 0, 0x12fdb864685f344d),
            (200, 16, 0xc8e68b05cf8b9a28),
            (240, 0, 0xccc7375172c41f03),
            (240, 16, 0x8cb7aa8b1272d596),
            (241, 0, 0x0b3b630948ce4a00),
            (241, 16, 0x96d1fb2efa6ebfb3),
            (1024, 0, 0x23bc880ebf0d29c6),
            (1024, 16, 0xee156b3d847adfe7),
            (1025, 0, 0xc09fdfbc398c7d82),
            (1025, 16, 0x2195fd57c654b605),
            (4100, 0, 0x12dfe4843fc71e92),
            (4100, 16, 0xa971fb72e6862175),
            (23044, 0, 0x848ba97ffad0b7a1),
            (23044, 16, 0x465776a85462d9f5),
        ];
        for (len, seed, want) in reference {
            assert_eq!(xxh3_64(&pattern(len), seed), want, "len {len} seed {seed}");
        }
    }

    /// The AVX2 path gives the scalar path's lanes at every length around the
    /// stripe and block edges.
    #[test]
    fn xxh3s_vector_path_agrees_with_the_scalar_path() {
        let bytes = pattern(4 * BLOCK + 3 * STRIPE + 9);
        for len in (241..bytes.len()).step_by(7) {
            let scalar = long_accumulate_body(&bytes[..len], &XXH3_SECRET);
            #[cfg(target_arch = "x86_64")]
            {
                use crate::quant::Isa;
                if Isa::Avx2.is_available() {
                    // SAFETY: AVX2 is available.
                    let avx2 = unsafe { long_accumulate_avx2(&bytes[..len], &XXH3_SECRET) };
                    assert_eq!(avx2, scalar, "avx2 at {len}");
                }
            }
            assert_eq!(long_accumulate(&bytes[..len], &XXH3_SECRET), scalar);
        }
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
