// Each kernel's one argument, by value: device addresses as 64-bit integers,
// then 32-bit sizes (MatmulArgs then the RopeKvArgs of its ROPE_KV mode). The same structs are declared in Rust
// (kernels/src/backend/cuda/launch.rs) with the sizes asserted on both sides;
// no struct has padding, so its bytes are exactly its fields.
//
// Shapes of the buffers they name are written as // [outer][inner].

#pragma once

// ggml type numbers (GGUF).
#define TYPE_F32 0u
#define TYPE_F16 1u
#define TYPE_Q4_0 2u
#define TYPE_Q4_1 3u
#define TYPE_Q5_0 6u
#define TYPE_Q5_1 7u
#define TYPE_Q8_0 8u
#define TYPE_Q4_K 12u
#define TYPE_Q5_K 13u
#define TYPE_Q6_K 14u
#define TYPE_BF16 30u

// Rows of embedding: out[t] = dequantize(table[tokens[t]]) * scale.
// Grid (tokens), block 128.
struct EmbedArgs {
    uint64_t table;   // [rows][row_bytes] in `type` blocks
    uint64_t tokens;  // u32 [tokens]
    uint64_t out;     // f32 [tokens][width]
    uint32_t type;
    uint32_t width;
    uint32_t row_bytes;
    uint32_t rows;  // a token at or past this writes zeros (the host refuses such a step first)
    float scale;    // 1, or Gemma's sqrt(width)
    uint32_t unused;
};

// RMSNorm of rows and their quantization for a matrix product:
//   out[r]  = x[src] / rms(x[src]) * gain       (src = gather[r], or r without gather;
//                                                x[src] itself when gain is 0;
//                                                added to out[r] where `accumulate`:
//                                                a post-norm into the residual)
//   qs[r], d[r], sums[r] = out[r] as Q8 blocks of `block_len` (when qs is not 0):
//     d = amax / 127, q = round_ties_even(x / d) in -127..=127, sums of 16 quants.
// Grid (rows), block 256.
struct NormArgs {
    uint64_t x;       // f32 [..][width]
    uint64_t gather;  // u32 [rows], or 0
    uint64_t gain;    // f32 [width], or 0
    uint64_t out;     // f32 [rows][width]
    uint64_t qs;      // i8 [rows][width], or 0
    uint64_t d;       // f32 [rows][width / block_len]
    uint64_t sums;    // i32 [rows][width / 16]
    uint32_t width;
    uint32_t block_len;  // 32 (Q8_1, for Q4_0, Q4_1, Q8_0 weights) or 256 (Q8_K, for K-quants)
    float eps;
    uint32_t accumulate;  // 1: out[r] += the normalised row (no quantization then)
};

// RoPE on every token's Q and K heads (pairs of the first rope_dim
// dimensions: adjacent ones (2i, 2i+1), the GGUF llama layout, or halves
// (i, i + rope_dim / 2) where `halves`), pair i turned by
// pos * base^(-2i / rope_dim) * rope_scale / freq_factors[i] (no factors
// where 0: Llama 3's table), then K and V stored at the token's
// position in its sequence's pages. A token whose sequence is NO_SEQ (the
// padding of a captured step) is left alone and stores nothing.
// Grid (tokens), block 128.
struct RopeKvArgs {
    uint64_t q;          // f32 [tokens][heads * head_dim]
    uint64_t k;          // f32 [tokens][kv_heads * head_dim]
    uint64_t v;          // f32 [tokens][kv_heads * head_dim]
    uint64_t kv;         // the pool: [layer][k|v][pages_count][page_tokens][kv_heads * head_dim]
    uint64_t token_seq;  // u32 [tokens]: the token's sequence, or NO_SEQ
    uint64_t positions;  // u32 [tokens]
    uint64_t seq_pages;  // u32 [seqs]: where each sequence's page ids start in `pages`
    uint64_t pages;      // u32 [..]: page ids, checked by the page book before the launch
    uint64_t freq_factors;  // f32 [rope_dim / 2]: divisors of each pair's frequency, or 0
    uint32_t heads;
    uint32_t kv_heads;
    uint32_t head_dim;
    uint32_t rope_dim;
    uint32_t layer;
    uint32_t pages_count;
    uint32_t page_tokens;
    uint32_t kv_f16;  // 1: values stored as f16 bits, 0: as f32
    float rope_base;
    float rope_scale;
    uint32_t halves;  // 1: pairs (i, i + rope_dim / 2), 0: (2i, 2i + 1)
    uint32_t unused;
};

// One weight matrix of a product, and where its outputs go.
struct MatSeg {
    uint64_t w;    // [rows][row_bytes] in `type` blocks
    uint64_t out;  // f32 [tokens][out_stride]; this matrix's rows at columns 0..rows
    uint64_t bias; // f32 [rows] added to each product (STORE: qwen2's Q, K, V), or 0
    uint32_t type;
    uint32_t rows;
    uint32_t row_bytes;
    uint32_t out_stride;
    float cap;     // > 0: each product (STORE) soft-capped, cap * tanh(value / cap)
    uint32_t unused;
};

#define MATMUL_SEGS_MAX 3
#define MATMUL_STORE 0u
#define MATMUL_ADD 1u
#define MATMUL_SWIGLU 2u
#define MATMUL_GEGLU 3u
#define MATMUL_SILU_MUL 4u
#define MATMUL_GELU_MUL 5u
#define MATMUL_ROPE_KV 6u

// out[t][r] = W[r] . x[t] for up to three matrices sharing one input (Q, K
// and V), or, in SWIGLU mode, seg[0].out[t][r] = silu(G[r] . x[t]) * (U[r] . x[t])
// with G = seg[0], U = seg[1] (GEGLU: GELU's tanh form for silu). Where G and
// U take different activations, G is STOREd first and U's launch gates it:
// SILU_MUL, out[t][r] = silu(out[t][r]) * (U[r] . x[t]) (GELU_MUL likewise). Quantized weights take x as Q8 (qs, d, sums;
// NormArgs), F16 and F32 weights take it as f32 (x). ADD accumulates into out
// (the residual stream). One warp a row: grid (ceil(rows / 4) * ceil(tokens
// / 8)), block 128.
//
// With norm_x, a block makes its own tokens' Q8 activations first, in shared
// memory, from f32 rows (norm_gather picks them; RMSNorm with norm_gain
// first), exactly as rms_norm makes them (the same sums in the same order):
// one launch where a norm and a product were two. Dynamic shared memory:
// min(tokens, 8) * (k + 4 k / block_len + 4 k / 16) bytes.
//
// ROPE_KV: STOREs Q, K and V (seg 0, 1, 2) as rope_kv leaves them: Q and K
// turned by `rope` (whose q, k and v are unused), K and V also stored into
// the pages; a token of no sequence is stored as it is and nothing of it
// goes into pages. A warp takes a pair of rows, the two a RoPE pair turns
// together (in V, and past rope_dim, rows 2i and 2i + 1): grid
// (ceil(rows / 8) * ceil(tokens / 8)). One launch where there were two.
struct MatmulArgs {
    MatSeg seg[MATMUL_SEGS_MAX];
    uint64_t x;     // f32 [tokens][k]
    uint64_t qs;    // i8 [tokens][k]
    uint64_t d;     // f32 [tokens][k / block_len]
    uint64_t sums;  // i32 [tokens][k / 16]
    uint64_t norm_x;       // f32 [..][k]: rows to quantize in the block, or 0 (qs, d, sums as given)
    uint64_t norm_gather;  // u32 [tokens]: token t's row of norm_x, or 0 (row t)
    uint64_t norm_gain;    // f32 [k]: RMSNorm's gain, or 0 (quantized as they are)
    uint32_t segs;
    uint32_t k;
    uint32_t tokens;
    uint32_t mode;
    uint32_t block_len;  // the Q8 blocks norm_x is quantized in: 32 (Q8_1) or 256 (Q8_K)
    float eps;
    RopeKvArgs rope;  // ROPE_KV's RoPE and pages; unused in other modes
};

// A unit of attention work: queries t0..t1 (consecutive tokens of one
// sequence, the first at position pos0) of one KV head's group of query
// heads, over KV positions p0..p1 (each query sees at most its own position).
// `partial` is NO_SEQ to write the normalised output, else the slot of
// `partials` where (m, l, o) go for a merge (such an item has one query),
// `merge` that merge's index.
struct AttnItem {
    uint32_t seq;
    uint32_t kv_head;
    uint32_t t0;
    uint32_t t1;
    uint32_t pos0;
    uint32_t p0;
    uint32_t p1;
    uint32_t partial;
    uint32_t merge;  // NO_SEQ where `partial` is
    uint32_t unused;
};

// Paged attention through page tables, an online softmax over tiles of
// `tile` positions; with `by_warps`, an item of one query (a decode token's)
// whose head width and group the warp path takes is read by warps instead,
// its scores in the region the tiles would use. An item with t0 == t1 is
// padding and does nothing.
// With `counters`, the last of a merge's items to finish folds its partials
// (as attention_merge does, no launch of its own): each item counts itself
// done once its partial is written and fenced, and the one whose count
// completes the merge resets the counter for the next layer's launch.
// Grid (items), block 128, dynamic shared memory attention_shared_bytes().
struct AttentionArgs {
    uint64_t q;          // f32 [tokens][heads * head_dim]
    uint64_t kv;         // the pool, as in RopeKvArgs
    uint64_t items;      // AttnItem [grid]
    uint64_t seq_pages;  // as in RopeKvArgs
    uint64_t pages;
    uint64_t out;       // f32 [tokens][heads * head_dim]
    uint64_t partials;  // f32 [slots][group][2 + head_dim]: m, l, o of one query
    uint64_t merges;    // MergeItem [..], as in MergeArgs
    uint64_t counters;  // u32 [merges]: zero before the launch; or 0, a merge launch folds them
    uint32_t heads;
    uint32_t kv_heads;
    uint32_t head_dim;
    uint32_t layer;
    uint32_t pages_count;
    uint32_t page_tokens;
    uint32_t kv_f16;
    uint32_t rows_max;  // query rows (queries times group) one item may hold
    uint32_t tile;      // KV positions per tile
    float scale;        // the model's, 1 / sqrt(head_dim) but where a file says otherwise
    uint32_t window;    // > 0: a query sees only the last `window` positions, its own included
    float softcap;      // > 0: scores soft-capped, cap * tanh(score / cap)
    uint32_t by_warps;  // 1: one-query items by warps where they can (attention.cu), 0: by tiles
    uint32_t unused;
};

// Folds the partials of one decode token's KV head, in slot order, into its
// normalised output.
struct MergeItem {
    uint32_t token;
    uint32_t kv_head;
    uint32_t first;  // first partial slot
    uint32_t count;  // slots, in position order; 0: padding, does nothing
};

// Grid (merges), block 128.
struct MergeArgs {
    uint64_t partials;  // as in AttentionArgs, one query per slot
    uint64_t merges;    // MergeItem [grid]
    uint64_t out;       // f32 [tokens][heads * head_dim]
    uint32_t heads;
    uint32_t kv_heads;
    uint32_t head_dim;
    uint32_t unused;
};

// Each logits row's token (sample.cu): its logits adjusted in place by the
// row's AdjustEntry list (kernels/src/backend/adjust.rs), then a draw's
// (kernels/src/backend/draw.rs) where the row's DrawParams say one, else its
// largest value's id, the lowest among ties, as the CPU's argmax finds it
// scanning in order (a NaN is never larger; a NaN at index 0 is never
// exceeded). Grid (rows), block 1024.
struct PickArgs {
    uint64_t logits;   // f32 [grid][vocab]
    uint64_t out;      // u32 [grid]
    uint64_t draws;    // DrawParams [grid]; 0: every row its argmax, unadjusted
    uint64_t adjusts;  // AdjustEntry [], as the rows' DrawParams point into
                       // it: a row's own entries, then where it has one its
                       // shared entry and that entry's ids, a word each
    uint64_t scores;   // u32 [grid][SCORE_WORDS]: where DrawParams asks, the
                       // token's log probability (f32), the alternatives'
                       // count, then (id, log probability) each
    uint64_t originals;  // f32 [4 x the adjusts' entries]: from 4 x a row's
                         // adjust_at, each adjusted logit as it was (its own
                         // entries', then its shared ids'), where its row
                         // asks for log probabilities
    uint32_t vocab;
    uint32_t unused;
};

// One row's draw (backend::Draw); inv_t 0 is no draw (the argmax). Its
// adjustments first: adjusts[adjust_at..adjust_at + adjust_count], each its
// own token's, and where shared_count > 0 the entry after them applied to
// each of the shared_count ids (u32, ascending) in the entries after it (the
// entry's id holds only its ban). No id is in both.
struct DrawParams {
    float inv_t;
    uint32_t top_k;  // 0: every token
    float top_p;     // 1: every token
    float min_p;     // 0: every token
    double u;        // in [0, 1)
    uint32_t adjust_at;
    uint32_t adjust_count;
    uint32_t top_logprobs;  // 0: none; else 1 + the alternatives wanted
    uint32_t target;        // 0: the row's token is picked; else 1 + the
                            // token a prompt's row is scored for (nothing picked)
    uint32_t shared_count;
    uint32_t unused;
};

// One token's adjustment (backend::Adjust): repetition (1: none), then
// penalty subtracted (0: none), then bias added (0: none); banned, -inf.
struct AdjustEntry {
    uint32_t id;  // the top bit: banned
    float repetition;
    float penalty;
    float bias;
};

// XXH3-64 of pages' used slots in the transfer's order (kv/digest.rs):
// for layer: K[0..used][kv_dim], V[0..used][kv_dim] as stored bits, seeded
// with `used`. One warp a page: grid (pages), block 32.
struct DigestArgs {
    uint64_t kv;     // the pool, as in RopeKvArgs
    uint64_t pages;  // u32 [grid][2]: page id, used slots
    uint64_t out;    // u64 [grid]
    uint32_t layers;
    uint32_t pages_count;
    uint32_t page_tokens;
    uint32_t kv_dim;
    uint32_t value_bytes;  // 2 (f16) or 4 (f32)
    uint32_t unused;
};

// A draw's weights, exp_rn of each value in place (sample.cu), for the GPU
// check to compare with the host's bit for bit. Grid (count / 128 rounded
// up), block 128.
struct DrawWeightsArgs {
    uint64_t values;  // f32 [count]
    uint32_t count;
    uint32_t unused;
};
