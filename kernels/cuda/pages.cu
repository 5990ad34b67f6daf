// Page digests on the device: XXH3-64 of a page's used slots in the
// transfer's byte order, seeded with the used slot count, bit for bit the
// host's `kv::digest::xxh3_64` over the bytes `PageStorage::read_rows` gives,
// so a page hashed on a GPU verifies against the same page hashed on a CPU.
//
// The page's bytes are not contiguous in device storage (the pool is
// layer-major: [layer][k|v][pages][page_tokens][kv_dim]); the hash reads them
// through `Wire`, which maps an offset of the transfer's byte stream to the
// slab holding it.
//
// One warp a page. XXH3's long-input loop adds each 64-byte stripe into
// eight 64-bit lanes and scrambles the lanes every 16 stripes; additions
// commute, so the warp's 32 threads split a block's stripes four ways (lane
// = 8 * group + accumulator), sum their shares with shuffles, and every
// thread of an accumulator applies the same scramble.

#include "common.cuh"
#include "args.cuh"

#define XXH_P32_1 0x9E3779B1ull
#define XXH_P32_2 0x85EBCA77ull
#define XXH_P32_3 0xC2B2AE3Dull
#define XXH_P64_1 0x9E3779B185EBCA87ull
#define XXH_P64_2 0xC2B2AE3D27D4EB4Full
#define XXH_P64_3 0x165667B19E3779F9ull
#define XXH_P64_4 0x85EBCA77C2B2AE63ull
#define XXH_P64_5 0x27D4EB2F165667C5ull
#define XXH_SECRET_BYTES 192u
#define XXH_STRIPE 64u
#define XXH_BLOCK 1024u

// XXH3's default secret (the reference implementation's XXH3_kSecret).
__device__ const uint8_t XXH3_SECRET[XXH_SECRET_BYTES] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

__device__ __forceinline__ uint64_t bytes64(const uint8_t* p) {
    uint64_t value = 0;
    for (int i = 0; i < 8; i++) value |= uint64_t(p[i]) << (8 * i);
    return value;
}

__device__ __forceinline__ uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

__device__ __forceinline__ uint64_t swap64(uint64_t x) {
    uint64_t out = 0;
    for (int i = 0; i < 8; i++) out |= ((x >> (8 * i)) & 0xff) << (8 * (7 - i));
    return out;
}

__device__ __forceinline__ uint32_t swap32(uint32_t x) {
    return (x >> 24) | ((x >> 8) & 0xff00) | ((x << 8) & 0xff0000) | (x << 24);
}

// The low and high halves of the 128-bit product, xor-ed.
__device__ __forceinline__ uint64_t mul_fold(uint64_t a, uint64_t b) {
#ifdef BULKHEAD_EMU
    unsigned __int128 product = (unsigned __int128)a * b;
    return uint64_t(product) ^ uint64_t(product >> 64);
#else
    return (a * b) ^ __umul64hi(a, b);
#endif
}

__device__ __forceinline__ uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= XXH_P64_2;
    h ^= h >> 29;
    h *= XXH_P64_3;
    return h ^ (h >> 32);
}

__device__ __forceinline__ uint64_t xxh3_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    return h ^ (h >> 32);
}

__device__ __forceinline__ uint64_t rrmxmx(uint64_t h, uint64_t len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= 0x9FB21C651E98DF25ull;
    h ^= (h >> 35) + len;
    h *= 0x9FB21C651E98DF25ull;
    return h ^ (h >> 28);
}

// A page's used slots as one byte stream: slab s (= 2 * layer + k|v) holds
// bytes s * used .. (s + 1) * used.
struct Wire {
    const uint8_t* page;   // the page's first slab (layer 0, K)
    uint64_t slab_stride;  // bytes from one (layer, k|v) slab of a page to the next
    uint64_t used;         // used bytes of each slab
    uint64_t len;          // bytes in the stream
};

__device__ __forceinline__ uint8_t wire_byte(const Wire& w, uint64_t at) {
    uint64_t slab = at / w.used;
    return w.page[slab * w.slab_stride + (at - slab * w.used)];
}

__device__ __forceinline__ uint64_t wire64(const Wire& w, uint64_t at) {
    uint64_t slab = at / w.used, within = at - slab * w.used;
    const uint8_t* p = w.page + slab * w.slab_stride + within;
    if (within + 8 <= w.used && (reinterpret_cast<uint64_t>(p) & 7) == 0) {
        return *reinterpret_cast<const uint64_t*>(p);
    }
    uint64_t value = 0;
    for (int i = 0; i < 8; i++) value |= uint64_t(wire_byte(w, at + i)) << (8 * i);
    return value;
}

__device__ __forceinline__ uint64_t wire32(const Wire& w, uint64_t at) {
    uint64_t value = 0;
    for (int i = 0; i < 4; i++) value |= uint64_t(wire_byte(w, at + i)) << (8 * i);
    return value;
}

__device__ __forceinline__ uint64_t mix16(const Wire& w, uint64_t at, uint32_t key, uint64_t seed) {
    return mul_fold(wire64(w, at) ^ (bytes64(XXH3_SECRET + key) + seed),
                    wire64(w, at + 8) ^ (bytes64(XXH3_SECRET + key + 8) - seed));
}

// XXH3-64 of at most 240 bytes (one thread).
__device__ uint64_t xxh3_short(const Wire& w, uint64_t seed) {
    const uint8_t* s = XXH3_SECRET;
    uint64_t len = w.len;
    if (len <= 16) {
        if (len > 8) {
            uint64_t flip1 = (bytes64(s + 24) ^ bytes64(s + 32)) + seed;
            uint64_t flip2 = (bytes64(s + 40) ^ bytes64(s + 48)) - seed;
            uint64_t lo = wire64(w, 0) ^ flip1;
            uint64_t hi = wire64(w, len - 8) ^ flip2;
            return xxh3_avalanche(len + swap64(lo) + hi + mul_fold(lo, hi));
        }
        if (len >= 4) {
            uint64_t keyed_seed = seed ^ (uint64_t(swap32(uint32_t(seed))) << 32);
            uint64_t flip = (bytes64(s + 8) ^ bytes64(s + 16)) - keyed_seed;
            uint64_t input = wire32(w, len - 4) + (wire32(w, 0) << 32);
            return rrmxmx(input ^ flip, len);
        }
        if (len > 0) {
            uint64_t combined = (uint64_t(wire_byte(w, 0)) << 16) |
                                (uint64_t(wire_byte(w, len >> 1)) << 24) |
                                uint64_t(wire_byte(w, len - 1)) | (len << 8);
            uint64_t flip = ((bytes64(s) & 0xffffffffull) ^ (bytes64(s + 4) & 0xffffffffull)) + seed;
            return xxh64_avalanche(combined ^ flip);
        }
        return xxh64_avalanche(seed ^ bytes64(s + 56) ^ bytes64(s + 64));
    }
    uint64_t acc = len * XXH_P64_1;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += mix16(w, 48, 96, seed);
                    acc += mix16(w, len - 64, 112, seed);
                }
                acc += mix16(w, 32, 64, seed);
                acc += mix16(w, len - 48, 80, seed);
            }
            acc += mix16(w, 16, 32, seed);
            acc += mix16(w, len - 32, 48, seed);
        }
        acc += mix16(w, 0, 0, seed);
        acc += mix16(w, len - 16, 16, seed);
        return xxh3_avalanche(acc);
    }
    for (uint32_t i = 0; i < 8; i++) acc += mix16(w, 16 * i, 16 * i, seed);
    acc = xxh3_avalanche(acc);
    for (uint32_t i = 8; i < len / 16; i++) acc += mix16(w, 16 * i, 16 * (i - 8) + 3, seed);
    acc += mix16(w, len - 16, 136 - 17, seed);
    return xxh3_avalanche(acc);
}

// Accumulator `lane`'s share of the stripe at `at`, keyed from `key`:
// data[lane ^ 1] + lo32(k) * hi32(k), k = data[lane] ^ key[lane].
__device__ __forceinline__ uint64_t stripe_share(const Wire& w, uint64_t at, const uint8_t* key,
                                                 uint32_t lane) {
    uint64_t keyed = wire64(w, at + 8 * lane) ^ bytes64(key + 8 * lane);
    return wire64(w, at + 8 * (lane ^ 1)) + (keyed & 0xffffffffull) * (keyed >> 32);
}

// Sum over the warp's four groups of one accumulator's shares.
__device__ __forceinline__ uint64_t group_sum(uint64_t share) {
    share += __shfl_xor_sync(FULL_MASK, share, 8);
    share += __shfl_xor_sync(FULL_MASK, share, 16);
    return share;
}

KERNEL(page_digest, DigestArgs) {
    __shared__ uint8_t secret[XXH_SECRET_BYTES];
    uint32_t lane = threadIdx.x;  // the block is one warp
    const uint32_t* entry = reinterpret_cast<const uint32_t*>(a.pages) + 2 * blockIdx.x;
    uint32_t page = entry[0], used_slots = entry[1];
    uint64_t slab_bytes = uint64_t(a.page_tokens) * a.kv_dim * a.value_bytes;
    Wire w;
    w.page = reinterpret_cast<const uint8_t*>(a.kv) + page * slab_bytes;
    w.slab_stride = uint64_t(a.pages_count) * slab_bytes;
    w.used = uint64_t(used_slots) * a.kv_dim * a.value_bytes;
    w.len = 2 * uint64_t(a.layers) * w.used;
    uint64_t seed = used_slots;
    uint64_t* out = reinterpret_cast<uint64_t*>(a.out) + blockIdx.x;
    if (w.len <= 240) {
        if (lane == 0) *out = xxh3_short(w, seed);
        return;
    }
    // The seeded secret: each 16-byte pair of the default one, +seed and -seed.
    if (lane < XXH_SECRET_BYTES / 16) {
        uint64_t lo = bytes64(XXH3_SECRET + 16 * lane) + seed;
        uint64_t hi = bytes64(XXH3_SECRET + 16 * lane + 8) - seed;
        for (int i = 0; i < 8; i++) {
            secret[16 * lane + i] = uint8_t(lo >> (8 * i));
            secret[16 * lane + 8 + i] = uint8_t(hi >> (8 * i));
        }
    }
    __syncwarp();
    uint32_t acc_lane = lane % 8, group = lane / 8;
    // XXH3's initial accumulators, lane by lane (a switch, not a table the
    // lane indexes: that table would be local memory).
    uint64_t acc;
    switch (acc_lane) {
        case 0: acc = XXH_P32_3; break;
        case 1: acc = XXH_P64_1; break;
        case 2: acc = XXH_P64_2; break;
        case 3: acc = XXH_P64_3; break;
        case 4: acc = XXH_P64_4; break;
        case 5: acc = XXH_P32_2; break;
        case 6: acc = XXH_P64_5; break;
        default: acc = XXH_P32_1; break;
    }
    uint64_t blocks = (w.len - 1) / XXH_BLOCK;
    for (uint64_t b = 0; b < blocks; b++) {
        uint64_t share = 0;
        for (uint32_t s = group; s < 16; s += 4) {
            share += stripe_share(w, b * XXH_BLOCK + s * XXH_STRIPE, secret + 8 * s, acc_lane);
        }
        acc += group_sum(share);
        acc ^= acc >> 47;
        acc ^= bytes64(secret + XXH_SECRET_BYTES - XXH_STRIPE + 8 * acc_lane);
        acc *= XXH_P32_1;
    }
    // The last, partial block's whole stripes, then the input's last 64 bytes.
    uint64_t stripes = ((w.len - 1) - XXH_BLOCK * blocks) / XXH_STRIPE;
    uint64_t share = 0;
    for (uint32_t s = group; s < stripes; s += 4) {
        share += stripe_share(w, blocks * XXH_BLOCK + s * XXH_STRIPE, secret + 8 * s, acc_lane);
    }
    if (group == 0) {
        share += stripe_share(w, w.len - XXH_STRIPE, secret + XXH_SECRET_BYTES - XXH_STRIPE - 7,
                              acc_lane);
    }
    acc += group_sum(share);
    // Lanes 0..8 hold the eight accumulators.
    uint64_t result = w.len * XXH_P64_1;
    for (uint32_t i = 0; i < 4; i++) {
        uint64_t even = __shfl_sync(FULL_MASK, acc, 2 * i);
        uint64_t odd = __shfl_sync(FULL_MASK, acc, 2 * i + 1);
        result += mul_fold(even ^ bytes64(secret + 11 + 16 * i), odd ^ bytes64(secret + 11 + 16 * i + 8));
    }
    if (lane == 0) *out = xxh3_avalanche(result);
}
