//! Quantized kernels against the scalar reference, and block formats against
//! hand-computed answers.
//!
//! Every SIMD path this CPU supports is compared with `Isa::Scalar` on fresh seeded
//! random data; paths the CPU lacks are reported as skipped on stderr, never passed.

use std::ops::Range;

use bulkhead_kernels::quant::{
    axpy_f32, dequantize_row, dot_f32, matmul, quantize_row, ActivationFormat, GgmlType, Isa,
    QuantError, QuantizedActivations,
};
use half::f16;

/// SplitMix64: a seed reproduces every case.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Uniform in [-1, 1), with an occasional outlier as real activations have.
    fn value(&mut self) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        if self.below(64) == 0 {
            u * 8.0
        } else {
            u
        }
    }
    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.value()).collect()
    }
}

const ALL_TYPES: [GgmlType; 11] = GgmlType::ALL;

/// The SIMD paths to test, announcing each one this CPU cannot run.
fn simd_isas() -> Vec<Isa> {
    let mut isas = Vec::new();
    for isa in [Isa::Avx2, Isa::Avx512] {
        if isa.is_available() {
            isas.push(isa);
        } else {
            eprintln!("skipped: {isa:?} is not available on this CPU");
        }
    }
    isas
}

fn row_bytes(ty: GgmlType, k: usize) -> usize {
    k / ty.block_len() * ty.block_bytes()
}

/// `rows_total` random rows of `k` weights, quantized with the reference quantizer.
fn random_weights(rng: &mut Rng, ty: GgmlType, rows_total: usize, k: usize) -> Vec<u8> {
    let mut w = vec![0u8; rows_total * row_bytes(ty, k)];
    for row in w.chunks_exact_mut(row_bytes(ty, k)) {
        // Row scales vary over two orders of magnitude, as across real layers.
        let scale = 0.01 + rng.below(100) as f32 * 0.01;
        let x: Vec<f32> = rng.values(k).iter().map(|v| v * scale).collect();
        quantize_row(ty, &x, row).unwrap();
    }
    w
}

fn dequantized(ty: GgmlType, w: &[u8], k: usize, r: usize) -> Vec<f32> {
    let mut out = vec![0.0; k];
    dequantize_row(
        ty,
        &w[r * row_bytes(ty, k)..(r + 1) * row_bytes(ty, k)],
        &mut out,
    )
    .unwrap();
    out
}

fn block_lens_for(ty: GgmlType) -> &'static [usize] {
    match ty.block_len() {
        // 129 blocks crosses the AVX-512 packing chunk (128 blocks) with an odd tail.
        32 => &[32, 96, 288, 576, 4128],
        256 => &[256, 768],
        _ => &[1, 7, 64, 100],
    }
}

/// One random matmul case: every ISA against scalar on the same inputs.
fn check_matmul_case(
    rng: &mut Rng,
    isas: &[Isa],
    ty: GgmlType,
    k: usize,
    rows_total: usize,
    rows: Range<usize>,
    n_tokens: usize,
) {
    let w = random_weights(rng, ty, rows_total, k);
    let x = rng.values(n_tokens * k);
    let mut xq = QuantizedActivations::new();
    xq.quantize(ty, &x, n_tokens, k).unwrap();
    let n_rows = rows.len();
    let mut expected = vec![0.0; n_tokens * n_rows];
    matmul(Isa::Scalar, ty, &w, k, rows.clone(), &xq, &mut expected);
    // Tolerance: f32 reassociation error, relative to the sum of |w| |x| magnitudes.
    let magnitude: Vec<f32> = rows
        .clone()
        .map(|r| {
            dequantized(ty, &w, k, r)
                .iter()
                .map(|v| v.abs())
                .sum::<f32>()
        })
        .collect();
    let amax_x = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    for &isa in isas {
        let mut got = vec![f32::NAN; n_tokens * n_rows];
        matmul(isa, ty, &w, k, rows.clone(), &xq, &mut got);
        for t in 0..n_tokens {
            for i in 0..n_rows {
                let (e, g) = (expected[t * n_rows + i], got[t * n_rows + i]);
                let tol = 2e-5 * magnitude[i] * amax_x + 1e-6;
                assert!(
                    (e - g).abs() <= tol,
                    "{isa:?} {ty:?} k={k} rows={rows:?} n_tokens={n_tokens}: out[{t}][{i}] = {g}, scalar {e}, tol {tol}"
                );
            }
        }
    }
}

#[test]
fn every_simd_matmul_matches_scalar_on_every_type_and_shape() {
    let isas = simd_isas();
    let mut rng = Rng(0x5EED_0001);
    for ty in ALL_TYPES {
        for &k in block_lens_for(ty) {
            for &n_tokens in &[1, 2, 3, 5, 9, 33] {
                let rows_total = [1, 3, 5, 7, 17][rng.below(5)];
                let start = rng.below(rows_total);
                let end = start + 1 + rng.below(rows_total - start);
                check_matmul_case(&mut rng, &isas, ty, k, rows_total, start..end, n_tokens);
            }
        }
    }
}

#[test]
fn every_simd_matmul_covers_each_row_remainder() {
    let isas = simd_isas();
    let mut rng = Rng(0x5EED_0002);
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0] {
        for rows_total in [1, 3, 4, 5, 7, 8, 17] {
            for n_tokens in [1, 4, 7, 8] {
                check_matmul_case(
                    &mut rng,
                    &isas,
                    ty,
                    160,
                    rows_total,
                    0..rows_total,
                    n_tokens,
                );
            }
        }
    }
}

/// Every batched-decode token count (one token group, several groups, a partial
/// group) against row counts that leave remainders for every row tile, with k odd in
/// blocks and k crossing a 128-block chunk.
#[test]
fn every_simd_matmul_covers_each_decode_batch_with_row_remainders() {
    let isas = simd_isas();
    let mut rng = Rng(0x5EED_0003);
    let token_counts = (1..=9).chain([12, 16, 17, 24, 33]);
    for n_tokens in token_counts {
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0] {
            for k in [160, 576, 4128] {
                for rows_total in [1, 2, 3, 5, 6, 7, 9, 18] {
                    // A range that starts past row 0 as the second worker's does.
                    let start = rng.below(rows_total.min(3));
                    let rows = start..rows_total;
                    check_matmul_case(&mut rng, &isas, ty, k, rows_total, rows, n_tokens);
                }
            }
        }
    }
}

#[test]
fn integer_dot_matches_dequantized_f32_dot_within_activation_quantization_error() {
    let mut rng = Rng(0x5EED_0003);
    for ty in ALL_TYPES {
        let k = block_lens_for(ty)[1];
        let (rows_total, n_tokens) = (5, 3);
        let w = random_weights(&mut rng, ty, rows_total, k);
        let x = rng.values(n_tokens * k);
        let mut xq = QuantizedActivations::new();
        xq.quantize(ty, &x, n_tokens, k).unwrap();
        let mut got = vec![0.0; n_tokens * rows_total];
        matmul(Isa::detect(), ty, &w, k, 0..rows_total, &xq, &mut got);
        let act_block = match ActivationFormat::for_weights(ty) {
            ActivationFormat::F32 => 0,
            ActivationFormat::Q8_1 => 32,
            ActivationFormat::Q8_K => 256,
        };
        for r in 0..rows_total {
            let wr = dequantized(ty, &w, k, r);
            for t in 0..n_tokens {
                let xt = &x[t * k..(t + 1) * k];
                let exact: f64 = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                // Each activation moves by at most half its block's step amax / 127.
                let half_steps: Vec<f64> = match act_block {
                    0 => vec![0.0; k],
                    len => xt
                        .chunks_exact(len)
                        .flat_map(|block| {
                            let amax = block.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                            std::iter::repeat_n(amax as f64 / 127.0 / 2.0, len)
                        })
                        .collect(),
                };
                let bound: f64 = wr
                    .iter()
                    .zip(xt)
                    .zip(&half_steps)
                    .map(|((&wi, &xi), &h)| wi.abs() as f64 * (h + 1e-6 * xi.abs() as f64))
                    .sum();
                let g = got[t * rows_total + r] as f64;
                assert!(
                    (g - exact).abs() <= bound * 1.01 + 1e-5,
                    "{ty:?} row {r} token {t}: {g} vs {exact}, bound {bound}"
                );
            }
        }
    }
}

#[test]
fn dot_and_axpy_match_scalar_on_every_length() {
    let isas = simd_isas();
    let mut rng = Rng(0x5EED_0004);
    for n in (0..70).chain([64, 128, 131, 1000]) {
        let (a, b) = (rng.values(n), rng.values(n));
        let alpha = rng.value();
        let expected_dot = dot_f32(Isa::Scalar, &a, &b);
        let mut expected_y = b.clone();
        axpy_f32(Isa::Scalar, alpha, &a, &mut expected_y);
        let magnitude: f32 = a.iter().zip(&b).map(|(x, y)| (x * y).abs()).sum();
        for &isa in &isas {
            let got = dot_f32(isa, &a, &b);
            assert!(
                (got - expected_dot).abs() <= 1e-5 * magnitude + 1e-6,
                "{isa:?} dot n={n}"
            );
            let mut y = b.clone();
            axpy_f32(isa, alpha, &a, &mut y);
            for (g, e) in y.iter().zip(&expected_y) {
                // One fused rounding versus two: at most an ulp or so apart.
                assert!(
                    (g - e).abs() <= 1e-6 * (1.0 + e.abs()),
                    "{isa:?} axpy n={n}"
                );
            }
        }
    }
}

#[test]
fn isa_available_starts_with_scalar_and_detect_is_the_fastest() {
    let available = Isa::available();
    assert_eq!(available[0], Isa::Scalar);
    assert_eq!(*available.last().unwrap(), Isa::detect());
    assert!(available.iter().all(|isa| isa.is_available()));
}

#[test]
#[should_panic(expected = "activations not quantized")]
fn matmul_rejects_activations_quantized_for_another_format() {
    let k = 256;
    let w = vec![0u8; row_bytes(GgmlType::Q4_K, k)];
    let mut xq = QuantizedActivations::new();
    xq.quantize(GgmlType::Q4_1, &vec![0.5; k], 1, k).unwrap();
    let mut out = [0.0];
    matmul(Isa::Scalar, GgmlType::Q4_K, &w, k, 0..1, &xq, &mut out);
}

#[test]
#[should_panic(expected = "rows")]
fn matmul_rejects_rows_beyond_the_weights() {
    let k = 32;
    let w = vec![0u8; 2 * row_bytes(GgmlType::Q8_0, k)];
    let mut xq = QuantizedActivations::new();
    xq.quantize(GgmlType::Q8_0, &[0.25; 32], 1, k).unwrap();
    let mut out = [0.0; 2];
    matmul(Isa::detect(), GgmlType::Q8_0, &w, k, 1..3, &xq, &mut out);
}

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

fn dequant_block(ty: GgmlType, block: &[u8]) -> Vec<f32> {
    let mut out = vec![0.0; ty.block_len()];
    dequantize_row(ty, block, &mut out).unwrap();
    out
}

/// Q4_0 with d = 0.5 and qs[j] = j | (15 - j) << 4.
fn q4_0_known_block() -> Vec<u8> {
    let mut block = f16_bytes(0.5).to_vec();
    block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    block
}

/// Q4_1 with d = 0.25, m = -1 and the same nibbles.
fn q4_1_known_block() -> Vec<u8> {
    let mut block = f16_bytes(0.25).to_vec();
    block.extend(f16_bytes(-1.0));
    block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    block
}

/// Q8_0 with d = 2 and q[j] = 127 - 8 j.
fn q8_0_known_block() -> Vec<u8> {
    let mut block = f16_bytes(2.0).to_vec();
    block.extend((0..32i32).map(|j| (127 - 8 * j) as i8 as u8));
    block
}

#[test]
fn dequantizes_hand_built_q4_0_q4_1_q8_0_blocks() {
    let q4_0 = dequant_block(GgmlType::Q4_0, &q4_0_known_block());
    let q4_1 = dequant_block(GgmlType::Q4_1, &q4_1_known_block());
    let q8_0 = dequant_block(GgmlType::Q8_0, &q8_0_known_block());
    for j in 0..16 {
        assert_eq!(q4_0[j], 0.5 * (j as f32 - 8.0));
        assert_eq!(q4_0[j + 16], 0.5 * (7.0 - j as f32));
        assert_eq!(q4_1[j], 0.25 * j as f32 - 1.0);
        assert_eq!(q4_1[j + 16], 0.25 * (15 - j) as f32 - 1.0);
    }
    for (j, &w) in q8_0.iter().enumerate() {
        assert_eq!(w, 2.0 * (127 - 8 * j as i32) as f32);
    }
}

#[test]
fn reference_quantizer_reproduces_hand_built_blocks_like_ggml() {
    for (ty, block) in [
        (GgmlType::Q4_0, q4_0_known_block()),
        (GgmlType::Q4_1, q4_1_known_block()),
        (GgmlType::Q8_0, q8_0_known_block()),
    ] {
        let values = dequant_block(ty, &block);
        let mut again = vec![0u8; ty.block_bytes()];
        quantize_row(ty, &values, &mut again).unwrap();
        assert_eq!(again, block, "{ty:?}");
    }
}

#[test]
fn dequantizes_hand_built_q4_k_block_with_high_scale_bits() {
    // Sub-block scales and mins; those of sub-blocks 4..8 exceed 4 bits, so their top
    // two bits live in the spare bits of bytes 0..8 (ggml's get_scale_min_k4).
    let sc = [1u8, 2, 3, 4, 17, 33, 49, 63];
    let mn = [5u8, 6, 7, 8, 20, 36, 52, 62];
    let scales = [65u8, 130, 195, 196, 69, 134, 199, 200, 65, 65, 65, 239];
    let mut block = f16_bytes(1.0).to_vec();
    block.extend(f16_bytes(0.5));
    block.extend(scales);
    block.extend((0..128usize).map(|i| (i % 16) as u8 | ((15 - i % 16) as u8) << 4));
    let w = dequant_block(GgmlType::Q4_K, &block);
    for j in 0..8 {
        for l in 0..32 {
            // Sub-block j sits in 32-byte chunk j / 2: low nibbles if j is even.
            let q = if j % 2 == 0 { l % 16 } else { 15 - l % 16 } as f32;
            let expected = 1.0 * sc[j] as f32 * q - 0.5 * mn[j] as f32;
            assert_eq!(w[j * 32 + l], expected, "sub-block {j} weight {l}");
        }
    }
}

#[test]
fn dequantizes_hand_built_q6_k_block() {
    // All-zero quants decode to -32; a few hand-set bytes exercise each bit field.
    let mut block = vec![0u8; GgmlType::Q6_K.block_bytes()];
    block[0] = 0x5A; // ql[0]: weight 0 low bits 0xA, weight 64 low bits 0x5
    block[32] = 0xC3; // ql[32]: weight 32 low bits 0x3, weight 96 low bits 0xC
    block[128] = 0b11_10_01_00; // qh[0]: high bits 0, 1, 2, 3 for weights 0, 32, 64, 96
    block[64] = 0x0F; // ql[64]: weight 128 low bits 0xF
    block[128 + 32] = 0b11; // qh[32]: weight 128 high bits 3
    for i in 0..16 {
        block[192 + i] = (i as i8 - 8) as u8;
    }
    block[208..210].copy_from_slice(&f16_bytes(0.5));
    let w = dequant_block(GgmlType::Q6_K, &block);
    let scale = |i: usize| 0.5 * (i as f32 - 8.0);
    assert_eq!(w[0], scale(0) * (10 - 32) as f32);
    assert_eq!(w[32], scale(2) * (3 + 16 - 32) as f32);
    assert_eq!(w[64], scale(4) * (5 + 32 - 32) as f32);
    assert_eq!(w[96], scale(6) * (12 + 48 - 32) as f32);
    assert_eq!(w[128], scale(8) * (15 + 48 - 32) as f32);
    assert_eq!(w[16], scale(1) * -32.0);
    assert_eq!(w[255], scale(15) * -32.0);
}

/// A Q5_0 (no min) or Q5_1 block whose codes are `code(j)`, d = 0.5, m = -1.
fn q5_known_block(ty: GgmlType, code: impl Fn(usize) -> u8) -> Vec<u8> {
    let mut block = f16_bytes(0.5).to_vec();
    if ty == GgmlType::Q5_1 {
        block.extend(f16_bytes(-1.0));
    }
    let high: u32 = (0..32).map(|j| ((code(j) >> 4) as u32 & 1) << j).sum();
    block.extend(high.to_le_bytes());
    block.extend((0..16).map(|j| (code(j) & 0xF) | ((code(j + 16) & 0xF) << 4)));
    assert_eq!(block.len(), ty.block_bytes());
    block
}

#[test]
fn dequantizes_hand_built_q5_0_and_q5_1_blocks() {
    // Codes 0..32 in reverse, so every fifth bit and every nibble differ.
    let code = |j: usize| (31 - j) as u8;
    let w = dequant_block(GgmlType::Q5_0, &q5_known_block(GgmlType::Q5_0, code));
    let expected: Vec<f32> = (0..32).map(|j| 0.5 * (code(j) as f32 - 16.0)).collect();
    assert_eq!(w, expected);
    let w = dequant_block(GgmlType::Q5_1, &q5_known_block(GgmlType::Q5_1, code));
    let expected: Vec<f32> = (0..32).map(|j| 0.5 * code(j) as f32 - 1.0).collect();
    assert_eq!(w, expected);
    // ggml's reference quantizers give back the very same blocks.
    for ty in [GgmlType::Q5_0, GgmlType::Q5_1] {
        let block = q5_known_block(ty, |j| {
            if ty == GgmlType::Q5_0 {
                31 - j as u8
            } else {
                j as u8
            }
        });
        let values = dequant_block(ty, &block);
        let mut again = vec![0u8; ty.block_bytes()];
        quantize_row(ty, &values, &mut again).unwrap();
        assert_eq!(dequant_block(ty, &again), values, "{ty:?}");
    }
}

#[test]
fn dequantizes_hand_built_q5_k_block() {
    // Q4_K's scales (sub-block j: scale j + 1, min 2j), nibbles l % 16, and the
    // fifth bit of weight l of chunk c from bit 2c / 2c + 1 of qh[l].
    let sc: [u8; 8] = std::array::from_fn(|j| j as u8 + 1);
    let mn: [u8; 8] = std::array::from_fn(|j| 2 * j as u8);
    let mut scales = [0u8; 12];
    for j in 0..4 {
        scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        scales[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        scales[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
    }
    let mut block = f16_bytes(0.25).to_vec();
    block.extend(f16_bytes(0.5));
    block.extend(scales);
    // qh[l] = l: weight l of chunk c has its fifth bit set when bit 2c (or
    // 2c + 1 for the high-nibble sub-block) of l is.
    block.extend(0..32u8);
    block.extend((0..128usize).map(|i| (i % 16) as u8 | (((i + 3) % 16) as u8) << 4));
    assert_eq!(block.len(), GgmlType::Q5_K.block_bytes());
    let w = dequant_block(GgmlType::Q5_K, &block);
    for j in 0..8 {
        let (chunk, high_nibble) = (j / 2, j % 2 == 1);
        for l in 0..32 {
            let nibble = if high_nibble { (l + 3) % 16 } else { l % 16 } as u32;
            let bit = (l as u32 >> (2 * chunk + high_nibble as usize)) & 1;
            let q = (nibble | (bit << 4)) as f32;
            let expected = 0.25 * sc[j] as f32 * q - 0.5 * mn[j] as f32;
            assert_eq!(w[j * 32 + l], expected, "sub-block {j} weight {l}");
        }
    }
}

#[test]
fn bf16_decodes_exactly_and_rounds_to_nearest_even() {
    let values = [1.5f32, -2.25, 0.0, 3.0e38, f32::from_bits(0x3F80_8000)];
    let mut bytes = vec![0u8; 2 * values.len()];
    quantize_row(GgmlType::BF16, &values, &mut bytes).unwrap();
    let mut back = [0.0f32; 5];
    dequantize_row(GgmlType::BF16, &bytes, &mut back).unwrap();
    assert_eq!(&back[..3], &values[..3]);
    // 1.00390625 is halfway between bf16 1.0 and 1.0078125: ties go to even (1.0).
    assert_eq!(back[4], 1.0);
    assert_eq!(back[3], f32::from_bits(0x7F62 << 16));
    let nan = f32::from_bits(0x7F80_0001);
    quantize_row(GgmlType::BF16, &[nan], &mut bytes[..2]).unwrap();
    dequantize_row(GgmlType::BF16, &bytes[..2], &mut back[..1]).unwrap();
    assert!(back[0].is_nan(), "NaN stays NaN, never infinity");
}

#[test]
fn dequantizes_f32_and_f16_rows() {
    let values = [1.5f32, -2.25, 0.0, 65504.0];
    let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let f16_row: Vec<u8> = values.iter().flat_map(|&v| f16_bytes(v)).collect();
    let mut out = [0.0; 4];
    dequantize_row(GgmlType::F32, &f32_bytes, &mut out).unwrap();
    assert_eq!(out, values);
    dequantize_row(GgmlType::F16, &f16_row, &mut out).unwrap();
    assert_eq!(out, values);
}

#[test]
fn reference_quantizers_round_trip_within_one_step() {
    let mut rng = Rng(0x5EED_0005);
    for ty in ALL_TYPES {
        let k = ty.block_len() * 4;
        let x = rng.values(k);
        let mut bytes = vec![0u8; row_bytes(ty, k)];
        quantize_row(ty, &x, &mut bytes).unwrap();
        let mut back = vec![0.0; k];
        dequantize_row(ty, &bytes, &mut back).unwrap();
        // Bound per block: a fraction of the block's value range.
        let (block, fraction) = match ty {
            GgmlType::F32 => (1, 0.0),
            GgmlType::F16 => (1, 1e-3),
            GgmlType::Q8_0 => (32, 1.0 / 127.0),
            GgmlType::BF16 => (1, 1.0 / 256.0),
            GgmlType::Q4_0 | GgmlType::Q4_1 => (32, 1.0 / 8.0),
            GgmlType::Q5_0 | GgmlType::Q5_1 => (32, 1.0 / 16.0),
            GgmlType::Q4_K => (32, 2.0 / 15.0),
            GgmlType::Q5_K => (32, 2.0 / 31.0),
            GgmlType::Q6_K => (16, 2.0 / 32.0),
        };
        for (i, (&a, &b)) in x.iter().zip(&back).enumerate() {
            let chunk = &x[i / block * block..][..block];
            let range = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs())) * 2.0;
            assert!(
                (a - b).abs() <= fraction * range + 1e-6,
                "{ty:?} value {i}: {a} -> {b}"
            );
        }
    }
}

#[test]
fn dequantize_rejects_partial_blocks_and_wrong_byte_counts() {
    let mut out = vec![0.0; 40];
    let err = dequantize_row(GgmlType::Q4_1, &[0u8; 40], &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            QuantError::PartialBlock {
                len: 40,
                block_len: 32,
                ..
            }
        ),
        "{err}"
    );
    let mut out = vec![0.0; 32];
    let err = dequantize_row(GgmlType::Q4_1, &[0u8; 19], &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            QuantError::ByteLength {
                expected: 20,
                actual: 19,
                ..
            }
        ),
        "{err}"
    );
    let err = quantize_row(GgmlType::Q6_K, &[0.0; 128], &mut [0u8; 105]).unwrap_err();
    assert!(matches!(err, QuantError::PartialBlock { .. }), "{err}");
}

#[test]
fn activation_quantize_rejects_wrong_lengths_and_partial_blocks() {
    let mut xq = QuantizedActivations::new();
    let err = xq.quantize(GgmlType::Q4_1, &[0.0; 63], 2, 32).unwrap_err();
    assert!(
        matches!(
            err,
            QuantError::ActivationLength {
                expected: 64,
                actual: 63,
                ..
            }
        ),
        "{err}"
    );
    let err = xq
        .quantize(GgmlType::Q4_K, &[0.0; 128], 1, 128)
        .unwrap_err();
    assert!(
        matches!(err, QuantError::PartialBlock { block_len: 256, .. }),
        "{err}"
    );
    xq.quantize(GgmlType::F16, &[0.0; 7], 1, 7).unwrap();
    assert_eq!(xq.format(), ActivationFormat::F32);
}

#[test]
fn activation_buffer_does_not_reallocate_within_its_capacity() {
    let (n_tokens_max, k_max) = (16, 1024);
    let mut xq = QuantizedActivations::with_capacity(n_tokens_max, k_max);
    let reserved = xq.capacity_bytes();
    let mut rng = Rng(0x5EED_0006);
    for (ty, n, k) in [
        (GgmlType::Q4_1, 16, 1024),
        (GgmlType::Q8_0, 3, 96),
        (GgmlType::Q4_K, 16, 1024),
        (GgmlType::Q6_K, 1, 256),
        (GgmlType::F32, 16, 1024),
        (GgmlType::Q4_0, 16, 992),
    ] {
        xq.quantize(ty, &rng.values(n * k), n, k).unwrap();
        assert_eq!((xq.n_tokens(), xq.k()), (n, k));
        assert_eq!(xq.capacity_bytes(), reserved, "{ty:?} {n}x{k} reallocated");
    }
}

#[test]
fn matmul_of_zero_activations_is_zero_for_every_type() {
    let mut rng = Rng(0x5EED_0007);
    for ty in ALL_TYPES {
        let k = block_lens_for(ty)[1];
        let w = random_weights(&mut rng, ty, 3, k);
        let mut xq = QuantizedActivations::new();
        xq.quantize(ty, &vec![0.0; 2 * k], 2, k).unwrap();
        for isa in Isa::available() {
            let mut out = vec![f32::NAN; 6];
            matmul(isa, ty, &w, k, 0..3, &xq, &mut out);
            assert!(out.iter().all(|&v| v == 0.0), "{isa:?} {ty:?}: {out:?}");
        }
    }
}

#[test]
fn every_type_round_trips_its_gguf_number_and_no_other_number_maps() {
    for ty in ALL_TYPES {
        assert_eq!(GgmlType::from_u32(ty as u32), Some(ty), "{ty:?}");
    }
    let known: Vec<u32> = ALL_TYPES.iter().map(|&ty| ty as u32).collect();
    for number in (0..64).filter(|n| !known.contains(n)) {
        assert_eq!(GgmlType::from_u32(number), None, "{number}");
    }
}
