//! f32 vector kernels of the forward pass that are not matrix products:
//! attention scores and weighted sums over one KV page, softmax, SwiGLU.
//!
//! Each is written once as plain Rust with fixed-width accumulators and a
//! branch-free `exp`, then compiled three times: for the baseline target, and
//! inside `#[target_feature]` wrappers for AVX2+FMA and AVX-512, where LLVM
//! vectorizes the inlined body with the wider registers (see `multiversion!`).
//! [`Isa`] picks one at run time, once per call (per page, not per position).

use crate::quant::Isa;

/// Accumulator lanes: one AVX-512 register of f32, or two AVX2 ones.
const LANES: usize = 16;

/// Defines `pub fn $name(isa, args…)` that runs `$body(args…)` compiled for the
/// widest vector unit `isa` allows: `$body` is `#[inline(always)]`, so it is
/// inlined into, and vectorized for, each `#[target_feature]` copy.
macro_rules! multiversion {
    ($(#[$meta:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) => $body:ident) => {
        $(#[$meta])*
        pub fn $name(isa: Isa, $($arg: $ty),*) {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => {
                    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                    unsafe fn wide($($arg: $ty),*) {
                        $body($($arg),*)
                    }
                    assert!(isa.is_available());
                    // SAFETY: the CPU supports AVX-512 (checked above).
                    unsafe { wide($($arg),*) }
                }
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => {
                    #[target_feature(enable = "avx2,fma")]
                    unsafe fn wide($($arg: $ty),*) {
                        $body($($arg),*)
                    }
                    assert!(isa.is_available());
                    // SAFETY: the CPU supports AVX2 and FMA (checked above).
                    unsafe { wide($($arg),*) }
                }
                _ => $body($($arg),*),
            }
        }
    };
}

multiversion! {
    /// `scores[j] = scale * q · k[j][offset..offset + q.len()]` for `j < scores.len()`,
    /// where `k` rows are `stride` floats apart.
    pub fn dot_rows(q: &[f32], k: &[f32], stride: usize, offset: usize, scale: f32, scores: &mut [f32]) => dot_rows_body
}

multiversion! {
    /// `acc += Σ_j p[j] * v[j][offset..offset + acc.len()]`, rows `stride` apart.
    pub fn axpy_rows(p: &[f32], v: &[f32], stride: usize, offset: usize, acc: &mut [f32]) => axpy_rows_body
}

multiversion! {
    /// In-place softmax.
    pub fn softmax(x: &mut [f32]) => softmax_body
}

multiversion! {
    /// `gate[i] = silu(gate[i]) * up[i]`.
    pub fn swiglu(gate: &mut [f32], up: &[f32]) => swiglu_body
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        let (a, b) = (&a[c * LANES..][..LANES], &b[c * LANES..][..LANES]);
        for i in 0..LANES {
            acc[i] += a[i] * b[i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * LANES..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

#[inline(always)]
fn dot_rows_body(
    q: &[f32],
    k: &[f32],
    stride: usize,
    offset: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let width = q.len();
    for (j, score) in scores.iter_mut().enumerate() {
        let row = &k[j * stride + offset..][..width];
        *score = dot(q, row) * scale;
    }
}

#[inline(always)]
fn axpy_rows_body(p: &[f32], v: &[f32], stride: usize, offset: usize, acc: &mut [f32]) {
    let width = acc.len();
    assert!(p.is_empty() || (p.len() - 1) * stride + offset + width <= v.len());
    for (j, &weight) in p.iter().enumerate() {
        let row = &v[j * stride + offset..][..width];
        for (a, &x) in acc.iter_mut().zip(row) {
            *a += weight * x;
        }
    }
}

#[inline(always)]
fn softmax_body(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = exp(*v - max);
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[inline(always)]
fn swiglu_body(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + exp(-*g)) * u;
    }
}

/// `e^x` without branches, so loops over it vectorize: `x = n ln2 + r` with
/// |r| ≤ ln2/2, `e^r` by a degree-6 polynomial, `2^n` built in the exponent
/// bits. Relative error below 2e-7 on [-87, 88]; inputs are clamped to that range
/// (e^-87 ≈ 0 for softmax and SiLU purposes; +88 would overflow anyway).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E).round();
    let r = x - n * LN2_HI - n * LN2_LO;
    // Taylor coefficients 1/k! for k = 6..=0 (Horner).
    let mut p = 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_across_its_range() {
        let mut worst = 0.0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let rel = ((exp(x) - x.exp()) / x.exp()).abs();
            worst = worst.max(rel);
            x += 0.0137;
        }
        assert!(worst < 1e-6, "relative error {worst}");
        assert_eq!(exp(-1000.0), exp(-87.0));
        assert!(exp(-87.0) < 1e-37);
    }

    #[test]
    fn every_isa_matches_scalar_on_odd_lengths() {
        let data: Vec<f32> = (0..997)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        for isa in Isa::available() {
            for width in [1usize, 15, 16, 17, 64, 67] {
                let rows = 13;
                let stride = width + 5;
                let k = &data[..rows * stride + 3];
                let q = &data[500..500 + width];
                let mut want = vec![0.0; rows];
                let mut got = vec![0.0; rows];
                dot_rows(Isa::Scalar, q, k, stride, 3, 0.5, &mut want);
                dot_rows(isa, q, k, stride, 3, 0.5, &mut got);
                for (a, b) in want.iter().zip(&got) {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                        "{isa:?} dot {a} vs {b}"
                    );
                }
                let mut acc_want = vec![0.25; width];
                let mut acc_got = acc_want.clone();
                axpy_rows(Isa::Scalar, &want, k, stride, 3, &mut acc_want);
                axpy_rows(isa, &want, k, stride, 3, &mut acc_got);
                for (a, b) in acc_want.iter().zip(&acc_got) {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                        "{isa:?} axpy {a} vs {b}"
                    );
                }
            }
            let mut s = data[..77].to_vec();
            softmax(isa, &mut s);
            assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            let mut reference: Vec<f32> = data[..77].iter().map(|v| v.exp()).collect();
            let total: f32 = reference.iter().sum();
            reference.iter_mut().for_each(|v| *v /= total);
            for (a, b) in s.iter().zip(&reference) {
                assert!((a - b).abs() < 1e-6, "{isa:?} softmax {a} vs {b}");
            }
            let mut g = data[..101].to_vec();
            swiglu(isa, &mut g, &data[200..301]);
            for (i, v) in g.iter().enumerate() {
                let x = data[i];
                let want = x / (1.0 + (-x).exp()) * data[200 + i];
                assert!(
                    (v - want).abs() < 1e-5 * (1.0 + want.abs()),
                    "{isa:?} swiglu"
                );
            }
        }
    }
}
