// Embedding rows, RMSNorm with activation quantization, and the quantized
// matrix products: the device side of kernels/src/quant/ and the CPU
// backend's norm and matmul steps.
//
// Activations are quantized exactly as the CPU quantizes them (Q8 blocks:
// d = amax / 127, quants rounded ties-to-even, clamped to -127..=127), and
// weight blocks are read in their GGUF layout, unrepacked. A product is then
// integer dot products (dp4a) per 32 weights, scaled in f32: the CPU's
// result up to the order of f32 sums.
//
// Unsigned quants (the nibbles of Q4_0, the 5-bit codes of Q5_0, the 6-bit
// codes of Q6_K) enter the dot product as they are, and their offset (8, 16,
// 32) comes off afterwards through the activations' sums of 16 quants:
// (q - o) . x = q . x - o * sum(x).

#include "common.cuh"
#include "args.cuh"
#include "kv.cuh"

#define QK 32u
#define QK_K 256u
#define MATMUL_WARPS 4u
// Tokens whose accumulators one warp keeps at once: each weight unit is
// decoded once for this many tokens.
#define MATMUL_TOKENS 8u

// The CPU's scale_min_k4: sub-block j's 6-bit scale and min of a Q4_K block.
__device__ __forceinline__ void scale_min_k4(uint32_t j, const uint8_t* scales, int* scale,
                                             int* min) {
    if (j < 4) {
        *scale = scales[j] & 63;
        *min = scales[j + 4] & 63;
    } else {
        *scale = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4);
        *min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
    }
}

// The float whose bits are `bits`.
__device__ __forceinline__ float bits_to_f32(uint32_t bits) {
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

// A bfloat16 is the top half of an f32.
__device__ __forceinline__ float load_bf16(const uint8_t* p) {
    return bits_to_f32(uint32_t(load_u16(p)) << 16);
}

// The 5-bit code of weight j (0..32) of a Q5_0 or Q5_1 block: its nibble
// (weights 0..16 low, 16..32 high) and bit j of the 32 high bits.
__device__ __forceinline__ uint32_t q5_code(const uint8_t* qh, const uint8_t* qs, uint32_t j) {
    uint32_t q = qs[j % 16];
    uint32_t nibble = j < 16 ? q & 0xF : q >> 4;
    return nibble | ((load_u32(qh) >> j) & 1) << 4;
}

// Weight `i` of a row of `type` blocks, as the CPU's dequantize_row gives it.
__device__ float dequantize_one(uint32_t type, const uint8_t* row, uint32_t i) {
    switch (type) {
        case TYPE_F32:
            return bits_to_f32(load_u32(row + 4 * i));
        case TYPE_F16:
            return load_f16(row + 2 * i);
        case TYPE_BF16:
            return load_bf16(row + 2 * i);
        case TYPE_Q4_0: {
            const uint8_t* block = row + (i / QK) * 18;
            uint32_t j = i % QK, q = block[2 + j % 16];
            int nibble = int(j < 16 ? q & 0xF : q >> 4);
            return load_f16(block) * float(nibble - 8);
        }
        case TYPE_Q4_1: {
            const uint8_t* block = row + (i / QK) * 20;
            uint32_t j = i % QK, q = block[4 + j % 16];
            float nibble = float(j < 16 ? q & 0xF : q >> 4);
            return mul_rn(load_f16(block), nibble) + load_f16(block + 2);
        }
        case TYPE_Q5_0: {
            const uint8_t* block = row + (i / QK) * 22;
            int code = int(q5_code(block + 2, block + 6, i % QK));
            return load_f16(block) * float(code - 16);
        }
        case TYPE_Q5_1: {
            const uint8_t* block = row + (i / QK) * 24;
            float code = float(q5_code(block + 4, block + 8, i % QK));
            return mul_rn(load_f16(block), code) + load_f16(block + 2);
        }
        case TYPE_Q8_0: {
            const uint8_t* block = row + (i / QK) * 34;
            return load_f16(block) * float(int8_t(block[2 + i % QK]));
        }
        case TYPE_Q4_K: {
            const uint8_t* block = row + (i / QK_K) * 144;
            uint32_t j = i % QK_K, sub = j / QK;
            uint8_t q = block[16 + (j / 64) * 32 + j % 32];
            int scale, min;
            scale_min_k4(sub, block + 4, &scale, &min);
            float nibble = float(sub % 2 == 0 ? q & 0xF : q >> 4);
            return mul_rn(mul_rn(load_f16(block), float(scale)), nibble) -
                   mul_rn(load_f16(block + 2), float(min));
        }
        case TYPE_Q5_K: {
            // Q4_K's scales and nibbles, and bit `sub` of qh[j % 32] as the fifth.
            const uint8_t* block = row + (i / QK_K) * 176;
            uint32_t j = i % QK_K, sub = j / QK;
            uint8_t q = block[48 + (j / 64) * 32 + j % 32];
            uint32_t high = (block[16 + j % 32] >> sub) & 1;
            int scale, min;
            scale_min_k4(sub, block + 4, &scale, &min);
            float code = float((sub % 2 == 0 ? q & 0xF : q >> 4) | high << 4);
            return mul_rn(mul_rn(load_f16(block), float(scale)), code) -
                   mul_rn(load_f16(block + 2), float(min));
        }
        case TYPE_Q6_K: {
            const uint8_t* block = row + (i / QK_K) * 210;
            uint32_t j = i % QK_K, half = j / 128, quarter = j % 128 / 32, l = j % 32;
            const uint8_t* ql = block + half * 64 + (quarter % 2) * 32;
            uint32_t low = quarter < 2 ? ql[l] & 0xF : ql[l] >> 4;
            uint32_t high = (block[128 + half * 32 + l] >> (2 * quarter)) & 3;
            int q = int(low | high << 4) - 32;
            float scale = float(int8_t(block[192 + j / 16]));
            return mul_rn(load_f16(block + 208), scale) * float(q);
        }
        default:
            return 0.0f;
    }
}

KERNEL(embed, EmbedArgs) {
    uint32_t token = reinterpret_cast<const uint32_t*>(a.tokens)[blockIdx.x];
    float* out = reinterpret_cast<float*>(a.out) + uint64_t(blockIdx.x) * a.width;
    const uint8_t* row = reinterpret_cast<const uint8_t*>(a.table) + uint64_t(token) * a.row_bytes;
    for (uint32_t i = threadIdx.x; i < a.width; i += blockDim.x) {
        float value = token < a.rows ? dequantize_one(a.type, row, i) : 0.0f;
        out[i] = a.scale == 1.0f ? value : value * a.scale;
    }
}

// Sum of `value` over each half-warp (lanes 0..16 and 16..32), to every lane.
__device__ __forceinline__ int half_warp_sum(int value) {
    for (int mask = 8; mask > 0; mask /= 2) value += __shfl_xor_sync(FULL_MASK, value, mask);
    return value;
}

KERNEL(rms_norm, NormArgs) {
    __shared__ float scratch[32];
    uint32_t r = blockIdx.x;
    uint32_t src = a.gather ? reinterpret_cast<const uint32_t*>(a.gather)[r] : r;
    const float* x = reinterpret_cast<const float*>(a.x) + uint64_t(src) * a.width;
    float* out = reinterpret_cast<float*>(a.out) + uint64_t(r) * a.width;
    const float* gain = reinterpret_cast<const float*>(a.gain);
    float inv = 1.0f;
    if (gain) {
        float squares = 0.0f;
        for (uint32_t i = threadIdx.x; i < a.width; i += blockDim.x) squares += x[i] * x[i];
        float mean_square = block_sum(squares, scratch) / float(a.width);
        inv = 1.0f / sqrtf(mean_square + a.eps);
    }
    // One chunk of the block's width at a time; every thread takes part in
    // every chunk's reductions, in range or not.
    for (uint32_t chunk = 0; chunk < a.width; chunk += blockDim.x) {
        uint32_t i = chunk + threadIdx.x;
        bool in_range = i < a.width;
        float value = in_range ? x[i] : 0.0f;
        if (gain && in_range) value = mul_rn(value, inv) * gain[i];
        if (in_range) out[i] = a.accumulate ? out[i] + value : value;
        if (!a.qs) continue;
        // A Q8 block is a warp (32) or the whole 256-thread block (256).
        float amax = fabsf(value);
        amax = a.block_len == QK ? warp_max(amax) : block_max(amax, scratch);
        float d = amax / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        int q = round_to_int(value * id);
        q = q > 127 ? 127 : (q < -127 ? -127 : q);
        int sum16 = half_warp_sum(q);
        if (!in_range) continue;
        uint64_t row_at = uint64_t(r) * a.width;
        reinterpret_cast<int8_t*>(a.qs)[row_at + i] = int8_t(q);
        if (i % 16 == 0) reinterpret_cast<int32_t*>(a.sums)[row_at / 16 + i / 16] = sum16;
        if (i % a.block_len == 0) {
            reinterpret_cast<float*>(a.d)[row_at / a.block_len + i / a.block_len] = d;
        }
    }
}

// One unit of 32 weights, decoded once for several tokens: the quants as 32
// int8 (packed four to an int), and how a token's integer sums scale.
struct Unit {
    int q[8];
    float scale_lo;  // multiplies the dot of weights 0..16
    float scale_hi;  // multiplies the dot of weights 16..32
    int offset;      // subtracted from every quant (through the activation sums)
    float min;       // multiplies the activations' sum (dx * sum of quants)
    bool per_256;    // the activation scale is per 256 (Q8_K) rather than per 32
};

// Four unsigned nibbles per int: the low (shift 0) or high (shift 4) ones.
__device__ __forceinline__ int nibbles(uint32_t bytes, int shift) {
    return int((bytes >> shift) & 0x0F0F0F0Fu);
}

// The low four bits of `bits` as bit 4 of four bytes (a Q5 block's fifth
// bits for four consecutive weights).
__device__ __forceinline__ int fifth_bits(uint32_t bits) {
    return int((bits & 1) << 4 | (bits & 2) << 11 | (bits & 4) << 18 | (bits & 8) << 25);
}

__device__ __forceinline__ uint32_t load_u32_aligned2(const uint8_t* p) {
    const uint16_t* half = reinterpret_cast<const uint16_t*>(p);
    return uint32_t(half[0]) | uint32_t(half[1]) << 16;
}

// Unit `u` (weights 32u..32u+32) of a row of quantized `type` blocks.
__device__ __forceinline__ Unit decode_unit(uint32_t type, const uint8_t* row, uint32_t u) {
    // Every quant set on every path (a type the kernel does not run is
    // zeros): ptxas then keeps the unit in registers (96 a thread, not 119).
    Unit unit;
    #pragma unroll
    for (int i = 0; i < 8; i++) unit.q[i] = 0;
    unit.offset = 0;
    unit.min = 0.0f;
    unit.per_256 = false;
    switch (type) {
        case TYPE_Q4_0:
        case TYPE_Q4_1:
        case TYPE_Q5_0:
        case TYPE_Q5_1: {
            // d, then m (Q4_1, Q5_1), then 32 fifth bits (Q5_0, Q5_1), then
            // 16 bytes of nibbles: weights 0..16 low, 16..32 high.
            bool has_min = type == TYPE_Q4_1 || type == TYPE_Q5_1;
            bool five = type == TYPE_Q5_0 || type == TYPE_Q5_1;
            uint32_t qh_at = has_min ? 4 : 2, qs_at = qh_at + (five ? 4 : 0);
            const uint8_t* block = row + u * (qs_at + 16);
            uint32_t qh = five ? load_u32_aligned2(block + qh_at) : 0;
            for (int i = 0; i < 4; i++) {
                uint32_t bytes = load_u32_aligned2(block + qs_at + 4 * i);
                unit.q[i] = nibbles(bytes, 0) | fifth_bits(qh >> (4 * i));
                unit.q[i + 4] = nibbles(bytes, 4) | fifth_bits(qh >> (16 + 4 * i));
            }
            unit.scale_lo = unit.scale_hi = load_f16(block);
            if (has_min) {
                unit.min = load_f16(block + 2);
            } else {
                unit.offset = five ? 16 : 8;
            }
            break;
        }
        case TYPE_Q8_0: {
            const uint8_t* block = row + u * 34;
            for (int i = 0; i < 8; i++) unit.q[i] = int(load_u32_aligned2(block + 2 + 4 * i));
            unit.scale_lo = unit.scale_hi = load_f16(block);
            break;
        }
        case TYPE_Q4_K:
        case TYPE_Q5_K: {
            // d, dmin, 12 bytes of 6-bit scales and mins, then (Q5_K) 32
            // bytes of fifth bits, sub-block j's being bit j of each, then
            // the nibbles: sub-blocks 2c and 2c + 1 in the low and high
            // nibbles of 32 bytes.
            bool five = type == TYPE_Q5_K;
            const uint8_t* block = row + (u / 8) * (five ? 176 : 144);
            uint32_t j = u % 8;
            const uint8_t* qs = block + (five ? 48 : 16) + (j / 2) * 32;
            for (int i = 0; i < 8; i++) {
                uint32_t high = five ? (load_u32_aligned2(block + 16 + 4 * i) >> j) & 0x01010101u : 0;
                unit.q[i] = nibbles(load_u32_aligned2(qs + 4 * i), 4 * int(j % 2)) | int(high << 4);
            }
            int scale, min;
            scale_min_k4(j, block + 4, &scale, &min);
            unit.scale_lo = unit.scale_hi = load_f16(block) * float(scale);
            unit.min = -(load_f16(block + 2) * float(min));
            unit.per_256 = true;
            break;
        }
        case TYPE_Q6_K: {
            const uint8_t* block = row + (u / 8) * 210;
            uint32_t j = u % 8, half = j / 4, quarter = j % 4;
            const uint8_t* ql = block + half * 64 + (quarter % 2) * 32;
            const uint8_t* qh = block + 128 + half * 32;
            for (int i = 0; i < 8; i++) {
                uint32_t low = load_u32_aligned2(ql + 4 * i);
                low = quarter < 2 ? low & 0x0F0F0F0Fu : (low >> 4) & 0x0F0F0F0Fu;
                uint32_t high = (load_u32_aligned2(qh + 4 * i) >> (2 * quarter)) & 0x03030303u;
                unit.q[i] = int(low | high << 4);
            }
            float d = load_f16(block + 208);
            unit.scale_lo = d * float(int8_t(block[192 + 2 * j]));
            unit.scale_hi = d * float(int8_t(block[192 + 2 * j + 1]));
            unit.offset = 32;
            unit.per_256 = true;
            break;
        }
        default:
            break;
    }
    return unit;
}

// A block's tokens' Q8 activations (token j of the block at j), in global
// memory (rms_norm's) or in the block's shared memory (its prologue's).
struct Acts {
    const int8_t* qs;
    const float* d;
    const int32_t* sums;
};

// A unit's value for one token from its integer dots with the token's Q8
// quants over weights 0..16 (lo) and 16..32 (hi), the sums of those quants,
// and the token's scale for the unit.
__device__ __forceinline__ float unit_value(float scale_lo, float scale_hi, int offset, float min,
                                            int lo, int hi, int sum_lo, int sum_hi, float dx) {
    lo -= offset * sum_lo;
    hi -= offset * sum_hi;
    float scaled = scale_lo * float(lo) + scale_hi * float(hi);
    return dx * scaled + min * (dx * float(sum_lo + sum_hi));
}

// The unit's dot with the block's token j's Q8 activations.
__device__ __forceinline__ float unit_dot(const Unit& unit, const MatmulArgs& a, const Acts& x,
                                          uint32_t j, uint32_t u) {
    uint64_t at = uint64_t(j) * a.k + uint64_t(u) * QK;
    const Int4* xq = reinterpret_cast<const Int4*>(x.qs + at);
    Int4 x0 = xq[0], x1 = xq[1];
    int lo = 0, hi = 0;
    lo = __dp4a(unit.q[0], x0.x, lo);
    lo = __dp4a(unit.q[1], x0.y, lo);
    lo = __dp4a(unit.q[2], x0.z, lo);
    lo = __dp4a(unit.q[3], x0.w, lo);
    hi = __dp4a(unit.q[4], x1.x, hi);
    hi = __dp4a(unit.q[5], x1.y, hi);
    hi = __dp4a(unit.q[6], x1.z, hi);
    hi = __dp4a(unit.q[7], x1.w, hi);
    const int32_t* sums = x.sums + at / 16;
    uint32_t blocks = unit.per_256 ? a.k / QK_K : a.k / QK;
    float dx = x.d[uint64_t(j) * blocks + (unit.per_256 ? u / 8 : u)];
    return unit_value(unit.scale_lo, unit.scale_hi, unit.offset, unit.min, lo, hi, sums[0], sums[1],
                      dx);
}

// Unit u of an f32, f16 or bf16 row with token t's f32 activations.
__device__ __forceinline__ float float_unit_dot(uint32_t type, const uint8_t* row,
                                                const MatmulArgs& a, uint32_t t, uint32_t u) {
    const float* x = reinterpret_cast<const float*>(a.x) + uint64_t(t) * a.k + u * QK;
    float sum = 0.0f;
    for (uint32_t i = 0; i < QK; i++) {
        uint32_t at = u * QK + i;
        float w = type == TYPE_F32   ? reinterpret_cast<const float*>(row)[at]
                  : type == TYPE_F16 ? f16_to_f32(reinterpret_cast<const uint16_t*>(row)[at])
                                     : bits_to_f32(uint32_t(reinterpret_cast<const uint16_t*>(row)[at]) << 16);
        sum += w * x[i];
    }
    return sum;
}

// Accumulates row `row` of `seg` against tokens t0..t0+n into acc (per lane).
__device__ __forceinline__ void row_products(const MatSeg& seg, uint32_t row, const MatmulArgs& a,
                                             const Acts& x, uint32_t t0, uint32_t n, float* acc) {
    const uint8_t* w = reinterpret_cast<const uint8_t*>(seg.w) + uint64_t(row) * seg.row_bytes;
    uint32_t units = a.k / QK, lane = threadIdx.x % WARP_SIZE;
    bool quantized = seg.type != TYPE_F32 && seg.type != TYPE_F16 && seg.type != TYPE_BF16;
    for (uint32_t u = lane; u < units; u += WARP_SIZE) {
        if (quantized) {
            Unit unit = decode_unit(seg.type, w, u);
            // Unrolled, every loop over a block's tokens: acc[j] at constant
            // indices stays in registers, where a loop's would be local
            // memory (ptxas: a 96-byte stack frame with these loops rolled).
            #pragma unroll
            for (uint32_t j = 0; j < MATMUL_TOKENS; j++) {
                if (j < n) acc[j] += unit_dot(unit, a, x, j, u);
            }
        } else {
            #pragma unroll
            for (uint32_t j = 0; j < MATMUL_TOKENS; j++) {
                if (j < n) acc[j] += float_unit_dot(seg.type, w, a, t0 + j, u);
            }
        }
    }
}

// GELU by its tanh form, as the CPU computes it: x * sigmoid(2z),
// 2z = 2 sqrt(2 / pi) (x + 0.044715 x^3).
__device__ __forceinline__ float gelu_tanh(float x) {
    float two_z = mul_rn(mul_rn(1.595769f, x), 1.0f + mul_rn(mul_rn(0.044715f, x), x));
    return x / (1.0f + expf(-two_z));
}

// The block's prologue (norm_x): tokens t0..t0+n's rows of norm_x, RMS-
// normalised with norm_gain where there is one, quantized into `shared` as
// rms_norm quantizes them. Every sum is rms_norm's, in its order: its 256
// threads' strided partials (two a thread here), each warp's summed, then
// the 8 warps' in order; a Q8 block's largest magnitude and its quants'
// sums are exact whatever the order.
__device__ void quantize_rows(const MatmulArgs& a, uint32_t t0, uint32_t n, unsigned char* shared,
                              Acts* acts) {
    __shared__ float scratch[2 * MATMUL_WARPS];
    uint32_t k = a.k, bl = a.block_len;
    uint32_t lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    int8_t* qs = reinterpret_cast<int8_t*>(shared);
    float* ds = reinterpret_cast<float*>(shared + uint64_t(n) * k);
    int32_t* sums = reinterpret_cast<int32_t*>(shared + uint64_t(n) * k + uint64_t(n) * (k / bl) * 4);
    const float* gain = reinterpret_cast<const float*>(a.norm_gain);
    for (uint32_t j = 0; j < n; j++) {
        uint32_t t = t0 + j;
        uint32_t src = a.norm_gather ? reinterpret_cast<const uint32_t*>(a.norm_gather)[t] : t;
        const float* x = reinterpret_cast<const float*>(a.norm_x) + uint64_t(src) * k;
        float inv = 1.0f;
        if (gain) {
            float lo = 0.0f, hi = 0.0f;
            for (uint32_t i = threadIdx.x; i < k; i += 256) lo += x[i] * x[i];
            for (uint32_t i = threadIdx.x + 128; i < k; i += 256) hi += x[i] * x[i];
            lo = warp_sum(lo);
            hi = warp_sum(hi);
            __syncthreads();  // scratch may still be read for the previous token
            if (lane == 0) {
                scratch[warp] = lo;
                scratch[MATMUL_WARPS + warp] = hi;
            }
            __syncthreads();
            float total = 0.0f;
            for (uint32_t w = 0; w < 2 * MATMUL_WARPS; w++) total += scratch[w];
            inv = 1.0f / sqrtf(total / float(k) + a.eps);
        }
        // rms_norm's chunks of 256, each thread two of its values.
        for (uint32_t chunk = 0; chunk < k; chunk += 256) {
            float value[2];
            for (uint32_t h = 0; h < 2; h++) {
                uint32_t i = chunk + h * 128 + threadIdx.x;
                float v = i < k ? x[i] : 0.0f;
                if (gain && i < k) v = mul_rn(v, inv) * gain[i];
                value[h] = v;
            }
            float block_amax = 0.0f;
            if (bl == QK_K) {
                // One Q8_K block is the chunk: its largest magnitude over both halves.
                float amax = fmaxf(fabsf(value[0]), fabsf(value[1]));
                amax = warp_max(amax);
                __syncthreads();
                if (lane == 0) scratch[warp] = amax;
                __syncthreads();
                block_amax = scratch[0];
                for (uint32_t w = 1; w < MATMUL_WARPS; w++) {
                    block_amax = scratch[w] > block_amax ? scratch[w] : block_amax;
                }
            }
            for (uint32_t h = 0; h < 2; h++) {
                uint32_t i = chunk + h * 128 + threadIdx.x;
                float amax = bl == QK ? warp_max(fabsf(value[h])) : block_amax;
                float d = amax / 127.0f;
                float id = d > 0.0f ? 1.0f / d : 0.0f;
                int q = round_to_int(value[h] * id);
                q = q > 127 ? 127 : (q < -127 ? -127 : q);
                int sum16 = half_warp_sum(q);
                if (i >= k) continue;
                uint64_t row_at = uint64_t(j) * k;
                qs[row_at + i] = int8_t(q);
                if (i % 16 == 0) sums[row_at / 16 + i / 16] = sum16;
                if (i % bl == 0) ds[row_at / bl + i / bl] = d;
            }
        }
    }
    __syncthreads();  // every token's activations made before any is read
    acts->qs = qs;
    acts->d = ds;
    acts->sums = sums;
}

// ROPE_KV's rows of pair `pair` of segment `s` (0 Q, 1 K, 2 V): in Q and
// K, pair i < rope_dim / 2 of a head is the two values RoPE turns together
// (2i and 2i + 1, or i and i + rope_dim / 2 in `halves`); past them, and in
// V, rows 2i and 2i + 1. Returns whether the pair is turned.
__device__ __forceinline__ bool rope_rows(const RopeKvArgs& r, uint32_t s, uint32_t pair,
                                          uint32_t* r0, uint32_t* r1) {
    uint32_t half = r.head_dim / 2, head = pair / half, i = pair % half;
    bool turned = s < 2 && i < r.rope_dim / 2;
    uint32_t base = head * r.head_dim;
    *r0 = base + (turned && r.halves ? i : 2 * i);
    *r1 = base + (turned && r.halves ? i + r.rope_dim / 2 : 2 * i + 1);
    return turned;
}

// ROPE_KV's epilogue, lane 0 of a warp: token t's products of rows r0 and r1
// of segment s (biases added), turned where `turned`, stored where rope_kv
// would leave them.
__device__ void rope_kv_store(const MatmulArgs& a, const MatSeg& seg, uint32_t s, uint32_t t,
                              uint32_t pair, uint32_t r0, uint32_t r1, bool turned, float v0,
                              float v1) {
    const RopeKvArgs& r = a.rope;
    uint32_t seq = reinterpret_cast<const uint32_t*>(r.token_seq)[t];
    uint32_t pos = reinterpret_cast<const uint32_t*>(r.positions)[t];
    if (turned && seq != NO_SEQ) rope_turn(r, pair % (r.head_dim / 2), pos, &v0, &v1);
    float* out = reinterpret_cast<float*>(seg.out) + uint64_t(t) * seg.out_stride;
    out[r0] = v0;
    out[r1] = v1;
    if (s == 0 || seq == NO_SEQ) return;
    store_token_kv(r, seq, pos, s - 1, r0, v0);
    store_token_kv(r, seq, pos, s - 1, r1, v1);
}

// Row `*row` of the launch's rows (a warp's, in pairs where `per` is 2):
// the segment holding it in *s and the row within that segment in *row
// (SWIGLU and GEGLU: a row of the gate, segment 0, and the same row of up).
// False past the last segment's rows.
__device__ __forceinline__ bool find_row(const MatmulArgs& a, bool swiglu, uint32_t per,
                                         uint32_t* row, uint32_t* s) {
    *s = 0;
    if (!swiglu) {
        while (*s + 1 < a.segs && *row >= a.seg[*s].rows / per) {
            *row -= a.seg[*s].rows / per;
            *s += 1;
        }
    }
    return *row < a.seg[*s].rows / per;
}

// Token t's product `value` with row `row` of `seg` (SWIGLU and GEGLU: the
// gate's, and `up` the up row's), finished and stored as the launch's mode
// says.
__device__ __forceinline__ void store_product(const MatmulArgs& a, const MatSeg& seg, uint32_t row,
                                              uint32_t t, float value, float up) {
    if (a.mode == MATMUL_SWIGLU) value = value / (1.0f + expf(-value)) * up;
    if (a.mode == MATMUL_GEGLU) value = gelu_tanh(value) * up;
    if (seg.bias) value += reinterpret_cast<const float*>(seg.bias)[row];
    if (seg.cap > 0.0f) value = soft_cap(value, seg.cap);
    float* dst = reinterpret_cast<float*>(seg.out) + uint64_t(t) * seg.out_stride + row;
    switch (a.mode) {
        case MATMUL_ADD: *dst = *dst + value; break;
        case MATMUL_SILU_MUL: *dst = *dst / (1.0f + expf(-*dst)) * value; break;
        case MATMUL_GELU_MUL: *dst = gelu_tanh(*dst) * value; break;
        default: *dst = value; break;
    }
}

// Block b takes rows (b % row_blocks) * MATMUL_WARPS.., a warp a row, for
// the MATMUL_TOKENS tokens of group b / row_blocks: a step of many tokens
// (a large batch, a prefill chunk) is as many blocks again per group, each
// reading the matrix from L2, rather than each warp taking every token in
// turn. In ROPE_KV a warp's "row" is a pair of rows. Before it waits for the
// kernel before it (a dependent launch), each warp asks for its weight rows'
// lines in L2 (matmul_prefetch, below): they do not depend on that kernel,
// and the activations they multiply do.
KERNEL_PREFETCHING(matmul, MatmulArgs) {
    uint32_t lane = threadIdx.x % WARP_SIZE;
    bool swiglu = a.mode == MATMUL_SWIGLU || a.mode == MATMUL_GEGLU;
    uint32_t per = a.mode == MATMUL_ROPE_KV ? 2 : 1;  // rows a warp takes
    uint32_t rows_total = a.seg[0].rows / per;
    for (uint32_t s = 1; !swiglu && s < a.segs; s++) rows_total += a.seg[s].rows / per;
    uint32_t row_blocks = (rows_total + MATMUL_WARPS - 1) / MATMUL_WARPS;
    uint32_t t0 = blockIdx.x / row_blocks * MATMUL_TOKENS;
    if (t0 >= a.tokens) return;  // the whole block
    uint32_t n = umin32(MATMUL_TOKENS, a.tokens - t0);
    // The block's tokens' activations: made here (every thread of the block
    // takes part, before any warp leaves) or rms_norm's.
    Acts acts;
    if (a.norm_x) {
        DYNAMIC_SHARED(unsigned char, shared);
        quantize_rows(a, t0, n, shared, &acts);
    } else {
        uint32_t blocks = a.k / (a.block_len ? a.block_len : QK);
        acts.qs = reinterpret_cast<const int8_t*>(a.qs) + uint64_t(t0) * a.k;
        acts.d = reinterpret_cast<const float*>(a.d) + uint64_t(t0) * blocks;
        acts.sums = reinterpret_cast<const int32_t*>(a.sums) + uint64_t(t0) * a.k / 16;
    }
    uint32_t row = blockIdx.x % row_blocks * MATMUL_WARPS + threadIdx.x / WARP_SIZE;
    uint32_t s;
    if (!find_row(a, swiglu, per, &row, &s)) return;  // the whole warp: rows are per warp
    const MatSeg& seg = a.seg[s];
    float acc[MATMUL_TOKENS], up[MATMUL_TOKENS];
    #pragma unroll
    for (uint32_t j = 0; j < MATMUL_TOKENS; j++) acc[j] = up[j] = 0.0f;
    if (per == 2) {
        uint32_t r0, r1;
        bool turned = rope_rows(a.rope, s, row, &r0, &r1);
        row_products(seg, r0, a, acts, t0, n, acc);
        row_products(seg, r1, a, acts, t0, n, up);
        const float* bias = reinterpret_cast<const float*>(seg.bias);
        #pragma unroll
        for (uint32_t j = 0; j < MATMUL_TOKENS; j++) {
            if (j >= n) break;
            float v0 = warp_sum(acc[j]), v1 = warp_sum(up[j]);
            if (lane != 0) continue;
            if (bias) {
                v0 += bias[r0];
                v1 += bias[r1];
            }
            rope_kv_store(a, seg, s, t0 + j, row, r0, r1, turned, v0, v1);
        }
        return;
    }
    row_products(seg, row, a, acts, t0, n, acc);
    if (swiglu) row_products(a.seg[1], row, a, acts, t0, n, up);
    #pragma unroll
    for (uint32_t j = 0; j < MATMUL_TOKENS; j++) {
        if (j >= n) break;
        float value = warp_sum(acc[j]);
        float u = swiglu ? warp_sum(up[j]) : 0.0f;
        if (lane == 0) store_product(a, seg, row, t0 + j, value, u);
    }
}

// The lines of `bytes` bytes of weights from `w`, a warp's lanes a line
// each in turn (the first line from `w` itself, within its allocation).
__device__ __forceinline__ void prefetch_row(const uint8_t* w, uint64_t bytes, uint32_t lane) {
    uint64_t base = reinterpret_cast<uint64_t>(w), end = base + bytes;
    for (uint64_t line = (base & ~uint64_t(127)) + 128 * lane; line < end; line += 128 * WARP_SIZE) {
        prefetch_l2(reinterpret_cast<const void*>(line < base ? base : line));
    }
}

// matmul's weight rows for this warp, as the kernel finds them (its
// parameters alone), asked for in L2 before the kernel waits.
__device__ __forceinline__ void matmul_prefetch(const MatmulArgs a) {
    uint32_t lane = threadIdx.x % WARP_SIZE;
    bool swiglu = a.mode == MATMUL_SWIGLU || a.mode == MATMUL_GEGLU;
    uint32_t per = a.mode == MATMUL_ROPE_KV ? 2 : 1;
    uint32_t rows_total = a.seg[0].rows / per;
    for (uint32_t s = 1; !swiglu && s < a.segs; s++) rows_total += a.seg[s].rows / per;
    uint32_t row_blocks = (rows_total + MATMUL_WARPS - 1) / MATMUL_WARPS;
    if (blockIdx.x / row_blocks * MATMUL_TOKENS >= a.tokens) return;
    uint32_t row = blockIdx.x % row_blocks * MATMUL_WARPS + threadIdx.x / WARP_SIZE;
    uint32_t s;
    if (!find_row(a, swiglu, per, &row, &s)) return;
    const MatSeg& seg = a.seg[s];
    const uint8_t* w = reinterpret_cast<const uint8_t*>(seg.w);
    if (per == 2) {
        uint32_t r0, r1;
        rope_rows(a.rope, s, row, &r0, &r1);
        prefetch_row(w + uint64_t(r0) * seg.row_bytes, seg.row_bytes, lane);
        prefetch_row(w + uint64_t(r1) * seg.row_bytes, seg.row_bytes, lane);
        return;
    }
    prefetch_row(w + uint64_t(row) * seg.row_bytes, seg.row_bytes, lane);
    if (swiglu) {
        const MatSeg& up = a.seg[1];
        prefetch_row(reinterpret_cast<const uint8_t*>(up.w) + uint64_t(row) * up.row_bytes,
                     up.row_bytes, lane);
    }
}

// Tokens a matmul_mma block takes: four of the tensor cores' 8-column tiles.
#define MMA_TOKENS 32u
// Rows a warp of matmul_mma takes: the tensor cores' 16-row tile.
#define MMA_ROWS 16u
// Words between two rows' quants in a warp's decoded units: at 12 the eight
// rows a fragment load reads, four lanes a row, fall in 32 different banks.
#define MMA_PITCH 12u

// The products of a step of more than MATMUL_TOKENS tokens (a large batch, a
// prefill chunk) on the tensor cores: quantized weights, rms_norm's Q8
// activations, every mode but ROPE_KV (never launched in that mode).
// Block b takes rows (b % row_blocks) * 64.., 16 a warp, for the 32 tokens
// of group b / row_blocks. Each round a warp decodes two units of its 16
// rows into shared memory (lanes 0..16 unit u, lanes 16..32 unit u + 1, a
// row a lane); for each unit and 8-token tile the tensor cores take the
// integer dots (one k32 product, or two k16 in a warp with a row that scales
// its halves apart, Q6_K's), and each lane scales its four as matmul does.
// The units' sums run in order, one accumulator an element: the same value
// as matmul's up to the order of f32 sums.
KERNEL(matmul_mma, MatmulArgs) {
    __shared__ int mma_q[MATMUL_WARPS][2][MMA_ROWS * MMA_PITCH];
    // A row's scale_lo, scale_hi, min and offset, for each of the round's two units.
    __shared__ Float4 mma_scale[MATMUL_WARPS][2][MMA_ROWS];
    uint32_t lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    bool swiglu = a.mode == MATMUL_SWIGLU || a.mode == MATMUL_GEGLU;
    uint32_t rows_total = a.seg[0].rows;
    for (uint32_t s = 1; !swiglu && s < a.segs; s++) rows_total += a.seg[s].rows;
    uint32_t row_blocks = (rows_total + MATMUL_WARPS * MMA_ROWS - 1) / (MATMUL_WARPS * MMA_ROWS);
    uint32_t t0 = blockIdx.x / row_blocks * MMA_TOKENS;
    uint32_t row0 = (blockIdx.x % row_blocks * MATMUL_WARPS + warp) * MMA_ROWS;
    if (t0 >= a.tokens || row0 >= rows_total) return;  // the whole warp
    uint32_t g = lane / 4, i = lane % 4;
    uint32_t units = a.k / QK, sets = swiglu ? 2 : 1, blocks = a.k / a.block_len;
    const int8_t* qs = reinterpret_cast<const int8_t*>(a.qs);
    const float* ds = reinterpret_cast<const float*>(a.d);
    const int32_t* sums = reinterpret_cast<const int32_t*>(a.sums);
    // This lane's row to decode, and whether the warp takes the k16 way.
    uint32_t my_row = row0 + lane % MMA_ROWS, my_seg;
    bool my_in = find_row(a, swiglu, 1, &my_row, &my_seg);
    int split = 0;
    for (uint32_t set = 0; set < sets; set++) {
        split |= my_in && a.seg[swiglu ? set : my_seg].type == TYPE_Q6_K;
    }
    split = warp_sum_int(split);
    float acc[2][MMA_TOKENS / 8][4];
    #pragma unroll
    for (uint32_t set = 0; set < 2; set++) {
        #pragma unroll
        for (uint32_t j = 0; j < MMA_TOKENS / 8; j++) {
            #pragma unroll
            for (uint32_t e = 0; e < 4; e++) acc[set][j][e] = 0.0f;
        }
    }
    for (uint32_t u0 = 0; u0 < units; u0 += 2) {
        #pragma unroll
        for (uint32_t set = 0; set < 2; set++) {
            if (set >= sets) break;
            {
                uint32_t h = lane / MMA_ROWS, r = lane % MMA_ROWS, u = u0 + h;
                bool in = my_in && u < units;
                const MatSeg& seg = a.seg[swiglu ? set : my_seg];
                Unit unit;
                if (in) {
                    const uint8_t* w = reinterpret_cast<const uint8_t*>(seg.w);
                    unit = decode_unit(seg.type, w + uint64_t(my_row) * seg.row_bytes, u);
                }
                int* q = &mma_q[warp][h][r * MMA_PITCH];
                #pragma unroll
                for (uint32_t k = 0; k < 8; k++) q[k] = in ? unit.q[k] : 0;
                Float4 sc = {0.0f, 0.0f, 0.0f, 0.0f};
                if (in) sc = {unit.scale_lo, unit.scale_hi, unit.min, float(unit.offset)};
                mma_scale[warp][h][r] = sc;
            }
            __syncwarp();
            for (uint32_t h = 0; h < 2 && u0 + h < units; h++) {
                uint32_t u = u0 + h;
                const int* q = mma_q[warp][h];
                uint32_t frag[4] = {uint32_t(q[g * MMA_PITCH + i]), uint32_t(q[(g + 8) * MMA_PITCH + i]),
                                    uint32_t(q[g * MMA_PITCH + 4 + i]),
                                    uint32_t(q[(g + 8) * MMA_PITCH + 4 + i])};
                #pragma unroll
                for (uint32_t j = 0; j < MMA_TOKENS / 8; j++) {
                    uint32_t tile = t0 + 8 * j;
                    if (tile >= a.tokens) break;
                    // B's column g: token tile + g's quants of the unit.
                    uint32_t b[2] = {0, 0};
                    if (tile + g < a.tokens) {
                        const int8_t* x = qs + uint64_t(tile + g) * a.k + u * QK + 4 * i;
                        b[0] = *reinterpret_cast<const uint32_t*>(x);
                        b[1] = *reinterpret_cast<const uint32_t*>(x + 16);
                    }
                    int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
                    // mma.sync.aligned: every lane, converged after the loads' branch.
                    __syncwarp();
                    if (split) {
                        uint32_t frag_hi[2] = {frag[2], frag[3]};
                        mma_s8_k16(lo, frag, b[0]);
                        mma_s8_k16(hi, frag_hi, b[1]);
                    } else {
                        mma_s8_k32(lo, frag, b);
                    }
                    // This lane's two tokens (D's columns 2i, 2i + 1): their
                    // sums of the unit's halves and their scale, each read
                    // once for both of its rows.
                    Int2 half_sums[2] = {{0, 0}, {0, 0}};
                    float dx[2] = {0.0f, 0.0f};
                    #pragma unroll
                    for (uint32_t c = 0; c < 2; c++) {
                        uint32_t t = tile + 2 * i + c;
                        if (t >= a.tokens) continue;
                        uint64_t at = uint64_t(t) * (a.k / 16) + 2 * u;
                        half_sums[c] = *reinterpret_cast<const Int2*>(sums + at);
                        dx[c] = ds[uint64_t(t) * blocks + u * QK / a.block_len];
                    }
                    #pragma unroll
                    for (uint32_t e = 0; e < 4; e++) {
                        if (tile + 2 * i + e % 2 >= a.tokens) continue;
                        // The row's scale_lo, scale_hi, min and offset.
                        Float4 sc = mma_scale[warp][h][g + 8 * (e / 2)];
                        Int2 hs = half_sums[e % 2];
                        float x = dx[e % 2], value;
                        int offset = int(sc.w);
                        if (split) {
                            value = unit_value(sc.x, sc.y, offset, sc.z, lo[e], hi[e], hs.x, hs.y, x);
                        } else {
                            int sum = hs.x + hs.y;
                            value = x * (sc.x * float(lo[e] - offset * sum)) + sc.z * (x * float(sum));
                        }
                        acc[set][j][e] += value;
                    }
                }
            }
            __syncwarp();  // every lane's fragments read before the next decode
        }
    }
    #pragma unroll
    for (uint32_t j = 0; j < MMA_TOKENS / 8; j++) {
        #pragma unroll
        for (uint32_t e = 0; e < 4; e++) {
            uint32_t row = row0 + g + 8 * (e / 2), t = t0 + 8 * j + 2 * i + e % 2, s;
            if (t < a.tokens && find_row(a, swiglu, 1, &row, &s)) {
                store_product(a, a.seg[s], row, t, acc[0][j][e], acc[1][j][e]);
            }
        }
    }
}
