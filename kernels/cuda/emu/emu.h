// The CUDA emulator's device prelude: what `common.cuh` needs from CUDA,
// provided on the CPU so that the same kernel sources run in tests on a
// machine without a GPU.
//
// How it runs a launch (emu.cpp):
//   1. Blocks run one after another, in an order drawn afresh for each
//      launch from its seed (a GPU promises no order).
//   2. A block's threads are fibers (ucontext) on one OS thread, switched only
//      at barriers: __syncthreads, __syncwarp and every warp shuffle. Between
//      barriers the fibers run in an order drawn afresh for each round from a
//      seeded generator, so a kernel that reads shared memory another thread
//      wrote without a barrier between sees a different order than it assumed.
//   3. `__shared__` variables are thread-local function statics: one copy
//      per OS thread, shared by the block's fibers, reused by the next block
//      (CUDA leaves it undefined).
//   4. A barrier that some thread of its group never reaches (a
//      __syncthreads under a branch or after some threads returned, a shuffle
//      with lanes that returned) is reported as an error instead of hanging
//      or passing: on a GPU it is undefined.
//   5. Every load and store is checked for alignment to its type's size
//      (the alignment sanitizer, kernels/build.rs), as a GPU's are: one that
//      a GPU would fault on ("misaligned address") stops the process here,
//      naming its line. Device memory is aligned to 256 bytes, as cudaMalloc's.
//
// What it cannot show: races between blocks, the memory model, timing. The
// GPU check (scripts/gpu-check.sh) runs the same sources on a real device.

#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace emu {

struct Dim3 {
    unsigned x, y, z;
};

// One emulated thread's identity and barrier bookkeeping.
struct Thread {
    Dim3 idx;
    unsigned linear;  // threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)
    unsigned shuffles;  // shuffles done so far: their parity picks the exchange slots
};

extern thread_local Thread* current;
extern thread_local Dim3 block_idx;
extern thread_local Dim3 block_dim;
extern thread_local Dim3 grid_dim;

void sync_block();
void sync_warp();
// Publishes `bits` for this lane's shuffle, waits for the warp, and returns the
// bits lane `src` published in the same shuffle.
uint64_t exchange(uint64_t bits, unsigned src);
// Publishes `bits`, waits for the warp, and copies every lane's into all[32].
void gather(uint64_t bits, uint64_t* all);
void* dynamic_shared();

inline unsigned lane() { return current->linear % 32; }

template <class T>
inline uint64_t to_bits(T value) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    return bits;
}

template <class T>
inline T from_bits(uint64_t bits) {
    T value;
    std::memcpy(&value, &bits, sizeof(T));
    return value;
}

template <class T>
inline T shfl_xor(T value, int mask) {
    return from_bits<T>(exchange(to_bits(value), (lane() ^ unsigned(mask)) % 32));
}

template <class T>
inline T shfl(T value, int src) {
    return from_bits<T>(exchange(to_bits(value), unsigned(src) % 32));
}

template <class T>
inline T shfl_down(T value, unsigned delta) {
    unsigned src = lane() + delta;
    T theirs = from_bits<T>(exchange(to_bits(value), src < 32 ? src : lane()));
    return src < 32 ? theirs : value;
}

// The product of each signed byte pair, summed, plus c (the PTX dp4a.s32.s32).
inline int dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) {
        c += int(int8_t(uint32_t(a) >> (8 * i))) * int(int8_t(uint32_t(b) >> (8 * i)));
    }
    return c;
}

// PTX mma.sync m16n8k32 (k = 32) or m16n8k16 (k = 16), s8 x s8 -> s32, by
// the fragment layout common.cuh documents: every lane gathers the warp's
// fragments and computes its own four elements of D.
inline void mma_s8(int d[4], const uint32_t* a, const uint32_t* b, unsigned k) {
    uint64_t a_lo[32], a_hi[32], b_all[32];
    gather(uint64_t(a[0]) | uint64_t(a[1]) << 32, a_lo);
    gather(k == 32 ? uint64_t(a[2]) | uint64_t(a[3]) << 32 : 0, a_hi);
    gather(k == 32 ? uint64_t(b[0]) | uint64_t(b[1]) << 32 : uint64_t(b[0]), b_all);
    unsigned g = lane() / 4, i = lane() % 4;
    for (unsigned e = 0; e < 4; e++) {
        unsigned row = g + 8 * (e / 2), col = 2 * i + e % 2;
        int sum = d[e];
        for (unsigned kk = 0; kk < k; kk++) {
            // A[row][kk] is in lane (row % 8, kk % 16 / 4), word (row / 8) + 2 (kk / 16);
            // B[kk][col] in lane (col, kk % 16 / 4), word kk / 16.
            unsigned owner = kk % 16 / 4, byte = kk % 4;
            uint64_t a_words = (kk < 16 ? a_lo : a_hi)[(row % 8) * 4 + owner];
            uint32_t a_word = uint32_t(a_words >> (32 * (row / 8)));
            uint32_t b_word = uint32_t(b_all[col * 4 + owner] >> (32 * (kk / 16)));
            sum += int(int8_t(a_word >> (8 * byte))) * int(int8_t(b_word >> (8 * byte)));
        }
        d[e] = sum;
    }
}

// Every launch registers its kernels by name at start-up (KERNEL below).
typedef void (*Entry)(const void* args);
struct Registration {
    Registration(const char* name, size_t args_bytes, Entry entry);
};

}  // namespace emu

#define threadIdx (emu::current->idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define __syncthreads() emu::sync_block()
#define __syncwarp(...) emu::sync_warp()
#define __shfl_xor_sync(mask, value, lane_mask, ...) emu::shfl_xor(value, lane_mask)
#define __shfl_sync(mask, value, src, ...) emu::shfl(value, src)
#define __shfl_down_sync(mask, value, delta, ...) emu::shfl_down(value, delta)
#define __dp4a(a, b, c) emu::dp4a(a, b, c)
// Blocks run one after another and a block's fibers switch only at
// barriers: every access is already ordered and a plain add is atomic.
#define __threadfence() ((void)0)
inline unsigned atomicAdd(unsigned* address, unsigned value) {
    unsigned old = *address;
    *address = old + value;
    return old;
}
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static thread_local
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

// A kernel: `KERNEL(name, Args) { ... a.field ... }`. On the emulator it
// registers `name` with the size of its one argument struct.
#define KERNEL(name, Args)                                                         \
    static void name##_body(const Args& a);                                        \
    static emu::Registration name##_registration(#name, sizeof(Args),              \
                                                  [](const void* args) {           \
                                                      name##_body(                 \
                                                          *static_cast<const Args*>(args)); \
                                                  });                              \
    static void name##_body(const Args& a)

#define KERNEL_THREADS(name, Args, threads) KERNEL(name, Args)

// KERNEL_PREFETCHING: its prefetch runs first, as on a GPU (no launch runs
// beside another here, so there is no wait to come after it).
#define KERNEL_PREFETCHING(name, Args)                                             \
    static void name##_prefetch(const Args a);                                     \
    static void name##_body(const Args& a);                                        \
    static emu::Registration name##_registration(#name, sizeof(Args),              \
                                                  [](const void* args) {           \
                                                      const Args& a =              \
                                                          *static_cast<const Args*>(args); \
                                                      name##_prefetch(a);          \
                                                      name##_body(a);              \
                                                  });                              \
    static void name##_body(const Args& a)

// The block's dynamic shared memory as `type*`.
#define DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(emu::dynamic_shared())
