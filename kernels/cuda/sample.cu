// A sampled row's token, picked on the device: the largest logit's id for a
// greedy row, and for a drawn one the draw of kernels/src/backend/draw.rs
// (temperature, top-k, min-p, top-p, then one uniform number walked over the
// kept tokens in id order), either after the row's adjustments (penalties,
// biases, bans: kernels/src/backend/adjust.rs). A step then copies 4 bytes a
// sampled row where it would copy the vocabulary's logits (196,608 bytes for
// SmolLM2's).
//
// One block a row. A draw finds what it keeps by bisection over the logits'
// order: each of 32 rounds counts (top-k) or weighs (top-p) the tokens at or
// above a candidate key in one pass over the row and a block reduction, so a
// selection costs passes over the row, never a sort of it; a pass finds a
// token's weight (its exp) only where it adds it. Temperature alone is 3
// passes over the row; top-p adds 35, top-k 34, min-p 1. Weights are summed
// in fixed point (units of 2^-40 of the likeliest's), so every sum is exact
// and the same whatever the order of its terms: a seed gives the same token
// on every run, the one the host draws from the same row (its weights are
// the same bits, exp_rn, and its sums the same integers).

#include "common.cuh"
#include "args.cuh"

// Threads of a pick block (the launch's block size; the scans' arrays).
#define PICK_BLOCK 1024u
// A weight of 1 in fixed point.
#define FIXED_ONE 1099511627776.0f

// Whether (value, id) beats (best, best_id) in argmax's order: a value
// (never a NaN: those are not candidates) beats none, a larger value a
// smaller, and of equal values the lower id.
__device__ __forceinline__ bool beats(float value, uint32_t id, float best, uint32_t best_id) {
    if (id == NO_SEQ) return false;
    if (best_id == NO_SEQ) return true;
    return value > best || (value == best && id < best_id);
}

// The largest and lowest-id (value, id) of the warp's lanes', to every lane.
__device__ __forceinline__ void warp_argmax(float* value, uint32_t* id) {
    for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) {
        float other = __shfl_xor_sync(FULL_MASK, *value, mask);
        uint32_t other_id = __shfl_xor_sync(FULL_MASK, *id, mask);
        if (beats(other, other_id, *value, *id)) {
            *value = other;
            *id = other_id;
        }
    }
}

// The id of the row's largest logit, the lowest among ties, to every thread:
// the CPU's argmax (a NaN is never larger; a NaN at index 0 is never exceeded).
__device__ uint32_t row_argmax(const float* row, uint32_t vocab) {
    __shared__ float values[32];
    __shared__ uint32_t ids[32];
    // Each thread's positions in order: a later value replaces only a larger.
    float best = 0.0f;
    uint32_t best_id = NO_SEQ;
    for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
        float value = row[i];
        bool number = value == value;
        if (number && beats(value, i, best, best_id)) {
            best = value;
            best_id = i;
        }
    }
    warp_argmax(&best, &best_id);
    uint32_t warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    __syncthreads();  // values and ids may still be read by a previous call
    if (lane == 0) {
        values[warp] = best;
        ids[warp] = best_id;
    }
    __syncthreads();
    uint32_t warps = blockDim.x / WARP_SIZE;
    best = lane < warps ? values[lane] : 0.0f;
    best_id = lane < warps ? ids[lane] : NO_SEQ;
    warp_argmax(&best, &best_id);
    bool first_nan = !(row[0] == row[0]);
    return first_nan || best_id == NO_SEQ ? 0 : best_id;
}

// The bits of an f32, and the f32 of bits.
__device__ __forceinline__ uint32_t f32_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return bits;
}

__device__ __forceinline__ float f32_of_bits(uint32_t bits) {
    float x;
    memcpy(&x, &bits, 4);
    return x;
}

// e^x for x in [-87, 88], in single operations each rounded once and none
// fused, so that the host's `exp_rn` (kernels/src/backend/draw.rs) gives
// the same bits (CUDA's expf is within 2 ulp of e^x, not the host's): x =
// n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts, the first exact
// times any n), e^r by Taylor's polynomial to r^7 (within 1.2 ulp of e^x
// over the range), times 2^n. The constants are given by their bits.
__device__ __forceinline__ float exp_rn(float x) {
    // x log2(e) to the nearest integer (ties to even): 1.5 * 2^23 added and
    // taken away, as the host does (the integer is also the sum's low bits).
    float shifted = add_rn(mul_rn(x, f32_of_bits(0x3fb8aa3bu)), 12582912.0f);
    float n = add_rn(shifted, -12582912.0f);
    float r = add_rn(x, -mul_rn(n, f32_of_bits(0x3f317200u)));  // ln 2, high part
    r = add_rn(r, -mul_rn(n, f32_of_bits(0x35bfbe8eu)));  // ln 2, low part
    const uint32_t taylor[8] = {0x39500d01u, 0x3ab60b61u, 0x3c088889u, 0x3d2aaaabu,
                                0x3e2aaaabu, 0x3f000000u, 0x3f800000u, 0x3f800000u};
    float p = f32_of_bits(taylor[0]);  // 1/7!
    for (int k = 1; k < 8; k++) p = add_rn(mul_rn(p, r), f32_of_bits(taylor[k]));
    return mul_rn(p, f32_of_bits((f32_bits(shifted) - 0x4b400000u + 127u) << 23));
}

// Floats as keys that order as the floats do (-0 below +0, as total_cmp).
__device__ __forceinline__ uint32_t ordered(float x) {
    uint32_t bits = f32_bits(x);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Whether key (o, i) is at or above (t, id) in likelihood: a larger value,
// or the same value and an id no higher.
__device__ __forceinline__ bool at_least(uint32_t o, uint32_t i, uint32_t t, uint32_t id) {
    return o > t || (o == t && i <= id);
}

// Sums of two values over the block, to every thread, in a fixed order.
__device__ __forceinline__ void block_sum2(uint64_t* a, uint64_t* b, uint64_t* scratch) {
    for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) {
        *a += __shfl_xor_sync(FULL_MASK, *a, mask);
        *b += __shfl_xor_sync(FULL_MASK, *b, mask);
    }
    uint32_t warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    uint32_t warps = blockDim.x / WARP_SIZE;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) {
        scratch[warp] = *a;
        scratch[32 + warp] = *b;
    }
    __syncthreads();
    *a = 0;
    *b = 0;
    for (uint32_t w = 0; w < warps; w++) {
        *a += scratch[w];
        *b += scratch[32 + w];
    }
}

// A row under a draw, and the bounds of what it keeps so far.
struct DrawRow {
    const float* row;
    uint32_t vocab;
    float inv_t;
    float max;  // the largest logit over the temperature
    // Top-k keeps keys at or above (k_key, k_id); min-p keys at or above
    // m_key; the nucleus keys at or above (p_key, p_id). (0, NO_SEQ) and 0
    // keep every token.
    uint32_t k_key, k_id, m_key, p_key, p_id;
};

// Token i's logit over the temperature, as the host computes it (one
// rounding).
__device__ __forceinline__ float x_at(const DrawRow& r, uint32_t i) { return mul_rn(r.row[i], r.inv_t); }

// A token's weight, e^(x - max) (0 below e^-87) as the host computes it.
__device__ __forceinline__ float weight_of(const DrawRow& r, float x) {
    float d = x - r.max;
    return d < -87.0f ? 0.0f : exp_rn(d);
}

// That weight in fixed point.
__device__ __forceinline__ uint64_t fixed(float w) { return uint64_t(w * FIXED_ONE); }

// Which tokens a selection is over.
#define OVER_ALL 0u   // every token (top-k's)
#define OVER_BASE 1u  // those top-k and min-p keep (the nucleus's)
#define OVER_KEPT 2u  // those every filter keeps (the walk's)

// Whether token i (key `key`) is in `set`: compares of keys alone, so a
// pass finds a token's weight only where it counts it.
__device__ __forceinline__ bool over(const DrawRow& r, uint32_t set, uint32_t key, uint32_t i) {
    if (set == OVER_ALL) return true;
    bool base = at_least(key, i, r.k_key, r.k_id) && key >= r.m_key;
    return base && (set == OVER_BASE || at_least(key, i, r.p_key, r.p_id));
}

// The largest key t such that the tokens of `set` with a key at or above t
// number at least `count` and, where `weigh`, weigh at least `weight`. Both
// only fall as t rises, and t = 0 holds every token, so 32 halvings find it.
__device__ uint32_t bisect(const DrawRow& r, uint32_t set, uint64_t count, bool weigh,
                           uint64_t weight, uint64_t* scratch) {
    uint32_t t = 0;
    for (int bit = 31; bit >= 0; bit--) {
        uint32_t candidate = t | (1u << bit);
        uint64_t n = 0, w = 0;
        for (uint32_t i = threadIdx.x; i < r.vocab; i += blockDim.x) {
            float x = x_at(r, i);
            uint32_t key = ordered(x);
            if (key >= candidate && over(r, set, key, i)) {
                n++;
                if (weigh) w += fixed(weight_of(r, x));
            }
        }
        block_sum2(&n, &w, scratch);
        if (n >= count && w >= weight) t = candidate;
    }
    return t;
}

// The count and weight of the tokens of `set` whose key is above `t`.
__device__ void above(const DrawRow& r, uint32_t set, uint32_t t, uint64_t* n, uint64_t* w,
                      uint64_t* scratch) {
    *n = 0;
    *w = 0;
    for (uint32_t i = threadIdx.x; i < r.vocab; i += blockDim.x) {
        float x = x_at(r, i);
        uint32_t key = ordered(x);
        if (key > t && over(r, set, key, i)) {
            *n += 1;
            *w += fixed(weight_of(r, x));
        }
    }
    block_sum2(n, w, scratch);
}

// In id order, the first token of `set` (only those with key `key`, where
// `key_only`) at which the running count reaches `count` and the running
// weight `weight`; the last of them where none does; NO_SEQ where there are
// none. Each thread takes a contiguous run of ids; warp 0 finds the run
// that holds it, whose thread walks it.
__device__ uint32_t nth_in_id_order(const DrawRow& r, uint32_t set, bool key_only, uint32_t key,
                                    uint64_t count, uint64_t weight) {
    __shared__ uint64_t counts[PICK_BLOCK];
    __shared__ uint64_t weights[PICK_BLOCK];
    __shared__ uint64_t before[2];
    __shared__ uint32_t found[2];
    uint32_t run = (r.vocab + blockDim.x - 1) / blockDim.x;
    uint32_t begin = umin32(threadIdx.x * run, r.vocab), end = umin32(begin + run, r.vocab);
    uint64_t n = 0, w = 0;
    for (uint32_t i = begin; i < end; i++) {
        float x = x_at(r, i);
        uint32_t k = ordered(x);
        if ((!key_only || k == key) && over(r, set, k, i)) {
            n++;
            w += fixed(weight_of(r, x));
        }
    }
    __syncthreads();  // the arrays may still be read by a previous call
    counts[threadIdx.x] = n;
    weights[threadIdx.x] = w;
    __syncthreads();
    if (threadIdx.x < WARP_SIZE) {
        // Warp 0 finds the run: each lane sums `per` threads' counts, learns
        // the lanes' before it by shuffles, and the first lane whose sums
        // reach both (or, where none does, the last with any) walks its
        // threads'. count is at least 1, so a lane that reaches holds some.
        uint32_t lane = threadIdx.x, per = blockDim.x / WARP_SIZE;
        uint64_t ln = 0, lw = 0;
        for (uint32_t t = lane * per; t < (lane + 1) * per; t++) {
            ln += counts[t];
            lw += weights[t];
        }
        uint64_t pn = 0, pw = 0;
        for (uint32_t src = 0; src < WARP_SIZE; src++) {
            uint64_t n = __shfl_sync(FULL_MASK, ln, src), w = __shfl_sync(FULL_MASK, lw, src);
            if (src < lane) {
                pn += n;
                pw += w;
            }
        }
        bool reaches = pn + ln >= count && pw + lw >= weight;
        uint32_t first = reaches ? lane : WARP_SIZE, last = ln > 0 ? lane : 0;
        bool any = ln > 0;
        for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) {
            first = umin32(first, __shfl_xor_sync(FULL_MASK, first, mask));
            last = umax32(last, __shfl_xor_sync(FULL_MASK, last, mask));
            any = __shfl_xor_sync(FULL_MASK, any ? 1u : 0u, mask) != 0 || any;
        }
        uint32_t chosen = first < WARP_SIZE ? first : (any ? last : WARP_SIZE);
        if (lane == 0) found[0] = NO_SEQ;
        __syncwarp();
        if (lane == chosen) {
            uint64_t cn = pn, cw = pw, last_n = 0, last_w = 0;
            uint32_t at = NO_SEQ;
            for (uint32_t t = lane * per; t < (lane + 1) * per; t++) {
                if (counts[t] == 0) continue;
                at = t;
                last_n = cn;
                last_w = cw;
                if (cn + counts[t] >= count && cw + weights[t] >= weight) break;
                cn += counts[t];
                cw += weights[t];
            }
            found[0] = at;
            before[0] = last_n;
            before[1] = last_w;
        }
        if (lane == 0) found[1] = NO_SEQ;
    }
    __syncthreads();
    if (threadIdx.x == found[0]) {
        uint64_t cn = before[0], cw = before[1];
        uint32_t id = NO_SEQ;
        for (uint32_t i = begin; i < end; i++) {
            float x = x_at(r, i);
            uint32_t k = ordered(x);
            if ((key_only && k != key) || !over(r, set, k, i)) continue;
            cn++;
            cw += fixed(weight_of(r, x));
            id = i;
            if (cn >= count && cw >= weight) break;
        }
        found[1] = id;
    }
    __syncthreads();
    return found[1];
}

// The smallest of every thread's `value`, to every thread.
__device__ __forceinline__ uint32_t block_min(uint32_t value, uint64_t* scratch) {
    for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) {
        value = umin32(value, __shfl_xor_sync(FULL_MASK, value, mask));
    }
    uint32_t warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = value;
    __syncthreads();
    for (uint32_t w = 0; w < blockDim.x / WARP_SIZE; w++) value = umin32(value, uint32_t(scratch[w]));
    return value;
}

// The token a draw picks from `row`, or NO_SEQ where the row draws nothing
// (a NaN, an infinite largest value, no weight kept): its argmax then.
__device__ uint32_t draw_row(const float* row, uint32_t vocab, const DrawParams& p) {
    __shared__ uint64_t scratch[64];
    __shared__ float floats[32];
    DrawRow r;
    r.row = row;
    r.vocab = vocab;
    r.inv_t = p.inv_t;
    r.k_key = r.p_key = r.m_key = 0;
    r.k_id = r.p_id = NO_SEQ;
    const float infinity = f32_of_bits(0x7f800000u);
    float best = -infinity;
    uint64_t nans = 0, unused = 0;
    for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
        float x = x_at(r, i);
        if (x != x) {
            nans++;
        } else {
            best = fmaxf(best, x);
        }
    }
    block_sum2(&nans, &unused, scratch);
    r.max = block_max(best, floats);
    if (nans > 0 || r.max == infinity || r.max == -infinity) return NO_SEQ;
    // Min-p as a key: the weight only rises with the key, so the tokens
    // weighing at least min_p are those at or above the least key of them
    // (the largest weighs 1, so there is one).
    if (p.min_p > 0.0f) {
        uint32_t least = 0xFFFFFFFFu;
        for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
            float x = x_at(r, i);
            if (weight_of(r, x) >= p.min_p) least = umin32(least, ordered(x));
        }
        r.m_key = block_min(least, scratch);
    }
    // Top-k: the k-th likeliest key over every token (ties to the lower id).
    if (p.top_k > 0 && p.top_k < vocab) {
        uint32_t t = bisect(r, OVER_ALL, p.top_k, false, 0, scratch);
        uint64_t n, w;
        above(r, OVER_ALL, t, &n, &w, scratch);
        r.k_key = t;
        r.k_id = nth_in_id_order(r, OVER_ALL, true, t, p.top_k - n, 0);
    }
    // The nucleus of what top-k and min-p keep: the shortest likeliest run
    // reaching top_p of their weight (at least one token).
    if (p.top_p < 1.0f) {
        uint64_t n, total;
        // A key of 0 is a NaN's, and there is none: `above` 0 is every token.
        above(r, OVER_BASE, 0, &n, &total, scratch);
        uint64_t target = uint64_t(ceil(double(fmaxf(p.top_p, 0.0f)) * double(total)));
        uint32_t t = bisect(r, OVER_BASE, 1, true, target, scratch);
        uint64_t w;
        above(r, OVER_BASE, t, &n, &w, scratch);
        r.p_key = t;
        r.p_id = nth_in_id_order(r, OVER_BASE, true, t, 1, target > w ? target - w : 0);
    }
    uint64_t n, kept;
    above(r, OVER_KEPT, 0, &n, &kept, scratch);
    if (n == 0 || kept == 0) return NO_SEQ;
    uint64_t target = uint64_t(ceil(p.u * double(kept)));
    return nth_in_id_order(r, OVER_KEPT, false, 0, 1, target);
}

// Words of a row's log probabilities (PickArgs.scores): the token's, the
// count of alternatives, then (id, log probability) each.
#define SCORE_WORDS (2u + 2u * TOP_LOGPROBS_MAX)
#define TOP_LOGPROBS_MAX 20u

// The sum of every thread's `value`, to every thread (blockDim.x a power
// of two, at most PICK_BLOCK).
__device__ double block_sum_f64(double value) {
    __shared__ double partial[PICK_BLOCK];
    partial[threadIdx.x] = value;
    __syncthreads();
    for (uint32_t half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
        __syncthreads();
    }
    double total = partial[0];
    __syncthreads();  // partial may be written again by the next call
    return total;
}

// The largest of every thread's `value`, to every thread.
__device__ uint64_t block_max_u64(uint64_t value) {
    __shared__ uint64_t partial[PICK_BLOCK];
    partial[threadIdx.x] = value;
    __syncthreads();
    for (uint32_t half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half && partial[threadIdx.x + half] > partial[threadIdx.x]) {
            partial[threadIdx.x] = partial[threadIdx.x + half];
        }
        __syncthreads();
    }
    uint64_t best = partial[0];
    __syncthreads();
    return best;
}

// x's place in f32's total order (Rust's total_cmp): a larger key, later.
__device__ __forceinline__ uint32_t total_key(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return (b >> 31) ? ~b : (b | 0x80000000u);
}

// The row's log probabilities as backend::Logprobs::of finds them: the
// log of the sum of e^(x - max) (0 below e^-87; the largest number the
// largest, a NaN counted as the host counts it), and the likeliest `top`
// by total order, ties to the lower id, each found by one pass over the
// row for the best (key, id) after the one before. Writes all but the
// token's own log probability (words 1..) and returns log Z.
__device__ float score_row(const float* row, uint32_t vocab, uint32_t top, uint32_t* out) {
    __shared__ float floats[32];
    float best = -f32_of_bits(0x7f800000u);
    for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) best = fmaxf(best, row[i]);
    best = block_max(best, floats);
    double sum = 0.0;
    for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
        float x = row[i] - best;
        sum += x < -87.0f ? 0.0 : double(expf(x));
    }
    sum = block_sum_f64(sum);
    float log_z = best + float(log(sum));
    top = umin32(umin32(top, vocab), TOP_LOGPROBS_MAX);
    // (key << 32 | ~id): the largest is the likeliest, the lower id of a
    // tie; 0 is none (no id is 2^32 - 1).
    uint64_t previous = ~0ull;
    for (uint32_t n = 0; n < top; n++) {
        uint64_t mine = 0;
        for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
            uint64_t packed = uint64_t(total_key(row[i])) << 32 | uint64_t(~i);
            if (packed < previous && packed > mine) mine = packed;
        }
        previous = block_max_u64(mine);
        if (threadIdx.x == 0) {
            uint32_t id = ~uint32_t(previous);
            float logprob = row[id] - log_z;
            out[2 + 2 * n] = id;
            memcpy(&out[3 + 2 * n], &logprob, 4);
        }
    }
    if (threadIdx.x == 0) out[1] = top;
    return log_z;
}

// `logit` adjusted by `e`, as Adjust::apply adjusts it: each operation
// rounded alone (never fused), and only where it changes something.
__device__ __forceinline__ float adjusted(const AdjustEntry& e, float logit) {
    if (e.id >> 31) return -f32_of_bits(0x7f800000u);
    float x = logit;
    if (e.repetition != 1.0f) x = x > 0.0f ? div_rn(x, e.repetition) : mul_rn(x, e.repetition);
    if (e.penalty != 0.0f) x = x - e.penalty;
    if (e.bias != 0.0f) x = x + e.bias;
    return x;
}

// The index of `id` among `n` ascending ids a `stride` words apart, or n.
__device__ __forceinline__ uint32_t find_id(const uint32_t* ids, uint32_t stride, uint32_t n,
                                            uint32_t id) {
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        uint32_t at = ids[uint64_t(mid) * stride] & 0x7FFFFFFFu;
        if (at == id) return mid;
        if (at < id) lo = mid + 1; else hi = mid;
    }
    return n;
}

KERNEL_THREADS(pick, PickArgs, PICK_BLOCK) {
    float* row = reinterpret_cast<float*>(a.logits) + uint64_t(blockIdx.x) * a.vocab;
    DrawParams p;
    p.inv_t = 0.0f;
    p.adjust_count = 0;
    p.shared_count = 0;
    p.top_logprobs = 0;
    p.target = 0;
    if (a.draws) p = reinterpret_cast<const DrawParams*>(a.draws)[blockIdx.x];
    // The row's own log probabilities, before any adjustment.
    uint32_t* scores = reinterpret_cast<uint32_t*>(a.scores) + uint64_t(blockIdx.x) * SCORE_WORDS;
    float log_z = 0.0f;
    if (p.top_logprobs > 0) log_z = score_row(row, a.vocab, p.top_logprobs - 1, scores);
    if (p.target > 0) {
        // A prompt's row, scored for the token after its position (checked
        // against the vocabulary before the step): that token is its "pick".
        uint32_t id = p.target - 1;
        if (threadIdx.x == 0) {
            reinterpret_cast<uint32_t*>(a.out)[blockIdx.x] = id;
            float logprob = id < a.vocab ? row[id] - log_z : f32_of_bits(0x7fc00000u);
            memcpy(&scores[0], &logprob, 4);
        }
        return;
    }
    const AdjustEntry* list = reinterpret_cast<const AdjustEntry*>(a.adjusts) + p.adjust_at;
    const uint32_t* shared_ids = reinterpret_cast<const uint32_t*>(list + p.adjust_count + 1);
    float* originals = reinterpret_cast<float*>(a.originals) + 4ull * p.adjust_at;
    uint32_t adjusts = p.adjust_count + p.shared_count;
    if (adjusts > 0) {
        // Not before thread 0 has read the last alternative's logit.
        if (p.top_logprobs > 0) __syncthreads();
        // In place: a picked row's logits are scratch no one reads after,
        // and its entries and shared ids name distinct tokens (the packer
        // sends no other list), so no two threads write one logit. Where
        // the row's log probabilities are asked, each logit is kept as it
        // was first.
        for (uint32_t i = threadIdx.x; i < adjusts; i += blockDim.x) {
            AdjustEntry e;
            if (i < p.adjust_count) {
                e = list[i];
            } else {
                e = list[p.adjust_count];
                e.id |= shared_ids[i - p.adjust_count];
            }
            uint32_t id = e.id & 0x7FFFFFFFu;
            if (id >= a.vocab) continue;
            if (p.top_logprobs > 0) originals[i] = row[id];
            row[id] = adjusted(e, row[id]);
        }
        __syncthreads();
    }
    uint32_t id = p.inv_t > 0.0f ? draw_row(row, a.vocab, p) : NO_SEQ;
    if (id == NO_SEQ) id = row_argmax(row, a.vocab);
    if (threadIdx.x == 0) reinterpret_cast<uint32_t*>(a.out)[blockIdx.x] = id;
    if (threadIdx.x == 0 && p.top_logprobs > 0) {
        // The token's logit before its adjustment: its entry's or its
        // shared id's original, found by bisecting each (ascending ids), or
        // the row's.
        float logit = row[id];
        const uint32_t* own = reinterpret_cast<const uint32_t*>(list);
        uint32_t at = find_id(own, 4, p.adjust_count, id);
        if (at < p.adjust_count) {
            logit = originals[at];
        } else {
            at = find_id(shared_ids, 1, p.shared_count, id);
            if (at < p.shared_count) logit = originals[p.adjust_count + at];
        }
        float logprob = logit - log_z;
        memcpy(&scores[0], &logprob, 4);
    }
}

// exp_rn of each value in place: what the draw's weights are made of, for
// the GPU check (and the emulator's tests) to compare with the host's
// `exp_rn` bit for bit, since a draw is the host's only where they agree.
KERNEL(draw_weights, DrawWeightsArgs) {
    float* values = reinterpret_cast<float*>(a.values);
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < a.count) values[i] = exp_rn(values[i]);
}
