//! Weight matrices repacked in groups of 16 rows for the AVX-512 VNNI kernels
//! (`avx512_kx16` for Q4_K and Q6_K, `avx512_x16` for the 32-value block
//! types), made
//! once per model at load. One `vpdpbusd` there multiplies four weights of each
//! of 16 rows (one i32 lane per row) by four activations broadcast to every
//! lane, and a block's scales apply to 16 rows in one float operation: most of
//! the row kernels' work that is not multiplying. Each layout takes the file's
//! bytes or a little more (Q4_K: 2.8 %, Q6_K: 0.95 %), counted in the memory budget through
//! [`repacked_len`].

use std::ops::Range;

#[cfg(test)]
use super::Isa;
use super::{ActivationFormat, GgmlType, QuantizedActivations};

/// Rows sharing one `vpdpbusd`.
pub const ROWS: usize = 16;

/// Repacked weights, starting on a 64-byte boundary so that no 512-bit load
/// of a block straddles two cache lines (a heap allocation of this size starts
/// 16 bytes past a page).
pub struct Packed {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl Packed {
    pub(super) fn zeroed(len: usize) -> Packed {
        let buf = vec![0u8; len + 63];
        let start = buf.as_ptr().align_offset(64);
        Packed { buf, start, len }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

/// Bytes of a `rows` x `k` matrix of `ty` in its 16-row layout; `None` where
/// no 16-row kernel runs it (another type, rows not whole groups, or not x86-64).
pub fn repacked_len(ty: GgmlType, rows: usize, k: usize) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if rows.is_multiple_of(ROWS) && rows > 0 && k > 0 {
        return match ty {
            GgmlType::Q4_K | GgmlType::Q6_K => super::avx512_kx16::packed_len(ty, rows, k),
            _ => super::avx512_x16::packed_len(ty, rows, k),
        };
    }
    let _ = (ty, rows, k);
    None
}

/// `w` (`rows` x `k` of `ty`, the file's layout) in the 16-row layout, by up
/// to `threads` threads (each lays out its own run of groups); `None` exactly
/// where [`repacked_len`] is, or if `w` is not that matrix's length.
pub fn repack(ty: GgmlType, w: &[u8], rows: usize, k: usize, threads: usize) -> Option<Packed> {
    let len = repacked_len(ty, rows, k)?;
    let row_bytes = k / ty.block_len() * ty.block_bytes();
    if w.len() != rows * row_bytes {
        return None;
    }
    let mut packed = Packed::zeroed(len);
    let groups = rows / ROWS;
    let group_bytes = len / groups;
    let run = groups.div_ceil(threads.clamp(1, groups));
    std::thread::scope(|scope| {
        let runs = packed.bytes_mut().chunks_mut(run * group_bytes);
        for (out, w) in runs.zip(w.chunks(run * ROWS * row_bytes)) {
            let rows = out.len() / group_bytes * ROWS;
            scope.spawn(move || fill(ty, w, rows, k, out));
        }
    });
    Some(packed)
}

/// Lays out `rows` (whole groups) of `w` into `out`.
fn fill(ty: GgmlType, w: &[u8], rows: usize, k: usize, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    match ty {
        GgmlType::Q4_K => super::avx512_kx16::fill_q4_k(w, rows, k, out),
        GgmlType::Q6_K => super::avx512_kx16::fill_q6_k(w, rows, k, out),
        _ => super::avx512_x16::fill(ty, w, rows, k, out),
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (w, rows, k, out);
        unreachable!("no 16-row layout for {ty:?} off x86-64");
    }
}

/// [`super::matmul`] for weights [`repack`] made:
/// `out[t][i] = Σ_k w[rows.start + i][k] * x[t][k]`, `rows` whole groups.
///
/// # Panics
/// Without AVX-512 VNNI, or on shapes that do not match: activations not
/// quantized for `ty` at width `k`, rows not whole groups, `packed` not
/// 64-byte aligned or too short, `out` not `[n_tokens][rows]`. The kernels
/// read through raw pointers on the strength of these checks.
pub fn matmul_repacked(
    ty: GgmlType,
    packed: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    assert!(super::Isa::Avx512.is_available());
    assert_eq!(
        xq.format(),
        ActivationFormat::for_weights(ty),
        "activations not quantized for {ty:?}"
    );
    assert_eq!(xq.k(), k, "activations of another width");
    assert!(rows.start.is_multiple_of(ROWS) && rows.end.is_multiple_of(ROWS));
    // Groups are laid out one after another: the rows up to rows.end.
    let len = repacked_len(ty, rows.end, k)
        .unwrap_or_else(|| panic!("no 16-row layout for {ty:?} x {k}"));
    assert!(packed.len() >= len, "packed weights too short");
    assert!(
        packed.as_ptr().align_offset(64) == 0,
        "packed weights not 64-byte aligned"
    );
    assert_eq!(out.len(), xq.n_tokens() * rows.len());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the shapes are checked above.
    unsafe {
        match ty {
            GgmlType::Q4_K => super::avx512_kx16::matmul_q4_k(packed, k, rows, xq, out),
            GgmlType::Q6_K => super::avx512_kx16::matmul_q6_k(packed, k, rows, xq, out),
            _ => super::avx512_x16::matmul(ty, packed, k, rows, xq, out),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (packed, rows, out);
        unreachable!("no repacked {ty:?} weights off x86-64");
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::quant::{matmul, quantize_row};

    #[test]
    fn repacked_matrices_match_the_row_kernels() {
        if !Isa::Avx512.is_available() {
            eprintln!("skipped: no AVX-512 VNNI here");
            return;
        }
        let mut state = 0x9E37_79B9u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state as f32 / u32::MAX as f32 - 0.5
        };
        let block32 = [576, 96]; // SmolLM2's width (pairs whole), an odd last block
        for (ty, widths) in [
            (GgmlType::Q4_0, &block32[..]),
            (GgmlType::Q4_1, &block32[..]),
            (GgmlType::Q5_0, &block32[..]),
            (GgmlType::Q5_1, &block32[..]),
            (GgmlType::Q8_0, &block32[..]),
            (GgmlType::Q4_K, &[512][..]),
            (GgmlType::Q6_K, &[512][..]),
        ] {
            for &k in widths {
                let rows = 48;
                let row_bytes = k / ty.block_len() * ty.block_bytes();
                let mut w = vec![0u8; rows * row_bytes];
                let mut x = vec![0f32; k];
                for row in w.chunks_exact_mut(row_bytes) {
                    // An offset so Q4_1's and Q5_1's mins matter.
                    x.iter_mut().for_each(|v| *v = next() * 0.2 + 0.03);
                    quantize_row(ty, &x, row).unwrap();
                }
                // Two threads: runs of two groups and one.
                let packed = repack(ty, &w, rows, k, 2).unwrap();
                assert_eq!(Some(packed.bytes().len()), repacked_len(ty, rows, k));
                assert_eq!(packed.bytes(), repack(ty, &w, rows, k, 1).unwrap().bytes());
                assert!(repack(ty, &w[..row_bytes * 8], 8, k, 1).is_none());
                assert!(repack(ty, &w[..w.len() - 1], rows, k, 1).is_none());
                for n_tokens in [1, 3, 8, 11] {
                    let xs: Vec<f32> = (0..n_tokens * k).map(|_| next()).collect();
                    let mut xq = QuantizedActivations::new();
                    xq.quantize(ty, &xs, n_tokens, k).unwrap();
                    let mut want = vec![0f32; n_tokens * 32];
                    matmul(Isa::Avx512, ty, &w, k, 16..48, &xq, &mut want);
                    let mut got = vec![0f32; n_tokens * 32];
                    matmul_repacked(ty, packed.bytes(), k, 16..48, &xq, &mut got);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                            "{ty:?} k {k}, {n_tokens} tokens, output {i}: {g} against {w}"
                        );
                    }
                }
            }
        }
        assert!(repacked_len(GgmlType::Q5_K, 16, 256).is_none());
        assert!(repacked_len(GgmlType::Q6_K, 16, 576).is_none());
        assert!(repacked_len(GgmlType::Q8_0, 16, 48).is_none());
        assert!(repacked_len(GgmlType::Q8_0, 0, 64).is_none());
    }

    #[test]
    fn matmul_repacked_refuses_shapes_its_kernels_would_misread() {
        if !Isa::Avx512.is_available() {
            eprintln!("skipped: no AVX-512 VNNI here");
            return;
        }
        let (ty, rows, k) = (GgmlType::Q8_0, 32, 64);
        let w = vec![0u8; rows * 2 * ty.block_bytes()];
        let packed = repack(ty, &w, rows, k, 1).unwrap();
        let mut xq = QuantizedActivations::new();
        xq.quantize(ty, &[0.5; 64], 1, k).unwrap();
        let mut k_quant = QuantizedActivations::new();
        k_quant
            .quantize(GgmlType::Q4_K, &[0.5; 256], 1, 256)
            .unwrap();
        let refused =
            |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
        let bytes = packed.bytes();
        let mut out = vec![0f32; rows];
        let run = |packed: &[u8], rows: Range<usize>, xq: &QuantizedActivations, len: usize| {
            let mut out = vec![0f32; len];
            matmul_repacked(ty, packed, k, rows, xq, &mut out);
        };
        assert!(
            refused(&|| run(&bytes[..bytes.len() - 64], 0..32, &xq, 32)),
            "short"
        );
        assert!(refused(&|| run(&bytes[1..], 0..16, &xq, 16)), "unaligned");
        assert!(
            refused(&|| run(bytes, 8..24, &xq, 16)),
            "rows not whole groups"
        );
        assert!(
            refused(&|| run(bytes, 0..32, &k_quant, 32)),
            "other activations"
        );
        assert!(
            refused(&|| run(bytes, 0..32, &xq, 31)),
            "out of another length"
        );
        matmul_repacked(ty, bytes, k, 0..32, &xq, &mut out);
    }
}
