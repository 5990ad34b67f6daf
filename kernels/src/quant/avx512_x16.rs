//! The 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) repacked in
//! groups of 16 rows (`super::repack`), against Q8_1 activations. Codes are
//! kept unsigned, as `vpdpbusd` wants its first operand: Q8_0's as q + 128,
//! the others as in the file. A block's offset (128, 16 or 8 codes) or min
//! comes back through the activations' scaled sum `s = d_x Σ q_x`:
//!
//! ```text
//! Σ_i w_i x_i = d d_x Σ_i u_i q_i + c s      c = -offset * d, or the block's min m
//! ```
//!
//! Per group of 16 rows and pair of blocks (b = 2p, 2p + 1), every field on a
//! 64-byte boundary, in the file's bits per weight (the scales stay f16):
//!
//! ```text
//!   d[2][16]              f16: block h, row r
//!   m[2][16]              f16 (Q4_1, Q5_1 only)
//!   8-bit codes:  [2][8][16][4]   u8: block h, vector v, row r: weights 4v..4v+4
//!   4- and 5-bit: [2][4][16][4]   nibbles: low = weights 4g..4g+4, high = 16+4g..
//!   5-bit only:   hi[2][8]        u64: bit 4r + i of vector v = bit 4 of row r's
//!                                 weight 4v + i (a byte mask: one masked add)
//! ```
//!
//! An odd last block is paired with zeros (d = 0, m = 0), and the activations'
//! padding (`Q8_1_QS_ALIGN`, `Q8_1_SCALE_ALIGN`) gives it zero quants to meet.

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::activations::QuantizedActivations;
use super::blocks::{
    q5_codes, Q4_0_QS, Q4_1_QS, Q5_0_QH, Q5_0_QS, Q5_1_QH, Q5_1_QS, Q8_0_QS, QK32,
};
use super::repack::ROWS;
use super::GgmlType;

/// Tokens sharing the decoded codes of a block.
const TILE_TOKENS: usize = 8;
/// Pairs of blocks ahead that the kernel prefetches.
const PREFETCH_PAIRS: usize = 2;

/// How a type's codes are stored.
#[derive(Clone, Copy)]
struct Layout {
    /// 4, 5 or 8.
    bits: u8,
    /// Whether blocks carry a min (Q4_1, Q5_1) rather than an offset.
    min: bool,
    /// The code that means zero, for the types without a min.
    offset: f32,
}

impl Layout {
    fn of(ty: GgmlType) -> Option<Layout> {
        let (bits, min, offset) = match ty {
            GgmlType::Q4_0 => (4, false, 8.0),
            GgmlType::Q4_1 => (4, true, 0.0),
            GgmlType::Q5_0 => (5, false, 16.0),
            GgmlType::Q5_1 => (5, true, 0.0),
            GgmlType::Q8_0 => (8, false, 128.0),
            _ => return None,
        };
        Some(Layout { bits, min, offset })
    }

    /// Byte offset of the codes in a pair.
    const fn codes(self) -> usize {
        if self.min {
            128
        } else {
            64
        }
    }

    /// Bytes of one group's pair of blocks.
    const fn pair_bytes(self) -> usize {
        self.codes()
            + match self.bits {
                8 => 1024,
                4 => 512,
                _ => 512 + 128,
            }
    }
}

/// Bytes of a `rows` x `k` matrix of `ty` repacked; `None` for another type,
/// or unless `rows` is a multiple of 16 and `k` of 32.
pub fn packed_len(ty: GgmlType, rows: usize, k: usize) -> Option<usize> {
    let layout = Layout::of(ty)?;
    (rows.is_multiple_of(ROWS) && k.is_multiple_of(QK32))
        .then(|| rows / ROWS * (k / QK32).div_ceil(2) * layout.pair_bytes())
}

/// Lays out `rows` x `k` weights of `ty` (`w`, ggml layout; `rows` whole
/// groups) into `out`, their [`packed_len`] (`super::repack::repack` checks
/// the shapes and cuts a matrix into runs of groups for its threads).
pub fn fill(ty: GgmlType, w: &[u8], rows: usize, k: usize, out: &mut [u8]) {
    let layout = Layout::of(ty).unwrap_or_else(|| panic!("no 16-row layout for {ty:?}"));
    let (block_bytes, nb) = (ty.block_bytes(), k / QK32);
    assert_eq!(w.len(), rows * nb * block_bytes);
    assert_eq!(Some(out.len()), packed_len(ty, rows, k));
    let (pairs, pair_bytes, codes_at) = (nb.div_ceil(2), layout.pair_bytes(), layout.codes());
    for group in 0..rows / ROWS {
        for b in 0..nb {
            let h = b % 2;
            let dst = &mut out[(group * pairs + b / 2) * pair_bytes..][..pair_bytes];
            for r in 0..ROWS {
                let row = group * ROWS + r;
                let block = &w[(row * nb + b) * block_bytes..][..block_bytes];
                dst[32 * h + 2 * r..][..2].copy_from_slice(&block[..2]);
                if layout.min {
                    // Q4_1 and Q5_1 keep their min right after d.
                    dst[64 + 32 * h + 2 * r..][..2].copy_from_slice(&block[2..4]);
                }
                let u = unsigned_codes(ty, block);
                let codes = &mut dst[codes_at..];
                if layout.bits == 8 {
                    for v in 0..8 {
                        codes[(h * 8 + v) * 64 + 4 * r..][..4]
                            .copy_from_slice(&u[4 * v..4 * v + 4]);
                    }
                    continue;
                }
                for g in 0..4 {
                    for i in 0..4 {
                        let (lo, hi) = (u[4 * g + i] & 0xF, u[16 + 4 * g + i] & 0xF);
                        codes[(h * 4 + g) * 64 + 4 * r + i] = lo | (hi << 4);
                    }
                }
                if layout.bits == 5 {
                    for v in 0..8 {
                        for i in 0..4 {
                            let bit = 4 * r + i;
                            if u[4 * v + i] & 0x10 != 0 {
                                codes[512 + (h * 8 + v) * 8 + bit / 8] |= 1 << (bit % 8);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// One block's 32 codes in weight order, unsigned.
fn unsigned_codes(ty: GgmlType, block: &[u8]) -> [u8; QK32] {
    let nibbles = |qs: usize| {
        let mut u = [0u8; QK32];
        for (j, &byte) in block[qs..qs + QK32 / 2].iter().enumerate() {
            u[j] = byte & 0xF;
            u[j + QK32 / 2] = byte >> 4;
        }
        u
    };
    match ty {
        GgmlType::Q4_0 => nibbles(Q4_0_QS),
        GgmlType::Q4_1 => nibbles(Q4_1_QS),
        GgmlType::Q5_0 => q5_codes(block, Q5_0_QH, Q5_0_QS),
        GgmlType::Q5_1 => q5_codes(block, Q5_1_QH, Q5_1_QS),
        GgmlType::Q8_0 => std::array::from_fn(|i| block[Q8_0_QS + i] ^ 0x80),
        _ => unreachable!("no 16-row layout for {ty:?}"),
    }
}

/// `out[t][i] = Σ_k w[rows.start + i][k] * x[t][k]` for `ty` weights that
/// [`fill`] laid out (`rows` a range of whole groups); `xq` quantized as Q8_1.
///
/// # Safety
/// AVX-512 VNNI present and the shapes `repack::matmul_repacked` checks.
pub(super) unsafe fn matmul(
    ty: GgmlType,
    packed: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    let layout = Layout::of(ty).unwrap_or_else(|| panic!("no 16-row layout for {ty:?}"));
    let pairs = (k / QK32).div_ceil(2);
    let neg_offset = -layout.offset;
    // SAFETY: the caller's; each layout's kernel matches its `pair_bytes`.
    unsafe {
        match (layout.bits, layout.min) {
            (8, false) => drive::<8, false>(packed, pairs, rows, xq, neg_offset, out),
            (4, false) => drive::<4, false>(packed, pairs, rows, xq, neg_offset, out),
            (4, true) => drive::<4, true>(packed, pairs, rows, xq, neg_offset, out),
            (5, false) => drive::<5, false>(packed, pairs, rows, xq, neg_offset, out),
            (5, true) => drive::<5, true>(packed, pairs, rows, xq, neg_offset, out),
            _ => unreachable!("Layout::of"),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn drive<const BITS: u8, const MIN: bool>(
    packed: &[u8],
    pairs: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    neg_offset: f32,
    out: &mut [f32],
) {
    let layout = Layout {
        bits: BITS,
        min: MIN,
        offset: 0.0,
    };
    let group_bytes = pairs * layout.pair_bytes();
    let (n_rows, n_tokens) = (rows.len(), xq.n_tokens());
    for group in rows.start / ROWS..rows.end / ROWS {
        let w = packed.as_ptr().add(group * group_bytes);
        let i0 = group * ROWS - rows.start;
        let mut t = 0;
        while t < n_tokens {
            let tile = (n_tokens - t).min(TILE_TOKENS);
            let mut acc = [[0f32; ROWS]; TILE_TOKENS];
            if tile == TILE_TOKENS {
                let x = std::array::from_fn(|j| row(xq, t + j));
                group_tile::<BITS, MIN, TILE_TOKENS>(w, pairs, x, neg_offset, &mut acc);
            } else {
                for j in 0..tile {
                    let x = [row(xq, t + j)];
                    group_tile::<BITS, MIN, 1>(w, pairs, x, neg_offset, &mut acc[j..j + 1]);
                }
            }
            for j in 0..tile {
                out[(t + j) * n_rows + i0..][..ROWS].copy_from_slice(&acc[j]);
            }
            t += tile;
        }
    }
}

/// Token `t`'s pair-interleaved quants and [d, s] per block.
fn row(xq: &QuantizedActivations, t: usize) -> (*const u8, *const f32) {
    let (qs, ds) = xq.q8_1_row(t);
    (qs.as_ptr() as *const u8, ds.as_ptr())
}

/// 16 rows (`w`: the group's first pair) against `T` tokens' activations.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_tile<const BITS: u8, const MIN: bool, const T: usize>(
    w: *const u8,
    pairs: usize,
    x: [(*const u8, *const f32); T],
    neg_offset: f32,
    out: &mut [[f32; ROWS]],
) {
    let layout = Layout {
        bits: BITS,
        min: MIN,
        offset: 0.0,
    };
    let (pair_bytes, codes_at) = (layout.pair_bytes(), layout.codes());
    let low = _mm512_set1_epi8(0x0F);
    let bit4 = _mm512_set1_epi8(0x10);
    let mut acc = [_mm512_setzero_ps(); T];
    for p in 0..pairs {
        let base = w.add(p * pair_bytes);
        // Streaming from memory at one token, the kernel runs ahead of the
        // hardware prefetcher (never dereferenced: no bounds).
        let ahead = base.wrapping_add(PREFETCH_PAIRS * pair_bytes);
        for line in 0..pair_bytes / 64 {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line) as *const i8);
        }
        let codes = base.add(codes_at);
        for h in 0..2 {
            let d = _mm512_cvtph_ps(_mm256_load_si256(base.add(32 * h) as *const __m256i));
            let c = if MIN {
                _mm512_cvtph_ps(_mm256_load_si256(base.add(64 + 32 * h) as *const __m256i))
            } else {
                _mm512_mul_ps(d, _mm512_set1_ps(neg_offset))
            };
            let mut isum = [_mm512_setzero_si512(); T];
            // Where token t's four activations for weights 4v..4v+4 of block h are.
            let xat = |t: usize, v: usize| {
                x[t].0.add(p * 64 + (v / 4) * 32 + h * 16 + 4 * (v % 4)) as *const i32
            };
            if BITS == 8 {
                for v in 0..8 {
                    let u = _mm512_load_si512(codes.add((h * 8 + v) * 64) as *const __m512i);
                    for t in 0..T {
                        let xv = _mm512_set1_epi32(xat(t, v).read_unaligned());
                        isum[t] = _mm512_dpbusd_epi32(isum[t], u, xv);
                    }
                }
            } else {
                let high = codes.add(512 + h * 64) as *const u64;
                for g in 0..4 {
                    let nib = _mm512_load_si512(codes.add((h * 4 + g) * 64) as *const __m512i);
                    let mut lo = _mm512_and_si512(nib, low);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(nib), low);
                    if BITS == 5 {
                        let (klo, khi) = (high.add(g).read(), high.add(4 + g).read());
                        lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(klo), lo, bit4);
                        hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(khi), hi, bit4);
                    }
                    for t in 0..T {
                        let xlo = _mm512_set1_epi32(xat(t, g).read_unaligned());
                        let xhi = _mm512_set1_epi32(xat(t, 4 + g).read_unaligned());
                        isum[t] = _mm512_dpbusd_epi32(isum[t], lo, xlo);
                        isum[t] = _mm512_dpbusd_epi32(isum[t], hi, xhi);
                    }
                }
            }
            for t in 0..T {
                let ds = x[t].1.add(2 * (2 * p + h));
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(ds.read()));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), scale, acc[t]);
                acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(ds.add(1).read()), c, acc[t]);
            }
        }
    }
    for t in 0..T {
        _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
    }
}
