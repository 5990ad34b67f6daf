//! The kernels' argument structs, as `kernels/cuda/args.cuh` declares them,
//! and the launch geometry of each kernel.
//!
//! Every struct is `#[repr(C)]`, 64-bit device addresses first and 32-bit
//! fields after, with no padding: the `args!` macro asserts at compile time
//! that a struct's size is the sum of its fields', so its bytes are exactly
//! its fields. The emulator's tests check each size against the C
//! declaration (`Emulator::args_bytes`), and the NVRTC check compiles the
//! declarations the device sees.

/// A kernel's argument struct.
pub trait KernelArgs: Copy {
    /// The kernel's name in the sources.
    const KERNEL: &'static str;

    /// The struct's bytes, as the kernel receives them.
    fn bytes(&self) -> &[u8] {
        // SAFETY: implementors are repr(C) structs of u32, u64 and f32 fields
        // with no padding (asserted where each is declared), so every byte is
        // initialised.
        unsafe {
            std::slice::from_raw_parts(
                (self as *const Self).cast::<u8>(),
                std::mem::size_of::<Self>(),
            )
        }
    }
}

/// Declares an argument struct, asserts it has no padding, and ties it to its kernel.
macro_rules! args {
    ($(#[$meta:meta])* struct $name:ident for $kernel:literal { $($(#[$field_meta:meta])* $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        ///
        /// Fields as `kernels/cuda/args.cuh` documents them.
        #[allow(missing_docs)]
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq)]
        pub struct $name {
            $($(#[$field_meta])* pub $field: $ty,)*
        }
        const _: () = assert!(
            std::mem::size_of::<$name>() == 0 $(+ std::mem::size_of::<$ty>())*,
            "argument structs have no padding"
        );
        impl KernelArgs for $name {
            const KERNEL: &'static str = $kernel;
        }
    };
}

/// A sequence index meaning "no sequence": a padding token of a captured step.
pub const NO_SEQ: u32 = u32::MAX;
/// Matrices one matmul launch may carry.
pub const MATMUL_SEGS_MAX: usize = 3;
/// Warps (rows) per matmul block.
pub const MATMUL_WARPS: u32 = 4;
/// Matmul output modes.
pub mod mode {
    /// `out = W . x`.
    pub const STORE: u32 = 0;
    /// `out += W . x` (the residual stream).
    pub const ADD: u32 = 1;
    /// `out = silu(G . x) * (U . x)`.
    pub const SWIGLU: u32 = 2;
    /// `out = gelu(G . x) * (U . x)`, GELU's tanh form.
    pub const GEGLU: u32 = 3;
    /// `out = silu(out) * (W . x)`: up gating a gate stored before.
    pub const SILU_MUL: u32 = 4;
    /// `out = gelu(out) * (W . x)`.
    pub const GELU_MUL: u32 = 5;
    /// Q, K and V stored as `rope_kv` leaves them: turned, and K and V in
    /// pages (`MatmulArgs::rope`); a warp takes a pair of rows.
    pub const ROPE_KV: u32 = 6;
}

args! {
    /// Rows of the embedding table.
    struct EmbedArgs for "embed" {
        table: u64,
        tokens: u64,
        out: u64,
        ty: u32,
        width: u32,
        row_bytes: u32,
        rows: u32,
        scale: f32,
        unused: u32,
    }
}

args! {
    /// RMSNorm and activation quantization.
    struct NormArgs for "rms_norm" {
        x: u64,
        gather: u64,
        gain: u64,
        out: u64,
        qs: u64,
        d: u64,
        sums: u64,
        width: u32,
        block_len: u32,
        eps: f32,
        accumulate: u32,
    }
}

/// One matrix of a matmul launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MatSeg {
    /// Weights, `[rows][row_bytes]`.
    pub w: u64,
    /// Output, f32 `[tokens][out_stride]`.
    pub out: u64,
    /// f32 `[rows]` added to each product (STORE only), or 0.
    pub bias: u64,
    /// ggml type.
    pub ty: u32,
    /// Rows.
    pub rows: u32,
    /// Bytes per row.
    pub row_bytes: u32,
    /// Floats between tokens' output rows.
    pub out_stride: u32,
    /// > 0: each product (STORE) soft-capped at this.
    pub cap: f32,
    /// Padding.
    pub unused: u32,
}
const _: () = assert!(std::mem::size_of::<MatSeg>() == 48);

args! {
    /// Up to three matrix products over one input, or a SwiGLU pair.
    struct MatmulArgs for "matmul" {
        seg: [MatSeg; MATMUL_SEGS_MAX],
        x: u64,
        qs: u64,
        d: u64,
        sums: u64,
        norm_x: u64,
        norm_gather: u64,
        norm_gain: u64,
        segs: u32,
        k: u32,
        tokens: u32,
        mode: u32,
        block_len: u32,
        eps: f32,
        rope: RopeKvArgs,
    }
}

args! {
    /// RoPE, then K and V stored into pages.
    struct RopeKvArgs for "rope_kv" {
        q: u64,
        k: u64,
        v: u64,
        kv: u64,
        token_seq: u64,
        positions: u64,
        seq_pages: u64,
        pages: u64,
        freq_factors: u64,
        heads: u32,
        kv_heads: u32,
        head_dim: u32,
        rope_dim: u32,
        layer: u32,
        pages_count: u32,
        page_tokens: u32,
        kv_f16: u32,
        rope_base: f32,
        rope_scale: f32,
        halves: u32,
        unused: u32,
    }
}

/// A unit of attention work (see `AttnItem` in args.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttnItem {
    /// The sequence's index in the step.
    pub seq: u32,
    /// The KV head.
    pub kv_head: u32,
    /// First query token (in the step).
    pub t0: u32,
    /// One past the last query token.
    pub t1: u32,
    /// Position of the first query.
    pub pos0: u32,
    /// First KV position read.
    pub p0: u32,
    /// One past the last KV position read (each query stops at its own).
    pub p1: u32,
    /// Partial slot, or [`NO_SEQ`] for the final output.
    pub partial: u32,
    /// The merge the partial folds into, or [`NO_SEQ`].
    pub merge: u32,
    /// Padding.
    pub unused: u32,
}
const _: () = assert!(std::mem::size_of::<AttnItem>() == 4 * ITEM_WORDS);

/// Words of an [`AttnItem`] in the step buffer.
pub const ITEM_WORDS: usize = 10;

impl AttnItem {
    /// Its words, as the kernels read them.
    pub fn words(&self) -> [u32; ITEM_WORDS] {
        [
            self.seq,
            self.kv_head,
            self.t0,
            self.t1,
            self.pos0,
            self.p0,
            self.p1,
            self.partial,
            self.merge,
            self.unused,
        ]
    }
}

args! {
    /// Paged attention over work items.
    struct AttentionArgs for "attention" {
        q: u64,
        kv: u64,
        items: u64,
        seq_pages: u64,
        pages: u64,
        out: u64,
        partials: u64,
        merges: u64,
        counters: u64,
        heads: u32,
        kv_heads: u32,
        head_dim: u32,
        layer: u32,
        pages_count: u32,
        page_tokens: u32,
        kv_f16: u32,
        rows_max: u32,
        tile: u32,
        scale: f32,
        window: u32,
        softcap: f32,
        by_warps: u32,
        unused: u32,
    }
}

/// One merge of split decode attention (see `MergeItem` in args.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MergeItem {
    /// The decode token.
    pub token: u32,
    /// The KV head.
    pub kv_head: u32,
    /// First partial slot.
    pub first: u32,
    /// Slots, in position order.
    pub count: u32,
}
const _: () = assert!(std::mem::size_of::<MergeItem>() == 16);

args! {
    /// Folds split attention partials.
    struct MergeArgs for "attention_merge" {
        partials: u64,
        merges: u64,
        out: u64,
        heads: u32,
        kv_heads: u32,
        head_dim: u32,
        unused: u32,
    }
}

args! {
    /// Each row's token: its draw's, or its largest logit's id.
    struct PickArgs for "pick" {
        logits: u64,
        out: u64,
        draws: u64,
        adjusts: u64,
        scores: u64,
        originals: u64,
        vocab: u32,
        unused: u32,
    }
}

args! {
    /// XXH3 page digests.
    struct DigestArgs for "page_digest" {
        kv: u64,
        pages: u64,
        out: u64,
        layers: u32,
        pages_count: u32,
        page_tokens: u32,
        kv_dim: u32,
        value_bytes: u32,
        unused: u32,
    }
}

args! {
    /// A draw's weights, `exp_rn` of each value in place (the GPU check's).
    struct DrawWeightsArgs for "draw_weights" {
        values: u64,
        count: u32,
        unused: u32,
    }
}

/// Threads per block of the kernels that take a row or a token per block.
pub const ROW_BLOCK: u32 = 128;
/// Threads per block of `rms_norm` (one Q8_K block of 256 values per
/// round).
pub const NORM_BLOCK: u32 = 256;
/// Threads per block of `pick` (sample.cu's PICK_BLOCK).
pub const PICK_BLOCK: u32 = 1024;
/// Threads per block of `page_digest` (a warp: one page, its lanes a
/// stripe's lanes each).
pub const DIGEST_BLOCK: u32 = 32;
/// Threads per block of `attention` and `attention_merge`.
pub const ATTENTION_BLOCK: u32 = 128;
/// KV positions per attention tile.
pub const ATTENTION_TILE: u32 = 32;
/// Query rows (queries times the KV head's query heads) per attention item.
pub const ATTENTION_ROWS_MAX: u32 = 32;

/// Dynamic shared memory a block may take without opting in: CUDA's default
/// 48 KiB (a kernel's static shared memory counts against it too).
pub const SHARED_DEFAULT_BYTES: u32 = 48 * 1024;

/// The one kernel that opts in to more (`cuFuncSetAttribute`, as the
/// device is opened; the emulator refuses any other launch past
/// [`SHARED_DEFAULT_BYTES`], as a GPU does).
pub const SHARED_OPT_IN_KERNEL: &str = "attention";

/// What it opts in to: an attention block of the widest head the kernels
/// run (256) at the most rows, at most `device_max`, the device's opt-in
/// limit (227 KiB on an H100 or H200).
pub fn shared_opt_in_bytes(device_max: u32) -> u32 {
    attention_shared_bytes(256, ATTENTION_ROWS_MAX, ATTENTION_TILE).min(device_max)
}

/// Dynamic shared memory of an attention block: q and o `[rows][head_dim]`,
/// k and v `[tile][head_dim + 1]` (rows padded apart in banks), p
/// `[rows][tile]`, and m, l, alpha per row.
pub fn attention_shared_bytes(head_dim: u32, rows_max: u32, tile: u32) -> u32 {
    4 * (2 * rows_max * head_dim + 2 * tile * (head_dim + 1) + rows_max * tile + 3 * rows_max)
}

/// Tokens one matmul block takes (quant.cu's MATMUL_TOKENS): each weight
/// unit is decoded once for this many.
pub const MATMUL_TOKENS: u32 = 8;

/// [`MatmulArgs`] for the tensor cores' product, `matmul_mma` (quant.cu):
/// the same fields, another kernel.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MatmulMmaArgs(pub MatmulArgs);

impl KernelArgs for MatmulMmaArgs {
    const KERNEL: &'static str = "matmul_mma";
}

/// Tokens one `matmul_mma` block takes (quant.cu's MMA_TOKENS).
pub const MMA_TOKENS: u32 = 32;
/// Rows one `matmul_mma` warp takes (MMA_ROWS): a block takes
/// [`MATMUL_WARPS`] times as many.
pub const MMA_ROWS: u32 = 16;

/// Blocks of a `matmul_mma` launch over `rows` output rows and `tokens`
/// tokens: the rows' blocks once per group of [`MMA_TOKENS`].
pub fn matmul_mma_blocks(rows: u32, tokens: u32) -> u32 {
    rows.div_ceil(MATMUL_WARPS * MMA_ROWS) * tokens.div_ceil(MMA_TOKENS)
}

/// Blocks of a matmul launch over `rows` output rows (one warp a row, or in
/// [`mode::ROPE_KV`] a pair) and `tokens` tokens: the rows' blocks once per
/// group of [`MATMUL_TOKENS`].
pub fn matmul_blocks(rows: u32, tokens: u32, mode: u32) -> u32 {
    let warps = if mode == mode::ROPE_KV {
        rows / 2
    } else {
        rows
    };
    warps.div_ceil(MATMUL_WARPS) * tokens.div_ceil(MATMUL_TOKENS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_structs_have_the_sizes_args_cuh_declares() {
        assert_eq!(std::mem::size_of::<EmbedArgs>(), 48);
        assert_eq!(std::mem::size_of::<NormArgs>(), 72);
        assert_eq!(std::mem::size_of::<MatmulArgs>(), 344);
        assert_eq!(std::mem::size_of::<RopeKvArgs>(), 120);
        assert_eq!(std::mem::size_of::<AttentionArgs>(), 128);
        assert_eq!(std::mem::size_of::<MergeArgs>(), 40);
        assert_eq!(std::mem::size_of::<DigestArgs>(), 48);
        assert_eq!(std::mem::size_of::<PickArgs>(), 56);
        assert_eq!(std::mem::size_of::<DrawWeightsArgs>(), 16);
    }

    #[test]
    fn bytes_are_the_fields_in_order() {
        let args = EmbedArgs {
            table: 0x0102_0304_0506_0708,
            tokens: 9,
            out: 10,
            ty: 3,
            width: 576,
            row_bytes: 360,
            rows: 49152,
            scale: 1.0,
            unused: 0,
        };
        let bytes = args.bytes();
        assert_eq!(bytes.len(), 48);
        assert_eq!(&bytes[..8], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(&bytes[24..28], &3u32.to_le_bytes());
        assert_eq!(&bytes[36..40], &49152u32.to_le_bytes());
    }

    #[test]
    fn attention_shared_memory_is_the_sum_of_its_tiles() {
        // q and o [32][64], k and v [32][65], p [32][32], m, l, alpha [32].
        let floats = 2 * 32 * 64 + 2 * 32 * 65 + 32 * 32 + 3 * 32;
        assert_eq!(attention_shared_bytes(64, 32, 32), 4 * floats);
        // SmolLM2 (head_dim 64) fits the default 48 KiB.
        assert!(attention_shared_bytes(64, ATTENTION_ROWS_MAX, ATTENTION_TILE) <= 48 * 1024);
    }
}
