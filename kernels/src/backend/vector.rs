//! Vector kernels of the forward pass that are not matrix products: attention
//! scores and weighted sums over KV rows (K and V in f16 or f32, queries and
//! accumulators in f32), the shifted exponentials of an online softmax,
//! SwiGLU.
//!
//! Each is written once as plain Rust with fixed-width accumulators, a
//! branch-free `exp` and a branch-free f16 → f32 conversion, then compiled
//! three times: for the baseline target, and inside `#[target_feature]`
//! wrappers for AVX2+FMA and AVX-512, where LLVM vectorizes the inlined body
//! with the wider registers (see `multiversion!`). [`Isa`] picks one at run
//! time, once per call (per page, not per position). The f16 loads convert
//! exactly, so an f16 page gives the same result as an f32 page holding the
//! same (rounded) values.
//!
//! On AVX-512 the attention scores and weighted sums are hand-written instead
//! ([`dot_rows_paged`], [`axpy_rows_paged`]): the query heads that share a KV
//! head share each K and V load, and rows come either from a widened tile or
//! in place from a span's pool pages (f16 widened on load). Both sources run
//! the same instructions per value, so a decode token that reads its pages
//! gets the bits of the prefill query that read the tile.

use crate::kv::{KvSlab, KvType, KvValue};
use crate::quant::Isa;
use half::f16;

/// Accumulator lanes: one AVX-512 register of f32, or two AVX2 ones.
const LANES: usize = 16;

/// Defines `pub fn $name(isa, args…)` that runs `$body(args…)` compiled for the
/// widest vector unit `isa` allows: `$body` is `#[inline(always)]`, so it is
/// inlined into, and vectorized for, each `#[target_feature]` copy.
macro_rules! multiversion {
    ($(#[$meta:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) => $body:ident) => {
        multiversion! { $(#[$meta])* pub fn $name($($arg: $ty),*) -> () => $body }
    };
    ($(#[$meta:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty => $body:ident) => {
        $(#[$meta])*
        pub fn $name(isa: Isa, $($arg: $ty),*) -> $ret {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => {
                    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                    unsafe fn wide($($arg: $ty),*) -> $ret {
                        $body($($arg),*)
                    }
                    assert!(isa.is_available());
                    // SAFETY: the CPU supports AVX-512 (checked above).
                    unsafe { wide($($arg),*) }
                }
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => {
                    #[target_feature(enable = "avx2,fma")]
                    unsafe fn wide($($arg: $ty),*) -> $ret {
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
    /// [`dot_rows_f32`], compiled for `isa`.
    pub fn dot_rows_f32_plain(q: &[f32], k: &[f32], stride: usize, offset: usize, scale: f32, scores: &mut [f32]) => dot_rows_body
}

/// `scores[j] = scale * q · k[j][offset..offset + q.len()]` for `j < scores.len()`,
/// where `k` rows are `stride` values apart. On AVX-512 with a head width that
/// is a whole number of registers, 16 rows at a time reduced together
/// (`dot_group_avx512` with one query row); elsewhere
/// [`dot_rows_f32_plain`]. Either way a row's score is the same bits whatever
/// rows come with it.
pub fn dot_rows_f32(
    isa: Isa,
    q: &[f32],
    k: &[f32],
    stride: usize,
    offset: usize,
    scale: f32,
    scores: &mut [f32],
) {
    if paged(isa, q.len()) {
        let pages = [k];
        let rows = HeadRows::one_page(&pages, stride, offset);
        dot_rows_paged(isa, q, 1, 1, rows, scale, scores);
        return;
    }
    dot_rows_f32_plain(isa, q, k, stride, offset, scale, scores);
}

/// One KV head's K (or V) rows, read in place: row `j` is the head's values
/// at `pages[j / page_rows][(j % page_rows) * stride + offset..]`, in the
/// stored type. A span of pool pages (`page_rows` = the page's tokens,
/// `stride` = the KV width, `offset` = the head's first value), or a widened
/// tile as one page.
#[derive(Clone, Copy, Debug)]
pub struct HeadRows<'a, T> {
    /// The slabs rows come from, in row order.
    pub pages: &'a [&'a [T]],
    /// Rows per slab (every slab but the last is full).
    pub page_rows: usize,
    /// Values from one row to the next within a slab.
    pub stride: usize,
    /// The head's first value within a row.
    pub offset: usize,
}

impl<'a, T> HeadRows<'a, T> {
    /// Every row of one slab.
    pub fn one_page(pages: &'a [&'a [T]; 1], stride: usize, offset: usize) -> HeadRows<'a, T> {
        HeadRows {
            pages,
            page_rows: usize::MAX,
            stride,
            offset,
        }
    }

    /// Panics unless rows `0..rows`, `width` values each, lie inside their slabs.
    fn check(&self, rows: usize, width: usize) {
        assert!(self.page_rows > 0, "pages of no rows");
        let mut first = 0;
        for page in self.pages {
            if first >= rows {
                return;
            }
            let last = (rows - first).min(self.page_rows) - 1;
            assert!(
                last * self.stride + self.offset + width <= page.len(),
                "rows out of range"
            );
            first = first.saturating_add(self.page_rows);
        }
        assert!(first >= rows, "rows past the last slab");
    }

    /// Where row `j` starts (inside its slab for rows that [`Self::check`] passed).
    #[inline(always)]
    fn row(&self, j: usize) -> *const T {
        if let [page] = self.pages {
            // One slab (a widened tile): no division per row.
            return page.as_ptr().wrapping_add(j * self.stride + self.offset);
        }
        let page = self.pages[j / self.page_rows];
        page.as_ptr()
            .wrapping_add((j % self.page_rows) * self.stride + self.offset)
    }

    /// Whether the rows span several slabs (pool pages, not a tile already
    /// in cache): then the kernels prefetch ahead.
    fn several_slabs(&self) -> bool {
        self.pages.len() > 1
    }
}

/// Whether [`dot_rows_paged`] and [`axpy_rows_paged`] run for heads of
/// `width` values on `isa`: AVX-512, and a whole number of its registers.
pub fn paged(isa: Isa, width: usize) -> bool {
    cfg!(target_arch = "x86_64") && isa == Isa::Avx512 && width > 0 && width.is_multiple_of(16)
}

/// `scores[g][j] = scale * q[g] · k[j][offset..offset + width]` for the `G`
/// query rows of one KV head's group (`q` is `[G][width]`, `scores` is
/// `[G][rows]`), where `k` rows are `stride` values apart. With [`paged`],
/// each K row is loaded once for up to 4 query rows ([`dot_rows_paged`]);
/// elsewhere row by row. Either way `scores[g][j]` is the same bits as
/// [`dot_rows_f32`] of row `g` alone: grouping shares loads, not arithmetic.
#[allow(clippy::too_many_arguments)]
pub fn dot_rows_group_f32(
    isa: Isa,
    q: &[f32],
    group: usize,
    k: &[f32],
    stride: usize,
    offset: usize,
    scale: f32,
    scores: &mut [f32],
) {
    assert!(group > 0 && q.len().is_multiple_of(group) && scores.len().is_multiple_of(group));
    let (width, rows) = (q.len() / group, scores.len() / group);
    if paged(isa, width) {
        let pages = [k];
        let rows = HeadRows::one_page(&pages, stride, offset);
        dot_rows_paged(isa, q, group, 1, rows, scale, scores);
        return;
    }
    for (q, scores) in q.chunks_exact(width).zip(scores.chunks_exact_mut(rows)) {
        dot_rows_f32(isa, q, k, stride, offset, scale, scores);
    }
}

/// [`dot_rows_group_f32`] over rows read in place, f16 or f32 (f16 widens
/// exactly on load, so an f16 row gives the bits of its widened copy), for
/// `heads` KV heads side by side: `q` is `[heads][group][width]`, `scores`
/// `[heads][group][rows]`, and KV head `h`'s values start `h * width` after
/// `k.offset` in each row. Rows are taken a few at a time for every head
/// before the next few, so a span's pages are read front to back once, not
/// once per head. Needs [`paged`] (panics otherwise).
pub fn dot_rows_paged<T: KvValue>(
    isa: Isa,
    q: &[f32],
    group: usize,
    heads: usize,
    k: HeadRows<'_, T>,
    scale: f32,
    scores: &mut [f32],
) {
    let sets = group * heads;
    assert!(sets > 0 && q.len().is_multiple_of(sets) && scores.len().is_multiple_of(sets));
    let (width, rows) = (q.len() / sets, scores.len() / sets);
    assert!(
        paged(isa, width) && isa.is_available(),
        "no paged kernels on {isa:?}"
    );
    k.check(rows, heads * width);
    let shape = Shape {
        group,
        heads,
        width,
        rows,
    };
    #[cfg(target_arch = "x86_64")]
    for first in (0..group).step_by(4) {
        // SAFETY: AVX-512 is available and every row below `rows` has
        // `heads * width` values after k.offset (both checked above); q and
        // scores hold `sets` rows of `width` and `rows` values.
        unsafe {
            // The common head widths get their chunk count as a constant, so
            // the chunk loop unrolls and every accumulator keeps its register
            // (with a run-time count the compiler rotated and spilled them:
            // 30-40 % slower on pages in cache); others count at run time.
            match ((group - first).min(4), width) {
                (1, 64) => dot_group_avx512::<1, 4, T>(q, &k, shape, first, scale, scores),
                (2, 64) => dot_group_avx512::<2, 4, T>(q, &k, shape, first, scale, scores),
                (3, 64) => dot_group_avx512::<3, 4, T>(q, &k, shape, first, scale, scores),
                (_, 64) => dot_group_avx512::<4, 4, T>(q, &k, shape, first, scale, scores),
                (1, 128) => dot_group_avx512::<1, 8, T>(q, &k, shape, first, scale, scores),
                (2, 128) => dot_group_avx512::<2, 8, T>(q, &k, shape, first, scale, scores),
                (3, 128) => dot_group_avx512::<3, 8, T>(q, &k, shape, first, scale, scores),
                (_, 128) => dot_group_avx512::<4, 8, T>(q, &k, shape, first, scale, scores),
                (1, _) => dot_group_avx512::<1, 0, T>(q, &k, shape, first, scale, scores),
                (2, _) => dot_group_avx512::<2, 0, T>(q, &k, shape, first, scale, scores),
                (3, _) => dot_group_avx512::<3, 0, T>(q, &k, shape, first, scale, scores),
                _ => dot_group_avx512::<4, 0, T>(q, &k, shape, first, scale, scores),
            }
        }
    }
}

/// The shape of a paged kernel's call: `heads` KV heads of `group` query rows
/// each, heads `width` values wide, over `rows` K (or V) rows.
#[derive(Clone, Copy)]
struct Shape {
    group: usize,
    heads: usize,
    width: usize,
    rows: usize,
}

/// How far ahead of the row they work on the paged kernels ask for rows:
/// pages need not be in order in memory, and the hardware's stream prefetch
/// stops at a page's end. Measured at decode depth 8128 (one thread, rounds
/// alternated in one process): 8 rows ahead ~33 tok/s, 4 or 12 within 3 %,
/// 16 and 32 7-11 % slower (further ahead, the lines crowd out the rows
/// in use); hinting L2 (T1) or non-temporal instead was slower still.
const PREFETCH_ROWS_AHEAD: usize = 8;

/// Asks for the cache lines of `values` values from `start` (a hint: it
/// reads nothing and cannot fault).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn prefetch_row<T>(start: *const T, values: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let bytes = values * std::mem::size_of::<T>();
    for line in (0..bytes).step_by(64) {
        // A prefetch is a hint: it never faults, whatever the address.
        _mm_prefetch::<_MM_HINT_T0>(start.cast::<i8>().wrapping_add(line));
    }
}

/// 16 values at `ptr` as f32 (f16 widens exactly).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load16<T: KvValue>(ptr: *const T) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees 16 readable values at ptr.
    unsafe {
        match T::TYPE {
            KvType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(ptr.cast())),
            KvType::F32 => _mm512_loadu_ps(ptr.cast()),
        }
    }
}

/// [`dot_rows_paged`] for query rows `first..first + G` of each head's group
/// (G at most 4). One round takes `16 / G` K rows and, for each head in turn,
/// its G query rows: each K chunk is loaded once and multiplied into `G` of
/// 16 register accumulators, one per (query row, K row) item; then one
/// transpose-and-add tree turns the 16 accumulators into their 16 sums, about
/// 3 instructions per item where a horizontal sum per item costs ~9. An
/// item's accumulator and its tree are the same whatever items share the
/// round, and slots with no item stay zero, so every score is the same bits
/// whatever rows, heads and group rows come with it (batch invariance).
/// `C` is the head's 16-value chunks, or 0 to take them from `shape.width`
/// (the same arithmetic either way).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_group_avx512<const G: usize, const C: usize, T: KvValue>(
    q: &[f32],
    k: &HeadRows<'_, T>,
    shape: Shape,
    first: usize,
    scale: f32,
    scores: &mut [f32],
) {
    use std::arch::x86_64::*;
    let per = 16 / G;
    let Shape {
        group,
        heads,
        width,
        rows,
    } = shape;
    let chunks = if C > 0 { C } else { width / 16 };
    // Item i (query row i / per, K row j0 + i % per) accumulates in slot
    // 4 (i % 4) + i / 4: the tree below transposes it back to lane i.
    let slot = |i: usize| (i % 4) * 4 + i / 4;
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let mut j0 = 0;
    while j0 < rows {
        let n = (rows - j0).min(per);
        let mut starts = [std::ptr::null::<T>(); 16];
        for (p, start) in starts[..per].iter_mut().enumerate() {
            // A round past the last row repeats it (only its real items are stored).
            *start = k.row((j0 + p).min(rows - 1));
        }
        if k.several_slabs() {
            for j in (j0 + PREFETCH_ROWS_AHEAD..rows).take(per) {
                prefetch_row(k.row(j), heads * width);
            }
        }
        for h in 0..heads {
            let set = h * group + first;
            let mut acc = [_mm512_setzero_ps(); 16];
            for c in 0..chunks {
                let mut qv = [_mm512_setzero_ps(); G];
                for (g, qv) in qv.iter_mut().enumerate() {
                    // SAFETY: q holds heads * group rows of chunks * 16 values.
                    *qv = unsafe { _mm512_loadu_ps(q.as_ptr().add((set + g) * width + c * 16)) };
                }
                for (p, &start) in starts[..per].iter().enumerate() {
                    // SAFETY: the caller checked that every row below `rows` has
                    // `heads * width` values from its start.
                    let kv = unsafe { load16(start.wrapping_add(h * width + c * 16)) };
                    for (g, &qv) in qv.iter().enumerate() {
                        let s = slot(g * per + p);
                        acc[s] = _mm512_fmadd_ps(qv, kv, acc[s]);
                    }
                }
            }
            // Level 1: accumulators in pairs, 16 lanes → 8 (128-bit lanes 0-1:
            // even accumulator, 2-3: odd).
            let mut s = [_mm512_setzero_ps(); 8];
            for (i, s) in s.iter_mut().enumerate() {
                let (a, b) = (acc[2 * i], acc[2 * i + 1]);
                let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b);
                let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b);
                *s = _mm512_add_ps(lo, hi);
            }
            // Level 2: 8 → 4 partials; each 128-bit lane is one accumulator.
            let mut t = [_mm512_setzero_ps(); 4];
            for (i, t) in t.iter_mut().enumerate() {
                let (a, b) = (s[2 * i], s[2 * i + 1]);
                let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b);
                let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b);
                *t = _mm512_add_ps(lo, hi);
            }
            // Level 3: 4 → 2 partials, two accumulators per 128-bit lane.
            let mut u = [_mm512_setzero_ps(); 2];
            for (i, u) in u.iter_mut().enumerate() {
                let (a, b) = (t[2 * i], t[2 * i + 1]);
                *u = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
            }
            // Level 4: 2 → 1; lane 4l + p holds slot 4p + l, which is item 4l + p.
            let lo = _mm512_shuffle_ps::<0b01_00_01_00>(u[0], u[1]);
            let hi = _mm512_shuffle_ps::<0b11_10_11_10>(u[0], u[1]);
            let sums = _mm512_mul_ps(_mm512_add_ps(lo, hi), _mm512_set1_ps(scale));
            // Query row g's items are lanes g * per.., stored as its scores j0..j0 + n.
            let mask: __mmask16 = if n == 16 { 0xFFFF } else { (1 << n) - 1 };
            for g in 0..G {
                let row = _mm512_permutexvar_ps(
                    _mm512_add_epi32(lanes, _mm512_set1_epi32((g * per) as i32)),
                    sums,
                );
                // SAFETY: scores (set + g) * rows + j0.. + n lie inside that row
                // of `scores` (j0 + n <= rows); the masked-off lanes are not written.
                unsafe {
                    let at = scores.as_mut_ptr().add((set + g) * rows + j0);
                    _mm512_mask_storeu_ps(at, mask, row);
                }
            }
        }
        j0 += per;
    }
}

multiversion! {
    /// `acc += Σ_j p[j] * v[j][offset..offset + acc.len()]`, rows `stride` values apart.
    pub fn axpy_rows_f32(p: &[f32], v: &[f32], stride: usize, offset: usize, acc: &mut [f32]) => axpy_rows_body
}

/// `acc[g] += Σ_j p[g][j] * v[j][offset..offset + width]` for the `G` rows of
/// one KV head's group: `p` is `[G][rows]`, row `g` of `acc` starts at
/// `g * acc_stride`, `v` rows are `stride` values apart. With [`paged`],
/// [`axpy_rows_paged`]; elsewhere row by row with [`axpy_rows_f32`]. Either
/// way a group row's sums do not depend on the rest of the group.
#[allow(clippy::too_many_arguments)]
pub fn axpy_rows_group_f32(
    isa: Isa,
    p: &[f32],
    group: usize,
    v: &[f32],
    stride: usize,
    offset: usize,
    width: usize,
    acc: &mut [f32],
    acc_stride: usize,
) {
    if paged(isa, width) {
        let pages = [v];
        let rows = HeadRows::one_page(&pages, stride, offset);
        axpy_rows_paged(isa, p, group, 1, rows, width, acc, acc_stride);
        return;
    }
    assert!(group > 0 && p.len().is_multiple_of(group));
    assert!(width <= acc_stride && (group - 1) * acc_stride + width <= acc.len());
    let rows = p.len() / group;
    for g in 0..group {
        let acc = &mut acc[g * acc_stride..][..width];
        axpy_rows_f32(isa, &p[g * rows..(g + 1) * rows], v, stride, offset, acc);
    }
}

/// [`axpy_rows_group_f32`] over rows read in place, f16 or f32, for `heads`
/// KV heads side by side: `p` is `[heads][group][rows]`, acc row `(h, g)`
/// starts at `(h * group + g) * acc_stride`, and KV head `h`'s values start
/// `h * width` after `v.offset` in each row. Each V row is loaded once for up
/// to 4 rows of a group; rows are taken 16 at a time for every head before
/// the next 16, so a span's pages are read front to back once. The sums are
/// fused multiply-adds in row order, so a row's sums are the same bits
/// whatever heads, group rows or slabs come with it. Needs [`paged`] (panics
/// otherwise).
#[allow(clippy::too_many_arguments)]
pub fn axpy_rows_paged<T: KvValue>(
    isa: Isa,
    p: &[f32],
    group: usize,
    heads: usize,
    v: HeadRows<'_, T>,
    width: usize,
    acc: &mut [f32],
    acc_stride: usize,
) {
    let sets = group * heads;
    assert!(sets > 0 && p.len().is_multiple_of(sets));
    assert!(width <= acc_stride && (sets - 1) * acc_stride + width <= acc.len());
    assert!(
        paged(isa, width) && isa.is_available(),
        "no paged kernels on {isa:?}"
    );
    let rows = p.len() / sets;
    v.check(rows, heads * width);
    let shape = Shape {
        group,
        heads,
        width,
        rows,
    };
    // One head: every row in one sweep per column block.
    let block = if heads == 1 {
        rows.max(1)
    } else {
        AXPY_PAGED_ROWS
    };
    #[cfg(target_arch = "x86_64")]
    for j0 in (0..rows).step_by(block) {
        let j1 = (j0 + block).min(rows);
        for h in 0..heads {
            for first in (0..group).step_by(4) {
                let set = h * group + first;
                let mut c = 0;
                while c < width {
                    let wide = width - c >= 64;
                    let at = Columns {
                        set,
                        col: c,
                        j0,
                        j1,
                    };
                    // SAFETY: AVX-512 is available and every V row below
                    // `rows` has `heads * width` values after v.offset (both
                    // checked above); acc holds `sets` rows of `acc_stride`
                    // (the last one `width`) values, p `sets` rows of weights.
                    unsafe {
                        match ((group - first).min(4), wide) {
                            (1, true) => {
                                axpy_group_avx512::<1, 4, T>(p, &v, shape, at, acc, acc_stride)
                            }
                            (2, true) => {
                                axpy_group_avx512::<2, 4, T>(p, &v, shape, at, acc, acc_stride)
                            }
                            (3, true) => {
                                axpy_group_avx512::<3, 4, T>(p, &v, shape, at, acc, acc_stride)
                            }
                            (_, true) => {
                                axpy_group_avx512::<4, 4, T>(p, &v, shape, at, acc, acc_stride)
                            }
                            (1, false) => {
                                axpy_group_avx512::<1, 1, T>(p, &v, shape, at, acc, acc_stride)
                            }
                            (2, false) => {
                                axpy_group_avx512::<2, 1, T>(p, &v, shape, at, acc, acc_stride)
                            }
                            (3, false) => {
                                axpy_group_avx512::<3, 1, T>(p, &v, shape, at, acc, acc_stride)
                            }
                            (_, false) => {
                                axpy_group_avx512::<4, 1, T>(p, &v, shape, at, acc, acc_stride)
                            }
                        }
                    }
                    c += if wide { 64 } else { 16 };
                }
            }
        }
    }
}

/// V rows [`axpy_rows_paged`] takes for every head before the next ones: one
/// 16-token page, a few KiB, still in L1 when the next head reads it.
const AXPY_PAGED_ROWS: usize = 16;

/// Which sums one [`axpy_group_avx512`] call adds to: acc rows `set..set + G`,
/// columns `col..col + 16 C`, over V rows `j0..j1`.
#[derive(Clone, Copy)]
struct Columns {
    set: usize,
    col: usize,
    j0: usize,
    j1: usize,
}

/// [`axpy_rows_paged`] for `C` registers of columns and `G` rows of one
/// head's group: the `G * C` sums stay in registers over rows `j0..j1` (and
/// go back to `acc` between calls, which changes no bit).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_group_avx512<const G: usize, const C: usize, T: KvValue>(
    p: &[f32],
    v: &HeadRows<'_, T>,
    shape: Shape,
    at: Columns,
    acc: &mut [f32],
    acc_stride: usize,
) {
    use std::arch::x86_64::*;
    let Columns { set, col, j0, j1 } = at;
    let rows = shape.rows;
    let head = set / shape.group;
    let mut sums = [[_mm512_setzero_ps(); C]; G];
    for (g, sums) in sums.iter_mut().enumerate() {
        for (c, sum) in sums.iter_mut().enumerate() {
            // SAFETY: the caller checked that acc row set + g holds col + 16 C values.
            *sum =
                unsafe { _mm512_loadu_ps(acc.as_ptr().add((set + g) * acc_stride + col + c * 16)) };
        }
    }
    for j in j0..j1 {
        if set == 0 && col == 0 && j + PREFETCH_ROWS_AHEAD < rows && v.several_slabs() {
            prefetch_row(v.row(j + PREFETCH_ROWS_AHEAD), shape.heads * shape.width);
        }
        let start = v.row(j).wrapping_add(head * shape.width + col);
        let mut vv = [_mm512_setzero_ps(); C];
        for (c, vv) in vv.iter_mut().enumerate() {
            // SAFETY: the caller checked that V row j holds this head's values.
            *vv = unsafe { load16(start.wrapping_add(c * 16)) };
        }
        for (g, sums) in sums.iter_mut().enumerate() {
            let w = _mm512_set1_ps(p[(set + g) * rows + j]);
            for (sum, &vv) in sums.iter_mut().zip(&vv) {
                *sum = _mm512_fmadd_ps(w, vv, *sum);
            }
        }
    }
    for (g, sums) in sums.iter().enumerate() {
        for (c, &sum) in sums.iter().enumerate() {
            // SAFETY: as for the loads above.
            unsafe {
                _mm512_storeu_ps(
                    acc.as_mut_ptr().add((set + g) * acc_stride + col + c * 16),
                    sum,
                )
            };
        }
    }
}

multiversion! {
    /// [`widen_rows`] from f32 rows: a copy.
    pub fn widen_rows_f32(src: &[f32], stride: usize, offset: usize, width: usize, dst: &mut [f32]) => widen_rows_body
}

multiversion! {
    /// [`widen_rows`] from f16 rows, converting in software.
    pub fn widen_rows_f16(src: &[f16], stride: usize, offset: usize, width: usize, dst: &mut [f32]) => widen_rows_body
}

/// `dst[j] = src[j][offset..offset + width]` as exact f32 for each row `j` of
/// `dst` (`[rows][width]`), where `src` rows (one page's K or V slab) are
/// `stride` values apart: one KV head's rows, contiguous and widened.
pub fn widen_rows(
    isa: Isa,
    src: KvSlab<'_>,
    stride: usize,
    offset: usize,
    width: usize,
    dst: &mut [f32],
) {
    match src {
        #[cfg(target_arch = "x86_64")]
        KvSlab::F16(src) if matches!(isa, Isa::Avx2 | Isa::Avx512) && width.is_multiple_of(8) => {
            assert!(isa.is_available());
            let rows = dst.len() / width;
            if rows > 0 {
                assert!(
                    (rows - 1) * stride + offset + width <= src.len(),
                    "rows out of range"
                );
            }
            // SAFETY: AVX2 and AVX-512 imply F16C (see `Isa`), checked above.
            unsafe { widen_rows_f16c(src, stride, offset, width, dst) }
        }
        KvSlab::F16(src) => widen_rows_f16(isa, src, stride, offset, width, dst),
        KvSlab::F32(src) => widen_rows_f32(isa, src, stride, offset, width, dst),
    }
}

/// [`widen_rows`] from f16 with the hardware conversion, 8 values at a time
/// (the same exact values as `f16_to_f32`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_rows_f16c(
    src: &[f16],
    stride: usize,
    offset: usize,
    width: usize,
    dst: &mut [f32],
) {
    use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    for (j, row) in dst.chunks_exact_mut(width).enumerate() {
        let from = &src[j * stride + offset..][..width];
        for (d, h) in row.chunks_exact_mut(8).zip(from.chunks_exact(8)) {
            // SAFETY: both chunks hold exactly 8 values; unaligned loads and stores.
            unsafe {
                let halves = _mm_loadu_si128(h.as_ptr().cast::<__m128i>());
                _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(halves));
            }
        }
    }
}

multiversion! {
    /// The unnormalised half of a softmax: `x[i] = e^(x[i] - max)` in place;
    /// returns `(max, Σ x[i])` after. `x` is not empty.
    pub fn exp_shift(x: &mut [f32]) -> (f32, f32) => exp_shift_body
}

multiversion! {
    /// `gate[i] = silu(gate[i]) * up[i]`.
    pub fn swiglu(gate: &mut [f32], up: &[f32]) => swiglu_body
}

multiversion! {
    /// `gate[i] = gelu(gate[i]) * up[i]`, GELU by its tanh approximation.
    pub fn geglu(gate: &mut [f32], up: &[f32]) => geglu_body
}

multiversion! {
    /// `x[i] = cap · tanh(x[i] / cap)` (soft-capping).
    pub fn softcap(x: &mut [f32], cap: f32) => softcap_body
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

/// Rows handled together by `dot_rows_body`: the query chunk is loaded once
/// for all of them, and their accumulators are independent chains.
const DOT_ROWS_BLOCK: usize = 4;

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
    let chunks = width / LANES;
    let blocks = scores.len() / DOT_ROWS_BLOCK;
    for b in 0..blocks {
        let j0 = b * DOT_ROWS_BLOCK;
        let mut acc = [[0.0f32; LANES]; DOT_ROWS_BLOCK];
        for c in 0..chunks {
            let q = &q[c * LANES..][..LANES];
            for (r, acc) in acc.iter_mut().enumerate() {
                let row = &k[(j0 + r) * stride + offset + c * LANES..][..LANES];
                for i in 0..LANES {
                    acc[i] += q[i] * row[i];
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            // The same lane sum and tail as `dot`, so a row gives the same
            // bits in a block as alone.
            let mut sum: f32 = acc.iter().sum();
            let row = &k[(j0 + r) * stride + offset..][..width];
            for i in chunks * LANES..width {
                sum += q[i] * row[i];
            }
            scores[j0 + r] = sum * scale;
        }
    }
    for j in blocks * DOT_ROWS_BLOCK..scores.len() {
        let row = &k[j * stride + offset..][..width];
        scores[j] = dot(q, row) * scale;
    }
}

/// Lanes of `acc` kept in registers across all rows by `axpy_rows_body`: 4
/// AVX-512 or 8 AVX2 registers, a 64-wide head in one pass.
const AXPY_BLOCK: usize = 64;

#[inline(always)]
fn axpy_rows_body(p: &[f32], v: &[f32], stride: usize, offset: usize, acc: &mut [f32]) {
    let width = acc.len();
    assert!(p.is_empty() || (p.len() - 1) * stride + offset + width <= v.len());
    let mut c = 0;
    while c + AXPY_BLOCK <= width {
        axpy_block::<AXPY_BLOCK>(p, v, stride, offset + c, &mut acc[c..c + AXPY_BLOCK]);
        c += AXPY_BLOCK;
    }
    while c + LANES <= width {
        axpy_block::<LANES>(p, v, stride, offset + c, &mut acc[c..c + LANES]);
        c += LANES;
    }
    if c < width {
        let acc = &mut acc[c..];
        for (j, &weight) in p.iter().enumerate() {
            let row = &v[j * stride + offset + c..][..acc.len()];
            for (a, &x) in acc.iter_mut().zip(row) {
                *a += weight * x;
            }
        }
    }
}

/// `acc[..N] += Σ_j p[j] * v[j][offset..offset + N]` with the N sums held in
/// registers over every row (one rounding per row and lane, in row order, as
/// a plain loop would do).
#[inline(always)]
fn axpy_block<const N: usize>(p: &[f32], v: &[f32], stride: usize, offset: usize, acc: &mut [f32]) {
    let mut sums = [0.0f32; N];
    sums.copy_from_slice(&acc[..N]);
    for (j, &weight) in p.iter().enumerate() {
        let row = &v[j * stride + offset..][..N];
        for i in 0..N {
            sums[i] += weight * row[i];
        }
    }
    acc[..N].copy_from_slice(&sums);
}

#[inline(always)]
fn widen_rows_body<T: KvValue>(
    src: &[T],
    stride: usize,
    offset: usize,
    width: usize,
    dst: &mut [f32],
) {
    for (j, row) in dst.chunks_exact_mut(width).enumerate() {
        let from = &src[j * stride + offset..][..width];
        for (d, &x) in row.iter_mut().zip(from) {
            *d = x.to_f32();
        }
    }
}

#[inline(always)]
fn exp_shift_body(x: &mut [f32]) -> (f32, f32) {
    // Lane-wise max and sum (a plain fold is a serial chain the compiler may
    // not reorder, so it would not vectorize), then the lanes in a fixed order.
    let chunks = x.len() / LANES;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for c in 0..chunks {
        let x = &x[c * LANES..][..LANES];
        for i in 0..LANES {
            lanes[i] = if x[i] > lanes[i] { x[i] } else { lanes[i] };
        }
    }
    let mut max = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for &v in &x[chunks * LANES..] {
        max = max.max(v);
    }
    let mut sums = [0.0f32; LANES];
    for c in 0..chunks {
        let x = &mut x[c * LANES..][..LANES];
        for i in 0..LANES {
            x[i] = exp(x[i] - max);
            sums[i] += x[i];
        }
    }
    let mut sum: f32 = sums.iter().sum();
    for v in &mut x[chunks * LANES..] {
        *v = exp(*v - max);
        sum += *v;
    }
    (max, sum)
}

#[inline(always)]
fn swiglu_body(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + exp(-*g)) * u;
    }
}

/// `x/2 · (1 + tanh(z)) = x · sigmoid(2z)`, `z = sqrt(2/pi) · (x + 0.044715 x^3)`:
/// the tanh form of GELU through the one branch-free `exp`, so it vectorizes.
#[inline(always)]
fn geglu_body(gate: &mut [f32], up: &[f32]) {
    /// `2 · sqrt(2 / pi)`.
    const TWO_SQRT_2_OVER_PI: f32 = 1.595_769;
    const COEF: f32 = 0.044_715;
    assert_eq!(gate.len(), up.len());
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        let two_z = TWO_SQRT_2_OVER_PI * x * (1.0 + COEF * x * x);
        *g = x / (1.0 + exp(-two_z)) * u;
    }
}

/// `tanh(y) = 1 - 2 / (1 + e^(2y))` through the branch-free `exp` (which
/// clamps, so |y| past 44 gives ±1 exactly).
#[inline(always)]
fn softcap_body(x: &mut [f32], cap: f32) {
    let inv = 1.0 / cap;
    for v in x.iter_mut() {
        let y = *v * inv;
        *v = cap * (1.0 - 2.0 / (1.0 + exp(2.0 * y)));
    }
}

/// `e^x` without branches, so loops over it vectorize: `x = n ln2 + r` with
/// |r| ≤ ln2/2, `e^r` by a degree-6 polynomial, `2^n` built in the exponent
/// bits. Relative error below 2e-7 on [-87, 88]; inputs are clamped to that range
/// (e^-87 ≈ 0 for softmax and SiLU purposes; +88 would overflow anyway).
///
/// `n` is rounded by adding and subtracting 1.5 · 2^23, which leaves `n` in
/// the low bits of the sum's representation. Neither `f32::round` nor an
/// `as i32` cast would do: the cast saturates and maps NaN to 0, which LLVM
/// lowers to a compare and branch per lane, and `round` is a libm call on the
/// baseline target. Those two made this function scalar, 14 % of a decode
/// step at depth 8k.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    /// 1.5 · 2^23: a sum with it has unit spacing, so adding rounds to an integer.
    const ROUNDER: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * LOG2E + ROUNDER;
    let n = shifted - ROUNDER;
    let r = x - n * LN2_HI - n * LN2_LO;
    // Taylor coefficients 1/k! for k = 6..=0 (Horner).
    let mut p = 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // The low bits of `shifted` are n in two's complement; n + 127 is in
    // 1..=254 after the clamp, a normal exponent.
    let biased = shifted
        .to_bits()
        .wrapping_sub(ROUNDER.to_bits())
        .wrapping_add(127);
    p * f32::from_bits(biased << 23)
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
                dot_rows_f32(Isa::Scalar, q, k, stride, 3, 0.5, &mut want);
                dot_rows_f32(isa, q, k, stride, 3, 0.5, &mut got);
                for (a, b) in want.iter().zip(&got) {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                        "{isa:?} dot {a} vs {b}"
                    );
                }
                let mut acc_want = vec![0.25; width];
                let mut acc_got = acc_want.clone();
                axpy_rows_f32(Isa::Scalar, &want, k, stride, 3, &mut acc_want);
                axpy_rows_f32(isa, &want, k, stride, 3, &mut acc_got);
                for (a, b) in acc_want.iter().zip(&acc_got) {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                        "{isa:?} axpy {a} vs {b}"
                    );
                }
            }
            let mut s = data[..77].to_vec();
            let (max, sum) = exp_shift(isa, &mut s);
            let want_max = data[..77].iter().copied().fold(f32::MIN, f32::max);
            assert_eq!(max, want_max);
            let reference: Vec<f32> = data[..77].iter().map(|v| (v - want_max).exp()).collect();
            let total: f32 = reference.iter().sum();
            assert!(
                (sum - total).abs() < 1e-5 * total,
                "{isa:?} sum {sum} vs {total}"
            );
            for (a, b) in s.iter().zip(&reference) {
                assert!((a - b).abs() < 1e-6, "{isa:?} exp_shift {a} vs {b}");
            }
            let mut g = data[..101].to_vec();
            geglu(isa, &mut g, &data[200..301]);
            for (i, v) in g.iter().enumerate() {
                let x = f64::from(data[i]);
                let z = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
                let want = 0.5 * x * (1.0 + z.tanh()) * f64::from(data[200 + i]);
                assert!(
                    (f64::from(*v) - want).abs() < 1e-5 * (1.0 + want.abs()),
                    "{isa:?} geglu({x}): {v} vs {want}"
                );
            }
            let mut capped = data[..101].iter().map(|v| v * 30.0).collect::<Vec<_>>();
            softcap(isa, &mut capped, 50.0);
            for (i, v) in capped.iter().enumerate() {
                let want = 50.0 * (f64::from(data[i]) * 30.0 / 50.0).tanh();
                assert!(
                    (f64::from(*v) - want).abs() < 1e-5 * 50.0,
                    "{isa:?} softcap: {v} vs {want}"
                );
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

    #[test]
    fn a_rows_score_is_the_same_bits_whatever_rows_come_with_it() {
        let data: Vec<f32> = (0..4000)
            .map(|i| ((i * 29 % 97) as f32 - 48.0) / 13.0)
            .collect();
        for isa in Isa::available() {
            for width in [16usize, 64, 67] {
                let stride = width + 1;
                let q = &data[3000..3000 + width];
                let rows = 37;
                let mut all = vec![0.0; rows];
                dot_rows_f32(isa, q, &data, stride, 0, 0.125, &mut all);
                for count in [1usize, 5, 16, 17, 33] {
                    for first in [0usize, 3, 20] {
                        let n = count.min(rows - first);
                        let mut some = vec![0.0; n];
                        let from = &data[first * stride..];
                        dot_rows_f32(isa, q, from, stride, 0, 0.125, &mut some);
                        assert_eq!(some, all[first..first + n], "{isa:?} width {width}");
                    }
                }
                for (j, &got) in all.iter().enumerate() {
                    let want: f32 = q
                        .iter()
                        .zip(&data[j * stride..])
                        .map(|(a, b)| a * b)
                        .sum::<f32>()
                        * 0.125;
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{isa:?} row {j}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_group_rows_scores_and_sums_are_the_bits_of_that_row_alone() {
        // Grouping the query heads of a KV head shares K and V loads; it
        // must not change a bit of any head's result, for any group size,
        // width or row count (including rows that end a round early).
        let data: Vec<f32> = (0..6000)
            .map(|i| ((i * 31 % 103) as f32 - 51.0) / 11.0)
            .collect();
        for isa in Isa::available() {
            for group in [1usize, 2, 3, 4, 5, 8] {
                for width in [16usize, 48, 64, 80, 67] {
                    for rows in [1usize, 4, 5, 6, 16, 17, 40] {
                        let stride = width + 3;
                        let q = &data[4000..4000 + group * width];
                        let k = &data[..rows * stride + 2];
                        let mut grouped = vec![0.0; group * rows];
                        dot_rows_group_f32(isa, q, group, k, stride, 2, 0.125, &mut grouped);
                        let mut acc = vec![0.5; group * (width + 2)];
                        axpy_rows_group_f32(
                            isa,
                            &grouped,
                            group,
                            k,
                            stride,
                            2,
                            width,
                            &mut acc[2..],
                            width + 2,
                        );
                        for g in 0..group {
                            let q_row = &q[g * width..(g + 1) * width];
                            let mut alone = vec![0.0; rows];
                            dot_rows_f32(isa, q_row, k, stride, 2, 0.125, &mut alone);
                            let want = &grouped[g * rows..(g + 1) * rows];
                            assert_eq!(
                                alone, want,
                                "{isa:?} group {group} width {width} rows {rows}"
                            );
                            let mut acc_alone = vec![0.5; width];
                            axpy_rows_group_f32(
                                isa,
                                want,
                                1,
                                k,
                                stride,
                                2,
                                width,
                                &mut acc_alone,
                                width,
                            );
                            let got = &acc[2 + g * (width + 2)..][..width];
                            assert_eq!(acc_alone, got, "{isa:?} group {group} width {width}");
                            // And both are the plain sums, to rounding.
                            let mut acc_plain = vec![0.5; width];
                            axpy_rows_f32(Isa::Scalar, want, k, stride, 2, &mut acc_plain);
                            for (a, b) in acc_plain.iter().zip(got) {
                                assert!(
                                    (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                                    "{isa:?} {a} vs {b}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn head_rows_refuse_rows_outside_their_slabs() {
        // The paged kernels read through raw pointers; `check` is what keeps
        // them inside the slabs.
        let run = |rows: usize, width: usize, lens: &[usize]| {
            let slabs: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.0; n]).collect();
            let pages: Vec<&[f32]> = slabs.iter().map(|v| v.as_slice()).collect();
            let head = HeadRows {
                pages: &pages,
                page_rows: 4,
                stride: 10,
                offset: 2,
            };
            std::panic::catch_unwind(|| head.check(rows, width)).is_ok()
        };
        // Two full pages of 4 rows (last row ends at 3 * 10 + 2 + 8 = 40) and
        // a partial third (row 8 is its row 0: 2 + 8 = 10).
        assert!(run(9, 8, &[40, 40, 10]));
        assert!(run(8, 8, &[40, 40]));
        assert!(!run(9, 8, &[40, 40]), "a row past the last slab");
        assert!(!run(9, 8, &[40, 39, 10]), "a short middle slab");
        assert!(!run(9, 9, &[40, 40, 10]), "a head wider than the row holds");
        assert!(run(0, 8, &[]), "no rows need no slab");
    }

    #[test]
    fn f16_rows_widen_to_exactly_their_values_on_every_isa() {
        // What attention computes on is the widened tile, so an f16 page and
        // an f32 page holding the same (rounded) values give the same bits.
        let data: Vec<f32> = (0..997)
            .map(|i| ((i * 53 % 89) as f32 - 44.0) / 7.0 + 1e-3)
            .collect();
        let halves: Vec<f16> = data.iter().map(|&x| f16::from_f32(x)).collect();
        let rounded: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
        for isa in Isa::available() {
            for width in [1usize, 8, 16, 33, 64] {
                let (rows, stride, offset) = (11, width + 3, 2);
                let mut from_half = vec![0.0; rows * width];
                let mut from_full = vec![-1.0; rows * width];
                widen_rows(
                    isa,
                    KvSlab::F16(&halves),
                    stride,
                    offset,
                    width,
                    &mut from_half,
                );
                widen_rows(
                    isa,
                    KvSlab::F32(&rounded),
                    stride,
                    offset,
                    width,
                    &mut from_full,
                );
                assert_eq!(from_half, from_full, "{isa:?} width {width}");
                assert_eq!(
                    from_full[width],
                    rounded[stride + offset],
                    "row 1 starts at stride"
                );
            }
        }
    }
}
