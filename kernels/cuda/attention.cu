// RoPE and the KV write, paged attention and the merge of split decode
// attention: the device side of the CPU backend's attention block.
//
// KV is read and written only through page tables: a token's position p
// lives in page pages[seq_pages[seq] + p / page_tokens], slot p % page_tokens.
// The backend packs those tables after the page book checked every lease of
// the step (kv::Pool::step_view), so a launch touches only pages the step's
// sequences own; the kernels trust the tables and nothing else.
//
// Attention is an online softmax over tiles of positions, for a block of
// query rows (queries times the query heads of one KV head): each tile's K
// and V are read from their pages once for all those rows. An item of one
// query (a decode token's, where a step's bytes are K and V) is read by
// warps instead: a few lanes a position, each lane 16 or 32 bytes of the
// position's row, every warp its own positions with no barrier between
// them; scores in shared memory, then one softmax over the item's span,
// then V read the same way (attend_one).

#include "common.cuh"
#include "args.cuh"
#include "kv.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))

#ifdef BULKHEAD_EMU
inline float __int_as_float(int bits) {
    float value;
    memcpy(&value, &bits, 4);
    return value;
}
#endif

// The 16 bytes at value `index`: 8 f16 values or 4 f32 into out[0..8 or 4].
__device__ __forceinline__ void kv_load16(uint64_t kv, uint64_t index, uint32_t kv_f16, float* out) {
    const uint8_t* at = reinterpret_cast<const uint8_t*>(kv) + index * (kv_f16 ? 2 : 4);
    Int4 raw = *reinterpret_cast<const Int4*>(at);
    int words[4] = {raw.x, raw.y, raw.z, raw.w};
    for (int w = 0; w < 4; w++) {
        uint32_t bits = uint32_t(words[w]);
        if (kv_f16) {
            out[2 * w] = f16_to_f32(uint16_t(bits & 0xFFFFu));
            out[2 * w + 1] = f16_to_f32(uint16_t(bits >> 16));
        } else {
            out[w] = __int_as_float(int(bits));
        }
    }
}

// Folds the partials of `merge` (slots first.., in position order) into
// its token's normalised output for the KV head's query heads, the block's
// threads a share of group * head_dim values each. The partials are read
// past L1: in attention's own fold, other blocks wrote them in this launch.
__device__ void merge_partials(uint64_t partials_at, uint64_t out_at, MergeItem merge,
                               uint32_t heads, uint32_t kv_heads, uint32_t hd) {
    uint32_t group = heads / kv_heads;
    const volatile float* partials = reinterpret_cast<const volatile float*>(partials_at);
    float* out = reinterpret_cast<float*>(out_at);
    for (uint32_t e = threadIdx.x; e < group * hd; e += blockDim.x) {
        uint32_t g = e / hd, i = e % hd;
        float best = NEG_INF;
        for (uint32_t s = 0; s < merge.count; s++) {
            best = fmaxf(best, partials[(uint64_t(merge.first + s) * group + g) * (2 + hd)]);
        }
        float l = 0.0f, o = 0.0f;
        for (uint32_t s = 0; s < merge.count; s++) {
            const volatile float* part = partials + (uint64_t(merge.first + s) * group + g) * (2 + hd);
            float m = part[0];
            float weight = m == NEG_INF ? 0.0f : expf(m - best);
            l += part[1] * weight;
            o += part[2 + i] * weight;
        }
        uint32_t head = merge.kv_head * group + g;
        out[uint64_t(merge.token) * heads * hd + head * hd + i] = l > 0.0f ? o / l : 0.0f;
    }
}

KERNEL(rope_kv, RopeKvArgs) {
    uint32_t t = blockIdx.x;
    uint32_t seq = reinterpret_cast<const uint32_t*>(a.token_seq)[t];
    if (seq == NO_SEQ) return;  // the whole block
    uint32_t pos = reinterpret_cast<const uint32_t*>(a.positions)[t];
    uint32_t kv_dim = a.kv_heads * a.head_dim, pairs = a.rope_dim / 2;
    float* q = reinterpret_cast<float*>(a.q) + uint64_t(t) * a.heads * a.head_dim;
    float* k = reinterpret_cast<float*>(a.k) + uint64_t(t) * kv_dim;
    const float* v = reinterpret_cast<const float*>(a.v) + uint64_t(t) * kv_dim;
    for (uint32_t e = threadIdx.x; e < (a.heads + a.kv_heads) * pairs; e += blockDim.x) {
        uint32_t head = e / pairs, i = e % pairs;
        float* head_at = head < a.heads ? q + head * a.head_dim : k + (head - a.heads) * a.head_dim;
        uint32_t i0 = a.halves ? i : 2 * i, i1 = a.halves ? i + pairs : 2 * i + 1;
        rope_turn(a, i, pos, &head_at[i0], &head_at[i1]);
    }
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        store_token_kv(a, seq, pos, 0, i, k[i]);
        store_token_kv(a, seq, pos, 1, i, v[i]);
    }
}

// Values at..at + VALS (8 or 4) of K (kv 0) or V (kv 1) at position p of
// the item's table into out[0..VALS]: one 16-byte load (8 f16 values or 4
// f32) or two (8 f32). Zeros where `valid` is false (a lane past the span).
template <int VALS>
__device__ __forceinline__ void load_position(const AttentionArgs& a, const uint32_t* table,
                                              uint32_t p, uint32_t kv, uint32_t at, bool valid,
                                              float* out) {
    if (!valid) {
        #pragma unroll
        for (int x = 0; x < 8; x++) out[x] = 0.0f;
        return;
    }
    uint32_t page = table[p / a.page_tokens], slot = p % a.page_tokens;
    uint64_t index = kv_index(a.layer, kv, page, slot, at, a.pages_count, a.page_tokens,
                              a.kv_heads * a.head_dim);
    kv_load16(a.kv, index, a.kv_f16, out);
    if (VALS == 8 && !a.kv_f16) kv_load16(a.kv, index + 4, 0, out + 4);
}

// Values a lane takes of a position's row in attend_one (8, or 4 for f32
// rows of at most 128), or 0 where the item is for the tiles: more than one
// query, a head width whose lanes are not a power of two or more than 8
// values a lane, a group wider than the lane's registers, or scores (and
// later the warps' sums) that would not fit the tiles' region of shared
// memory, `region` floats.
__device__ __forceinline__ uint32_t by_warps_vals(const AttentionArgs& a, const AttnItem& item,
                                                  uint32_t n, uint32_t group, uint32_t region) {
    if (!a.by_warps || item.t1 - item.t0 != 1) return 0;
    uint32_t hd = a.head_dim, per = a.kv_f16 ? 8 : 4;
    uint32_t lanes = umin32(WARP_SIZE, hd / per), vals = lanes ? hd / lanes : 0;
    bool whole = lanes > 0 && (lanes & (lanes - 1)) == 0 && lanes * vals == hd;
    uint32_t warps = blockDim.x / WARP_SIZE;
    if (!whole || uint64_t(group) * umax32(n, warps * hd) > region) return 0;
    if (vals == 8 && group <= 4) return 8;
    if (vals == 4 && group <= 8) return 4;
    return 0;
}

// A one-query item's attention over positions start..start + n, by warps:
// hd / VALS lanes (a "team") a position, VALS values of its row each, so a
// warp takes 32 / (hd / VALS) positions at once and two rounds of them per
// iteration (every load of an iteration issued before any is used). Leaves
// the normalised-to-be output in os (unnormalised, as the tiles leave it),
// the largest score in ms and the sum of weights in ls, a row per query
// head. `region` holds group * max(n, warps * hd) floats: the scores
// (`[group][n]`), then the warps' sums.
template <int VALS, int GMAX>
__device__ void attend_one(const AttentionArgs& a, const AttnItem& item, const uint32_t* table,
                           uint32_t start, uint32_t n, float* os, float* ms, float* ls,
                           float* region) {
    uint32_t hd = a.head_dim, group = a.heads / a.kv_heads;
    uint32_t warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    uint32_t warps = blockDim.x / WARP_SIZE;
    uint32_t lanes = hd / VALS, per_warp = WARP_SIZE / lanes;
    uint32_t team = warp * per_warp + lane / lanes, teams = warps * per_warp;
    uint32_t part = lane % lanes, at = item.kv_head * hd + part * VALS;
    // The query heads' values this lane multiplies, in registers.
    const float* q = reinterpret_cast<const float*>(a.q) + uint64_t(item.t0) * a.heads * hd +
                     uint64_t(item.kv_head) * group * hd + part * VALS;
    float qv[GMAX][VALS];
    #pragma unroll
    for (uint32_t g = 0; g < GMAX; g++) {
        #pragma unroll
        for (uint32_t x = 0; x < VALS; x++) qv[g][x] = g < group ? q[g * hd + x] : 0.0f;
    }
    float* scores = region;
    // Scores: a team's lanes' dots summed across the team (lanes a power
    // of two, so xor stays within it). Every lane runs every iteration: the
    // shuffles need the whole warp.
    for (uint32_t j0 = 0; j0 < n; j0 += 2 * teams) {
        float k[2][8];
        #pragma unroll
        for (uint32_t u = 0; u < 2; u++) {
            uint32_t j = j0 + u * teams + team;
            load_position<VALS>(a, table, start + j, 0, at, j < n, k[u]);
        }
        #pragma unroll
        for (uint32_t u = 0; u < 2; u++) {
            uint32_t j = j0 + u * teams + team;
            float dot[GMAX];
            #pragma unroll
            for (uint32_t g = 0; g < GMAX; g++) {
                dot[g] = 0.0f;
                #pragma unroll
                for (uint32_t x = 0; x < VALS; x++) dot[g] += qv[g][x] * k[u][x];
            }
            for (uint32_t mask = lanes / 2; mask > 0; mask /= 2) {
                #pragma unroll
                for (uint32_t g = 0; g < GMAX; g++) {
                    if (g < group) dot[g] += __shfl_xor_sync(FULL_MASK, dot[g], mask);
                }
            }
            if (j >= n || part != 0) continue;
            #pragma unroll
            for (uint32_t g = 0; g < GMAX; g++) {
                if (g >= group) break;
                float score = dot[g] * a.scale;
                if (a.softcap > 0.0f) score = soft_cap(score, a.softcap);
                scores[g * n + j] = score;
            }
        }
    }
    __syncthreads();
    // One softmax over the span: a warp a query head, the weights in
    // place of the scores.
    for (uint32_t g = warp; g < group; g += warps) {
        float best = NEG_INF;
        for (uint32_t j = lane; j < n; j += WARP_SIZE) best = fmaxf(best, scores[g * n + j]);
        best = warp_max(best);
        float sum = 0.0f;
        for (uint32_t j = lane; j < n; j += WARP_SIZE) {
            float s = scores[g * n + j];
            float p = s == NEG_INF ? 0.0f : expf(s - best);
            scores[g * n + j] = p;
            sum += p;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            ms[g] = best;
            ls[g] = sum;
        }
    }
    __syncthreads();
    // V weighted: each lane its VALS values of every query head.
    float o[GMAX][VALS];
    #pragma unroll
    for (uint32_t g = 0; g < GMAX; g++) {
        #pragma unroll
        for (uint32_t x = 0; x < VALS; x++) o[g][x] = 0.0f;
    }
    for (uint32_t j0 = 0; j0 < n; j0 += 2 * teams) {
        float v[2][8];
        #pragma unroll
        for (uint32_t u = 0; u < 2; u++) {
            uint32_t j = j0 + u * teams + team;
            load_position<VALS>(a, table, start + j, 1, at, j < n, v[u]);
        }
        #pragma unroll
        for (uint32_t u = 0; u < 2; u++) {
            uint32_t j = j0 + u * teams + team;
            if (j >= n) break;
            #pragma unroll
            for (uint32_t g = 0; g < GMAX; g++) {
                if (g >= group) break;
                float p = scores[g * n + j];
                #pragma unroll
                for (uint32_t x = 0; x < VALS; x++) o[g][x] += p * v[u][x];
            }
        }
    }
    // The warp's teams summed (lanes of one part, `lanes` apart), then the
    // warps' through the region, the scores no longer read.
    for (uint32_t mask = lanes; mask < WARP_SIZE; mask *= 2) {
        #pragma unroll
        for (uint32_t g = 0; g < GMAX; g++) {
            if (g >= group) break;
            #pragma unroll
            for (uint32_t x = 0; x < VALS; x++) o[g][x] += __shfl_xor_sync(FULL_MASK, o[g][x], mask);
        }
    }
    __syncthreads();
    float* sums = region;
    if (lane < lanes) {
        #pragma unroll
        for (uint32_t g = 0; g < GMAX; g++) {
            if (g >= group) break;
            #pragma unroll
            for (uint32_t x = 0; x < VALS; x++) sums[(warp * group + g) * hd + part * VALS + x] = o[g][x];
        }
    }
    __syncthreads();
    for (uint32_t e = threadIdx.x; e < group * hd; e += blockDim.x) {
        float total = 0.0f;
        for (uint32_t w = 0; w < warps; w++) total += sums[w * group * hd + e];
        os[e] = total;
    }
}

// Shared memory of an attention block: q[rows_max][hd], o[rows_max][hd],
// k[tile][hd + 1], v[tile][hd + 1], p[rows_max][tile], m[rows_max],
// l[rows_max], alpha[rows_max]. A row of k or v is hd + 1 wide: a score's
// lanes, one position each, then read distinct banks (at hd they would all
// read one), and a tile's stores (a warp's lanes 8 values of 4 positions,
// or 4 of 2) fall at most two to a bank, where at hd eight would.
struct AttnShared {
    float* qs;
    float* os;
    float* ks;
    float* vs;
    float* ps;
    float* ms;
    float* ls;
    float* alphas;
    uint32_t stride;  // of k and v
    uint32_t region;  // floats of k, v and p together
};

__device__ __forceinline__ AttnShared attn_shared(const AttentionArgs& a, float* shared) {
    AttnShared sh;
    sh.stride = a.head_dim + 1;
    sh.qs = shared;
    sh.os = sh.qs + a.rows_max * a.head_dim;
    sh.ks = sh.os + a.rows_max * a.head_dim;
    sh.vs = sh.ks + a.tile * sh.stride;
    sh.ps = sh.vs + a.tile * sh.stride;
    sh.ms = sh.ps + a.rows_max * a.tile;
    sh.ls = sh.ms + a.rows_max;
    sh.alphas = sh.ls + a.rows_max;
    sh.region = 2 * a.tile * sh.stride + a.rows_max * a.tile;
    return sh;
}

// The item's queries over positions start..end by tiles of `tile`
// positions, an online softmax over them: each tile's K and V read into
// shared memory once for every query row of the item.
__device__ void attend_tiles(const AttentionArgs& a, const AttnItem& item, const uint32_t* table,
                             uint32_t start, uint32_t end, const AttnShared& sh) {
    uint32_t hd = a.head_dim, group = a.heads / a.kv_heads, kv_dim = a.kv_heads * hd;
    uint32_t rows = (item.t1 - item.t0) * group, tile = a.tile, stride = sh.stride;
    uint32_t warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    uint32_t warps = blockDim.x / WARP_SIZE;
    float *qs = sh.qs, *os = sh.os, *ks = sh.ks, *vs = sh.vs, *ps = sh.ps;
    float *ms = sh.ms, *ls = sh.ls, *alphas = sh.alphas;
    // Row r: query r / group (token t0 + r / group), head kv_head * group + r % group.
    const float* q = reinterpret_cast<const float*>(a.q);
    for (uint32_t e = threadIdx.x; e < rows * hd; e += blockDim.x) {
        uint32_t r = e / hd, i = e % hd;
        uint32_t t = item.t0 + r / group, head = item.kv_head * group + r % group;
        qs[e] = q[uint64_t(t) * a.heads * hd + head * hd + i];
        os[e] = 0.0f;
    }
    for (uint32_t r = threadIdx.x; r < rows; r += blockDim.x) {
        ms[r] = NEG_INF;
        ls[r] = 0.0f;
    }
    for (uint32_t first = start; first < end; first += tile) {
        uint32_t n = umin32(tile, end - first);
        __syncthreads();  // the previous tile's k, v and p are no longer read
        // 16 bytes at a time (8 f16 values or 4 f32: head_dim is a multiple
        // of 8, so a head's row starts 16-byte aligned), every load of the
        // tile independent of the others.
        uint32_t per = a.kv_f16 ? 8 : 4, chunks = hd / per;
        for (uint32_t e = threadIdx.x; e < n * chunks; e += blockDim.x) {
            uint32_t j = e / chunks, i = (e % chunks) * per, p = first + j;
            uint32_t page = table[p / a.page_tokens], slot = p % a.page_tokens;
            uint32_t at = item.kv_head * hd + i;
            float k[8], v[8];
            kv_load16(a.kv, kv_index(a.layer, 0, page, slot, at, a.pages_count, a.page_tokens, kv_dim), a.kv_f16, k);
            kv_load16(a.kv, kv_index(a.layer, 1, page, slot, at, a.pages_count, a.page_tokens, kv_dim), a.kv_f16, v);
            // Constant indices (8, the most a load gives), so k and v stay
            // in registers rather than local memory.
            #pragma unroll
            for (uint32_t x = 0; x < 8; x++) {
                if (x >= per) break;
                ks[j * stride + i + x] = k[x];
                vs[j * stride + i + x] = v[x];
            }
        }
        __syncthreads();
        for (uint32_t e = threadIdx.x; e < rows * tile; e += blockDim.x) {
            uint32_t r = e / tile, j = e % tile;
            uint32_t query_pos = item.pos0 + r / group;
            float score = NEG_INF;
            uint32_t p = first + j;
            bool seen = p <= query_pos && (a.window == 0 || p + a.window > query_pos);
            if (j < n && seen) {
                float dot = 0.0f;
                for (uint32_t i = 0; i < hd; i++) dot += qs[r * hd + i] * ks[j * stride + i];
                score = dot * a.scale;
                if (a.softcap > 0.0f) score = soft_cap(score, a.softcap);
            }
            ps[e] = score;
        }
        __syncthreads();
        // The online softmax: one warp a row.
        for (uint32_t r = warp; r < rows; r += warps) {
            float best = NEG_INF;
            for (uint32_t j = lane; j < tile; j += WARP_SIZE) best = fmaxf(best, ps[r * tile + j]);
            best = warp_max(best);
            float m_old = ms[r], m_new = fmaxf(m_old, best);
            float sum = 0.0f;
            for (uint32_t j = lane; j < tile; j += WARP_SIZE) {
                float s = ps[r * tile + j];
                float p = s == NEG_INF ? 0.0f : expf(s - m_new);
                ps[r * tile + j] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                float alpha = m_old == NEG_INF ? 0.0f : expf(m_old - m_new);
                alphas[r] = alpha;
                ls[r] = ls[r] * alpha + sum;
                ms[r] = m_new;
            }
        }
        __syncthreads();
        for (uint32_t e = threadIdx.x; e < rows * hd; e += blockDim.x) {
            uint32_t r = e / hd, i = e % hd;
            float acc = os[e] * alphas[r];
            for (uint32_t j = 0; j < n; j++) acc += ps[r * tile + j] * vs[j * stride + i];
            os[e] = acc;
        }
    }
}

// An item's positions a block asks for in L2 before it waits for the kernel
// before it (attention_prefetch): a decode split's whole span at the
// smaller batches, a longer span's first two tiles.
#define PREFETCH_POSITIONS 64u

// Before it waits (a dependent launch), each block asks for the lines of K
// and V its item will read first: their pages were written by earlier steps
// (the token's own position by the kernel before, which L2, coherent for
// every multiprocessor, takes in whichever order), and the item and its
// page table are the step buffer's. The softmax's two reads of K and of V
// then find them in L2 rather than in memory.
KERNEL_PREFETCHING(attention, AttentionArgs) {
    AttnItem item = reinterpret_cast<const AttnItem*>(a.items)[blockIdx.x];
    if (item.t0 >= item.t1) return;  // padding
    uint32_t hd = a.head_dim, group = a.heads / a.kv_heads;
    uint32_t rows = (item.t1 - item.t0) * group;
    DYNAMIC_SHARED(float, shared);
    AttnShared sh = attn_shared(a, shared);
    float *os = sh.os, *ms = sh.ms, *ls = sh.ls, *alphas = sh.alphas;
    const uint32_t* table = reinterpret_cast<const uint32_t*>(a.pages) +
                            reinterpret_cast<const uint32_t*>(a.seq_pages)[item.seq];
    // Positions the last query may see: up to its own.
    uint32_t end = umin32(item.p1, item.pos0 + (item.t1 - item.t0));
    // And from the first query's window on, in a local layer: pages before
    // it are not read (a split wholly before it reads nothing, weighs nothing).
    uint32_t start = item.p0;
    if (a.window != 0 && item.pos0 + 1 > a.window) start = umax32(start, item.pos0 + 1 - a.window);
    // One query by warps where it can (every position of start..end is its
    // to see), in the region of k, v and p; else by tiles.
    uint32_t span = end > start ? end - start : 0;
    uint32_t vals = by_warps_vals(a, item, span, group, sh.region);
    if (vals == 8) {
        attend_one<8, 4>(a, item, table, start, span, os, ms, ls, sh.ks);
    } else if (vals == 4) {
        attend_one<4, 8>(a, item, table, start, span, os, ms, ls, sh.ks);
    } else {
        attend_tiles(a, item, table, start, end, sh);
    }
    __syncthreads();
    float* out = reinterpret_cast<float*>(a.out);
    float* partials = reinterpret_cast<float*>(a.partials);
    for (uint32_t e = threadIdx.x; e < rows * hd; e += blockDim.x) {
        uint32_t r = e / hd, i = e % hd;
        uint32_t t = item.t0 + r / group, head = item.kv_head * group + r % group;
        if (item.partial == NO_SEQ) {
            float l = ls[r];
            out[uint64_t(t) * a.heads * hd + head * hd + i] = l > 0.0f ? os[e] / l : 0.0f;
        } else {
            float* part = partials + (uint64_t(item.partial) * group + r) * (2 + hd);
            if (i == 0) {
                part[0] = ms[r];
                part[1] = ls[r];
            }
            part[2 + i] = os[e];
        }
    }
    if (item.partial == NO_SEQ || !a.counters) return;
    // The last of the merge's items to finish folds them all. Every
    // thread's stores are fenced before the block counts itself done, so the
    // block whose count completes the merge sees every partial of it.
    __threadfence();
    __syncthreads();
    uint32_t* counters = reinterpret_cast<uint32_t*>(a.counters);
    MergeItem merge = reinterpret_cast<const MergeItem*>(a.merges)[item.merge];
    if (threadIdx.x == 0) {
        bool last = atomicAdd(&counters[item.merge], 1u) + 1 == merge.count;
        if (last) counters[item.merge] = 0;  // zero again for the next layer's launch
        alphas[0] = last ? 1.0f : 0.0f;      // no longer read: the block's flag
    }
    __syncthreads();
    if (alphas[0] == 0.0f) return;
    __threadfence();
    merge_partials(a.partials, a.out, merge, a.heads, a.kv_heads, hd);
}

// attention's prefetch: the item's first PREFETCH_POSITIONS positions of K
// and V, found as the kernel finds them (its parameters and the step
// buffer's words alone), a line a thread in turn.
__device__ __forceinline__ void attention_prefetch(const AttentionArgs a) {
    const uint32_t* item = reinterpret_cast<const uint32_t*>(a.items) +
                           uint64_t(blockIdx.x) * (sizeof(AttnItem) / 4);
    // AttnItem's words: seq, kv_head, t0, t1, pos0, p0, p1.
    uint32_t seq = load_step_word(item), kv_head = load_step_word(item + 1);
    uint32_t t0 = load_step_word(item + 2), t1 = load_step_word(item + 3);
    uint32_t pos0 = load_step_word(item + 4), p0 = load_step_word(item + 5);
    uint32_t p1 = load_step_word(item + 6);
    if (t0 >= t1) return;  // padding
    uint32_t end = umin32(p1, pos0 + (t1 - t0)), start = p0;
    if (a.window != 0 && pos0 + 1 > a.window) start = umax32(start, pos0 + 1 - a.window);
    if (end <= start) return;
    uint32_t n = umin32(end - start, PREFETCH_POSITIONS);
    const uint32_t* table = reinterpret_cast<const uint32_t*>(a.pages) +
                            load_step_word(reinterpret_cast<const uint32_t*>(a.seq_pages) + seq);
    uint32_t value_bytes = a.kv_f16 ? 2 : 4, kv_dim = a.kv_heads * a.head_dim;
    uint32_t lines = (a.head_dim * value_bytes + 127) / 128;  // of a position's head
    for (uint32_t e = threadIdx.x; e < 2 * n * lines; e += blockDim.x) {
        uint32_t kv = e / (n * lines), p = start + e % (n * lines) / lines, line = e % lines;
        uint32_t page = load_step_word(table + p / a.page_tokens);
        uint64_t index = kv_index(a.layer, kv, page, p % a.page_tokens, kv_head * a.head_dim,
                                  a.pages_count, a.page_tokens, kv_dim);
        prefetch_l2(reinterpret_cast<const uint8_t*>(a.kv) + index * value_bytes + 128 * line);
    }
}

KERNEL(attention_merge, MergeArgs) {
    MergeItem merge = reinterpret_cast<const MergeItem*>(a.merges)[blockIdx.x];
    if (merge.count == 0) return;  // padding of a captured step
    merge_partials(a.partials, a.out, merge, a.heads, a.kv_heads, a.head_dim);
}
