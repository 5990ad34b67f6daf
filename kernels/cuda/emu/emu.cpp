// The CUDA emulator's runtime: device memory in host pages, and launches of
// kernels compiled for the CPU (kernels.cpp), one block at a time, its
// threads as fibers switched at barriers. See emu.h for the model and its
// limits. Test-only: built when the `emulator` feature of bulkhead-kernels is on.

#include "emu.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace emu {

// Per OS thread: tests launch on several emulated devices at once, each
// launch's fibers all on the thread that launched it.
thread_local Thread* current = nullptr;
thread_local Dim3 block_idx;
thread_local Dim3 block_dim;
thread_local Dim3 grid_dim;

namespace {

// Per-fiber stack: kernels keep a few small arrays in registers, no more.
const size_t STACK_BYTES = 256 * 1024;
const unsigned BLOCK_THREADS_MAX = 1024;
const unsigned WARP = 32;

enum State { RUNNABLE, WAIT_BLOCK, WAIT_WARP, DONE };

// A fiber's saved context. On x86-64 a switch saves only what the System V
// ABI says a call preserves (rbx, rbp, r12-r15, the stack pointer; kernels
// never change the FPU's control words): swapcontext also saves and restores
// the signal mask, a system call per switch, and was 87 % of the emulator's
// time (perf on decode_attention_split_over_many_spans_is_merged_as_the_cpu_computes_it).
#if defined(__x86_64__)
struct Context {
    void* sp = nullptr;
};
#else
struct Context {
    ucontext_t uc;
};
#endif

struct Fiber {
    Context context;
    Thread thread;
    State state;
};

struct Kernel {
    size_t args_bytes;
    Entry entry;
};

std::map<std::string, Kernel>& registry() {
    static std::map<std::string, Kernel> kernels;
    return kernels;
}

// The launch in progress on this OS thread (launches never nest).
struct Launch {
    Context scheduler;
    std::vector<Fiber> fibers;
    char* stacks = nullptr;
    size_t stacks_bytes = 0;
    // [warp][parity][lane]: the bits each lane published for a shuffle.
    std::vector<uint64_t> slots;
    std::vector<unsigned char> shared;
    Entry entry = nullptr;
    const void* args = nullptr;
    uint64_t rng = 0;
    std::string error;
};

thread_local Launch launch;

uint64_t next_random() {
    // xorshift64*: cheap, and a seed reproduces a schedule.
    launch.rng ^= launch.rng >> 12;
    launch.rng ^= launch.rng << 25;
    launch.rng ^= launch.rng >> 27;
    return launch.rng * 0x2545F4914F6CDD1DULL;
}

Fiber& current_fiber() {
    return launch.fibers[current->linear];
}

#if defined(__x86_64__)
}  // namespace
}  // namespace emu

// Saves the callee-saved registers on the current stack and its pointer in
// *save, then resumes the context whose stack pointer is `load`.
extern "C" void bulkhead_emu_switch(void** save, void* load);
asm(R"(
    .text
    .p2align 4
    .globl bulkhead_emu_switch
    .hidden bulkhead_emu_switch
    .type bulkhead_emu_switch, @function
bulkhead_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size bulkhead_emu_switch, .-bulkhead_emu_switch
)");

namespace emu {
namespace {

void switch_to(Context& save, const Context& load) { bulkhead_emu_switch(&save.sp, load.sp); }

// A context that starts `entry` on `stack` at its first switch: the six
// registers the switch pops, then `entry` as the address it returns to, then
// a return address for `entry` that is never used (entry never returns), so
// that `entry` begins with the stack aligned as after a call.
void prepare(Context& context, char* stack, size_t bytes, void (*entry)()) {
    uintptr_t top = (uintptr_t(stack) + bytes) & ~uintptr_t(15);
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;
    *--sp = reinterpret_cast<void*>(entry);
    for (int i = 0; i < 6; i++) *--sp = nullptr;
    context.sp = sp;
}
#else
void switch_to(Context& save, const Context& load) { swapcontext(&save.uc, &load.uc); }

void prepare(Context& context, char* stack, size_t bytes, void (*entry)()) {
    getcontext(&context.uc);
    context.uc.uc_stack.ss_sp = stack;
    context.uc.uc_stack.ss_size = bytes;
    context.uc.uc_link = nullptr;
    makecontext(&context.uc, entry, 0);
}
#endif

void yield(State state) {
    Fiber& fiber = current_fiber();
    fiber.state = state;
    switch_to(fiber.context, launch.scheduler);
}

// A fiber's whole life: the kernel, then back to the scheduler for good.
[[noreturn]] void run_thread() {
    launch.entry(launch.args);
    Fiber& fiber = current_fiber();
    fiber.state = DONE;
    switch_to(fiber.context, launch.scheduler);
    __builtin_unreachable();
}

bool ensure_stacks(unsigned threads) {
    size_t bytes = size_t(threads) * STACK_BYTES;
    if (bytes <= launch.stacks_bytes) return true;
    if (launch.stacks) munmap(launch.stacks, launch.stacks_bytes);
    void* stacks = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stacks == MAP_FAILED) {
        launch.stacks = nullptr;
        launch.stacks_bytes = 0;
        return false;
    }
    launch.stacks = static_cast<char*>(stacks);
    launch.stacks_bytes = bytes;
    return true;
}

// Releases every barrier all of whose live members arrived. Returns whether
// any was released; records an error for a barrier that can never complete.
bool release_barriers() {
    bool released = false;
    unsigned threads = unsigned(launch.fibers.size());
    unsigned live = 0, at_block = 0;
    for (const Fiber& fiber : launch.fibers) {
        live += fiber.state != DONE;
        at_block += fiber.state == WAIT_BLOCK;
    }
    for (unsigned warp = 0; warp * WARP < threads; warp++) {
        unsigned first = warp * WARP, end = first + WARP < threads ? first + WARP : threads;
        unsigned waiting = 0, done = 0;
        for (unsigned t = first; t < end; t++) {
            waiting += launch.fibers[t].state == WAIT_WARP;
            done += launch.fibers[t].state == DONE;
        }
        if (waiting == 0) continue;
        if (done > 0 || end - first < WARP) {
            launch.error = "a warp shuffle or __syncwarp in warp " + std::to_string(warp) +
                           " with lanes that exited or do not exist";
            return false;
        }
        if (waiting == WARP) {
            for (unsigned t = first; t < end; t++) launch.fibers[t].state = RUNNABLE;
            released = true;
        }
    }
    if (at_block > 0 && live < threads) {
        launch.error = "__syncthreads reached while threads of the block had exited";
        return false;
    }
    if (at_block > 0 && at_block == live) {
        for (Fiber& fiber : launch.fibers) {
            if (fiber.state == WAIT_BLOCK) fiber.state = RUNNABLE;
        }
        released = true;
    }
    return released;
}

bool run_block(unsigned threads, size_t shared_bytes) {
    // Dynamic shared memory starts as all-ones bytes (NaN floats), so a read
    // before any write shows up in the output.
    std::memset(launch.shared.data(), 0xFF, shared_bytes);
    for (unsigned t = 0; t < threads; t++) {
        Fiber& fiber = launch.fibers[t];
        fiber.thread.linear = t;
        fiber.thread.idx = {t % block_dim.x, t / block_dim.x % block_dim.y,
                            t / (block_dim.x * block_dim.y)};
        fiber.thread.shuffles = 0;
        fiber.state = RUNNABLE;
        prepare(fiber.context, launch.stacks + size_t(t) * STACK_BYTES, STACK_BYTES, run_thread);
    }
    std::vector<unsigned> order(threads);
    for (unsigned t = 0; t < threads; t++) order[t] = t;
    for (;;) {
        // A fresh order for every round (Fisher-Yates).
        for (unsigned i = threads; i > 1; i--) {
            unsigned j = unsigned(next_random() % i);
            unsigned swap = order[i - 1];
            order[i - 1] = order[j];
            order[j] = swap;
        }
        unsigned ran = 0, live = 0;
        for (unsigned t : order) {
            Fiber& fiber = launch.fibers[t];
            if (fiber.state != RUNNABLE) continue;
            current = &fiber.thread;
            switch_to(launch.scheduler, fiber.context);
            ran++;
        }
        for (const Fiber& fiber : launch.fibers) live += fiber.state != DONE;
        if (live == 0) return true;
        bool released = release_barriers();
        if (!launch.error.empty()) return false;
        if (ran == 0 && !released) {
            launch.error = "deadlock: threads wait at barriers that others never reach";
            return false;
        }
    }
}

void set_error(char* error, size_t error_len, const std::string& message) {
    if (error_len == 0) return;
    std::snprintf(error, error_len, "%s", message.c_str());
}

}  // namespace

Registration::Registration(const char* name, size_t args_bytes, Entry entry) {
    registry()[name] = Kernel{args_bytes, entry};
}

void sync_block() { yield(WAIT_BLOCK); }

void sync_warp() { yield(WAIT_WARP); }

void gather(uint64_t bits, uint64_t* all) {
    unsigned linear = current->linear;
    unsigned parity = current->shuffles++ & 1;
    size_t warp_base = size_t(linear / WARP) * 2 * WARP + parity * WARP;
    launch.slots[warp_base + linear % WARP] = bits;
    yield(WAIT_WARP);
    std::memcpy(all, &launch.slots[warp_base], WARP * sizeof(uint64_t));
}

uint64_t exchange(uint64_t bits, unsigned src) {
    unsigned linear = current->linear;
    unsigned parity = current->shuffles++ & 1;
    size_t warp_base = size_t(linear / WARP) * 2 * WARP + parity * WARP;
    launch.slots[warp_base + linear % WARP] = bits;
    yield(WAIT_WARP);
    return launch.slots[warp_base + src];
}

void* dynamic_shared() { return launch.shared.data(); }

}  // namespace emu

extern "C" {

// Zeroed device memory of at least `bytes`, aligned to 256 bytes, ending
// within 256 bytes of an inaccessible page: an access past the end faults.
void* bulkhead_emu_alloc(size_t bytes) {
    size_t page = size_t(sysconf(_SC_PAGESIZE));
    size_t rounded = (bytes + 255) / 256 * 256;
    if (rounded == 0) rounded = 256;
    size_t mapped = (rounded + page - 1) / page * page + page;
    void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return nullptr;
    char* guard = static_cast<char*>(base) + mapped - page;
    mprotect(guard, page, PROT_NONE);
    return guard - rounded;
}

void bulkhead_emu_free(void* ptr, size_t bytes) {
    if (!ptr) return;
    size_t page = size_t(sysconf(_SC_PAGESIZE));
    size_t rounded = (bytes + 255) / 256 * 256;
    if (rounded == 0) rounded = 256;
    size_t mapped = (rounded + page - 1) / page * page + page;
    char* guard_end = static_cast<char*>(ptr) + rounded + page;
    munmap(guard_end - mapped, mapped);
}

// Bytes of `name`'s argument struct, or 0 for a kernel the emulator lacks.
size_t bulkhead_emu_args_bytes(const char* name) {
    auto found = emu::registry().find(name);
    return found == emu::registry().end() ? 0 : found->second.args_bytes;
}

// Runs kernel `name` over `grid` blocks of `block` threads. Returns 0, or 1
// with a message in `error`.
int bulkhead_emu_launch(const char* name, const uint32_t grid[3], const uint32_t block[3],
                        uint32_t shared_bytes, const void* args, size_t args_bytes,
                        uint64_t seed, char* error, size_t error_len) {
    using namespace emu;
    auto found = registry().find(name);
    if (found == registry().end()) {
        set_error(error, error_len, std::string("no kernel named ") + name);
        return 1;
    }
    if (found->second.args_bytes != args_bytes) {
        set_error(error, error_len,
                  std::string("kernel ") + name + " takes " +
                      std::to_string(found->second.args_bytes) + " bytes of arguments, not " +
                      std::to_string(args_bytes));
        return 1;
    }
    uint64_t threads = uint64_t(block[0]) * block[1] * block[2];
    if (threads == 0 || threads > BLOCK_THREADS_MAX || grid[0] == 0 || grid[1] == 0 ||
        grid[2] == 0 || grid[1] > 65535 || grid[2] > 65535 || block[2] > 64) {
        set_error(error, error_len, std::string("launch geometry out of range for ") + name);
        return 1;
    }
    if (!ensure_stacks(unsigned(threads))) {
        set_error(error, error_len, "no memory for fiber stacks");
        return 1;
    }
    launch.fibers.assign(threads, Fiber());
    launch.slots.assign((threads + WARP - 1) / WARP * 2 * WARP, 0);
    launch.shared.assign(shared_bytes > 0 ? shared_bytes : 1, 0);
    launch.entry = found->second.entry;
    launch.args = args;
    launch.rng = seed * 0x9E3779B97F4A7C15ULL + 1;
    launch.error.clear();
    grid_dim = {grid[0], grid[1], grid[2]};
    block_dim = {block[0], block[1], block[2]};
    // The blocks in an order drawn from the seed (Fisher-Yates), as a GPU
    // promises none: a block that reads what another block of the same
    // launch writes, without the fence-and-count that makes it safe, sees a
    // different order than it assumed.
    uint64_t blocks = uint64_t(grid[0]) * grid[1] * grid[2];
    std::vector<uint64_t> order(blocks);
    for (uint64_t b = 0; b < blocks; b++) order[b] = b;
    for (uint64_t b = blocks; b > 1; b--) std::swap(order[b - 1], order[next_random() % b]);
    for (uint64_t b : order) {
        unsigned x = unsigned(b % grid[0]), y = unsigned(b / grid[0] % grid[1]),
                 z = unsigned(b / grid[0] / grid[1]);
        block_idx = {x, y, z};
        if (!run_block(unsigned(threads), shared_bytes)) {
            set_error(error, error_len,
                      std::string(name) + " block (" + std::to_string(x) + ", " +
                          std::to_string(y) + ", " + std::to_string(z) + "): " + launch.error);
            current = nullptr;
            return 1;
        }
    }
    current = nullptr;
    return 0;
}

}  // extern "C"
