//! ggml block layouts: scalar dequantization and reference quantizers.
//!
//! Byte layouts, little-endian, exactly as ggml-common.h declares them:
//!
//! ```text
//! Q4_0 (18 B / 32 w):  [d f16][qs u8 x16]            w[j] = d*(lo(qs[j])-8), w[j+16] = d*(hi(qs[j])-8)
//! Q4_1 (20 B / 32 w):  [d f16][m f16][qs u8 x16]     w[j] = d*lo(qs[j])+m,   w[j+16] = d*hi(qs[j])+m
//! Q5_0 (22 B / 32 w):  [d f16][qh u32][qs u8 x16]   q[j] = lo(qs[j]) | bit j of qh << 4,
//!                                                    q[j+16] = hi(qs[j]) | bit j+16 of qh << 4;
//!                                                    w = d*(q-16)
//! Q5_1 (24 B / 32 w):  [d f16][m f16][qh u32][qs u8 x16]   q as Q5_0; w = d*q+m
//! Q8_0 (34 B / 32 w):  [d f16][qs i8 x32]            w[j] = d*qs[j]
//! Q4_K (144 B / 256 w): [d f16][dmin f16][scales u8 x12][qs u8 x128]
//!     8 sub-blocks of 32; 64 weights per 32 qs bytes (low nibbles, then high nibbles);
//!     sub-block scale/min are 6-bit, packed as `scale_min_k4` unpacks them.
//! Q5_K (176 B / 256 w): [d f16][dmin f16][scales u8 x12][qh u8 x32][qs u8 x128]
//!     Q4_K's sub-blocks, scales and nibbles, plus a fifth bit: weight l of 64-weight
//!     chunk c takes bit 2c (low nibble) or 2c+1 (high nibble) of qh[l % 32].
//! BF16 (2 B / 1 w):   the top 16 bits of an f32.
//! Q6_K (210 B / 256 w): [ql u8 x128][qh u8 x64][scales i8 x16][d f16]
//!     16 sub-blocks of 16; q = (4 low bits from ql) | (2 high bits from qh) - 32.
//! ```
//!
//! Invariants:
//! 1. Every function here works on whole blocks; callers' lengths are checked and a
//!    mismatch is a [`QuantError`], never a partial write.
//! 2. The reference quantizers follow ggml's `quantize_row_*_ref` rounding for Q4_0, Q4_1
//!    and Q8_0, so files written with them decode the same in llama.cpp. The K-quant
//!    quantizers are simple (no error search) but produce valid blocks.

use half::f16;

use super::{GgmlType, QuantError};

/// Weights in a Q4_0 / Q4_1 / Q8_0 block.
pub const QK32: usize = 32;
/// Weights in a K-quant super-block.
pub const QK_K: usize = 256;
/// Bytes of packed 6-bit scales and mins in a Q4_K block.
pub const K_SCALE_BYTES: usize = 12;

/// Byte offset of `qs` in a Q4_0 block.
pub const Q4_0_QS: usize = 2;
/// Byte offset of `m` in a Q4_1 block.
pub const Q4_1_M: usize = 2;
/// Byte offset of `qs` in a Q4_1 block.
pub const Q4_1_QS: usize = 4;
/// Byte offset of `qh` in a Q5_0 block.
pub const Q5_0_QH: usize = 2;
/// Byte offset of `qs` in a Q5_0 block.
pub const Q5_0_QS: usize = 6;
/// Byte offset of `m` in a Q5_1 block.
pub const Q5_1_M: usize = 2;
/// Byte offset of `qh` in a Q5_1 block.
pub const Q5_1_QH: usize = 4;
/// Byte offset of `qs` in a Q5_1 block.
pub const Q5_1_QS: usize = 8;
/// Byte offset of `qh` in a Q5_K block.
pub const Q5_K_QH: usize = Q4_K_QS;
/// Byte offset of `qs` in a Q5_K block.
pub const Q5_K_QS: usize = Q5_K_QH + QK_K / 8;
/// Byte offset of `qs` in a Q8_0 block.
pub const Q8_0_QS: usize = 2;
/// Byte offset of `dmin` in a Q4_K block.
pub const Q4_K_DMIN: usize = 2;
/// Byte offset of `scales` in a Q4_K block.
pub const Q4_K_SCALES: usize = 4;
/// Byte offset of `qs` in a Q4_K block.
pub const Q4_K_QS: usize = Q4_K_SCALES + K_SCALE_BYTES;
/// Byte offset of `qh` in a Q6_K block.
pub const Q6_K_QH: usize = QK_K / 2;
/// Byte offset of `scales` in a Q6_K block.
pub const Q6_K_SCALES: usize = Q6_K_QH + QK_K / 4;
/// Byte offset of `d` in a Q6_K block.
pub const Q6_K_D: usize = Q6_K_SCALES + QK_K / 16;

const _: () = assert!(Q4_K_QS + QK_K / 2 == GgmlType::Q4_K.block_bytes());
const _: () = assert!(Q6_K_D + 2 == GgmlType::Q6_K.block_bytes());
const _: () = assert!(Q4_1_QS + QK32 / 2 == GgmlType::Q4_1.block_bytes());
const _: () = assert!(Q8_0_QS + QK32 == GgmlType::Q8_0.block_bytes());
const _: () = assert!(Q5_0_QS + QK32 / 2 == GgmlType::Q5_0.block_bytes());
const _: () = assert!(Q5_1_QS + QK32 / 2 == GgmlType::Q5_1.block_bytes());
const _: () = assert!(Q5_K_QS + QK_K / 2 == GgmlType::Q5_K.block_bytes());

/// Reads the f16 at `bytes[offset..offset + 2]` as f32.
#[inline(always)]
pub fn f16_at(bytes: &[u8], offset: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[offset], bytes[offset + 1]])).to_f32()
}

/// Reads the bfloat16 at `bytes[offset..offset + 2]` as f32 (exact).
#[inline(always)]
pub fn bf16_at(bytes: &[u8], offset: usize) -> f32 {
    f32::from_bits((u16::from_le_bytes([bytes[offset], bytes[offset + 1]]) as u32) << 16)
}

/// The 32 unsigned 5-bit codes (0..=31) of a Q5_0 or Q5_1 block whose high
/// bits are at `qh` and nibbles at `qs`, in weight order.
pub fn q5_codes(block: &[u8], qh: usize, qs: usize) -> [u8; QK32] {
    let high = u32::from_le_bytes([block[qh], block[qh + 1], block[qh + 2], block[qh + 3]]);
    let bit = |j: usize| (((high >> j) & 1) as u8) << 4;
    let mut q = [0u8; QK32];
    for (j, &byte) in block[qs..qs + QK32 / 2].iter().enumerate() {
        q[j] = (byte & 0xF) | bit(j);
        q[j + QK32 / 2] = (byte >> 4) | bit(j + QK32 / 2);
    }
    q
}

/// The 256 unsigned 5-bit codes (0..=31) of a Q5_K block, in weight order.
pub fn q5_k_codes(block: &[u8]) -> [u8; QK_K] {
    let qh = &block[Q5_K_QH..Q5_K_QS];
    let mut q = [0u8; QK_K];
    for (chunk, qs) in block[Q5_K_QS..].chunks_exact(QK32).enumerate() {
        let y = &mut q[chunk * 2 * QK32..(chunk + 1) * 2 * QK32];
        for (l, &byte) in qs.iter().enumerate() {
            y[l] = (byte & 0xF) | (((qh[l] >> (2 * chunk)) & 1) << 4);
            y[l + QK32] = (byte >> 4) | (((qh[l] >> (2 * chunk + 1)) & 1) << 4);
        }
    }
    q
}

/// Unpacks sub-block `j` (0..8) of a Q4_K block's 12 scale bytes into (scale, min),
/// both 6-bit. Sub-blocks 0..4 keep theirs in the low 6 bits of bytes 0..4 / 4..8;
/// sub-blocks 4..8 keep the low 4 bits in bytes 8..12 and the top 2 in the spare bits.
#[inline(always)]
pub fn scale_min_k4(j: usize, scales: &[u8]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        let scale = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4);
        let min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        (scale, min)
    }
}

/// Inverse of [`scale_min_k4`]: packs eight 6-bit scales and mins into 12 bytes.
pub fn pack_scale_min_k4(scale: &[u8; 8], min: &[u8; 8]) -> [u8; K_SCALE_BYTES] {
    let mut packed = [0u8; K_SCALE_BYTES];
    for j in 0..4 {
        packed[j] = (scale[j] & 63) | ((scale[j + 4] >> 4) << 6);
        packed[j + 4] = (min[j] & 63) | ((min[j + 4] >> 4) << 6);
        packed[j + 8] = (scale[j + 4] & 0xF) | ((min[j + 4] & 0xF) << 4);
    }
    packed
}

/// Checks that `bytes` holds exactly the blocks for `weights` values of `ty`.
pub fn check_row(ty: GgmlType, weights: usize, bytes: usize) -> Result<(), QuantError> {
    let block_len = ty.block_len();
    if !weights.is_multiple_of(block_len) {
        return Err(QuantError::PartialBlock {
            ty,
            len: weights,
            block_len,
        });
    }
    let expected = weights / block_len * ty.block_bytes();
    if expected != bytes {
        return Err(QuantError::ByteLength {
            ty,
            weights,
            expected,
            actual: bytes,
        });
    }
    Ok(())
}

/// Decodes `dst.len()` weights of type `ty` from `src` (scalar reference).
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check_row(ty, dst.len(), src.len())?;
    let chunks = src.chunks_exact(ty.block_bytes());
    for (block, out) in chunks.zip(dst.chunks_exact_mut(ty.block_len())) {
        match ty {
            GgmlType::F32 => out[0] = f32::from_le_bytes([block[0], block[1], block[2], block[3]]),
            GgmlType::F16 => out[0] = f16_at(block, 0),
            GgmlType::BF16 => out[0] = bf16_at(block, 0),
            GgmlType::Q4_0 => dequantize_q4_0(block, out),
            GgmlType::Q4_1 => dequantize_q4_1(block, out),
            GgmlType::Q5_0 => dequantize_q5(block, out, Q5_0_QH, Q5_0_QS, None),
            GgmlType::Q5_1 => dequantize_q5(block, out, Q5_1_QH, Q5_1_QS, Some(Q5_1_M)),
            GgmlType::Q8_0 => dequantize_q8_0(block, out),
            GgmlType::Q4_K => dequantize_q4_k(block, out),
            GgmlType::Q5_K => dequantize_q5_k(block, out),
            GgmlType::Q6_K => dequantize_q6_k(block, out),
        }
    }
    Ok(())
}

fn dequantize_q4_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    for (j, &q) in block[Q4_0_QS..Q4_0_QS + QK32 / 2].iter().enumerate() {
        out[j] = d * ((q & 0xF) as i32 - 8) as f32;
        out[j + QK32 / 2] = d * ((q >> 4) as i32 - 8) as f32;
    }
}

fn dequantize_q4_1(block: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(block, 0), f16_at(block, Q4_1_M));
    for (j, &q) in block[Q4_1_QS..Q4_1_QS + QK32 / 2].iter().enumerate() {
        out[j] = d * (q & 0xF) as f32 + m;
        out[j + QK32 / 2] = d * (q >> 4) as f32 + m;
    }
}

/// Q5_0 (`min` absent: w = d*(q-16)) or Q5_1 (`min` at that offset: w = d*q+m).
fn dequantize_q5(block: &[u8], out: &mut [f32], qh: usize, qs: usize, min: Option<usize>) {
    let d = f16_at(block, 0);
    let q = q5_codes(block, qh, qs);
    for (o, &code) in out.iter_mut().zip(&q) {
        *o = match min {
            None => d * (code as i32 - 16) as f32,
            Some(m) => d * code as f32 + f16_at(block, m),
        };
    }
}

fn dequantize_q5_k(block: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(block, 0), f16_at(block, Q4_K_DMIN));
    let scales = &block[Q4_K_SCALES..Q4_K_QS];
    let q = q5_k_codes(block);
    for (j, (y, q)) in out
        .chunks_exact_mut(QK32)
        .zip(q.chunks_exact(QK32))
        .enumerate()
    {
        let (sc, m) = scale_min_k4(j, scales);
        for (y, &code) in y.iter_mut().zip(q) {
            *y = d * sc as f32 * code as f32 - dmin * m as f32;
        }
    }
}

fn dequantize_q8_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    for (o, &q) in out.iter_mut().zip(&block[Q8_0_QS..Q8_0_QS + QK32]) {
        *o = d * (q as i8) as f32;
    }
}

fn dequantize_q4_k(block: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(block, 0), f16_at(block, Q4_K_DMIN));
    let scales = &block[Q4_K_SCALES..Q4_K_QS];
    // Each 32 qs bytes hold two sub-blocks: low nibbles, then high nibbles.
    for (chunk, qs) in block[Q4_K_QS..].chunks_exact(QK32).enumerate() {
        let (sc_lo, m_lo) = scale_min_k4(2 * chunk, scales);
        let (sc_hi, m_hi) = scale_min_k4(2 * chunk + 1, scales);
        let y = &mut out[chunk * 2 * QK32..(chunk + 1) * 2 * QK32];
        for (l, &q) in qs.iter().enumerate() {
            y[l] = d * sc_lo as f32 * (q & 0xF) as f32 - dmin * m_lo as f32;
            y[l + QK32] = d * sc_hi as f32 * (q >> 4) as f32 - dmin * m_hi as f32;
        }
    }
}

/// The 256 signed 6-bit quants (-32..=31) of a Q6_K block, in weight order.
pub fn q6_k_quants(block: &[u8]) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for half in 0..2 {
        let ql = &block[half * 64..half * 64 + 64];
        let qh = &block[Q6_K_QH + half * 32..Q6_K_QH + half * 32 + 32];
        let y = &mut q[half * 128..half * 128 + 128];
        for l in 0..32 {
            let h = qh[l];
            y[l] = ((ql[l] & 0xF) | ((h & 3) << 4)) as i8 - 32;
            y[l + 32] = ((ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4)) as i8 - 32;
            y[l + 64] = ((ql[l] >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32;
            y[l + 96] = ((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    q
}

fn dequantize_q6_k(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, Q6_K_D);
    let q = q6_k_quants(block);
    for (i, y) in out.iter_mut().enumerate() {
        let scale = block[Q6_K_SCALES + i / 16] as i8;
        *y = d * scale as f32 * q[i] as f32;
    }
}
