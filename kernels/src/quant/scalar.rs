//! Portable reference dot products: the semantics every SIMD path must reproduce.
//!
//! Invariants:
//! 1. Integer sums are exact (i32); only the per-block scaling is floating point, so
//!    SIMD paths differ from these only by f32 summation order.
//! 2. These functions favour clarity over speed; they are the test oracle and the
//!    fallback on CPUs without AVX2.

use super::activations::QuantizedActivations;
use super::blocks::{
    bf16_at, f16_at, q5_codes, q5_k_codes, q6_k_quants, scale_min_k4, Q4_0_QS, Q4_1_M, Q4_1_QS,
    Q4_K_DMIN, Q4_K_QS, Q4_K_SCALES, Q5_0_QH, Q5_0_QS, Q5_1_M, Q5_1_QH, Q5_1_QS, Q6_K_D,
    Q6_K_SCALES, Q8_0_QS, QK32, QK_K,
};
use super::GgmlType;

/// Scalar matmul over `rows`; arguments already validated by the dispatcher.
pub fn matmul(
    ty: GgmlType,
    w: &[u8],
    k: usize,
    rows: std::ops::Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    let row_bytes = k / ty.block_len() * ty.block_bytes();
    let n_rows = rows.len();
    for t in 0..xq.n_tokens() {
        for (i, r) in rows.clone().enumerate() {
            let w_row = &w[r * row_bytes..(r + 1) * row_bytes];
            out[t * n_rows + i] = dot_row(ty, w_row, xq, t);
        }
    }
}

/// Dot product of one weight row with token `t`'s activations.
pub fn dot_row(ty: GgmlType, w_row: &[u8], xq: &QuantizedActivations, t: usize) -> f32 {
    match ty {
        GgmlType::F32 => w_row
            .chunks_exact(4)
            .zip(xq.values(t))
            .map(|(b, &x)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x)
            .sum(),
        GgmlType::F16 => (0..xq.k())
            .map(|i| f16_at(w_row, 2 * i) * xq.values(t)[i])
            .sum(),
        GgmlType::BF16 => (0..xq.k())
            .map(|i| bf16_at(w_row, 2 * i) * xq.values(t)[i])
            .sum(),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
            dot_row_b32(ty, w_row, xq, t)
        }
        GgmlType::Q4_K => dot_row_q4_k(w_row, xq, t),
        GgmlType::Q5_K => dot_row_q5_k(w_row, xq, t),
        GgmlType::Q6_K => dot_row_q6_k(w_row, xq, t),
    }
}

fn dot_row_b32(ty: GgmlType, w_row: &[u8], xq: &QuantizedActivations, t: usize) -> f32 {
    let mut sum = 0.0f32;
    for (b, block) in w_row.chunks_exact(ty.block_bytes()).enumerate() {
        let (x, dx, sx) = xq.q8_1_block(t, b);
        let dw = f16_at(block, 0);
        sum += match ty {
            GgmlType::Q4_0 => {
                let q = &block[Q4_0_QS..Q4_0_QS + QK32 / 2];
                dw * dx * nibble_dot(q, &x, -8) as f32
            }
            GgmlType::Q4_1 => {
                let q = &block[Q4_1_QS..Q4_1_QS + QK32 / 2];
                dw * dx * nibble_dot(q, &x, 0) as f32 + f16_at(block, Q4_1_M) * sx
            }
            GgmlType::Q5_0 => {
                let q = q5_codes(block, Q5_0_QH, Q5_0_QS);
                dw * dx * code_dot(&q, &x, -16) as f32
            }
            GgmlType::Q5_1 => {
                let q = q5_codes(block, Q5_1_QH, Q5_1_QS);
                dw * dx * code_dot(&q, &x, 0) as f32 + f16_at(block, Q5_1_M) * sx
            }
            _ => {
                let q = &block[Q8_0_QS..Q8_0_QS + QK32];
                let isum: i32 = q
                    .iter()
                    .zip(&x)
                    .map(|(&w, &x)| (w as i8) as i32 * x as i32)
                    .sum();
                dw * dx * isum as f32
            }
        };
    }
    sum
}

/// Sum of (nibble + offset) * x over a 16-byte ggml nibble block (low nibbles are
/// weights 0..16, high nibbles 16..32).
fn nibble_dot(q: &[u8], x: &[i8], offset: i32) -> i32 {
    let mut sum = 0i32;
    for (j, &byte) in q.iter().enumerate() {
        sum += ((byte & 0xF) as i32 + offset) * x[j] as i32;
        sum += ((byte >> 4) as i32 + offset) * x[j + QK32 / 2] as i32;
    }
    sum
}

/// Sum of (code + offset) * x over 32 codes in weight order.
fn code_dot(q: &[u8], x: &[i8], offset: i32) -> i32 {
    q.iter()
        .zip(x)
        .map(|(&code, &x)| (code as i32 + offset) * x as i32)
        .sum()
}

fn dot_row_q5_k(w_row: &[u8], xq: &QuantizedActivations, t: usize) -> f32 {
    let (qs, d) = xq.q8_k_row(t);
    let bsums = xq.bsums(t);
    let mut sum = 0.0f32;
    for (b, block) in w_row.chunks_exact(GgmlType::Q5_K.block_bytes()).enumerate() {
        let x = &qs[b * QK_K..(b + 1) * QK_K];
        let scales = &block[Q4_K_SCALES..Q4_K_QS];
        let q = q5_k_codes(block);
        let (mut scaled, mut mins) = (0i32, 0i32);
        for j in 0..QK_K / QK32 {
            let (sc, m) = scale_min_k4(j, scales);
            let span = j * QK32..(j + 1) * QK32;
            scaled += sc as i32 * code_dot(&q[span.clone()], &x[span], 0);
            mins += m as i32 * (bsums[b * 16 + 2 * j] as i32 + bsums[b * 16 + 2 * j + 1] as i32);
        }
        let (dw, dmin) = (f16_at(block, 0), f16_at(block, Q4_K_DMIN));
        sum += d[b] * (dw * scaled as f32 - dmin * mins as f32);
    }
    sum
}

fn dot_row_q4_k(w_row: &[u8], xq: &QuantizedActivations, t: usize) -> f32 {
    let (qs, d) = xq.q8_k_row(t);
    let bsums = xq.bsums(t);
    let mut sum = 0.0f32;
    for (b, block) in w_row.chunks_exact(GgmlType::Q4_K.block_bytes()).enumerate() {
        let x = &qs[b * QK_K..(b + 1) * QK_K];
        let scales = &block[Q4_K_SCALES..Q4_K_QS];
        let (mut scaled, mut mins) = (0i32, 0i32);
        for j in 0..QK_K / QK32 {
            let (sc, m) = scale_min_k4(j, scales);
            let q = &block[Q4_K_QS + (j / 2) * QK32..][..QK32];
            let shift = 4 * (j % 2);
            let isum: i32 = (0..QK32)
                .map(|l| ((q[l] >> shift) & 0xF) as i32 * x[j * QK32 + l] as i32)
                .sum();
            scaled += sc as i32 * isum;
            mins += m as i32 * (bsums[b * 16 + 2 * j] as i32 + bsums[b * 16 + 2 * j + 1] as i32);
        }
        let (dw, dmin) = (f16_at(block, 0), f16_at(block, Q4_K_DMIN));
        sum += d[b] * (dw * scaled as f32 - dmin * mins as f32);
    }
    sum
}

fn dot_row_q6_k(w_row: &[u8], xq: &QuantizedActivations, t: usize) -> f32 {
    let (qs, d) = xq.q8_k_row(t);
    let mut sum = 0.0f32;
    for (b, block) in w_row.chunks_exact(GgmlType::Q6_K.block_bytes()).enumerate() {
        let x = &qs[b * QK_K..(b + 1) * QK_K];
        let q = q6_k_quants(block);
        let mut scaled = 0i32;
        for i in 0..QK_K / 16 {
            let isum: i32 = (i * 16..(i + 1) * 16)
                .map(|l| q[l] as i32 * x[l] as i32)
                .sum();
            scaled += (block[Q6_K_SCALES + i] as i8) as i32 * isum;
        }
        sum += d[b] * f16_at(block, Q6_K_D) * scaled as f32;
    }
    sum
}

/// Scalar `a . b`.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Scalar `y += alpha * x`.
pub fn axpy_f32(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}
