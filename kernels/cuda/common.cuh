// What every kernel file shares: fixed-width types, the KERNEL macro, f16
// conversions, warp and block reductions. Compiled two ways:
//   - by NVRTC for the device present (backend/cuda/nvrtc.rs), with no system
//     headers: NVRTC has none, so the fixed-width types are defined here;
//   - by the host C++ compiler after emu/emu.h (BULKHEAD_EMU), for the
//     emulator that runs these sources in tests without a GPU.
// Kernels use only what this file and emu.h both provide.

#pragma once

#ifndef BULKHEAD_EMU
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

// A dependent launch (programmatic dependent launch, sm_90 and later: the
// backend's launches after a step's first, CudaBackend::launch) may begin
// while the kernel queued before it still runs. Every kernel therefore lets
// the next one begin (`launch_dependents`: its blocks are placed and run up
// to their own wait as soon as every block of this one has begun), then
// waits (`wait`: until the kernel before has ended and its writes are
// visible) before it reads or writes anything: what it sees is what it
// would see launched after. Launched otherwise, both do nothing.
__device__ __forceinline__ void grid_dependency() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A kernel takes one argument: its struct of device addresses and sizes
// (args.cuh), passed by value; its body runs after grid_dependency().
#define KERNEL(name, Args)                                    \
    __device__ __forceinline__ void name##_body(const Args a); \
    extern "C" __global__ void name(const Args a) {           \
        grid_dependency();                                    \
        name##_body(a);                                       \
    }                                                         \
    __device__ __forceinline__ void name##_body(const Args a)
// A kernel that asks for what it will read of memory no kernel writes (a
// weight matrix) before it waits: `name##_prefetch(a)`, defined after it,
// may issue prefetch_l2 hints and read its parameters, nothing else.
#define KERNEL_PREFETCHING(name, Args)                         \
    __device__ __forceinline__ void name##_prefetch(const Args a); \
    __device__ __forceinline__ void name##_body(const Args a);     \
    extern "C" __global__ void name(const Args a) {               \
        name##_prefetch(a);                                       \
        grid_dependency();                                        \
        name##_body(a);                                           \
    }                                                             \
    __device__ __forceinline__ void name##_body(const Args a)
// A kernel launched with `threads` a block, more than a register file
// holds at the compiler's own choice (1024 threads have 64 registers each):
// the bound makes NVRTC fit them, where a launch would otherwise fail.
#define KERNEL_THREADS(name, Args, threads)                                     \
    __device__ __forceinline__ void name##_body(const Args a);                  \
    extern "C" __global__ void __launch_bounds__(threads) name(const Args a) {  \
        grid_dependency();                                                      \
        name##_body(a);                                                         \
    }                                                                           \
    __device__ __forceinline__ void name##_body(const Args a)
#define DYNAMIC_SHARED(type, name)                         \
    extern __shared__ __align__(16) unsigned char name##_bytes[]; \
    type* name = reinterpret_cast<type*>(name##_bytes)
#endif

// Asks for the cache line holding `p` to be brought into L2: a hint that
// reads no value (so it may come before a dependent kernel's wait, and a
// line no kernel writes is all it may name). The emulator reads the byte
// at `p`, so that an address outside every allocation faults there.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef BULKHEAD_EMU
    (void)*static_cast<const volatile unsigned char*>(p);
#else
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// A word of memory no kernel of the step writes (the step buffer: copied
// before the step's first launch, read-only until the step ends), read
// through the read-only path (ld.global.nc): the one load that may come
// before a dependent kernel's wait, to find what to prefetch.
__device__ __forceinline__ uint32_t load_step_word(const uint32_t* p) {
#ifdef BULKHEAD_EMU
    return *p;
#else
    return __ldg(p);
#endif
}

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu
// A sequence index meaning "no sequence": a padding token of a captured step.
#define NO_SEQ 0xffffffffu

// f16 bits to the exact f32 value.
__device__ __forceinline__ float f16_to_f32(uint16_t bits) {
#ifdef BULKHEAD_EMU
    uint32_t sign = uint32_t(bits & 0x8000) << 16;
    uint32_t exponent = (bits >> 10) & 0x1f;
    uint32_t mantissa = bits & 0x3ff;
    uint32_t out;
    if (exponent == 0x1f) {
        out = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        out = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        out = sign;
    } else {
        // Subnormal: normalise.
        int shift = 0;
        while ((mantissa & 0x400) == 0) {
            mantissa <<= 1;
            shift++;
        }
        out = sign | uint32_t(113 - shift) << 23 | ((mantissa & 0x3ff) << 13);
    }
    float value;
    memcpy(&value, &out, 4);
    return value;
#else
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
#endif
}

// f32 to f16 bits, rounding to nearest even, as the host storage does:
// finite values beyond f16's range saturate at ±65504 rather than become
// infinite (an infinite key would make every score of its position NaN).
__device__ __forceinline__ uint16_t f32_to_f16(float value) {
    // Comparisons are false for NaN, which passes through unchanged.
    value = value > 65504.0f ? 65504.0f : value;
    value = value < -65504.0f ? -65504.0f : value;
#ifdef BULKHEAD_EMU
    uint32_t x;
    memcpy(&x, &value, 4);
    uint16_t sign = uint16_t((x >> 16) & 0x8000);
    uint32_t magnitude = x & 0x7fffffffu;
    if (magnitude > 0x7f800000u) {
        // NaN: keep the top payload bits, quiet.
        return uint16_t(sign | 0x7e00 | ((magnitude >> 13) & 0x3ff));
    }
    if (magnitude >= 0x38800000u) {
        // Normal in f16: drop 13 mantissa bits, ties to even.
        uint32_t rounded = magnitude - 0x38000000u;
        rounded += 0x0fff + ((rounded >> 13) & 1);
        return uint16_t(sign | (rounded >> 13));
    }
    if (magnitude < 0x33000000u) {
        return sign;  // Below half the smallest subnormal: zero.
    }
    // Subnormal in f16.
    uint32_t exponent = magnitude >> 23;
    uint32_t mantissa = (magnitude & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - exponent;  // 14..24
    uint32_t half_bits = mantissa >> shift;
    uint32_t rest = mantissa & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half_bits & 1))) half_bits++;
    return uint16_t(sign | half_bits);
#else
    uint16_t bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    return bits;
#endif
}

// Rounds to the nearest integer, ties to even (the CPU quantizer's rounding).
__device__ __forceinline__ int round_to_int(float x) {
#ifdef BULKHEAD_EMU
    return int(nearbyintf(x));
#else
    return __float2int_rn(x);
#endif
}

__device__ __forceinline__ float warp_sum(float value) {
    for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) {
        value += __shfl_xor_sync(FULL_MASK, value, mask);
    }
    return value;
}

__device__ __forceinline__ int warp_sum_int(int value) {
    for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) {
        value += __shfl_xor_sync(FULL_MASK, value, mask);
    }
    return value;
}

__device__ __forceinline__ float warp_max(float value) {
    for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) {
        float other = __shfl_xor_sync(FULL_MASK, value, mask);
        value = other > value ? other : value;
    }
    return value;
}

// The sum over the block of every thread's `value`, returned to every
// thread. `scratch` is shared memory of at least one float per warp; the
// block is a whole number of warps.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
    unsigned lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    unsigned warps = blockDim.x / WARP_SIZE;
    value = warp_sum(value);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = value;
    __syncthreads();
    float total = 0.0f;
    for (unsigned w = 0; w < warps; w++) total += scratch[w];
    return total;
}

__device__ __forceinline__ float block_max(float value, float* scratch) {
    unsigned lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    unsigned warps = blockDim.x / WARP_SIZE;
    value = warp_max(value);
    __syncthreads();
    if (lane == 0) scratch[warp] = value;
    __syncthreads();
    float best = scratch[0];
    for (unsigned w = 1; w < warps; w++) best = scratch[w] > best ? scratch[w] : best;
    return best;
}

// a * b rounded once, never fused with a following add: where the CPU
// computes a product and then a sum, the device gives the same bits.
__device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef BULKHEAD_EMU
    return a * b;  // the emulator is compiled with -ffp-contract=off
#else
    return __fmul_rn(a, b);
#endif
}

// a + b rounded once, never fused with the product before it.
__device__ __forceinline__ float add_rn(float a, float b) {
#ifdef BULKHEAD_EMU
    return a + b;
#else
    return __fadd_rn(a, b);
#endif
}

// a / b rounded once (IEEE division, whatever the compiler's options).
__device__ __forceinline__ float div_rn(float a, float b) {
#ifdef BULKHEAD_EMU
    return a / b;
#else
    return __fdiv_rn(a, b);
#endif
}

// 16 aligned bytes, loaded at once.
struct __align__(16) Int4 {
    int x, y, z, w;
};

struct __align__(16) Float4 {
    float x, y, z, w;
};

// 8 aligned bytes, loaded at once.
struct __align__(8) Int2 {
    int x, y;
};

__device__ __forceinline__ uint32_t umin32(uint32_t a, uint32_t b) { return a < b ? a : b; }
__device__ __forceinline__ uint32_t umax32(uint32_t a, uint32_t b) { return a > b ? a : b; }

// Little-endian loads from byte addresses of any alignment.
__device__ __forceinline__ uint32_t load_u16(const uint8_t* p) {
    return uint32_t(p[0]) | uint32_t(p[1]) << 8;
}

__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) {
    return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

__device__ __forceinline__ float load_f16(const uint8_t* p) { return f16_to_f32(uint16_t(load_u16(p))); }

// cap * tanh(value / cap), as the CPU computes it: cap (1 - 2 / (1 + e^(2y))).
__device__ __forceinline__ float soft_cap(float value, float cap) {
    float y = mul_rn(value, 1.0f / cap);
    return mul_rn(cap, 1.0f - 2.0f / (1.0f + expf(2.0f * y)));
}

// D = A . B + D on the tensor cores, the warp together (PTX mma.sync
// m16n8k32, s8 x s8 -> s32; sm_80 and later: the host launches no kernel
// using it on an older device). A is 16 rows of 32 k, B 32 k of 8 columns,
// D 16 x 8. Lane (g = lane / 4, i = lane % 4) holds, four signed bytes a
// word, lowest k first:
//   a[0] = A[g][4i..4i+4]   a[1] = A[g+8][4i..4i+4]
//   a[2] = A[g][16+4i..]    a[3] = A[g+8][16+4i..]
//   b[0] = B[4i..4i+4][g]   b[1] = B[16+4i..16+4i+4][g]
//   d[0], d[1] = D[g][2i], D[g][2i+1]     d[2], d[3] = D[g+8][2i], D[g+8][2i+1]
// The k16 form takes a[0], a[1] and b[0] alone (k 0..16).
__device__ __forceinline__ void mma_s8_k32(int d[4], const uint32_t a[4], const uint32_t b[2]) {
#ifdef BULKHEAD_EMU
    emu::mma_s8(d, a, b, 32);
#elif __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();
#endif
}

__device__ __forceinline__ void mma_s8_k16(int d[4], const uint32_t a[2], uint32_t b) {
#ifdef BULKHEAD_EMU
    emu::mma_s8(d, a, &b, 16);
#elif __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b));
#else
    __trap();
#endif
}
