//! Activations quantized for the integer dot products ("vec_dot_type" in ggml).
//!
//! Each weight type pairs with one activation format:
//!
//! ```text
//! weights            activations   per block of activations
//! F32, F16, BF16     F32           the values themselves
//! Q4_0, Q4_1, Q5_0,  Q8_1          32 x i8 q, f32 d, f32 s = d * sum(q)
//!   Q5_1, Q8_0
//! Q4_K, Q5_K, Q6_K   Q8_K          256 x i8 q, f32 d, 16 x i16 bsums (sums of 16 q)
//! ```
//!
//! Q4_0 and Q8_0 pair with Q8_1 (not ggml's Q8_0) because the SIMD kernels feed
//! weights to `vpdpbusd` as unsigned bytes (nibble, or q8 + 128) and subtract the
//! offset times `s` afterwards; the sum makes that free.
//!
//! Q8_1 rows are laid out in pairs of blocks (b, b+1), 16-byte lanes interleaved so
//! that the two blocks' nibble-unpacked weights line up without a permute:
//!
//! ```text
//! qs per pair (64 B):  [b q0..16][b+1 q0..16][b q16..32][b+1 q16..32]
//! ds per pair (4 f32): [d_b, s_b, d_b+1, s_b+1]
//! ```
//!
//! Invariants:
//! 1. Activation quants lie in -127..=127 (never -128), so the AVX2 sign trick and
//!    `vpmaddubsw` pair sums cannot overflow i16 for 4-bit and 6-bit weights.
//! 2. Q8_1 rows are padded with zero blocks (q = 0, d = 0, s = 0) to [`Q8_1_QS_ALIGN`]
//!    bytes and [`Q8_1_SCALE_ALIGN`] blocks, so kernels may read whole pairs and whole
//!    512-bit vectors of `ds` past k.
//! 3. Lifecycle: build once per worker (`with_capacity` at startup), then
//!    `quantize` per step; buffers reallocate only when a step is larger than any before.

// ggml's names for the block formats (Q8_1, Q8_K) read better than camel case here.
#![allow(non_camel_case_types)]

use super::blocks::{QK32, QK_K};
use super::{GgmlType, QuantError};

/// Q8_1 rows are padded to this many bytes (two 32-blocks: one 512-bit vector).
pub const Q8_1_QS_ALIGN: usize = 64;
/// Q8_1 scale rows are padded to this many blocks (their `ds` fill one 512-bit vector).
pub const Q8_1_SCALE_ALIGN: usize = 8;
/// f32 values per Q8_1 block in `ds`: d and s.
pub const Q8_1_DS: usize = 2;
/// Bytes in one 16-quant lane of a Q8_1 pair.
const Q8_1_LANE: usize = 16;
/// Largest activation quant magnitude (see invariant 1).
const Q8_MAX: f32 = 127.0;
/// Q8_K block-sum group size.
pub const Q8_K_BSUM_LEN: usize = 16;

/// How activations are stored for a given weight type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActivationFormat {
    /// Plain f32, for F32 and F16 weights.
    F32,
    /// 32-value blocks with scale and scaled sum, for Q4_0, Q4_1 and Q8_0 weights.
    Q8_1,
    /// 256-value blocks with scale and 16-value sums, for Q4_K and Q6_K weights.
    Q8_K,
}

impl ActivationFormat {
    /// The format the weight type's dot product consumes.
    pub const fn for_weights(ty: GgmlType) -> ActivationFormat {
        match ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => ActivationFormat::F32,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                ActivationFormat::Q8_1
            }
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => ActivationFormat::Q8_K,
        }
    }
}

/// A reusable buffer of `n_tokens` activation rows of `k` values each.
#[derive(Debug, Clone)]
pub struct QuantizedActivations {
    format: ActivationFormat,
    n_tokens: usize,
    k: usize,
    /// `[n_tokens][k]` (F32 format only).
    values: Vec<f32>,
    /// `[n_tokens][qs_stride]` quants (Q8 formats).
    qs: Vec<i8>,
    /// Q8_1: [n_tokens][scale_stride / 2][d, s]; Q8_K: [n_tokens][k / 256] scales d.
    d: Vec<f32>,
    /// [n_tokens][k / 16] sums of 16 consecutive quants (Q8_K only).
    bsums: Vec<i16>,
}

impl Default for QuantizedActivations {
    fn default() -> Self {
        QuantizedActivations::new()
    }
}

/// `value` rounded up to a multiple of `align`.
const fn round_up(value: usize, align: usize) -> usize {
    value.div_ceil(align) * align
}

/// Clears `buf` and refills it with `len` zeros; allocates only above its capacity.
fn reset<T: Copy + Default>(buf: &mut Vec<T>, len: usize) {
    buf.clear();
    buf.resize(len, T::default());
}

impl QuantizedActivations {
    /// An empty buffer; the first `quantize` allocates.
    pub fn new() -> Self {
        QuantizedActivations {
            format: ActivationFormat::F32,
            n_tokens: 0,
            k: 0,
            values: Vec::new(),
            qs: Vec::new(),
            d: Vec::new(),
            bsums: Vec::new(),
        }
    }

    /// A buffer sized for up to `n_tokens_max` rows of `k_max` values of any format,
    /// so later `quantize` calls within those limits never allocate.
    pub fn with_capacity(n_tokens_max: usize, k_max: usize) -> Self {
        let scales = round_up(k_max.div_ceil(QK32), Q8_1_SCALE_ALIGN);
        QuantizedActivations {
            values: Vec::with_capacity(n_tokens_max * k_max),
            qs: Vec::with_capacity(n_tokens_max * round_up(k_max, Q8_1_QS_ALIGN)),
            d: Vec::with_capacity(n_tokens_max * scales * Q8_1_DS),
            bsums: Vec::with_capacity(n_tokens_max * k_max.div_ceil(Q8_K_BSUM_LEN)),
            ..QuantizedActivations::new()
        }
    }

    /// Quantizes `x` (`[n_tokens][k]`) for a dot product with `weight_ty` weights.
    pub fn quantize(
        &mut self,
        weight_ty: GgmlType,
        x: &[f32],
        n_tokens: usize,
        k: usize,
    ) -> Result<(), QuantError> {
        if x.len() != n_tokens * k {
            let (expected, actual) = (n_tokens * k, x.len());
            return Err(QuantError::ActivationLength {
                n_tokens,
                k,
                expected,
                actual,
            });
        }
        let format = ActivationFormat::for_weights(weight_ty);
        let block_len = match format {
            ActivationFormat::F32 => 1,
            ActivationFormat::Q8_1 => QK32,
            ActivationFormat::Q8_K => QK_K,
        };
        if !k.is_multiple_of(block_len) {
            return Err(QuantError::PartialBlock {
                ty: weight_ty,
                len: k,
                block_len,
            });
        }
        (self.format, self.n_tokens, self.k) = (format, n_tokens, k);
        match format {
            ActivationFormat::F32 => {
                self.values.clear();
                self.values.extend_from_slice(x);
            }
            ActivationFormat::Q8_1 => self.quantize_q8_1(x),
            ActivationFormat::Q8_K => self.quantize_q8_k(x),
        }
        Ok(())
    }

    fn quantize_q8_1(&mut self, x: &[f32]) {
        let (qs_stride, ds_stride) = (self.qs_stride(), self.scale_stride() * Q8_1_DS);
        reset(&mut self.qs, self.n_tokens * qs_stride);
        reset(&mut self.d, self.n_tokens * ds_stride);
        let mut block = [0i8; QK32];
        for t in 0..self.n_tokens {
            let row = &x[t * self.k..(t + 1) * self.k];
            for (b, values) in row.chunks_exact(QK32).enumerate() {
                let (d, sum) = quantize_block(values, &mut block);
                let (lo, hi) = q8_1_lanes(b);
                let qs = &mut self.qs[t * qs_stride..][..qs_stride];
                qs[lo..lo + Q8_1_LANE].copy_from_slice(&block[..Q8_1_LANE]);
                qs[hi..hi + Q8_1_LANE].copy_from_slice(&block[Q8_1_LANE..]);
                let ds = &mut self.d[t * ds_stride + b * Q8_1_DS..][..Q8_1_DS];
                ds.copy_from_slice(&[d, d * sum as f32]);
            }
        }
    }

    fn quantize_q8_k(&mut self, x: &[f32]) {
        let (n, k) = (self.n_tokens, self.k);
        reset(&mut self.qs, n * k);
        reset(&mut self.d, n * k / QK_K);
        reset(&mut self.bsums, n * k / Q8_K_BSUM_LEN);
        for (b, values) in x.chunks_exact(QK_K).enumerate() {
            let q = &mut self.qs[b * QK_K..][..QK_K];
            let (d, _) = quantize_block(values, q);
            self.d[b] = d;
            for (g, group) in q.chunks_exact(Q8_K_BSUM_LEN).enumerate() {
                // 16 values of at most 127 in magnitude: |sum| <= 2032 fits i16.
                let sum: i32 = group.iter().map(|&v| v as i32).sum();
                self.bsums[b * (QK_K / Q8_K_BSUM_LEN) + g] = sum as i16;
            }
        }
    }

    /// The format currently held.
    pub fn format(&self) -> ActivationFormat {
        self.format
    }

    /// Rows currently held.
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// Values per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes between consecutive token rows of quants.
    pub(crate) fn qs_stride(&self) -> usize {
        match self.format {
            ActivationFormat::Q8_1 => round_up(self.k, Q8_1_QS_ALIGN),
            _ => self.k,
        }
    }

    /// Bytes currently reserved by the buffers (for memory accounting and tests of
    /// the no-reallocation contract).
    pub fn capacity_bytes(&self) -> usize {
        self.values.capacity() * 4
            + self.qs.capacity()
            + self.d.capacity() * 4
            + self.bsums.capacity() * 2
    }

    /// Blocks (padded) between consecutive token rows of scales.
    pub(crate) fn scale_stride(&self) -> usize {
        match self.format {
            ActivationFormat::Q8_1 => round_up(self.k / QK32, Q8_1_SCALE_ALIGN),
            _ => self.k / QK_K,
        }
    }

    /// Token `t`'s f32 values (F32 format).
    pub(crate) fn values(&self, t: usize) -> &[f32] {
        &self.values[t * self.k..(t + 1) * self.k]
    }

    /// Token `t`'s padded Q8_1 row: pair-interleaved quants and [d, s] per block.
    pub(crate) fn q8_1_row(&self, t: usize) -> (&[i8], &[f32]) {
        debug_assert_eq!(self.format, ActivationFormat::Q8_1);
        let (qs_stride, ds_stride) = (self.qs_stride(), self.scale_stride() * Q8_1_DS);
        (
            &self.qs[t * qs_stride..(t + 1) * qs_stride],
            &self.d[t * ds_stride..(t + 1) * ds_stride],
        )
    }

    /// Block `b` of token `t` in weight order: (quants, d, s). For the scalar path.
    pub(crate) fn q8_1_block(&self, t: usize, b: usize) -> ([i8; QK32], f32, f32) {
        let (qs, ds) = self.q8_1_row(t);
        let (lo, hi) = q8_1_lanes(b);
        let mut block = [0i8; QK32];
        block[..Q8_1_LANE].copy_from_slice(&qs[lo..lo + Q8_1_LANE]);
        block[Q8_1_LANE..].copy_from_slice(&qs[hi..hi + Q8_1_LANE]);
        (block, ds[b * Q8_1_DS], ds[b * Q8_1_DS + 1])
    }

    /// Token `t`'s Q8_K quants (`[k]`) and scales (`[k / 256]`).
    pub(crate) fn q8_k_row(&self, t: usize) -> (&[i8], &[f32]) {
        debug_assert_eq!(self.format, ActivationFormat::Q8_K);
        let blocks = self.k / QK_K;
        (
            &self.qs[t * self.k..(t + 1) * self.k],
            &self.d[t * blocks..(t + 1) * blocks],
        )
    }

    /// Token `t`'s Q8_K block sums (`[k / 256][16]`).
    pub(crate) fn bsums(&self, t: usize) -> &[i16] {
        let stride = self.k / Q8_K_BSUM_LEN;
        &self.bsums[t * stride..(t + 1) * stride]
    }
}

/// Byte offsets within a Q8_1 row of block `b`'s quants 0..16 and 16..32.
const fn q8_1_lanes(b: usize) -> (usize, usize) {
    let pair = b / 2 * 2 * QK32;
    let lane = (b % 2) * Q8_1_LANE;
    (pair + lane, pair + 2 * Q8_1_LANE + lane)
}

/// Symmetric 8-bit quantization of one block: returns (d, sum of quants).
/// Rounds to the nearest integer, ties to even, for |x| < 2^22: adding and
/// subtracting 1.5 * 2^23 leaves no fraction bits, so the FPU's default rounding
/// (ties to even) does the work. Unlike `f32::round_ties_even` it needs no libm
/// call on baseline x86-64, so the loop stays inlined.
#[inline(always)]
fn round_ties_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

fn quantize_block(values: &[f32], q: &mut [i8]) -> (f32, i32) {
    let amax = values.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / Q8_MAX;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (qi, &v) in q.iter_mut().zip(values) {
        // Ties to even, as `cvtps2dq` rounds, so a SIMD quantizer can match exactly.
        let code = round_ties_even(v * id).clamp(-Q8_MAX, Q8_MAX) as i8;
        *qi = code;
        sum += code as i32;
    }
    (d, sum)
}
