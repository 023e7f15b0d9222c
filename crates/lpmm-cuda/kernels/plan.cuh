// The specialized fused steps (crates/lpmm-backend/src/plans.rs): one kernel per hot plan, each a
// `plan_step` with the rule, every slot's format (as a lane type below) and the gradient's input
// fixed at compile time; `cargo xtask codegen` writes their entries after this file. They compute
// what `lpmm_step` computes for the same items, with the same functions in the same order (the
// rule's `rule_<name>_apply`, `fits`, bf16 and split rounding, the random draws): only the memory
// access and the code search differ, and the search gives the same count of thresholds.
//
// What differs from `lpmm_step`:
// - no format or rule dispatch: each slot's loads and stores are its lane's, inlined;
// - a thread's 16 elements move in 16-byte accesses (8 bytes for 4-bit codes): the host hands a
//   plan's kernel only items whose regions and io start at a multiple of 16 bytes, and whose
//   length is a multiple of every quantized slot's block (abi::PER-element threads are whole or
//   idle, blocks whole; lpmm-backend's Device steps the rest with `lpmm_step`);
// - a block's absmax is a warp shuffle over the threads that own it (blocks up to 512 elements,
//   32 threads), not a shared-memory tree with barriers;
// - each quantized slot's code map (values, thresholds, key table; lpmm-formats
//   `CodeMap::key_table`) is in shared memory, and the nearest code is two reads and one
//   comparison;
// - a block walks a contiguous range of tiles (the grid is sized to the device), so the maps are
//   loaded once per block, and reads its descriptor's fields once per tile.
// Only what a plan has is loaded or stored; nothing is indexed by a run-time value but memory.

#define PLAN_IO_NONE 0u
#define PLAN_IO_F32 1u
#define PLAN_IO_BF16 2u

// A region's words, as global memory: descriptors carry addresses as integers, so the compiler
// cannot tell global memory from shared, and plain accesses would be generic (LD/ST) ones. The
// host build (emulate.cpp) has no PTX: plain accesses.
#ifdef LPMM_HOST
__device__ __forceinline__ uint4 plan_ld4(const uint32_t* p) {
    return *reinterpret_cast<const uint4*>(p);
}

__device__ __forceinline__ uint2 plan_ld2(const uint32_t* p) {
    return *reinterpret_cast<const uint2*>(p);
}

__device__ __forceinline__ uint32_t plan_ld1(const uint32_t* p) { return *p; }

__device__ __forceinline__ void plan_st4(uint32_t* p, uint32_t a, uint32_t b, uint32_t c,
                                         uint32_t d) {
    uint4 v;
    v.x = a;
    v.y = b;
    v.z = c;
    v.w = d;
    *reinterpret_cast<uint4*>(p) = v;
}

__device__ __forceinline__ void plan_st2(uint32_t* p, uint32_t a, uint32_t b) {
    uint2 v;
    v.x = a;
    v.y = b;
    *reinterpret_cast<uint2*>(p) = v;
}

__device__ __forceinline__ void plan_st1(uint32_t* p, uint32_t a) { *p = a; }
#else
// Loads are ordered after every earlier store by the stores' memory clobber; a thread loads
// nothing another thread of the launch stores but an accumulator's absmax, which is cleared
// after a `__syncwarp` (plan_step).
__device__ __forceinline__ uint4 plan_ld4(const uint32_t* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ uint2 plan_ld2(const uint32_t* p) {
    uint2 v;
    asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ uint32_t plan_ld1(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ void plan_st4(uint32_t* p, uint32_t a, uint32_t b, uint32_t c,
                                         uint32_t d) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c),
                 "r"(d)
                 : "memory");
}

__device__ __forceinline__ void plan_st2(uint32_t* p, uint32_t a, uint32_t b) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}

__device__ __forceinline__ void plan_st1(uint32_t* p, uint32_t a) {
    asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(a) : "memory");
}
#endif

// The 16-bit value of element `i` of a region of halves.
__device__ __forceinline__ uint32_t plan_ld_half(const uint32_t* p, uint32_t i) {
    return (plan_ld1(p + i / 2u) >> (16u * (i & 1u))) & 0xFFFFu;
}

// Eight words of a region (a thread's 16 bf16 or 16-bit halves).
__device__ __forceinline__ void plan_ld8(const uint32_t* p, uint32_t w[8]) {
    uint4 a = plan_ld4(p);
    uint4 b = plan_ld4(p + 4u);
    w[0] = a.x;
    w[1] = a.y;
    w[2] = a.z;
    w[3] = a.w;
    w[4] = b.x;
    w[5] = b.y;
    w[6] = b.z;
    w[7] = b.w;
}

__device__ __forceinline__ void plan_st8(uint32_t* p, const uint32_t w[8]) {
    plan_st4(p, w[0], w[1], w[2], w[3]);
    plan_st4(p + 4u, w[4], w[5], w[6], w[7]);
}

// A code map in shared memory: its values (the last repeated to 256: CodeMap::value), its
// thresholds (NaN past the last: no comparison counts there) and its key table.
struct PlanMap {
    float values[256];
    float thresholds[256];
    uint32_t meta[64];
    unsigned char starts[512];
};

// Copies map `map` of the table (abi.rs `map_table`) into `m`. Called by every thread.
__device__ __forceinline__ void plan_load_map(PlanMap* m, const uint32_t* maps, uint32_t map) {
    uint32_t len = maps[MAP_LENS + map];
    const uint32_t* base = maps + MAP_STRIDE * map;
    for (uint32_t k = threadIdx.x; k < 256u; k += THREADS) {
        m->values[k] = u2f(base[k < len ? k : len - 1u]);
        m->thresholds[k] = k + 1u < len ? u2f(base[256u + k]) : u2f(0x7FC00000u);
    }
    const uint32_t* keys = maps + MAP_KEYS + MAP_KEY_WORDS * map;
    for (uint32_t k = threadIdx.x; k < 64u; k += THREADS) {
        m->meta[k] = keys[k];
    }
    uint32_t* starts = reinterpret_cast<uint32_t*>(m->starts);
    for (uint32_t k = threadIdx.x; k < 128u; k += THREADS) {
        starts[k] = keys[64u + k];
    }
}

// CodeMap::nearest for |y| < 2 (a quotient by its block's absmax is at most 1): the number of
// thresholds <= y, as the count at the bottom of y's key-table bucket plus one comparison (a
// bucket holds at most one threshold; codemap.rs `KeyTable`).
__device__ __forceinline__ uint32_t plan_nearest(const PlanMap* m, float y) {
    uint32_t h = f2u(y) >> 16u;
    uint32_t e = (h >> 7u) & 0xFFu;
    uint32_t b = e > 96u ? e - 96u : 0u;
    uint32_t meta = m->meta[((h >> 15u) << 5u) | b];
    uint32_t key = (meta & 0xFFFu) + ((h & 0x7Fu) >> (meta >> 12u));
    uint32_t c = m->starts[key];
    return c + (m->thresholds[c] <= y ? 1u : 0u);
}

// CodeMap::stochastic for |y| < 2 (maps.cuh `map_stochastic`), with selects for its early
// returns: the same code.
__device__ __forceinline__ uint32_t plan_stochastic(const PlanMap* m, uint32_t len, float y,
                                                    uint32_t r) {
    uint32_t c = plan_nearest(m, y);
    uint32_t below = m->values[c] > y ? 1u : 0u;
    bool under = below > c;
    uint32_t lo = under ? 0u : c - below;
    bool top = lo + 1u == len;
    float lo_v = m->values[lo];
    float hi_v = m->values[top ? lo : lo + 1u];
    float frac = (y - lo_v) / (hi_v - lo_v);
    float scaled = frac * 4294967296.0f;
    // Rust's saturating `as u32`.
    uint32_t cut = 0xFFFFFFFFu;
    if (scaled < 4294967296.0f) {
        cut = scaled > 0.0f ? (uint32_t)scaled : 0u;
    }
    uint32_t code = lo + (r < cut ? 1u : 0u);
    code = top ? lo : code;
    return under ? 0u : code;
}

// The cold path of a thread whose run of 16 elements is cut by its item's end (or past it): its
// accesses are scalar and cover only its `count` elements. It carries a marker instruction (a
// performance-monitor event, which does nothing else) so that the SASS analysis of the static
// gates (crates/lpmm-cuda/src/sass.rs) can tell it from the fast path.
#ifdef LPMM_HOST
#define PLAN_COLD()
#else
#define PLAN_COLD() asm volatile("pmevent 7;")
#endif

// The lanes: how a plan reaches one slot. `at` points the lane at a descriptor's slot; `load`
// decodes a thread's 16 elements from element `first` (a multiple of 16) with 16-byte accesses,
// `load_part` its first `count` (the rest 0) with scalar ones; `store` encodes them (with the
// slot's random draws `r` if it rounds stochastically; every thread of the warp calls it) and
// writes all 16 (`count` 16) or the first `count`; `clear` clears an accumulator's. Each mirrors
// formats/<name>.cuh.

// No slot: zeros in (the rule never changes a state it does not have), nothing out.
struct PlanAbsent {
    static constexpr uint32_t FMT = FMT_NONE;
    static constexpr bool PRESENT = false;
    static constexpr bool SR = false;
    static constexpr uint32_t QUANT = 0u;
    static constexpr uint32_t MAP = 0u;
    __device__ __forceinline__ void at(const Desc* d, uint32_t s, const PlanMap* m, uint32_t n) {}
    __device__ __forceinline__ void load(uint32_t first, float v[16]) const {
#pragma unroll
        for (int j = 0; j < 16; j++) {
            v[j] = 0.0f;
        }
    }
    __device__ __forceinline__ void load_part(uint32_t first, uint32_t count, float v[16]) const {
        load(first, v);
    }
    __device__ __forceinline__ void store(uint32_t first, uint32_t count, const float v[16],
                                          const uint32_t r[16]) const {}
    __device__ __forceinline__ void clear(uint32_t first, uint32_t count) const {}
};

// f32 (formats/f32.cuh).
struct PlanF32 {
    static constexpr uint32_t FMT = FMT_F32;
    static constexpr bool PRESENT = true;
    static constexpr bool SR = false;
    static constexpr uint32_t QUANT = 0u;
    static constexpr uint32_t MAP = 0u;
    uint32_t* a;
    __device__ __forceinline__ void at(const Desc* d, uint32_t s, const PlanMap* m, uint32_t n) {
        a = reinterpret_cast<uint32_t*>(d->slots[s].region[0]);
    }
    __device__ __forceinline__ void load(uint32_t first, float v[16]) const {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            uint4 w = plan_ld4(a + first + 4u * k);
            v[4 * k] = u2f(w.x);
            v[4 * k + 1] = u2f(w.y);
            v[4 * k + 2] = u2f(w.z);
            v[4 * k + 3] = u2f(w.w);
        }
    }
    __device__ __forceinline__ void load_part(uint32_t first, uint32_t count, float v[16]) const {
#pragma unroll
        for (int j = 0; j < 16; j++) {
            v[j] = (uint32_t)j < count ? u2f(plan_ld1(a + first + j)) : 0.0f;
        }
    }
    __device__ __forceinline__ void store(uint32_t first, uint32_t count, const float v[16],
                                          const uint32_t r[16]) const {
        if (count == 16u) {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                plan_st4(a + first + 4u * k, f2u(v[4 * k]), f2u(v[4 * k + 1]),
                         f2u(v[4 * k + 2]), f2u(v[4 * k + 3]));
            }
        } else {
            PLAN_COLD();
#pragma unroll
            for (int j = 0; j < 16; j++) {
                if ((uint32_t)j < count) {
                    plan_st1(a + first + j, f2u(v[j]));
                }
            }
        }
    }
    __device__ __forceinline__ void clear(uint32_t first, uint32_t count) const {
        if (count == 16u) {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                plan_st4(a + first + 4u * k, 0u, 0u, 0u, 0u);
            }
        } else {
            PLAN_COLD();
#pragma unroll
            for (int j = 0; j < 16; j++) {
                if ((uint32_t)j < count) {
                    plan_st1(a + first + j, 0u);
                }
            }
        }
    }
};

// Words `k < (count + 1) / 2` of a region of 16-bit halves at `p` (the rest 0).
__device__ __forceinline__ void plan_ld8_part(const uint32_t* p, uint32_t count, uint32_t w[8]) {
#pragma unroll
    for (int k = 0; k < 8; k++) {
        w[k] = (uint32_t)(2 * k) < count ? plan_ld1(p + k) : 0u;
    }
}

// Writes the 16-bit pairs of `w` (all 8 words when `count` is 16; else the words of the first
// `count` halves, a last odd half with 0 above it, as formats/bf16.cuh writes them).
__device__ __forceinline__ void plan_st8_count(uint32_t* p, uint32_t count, const uint32_t w[8]) {
    if (count == 16u) {
        plan_st8(p, w);
    } else {
        PLAN_COLD();
#pragma unroll
        for (int k = 0; k < 8; k++) {
            if ((uint32_t)(2 * k) < count) {
                plan_st1(p + k, (uint32_t)(2 * k + 1) < count ? w[k] : w[k] & 0xFFFFu);
            }
        }
    }
}

// bf16, nearest or stochastic (formats/bf16.cuh).
template <uint32_t AUX>
struct PlanBf16 {
    static constexpr uint32_t FMT = FMT_BF16;
    static constexpr bool PRESENT = true;
    static constexpr bool SR = (AUX & 1u) != 0u;
    static constexpr uint32_t QUANT = 0u;
    static constexpr uint32_t MAP = 0u;
    uint32_t* a;
    __device__ __forceinline__ void at(const Desc* d, uint32_t s, const PlanMap* m, uint32_t n) {
        a = reinterpret_cast<uint32_t*>(d->slots[s].region[0]);
    }
    __device__ __forceinline__ static void decode(const uint32_t w[8], float v[16]) {
#pragma unroll
        for (int k = 0; k < 8; k++) {
            v[2 * k] = bf16_value(w[k] & 0xFFFFu);
            v[2 * k + 1] = bf16_value(w[k] >> 16u);
        }
    }
    __device__ __forceinline__ void load(uint32_t first, float v[16]) const {
        uint32_t w[8];
        plan_ld8(a + first / 2u, w);
        decode(w, v);
    }
    __device__ __forceinline__ void load_part(uint32_t first, uint32_t count, float v[16]) const {
        uint32_t w[8];
        plan_ld8_part(a + first / 2u, count, w);
        decode(w, v);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            v[j] = (uint32_t)j < count ? v[j] : 0.0f;
        }
    }
    __device__ __forceinline__ void store(uint32_t first, uint32_t count, const float v[16],
                                          const uint32_t r[16]) const {
        uint32_t w[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            uint32_t h0;
            uint32_t h1;
            if (SR) {
                h0 = bf16_stochastic(v[2 * k], r[2 * k]);
                h1 = bf16_stochastic(v[2 * k + 1], r[2 * k + 1]);
            } else {
                h0 = bf16_nearest(v[2 * k]);
                h1 = bf16_nearest(v[2 * k + 1]);
            }
            w[k] = h0 | (h1 << 16u);
        }
        plan_st8_count(a + first / 2u, count, w);
    }
    __device__ __forceinline__ void clear(uint32_t first, uint32_t count) const {
        uint32_t w[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
        plan_st8_count(a + first / 2u, count, w);
    }
};

// Split f32: bf16 halves and remainders (formats/split_f32.cuh).
struct PlanSplit {
    static constexpr uint32_t FMT = FMT_SPLIT_F32;
    static constexpr bool PRESENT = true;
    static constexpr bool SR = false;
    static constexpr uint32_t QUANT = 0u;
    static constexpr uint32_t MAP = 0u;
    uint32_t* hi;
    uint32_t* rem;
    __device__ __forceinline__ void at(const Desc* d, uint32_t s, const PlanMap* m, uint32_t n) {
        hi = reinterpret_cast<uint32_t*>(d->slots[s].region[0]);
        rem = reinterpret_cast<uint32_t*>(d->slots[s].region[1]);
    }
    __device__ __forceinline__ static void decode(const uint32_t a[8], const uint32_t b[8],
                                                  float v[16]) {
#pragma unroll
        for (int j = 0; j < 16; j++) {
            uint32_t shift = 16u * (j & 1);
            uint32_t h = (a[j / 2] >> shift) & 0xFFFFu;
            uint32_t m = (b[j / 2] >> shift) & 0xFFFFu;
            h = (h - (m >= 0x8000u ? 1u : 0u)) & 0xFFFFu;
            v[j] = u2f((h << 16u) | m);
        }
    }
    __device__ __forceinline__ void load(uint32_t first, float v[16]) const {
        uint32_t a[8];
        uint32_t b[8];
        plan_ld8(hi + first / 2u, a);
        plan_ld8(rem + first / 2u, b);
        decode(a, b, v);
    }
    __device__ __forceinline__ void load_part(uint32_t first, uint32_t count, float v[16]) const {
        uint32_t a[8];
        uint32_t b[8];
        plan_ld8_part(hi + first / 2u, count, a);
        plan_ld8_part(rem + first / 2u, count, b);
        decode(a, b, v);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            v[j] = (uint32_t)j < count ? v[j] : 0.0f;
        }
    }
    __device__ __forceinline__ void store(uint32_t first, uint32_t count, const float v[16],
                                          const uint32_t r[16]) const {
        uint32_t a[8];
        uint32_t b[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            uint32_t h[2];
            uint32_t m[2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                uint32_t bits = f2u(v[2 * k + i]);
                if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
                    bits = (bits & 0x80000000u) | 0x7FC00000u;
                }
                m[i] = bits & 0xFFFFu;
                h[i] = ((bits >> 16u) + (m[i] >= 0x8000u ? 1u : 0u)) & 0xFFFFu;
            }
            a[k] = h[0] | (h[1] << 16u);
            b[k] = m[0] | (m[1] << 16u);
        }
        plan_st8_count(hi + first / 2u, count, a);
        plan_st8_count(rem + first / 2u, count, b);
    }
    __device__ __forceinline__ void clear(uint32_t first, uint32_t count) const {
        uint32_t w[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
        plan_st8_count(hi + first / 2u, count, w);
        plan_st8_count(rem + first / 2u, count, w);
    }
};

// Block-wise codes of 8 or 4 bits and one absmax per block (formats/blockwise.cuh), blocks of at
// most 512 elements: a block's threads are consecutive lanes of one warp.
template <uint32_t AUX>
struct PlanQuant {
    static constexpr uint32_t FMT = FMT_BLOCKWISE;
    static constexpr bool PRESENT = true;
    static constexpr bool SR = ((AUX >> 16u) & 1u) != 0u;
    static constexpr uint32_t QUANT = 1u;
    static constexpr uint32_t MAP = AUX & 0xFFu;
    static constexpr uint32_t LOG = (AUX >> 8u) & 0xFFu;
    static constexpr uint32_t BITS = AUX >> 24u;
    // Code words of a thread's 16 elements, and codes per word.
    static constexpr uint32_t WORDS = 16u * BITS / 32u;
    static constexpr uint32_t PER_WORD = 32u / BITS;
    // Threads per block.
    static constexpr uint32_t GROUP = (1u << LOG) / PER;
    static_assert(BITS == 8u || BITS == 4u, "8- or 4-bit codes");
    static_assert(GROUP >= 1u && GROUP <= 32u, "a block within one warp");
    uint32_t* codes;
    uint32_t* absmax;
    const PlanMap* m;
    uint32_t len;
    __device__ __forceinline__ void at(const Desc* d, uint32_t s, const PlanMap* map,
                                       uint32_t map_len) {
        codes = reinterpret_cast<uint32_t*>(d->slots[s].region[0]);
        absmax = reinterpret_cast<uint32_t*>(d->slots[s].region[1]);
        m = map;
        len = map_len;
    }
    __device__ __forceinline__ void decode(const uint32_t w[WORDS], float scale,
                                           float v[16]) const {
#pragma unroll
        for (int j = 0; j < 16; j++) {
            uint32_t code = (w[j / PER_WORD] >> (BITS * (j % PER_WORD))) & ((1u << BITS) - 1u);
            v[j] = m->values[code] * scale;
        }
    }
    __device__ __forceinline__ void load(uint32_t first, float v[16]) const {
        float scale = u2f(plan_ld1(absmax + (first >> LOG)));
        uint32_t w[WORDS];
        if (BITS == 8u) {
            uint4 x = plan_ld4(codes + first / 4u);
            w[0] = x.x;
            w[1] = x.y;
            w[2] = x.z;
            w[3] = x.w;
        } else {
            uint2 x = plan_ld2(codes + first / 8u);
            w[0] = x.x;
            w[1] = x.y;
        }
        decode(w, scale, v);
    }
    __device__ __forceinline__ void load_part(uint32_t first, uint32_t count, float v[16]) const {
        float scale = count > 0u ? u2f(plan_ld1(absmax + (first >> LOG))) : 0.0f;
        uint32_t w[WORDS];
#pragma unroll
        for (uint32_t k = 0u; k < WORDS; k++) {
            w[k] = k * PER_WORD < count ? plan_ld1(codes + first / PER_WORD + k) : 0u;
        }
        decode(w, scale, v);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            v[j] = (uint32_t)j < count ? v[j] : 0.0f;
        }
    }
    // Blockwise::quantize_block: the block's absmax (the largest |x| as bits, shuffled across
    // its threads; a thread's elements past `count` are 0), then each code nearest to (or
    // stochastically rounded from) x / absmax.
    __device__ __forceinline__ void store(uint32_t first, uint32_t count, const float v[16],
                                          const uint32_t r[16]) const {
        uint32_t local = 0u;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            uint32_t a = f2u(v[j]) & 0x7FFFFFFFu;
            local = a > local ? a : local;
        }
#pragma unroll
        for (uint32_t off = 1u; off < GROUP; off *= 2u) {
            uint32_t o = __shfl_xor_sync(0xFFFFFFFFu, local, off);
            local = o > local ? o : local;
        }
        float scale = u2f(local);
        // x / 1 for an all-zero block, whose quotients are then replaced by 0 (no branch; the
        // same codes).
        float den = scale != 0.0f ? scale : 1.0f;
        uint32_t w[WORDS];
#pragma unroll
        for (uint32_t k = 0u; k < WORDS; k++) {
            w[k] = 0u;
        }
#pragma unroll
        for (int j = 0; j < 16; j++) {
            float y = v[j] / den;
            y = scale != 0.0f ? y : 0.0f;
            uint32_t code = SR ? plan_stochastic(m, len, y, r[j]) : plan_nearest(m, y);
            w[j / PER_WORD] |= code << (BITS * (j % PER_WORD));
        }
        bool lead = (first & ((1u << LOG) - 1u)) == 0u;
        if (count == 16u) {
            if (BITS == 8u) {
                plan_st4(codes + first / 4u, w[0], w[1], w[2], w[3]);
            } else {
                plan_st2(codes + first / 8u, w[0], w[1]);
            }
            if (lead) {
                plan_st1(absmax + (first >> LOG), local);
            }
        } else if (count > 0u) {
            PLAN_COLD();
            // The words holding the first `count` codes, with 0 past them (as
            // formats/blockwise.cuh packs them).
#pragma unroll
            for (uint32_t k = 0u; k < WORDS; k++) {
                if (k * PER_WORD < count) {
                    uint32_t n = count - k * PER_WORD;
                    uint32_t keep = n >= PER_WORD ? 0xFFFFFFFFu : (1u << (BITS * n)) - 1u;
                    plan_st1(codes + first / PER_WORD + k, w[k] & keep);
                }
            }
            if (lead) {
                plan_st1(absmax + (first >> LOG), local);
            }
        }
    }
    // A zero absmax; 8-bit codes also get the code of 0 (formats/blockwise.cuh).
    __device__ __forceinline__ void clear(uint32_t first, uint32_t count) const {
        bool lead = (first & ((1u << LOG) - 1u)) == 0u;
        uint32_t zero = plan_nearest(m, 0.0f);
        uint32_t z = zero | (zero << 8u) | (zero << 16u) | (zero << 24u);
        if (count == 16u) {
            if (BITS == 8u) {
                plan_st4(codes + first / 4u, z, z, z, z);
            }
            if (lead) {
                plan_st1(absmax + (first >> LOG), 0u);
            }
        } else if (count > 0u) {
            PLAN_COLD();
            if (BITS == 8u) {
#pragma unroll
                for (uint32_t k = 0u; k < 4u; k++) {
                    if (4u * k < count) {
                        plan_st1(codes + first / 4u + k, z);
                    }
                }
            }
            if (lead) {
                plan_st1(absmax + (first >> LOG), 0u);
            }
        }
    }
};

// The index of the last descriptor whose first tile is at or before `tile`.
__device__ __forceinline__ uint32_t plan_search(const Desc* descs, uint32_t ndesc,
                                                uint32_t tile) {
    uint32_t lo = 0u;
    uint32_t hi = ndesc;
    while (hi - lo > 1u) {
        uint32_t mid = (lo + hi) / 2u;
        if (descs[mid].tile_begin <= tile) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// The random draws of slot `s` for a thread's 16 elements (random.cuh `thread_bits`), if the
// lane rounds stochastically.
template <class L>
__device__ __forceinline__ void plan_bits(const Tile& t, uint32_t lt, uint32_t s,
                                          uint64_t counter, uint32_t r[16]) {
    if (L::SR) {
        thread_bits(t, lt, s, counter, r);
    } else {
#pragma unroll
        for (int j = 0; j < 16; j++) {
            r[j] = 0u;
        }
    }
}

// entries.cuh `lpmm_step` for the items of one plan: rule `R` (a generated adapter over
// `rule_<name>_apply`), gradient input `IO`, lanes of the parameter, the accumulator and the
// three states. Every item is whole (see the top of this file), the parameter moves
// (F_UPDATE_PARAM), no state is given and nothing is a transform: the host sends other steps to
// `lpmm_step`.
template <class R, uint32_t IO, class P, class G, class S1, class S2, class S3>
__device__ __forceinline__ void plan_step(const Desc* descs, uint32_t ndesc, const uint32_t* maps,
                                          uint32_t* flags) {
    constexpr uint32_t IP = 0u;
    constexpr uint32_t IG = IP + P::QUANT;
    constexpr uint32_t I1 = IG + G::QUANT;
    constexpr uint32_t I2 = I1 + S1::QUANT;
    constexpr uint32_t I3 = I2 + S2::QUANT;
    constexpr uint32_t NQ = I3 + S3::QUANT;
    __shared__ PlanMap smap[NQ > 0u ? NQ : 1u];
    if (ndesc == 0u) {
        return;
    }
    // This block's tiles: a contiguous share of the launch's.
    const Desc* last = descs + (ndesc - 1u);
    uint32_t total = (uint32_t)(last->tile_begin + (last->len + TILE - 1u) / TILE);
    uint32_t per = (total + gridDim.x - 1u) / gridDim.x;
    uint32_t tile = blockIdx.x * per;
    uint32_t end = tile + per < total ? tile + per : total;
    if (tile >= end) {
        return;
    }
    if (P::QUANT) {
        plan_load_map(&smap[IP], maps, P::MAP);
    }
    if (G::QUANT) {
        plan_load_map(&smap[IG], maps, G::MAP);
    }
    if (S1::QUANT) {
        plan_load_map(&smap[I1], maps, S1::MAP);
    }
    if (S2::QUANT) {
        plan_load_map(&smap[I2], maps, S2::MAP);
    }
    if (S3::QUANT) {
        plan_load_map(&smap[I3], maps, S3::MAP);
    }
    __syncthreads();
    const uint32_t len_p = maps[MAP_LENS + P::MAP];
    const uint32_t len_1 = maps[MAP_LENS + S1::MAP];
    const uint32_t len_2 = maps[MAP_LENS + S2::MAP];
    const uint32_t len_3 = maps[MAP_LENS + S3::MAP];
    const uint32_t lt = threadIdx.x;
    uint32_t k = plan_search(descs, ndesc, tile);
    do {
        while (k + 1u < ndesc && descs[k + 1u].tile_begin <= tile) {
            k++;
        }
        const Desc* d = descs + k;
        Tile t;
        t.valid = true;
        t.d = d;
        t.start = (uint32_t)((tile - d->tile_begin) * TILE);
        uint32_t len = (uint32_t)d->len;
        t.n = len - t.start < TILE ? len - t.start : TILE;
        uint32_t first = t.start + PER * lt;
        // A thread's elements: 16, or fewer at its item's end (0 past it).
        uint32_t count = first < len ? (len - first < PER ? len - first : PER) : 0u;
        bool full = count == PER;
        // The descriptor's fields, read once (the stores below may alias nothing of it, but the
        // compiler cannot know).
        const typename R::C c = *reinterpret_cast<const typename R::C*>(d->consts);
        const float clip = d->clip;
        const uint32_t fl = (d->flags & F_FIRST) | F_UPDATE_PARAM;
        const uint64_t counter = d->step;
        const uint32_t flag_index = d->flag_index;
        const uint32_t* io = reinterpret_cast<const uint32_t*>(d->io);
        P p_lane;
        G g_lane;
        S1 s1_lane;
        S2 s2_lane;
        S3 s3_lane;
        p_lane.at(d, S_PARAM, &smap[IP], len_p);
        g_lane.at(d, S_GRAD, &smap[IG], 0u);
        s1_lane.at(d, S_STATE1, &smap[I1], len_1);
        s2_lane.at(d, S_STATE2, &smap[I2], len_2);
        s3_lane.at(d, S_STATE3, &smap[I3], len_3);
        float g[16];
        float x[16];
        float p[16];
        float m[16];
        float v[16];
        float w[16];
        if (full) {
            g_lane.load(first, g);
            if (IO == PLAN_IO_F32) {
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    uint4 y = plan_ld4(io + first + 4u * q);
                    x[4 * q] = u2f(y.x);
                    x[4 * q + 1] = u2f(y.y);
                    x[4 * q + 2] = u2f(y.z);
                    x[4 * q + 3] = u2f(y.w);
                }
            } else if (IO == PLAN_IO_BF16) {
                uint32_t y[8];
                plan_ld8(io + first / 2u, y);
                PlanBf16<0u>::decode(y, x);
            }
            p_lane.load(first, p);
            s1_lane.load(first, m);
            s2_lane.load(first, v);
            s3_lane.load(first, w);
        } else {
            PLAN_COLD();
            g_lane.load_part(first, count, g);
            if (IO == PLAN_IO_F32) {
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    x[j] = (uint32_t)j < count ? u2f(plan_ld1(io + first + j)) : 0.0f;
                }
            } else if (IO == PLAN_IO_BF16) {
                // 16-bit reads: a caller's bf16 buffer may end at any element.
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    x[j] = (uint32_t)j < count ? bf16_value(plan_ld_half(io, first + j)) : 0.0f;
                }
            }
            p_lane.load_part(first, count, p);
            s1_lane.load_part(first, count, m);
            s2_lane.load_part(first, count, v);
            s3_lane.load_part(first, count, w);
        }
        if (IO != PLAN_IO_NONE) {
            // entries.cuh `gradient`: the accumulator (0 without one) plus the input.
#pragma unroll
            for (int j = 0; j < 16; j++) {
                g[j] = g[j] + x[j];
            }
        }
        const uint32_t lim_p = fmt_limit(P::FMT);
        const uint32_t lim_1 = fmt_limit(S1::FMT);
        const uint32_t lim_2 = fmt_limit(S2::FMT);
        const uint32_t lim_3 = fmt_limit(S3::FMT);
        bool bad = false;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            float gi = g[j] * clip;
            Update u = R::apply(c, fl, p[j], gi, m[j], v[j], w[j]);
            // entries.cuh `step_ok`. Past `count` (all zeros) nothing is reported: every value
            // there is dropped.
            bool ok = fits(gi, LIMIT_F32) && fits(u.p, lim_p) && fits(u.d, LIMIT_F32) &&
                      fits(u.m, lim_1) && fits(u.v, lim_2) && fits(u.w, lim_3);
            m[j] = ok ? u.m : m[j];
            v[j] = ok ? u.v : v[j];
            w[j] = ok ? u.w : w[j];
            p[j] = ok ? u.p : p[j];
            bad = bad || (!ok && (uint32_t)j < count);
        }
        if (bad) {
            atomicOr(&flags[flag_index], 1u);
        }
        uint32_t r[16];
        plan_bits<S1>(t, lt, S_STATE1, counter, r);
        s1_lane.store(first, count, m, r);
        plan_bits<S2>(t, lt, S_STATE2, counter, r);
        s2_lane.store(first, count, v, r);
        plan_bits<S3>(t, lt, S_STATE3, counter, r);
        s3_lane.store(first, count, w, r);
        plan_bits<P>(t, lt, S_PARAM, counter, r);
        p_lane.store(first, count, p, r);
        // Every thread of a block has read the accumulator's absmax before it is zeroed.
        __syncwarp();
        g_lane.clear(first, count);
        tile++;
    } while (tile < end);
}
