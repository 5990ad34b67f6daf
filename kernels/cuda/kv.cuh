// RoPE and the KV store into pages, shared by rope_kv (attention.cu) and the
// Q/K/V product that turns and stores its own outputs (quant.cu): the same
// functions, so the same bits whichever launch does it.

#pragma once

#include "common.cuh"
#include "args.cuh"

// Where value i of K (kv 0) or V (kv 1) of `layer` at `slot` of `page` lives.
__device__ __forceinline__ uint64_t kv_index(uint32_t layer, uint32_t kv, uint32_t page,
                                             uint32_t slot, uint32_t i, uint32_t pages_count,
                                             uint32_t page_tokens, uint32_t kv_dim) {
    uint64_t slab = uint64_t(page_tokens) * kv_dim;
    return ((uint64_t(layer) * 2 + kv) * pages_count + page) * slab + uint64_t(slot) * kv_dim + i;
}

__device__ __forceinline__ void kv_store(uint64_t kv, uint64_t index, uint32_t kv_f16, float value) {
    if (kv_f16) {
        reinterpret_cast<uint16_t*>(kv)[index] = f32_to_f16(value);
    } else {
        reinterpret_cast<float*>(kv)[index] = value;
    }
}

// Stores value i (of kv_heads * head_dim) of K (kv 0) or V (kv 1) of the
// token at `pos` of sequence `seq`, in its page through the sequence's table.
__device__ __forceinline__ void store_token_kv(const RopeKvArgs& r, uint32_t seq, uint32_t pos,
                                               uint32_t kv, uint32_t i, float value) {
    const uint32_t* pages = reinterpret_cast<const uint32_t*>(r.pages);
    uint32_t page = pages[reinterpret_cast<const uint32_t*>(r.seq_pages)[seq] + pos / r.page_tokens];
    uint32_t kv_dim = r.kv_heads * r.head_dim;
    uint64_t at = kv_index(r.layer, kv, page, pos % r.page_tokens, i, r.pages_count, r.page_tokens, kv_dim);
    kv_store(r.kv, at, r.kv_f16, value);
}

// Pair i (i < rope_dim / 2) of a head turned for position `pos`: by
// pos * base^(-2i / rope_dim) * rope_scale / freq_factors[i].
__device__ __forceinline__ void rope_turn(const RopeKvArgs& r, uint32_t i, uint32_t pos, float* x0,
                                          float* x1) {
    // As the CPU's table: the base's power, times the scale, over the factor.
    float freq = powf(r.rope_base, -float(2 * i) / float(r.rope_dim)) * r.rope_scale;
    if (r.freq_factors) freq = freq / reinterpret_cast<const float*>(r.freq_factors)[i];
    float theta = float(pos) * freq;
    float sin_theta, cos_theta;
    sincosf(theta, &sin_theta, &cos_theta);
    float a = *x0, b = *x1;
    *x0 = mul_rn(a, cos_theta) - mul_rn(b, sin_theta);
    *x1 = mul_rn(a, sin_theta) + mul_rn(b, cos_theta);
}
