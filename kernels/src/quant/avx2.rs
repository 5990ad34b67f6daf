//! AVX2 + FMA + F16C kernels: `vpmaddubsw` int8 dot products on 256-bit vectors.
//!
//! One 32-weight block is one `__m256i`. Per block and (row, token) pair:
//!
//! ```text
//! codes (u8, or |w| for Q8_0) x  x (i8, or sign(x, w) for Q8_0)
//!     --vpmaddubsw--> 16 x i16 --vpmaddwd(1)--> 8 x i32 --cvt--> 8 x f32
//!     --fma(dw*dx)--> acc[row][token]            and  msum += m * s  (offset term)
//! ```
//!
//! Invariants:
//! 1. Every function here runs only after the dispatcher confirmed avx2, fma and f16c
//!    (`Isa::Avx2.is_available()`); `Isa::Avx512` implies the same features.
//! 2. `vpmaddubsw` saturates at i16: pairs of (u8 <= 63) x (|i8| <= 127) cannot reach
//!    it, which is why Q8_0 uses the sign trick (|w| <= 128) rather than w + 128.
//! 3. Register tiles are `R` rows x `T` tokens; every row/token remainder is handled by
//!    the 1-wide instantiations, so any shape is covered.

// Register tiles index several per-row and per-token arrays by the same r and t;
// index loops say that more plainly than zipped iterators.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::activations::QuantizedActivations;
use super::blocks::{
    Q4_0_QS, Q4_1_M, Q4_1_QS, Q4_K_DMIN, Q4_K_QS, Q4_K_SCALES, Q5_0_QH, Q5_0_QS, Q5_1_M, Q5_1_QH,
    Q5_1_QS, Q5_K_QH, Q5_K_QS, Q6_K_D, Q6_K_QH, Q6_K_SCALES, Q8_0_QS, QK32, QK_K,
};
use super::scalar;
use super::GgmlType;

/// Weight rows per register tile.
const TILE_ROWS: usize = 4;
/// Tokens per register tile.
const TILE_TOKENS: usize = 2;

/// Weights are prefetched this many rows ahead (see `avx512::PREFETCH_ROWS`).
const PREFETCH_ROWS: usize = 4 * TILE_ROWS;

/// AVX2 matmul; arguments already validated by the dispatcher.
pub fn matmul(
    ty: GgmlType,
    w: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    // SAFETY (every arm): the dispatcher asserted AVX2/FMA/F16C and the buffer shapes.
    unsafe {
        match ty {
            GgmlType::Q4_0 => drive_b32::<Q4_0W>(w, k, rows, xq, out),
            GgmlType::Q4_1 => drive_b32::<Q4_1W>(w, k, rows, xq, out),
            GgmlType::Q5_0 => drive_b32::<Q5_0W>(w, k, rows, xq, out),
            GgmlType::Q5_1 => drive_b32::<Q5_1W>(w, k, rows, xq, out),
            GgmlType::Q8_0 => drive_b32::<Q8_0Signed>(w, k, rows, xq, out),
            GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16 => matmul_rowwise(ty, w, k, rows, xq, out),
        }
    }
}

/// A 32-weight block format decoded a pair of blocks (b, b + 1) at a time, in the
/// Q8_1 pair layout (see `activations`): 16-byte lanes `[b 0..16][b+1 0..16]` and
/// `[b 16..32][b+1 16..32]`.
pub(crate) trait PairDecode {
    /// Bytes per block.
    const BYTES: usize;
    /// Codes of weights 0..16 and 16..32 of both blocks at `p0` and `p1`.
    ///
    /// # Safety
    /// `p0`, `p1` each point at `BYTES` readable bytes; AVX2 available.
    unsafe fn codes(p0: *const u8, p1: *const u8) -> (__m256i, __m256i);
    /// `[d_b, m_b, d_b+1, m_b+1]`, where `block . x = d * dx * (codes . q) + m * s`.
    ///
    /// # Safety
    /// As for `codes`; F16C available.
    unsafe fn scales(p0: *const u8, p1: *const u8) -> __m128;
}

/// A pair decoder whose codes `vpmaddubsw` can take.
trait Avx2Dot: PairDecode {
    /// i32 lanes 0..4 hold block b's partial sums, lanes 4..8 block b + 1's.
    ///
    /// # Safety
    /// AVX2 available.
    unsafe fn dot(lo: __m256i, hi: __m256i, x_lo: __m256i, x_hi: __m256i) -> __m256i;
}

/// Four f16 at `p0`, `p0 + 2`, `p1`, `p1 + 2` as f32.
///
/// # Safety
/// `p0`, `p1` each point at 4 readable bytes; F16C available.
#[inline(always)]
unsafe fn f16x2_pair(p0: *const u8, p1: *const u8) -> __m128 {
    let lo = (p0 as *const i32).read_unaligned();
    let hi = (p1 as *const i32).read_unaligned();
    _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(lo), hi, 1))
}

/// The f16 at `block[offset..offset + 2]` as f32, by one F16C conversion
/// (`blocks::f16_at`, through the `half` crate, is a call per value here:
/// at one token, 10 % of a K-quant block's time; BENCHMARKS.md).
///
/// # Safety
/// F16C available.
#[inline(always)]
pub(crate) unsafe fn f16c_at(block: &[u8], offset: usize) -> f32 {
    let bits = u16::from_le_bytes([block[offset], block[offset + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// `[d_b, factor * d_b, d_b+1, factor * d_b+1]` from the f16 d at `p0` and `p1`.
///
/// # Safety
/// As for [`f16x2_pair`] with 2 readable bytes each.
#[inline(always)]
pub(crate) unsafe fn d_pair(p0: *const u8, p1: *const u8, factor: f32) -> __m128 {
    let d0 = (p0 as *const u16).read_unaligned() as i32;
    let d1 = (p1 as *const u16).read_unaligned() as i32;
    let halves = _mm_insert_epi32(_mm_cvtsi32_si128(d0 | (d0 << 16)), d1 | (d1 << 16), 1);
    _mm_mul_ps(_mm_cvtph_ps(halves), _mm_setr_ps(1.0, factor, 1.0, factor))
}

/// Nibbles of two 16-byte ggml nibble arrays: (low nibbles, high nibbles).
///
/// # Safety
/// `p0`, `p1` each point at 16 readable bytes; AVX2 available.
#[inline(always)]
pub(crate) unsafe fn nibble_pair(p0: *const u8, p1: *const u8) -> (__m256i, __m256i) {
    let q = _mm256_loadu2_m128i(p1 as *const __m128i, p0 as *const __m128i);
    let low = _mm256_set1_epi8(0x0F);
    (
        _mm256_and_si256(q, low),
        _mm256_and_si256(_mm256_srli_epi16(q, 4), low),
    )
}

/// Signed Q8_0 quants of a pair: (weights 0..16 of both, weights 16..32 of both).
///
/// # Safety
/// `p0`, `p1` each point at a Q8_0 block; AVX2 available.
#[inline(always)]
pub(crate) unsafe fn q8_pair(p0: *const u8, p1: *const u8) -> (__m256i, __m256i) {
    let (q0, q1) = (p0.add(Q8_0_QS), p1.add(Q8_0_QS));
    let lo = _mm256_loadu2_m128i(q1 as *const __m128i, q0 as *const __m128i);
    let hi = _mm256_loadu2_m128i(q1.add(16) as *const __m128i, q0.add(16) as *const __m128i);
    (lo, hi)
}

/// `0x10` in byte `i` where bit `i` of `bits` is set, 0 elsewhere: the fifth
/// bit of 32 five-bit codes (ggml's `bytes_from_bits_32`).
///
/// # Safety
/// AVX2 available.
#[inline(always)]
unsafe fn fifth_bits(bits: u32) -> __m256i {
    // Byte i takes byte i / 8 of `bits`, then keeps only its bit i % 8.
    let spread = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), spread);
    let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1));
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// Five-bit codes of a Q5_0 or Q5_1 pair, high bits at `qh` and nibbles at `qs`.
///
/// # Safety
/// `p0`, `p1` each point at a block of that type; AVX2 available.
#[inline(always)]
pub(crate) unsafe fn q5_pair(
    p0: *const u8,
    p1: *const u8,
    qh: usize,
    qs: usize,
) -> (__m256i, __m256i) {
    let (lo, hi) = nibble_pair(p0.add(qs), p1.add(qs));
    let h0 = (p0.add(qh) as *const u32).read_unaligned();
    let h1 = (p1.add(qh) as *const u32).read_unaligned();
    // Lanes [b 0..16][b+1 0..16] take bits 0..16 of each; the high lanes bits 16..32.
    let bits_lo = (h0 & 0xFFFF) | (h1 << 16);
    let bits_hi = (h0 >> 16) | (h1 & 0xFFFF_0000);
    (
        _mm256_or_si256(lo, fifth_bits(bits_lo)),
        _mm256_or_si256(hi, fifth_bits(bits_hi)),
    )
}

/// Q4_0 as nibbles 0..=15 with the -8 folded into m = -8 d.
pub(crate) struct Q4_0W;
/// Q4_1 as nibbles with its own min m.
pub(crate) struct Q4_1W;
/// Q5_0 as codes 0..=31 with the -16 folded into m = -16 d.
pub(crate) struct Q5_0W;
/// Q5_1 as codes 0..=31 with its own min m.
pub(crate) struct Q5_1W;
/// Q8_0 as signed bytes for the `vpmaddubsw` sign trick (m = 0).
struct Q8_0Signed;

impl PairDecode for Q5_0W {
    const BYTES: usize = GgmlType::Q5_0.block_bytes();
    #[inline(always)]
    unsafe fn codes(p0: *const u8, p1: *const u8) -> (__m256i, __m256i) {
        q5_pair(p0, p1, Q5_0_QH, Q5_0_QS)
    }
    #[inline(always)]
    unsafe fn scales(p0: *const u8, p1: *const u8) -> __m128 {
        d_pair(p0, p1, -16.0)
    }
}

impl PairDecode for Q5_1W {
    const BYTES: usize = GgmlType::Q5_1.block_bytes();
    #[inline(always)]
    unsafe fn codes(p0: *const u8, p1: *const u8) -> (__m256i, __m256i) {
        q5_pair(p0, p1, Q5_1_QH, Q5_1_QS)
    }
    #[inline(always)]
    unsafe fn scales(p0: *const u8, p1: *const u8) -> __m128 {
        const _: () = assert!(Q5_1_M == 2);
        f16x2_pair(p0, p1)
    }
}

impl PairDecode for Q4_0W {
    const BYTES: usize = GgmlType::Q4_0.block_bytes();
    #[inline(always)]
    unsafe fn codes(p0: *const u8, p1: *const u8) -> (__m256i, __m256i) {
        nibble_pair(p0.add(Q4_0_QS), p1.add(Q4_0_QS))
    }
    #[inline(always)]
    unsafe fn scales(p0: *const u8, p1: *const u8) -> __m128 {
        d_pair(p0, p1, -8.0)
    }
}

impl PairDecode for Q4_1W {
    const BYTES: usize = GgmlType::Q4_1.block_bytes();
    #[inline(always)]
    unsafe fn codes(p0: *const u8, p1: *const u8) -> (__m256i, __m256i) {
        nibble_pair(p0.add(Q4_1_QS), p1.add(Q4_1_QS))
    }
    #[inline(always)]
    unsafe fn scales(p0: *const u8, p1: *const u8) -> __m128 {
        // d and m are adjacent f16 at the block start: one u32 per block.
        const _: () = assert!(Q4_1_M == 2);
        f16x2_pair(p0, p1)
    }
}

impl PairDecode for Q8_0Signed {
    const BYTES: usize = GgmlType::Q8_0.block_bytes();
    #[inline(always)]
    unsafe fn codes(p0: *const u8, p1: *const u8) -> (__m256i, __m256i) {
        q8_pair(p0, p1)
    }
    #[inline(always)]
    unsafe fn scales(p0: *const u8, p1: *const u8) -> __m128 {
        d_pair(p0, p1, 0.0)
    }
}

impl Avx2Dot for Q4_0W {
    #[inline(always)]
    unsafe fn dot(lo: __m256i, hi: __m256i, x_lo: __m256i, x_hi: __m256i) -> __m256i {
        nibble_dot(lo, hi, x_lo, x_hi)
    }
}

impl Avx2Dot for Q4_1W {
    #[inline(always)]
    unsafe fn dot(lo: __m256i, hi: __m256i, x_lo: __m256i, x_hi: __m256i) -> __m256i {
        nibble_dot(lo, hi, x_lo, x_hi)
    }
}

impl Avx2Dot for Q5_0W {
    #[inline(always)]
    unsafe fn dot(lo: __m256i, hi: __m256i, x_lo: __m256i, x_hi: __m256i) -> __m256i {
        nibble_dot(lo, hi, x_lo, x_hi)
    }
}

impl Avx2Dot for Q5_1W {
    #[inline(always)]
    unsafe fn dot(lo: __m256i, hi: __m256i, x_lo: __m256i, x_hi: __m256i) -> __m256i {
        nibble_dot(lo, hi, x_lo, x_hi)
    }
}

impl Avx2Dot for Q8_0Signed {
    #[inline(always)]
    unsafe fn dot(lo: __m256i, hi: __m256i, x_lo: __m256i, x_hi: __m256i) -> __m256i {
        // |w| * sign(x, w) = w * x with the unsigned operand at most 128; each half is
        // widened to i32 on its own because two such i16 sums could overflow.
        let ones = _mm256_set1_epi16(1);
        let p_lo = _mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(x_lo, lo));
        let p_hi = _mm256_maddubs_epi16(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(x_hi, hi));
        _mm256_add_epi32(_mm256_madd_epi16(p_lo, ones), _mm256_madd_epi16(p_hi, ones))
    }
}

/// Four- or five-bit codes . quants: both halves' i16 pair sums (at most
/// 2 * 2 * 31 * 127 = 15,748) add without overflow before one widening `vpmaddwd`.
#[inline(always)]
unsafe fn nibble_dot(lo: __m256i, hi: __m256i, x_lo: __m256i, x_hi: __m256i) -> __m256i {
    let pairs = _mm256_add_epi16(
        _mm256_maddubs_epi16(lo, x_lo),
        _mm256_maddubs_epi16(hi, x_hi),
    );
    _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
}

/// Sum of the eight lanes.
///
/// # Safety
/// AVX available.
#[inline(always)]
pub(crate) unsafe fn hsum256(v: __m256) -> f32 {
    let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
}

/// Per-token activation pointers for a pair tile: (pair-interleaved quants, [d, s]).
pub(crate) type Q8Row = (*const i8, *const f32);

/// Token `t`'s Q8_1 row pointers.
pub(crate) fn q8_1_ptrs(xq: &QuantizedActivations, t: usize) -> Q8Row {
    let (qs, ds) = xq.q8_1_row(t);
    (qs.as_ptr(), ds.as_ptr())
}

/// Walks `rows` x tokens in `TILE_ROWS` x `TILE_TOKENS` tiles, remainders one wide.
///
/// # Safety
/// AVX2/FMA/F16C available; shapes validated by the dispatcher.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn drive_b32<W: Avx2Dot>(
    w: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    let nb = k / QK32;
    let row_bytes = nb * W::BYTES;
    let (n_rows, n_tokens) = (rows.len(), xq.n_tokens());
    let mut r = 0;
    while r < n_rows {
        let tile_rows = if n_rows - r >= TILE_ROWS {
            TILE_ROWS
        } else {
            1
        };
        // SAFETY: rows.end * row_bytes <= w.len() (dispatcher), so row r's blocks are in w.
        let w_rows = w.as_ptr().add((rows.start + r) * row_bytes);
        let mut t = 0;
        while t < n_tokens {
            let tile_tokens = if n_tokens - t >= TILE_TOKENS {
                TILE_TOKENS
            } else {
                1
            };
            // SAFETY: (t, r) indexes inside out = [n_tokens][n_rows]; the tile writes
            // only rows r..r+tile_rows and tokens t..t+tile_tokens of it.
            let o = out.as_mut_ptr().add(t * n_rows + r);
            let x2: [Q8Row; TILE_TOKENS] =
                std::array::from_fn(|i| q8_1_ptrs(xq, t + i.min(tile_tokens - 1)));
            let x1 = [x2[0]];
            match (tile_rows, tile_tokens) {
                (TILE_ROWS, TILE_TOKENS) => {
                    tile_pairs::<W, TILE_ROWS, TILE_TOKENS>(w_rows, row_bytes, nb, x2, o, n_rows)
                }
                (TILE_ROWS, _) => {
                    tile_pairs::<W, TILE_ROWS, 1>(w_rows, row_bytes, nb, x1, o, n_rows)
                }
                (_, TILE_TOKENS) => {
                    tile_pairs::<W, 1, TILE_TOKENS>(w_rows, row_bytes, nb, x2, o, n_rows)
                }
                _ => tile_pairs::<W, 1, 1>(w_rows, row_bytes, nb, x1, o, n_rows),
            }
            t += tile_tokens;
        }
        r += tile_rows;
    }
}

/// Byte offsets of pair `p`'s two blocks in a row of `nb` blocks; an odd last block is
/// paired with itself (its partner's activations are zero padding, so it adds 0).
#[inline(always)]
pub(crate) fn pair_offsets(p: usize, nb: usize, block_bytes: usize) -> (usize, usize) {
    let b0 = 2 * p;
    let b1 = if b0 + 1 < nb { b0 + 1 } else { b0 };
    (b0 * block_bytes, b1 * block_bytes)
}

/// Sum of lanes 1 and 3 (the m * s terms of a pair-scale accumulator).
///
/// # Safety
/// SSE available (always on x86_64).
#[inline(always)]
pub(crate) unsafe fn offset_lanes(v: __m128) -> f32 {
    let folded = _mm_add_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_shuffle_ps(folded, folded, 1))
}

/// One `R` x `T` register tile over all blocks; writes `out[t * out_stride + r]`.
///
/// # Safety
/// `w_rows` holds `R` rows of `row_bytes`; each `x` row holds `nb` blocks, padded to
/// whole pairs; `out` has the `T` x `R` slots; AVX2/FMA/F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_pairs<W: Avx2Dot, const R: usize, const T: usize>(
    w_rows: *const u8,
    row_bytes: usize,
    nb: usize,
    x: [Q8Row; T],
    out: *mut f32,
    out_stride: usize,
) {
    // Lanes 0..4 (block b) take the product's lane 0, lanes 4..8 its lane 2.
    let spread = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut offset = [[_mm_setzero_ps(); T]; R];
    for p in 0..nb.div_ceil(2) {
        let (o0, o1) = pair_offsets(p, nb, W::BYTES);
        let mut codes = [(_mm256_setzero_si256(), _mm256_setzero_si256()); R];
        let mut scales = [_mm_setzero_ps(); R];
        for r in 0..R {
            let row = w_rows.add(r * row_bytes);
            // The tile's rows are contiguous: prefetch the region ahead as one linear
            // stream (see `avx512::prefetch_linear`). Prefetch never faults;
            // wrapping_add keeps the address computation defined past the weights.
            let step = 2 * W::BYTES;
            let ahead = w_rows.wrapping_add(PREFETCH_ROWS * row_bytes + (p * R + r) * step);
            _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(step - 1) as *const i8);
            codes[r] = W::codes(row.add(o0), row.add(o1));
            scales[r] = W::scales(row.add(o0), row.add(o1));
        }
        for t in 0..T {
            let (qs, ds) = x[t];
            let x_lo = _mm256_loadu_si256(qs.add(p * 2 * QK32) as *const __m256i);
            let x_hi = _mm256_loadu_si256(qs.add(p * 2 * QK32 + QK32) as *const __m256i);
            let dsv = _mm_loadu_ps(ds.add(4 * p));
            for r in 0..R {
                let product = _mm_mul_ps(scales[r], dsv);
                offset[r][t] = _mm_add_ps(offset[r][t], product);
                let scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(product), spread);
                let sums = _mm256_cvtepi32_ps(W::dot(codes[r].0, codes[r].1, x_lo, x_hi));
                acc[r][t] = _mm256_fmadd_ps(sums, scale, acc[r][t]);
            }
        }
    }
    for r in 0..R {
        for t in 0..T {
            *out.add(t * out_stride + r) = hsum256(acc[r][t]) + offset_lanes(offset[r][t]);
        }
    }
}

/// Row-at-a-time matmul for the types without a register-tiled kernel.
///
/// # Safety
/// AVX2/FMA/F16C available; shapes validated by the dispatcher.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn matmul_rowwise(
    ty: GgmlType,
    w: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    let nb = k / ty.block_len();
    let row_bytes = nb * ty.block_bytes();
    let n_rows = rows.len();
    for t in 0..xq.n_tokens() {
        for (i, r) in rows.clone().enumerate() {
            let w_row = &w[r * row_bytes..(r + 1) * row_bytes];
            out[t * n_rows + i] = match ty {
                GgmlType::F32 => dot_f32_bytes::<WIDE_F32>(w_row, xq.values(t)),
                GgmlType::F16 => dot_f32_bytes::<WIDE_F16>(w_row, xq.values(t)),
                GgmlType::BF16 => dot_f32_bytes::<WIDE_BF16>(w_row, xq.values(t)),
                GgmlType::Q4_K => dot_affine_k::<false>(w_row, xq, t),
                GgmlType::Q5_K => dot_affine_k::<true>(w_row, xq, t),
                GgmlType::Q6_K => dot_q6_k(w_row, xq, t),
                _ => scalar::dot_row(ty, w_row, xq, t),
            };
        }
    }
}

/// Float weight formats for [`dot_f32_bytes`].
const WIDE_F32: u8 = 0;
const WIDE_F16: u8 = 1;
const WIDE_BF16: u8 = 2;

/// Dot of a row of float weight bytes (`FORMAT`: f32, f16 or bf16) with f32
/// activations.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32_bytes<const FORMAT: u8>(w_row: &[u8], x: &[f32]) -> f32 {
    const LANES: usize = 8;
    let width = if FORMAT == WIDE_F32 { 4 } else { 2 };
    let main = x.len() / LANES * LANES;
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let load = |i: usize| {
        // SAFETY: i + 8 <= main <= x.len(), and w_row holds x.len() weights of `width` bytes.
        unsafe {
            let p = w_row.as_ptr().add(i * width);
            match FORMAT {
                WIDE_F32 => _mm256_loadu_ps(p as *const f32),
                WIDE_F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                _ => {
                    let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
                    _mm256_castsi256_ps(_mm256_slli_epi32(halves, 16))
                }
            }
        }
    };
    let mut i = 0;
    while i + 2 * LANES <= main {
        acc0 = _mm256_fmadd_ps(load(i), _mm256_loadu_ps(x.as_ptr().add(i)), acc0);
        acc1 = _mm256_fmadd_ps(
            load(i + LANES),
            _mm256_loadu_ps(x.as_ptr().add(i + LANES)),
            acc1,
        );
        i += 2 * LANES;
    }
    if i < main {
        acc0 = _mm256_fmadd_ps(load(i), _mm256_loadu_ps(x.as_ptr().add(i)), acc0);
    }
    let mut sum = hsum256(_mm256_add_ps(acc0, acc1));
    for j in main..x.len() {
        let b = &w_row[j * width..];
        sum += x[j]
            * match FORMAT {
                WIDE_F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                WIDE_F16 => f16c_at(b, 0),
                _ => super::blocks::bf16_at(b, 0),
            };
    }
    sum
}

/// Q4_K (`FIVE_BIT` false) or Q5_K row . Q8_K token `t`: nibble codes (with
/// Q5_K's fifth bit from `qh`: bit 2c for chunk c's low nibbles, 2c + 1 for
/// its high ones) dotted and scaled by 6-bit sub-scales in i32, the sub-block
/// mins applied through the activation block sums.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_affine_k<const FIVE_BIT: bool>(
    w_row: &[u8],
    xq: &QuantizedActivations,
    t: usize,
) -> f32 {
    let (ty, qs_at) = if FIVE_BIT {
        (GgmlType::Q5_K, Q5_K_QS)
    } else {
        (GgmlType::Q4_K, Q4_K_QS)
    };
    let (qs, d) = xq.q8_k_row(t);
    let bsums = xq.bsums(t);
    let low = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let mut acc = _mm256_setzero_ps();
    let mut mins_total = 0.0f32;
    for (b, block) in w_row.chunks_exact(ty.block_bytes()).enumerate() {
        let scales = &block[Q4_K_SCALES..Q4_K_QS];
        // SAFETY: for Q5_K, the 32 qh bytes lie inside the 176-byte block.
        let qh = if FIVE_BIT {
            _mm256_loadu_si256(block.as_ptr().add(Q5_K_QH) as *const __m256i)
        } else {
            _mm256_setzero_si256()
        };
        let mut isum = _mm256_setzero_si256();
        let mut mins = 0i32;
        for chunk in 0..QK_K / 64 {
            let (sc_lo, m_lo) = super::blocks::scale_min_k4(2 * chunk, scales);
            let (sc_hi, m_hi) = super::blocks::scale_min_k4(2 * chunk + 1, scales);
            let bs = &bsums[b * 16 + 4 * chunk..][..4];
            mins += m_lo as i32 * (bs[0] as i32 + bs[1] as i32)
                + m_hi as i32 * (bs[2] as i32 + bs[3] as i32);
            // SAFETY: 32 qs bytes at chunk*32 lie inside the block; the 64
            // activations at b*256 + chunk*64 lie inside token t's k quants.
            let q = _mm256_loadu_si256(block.as_ptr().add(qs_at + chunk * QK32) as *const __m256i);
            let mut c_lo = _mm256_and_si256(q, low);
            let mut c_hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
            if FIVE_BIT {
                let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * chunk as i32));
                let h_hi = _mm256_srli_epi16(h, 1);
                c_lo = _mm256_or_si256(c_lo, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
                c_hi = _mm256_or_si256(c_hi, _mm256_slli_epi16(_mm256_and_si256(h_hi, one), 4));
            }
            let x = qs.as_ptr().add(b * QK_K + chunk * 64);
            let x_lo = _mm256_loadu_si256(x as *const __m256i);
            let x_hi = _mm256_loadu_si256(x.add(QK32) as *const __m256i);
            let p_lo = _mm256_maddubs_epi16(c_lo, x_lo);
            let p_hi = _mm256_maddubs_epi16(c_hi, x_hi);
            let s_lo = _mm256_madd_epi16(p_lo, _mm256_set1_epi16(sc_lo as i16));
            let s_hi = _mm256_madd_epi16(p_hi, _mm256_set1_epi16(sc_hi as i16));
            isum = _mm256_add_epi32(isum, _mm256_add_epi32(s_lo, s_hi));
        }
        let dw = f16c_at(block, 0);
        let dmin = f16c_at(block, Q4_K_DMIN);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dw * d[b]), acc);
        mins_total += dmin * d[b] * mins as f32;
    }
    hsum256(acc) - mins_total
}

/// Q6_K row . Q8_K token `t`: 6-bit codes (q + 32) as unsigned bytes, the -32 offset
/// applied through the activation block sums.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k(w_row: &[u8], xq: &QuantizedActivations, t: usize) -> f32 {
    let (qs, d) = xq.q8_k_row(t);
    let bsums = xq.bsums(t);
    let mut acc = _mm256_setzero_ps();
    let mut offset_total = 0.0f32;
    for (b, block) in w_row.chunks_exact(GgmlType::Q6_K.block_bytes()).enumerate() {
        let sc = |i: usize| block[Q6_K_SCALES + i] as i8 as i16;
        let offset: i32 = (0..16)
            .map(|i| sc(i) as i32 * bsums[b * 16 + i] as i32)
            .sum();
        let mut isum = _mm256_setzero_si256();
        for half in 0..2 {
            let p = block.as_ptr();
            // SAFETY: ql (64 bytes at half*64) and qh (32 bytes) lie inside the
            // 210-byte block; 128 activations at b*256 + half*128 lie inside token t's.
            let ql0 = _mm256_loadu_si256(p.add(half * 64) as *const __m256i);
            let ql1 = _mm256_loadu_si256(p.add(half * 64 + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(p.add(Q6_K_QH + half * 32) as *const __m256i);
            let codes = q6_codes(ql0, ql1, qh);
            let x = qs.as_ptr().add(b * QK_K + half * 128);
            for (n, code) in codes.into_iter().enumerate() {
                let xv = _mm256_loadu_si256(x.add(n * QK32) as *const __m256i);
                let first = half * 8 + 2 * n;
                let scale =
                    _mm256_set_m128i(_mm_set1_epi16(sc(first + 1)), _mm_set1_epi16(sc(first)));
                isum = _mm256_add_epi32(
                    isum,
                    _mm256_madd_epi16(_mm256_maddubs_epi16(code, xv), scale),
                );
            }
        }
        let scale = f16c_at(block, Q6_K_D) * d[b];
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(scale), acc);
        offset_total += scale * (32 * offset) as f32;
    }
    hsum256(acc) - offset_total
}

/// The four 32-byte vectors of unsigned 6-bit codes (q + 32) in one Q6_K half-block,
/// for weights 0..32, 32..64, 64..96 and 96..128 of that half.
#[inline(always)]
pub(crate) unsafe fn q6_codes(ql0: __m256i, ql1: __m256i, qh: __m256i) -> [__m256i; 4] {
    let low4 = _mm256_set1_epi8(0x0F);
    let two = _mm256_set1_epi8(3);
    let high = |shift: i32| {
        // SAFETY: AVX2 is available in every caller.
        unsafe {
            let bits = match shift {
                0 => qh,
                2 => _mm256_srli_epi16(qh, 2),
                4 => _mm256_srli_epi16(qh, 4),
                _ => _mm256_srli_epi16(qh, 6),
            };
            _mm256_slli_epi16(_mm256_and_si256(bits, two), 4)
        }
    };
    [
        _mm256_or_si256(_mm256_and_si256(ql0, low4), high(0)),
        _mm256_or_si256(_mm256_and_si256(ql1, low4), high(2)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), high(4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4), high(6)),
    ]
}

/// AVX2 `a . b`.
///
/// # Safety
/// AVX2 and FMA available; `a.len() == b.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 8;
    let main = a.len() / LANES * LANES;
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut i = 0;
    while i + 2 * LANES <= main {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i + LANES)),
            _mm256_loadu_ps(pb.add(i + LANES)),
            acc1,
        );
        i += 2 * LANES;
    }
    if i < main {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
    }
    hsum256(_mm256_add_ps(acc0, acc1)) + scalar::dot_f32(&a[main..], &b[main..])
}

/// AVX2 `y += alpha * x`.
///
/// # Safety
/// AVX2 and FMA available; `x.len() == y.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn axpy_f32(alpha: f32, x: &[f32], y: &mut [f32]) {
    const LANES: usize = 8;
    let main = x.len() / LANES * LANES;
    let a = _mm256_set1_ps(alpha);
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    for i in (0..main).step_by(LANES) {
        _mm256_storeu_ps(
            py.add(i),
            _mm256_fmadd_ps(a, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i))),
        );
    }
    scalar::axpy_f32(alpha, &x[main..], &mut y[main..]);
}
