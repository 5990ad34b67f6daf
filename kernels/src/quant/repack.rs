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

use super::{GgmlType, QuantizedActivations};

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

/// [`super::matmul`] for weights [`repack`] made: `out[t][i] = Σ_k w[rows.start
/// + i][k] * x[t][k]`, `rows` whole groups.
///
/// # Panics
/// Without AVX-512 VNNI, or on shapes that do not match (as `matmul`).
pub fn matmul_repacked(
    ty: GgmlType,
    packed: &[u8],
    k: usize,
    rows: Range<usize>,
    xq: &QuantizedActivations,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    match ty {
        GgmlType::Q4_K => super::avx512_kx16::matmul_q4_k(packed, k, rows, xq, out),
        GgmlType::Q6_K => super::avx512_kx16::matmul_q6_k(packed, k, rows, xq, out),
        _ => super::avx512_x16::matmul(ty, packed, k, rows, xq, out),
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (packed, k, rows, xq, out);
        unreachable!("no repacked {ty:?} weights off x86-64");
    }
}
