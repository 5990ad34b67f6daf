//! AVX-512 VNNI kernels for the K-quants (Q4_K, Q5_K, Q6_K): each 256-weight
//! super-block of a row is decoded once into four 512-bit vectors of unsigned
//! codes in weight order, and dotted with up to [`TILE_TOKENS`] tokens' Q8_K
//! activations by `vpdpbusd`, so batched decode and prefill share one decode
//! across tokens (the row-at-a-time AVX2 kernels decode per token).
//!
//! ```text
//! codes[c]: weights 64c..64c+64 of the block   (u8: 0..15, 0..31 or 0..63)
//! x[t][c]:  the same 64 activations of token t  (i8)
//! dot[c] = vpdpbusd(0, codes[c], x[t][c])       16 x i32, 4 weights per lane
//! pair   = vpackssdw(dot[2p], dot[2p + 1])      32 x i16 (exact: invariant 2)
//! isum   = Σ_p vpmaddwd(pair, scales[p])        each i16 times its sub-block's scale
//! acc[t] = fma(cvt(isum), d_w * d_x[t], acc[t])
//! off    = vpmaddwd(bsums[t], off_w)            8 x i32: two 16-activation groups each
//! offset[t] = fma(cvt(off), d_x[t] * factor, offset[t])   (mins, or Q6_K's 32)
//! out[t] = hsum(acc[t] - offset[t])              once per row
//! ```
//!
//! The sub-block scales are packed to i16 as the dot products are
//! (`vpackssdw` of the per-lane scale vectors), so one `vpmaddwd` scales and
//! pairs two chunks; the offset stays in a vector accumulator of its own,
//! reduced once per row with the rest. Per token and block that is 4 dot products and 13
//! other vector operations (loads included).
//!
//! A block's sub-block scales (and Q4_K's and Q5_K's mins) are unpacked with
//! a few word operations and spread to their lanes by permutes, not in scalar
//! code per sub-block: at one token the unpacking is most of a block's work.
//!
//! Invariants:
//! 1. Runs only after `Isa::Avx512.is_available()` (the dispatcher's assert).
//! 2. Integer sums within a block are exact: codes <= 63 and |x| <= 127, 4 per
//!    lane per `vpdpbusd`, so |dot| <= 32,004 fits i16 (the packs saturate
//!    nothing); times a 6- or 8-bit scale and paired, far inside i32. Offsets:
//!    group sums (|s| <= 2,032) times mins (<= 63) or 32 x Q6_K's scales
//!    (|w| <= 4,096), paired: inside i32.
//! 3. Batch invariance: a token's result is the same sequence of operations
//!    whatever tile it lands in (tiles differ only in how many tokens share a
//!    decoded block), so it does not depend on who shares its step.

// Tiles index per-token arrays by t alongside the decoded block.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::activations::{QuantizedActivations, Q8_K_BSUM_LEN};
use super::blocks::{
    Q4_K_DMIN, Q4_K_QS, Q4_K_SCALES, Q5_K_QH, Q5_K_QS, Q6_K_D, Q6_K_QH, Q6_K_SCALES, QK_K,
};
use super::GgmlType;

/// Tokens sharing one decoded block: their accumulators, the codes and the
/// scales fit the 32 zmm registers.
const TILE_TOKENS: usize = 8;
/// Bytes of weight rows kept in cache while every token passes over them.
const GROUP_BYTES: usize = 16 * 1024;
/// 64-weight chunks per super-block.
const CHUNKS: usize = QK_K / 64;
/// Block sums (of 16 activations) per super-block.
const GROUPS: usize = QK_K / Q8_K_BSUM_LEN;

/// One decoded super-block.
struct Decoded {
    /// Unsigned codes, 64 per vector, in weight order.
    codes: [__m512i; CHUNKS],
    /// Each i32 lane's sub-block scale, per chunk.
    scales: [__m512i; CHUNKS],
    /// The block's scale `d`.
    d: f32,
    /// Per 16-activation group: the integer weight of its sum in the offset.
    off_w: __m512i,
    /// The offset's float factor (`dmin`, or `d` for Q6_K).
    off_factor: f32,
}

/// A decoded block as the token loop uses it: scales packed to i16 as the
/// dot products of chunk pairs are packed.
struct Packed {
    codes: [__m512i; CHUNKS],
    /// `vpackssdw(scales[2p], scales[2p + 1])`.
    scales: [__m512i; CHUNKS / 2],
    /// `off_w` as 16 x i16, in group order.
    off_w: __m256i,
    d: f32,
    off_factor: f32,
}

impl Decoded {
    #[inline(always)]
    unsafe fn packed(self) -> Packed {
        Packed {
            codes: self.codes,
            scales: [
                _mm512_packs_epi32(self.scales[0], self.scales[1]),
                _mm512_packs_epi32(self.scales[2], self.scales[3]),
            ],
            off_w: _mm512_cvtepi32_epi16(self.off_w),
            d: self.d,
            off_factor: self.off_factor,
        }
    }
}

/// A K-quant format's decoder.
trait KDecode {
    const BYTES: usize;
    /// # Safety
    /// `block` points at `BYTES` readable bytes; AVX-512 available.
    unsafe fn decode(block: &[u8]) -> Decoded;
}

struct Q4K;
struct Q5K;
struct Q6K;

/// `[a x 8][b x 8]` as i32 lanes.
#[inline(always)]
unsafe fn halves(a: i32, b: i32) -> __m512i {
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_set1_epi32(a)),
        _mm256_set1_epi32(b),
    )
}

/// The 12 packed bytes of Q4_K's and Q5_K's 6-bit scales and mins as 16
/// bytes: scales of sub-blocks 0..8, then their mins (ggml's `utmp` unpacking:
/// sub-blocks 4..8 keep their low 4 bits in bytes 8..12 and their top 2 in the
/// spare bits of bytes 0..8).
#[inline(always)]
fn unpack_scales_mins(packed: &[u8]) -> [u32; 4] {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| {
        u32::from_le_bytes([
            packed[4 * i],
            packed[4 * i + 1],
            packed[4 * i + 2],
            packed[4 * i + 3],
        ])
    };
    let (w0, w1, w2) = (word(0), word(1), word(2));
    [
        w0 & LOW6,
        (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4),
        w1 & LOW6,
        ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4),
    ]
}

/// Q4_K and Q5_K share their scales, mins and d/dmin.
#[inline(always)]
unsafe fn affine_k(block: &[u8], codes: [__m512i; CHUNKS]) -> Decoded {
    let unpacked = unpack_scales_mins(&block[Q4_K_SCALES..Q4_K_QS]);
    // i32 lanes 0..8: the scales of sub-blocks 0..8; lanes 8..16: their mins.
    let all = _mm512_cvtepu8_epi32(_mm_loadu_si128(unpacked.as_ptr() as *const __m128i));
    let mut scales = [_mm512_setzero_si512(); CHUNKS];
    for c in 0..CHUNKS {
        let (lo, hi) = (2 * c as i32, 2 * c as i32 + 1);
        scales[c] = _mm512_permutexvar_epi32(halves(lo, hi), all);
    }
    // Sub-block j covers activation groups 2j and 2j + 1.
    let mins = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    Decoded {
        codes,
        scales,
        d: super::avx2::f16c_at(block, 0),
        off_w: _mm512_permutexvar_epi32(mins, all),
        // w = d * sc * q - dmin * m: the offset is subtracted.
        off_factor: super::avx2::f16c_at(block, Q4_K_DMIN),
    }
}

/// Chunk `c`'s 32 nibble bytes as 64 codes: low nibbles (sub-block 2c), then
/// high nibbles (sub-block 2c + 1).
#[inline(always)]
unsafe fn nibble_chunk(qs: *const u8) -> (__m256i, __m256i) {
    let q = _mm256_loadu_si256(qs as *const __m256i);
    let low = _mm256_set1_epi8(0x0F);
    (
        _mm256_and_si256(q, low),
        _mm256_and_si256(_mm256_srli_epi16(q, 4), low),
    )
}

#[inline(always)]
unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

impl KDecode for Q4K {
    const BYTES: usize = GgmlType::Q4_K.block_bytes();
    #[inline(always)]
    unsafe fn decode(block: &[u8]) -> Decoded {
        let qs = block.as_ptr().add(Q4_K_QS);
        let mut codes = [_mm512_setzero_si512(); CHUNKS];
        for c in 0..CHUNKS {
            // Chunk c's 32 bytes lie inside the block.
            let (lo, hi) = nibble_chunk(qs.add(32 * c));
            codes[c] = join(lo, hi);
        }
        affine_k(block, codes)
    }
}

impl KDecode for Q5K {
    const BYTES: usize = GgmlType::Q5_K.block_bytes();
    #[inline(always)]
    unsafe fn decode(block: &[u8]) -> Decoded {
        let qs = block.as_ptr().add(Q5_K_QS);
        let qh = _mm256_loadu_si256(block.as_ptr().add(Q5_K_QH) as *const __m256i);
        let one = _mm256_set1_epi8(1);
        let mut codes = [_mm512_setzero_si512(); CHUNKS];
        for c in 0..CHUNKS {
            // Chunk c's 32 bytes lie inside the block.
            let (lo, hi) = nibble_chunk(qs.add(32 * c));
            let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c as i32));
            let h_lo = _mm256_slli_epi16(_mm256_and_si256(h, one), 4);
            let h_hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4);
            codes[c] = join(_mm256_or_si256(lo, h_lo), _mm256_or_si256(hi, h_hi));
        }
        affine_k(block, codes)
    }
}

impl KDecode for Q6K {
    const BYTES: usize = GgmlType::Q6_K.block_bytes();
    #[inline(always)]
    unsafe fn decode(block: &[u8]) -> Decoded {
        let p = block.as_ptr();
        let mut quarters = [_mm256_setzero_si256(); 8];
        for half in 0..2 {
            let ql0 = _mm256_loadu_si256(p.add(half * 64) as *const __m256i);
            let ql1 = _mm256_loadu_si256(p.add(half * 64 + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(p.add(Q6_K_QH + half * 32) as *const __m256i);
            let codes = super::avx2::q6_codes(ql0, ql1, qh);
            quarters[4 * half..4 * half + 4].copy_from_slice(&codes);
        }
        let mut sc = [0i32; GROUPS];
        for (i, s) in sc.iter_mut().enumerate() {
            *s = block[Q6_K_SCALES + i] as i8 as i32;
        }
        // Chunk c's lanes 4i..4i+4 are sub-block 4c + i: widen 4 scales, then
        // repeat each over its 4 lanes.
        let all = _mm512_loadu_si512(sc.as_ptr() as *const __m512i);
        let mut scales = [_mm512_setzero_si512(); CHUNKS];
        for c in 0..CHUNKS {
            let base = 4 * c as i32;
            let index = _mm512_setr_epi32(
                base,
                base,
                base,
                base,
                base + 1,
                base + 1,
                base + 1,
                base + 1,
                base + 2,
                base + 2,
                base + 2,
                base + 2,
                base + 3,
                base + 3,
                base + 3,
                base + 3,
            );
            scales[c] = _mm512_permutexvar_epi32(index, all);
        }
        let d = super::avx2::f16c_at(block, Q6_K_D);
        let mut codes = [_mm512_setzero_si512(); CHUNKS];
        for c in 0..CHUNKS {
            codes[c] = join(quarters[2 * c], quarters[2 * c + 1]);
        }
        Decoded {
            codes,
            scales,
            d,
            // Codes are q + 32: subtract 32 * sc_g * (sum of group g).
            off_w: _mm512_slli_epi32::<5>(all),
            off_factor: d,
        }
    }
}

/// K-quant matmul; arguments already validated by the dispatcher.
pub fn matmul(
    ty: GgmlType,
    w: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    // SAFETY (every arm): the dispatcher asserted AVX-512 and the shapes.
    unsafe {
        match ty {
            GgmlType::Q4_K => drive::<Q4K>(w, k, rows, xq, out),
            GgmlType::Q5_K => drive::<Q5K>(w, k, rows, xq, out),
            GgmlType::Q6_K => drive::<Q6K>(w, k, rows, xq, out),
            _ => unreachable!("{ty:?} is not a K-quant"),
        }
    }
}

/// Row groups that stay in cache, token tiles over each group's rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn drive<K: KDecode>(
    w: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    let nb = k / QK_K;
    let row_bytes = nb * K::BYTES;
    let (n_rows, n_tokens) = (rows.len(), xq.n_tokens());
    let group_rows = (GROUP_BYTES / row_bytes).max(1);
    for group_start in (0..n_rows).step_by(group_rows) {
        let group = group_start..(group_start + group_rows).min(n_rows);
        let mut t = 0;
        while t < n_tokens {
            let tile = (n_tokens - t).min(TILE_TOKENS);
            for i in group.clone() {
                let r = rows.start + i;
                let w_row = &w[r * row_bytes..(r + 1) * row_bytes];
                let mut sums = [0.0f32; TILE_TOKENS];
                match tile {
                    TILE_TOKENS => row_tile::<K, TILE_TOKENS>(w_row, xq, t, &mut sums),
                    _ => {
                        for j in 0..tile {
                            row_tile::<K, 1>(w_row, xq, t + j, &mut sums[j..j + 1]);
                        }
                    }
                }
                for j in 0..tile {
                    out[(t + j) * n_rows + i] = sums[j];
                }
            }
            t += tile;
        }
    }
}

/// One row against tokens `t0..t0 + T`: writes their dot products to `sums`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn row_tile<K: KDecode, const T: usize>(
    w_row: &[u8],
    xq: &QuantizedActivations,
    t0: usize,
    sums: &mut [f32],
) {
    let mut x: [(&[i8], &[f32], &[i16]); T] = [(&[], &[], &[]); T];
    for (j, x) in x.iter_mut().enumerate() {
        let (qs, d) = xq.q8_k_row(t0 + j);
        *x = (qs, d, xq.bsums(t0 + j));
    }
    let mut acc = [_mm512_setzero_ps(); T];
    // The offsets, apart: 8 lanes, half the work of a 16-lane accumulator.
    let mut offset = [_mm256_setzero_ps(); T];
    for (b, block) in w_row.chunks_exact(K::BYTES).enumerate() {
        let block = K::decode(block).packed();
        for j in 0..T {
            let (qs, d, bsums) = x[j];
            let xs = qs.as_ptr().add(b * QK_K);
            let mut dots = [_mm512_setzero_si512(); CHUNKS];
            for c in 0..CHUNKS {
                let xv = _mm512_loadu_si512(xs.add(64 * c) as *const __m512i);
                dots[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), block.codes[c], xv);
            }
            // Invariant 2: each dot fits i16, so the packs are exact.
            let isum = _mm512_add_epi32(
                _mm512_madd_epi16(_mm512_packs_epi32(dots[0], dots[1]), block.scales[0]),
                _mm512_madd_epi16(_mm512_packs_epi32(dots[2], dots[3]), block.scales[1]),
            );
            let dx = d[b];
            acc[j] = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(isum),
                _mm512_set1_ps(block.d * dx),
                acc[j],
            );
            let group_sums = _mm256_loadu_si256(bsums.as_ptr().add(b * GROUPS) as *const __m256i);
            let off = _mm256_madd_epi16(group_sums, block.off_w);
            offset[j] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(off),
                _mm256_set1_ps(dx * block.off_factor),
                offset[j],
            );
        }
    }
    for j in 0..T {
        let offset = _mm512_zextps256_ps512(offset[j]);
        sums[j] = _mm512_reduce_add_ps(_mm512_sub_ps(acc[j], offset));
    }
}
