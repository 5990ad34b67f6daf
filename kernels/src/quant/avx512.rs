//! AVX-512 VNNI kernels: `vpdpbusd` int8 dot products on 512-bit vectors.
//!
//! The 32-block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) decode a pair of blocks (b, b + 1) into one
//! 512-bit vector of codes in the Q8_1 pair layout (see `activations`), so codes and
//! activation quants line up byte for byte:
//!
//! ```text
//! codes: [b w0..16][b+1 w0..16][b w16..32][b+1 w16..32]  (nibble, 5-bit code, or q8 ^ 0x80)
//! i32 lanes after vpdpbusd: 0..4 b, 4..8 b+1, 8..12 b, 12..16 b+1
//! acc[r][t] += cvt(vpdpbusd(0, codes[r], x[t])) * spread(dw[r] * dx[t]);  + m[r] * s[t]
//! ```
//!
//! Three schedules, by token count (thresholds measured end to end on Zen 4, where
//! each step's weights come cold from DRAM):
//! 1. One token (decode at batch 1): `direct_tile` with one token decodes each pair
//!    straight from the ggml rows, 4 rows at a time, and uses it at once; weights
//!    stream through once.
//! 2. 2 to [`DIRECT_TOKENS_MAX`] tokens (batched decode): `direct_tile` decodes each
//!    pair of an `R`-row tile once into registers and dots it with up to
//!    [`DIRECT_TILE_TOKENS`] tokens; later token groups find the rows in L1. Weights
//!    still stream from DRAM once, with no pack buffer to store and reload.
//! 3. More tokens (prefill): pack `TILE_ROWS` rows of a k-chunk once (codes, scales
//!    spread to lanes, mins), then sweep `TILE_ROWS` x `TILE_TOKENS` register tiles over
//!    every token, so each decoded pair serves all tokens.
//!
//! ```text
//! direct_tile, R = 2, T = 8, per pair p:        zmm registers
//!   codes[r], dw[r] = decode(row r, p)           2 + 2
//!   for t: xv, dx = x[t] at p                    2
//!     for r: acc[r][t] += cvt(dpbusd(codes[r], xv)) * (dw[r] * dx)    16 + temps
//!   mins[r][p] = [0, m_b, 0, m_b+1]  (stored; applied 4 pairs per vector per chunk)
//! ```
//!
//! Every schedule computes each (row, token) result with the same operations in the
//! same order — per k-chunk: the pairs in order into one accumulator (`fmadd` of the
//! dot product with `dw * dx`), its lane sum by a fixed tree added to the result, then
//! the chunk's mins four pairs per vector into another accumulator, its lane sum added
//! too; chunks in order — so a token's result is the same
//! bits whatever the batch, tile or schedule it lands in (batch invariance: a prefix
//! served from cache, a sequence recomputed after preemption and one decoded with other
//! tenants' requests all see exactly what they would alone).
//!
//! Invariants:
//! 1. Every function here runs only after `Isa::Avx512.is_available()` (avx512 f, bw,
//!    vl, vnni plus avx2, fma, f16c).
//! 2. `vpdpbusd` does not saturate, so Q8_0 may use unsigned codes q8 + 128 (<= 255):
//!    32 * 255 * 127 fits i32 with room to spare; the +128 is removed via m = -128 d.
//! 3. Padding contributes exactly 0: activations are zero past k (quants, d and s), an
//!    odd last block is paired with itself against those zeros, and packed mins are zero
//!    past the chunk.
//! 4. A k-chunk holds at most [`CHUNK_BLOCKS`] blocks; later chunks add into `out`.

// Register tiles index several per-row and per-token arrays by the same r and t;
// index loops say that more plainly than zipped iterators.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::ops::Range;

use super::activations::{QuantizedActivations, Q8_1_SCALE_ALIGN};
use super::avx2::{
    d_pair, pair_offsets, q8_1_ptrs, q8_pair, PairDecode, Q8Row, Q4_0W, Q4_1W, Q5_0W, Q5_1W,
};
use super::blocks::QK32;
use super::GgmlType;

/// Weight rows per register tile.
const TILE_ROWS: usize = 4;
/// Tokens per register tile (prefill schedule).
const TILE_TOKENS: usize = 4;
/// Weight rows per direct multi-token tile.
const DIRECT_TILE_ROWS: usize = 2;
/// Tokens per direct multi-token tile: `DIRECT_TILE_ROWS` x 8 accumulators plus the
/// decoded rows fit the 32 zmm registers.
const DIRECT_TILE_TOKENS: usize = 8;
/// Up to this many tokens, direct tiles are `TILE_ROWS` high (fewer tokens to share
/// each decoded row, so more rows share each token's loads).
const DIRECT_WIDE_TOKENS_MAX: usize = 4;
/// Up to this many tokens, decode weights directly instead of packing them. Measured
/// end to end (`bulkhead bench engine`): direct wins at 32 tokens, packing at 64.
const DIRECT_TOKENS_MAX: usize = 32;
/// Decode prefetches weights this many rows ahead: far enough to cover DRAM latency
/// for short rows, which the hardware prefetcher streams poorly.
const PREFETCH_ROWS: usize = 4 * TILE_ROWS;
/// Blocks per packed k-chunk (4096 weights: 16 KiB of codes for a 4-row tile).
const CHUNK_BLOCKS: usize = 128;
/// Blocks per 512-bit vector of int8 codes.
const PAIR: usize = 2;
/// f32 lanes in a 512-bit vector.
const LANES: usize = 16;
/// f32 values per pair in `ds` and in packed mins: [d or 0, s or m] x 2.
const PAIR_DS: usize = 4;

const _: () = assert!(CHUNK_BLOCKS.is_multiple_of(Q8_1_SCALE_ALIGN));
const _: () = assert!(Q8_1_SCALE_ALIGN / PAIR * PAIR_DS == LANES);

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
            GgmlType::Q5_0 => drive::<Q5_0W>(w, k, rows, xq, out),
            GgmlType::Q5_1 => drive::<Q5_1W>(w, k, rows, xq, out),
            GgmlType::Q8_0 => drive::<Q8_0Offset>(w, k, rows, xq, out),
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
                super::avx512_k::matmul(ty, w, k, rows, xq, out)
            }
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                super::avx2::matmul_rowwise(ty, w, k, rows, xq, out)
            }
        }
    }
}

/// Q8_0 as unsigned q8 + 128 with m = -128 d (see invariant 2).
struct Q8_0Offset;

impl PairDecode for Q8_0Offset {
    const BYTES: usize = GgmlType::Q8_0.block_bytes();
    #[inline(always)]
    unsafe fn codes(p0: *const u8, p1: *const u8) -> (__m256i, __m256i) {
        let (lo, hi) = q8_pair(p0, p1);
        // q ^ 0x80 reinterprets the signed byte q as the unsigned byte q + 128.
        let flip = _mm256_set1_epi8(i8::MIN);
        (_mm256_xor_si256(lo, flip), _mm256_xor_si256(hi, flip))
    }
    #[inline(always)]
    unsafe fn scales(p0: *const u8, p1: *const u8) -> __m128 {
        d_pair(p0, p1, -128.0)
    }
}

/// One pair's codes as a 512-bit vector.
///
/// # Safety
/// As for `PairDecode::codes`; AVX-512F available.
#[inline(always)]
unsafe fn codes512<W: PairDecode>(p0: *const u8, p1: *const u8) -> __m512i {
    let (lo, hi) = W::codes(p0, p1);
    _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
}

/// Spreads `[a, _, b, _]` to lanes `[a x4, b x4, a x4, b x4]`, matching the i32 lanes.
///
/// # Safety
/// AVX-512F available.
#[inline(always)]
unsafe fn spread(v: __m128) -> __m512 {
    let index = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2);
    _mm512_permutexvar_ps(index, _mm512_castps128_ps512(v))
}

/// Picks the schedule from the token count.
///
/// # Safety
/// AVX-512 set available; shapes validated by the dispatcher.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn drive<W: PairDecode>(
    w: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    let row_bytes = k / QK32 * W::BYTES;
    // SAFETY: rows.end * row_bytes <= w.len() (dispatcher).
    let w_first = w.as_ptr().add(rows.start * row_bytes);
    let geometry = Geometry {
        nb: k / QK32,
        row_bytes,
        n_rows: rows.len(),
    };
    match xq.n_tokens() {
        1 => drive_direct::<W>(w_first, geometry, xq, out),
        n if n <= DIRECT_WIDE_TOKENS_MAX => {
            drive_direct_tokens::<W, TILE_ROWS, TILE_TOKENS>(w_first, geometry, xq, out)
        }
        n if n <= DIRECT_TOKENS_MAX => {
            drive_direct_tokens::<W, DIRECT_TILE_ROWS, DIRECT_TILE_TOKENS>(
                w_first, geometry, xq, out,
            )
        }
        _ => drive_packed::<W>(w_first, geometry, xq, out),
    }
}

/// Shape of the weight rows one `matmul` call covers.
#[derive(Clone, Copy)]
struct Geometry {
    /// Blocks per row.
    nb: usize,
    /// Bytes per row.
    row_bytes: usize,
    /// Rows in the call (`out` holds `n_rows` slots per token).
    n_rows: usize,
}

/// One token: `direct_tile` over `TILE_ROWS`-row tiles, remainder rows one at a
/// time, prefetching ahead (weights stream through once).
///
/// # Safety
/// `w_first` holds `g.n_rows` rows; `out` is `[1][g.n_rows]`; AVX-512 set available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn drive_direct<W: PairDecode>(
    w_first: *const u8,
    g: Geometry,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    let x: [Q8Row; DIRECT_TILE_TOKENS] = [q8_1_ptrs(xq, 0); DIRECT_TILE_TOKENS];
    let mut mins = [[0.0; CHUNK_BLOCKS / PAIR * PAIR_DS]; TILE_ROWS];
    let mut r = 0;
    while r < g.n_rows {
        let tile_rows = if g.n_rows - r >= TILE_ROWS {
            TILE_ROWS
        } else {
            1
        };
        let tile = DirectTile {
            w_rows: w_first.add(r * g.row_bytes),
            x: &x,
            out: out.as_mut_ptr().add(r),
            prefetch: true,
        };
        if tile_rows == TILE_ROWS {
            direct_tile::<W, TILE_ROWS, 1>(tile, g, &mut mins);
        } else {
            direct_tile::<W, 1, 1>(tile, g, &mut mins);
        }
        r += tile_rows;
    }
}

/// Few tokens: for each `DIRECT_TILE_ROWS` row tile, every token group in turn, so
/// the tile's rows come from DRAM once and stay in L1 for the later groups.
///
/// # Safety
/// `w_first` holds `g.n_rows` rows; `out` is `[n_tokens][g.n_rows]`; AVX-512 set
/// available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn drive_direct_tokens<W: PairDecode, const R: usize, const T: usize>(
    w_first: *const u8,
    g: Geometry,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    let n_tokens = xq.n_tokens();
    // Token pointers, padded with the last token so every group reads a whole array.
    let xs: [Q8Row; DIRECT_TOKENS_MAX + DIRECT_TILE_TOKENS] =
        std::array::from_fn(|t| q8_1_ptrs(xq, t.min(n_tokens - 1)));
    let mut mins = [[0.0; CHUNK_BLOCKS / PAIR * PAIR_DS]; TILE_ROWS];
    let mut r = 0;
    while r < g.n_rows {
        let tile_rows = if g.n_rows - r >= R { R } else { 1 };
        let w_rows = w_first.add(r * g.row_bytes);
        let mut t = 0;
        while t < n_tokens {
            let tile_tokens = (n_tokens - t).min(T);
            let tile = DirectTile {
                w_rows,
                x: xs[t..t + DIRECT_TILE_TOKENS]
                    .try_into()
                    .expect("xs is padded by a whole tile"),
                // SAFETY: tile (t, r) lies inside out = [n_tokens][n_rows].
                out: out.as_mut_ptr().add(t * g.n_rows + r),
                // Later token groups find the rows in cache already.
                prefetch: t == 0,
            };
            if tile_rows == R {
                direct_tokens::<W, R>(tile, tile_tokens, g, &mut mins);
            } else {
                direct_tokens::<W, 1>(tile, tile_tokens, g, &mut mins);
            }
            t += tile_tokens;
        }
        r += tile_rows;
    }
}

/// Many tokens: pack each row tile's k-chunks once, then sweep every token over them.
///
/// # Safety
/// `w_first` holds `g.n_rows` rows; `out` is `[n_tokens][g.n_rows]`; AVX-512 set
/// available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn drive_packed<W: PairDecode>(
    w_first: *const u8,
    g: Geometry,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    let mut pack = Packed {
        codes: [[0; CHUNK_BLOCKS * QK32]; TILE_ROWS],
        dw: [[0.0; CHUNK_BLOCKS / PAIR * LANES]; TILE_ROWS],
        m: [[0.0; CHUNK_BLOCKS / PAIR * PAIR_DS]; TILE_ROWS],
    };
    let mut r = 0;
    while r < g.n_rows {
        let tile_rows = if g.n_rows - r >= TILE_ROWS {
            TILE_ROWS
        } else {
            1
        };
        for first_block in (0..g.nb).step_by(CHUNK_BLOCKS) {
            let blocks = CHUNK_BLOCKS.min(g.nb - first_block);
            let chunk = Chunk {
                first_block,
                blocks,
                accumulate: first_block > 0,
            };
            pack_rows::<W>(
                &mut pack,
                w_first.add(r * g.row_bytes),
                g.row_bytes,
                tile_rows,
                chunk,
            );
            sweep_tokens(&pack, chunk, tile_rows, xq, out, r, g.n_rows);
        }
        r += tile_rows;
    }
}

/// Prefetches the `R` x `row_bytes` tile `PREFETCH_ROWS` rows ahead of `w_rows`, a
/// pair's worth of bytes at step (pair `p`, row `r`), as ONE linear stream.
///
/// A tile's rows are contiguous, so walking the region ahead in address order keeps
/// one sequential stream for the hardware prefetcher too; prefetching each row at the
/// pair being decoded instead opened `R` streams a row apart, which halved the
/// DRAM rate for rows of 600 bytes and more (Q8_0 output head, k = 1536 Q4_1).
/// `pairs x R` steps of `PAIR * W::BYTES` bytes cover the tile ahead exactly when a
/// row is one k-chunk (every model shape here); longer rows get part of it, and the
/// hardware prefetcher follows such long rows well on its own.
///
/// # Safety
/// SSE available (prefetch never faults; wrapping_add keeps the address computation
/// defined past the end of the weights).
#[inline(always)]
unsafe fn prefetch_linear<W: PairDecode, const R: usize>(
    w_rows: *const u8,
    row_bytes: usize,
    p: usize,
    r: usize,
) {
    let step = PAIR * W::BYTES;
    let ahead = w_rows.wrapping_add(PREFETCH_ROWS * row_bytes + (p * R + r) * step);
    _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(step - 1) as *const i8);
}

/// One direct multi-token tile: `R` rows from `w_rows` against tokens `x[..T]`.
#[derive(Clone, Copy)]
struct DirectTile<'a> {
    /// First of the tile's rows.
    w_rows: *const u8,
    /// Token rows; only the first `T` are read.
    x: &'a [Q8Row; DIRECT_TILE_TOKENS],
    /// Slot (token 0, row 0) of the tile in `out`, `Geometry::n_rows` per token.
    out: *mut f32,
    /// Whether to prefetch rows ahead (only the first token group streams from DRAM).
    prefetch: bool,
}

/// Per-row packed mins of one k-chunk: `[row][pair][0, m_b, 0, m_b+1]`.
type ChunkMins = [[f32; CHUNK_BLOCKS / PAIR * PAIR_DS]; TILE_ROWS];

/// `direct_tile` for a run-time token count up to `DIRECT_TILE_TOKENS`.
///
/// # Safety
/// As for [`direct_tile`].
#[inline(always)]
unsafe fn direct_tokens<W: PairDecode, const R: usize>(
    tile: DirectTile,
    tile_tokens: usize,
    g: Geometry,
    mins: &mut ChunkMins,
) {
    const _: () = assert!(DIRECT_TILE_TOKENS == 8);
    match tile_tokens {
        1 => direct_tile::<W, R, 1>(tile, g, mins),
        2 => direct_tile::<W, R, 2>(tile, g, mins),
        3 => direct_tile::<W, R, 3>(tile, g, mins),
        4 => direct_tile::<W, R, 4>(tile, g, mins),
        5 => direct_tile::<W, R, 5>(tile, g, mins),
        6 => direct_tile::<W, R, 6>(tile, g, mins),
        7 => direct_tile::<W, R, 7>(tile, g, mins),
        _ => direct_tile::<W, R, DIRECT_TILE_TOKENS>(tile, g, mins),
    }
}

/// Few-token decode schedule: each pair of `R` rows is decoded once into registers
/// and dotted with all `T` tokens; the mins go to `mins` and are applied per k-chunk
/// four pairs per vector, as in [`tile`].
///
/// # Safety
/// `tile.w_rows` holds `R` rows of `g.row_bytes`; `x[..T]` cover `g.nb` blocks,
/// padded; `tile.out` has the `T` x `R` slots at stride `g.n_rows`; AVX-512 set
/// available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn direct_tile<W: PairDecode, const R: usize, const T: usize>(
    tile: DirectTile,
    g: Geometry,
    mins: &mut ChunkMins,
) {
    let zero = _mm512_setzero_si512();
    for first_block in (0..g.nb).step_by(CHUNK_BLOCKS) {
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let blocks = CHUNK_BLOCKS.min(g.nb - first_block);
        let pairs = blocks.div_ceil(PAIR);
        let w_chunk = tile.w_rows.add(first_block * W::BYTES);
        // Activation offsets of the chunk: quants per block, [d, s] per block.
        let (x_qs, x_ds) = (first_block * QK32, first_block * PAIR_DS / PAIR);
        for p in 0..pairs {
            let (o0, o1) = pair_offsets(p, blocks, W::BYTES);
            let mut codes = [zero; R];
            let mut dw = [_mm512_setzero_ps(); R];
            for r in 0..R {
                let row = w_chunk.add(r * g.row_bytes);
                if tile.prefetch {
                    prefetch_linear::<W, R>(w_chunk, g.row_bytes, p, r);
                }
                codes[r] = codes512::<W>(row.add(o0), row.add(o1));
                let scales = W::scales(row.add(o0), row.add(o1));
                dw[r] = spread(scales);
                let m = _mm_blend_ps(_mm_setzero_ps(), scales, 0b1010);
                _mm_storeu_ps(mins[r].as_mut_ptr().add(p * PAIR_DS), m);
            }
            for t in 0..T {
                let (qs, ds) = tile.x[t];
                let xv = _mm512_loadu_si512(qs.add(x_qs + p * PAIR * QK32) as *const _);
                let dx = spread(_mm_loadu_ps(ds.add(x_ds + p * PAIR_DS)));
                for r in 0..R {
                    let sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, codes[r], xv));
                    acc[r][t] = _mm512_fmadd_ps(sums, _mm512_mul_ps(dw[r], dx), acc[r][t]);
                }
            }
        }
        store_sums::<R, T>(&acc, tile.out, g.n_rows, first_block > 0);
        let groups = blocks.div_ceil(Q8_1_SCALE_ALIGN);
        for r in 0..R {
            mins[r][pairs * PAIR_DS..groups * LANES].fill(0.0);
        }
        // m * s for four pairs per vector: [0, m, 0, m] against [d, s, d, s], in
        // an accumulator of their own (the dot products and the offsets are
        // large and cancel: summed apart, then added, they keep more bits).
        let mut offsets = [[_mm512_setzero_ps(); T]; R];
        for gi in 0..groups {
            // SAFETY: group gi lies inside the row's mins (zero-filled to whole groups).
            let m: [__m512; R] = std::array::from_fn(|r| unsafe {
                _mm512_loadu_ps(mins[r].as_ptr().add(gi * LANES))
            });
            for t in 0..T {
                let s = _mm512_loadu_ps(tile.x[t].1.add(x_ds + gi * LANES));
                for r in 0..R {
                    offsets[r][t] = _mm512_fmadd_ps(m[r], s, offsets[r][t]);
                }
            }
        }
        store_sums::<R, T>(&offsets, tile.out, g.n_rows, true);
    }
}

/// Writes `out[t * out_stride + r] = sum of acc[r][t]` (adds it when
/// `accumulate`: a later k-chunk), reducing four accumulators per shuffle tree.
/// Every lane sum takes the same tree ([`hsum4`] and [`hsum1`] agree bit for
/// bit), so a token's result never depends on its place in a tile.
///
/// # Safety
/// `out` has the `T` x `R` slots; AVX-512F available.
#[inline(always)]
unsafe fn store_sums<const R: usize, const T: usize>(
    acc: &[[__m512; T]; R],
    out: *mut f32,
    out_stride: usize,
    accumulate: bool,
) {
    let flat = |i: usize| acc[i % R][i / R];
    let put = |i: usize, sum: f32| {
        // SAFETY: slot (i / R, i % R) is one of the tile's T x R slots.
        let slot = unsafe { out.add(i / R * out_stride + i % R) };
        // SAFETY: as above.
        unsafe { *slot = if accumulate { *slot + sum } else { sum } };
    };
    let mut i = 0;
    while i + 4 <= R * T {
        let sums = hsum4(flat(i), flat(i + 1), flat(i + 2), flat(i + 3));
        let mut lanes = [0.0f32; 4];
        _mm_storeu_ps(lanes.as_mut_ptr(), sums);
        for (j, lane) in lanes.into_iter().enumerate() {
            put(i + j, lane);
        }
        i += 4;
    }
    for i in i..R * T {
        put(i, hsum1(flat(i)));
    }
}

/// The lane sums of four vectors, `[sum a, sum b, sum c, sum d]`, each as
/// `((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))` over `x_i = v_i + v_{i+8}`.
///
/// # Safety
/// AVX-512F available.
#[inline(always)]
unsafe fn hsum4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
    // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7].
    let ab = _mm256_hadd_ps(fold(a), fold(b));
    let cd = _mm256_hadd_ps(fold(c), fold(d));
    let abcd = _mm256_hadd_ps(ab, cd);
    _mm_add_ps(
        _mm256_castps256_ps128(abcd),
        _mm256_extractf128_ps::<1>(abcd),
    )
}

/// The lane sum of one vector by exactly [`hsum4`]'s tree.
///
/// # Safety
/// AVX-512F available.
#[inline(always)]
unsafe fn hsum1(v: __m512) -> f32 {
    let x = fold(v);
    let pairs = _mm256_hadd_ps(x, x);
    let quads = _mm256_hadd_ps(pairs, pairs);
    let sum = _mm_add_ps(
        _mm256_castps256_ps128(quads),
        _mm256_extractf128_ps::<1>(quads),
    );
    _mm_cvtss_f32(sum)
}

/// `[v_i + v_{i+8}]`: the 512-bit vector folded to 256 bits.
///
/// # Safety
/// AVX-512F available.
#[inline(always)]
unsafe fn fold(v: __m512) -> __m256 {
    let high = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v));
    _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(high))
}

/// One row tile's packed k-chunk.
struct Packed {
    /// `[TILE_ROWS][pair][64]` unsigned codes in pair layout.
    codes: [[u8; CHUNK_BLOCKS * QK32]; TILE_ROWS],
    /// `[TILE_ROWS][pair][16]` block scales spread to the i32 lanes.
    dw: [[f32; CHUNK_BLOCKS / PAIR * LANES]; TILE_ROWS],
    /// `[TILE_ROWS][pair][0, m_b, 0, m_b+1]`, zero past the chunk to a whole vector.
    m: [[f32; CHUNK_BLOCKS / PAIR * PAIR_DS]; TILE_ROWS],
}

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

/// Packs `n` rows (at most `TILE_ROWS`) of one chunk into `pack`.
///
/// # Safety
/// `w_rows` holds `n` rows of `row_bytes` covering the chunk; AVX-512 set available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pack_rows<W: PairDecode>(
    pack: &mut Packed,
    w_rows: *const u8,
    row_bytes: usize,
    n: usize,
    chunk: Chunk,
) {
    let pairs = chunk.blocks.div_ceil(PAIR);
    let padded_pairs = chunk.blocks.div_ceil(Q8_1_SCALE_ALIGN) * Q8_1_SCALE_ALIGN / PAIR;
    for r in 0..n {
        let row = w_rows.add(r * row_bytes + chunk.first_block * W::BYTES);
        for p in 0..pairs {
            let (o0, o1) = pair_offsets(p, chunk.blocks, W::BYTES);
            let codes = codes512::<W>(row.add(o0), row.add(o1));
            _mm512_storeu_si512(
                pack.codes[r].as_mut_ptr().add(p * PAIR * QK32) as *mut _,
                codes,
            );
            let scales = W::scales(row.add(o0), row.add(o1));
            _mm512_storeu_ps(pack.dw[r].as_mut_ptr().add(p * LANES), spread(scales));
            let mins = _mm_blend_ps(_mm_setzero_ps(), scales, 0b1010);
            _mm_storeu_ps(pack.m[r].as_mut_ptr().add(p * PAIR_DS), mins);
        }
        pack.m[r][pairs * PAIR_DS..padded_pairs * PAIR_DS].fill(0.0);
    }
}

/// Runs every token tile over one packed chunk of `tile_rows` rows starting at row `r`.
///
/// # Safety
/// As for [`tile`]; AVX-512 set available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn sweep_tokens(
    pack: &Packed,
    chunk: Chunk,
    tile_rows: usize,
    xq: &QuantizedActivations,
    out: &mut [f32],
    r: usize,
    n_rows: usize,
) {
    let n_tokens = xq.n_tokens();
    let mut t = 0;
    while t < n_tokens {
        let tile_tokens = if n_tokens - t >= TILE_TOKENS {
            TILE_TOKENS
        } else {
            1
        };
        let x4: [Q8Row; TILE_TOKENS] = std::array::from_fn(|i| {
            let (qs, ds) = q8_1_ptrs(xq, t + i.min(tile_tokens - 1));
            // SAFETY: the chunk's blocks lie inside the padded activation row.
            unsafe {
                (
                    qs.add(chunk.first_block * QK32),
                    ds.add(chunk.first_block * PAIR_DS / PAIR),
                )
            }
        });
        // SAFETY: tile (t, r) lies inside out = [n_tokens][n_rows].
        let o = out.as_mut_ptr().add(t * n_rows + r);
        match (tile_rows, tile_tokens) {
            (TILE_ROWS, TILE_TOKENS) => tile::<TILE_ROWS, TILE_TOKENS>(pack, chunk, x4, o, n_rows),
            (TILE_ROWS, _) => tile::<TILE_ROWS, 1>(pack, chunk, [x4[0]], o, n_rows),
            (_, TILE_TOKENS) => tile::<1, TILE_TOKENS>(pack, chunk, x4, o, n_rows),
            _ => tile::<1, 1>(pack, chunk, [x4[0]], o, n_rows),
        }
        t += tile_tokens;
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
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for p in 0..chunk.blocks.div_ceil(PAIR) {
        let codes: [__m512i; R] = std::array::from_fn(|r| {
            // SAFETY: pair p lies inside the packed chunk.
            unsafe { _mm512_loadu_si512(pack.codes[r].as_ptr().add(p * PAIR * QK32) as *const _) }
        });
        // SAFETY: as above, for the spread scales.
        let dw: [__m512; R] =
            std::array::from_fn(|r| unsafe { _mm512_loadu_ps(pack.dw[r].as_ptr().add(p * LANES)) });
        for t in 0..T {
            let (qs, ds) = x[t];
            let xv = _mm512_loadu_si512(qs.add(p * PAIR * QK32) as *const _);
            let dx = spread(_mm_loadu_ps(ds.add(p * PAIR_DS)));
            for r in 0..R {
                let sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, codes[r], xv));
                acc[r][t] = _mm512_fmadd_ps(sums, _mm512_mul_ps(dw[r], dx), acc[r][t]);
            }
        }
    }
    store_sums::<R, T>(&acc, out, out_stride, chunk.accumulate);
    // m * s for four pairs per vector: packed [0, m, 0, m] against [d, s, d, s], in
    // an accumulator of their own, as in `direct_tile`.
    let mut offsets = [[_mm512_setzero_ps(); T]; R];
    for g in 0..chunk.blocks.div_ceil(Q8_1_SCALE_ALIGN) {
        for r in 0..R {
            let m = _mm512_loadu_ps(pack.m[r].as_ptr().add(g * LANES));
            for t in 0..T {
                offsets[r][t] =
                    _mm512_fmadd_ps(m, _mm512_loadu_ps(x[t].1.add(g * LANES)), offsets[r][t]);
            }
        }
    }
    store_sums::<R, T>(&offsets, out, out_stride, true);
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
