//! Reference weight quantizers: f32 rows to ggml blocks.
//!
//! Invariants:
//! 1. Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and BF16 round exactly as ggml's reference
//!    quantizers do, so a model written here decodes identically in llama.cpp.
//! 2. Q4_K, Q5_K and Q6_K use a plain min/max fit per sub-block (no iterative search): the
//!    blocks are valid and decode within one quantization step, but are not the
//!    bit-identical blocks llama.cpp would write.

use half::f16;

use super::blocks::{
    check_row, f16_at, pack_scale_min_k4, Q4_0_QS, Q4_1_M, Q4_1_QS, Q4_K_DMIN, Q4_K_QS,
    Q4_K_SCALES, Q5_0_QH, Q5_0_QS, Q5_1_M, Q5_1_QH, Q5_1_QS, Q5_K_QH, Q5_K_QS, Q6_K_D, Q6_K_QH,
    Q6_K_SCALES, Q8_0_QS, QK32, QK_K,
};
use super::{GgmlType, QuantError};

/// Largest 6-bit Q4_K sub-block scale or min.
const K4_SCALE_MAX: f32 = 63.0;
/// Largest unsigned 4-bit quant.
const NIBBLE_MAX: f32 = 15.0;
/// Largest unsigned 5-bit quant.
const FIVE_BIT_MAX: f32 = 31.0;

/// Quantizes `src` into `dst` blocks of type `ty` (reference, not fast).
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    check_row(ty, src.len(), dst.len())?;
    let blocks = dst.chunks_exact_mut(ty.block_bytes());
    for (block, x) in blocks.zip(src.chunks_exact(ty.block_len())) {
        match ty {
            GgmlType::F32 => block.copy_from_slice(&x[0].to_le_bytes()),
            GgmlType::F16 => block.copy_from_slice(&f16::from_f32(x[0]).to_bits().to_le_bytes()),
            GgmlType::BF16 => block.copy_from_slice(&bf16_bits(x[0]).to_le_bytes()),
            GgmlType::Q4_0 => quantize_q4_0(x, block),
            GgmlType::Q4_1 => quantize_q4_1(x, block),
            GgmlType::Q5_0 => quantize_q5_0(x, block),
            GgmlType::Q5_1 => quantize_q5_1(x, block),
            GgmlType::Q8_0 => quantize_q8_0(x, block),
            GgmlType::Q4_K => quantize_q4_k(x, block),
            GgmlType::Q5_K => quantize_q5_k(x, block),
            GgmlType::Q6_K => quantize_q6_k(x, block),
        }
    }
    Ok(())
}

fn put_f16(bytes: &mut [u8], offset: usize, value: f32) {
    bytes[offset..offset + 2].copy_from_slice(&f16::from_f32(value).to_bits().to_le_bytes());
}

/// The value with the largest magnitude, sign kept.
fn signed_absmax(x: &[f32]) -> f32 {
    x.iter().fold(
        0.0f32,
        |best, &v| if v.abs() > best.abs() { v } else { best },
    )
}

fn quantize_q4_0(x: &[f32], block: &mut [u8]) {
    let max = signed_absmax(x);
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(block, 0, d);
    // ggml truncates x*id + 8.5 towards zero; the result is within 0..=16, clamp to 15.
    let code = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
    for j in 0..QK32 / 2 {
        block[Q4_0_QS + j] = code(x[j]) | (code(x[j + QK32 / 2]) << 4);
    }
}

fn quantize_q4_1(x: &[f32], block: &mut [u8]) {
    let min = x.iter().copied().fold(f32::MAX, f32::min);
    let max = x.iter().copied().fold(f32::MIN, f32::max);
    let d = (max - min) / NIBBLE_MAX;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(block, 0, d);
    put_f16(block, Q4_1_M, min);
    let code = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
    for j in 0..QK32 / 2 {
        block[Q4_1_QS + j] = code(x[j]) | (code(x[j + QK32 / 2]) << 4);
    }
}

fn quantize_q8_0(x: &[f32], block: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(block, 0, d);
    for (q, &v) in block[Q8_0_QS..].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
}

/// A K-quant super-block fitted as Q4_K and Q5_K store it.
struct AffineK {
    d: f32,
    dmin: f32,
    scale: [u8; 8],
    min: [u8; 8],
    /// Codes 0..=`code_max`, in weight order.
    q: [u8; QK_K],
}

/// Per sub-block affine fit: w ~ d * scale * q - dmin * min, q in 0..=`code_max`.
fn fit_affine_k(x: &[f32], code_max: f32) -> AffineK {
    let mut scale_f = [0.0f32; 8];
    let mut min_f = [0.0f32; 8];
    for (j, sub) in x.chunks_exact(QK32).enumerate() {
        let lo = sub.iter().copied().fold(0.0f32, f32::min);
        let hi = sub.iter().copied().fold(f32::MIN, f32::max);
        scale_f[j] = (hi - lo) / code_max;
        min_f[j] = -lo;
    }
    let d = f16::from_f32(scale_f.iter().copied().fold(0.0, f32::max) / K4_SCALE_MAX).to_f32();
    let dmin = f16::from_f32(min_f.iter().copied().fold(0.0, f32::max) / K4_SCALE_MAX).to_f32();
    let six_bit = |v: f32, unit: f32| {
        if unit > 0.0 {
            (v / unit).round().min(K4_SCALE_MAX) as u8
        } else {
            0
        }
    };
    let scale: [u8; 8] = std::array::from_fn(|j| six_bit(scale_f[j], d));
    let min: [u8; 8] = std::array::from_fn(|j| six_bit(min_f[j], dmin));
    let mut q = [0u8; QK_K];
    for (i, (qi, &v)) in q.iter_mut().zip(x).enumerate() {
        let (step, offset) = (d * scale[i / QK32] as f32, dmin * min[i / QK32] as f32);
        *qi = if step > 0.0 {
            ((v + offset) / step).round().clamp(0.0, code_max) as u8
        } else {
            0
        };
    }
    AffineK {
        d,
        dmin,
        scale,
        min,
        q,
    }
}

/// Writes the header shared by Q4_K and Q5_K: d, dmin, packed scales and mins.
fn put_affine_k_header(fit: &AffineK, block: &mut [u8]) {
    put_f16(block, 0, fit.d);
    put_f16(block, Q4_K_DMIN, fit.dmin);
    block[Q4_K_SCALES..Q4_K_QS].copy_from_slice(&pack_scale_min_k4(&fit.scale, &fit.min));
}

fn quantize_q4_k(x: &[f32], block: &mut [u8]) {
    let fit = fit_affine_k(x, NIBBLE_MAX);
    put_affine_k_header(&fit, block);
    let q = &fit.q;
    for chunk in 0..QK_K / 64 {
        for l in 0..QK32 {
            block[Q4_K_QS + chunk * QK32 + l] = q[chunk * 64 + l] | (q[chunk * 64 + QK32 + l] << 4);
        }
    }
}

fn quantize_q5_k(x: &[f32], block: &mut [u8]) {
    let fit = fit_affine_k(x, FIVE_BIT_MAX);
    put_affine_k_header(&fit, block);
    let q = &fit.q;
    block[Q5_K_QH..Q5_K_QS].fill(0);
    for chunk in 0..QK_K / 64 {
        for l in 0..QK32 {
            let (lo, hi) = (q[chunk * 64 + l], q[chunk * 64 + QK32 + l]);
            block[Q5_K_QS + chunk * QK32 + l] = (lo & 0xF) | ((hi & 0xF) << 4);
            block[Q5_K_QH + l] |= ((lo >> 4) << (2 * chunk)) | ((hi >> 4) << (2 * chunk + 1));
        }
    }
}

/// ggml's `quantize_row_q5_0_ref`: d = max / -16, codes truncated from x/d + 16.5.
fn quantize_q5_0(x: &[f32], block: &mut [u8]) {
    let max = signed_absmax(x);
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(block, 0, d);
    let codes: [u8; QK32] = std::array::from_fn(|j| ((x[j] * id + 16.5) as i8).min(31) as u8);
    put_q5_codes(&codes, block, Q5_0_QH, Q5_0_QS);
}

/// ggml's `quantize_row_q5_1_ref`: d = (max - min) / 31, m = min, codes rounded.
fn quantize_q5_1(x: &[f32], block: &mut [u8]) {
    let min = x.iter().copied().fold(f32::MAX, f32::min);
    let max = x.iter().copied().fold(f32::MIN, f32::max);
    let d = (max - min) / FIVE_BIT_MAX;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(block, 0, d);
    put_f16(block, Q5_1_M, min);
    let codes: [u8; QK32] = std::array::from_fn(|j| (((x[j] - min) * id + 0.5) as u8).min(31));
    put_q5_codes(&codes, block, Q5_1_QH, Q5_1_QS);
}

/// Packs 32 five-bit codes: nibbles at `qs` (weights j and j+16 share byte j),
/// fifth bits at `qh` (bit j for weight j).
fn put_q5_codes(codes: &[u8; QK32], block: &mut [u8], qh: usize, qs: usize) {
    let mut high = 0u32;
    for j in 0..QK32 / 2 {
        let (a, b) = (codes[j], codes[j + QK32 / 2]);
        block[qs + j] = (a & 0xF) | ((b & 0xF) << 4);
        high |= (((a >> 4) & 1) as u32) << j | (((b >> 4) & 1) as u32) << (j + QK32 / 2);
    }
    block[qh..qh + 4].copy_from_slice(&high.to_le_bytes());
}

/// ggml's `ggml_compute_fp32_to_bf16`: round to nearest even, NaN kept quiet.
fn bf16_bits(v: f32) -> u16 {
    let u = v.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

fn quantize_q6_k(x: &[f32], block: &mut [u8]) {
    // Sub-block scales relative to the super-block scale d, as signed 8-bit.
    let sub_scale: [f32; 16] =
        std::array::from_fn(|i| signed_absmax(&x[i * 16..i * 16 + 16]) / -32.0);
    let d = f16::from_f32(signed_absmax(&sub_scale).abs() / 127.0).to_f32();
    put_f16(block, Q6_K_D, d);
    let mut q = [0u8; QK_K];
    for i in 0..16 {
        let sc = if d > 0.0 {
            (sub_scale[i] / d).round().clamp(-128.0, 127.0) as i8
        } else {
            0
        };
        block[Q6_K_SCALES + i] = sc as u8;
        let step = d * sc as f32;
        for l in 0..16 {
            let v = if step != 0.0 {
                (x[i * 16 + l] / step).round().clamp(-32.0, 31.0)
            } else {
                0.0
            };
            q[i * 16 + l] = (v as i32 + 32) as u8;
        }
    }
    for half in 0..2 {
        let y = &q[half * 128..half * 128 + 128];
        for l in 0..32 {
            let (q1, q2, q3, q4) = (y[l], y[l + 32], y[l + 64], y[l + 96]);
            block[half * 64 + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
            block[half * 64 + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
            block[Q6_K_QH + half * 32 + l] =
                (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    debug_assert!(f16_at(block, Q6_K_D) == d);
}
