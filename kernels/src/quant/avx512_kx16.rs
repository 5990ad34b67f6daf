//! Q4_K weights repacked so that one `vpdpbusd` works on 16 rows at once
//! (each i32 lane one row, four weights of it against four activations
//! broadcast to every lane), as llama.cpp's interleaved repacks do
//! (`super::repack`). The sub-block scales and mins then apply to 16 rows in
//! one float operation instead of per row, which is most of the row kernel's
//! non-multiply work (`avx512_k.rs`); BENCHMARKS.md has the comparison
//! (`quant_bench Q4_Kx16`).
//!
//! ```text
//! per group of 16 rows and super-block (GROUP_BLOCK_BYTES):
//!   d[16], dmin[16]            f16, as in the file
//!   sc[8][16]                  u8: sub-block j's scale, row r
//!   m[4][16][2]                u8: mins of sub-blocks 2p, 2p+1 (widened to a
//!                              vpdpwssd pair of i16 when loaded)
//!   codes[8][4][16][4]         nibbles: sub-block j, vector g, row r: low nibbles
//!                              weights 32j+4g..+4, high nibbles 32j+16+4g..+4
//! per token t, block b, sub-block j:
//!   isum  = Σ_g dpbusd(lo_g, bcast x[32j+4g..]) + dpbusd(hi_g, bcast x[32j+16+4g..])
//!   acc  += cvt(isum) * (d * sc_j) * dx
//! per token and block:  acc -= cvt(Σ_p dpwssd(m_p, bcast (S_2p, S_2p+1))) * dmin * dx
//! ```
//! where `S_j` is the sum of sub-block j's 32 activations (from Q8_K's sums).
//!
//! Q6_K the same way, its codes kept unsigned (q + 32) in 6 bits:
//!
//! ```text
//! per group of 16 rows and super-block (Q6_K_GROUP_BLOCK_BYTES):
//!   d[16]                      f16, as in the file (then 32 bytes of padding)
//!   sc[8][16][2]               i8: sub-blocks 2c, 2c+1, row r (a vpdpwssd pair
//!                              once widened)
//!   codes[8][4][16][4]         low nibbles as Q4_K's: chunk c (sub-blocks 2c,
//!                              2c+1), vector g, row r: weights 32c+4g.. and 32c+16+4g..
//!   high[8][2][16][4]          2-bit fields: chunk c, half (low nibbles, high
//!                              nibbles), row r: bits 2g..2g+2 = the top two
//!                              bits of vector g's code
//! per token t and block:
//!   isum  = Σ_j sc_j Σ_g dpbusd(code_jg, bcast x[16j+4g..])   (i32, exact)
//!   acc  += cvt(isum - 32 Σ_c dpwssd(sc_c, bcast (S_2c, S_2c+1))) * d * dx
//! ```
//! with `S_j` Q8_K's sum of the 16 activations of sub-block j.

#![allow(clippy::needless_range_loop)]

// The layout above: 16 rows' super-blocks in 37 cache lines.
const _: () = assert!(GROUP_BLOCK_BYTES == 37 * 64 && ROWS == 16);

use std::arch::x86_64::*;
use std::ops::Range;

use super::activations::{QuantizedActivations, Q8_K_BSUM_LEN};
use super::blocks::{
    q6_k_quants, scale_min_k4, Q4_K_DMIN, Q4_K_QS, Q4_K_SCALES, Q6_K_D, Q6_K_SCALES, QK_K,
};
use super::repack::ROWS;
use super::GgmlType;

/// Bytes of one group of 16 rows' super-block.
pub const GROUP_BLOCK_BYTES: usize = 32 + 32 + 128 + 128 + 2048;
const DMIN: usize = 32;
const SC: usize = 64;
const MINS: usize = 192;
const CODES: usize = 320;
/// Blocks ahead that the kernel prefetches.
const PREFETCH_BLOCKS: usize = 2;
/// Tokens sharing the decoded codes of a sub-block.
const TILE_TOKENS: usize = 8;

/// Bytes of one group of 16 rows' Q6_K super-block: 53 cache lines.
pub const Q6_K_GROUP_BLOCK_BYTES: usize = 64 + 256 + 2048 + 1024;
const Q6_SC: usize = 64;
const Q6_CODES: usize = 320;
const Q6_HIGH: usize = 2368;

/// Bytes of a `rows` x `k` matrix of `ty` (Q4_K or Q6_K) repacked; `None`
/// for another type, or unless `rows` is a multiple of 16 and `k` of 256.
pub fn packed_len(ty: GgmlType, rows: usize, k: usize) -> Option<usize> {
    let group_block = match ty {
        GgmlType::Q4_K => GROUP_BLOCK_BYTES,
        GgmlType::Q6_K => Q6_K_GROUP_BLOCK_BYTES,
        _ => return None,
    };
    (rows.is_multiple_of(ROWS) && k.is_multiple_of(QK_K))
        .then(|| rows / ROWS * (k / QK_K) * group_block)
}

/// Lays out `rows` x `k` Q4_K weights (`w`, ggml layout; `rows` whole
/// groups) into `out`, their [`packed_len`] (`super::repack::repack` checks
/// the shapes and cuts a matrix into runs of groups for its threads).
pub fn fill_q4_k(w: &[u8], rows: usize, k: usize, out: &mut [u8]) {
    let block_bytes = GgmlType::Q4_K.block_bytes();
    let nb = k / QK_K;
    assert_eq!(w.len(), rows * nb * block_bytes);
    assert_eq!(Some(out.len()), packed_len(GgmlType::Q4_K, rows, k));
    for group in 0..rows / ROWS {
        for b in 0..nb {
            let dst = &mut out[(group * nb + b) * GROUP_BLOCK_BYTES..][..GROUP_BLOCK_BYTES];
            for r in 0..ROWS {
                let row = group * ROWS + r;
                let block = &w[(row * nb + b) * block_bytes..][..block_bytes];
                dst[2 * r..2 * r + 2].copy_from_slice(&block[..2]);
                dst[DMIN + 2 * r..DMIN + 2 * r + 2]
                    .copy_from_slice(&block[Q4_K_DMIN..Q4_K_DMIN + 2]);
                let scales = &block[Q4_K_SCALES..Q4_K_QS];
                let mut codes = [0u8; QK_K];
                for (chunk, qs) in block[Q4_K_QS..].chunks_exact(32).enumerate() {
                    for (l, &q) in qs.iter().enumerate() {
                        codes[64 * chunk + l] = q & 0xF;
                        codes[64 * chunk + 32 + l] = q >> 4;
                    }
                }
                for j in 0..8 {
                    let (sc, m) = scale_min_k4(j, scales);
                    dst[SC + 16 * j + r] = sc;
                    dst[MINS + (j / 2) * 32 + 2 * r + j % 2] = m;
                    for g in 0..4 {
                        for i in 0..4 {
                            let lo = codes[32 * j + 4 * g + i];
                            let hi = codes[32 * j + 16 + 4 * g + i];
                            dst[CODES + (j * 4 + g) * 64 + 4 * r + i] = lo | (hi << 4);
                        }
                    }
                }
            }
        }
    }
}

/// `out[t][i] = Σ_k w[rows.start + i][k] * x[t][k]` for repacked Q4_K
/// weights (`rows` a range of whole groups); `xq` quantized as Q8_K.
///
/// # Safety
/// AVX-512 VNNI present and the shapes `repack::matmul_repacked` checks.
pub(super) unsafe fn matmul_q4_k(
    packed: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    let nb = k / QK_K;
    // Sub-block sums of each token's activations, as i16 pairs for vpdpwssd.
    let n_tokens = xq.n_tokens();
    let mut sums = vec![0i16; n_tokens * nb * 8];
    for t in 0..n_tokens {
        let bsums = xq.bsums(t);
        for (j, s) in sums[t * nb * 8..(t + 1) * nb * 8].iter_mut().enumerate() {
            // |S| <= 32 x 127: fits i16.
            *s = bsums[2 * j] + bsums[2 * j + 1];
        }
    }
    debug_assert_eq!(Q8_K_BSUM_LEN, 16);
    drive(packed, nb, rows, xq, &sums, out)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn drive(
    packed: &[u8],
    nb: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    sums: &[i16],
    out: &mut [f32],
) {
    let (n_rows, n_tokens) = (rows.len(), xq.n_tokens());
    for group in rows.start / ROWS..rows.end / ROWS {
        let w = &packed[group * nb * GROUP_BLOCK_BYTES..(group + 1) * nb * GROUP_BLOCK_BYTES];
        let i0 = group * ROWS - rows.start;
        let mut t = 0;
        while t < n_tokens {
            let tile = (n_tokens - t).min(TILE_TOKENS);
            let mut acc = [[0f32; ROWS]; TILE_TOKENS];
            match tile {
                TILE_TOKENS => group_tile::<TILE_TOKENS>(w, nb, xq, sums, t, &mut acc),
                _ => {
                    for j in 0..tile {
                        group_tile::<1>(w, nb, xq, sums, t + j, &mut acc[j..j + 1]);
                    }
                }
            }
            for j in 0..tile {
                out[(t + j) * n_rows + i0..][..ROWS].copy_from_slice(&acc[j]);
            }
            t += tile;
        }
    }
}

/// 16 rows against tokens `t0..t0 + T`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_tile<const T: usize>(
    w: &[u8],
    nb: usize,
    xq: &QuantizedActivations,
    sums: &[i16],
    t0: usize,
    out: &mut [[f32; ROWS]],
) {
    let mut x: [(*const u8, &[f32]); T] = [(std::ptr::null(), &[]); T];
    for (j, x) in x.iter_mut().enumerate() {
        let (qs, d) = xq.q8_k_row(t0 + j);
        *x = (qs.as_ptr() as *const u8, d);
    }
    let low = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..nb {
        let base = w.as_ptr().add(b * GROUP_BLOCK_BYTES);
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(base as *const __m256i));
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(DMIN) as *const __m256i));
        let mut dx = [_mm512_setzero_ps(); T];
        for t in 0..T {
            dx[t] = _mm512_set1_ps(x[t].1[b]);
        }
        for j in 0..8 {
            // Streaming from memory at one token, this kernel runs ahead of
            // the hardware prefetcher: fetch the block after next, a fifth
            // of a block per sub-block (never dereferenced: no bounds).
            let ahead = base.wrapping_add(PREFETCH_BLOCKS * GROUP_BLOCK_BYTES + j * 320);
            // (8 x 5 lines: 2,560 bytes, the 2,368 of a block and the next's first.)
            for line in 0..5 {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line) as *const i8);
            }
            let mut isum = [_mm512_setzero_si512(); T];
            for g in 0..4 {
                let nib = _mm512_loadu_si512(base.add(CODES + (j * 4 + g) * 64) as *const __m512i);
                let lo = _mm512_and_si512(nib, low);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(nib), low);
                for t in 0..T {
                    let xs = x[t].0.add(b * QK_K + 32 * j + 4 * g);
                    let xlo = _mm512_set1_epi32((xs as *const i32).read_unaligned());
                    let xhi = _mm512_set1_epi32((xs.add(16) as *const i32).read_unaligned());
                    isum[t] = _mm512_dpbusd_epi32(isum[t], lo, xlo);
                    isum[t] = _mm512_dpbusd_epi32(isum[t], hi, xhi);
                }
            }
            let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                base.add(SC + 16 * j) as *const __m128i,
            )));
            let scale = _mm512_mul_ps(sc, d);
            for t in 0..T {
                acc[t] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(isum[t]),
                    _mm512_mul_ps(scale, dx[t]),
                    acc[t],
                );
            }
        }
        let mut mins = [_mm512_setzero_si512(); 4];
        for p in 0..4 {
            mins[p] =
                _mm512_cvtepu8_epi16(_mm256_loadu_si256(base.add(MINS + 32 * p) as *const __m256i));
        }
        for t in 0..T {
            let s = sums.as_ptr().add(((t0 + t) * nb + b) * 8) as *const i32;
            let mut off = _mm512_setzero_si512();
            for p in 0..4 {
                off =
                    _mm512_dpwssd_epi32(off, mins[p], _mm512_set1_epi32(s.add(p).read_unaligned()));
            }
            acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(off), _mm512_mul_ps(dmin, dx[t]), acc[t]);
        }
    }
    for t in 0..T {
        _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
    }
}

/// Lays out `rows` x `k` Q6_K weights (`w`, ggml layout; `rows` whole
/// groups) into `out`, their [`packed_len`] (`super::repack::repack` checks
/// the shapes and cuts a matrix into runs of groups for its threads).
pub fn fill_q6_k(w: &[u8], rows: usize, k: usize, out: &mut [u8]) {
    let block_bytes = GgmlType::Q6_K.block_bytes();
    let nb = k / QK_K;
    assert_eq!(w.len(), rows * nb * block_bytes);
    assert_eq!(Some(out.len()), packed_len(GgmlType::Q6_K, rows, k));
    for group in 0..rows / ROWS {
        for b in 0..nb {
            let dst =
                &mut out[(group * nb + b) * Q6_K_GROUP_BLOCK_BYTES..][..Q6_K_GROUP_BLOCK_BYTES];
            for r in 0..ROWS {
                let row = group * ROWS + r;
                let block = &w[(row * nb + b) * block_bytes..][..block_bytes];
                dst[2 * r..2 * r + 2].copy_from_slice(&block[Q6_K_D..Q6_K_D + 2]);
                let u = q6_k_quants(block).map(|q| (q + 32) as u8);
                for c in 0..8 {
                    for half in 0..2 {
                        dst[Q6_SC + 32 * c + 2 * r + half] = block[Q6_K_SCALES + 2 * c + half];
                    }
                    for g in 0..4 {
                        for i in 0..4 {
                            let (lo, hi) = (u[32 * c + 4 * g + i], u[32 * c + 16 + 4 * g + i]);
                            let at = 4 * r + i;
                            dst[Q6_CODES + (c * 4 + g) * 64 + at] = (lo & 0xF) | ((hi & 0xF) << 4);
                            dst[Q6_HIGH + c * 128 + at] |= (lo >> 4) << (2 * g);
                            dst[Q6_HIGH + c * 128 + 64 + at] |= (hi >> 4) << (2 * g);
                        }
                    }
                }
            }
        }
    }
}

/// [`matmul_q4_k`] for Q6_K weights [`fill_q6_k`] laid out.
///
/// # Safety
/// As `matmul_q4_k`.
pub(super) unsafe fn matmul_q6_k(
    packed: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    debug_assert_eq!(Q8_K_BSUM_LEN, 16);
    drive_q6_k(packed, k / QK_K, rows, xq, out)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn drive_q6_k(
    packed: &[u8],
    nb: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    let (n_rows, n_tokens) = (rows.len(), xq.n_tokens());
    for group in rows.start / ROWS..rows.end / ROWS {
        let w = packed.as_ptr().add(group * nb * Q6_K_GROUP_BLOCK_BYTES);
        let i0 = group * ROWS - rows.start;
        let mut t = 0;
        while t < n_tokens {
            let tile = (n_tokens - t).min(TILE_TOKENS);
            let mut acc = [[0f32; ROWS]; TILE_TOKENS];
            let x = |j: usize| {
                let (qs, d) = xq.q8_k_row(t + j);
                (
                    qs.as_ptr() as *const u8,
                    d.as_ptr(),
                    xq.bsums(t + j).as_ptr(),
                )
            };
            if tile == TILE_TOKENS {
                group_tile_q6_k::<TILE_TOKENS>(w, nb, std::array::from_fn(x), &mut acc);
            } else {
                for j in 0..tile {
                    group_tile_q6_k::<1>(w, nb, [x(j)], &mut acc[j..j + 1]);
                }
            }
            for j in 0..tile {
                out[(t + j) * n_rows + i0..][..ROWS].copy_from_slice(&acc[j]);
            }
            t += tile;
        }
    }
}

/// The top two bits of vector `g`'s codes from its 2-bit fields, as bits 4..6
/// (`& 0x30` to follow).
#[inline(always)]
unsafe fn q6_high(fields: __m512i, g: usize) -> __m512i {
    match g {
        0 => _mm512_slli_epi16::<4>(fields),
        1 => _mm512_slli_epi16::<2>(fields),
        2 => fields,
        _ => _mm512_srli_epi16::<2>(fields),
    }
}

/// 16 rows (`w`: the group's first super-block) against `T` tokens: (quants,
/// scales, 16-value sums) of each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_tile_q6_k<const T: usize>(
    w: *const u8,
    nb: usize,
    x: [(*const u8, *const f32, *const i16); T],
    out: &mut [[f32; ROWS]],
) {
    let low = _mm512_set1_epi8(0x0F);
    let top = _mm512_set1_epi8(0x30);
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..nb {
        let base = w.add(b * Q6_K_GROUP_BLOCK_BYTES);
        let d = _mm512_cvtph_ps(_mm256_load_si256(base as *const __m256i));
        // The codes' offset first: -32 Σ_j sc_j S_j.
        let mut isum = [_mm512_setzero_si512(); T];
        for c in 0..8 {
            let sc =
                _mm512_cvtepi8_epi16(_mm256_load_si256(base.add(Q6_SC + 32 * c) as *const __m256i));
            for t in 0..T {
                let s = x[t].2.add(b * 16 + 2 * c) as *const i32;
                isum[t] = _mm512_dpwssd_epi32(isum[t], sc, _mm512_set1_epi32(s.read_unaligned()));
            }
        }
        for t in 0..T {
            isum[t] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<5>(isum[t]));
        }
        for c in 0..8 {
            let ahead = base.wrapping_add(PREFETCH_BLOCKS * Q6_K_GROUP_BLOCK_BYTES + c * 448);
            // (8 x 7 lines: 3,584 bytes, the 3,392 of a block and the next's first.)
            for line in 0..7 {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line) as *const i8);
            }
            let pair =
                _mm512_cvtepi8_epi16(_mm256_load_si256(base.add(Q6_SC + 32 * c) as *const __m256i));
            // Sub-block 2c's scale per row in the low i16 of each lane, 2c+1's in the high.
            let scales = [
                _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(pair)),
                _mm512_srai_epi32::<16>(pair),
            ];
            for half in 0..2 {
                let fields =
                    _mm512_load_si512(base.add(Q6_HIGH + c * 128 + half * 64) as *const __m512i);
                let mut sub = [_mm512_setzero_si512(); T];
                for g in 0..4 {
                    let nib =
                        _mm512_load_si512(base.add(Q6_CODES + (c * 4 + g) * 64) as *const __m512i);
                    let nib = if half == 0 {
                        nib
                    } else {
                        _mm512_srli_epi16::<4>(nib)
                    };
                    // (high & 0x30) | (nib & 0x0F)
                    let code = _mm512_ternarylogic_epi32::<0xEA>(
                        q6_high(fields, g),
                        top,
                        _mm512_and_si512(nib, low),
                    );
                    for t in 0..T {
                        let xs = x[t].0.add(b * QK_K + 32 * c + 16 * half + 4 * g) as *const i32;
                        sub[t] = _mm512_dpbusd_epi32(
                            sub[t],
                            code,
                            _mm512_set1_epi32(xs.read_unaligned()),
                        );
                    }
                }
                for t in 0..T {
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(sub[t], scales[half]));
                }
            }
        }
        for t in 0..T {
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(x[t].1.add(b).read()));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), scale, acc[t]);
        }
    }
    for t in 0..T {
        _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
    }
}
