// lpmm's kernels: the descriptors, tiles and memory access every other file uses. Each function
// of this program mirrors the CPU reference routine named in its comment (crates/lpmm-optim,
// crates/lpmm-formats, crates/lpmm-quant); docs/FORMATS.md and docs/OPTIMIZERS.md define them,
// and crates/lpmm-wgpu/kernels/ is the same program in WGSL, file for file.
//
// One block handles one tile: up to TILE consecutive elements of one item (a range of one
// parameter piece). Thread t owns elements PER t .. PER t + PER of the tile: 16 is a multiple of
// every packing (bf16 pairs, 8-bit and 4-bit codes), so every storage word belongs to one
// thread, and the 16 elements are one ChaCha block of random words. Quantization blocks
// (32 ..= 4096 elements, powers of two) fall whole inside a tile, so a block's absmax is a
// reduction over the threads that own it.
//
// Compiled to PTX by `cargo xtask kernels` (NVRTC, options in src/kernels.rs: no contraction of
// a * b + c, IEEE division and square root, subnormals kept), and to host code by
// kernels/emulate.cpp for the tests on machines without a GPU.

// A region's address (abi.rs) is a pointer: CUDA has no bindings. An element region's points at
// the item's first element (the arena's words, or a lent parameter's buffer); a tensor-wide
// region's at the region's start.

struct Tile {
    bool valid;
    // The item's descriptor.
    const Desc* d;
    // The tile's first element, item-relative.
    uint32_t start;
    // Elements in the tile.
    uint32_t n;
};

// The item of block `index`: the last descriptor whose first tile is at or before it.
__device__ __forceinline__ Tile tile_of(const Desc* descs, uint32_t ndesc) {
    Tile t;
    uint64_t index = blockIdx.x;
    uint32_t lo = 0u;
    uint32_t hi = ndesc;
    while (hi - lo > 1u) {
        uint32_t mid = (lo + hi) / 2u;
        if (descs[mid].tile_begin <= index) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    // The block's descriptor is read by every thread for every element: copied once into
    // shared memory, every later read is a broadcast from it instead of a global load (8-bit
    // AdamW's step 1.21x faster on an H200 with the bucket search, docs/BENCHMARKS.md). The
    // WGSL program reads its descriptor in place.
    __shared__ Desc desc;
    if (ndesc > 0u) {
        const uint32_t* from = reinterpret_cast<const uint32_t*>(&descs[lo]);
        uint32_t* to = reinterpret_cast<uint32_t*>(&desc);
        for (uint32_t k = threadIdx.x; k < (uint32_t)(sizeof(Desc) / 4u); k += THREADS) {
            to[k] = from[k];
        }
    }
    __syncthreads();
    t.d = &desc;
    uint64_t start = (index - t.d->tile_begin) * TILE;
    uint64_t len = t.d->len;
    t.valid = ndesc > 0u && index >= t.d->tile_begin && start < len;
    t.start = (uint32_t)start;
    t.n = t.valid ? (uint32_t)(len - start < TILE ? len - start : TILE) : 0u;
    return t;
}

// The elements thread `lt` owns in its tile (16, fewer at the end of an item).
__device__ __forceinline__ uint32_t thread_count(const Tile& t, uint32_t lt) {
    uint32_t first = PER * lt;
    if (first >= t.n) {
        return 0u;
    }
    return t.n - first < PER ? t.n - first : PER;
}

__device__ __forceinline__ uint32_t slot_format(const Tile& t, uint32_t s) {
    return t.d->slots[s].format;
}

__device__ __forceinline__ uint32_t slot_aux(const Tile& t, uint32_t s) {
    return t.d->slots[s].aux;
}

__device__ __forceinline__ uint32_t* region(const Tile& t, uint32_t s, uint32_t r) {
    return reinterpret_cast<uint32_t*>(t.d->slots[s].region[r]);
}

__device__ __forceinline__ uint32_t f2u(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float u2f(uint32_t x) { return __uint_as_float(x); }

// Word k of a region.
__device__ __forceinline__ uint32_t rd(const uint32_t* a, uint64_t k) { return a[k]; }

__device__ __forceinline__ void wr(uint32_t* a, uint64_t k, uint32_t v) { a[k] = v; }

// Atomics on tensor-wide regions (folds).
__device__ __forceinline__ void wide_max(uint32_t* a, uint64_t k, uint32_t v) {
    atomicMax(a + k, v);
}

__device__ __forceinline__ uint32_t wide_add(uint32_t* a, uint64_t k, uint32_t v) {
    return atomicAdd(a + k, v);
}

// The tensor index of item element `i` (rank-1 and factorized states).
__device__ __forceinline__ uint64_t global_index(const Tile& t, uint32_t i) {
    return t.d->global + i;
}

__device__ __forceinline__ float bf16_value(uint32_t h);
__device__ __forceinline__ uint32_t bf16_nearest(float x);

// Item element `i` of the io values: the input (f32, or bf16 with F_INPUT_BF16) at `Desc::io`,
// the address of element 0.
__device__ __forceinline__ float io_load(const Tile& t, uint32_t i) {
    if ((t.d->flags & F_INPUT_BF16) != 0u) {
        return bf16_value(reinterpret_cast<const uint16_t*>(t.d->io)[i]);
    }
    return reinterpret_cast<const float*>(t.d->io)[i];
}

// Writes the thread's decoded values (f32, or bf16 nearest with F_OUTPUT_BF16: 16-bit stores,
// so a caller's buffer may start at any element).
__device__ __forceinline__ void io_store(const Tile& t, uint32_t first, const float v[16],
                                         uint32_t count) {
    if ((t.d->flags & F_OUTPUT_BF16) != 0u) {
        uint16_t* out = reinterpret_cast<uint16_t*>(t.d->io) + first;
        for (uint32_t j = 0u; j < count; j++) {
            out[j] = (uint16_t)bf16_nearest(v[j]);
        }
        return;
    }
    float* out = reinterpret_cast<float*>(t.d->io) + first;
    for (uint32_t j = 0u; j < count; j++) {
        out[j] = v[j];
    }
}

// What one element's update produced (rule.rs `Updated` and the states).
struct Update {
    float p;
    float d;
    float m;
    float v;
    float w;
};

// 64-bit unsigned integers (WGSL composes them from two words; CUDA has them).
__device__ __forceinline__ uint64_t shl64(uint64_t v, uint32_t s) {
    return s >= 64u ? 0ull : v << s;
}

__device__ __forceinline__ uint64_t shr64(uint64_t v, uint32_t s) {
    return s >= 64u ? 0ull : v >> s;
}

// Bits needed for `v` (0 for zero).
__device__ __forceinline__ uint32_t bitlen64(uint64_t v) {
    return 64u - (uint32_t)__clzll((long long)v);
}

// Adds `v` to the 64-bit integer in words 2k (low) and 2k + 1 (high) of a tensor-wide region:
// exact in any order (factored.rs `add64`).
__device__ __forceinline__ void wide_add64(uint32_t* a, uint64_t k, uint64_t v) {
    uint32_t lo = (uint32_t)v;
    uint32_t old = wide_add(a, 2u * k, lo);
    uint32_t carry = old > 0xFFFFFFFFu - lo ? 1u : 0u;
    uint32_t hi = (uint32_t)(v >> 32) + carry;
    if (hi != 0u) {
        wide_add(a, 2u * k + 1u, hi);
    }
}
