//! AVX-512 VNNI kernels: `vpdpbusd` int8 dot products on 512-bit vectors.
//!
//! The 32-block types (Q4_0, Q4_1, Q8_0) run in two phases per tile of rows:
//!
//! ```text
//! 1. pack   R ggml rows (one k-chunk) -> codes [R][k] u8 (nibble, or q8 ^ 0x80 = q8 + 128)
//!                                      dw    [R][pair][16] f32 (d of 2 blocks, 8 lanes each)
//!                                      m     [R][block] f32   (offset coefficient)
//! 2. tile   for each R x T (rows x tokens) register tile, per pair of blocks:
//!           acc[r][t] += cvt(vpdpbusd(0, codes[r], x[t])) * (dw[r] * dx[t])
//!           then acc[r][t] += m[r] . s[t] (16 blocks per fma), reduce, store.
//! ```
//!
//! The packed codes are in weight order, so they line up with the activations byte for
//! byte; unpacking happens once per row, not once per (row, token).
//!
//! Invariants:
//! 1. Every function here runs only after `Isa::Avx512.is_available()` (avx512 f, bw,
//!    vl, vnni plus avx2, fma, f16c).
//! 2. `vpdpbusd` does not saturate, so Q8_0 may use unsigned codes q8 + 128 (<= 255):
//!    32 * 255 * 127 fits i32 with room to spare; the +128 is removed via m = -128 d.
//! 3. Pack padding (odd last block, scale groups) is zero in codes, dw and m, and the
//!    activations are zero-padded to whole pairs and 16-block groups, so padded lanes
//!    contribute exactly 0.
//! 4. A k-chunk holds at most [`CHUNK_BLOCKS`] blocks; later chunks add into `out`.

use std::arch::x86_64::*;
use std::ops::Range;

use super::activations::{QuantizedActivations, Q8_1_SCALE_ALIGN};
use super::avx2::{f16_load, nibbles32};
use super::blocks::{Q4_0_QS, Q4_1_M, Q4_1_QS, Q8_0_QS, QK32};
use super::GgmlType;

/// Weight rows per register tile.
const TILE_ROWS: usize = 4;
/// Tokens per register tile.
const TILE_TOKENS: usize = 4;
/// Blocks per packed k-chunk (4096 weights: 16 KiB of codes for a 4-row tile).
const CHUNK_BLOCKS: usize = 128;
/// Blocks per 512-bit vector of int8 codes.
const PAIR: usize = 2;
/// f32 lanes in a 512-bit vector.
const LANES: usize = 16;

const _: () = assert!(CHUNK_BLOCKS % Q8_1_SCALE_ALIGN == 0 && CHUNK_BLOCKS % PAIR == 0);
const _: () = assert!(Q8_1_SCALE_ALIGN == LANES);

/// AVX-512 matmul; arguments already validated by the dispatcher.
pub fn matmul(
    ty: GgmlType,
    w: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    // SAFETY (every arm): the dispatcher asserted AVX-512 (which implies the AVX2 set)
    // and the buffer shapes.
    unsafe {
        match ty {
            GgmlType::Q4_0 => drive::<Q4_0W>(w, k, rows, xq, out),
            GgmlType::Q4_1 => drive::<Q4_1W>(w, k, rows, xq, out),
            GgmlType::Q8_0 => drive::<Q8_0W>(w, k, rows, xq, out),
            GgmlType::Q4_K | GgmlType::Q6_K | GgmlType::F32 | GgmlType::F16 => {
                super::avx2::matmul_rowwise(ty, w, k, rows, xq, out)
            }
        }
    }
}

/// A 32-weight block format as the packer sees it.
trait Pack32 {
    /// Bytes per block.
    const BYTES: usize;
    /// Writes the block's 32 unsigned codes to `codes`; returns (d, m) such that
    /// `block . x = d * dx * (codes . q) + m * s`.
    ///
    /// # Safety
    /// `block` has `BYTES` readable bytes, `codes` 32 writable; AVX2/F16C available.
    unsafe fn unpack(block: *const u8, codes: *mut u8) -> (f32, f32);
}

struct Q4_0W;
struct Q4_1W;
struct Q8_0W;

impl Pack32 for Q4_0W {
    const BYTES: usize = GgmlType::Q4_0.block_bytes();
    #[inline(always)]
    unsafe fn unpack(block: *const u8, codes: *mut u8) -> (f32, f32) {
        _mm256_storeu_si256(codes as *mut __m256i, nibbles32(block.add(Q4_0_QS)));
        let d = f16_load(block);
        (d, -8.0 * d)
    }
}

impl Pack32 for Q4_1W {
    const BYTES: usize = GgmlType::Q4_1.block_bytes();
    #[inline(always)]
    unsafe fn unpack(block: *const u8, codes: *mut u8) -> (f32, f32) {
        _mm256_storeu_si256(codes as *mut __m256i, nibbles32(block.add(Q4_1_QS)));
        (f16_load(block), f16_load(block.add(Q4_1_M)))
    }
}

impl Pack32 for Q8_0W {
    const BYTES: usize = GgmlType::Q8_0.block_bytes();
    #[inline(always)]
    unsafe fn unpack(block: *const u8, codes: *mut u8) -> (f32, f32) {
        let q = _mm256_loadu_si256(block.add(Q8_0_QS) as *const __m256i);
        // q ^ 0x80 reinterprets the signed byte q as the unsigned byte q + 128.
        _mm256_storeu_si256(
            codes as *mut __m256i,
            _mm256_xor_si256(q, _mm256_set1_epi8(i8::MIN)),
        );
        let d = f16_load(block);
        (d, -128.0 * d)
    }
}

/// One row tile's packed k-chunk (see the module diagram).
struct Packed {
    /// [TILE_ROWS][CHUNK_BLOCKS * 32] unsigned codes.
    codes: [[u8; CHUNK_BLOCKS * QK32]; TILE_ROWS],
    /// [TILE_ROWS][CHUNK_BLOCKS / 2][16] block scales, 8 lanes per block.
    dw: [[f32; CHUNK_BLOCKS * LANES / PAIR]; TILE_ROWS],
    /// [TILE_ROWS][CHUNK_BLOCKS] offset coefficients.
    m: [[f32; CHUNK_BLOCKS]; TILE_ROWS],
}

/// Per-token activation pointers at the current chunk: (quants, scales d, sums s).
type Q8Row = (*const i8, *const f32, *const f32);

/// Geometry of one packed k-chunk.
#[derive(Clone, Copy)]
struct Chunk {
    /// First block of the chunk within the row.
    first_block: usize,
    /// Blocks in the chunk.
    blocks: usize,
    /// Whether `out` already holds earlier chunks' sums.
    accumulate: bool,
}

/// Packs `n` rows (at most `TILE_ROWS`) of one chunk into `pack`, zero-padding the
/// chunk to whole pairs (codes, dw) and whole 16-block groups (m).
///
/// # Safety
/// `w_rows` holds `n` rows of `row_bytes` covering the chunk; AVX2/F16C available.
#[inline(always)]
unsafe fn pack_rows<W: Pack32>(
    pack: &mut Packed,
    w_rows: *const u8,
    row_bytes: usize,
    n: usize,
    chunk: Chunk,
) {
    let padded_pairs = chunk.blocks.div_ceil(PAIR) * PAIR;
    let padded_groups = chunk.blocks.div_ceil(LANES) * LANES;
    for r in 0..n {
        let row = w_rows.add(r * row_bytes + chunk.first_block * W::BYTES);
        for j in 0..chunk.blocks {
            let (d, m) = W::unpack(
                row.add(j * W::BYTES),
                pack.codes[r].as_mut_ptr().add(j * QK32),
            );
            let lanes = (j / PAIR) * LANES + (j % PAIR) * (LANES / PAIR);
            pack.dw[r][lanes..lanes + LANES / PAIR].fill(d);
            pack.m[r][j] = m;
        }
        for j in chunk.blocks..padded_pairs {
            pack.codes[r][j * QK32..(j + 1) * QK32].fill(0);
            let lanes = (j / PAIR) * LANES + (j % PAIR) * (LANES / PAIR);
            pack.dw[r][lanes..lanes + LANES / PAIR].fill(0.0);
        }
        pack.m[r][chunk.blocks..padded_groups].fill(0.0);
    }
}

/// Walks row tiles, packs each k-chunk once, then sweeps all token tiles over it.
///
/// # Safety
/// AVX-512 set available; shapes validated by the dispatcher.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn drive<W: Pack32>(
    w: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    let nb = k / QK32;
    let row_bytes = nb * W::BYTES;
    let (n_rows, n_tokens) = (rows.len(), xq.n_tokens());
    let mut pack = Packed {
        codes: [[0; CHUNK_BLOCKS * QK32]; TILE_ROWS],
        dw: [[0.0; CHUNK_BLOCKS * LANES / PAIR]; TILE_ROWS],
        m: [[0.0; CHUNK_BLOCKS]; TILE_ROWS],
    };
    let mut r = 0;
    while r < n_rows {
        let tile_rows = if n_rows - r >= TILE_ROWS {
            TILE_ROWS
        } else {
            1
        };
        // SAFETY: rows.end * row_bytes <= w.len() (dispatcher).
        let w_rows = w.as_ptr().add((rows.start + r) * row_bytes);
        for first_block in (0..nb).step_by(CHUNK_BLOCKS) {
            let blocks = CHUNK_BLOCKS.min(nb - first_block);
            let chunk = Chunk {
                first_block,
                blocks,
                accumulate: first_block > 0,
            };
            pack_rows::<W>(&mut pack, w_rows, row_bytes, tile_rows, chunk);
            let mut t = 0;
            while t < n_tokens {
                let tile_tokens = if n_tokens - t >= TILE_TOKENS {
                    TILE_TOKENS
                } else {
                    1
                };
                let x4: [Q8Row; TILE_TOKENS] = std::array::from_fn(|i| {
                    let (qs, d, s) = xq.q8_row(t + i.min(tile_tokens - 1));
                    // SAFETY: the chunk's blocks lie inside the padded activation row.
                    unsafe {
                        (
                            qs.as_ptr().add(first_block * QK32),
                            d.as_ptr().add(first_block),
                            s.as_ptr().add(first_block),
                        )
                    }
                });
                // SAFETY: tile (t, r) lies inside out = [n_tokens][n_rows].
                let o = out.as_mut_ptr().add(t * n_rows + r);
                match (tile_rows, tile_tokens) {
                    (TILE_ROWS, TILE_TOKENS) => {
                        tile::<TILE_ROWS, TILE_TOKENS>(&pack, chunk, x4, o, n_rows)
                    }
                    (TILE_ROWS, _) => tile::<TILE_ROWS, 1>(&pack, chunk, [x4[0]], o, n_rows),
                    (_, TILE_TOKENS) => tile::<1, TILE_TOKENS>(&pack, chunk, x4, o, n_rows),
                    _ => tile::<1, 1>(&pack, chunk, [x4[0]], o, n_rows),
                }
                t += tile_tokens;
            }
        }
        r += tile_rows;
    }
}

/// One `R` x `T` register tile over a packed chunk; writes (or adds to)
/// `out[t * out_stride + r]`.
///
/// # Safety
/// `pack` holds `R` packed rows of `chunk`; each `x` row covers the chunk, padded;
/// `out` has the `T` x `R` slots; AVX-512 set available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const R: usize, const T: usize>(
    pack: &Packed,
    chunk: Chunk,
    x: [Q8Row; T],
    out: *mut f32,
    out_stride: usize,
) {
    // Lanes 0..8 take the pair's first scale, lanes 8..16 the second.
    let spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for p in 0..chunk.blocks.div_ceil(PAIR) {
        let codes: [__m512i; R] = std::array::from_fn(|r| {
            // SAFETY: pair p lies inside the packed (padded) chunk.
            unsafe { _mm512_loadu_si512(pack.codes[r].as_ptr().add(p * 2 * QK32) as *const _) }
        });
        // SAFETY: as above, for the scale lanes.
        let dw: [__m512; R] =
            std::array::from_fn(|r| unsafe { _mm512_loadu_ps(pack.dw[r].as_ptr().add(p * LANES)) });
        for t in 0..T {
            let (qs, d, _) = x[t];
            let xv = _mm512_loadu_si512(qs.add(p * 2 * QK32) as *const _);
            let d2 = _mm_loadl_epi64(d.add(p * PAIR) as *const __m128i);
            let dx = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_castsi128_ps(d2)));
            for r in 0..R {
                let sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, codes[r], xv));
                acc[r][t] = _mm512_fmadd_ps(sums, _mm512_mul_ps(dw[r], dx), acc[r][t]);
            }
        }
    }
    for g in 0..chunk.blocks.div_ceil(LANES) {
        for r in 0..R {
            let m = _mm512_loadu_ps(pack.m[r].as_ptr().add(g * LANES));
            for t in 0..T {
                acc[r][t] = _mm512_fmadd_ps(m, _mm512_loadu_ps(x[t].2.add(g * LANES)), acc[r][t]);
            }
        }
    }
    for r in 0..R {
        for t in 0..T {
            let slot = out.add(t * out_stride + r);
            let sum = _mm512_reduce_add_ps(acc[r][t]);
            *slot = if chunk.accumulate { *slot + sum } else { sum };
        }
    }
}

/// AVX-512 `a . b`, the tail under a lane mask.
///
/// # Safety
/// AVX-512F available; `a.len() == b.len()`.
#[target_feature(enable = "avx512f")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut i = 0;
    while i + 2 * LANES <= n {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm512_fmadd_ps(
            _mm512_loadu_ps(pa.add(i + LANES)),
            _mm512_loadu_ps(pb.add(i + LANES)),
            acc1,
        );
        i += 2 * LANES;
    }
    while i < n {
        let mask: __mmask16 = if n - i >= LANES {
            !0
        } else {
            (1u16 << (n - i)) - 1
        };
        let va = _mm512_maskz_loadu_ps(mask, pa.add(i));
        acc0 = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(mask, pb.add(i)), acc0);
        i += LANES;
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
}

/// AVX-512 `y += alpha * x`, the tail under a lane mask.
///
/// # Safety
/// AVX-512F available; `x.len() == y.len()`.
#[target_feature(enable = "avx512f")]
pub unsafe fn axpy_f32(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len();
    let a = _mm512_set1_ps(alpha);
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i < n {
        let mask: __mmask16 = if n - i >= LANES {
            !0
        } else {
            (1u16 << (n - i)) - 1
        };
        let yv = _mm512_maskz_loadu_ps(mask, py.add(i));
        let r = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(mask, px.add(i)), yv);
        _mm512_mask_storeu_ps(py.add(i), mask, r);
        i += LANES;
    }
}
