// Every kernel source, compiled for the CPU emulator (emu.h) as one
// translation unit, so the static registrations of KERNEL all link in.

#define BULKHEAD_EMU 1
#include "emu.h"

#include "../attention.cu"
#include "../pages.cu"
#include "../quant.cu"
#include "../sample.cu"

// The emulator's own canaries (kernels/src/backend/cuda/tests.rs): a block
// reduction it must get right, barrier misuse it must report, a race and
// an order of blocks its seed must change.
struct SelfTestArgs {
    uint64_t out;
    uint32_t mode;
    uint32_t unused;
};

KERNEL(emu_selftest, SelfTestArgs) {
    float* out = reinterpret_cast<float*>(a.out);
    __shared__ float scratch[32];
    __shared__ float cell;
    switch (a.mode) {
        case 0: {  // out[block] = sum of the block's thread indices
            float sum = block_sum(float(threadIdx.x), scratch);
            if (threadIdx.x == 0) out[blockIdx.x] = sum;
            break;
        }
        case 1:  // a barrier half the block never reaches
            if (threadIdx.x < blockDim.x / 2) __syncthreads();
            break;
        case 2:  // a shuffle after half of each warp returned
            if (threadIdx.x % WARP_SIZE < 16) return;
            out[threadIdx.x] = __shfl_xor_sync(FULL_MASK, 1.0f, 1);
            break;
        case 3:  // a race: thread 0 reads what thread 1 writes, no barrier between
            if (threadIdx.x == 0) cell = 0.0f;
            __syncthreads();
            if (threadIdx.x == 1) cell = 1.0f;
            if (threadIdx.x == 0) out[0] = cell;
            break;
        case 4: {  // out[block] = how many blocks ran before it (a count in out[1023])
            unsigned* count = reinterpret_cast<unsigned*>(out + 1023);
            if (threadIdx.x == 0) out[blockIdx.x] = float(atomicAdd(count, 1u));
            break;
        }
    }
}

// Referenced from Rust, so the linker keeps this object (and its registrations).
extern "C" int bulkhead_emu_kernels_linked() { return 1; }
