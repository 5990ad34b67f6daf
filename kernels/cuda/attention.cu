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
// and V are read from their pages once for all those rows.

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

KERNEL(attention, AttentionArgs) {
    AttnItem item = reinterpret_cast<const AttnItem*>(a.items)[blockIdx.x];
    if (item.t0 >= item.t1) return;  // padding
    uint32_t hd = a.head_dim, group = a.heads / a.kv_heads, kv_dim = a.kv_heads * hd;
    uint32_t rows = (item.t1 - item.t0) * group, tile = a.tile;
    uint32_t warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    uint32_t warps = blockDim.x / WARP_SIZE;
    // Shared memory: q[rows_max][hd], o[rows_max][hd], k[tile][hd + 1],
    // v[tile][hd + 1], p[rows_max][tile], m[rows_max], l[rows_max],
    // alpha[rows_max]. A row of k or v is hd + 1 wide: a score's lanes, one
    // position each, then read distinct banks (at hd they would all read
    // one), and a tile's stores (a warp's lanes 8 values of 4 positions, or
    // 4 of 2) fall at most two to a bank, where at hd eight would.
    DYNAMIC_SHARED(float, shared);
    uint32_t stride = hd + 1;
    float* qs = shared;
    float* os = qs + a.rows_max * hd;
    float* ks = os + a.rows_max * hd;
    float* vs = ks + tile * stride;
    float* ps = vs + tile * stride;
    float* ms = ps + a.rows_max * tile;
    float* ls = ms + a.rows_max;
    float* alphas = ls + a.rows_max;
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
    const uint32_t* table = reinterpret_cast<const uint32_t*>(a.pages) +
                            reinterpret_cast<const uint32_t*>(a.seq_pages)[item.seq];
    // Positions the last query may see: up to its own.
    uint32_t end = umin32(item.p1, item.pos0 + (item.t1 - item.t0));
    // And from the first query's window on, in a local layer: pages before
    // it are not read (a split wholly before it reads nothing, weighs nothing).
    uint32_t start = item.p0;
    if (a.window != 0 && item.pos0 + 1 > a.window) start = umax32(start, item.pos0 + 1 - a.window);
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

KERNEL(attention_merge, MergeArgs) {
    MergeItem merge = reinterpret_cast<const MergeItem*>(a.merges)[blockIdx.x];
    if (merge.count == 0) return;  // padding of a captured step
    merge_partials(a.partials, a.out, merge, a.heads, a.kv_heads, a.head_dim);
}
