//! Quantized block formats and their dot products.
//!
//! The forward pass uses this module in four steps:
//!
//! 1. Weights stay in their GGUF blocks ([`GgmlType`]), except where an AVX-512
//!    16-row kernel runs them: those matrices are repacked once at load
//!    ([`repack`]) and run by [`repack::matmul_repacked`].
//! 2. Each step quantizes its activations once per weight format into a reusable
//!    [`QuantizedActivations`] ([`ActivationFormat::for_weights`] picks the format).
//! 3. Worker threads call [`matmul`] on disjoint row ranges with their own output
//!    slices; `matmul` itself is single-threaded and allocation-free.
//! 4. Attention uses [`dot_f32`] and [`axpy_f32`] on f32 vectors.
//!
//! Invariants:
//! 1. Every [`Isa`] path computes the scalar path's result up to f32 summation order;
//!    the tests in `kernels/tests/quant_kernels.rs` hold every path to that.
//! 2. An ISA is executed only after `Isa::is_available` confirmed it (asserted here).
//! 3. Shape errors in the hot entry points are programmer errors and panic; the
//!    conversion entry points that take caller data return [`QuantError`].

mod activations;
mod blocks;
mod error;
mod isa;
mod quantize;
mod scalar;
mod types;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_k;
#[cfg(target_arch = "x86_64")]
mod avx512_kx16;
#[cfg(target_arch = "x86_64")]
mod avx512_x16;
pub mod repack;

use std::ops::Range;

pub use activations::{ActivationFormat, QuantizedActivations};
pub use blocks::{dequantize_row, QK32, QK_K};
pub use error::QuantError;
pub use isa::Isa;
pub use quantize::quantize_row;
pub use types::GgmlType;

/// `out[t][r - rows.start] = W[r] . x[t]` for every token `t` in `xq` and row `r` in
/// `rows`.
///
/// `w` is the whole weight matrix, `[rows_total][k]` in `ty` blocks, rows contiguous.
/// `out` is `[xq.n_tokens()][rows.len()]`. Single-threaded; callers split rows.
///
/// # Panics
/// If `isa` is not available on this CPU, `xq` was not quantized for `ty` with this
/// `k`, `k` is not whole blocks, `w` is too short for `rows`, or `out` has the wrong
/// length.
pub fn matmul(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    assert!(isa.is_available(), "{isa:?} is not available on this CPU");
    assert_eq!(
        xq.format(),
        ActivationFormat::for_weights(ty),
        "activations not quantized for {ty:?}"
    );
    assert_eq!(
        xq.k(),
        k,
        "activations have k = {}, weights k = {k}",
        xq.k()
    );
    assert_eq!(k % ty.block_len(), 0, "k = {k} is not whole {ty:?} blocks");
    let row_bytes = k / ty.block_len() * ty.block_bytes();
    assert!(
        rows.start <= rows.end && rows.end * row_bytes <= w.len(),
        "rows {rows:?} exceed weights"
    );
    assert_eq!(
        out.len(),
        xq.n_tokens() * rows.len(),
        "out is not [n_tokens][rows]"
    );
    if rows.is_empty() || xq.n_tokens() == 0 {
        return;
    }
    match isa {
        Isa::Scalar => scalar::matmul(ty, w, k, rows, xq, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::matmul(ty, w, k, rows, xq, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512::matmul(ty, w, k, rows, xq, out),
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("x86 ISA reported available off x86"),
    }
}

/// `a . b` for equal-length f32 slices (attention scores).
///
/// # Panics
/// If the lengths differ or `isa` is not available.
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32 length mismatch");
    assert!(isa.is_available(), "{isa:?} is not available on this CPU");
    match isa {
        Isa::Scalar => scalar::dot_f32(a, b),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: availability of AVX2 (and FMA) was asserted above.
        Isa::Avx2 => unsafe { avx2::dot_f32(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: availability of AVX-512F was asserted above.
        Isa::Avx512 => unsafe { avx512::dot_f32(a, b) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("x86 ISA reported available off x86"),
    }
}

/// `y += alpha * x` for equal-length f32 slices (attention's weighted V sum).
///
/// # Panics
/// If the lengths differ or `isa` is not available.
pub fn axpy_f32(isa: Isa, alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy_f32 length mismatch");
    assert!(isa.is_available(), "{isa:?} is not available on this CPU");
    match isa {
        Isa::Scalar => scalar::axpy_f32(alpha, x, y),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: availability of AVX2 (and FMA) was asserted above.
        Isa::Avx2 => unsafe { avx2::axpy_f32(alpha, x, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: availability of AVX-512F was asserted above.
        Isa::Avx512 => unsafe { avx512::axpy_f32(alpha, x, y) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("x86 ISA reported available off x86"),
    }
}
