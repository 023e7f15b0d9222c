// The specialized fused steps' memory access, code maps and lanes (crates/lpmm-backend/src/plans.rs:
// one kernel per hot plan, each a plan.cuh `plan_step` with the rule, every slot's format, as a
// lane type below, and the gradient's input fixed at compile time; `cargo xtask codegen` writes
// their entries after plan.cuh). They compute what `lpmm_step` computes for the same items: the
// fast path with exact.cuh's shortcuts (the same bits: docs/FORMATS.md §13), the cold path with
// the same functions in the same order as `lpmm_step` (the rule's `rule_<name>_apply`, `fits`,
// bf16 and split rounding, the random draws).
//
// What differs from `lpmm_step`:
// - no format or rule dispatch: each slot's loads and stores are its lane's, inlined;
// - a thread's 16 elements move in 16-byte accesses (8 bytes for 4-bit codes): the host hands a
//   plan's kernel only items whose regions and io start at a multiple of 16 bytes, and whose
//   length is a multiple of every quantized slot's block (abi::PER-element threads are whole or
//   idle, blocks whole; lpmm-backend's Device steps the rest with `lpmm_step`);
// - a block's absmax is a warp shuffle over the threads that own it (blocks up to 512 elements,
//   32 threads), not a shared-memory tree with barriers;
// - each quantized slot's code map (values, keys, bucket table, interval steps) is in shared
//   memory, built once per block, and a code is a table count plus one comparison;
// - a block walks a contiguous range of tiles (the grid is sized to the device), so the maps are
//   built once per block, and reads its descriptor's fields once per tile.
// Only what a plan has is loaded or stored; nothing is indexed by a run-time value but memory.
// `// sass: <category>` comments mark where each instruction goes in `cargo xtask kernels
// --report` (crates/lpmm-cuda/src/sass/lines.rs).

#define PLAN_IO_NONE 0u
#define PLAN_IO_F32 1u
#define PLAN_IO_BF16 2u

// A region's words, as global memory: descriptors carry addresses as integers, so the compiler
// cannot tell global memory from shared, and plain accesses would be generic (LD/ST) ones. The
// host build (emulate.cpp) has no PTX: plain accesses.
#ifdef LPMM_HOST
__device__ __forceinline__ uint4 plan_ld4(const uint32_t* p) {
    // sass: loads
    return *reinterpret_cast<const uint4*>(p);
}

__device__ __forceinline__ uint2 plan_ld2(const uint32_t* p) {
    // sass: loads
    return *reinterpret_cast<const uint2*>(p);
}

__device__ __forceinline__ uint32_t plan_ld1(const uint32_t* p) { return *p; }

__device__ __forceinline__ void plan_st4(uint32_t* p, uint32_t a, uint32_t b, uint32_t c,
                                         uint32_t d) {
    // sass: stores
    uint4 v;
    v.x = a;
    v.y = b;
    v.z = c;
    v.w = d;
    *reinterpret_cast<uint4*>(p) = v;
}

__device__ __forceinline__ void plan_st2(uint32_t* p, uint32_t a, uint32_t b) {
    // sass: stores
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
    // sass: loads
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ uint2 plan_ld2(const uint32_t* p) {
    // sass: loads
    uint2 v;
    asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ uint32_t plan_ld1(const uint32_t* p) {
    // sass: loads
    uint32_t v;
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ void plan_st4(uint32_t* p, uint32_t a, uint32_t b, uint32_t c,
                                         uint32_t d) {
    // sass: stores
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c),
                 "r"(d)
                 : "memory");
}

__device__ __forceinline__ void plan_st2(uint32_t* p, uint32_t a, uint32_t b) {
    // sass: stores
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}

__device__ __forceinline__ void plan_st1(uint32_t* p, uint32_t a) {
    // sass: stores
    asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(a) : "memory");
}
#endif

// The 16-bit value of element `i` of a region of halves.
__device__ __forceinline__ uint32_t plan_ld_half(const uint32_t* p, uint32_t i) {
    // sass: loads
    return (plan_ld1(p + i / 2u) >> (16u * (i & 1u))) & 0xFFFFu;
}

// Eight words of a region (a thread's 16 bf16 or 16-bit halves).
__device__ __forceinline__ void plan_ld8(const uint32_t* p, uint32_t w[8]) {
    // sass: loads
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
    // sass: stores
    plan_st4(p, w[0], w[1], w[2], w[3]);
    plan_st4(p + 4u, w[4], w[5], w[6], w[7]);
}

// The code maps of a plan (plan.cuh `plan_maps`: at most PLAN_MAPS), in one shared byte array
// for every plan's kernel, so that addresses are constants. Map k's keys are the sorted table its
// stores search: its thresholds for nearest rounding (NaN past the last: no comparison counts
// there), its values for stochastic rounding (NaN past the last). Its bucket table (exact.cuh
// `exact_bucket`: the number of keys at or below each bucket's lowest value) lies at k 0x1000 for
// the buckets of a sign bit 0, and 0x8000 above that for the others; in the space between, at
// 0x3000 + k 0x800, its values (the last repeated to 256: CodeMap::value) and keys, at 0x4800 +
// 4 k the code of 0 (an accumulator's clear), and at 0x4810 + k 0x1010 (stochastic rounding) the
// step of each interval between values (plan_stochastic).
#define PLAN_MAPS 3u
alignas(16) __shared__ unsigned char plan_sm[0x8000u + 0x1000u * PLAN_MAPS];

__device__ __forceinline__ float* plan_values(uint32_t k) {
    return reinterpret_cast<float*>(plan_sm + 0x3000u + 0x800u * k);
}

__device__ __forceinline__ float* plan_keys(uint32_t k) {
    return reinterpret_cast<float*>(plan_sm + 0x3400u + 0x800u * k);
}

// The code of 0 in every byte (8-bit codes: an accumulator's clear).
__device__ __forceinline__ uint32_t* plan_zero(uint32_t k) {
    return reinterpret_cast<uint32_t*>(plan_sm + 0x4800u + 4u * k);
}

// The bucket of y in map k's table: exact.cuh's linear buckets (LINEAR) or its logarithmic ones.
template <bool LINEAR>
__device__ __forceinline__ uint32_t plan_bucket(uint32_t k, float y) {
    // sass: search
    return 0x1000u * k + (LINEAR ? exact_linear_bucket(y) : exact_bucket(y));
}

// Interval i of map k, for a y with i values at or below it (0 ..= len): the lower value lo_v
// (x), the step den = hi_v - lo_v (y) and rden = RN(1 / den) (z) of CodeMap::stochastic's
// fraction (y - lo_v) / den, as exact.cuh's exact_quotient divides it. Below the first value (i =
// 0) every fraction is at least 1 (lo_v -2, den and rden 1: the draw always rounds up, to code
// 0); at or above the last (i = len) every fraction is 0 (rden 0: the last code).
__device__ __forceinline__ uint4* plan_steps(uint32_t k) {
    return reinterpret_cast<uint4*>(plan_sm + 0x4810u + 0x1010u * k);
}

// Copies map `map` of the table (abi.rs `map_table`) into shared map k, with its keys for
// stochastic rounding (`sr`) or nearest rounding. Called by every thread; the bucket table needs
// the keys (plan_build_map, after a barrier).
__device__ __forceinline__ void plan_load_map(uint32_t k, const uint32_t* maps, uint32_t map,
                                              bool sr) {
    uint32_t len = maps[MAP_LENS + map];
    const uint32_t* base = maps + MAP_STRIDE * map;
    for (uint32_t i = threadIdx.x; i < 256u; i += THREADS) {
        plan_values(k)[i] = u2f(base[i < len ? i : len - 1u]);
        if (sr) {
            plan_keys(k)[i] = i < len ? u2f(base[i]) : u2f(0x7FC00000u);
        } else {
            plan_keys(k)[i] = i + 1u < len ? u2f(base[256u + i]) : u2f(0x7FC00000u);
        }
    }
    for (uint32_t i = threadIdx.x; sr && i <= len; i += THREADS) {
        uint4 e;
        e.w = 0u;
        if (i == 0u) {
            e.x = f2u(-2.0f);
            e.y = f2u(1.0f);
            e.z = f2u(1.0f);
        } else if (i == len) {
            e.x = base[len - 1u];
            e.y = f2u(1.0f);
            e.z = 0u;
        } else {
            float lo = u2f(base[i - 1u]);
            float den = u2f(base[i]) - lo;
            e.x = f2u(lo);
            e.y = f2u(den);
            e.z = f2u(1.0f / den);
        }
        plan_steps(k)[i] = e;
    }
    if (threadIdx.x == 0u) {
        // CodeMap::nearest(0): the thresholds at or below 0 (binary search).
        uint32_t c = 0u;
        for (uint32_t step = 128u; step > 0u; step /= 2u) {
            uint32_t at = c + step - 1u;
            c = at + 1u < len && u2f(base[256u + at]) <= 0.0f ? c + step : c;
        }
        *plan_zero(k) = c * 0x01010101u;
    }
}

// The bucket table of shared map k (after plan_load_map and a barrier): for logarithmic buckets
// the keys at or below each bucket's lowest value, for linear ones the keys of the buckets below
// (a binary search: the linear bucket is monotone in the key). Called by every thread.
__device__ __forceinline__ void plan_build_map(uint32_t k, bool linear) {
    const float* keys = plan_keys(k);
    for (uint32_t i = threadIdx.x; linear && i <= 256u; i += THREADS) {
        uint32_t c = 0u;
        for (uint32_t step = 128u; step > 0u; step /= 2u) {
            float key = keys[c + step - 1u];
            c = key == key && exact_linear_bucket(key) < i ? c + step : c;
        }
        plan_sm[0x1000u * k + i] = (unsigned char)c;
    }
    for (uint32_t i = threadIdx.x; !linear && i < 0x2000u; i += THREADS) {
        uint32_t b = i < 0x1000u ? i : i + 0x7000u;
        plan_sm[0x1000u * k + b] = (unsigned char)exact_count(keys, exact_bucket_low(b));
    }
}

// The 16 bytes at shared address p in one load. An explicit vector load: NVVM otherwise splits
// some of these into word loads, differently from one compilation to the next (the PTX must be
// the same every time: tests/ptx.rs).
__device__ __forceinline__ uint4 plan_lds4(const uint4* p) {
#ifdef LPMM_HOST
    return *p;
#else
    uint4 v;
    uint32_t at = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(at));
    return v;
#endif
}

// Where a <= b: x += dx and y += dy; where a < b (unsigned): x += dx. One comparison and
// predicated adds (the compiler's form of these selects a sum or adds a select).
__device__ __forceinline__ void plan_add2_if_le(float a, float b, uint32_t& x, uint32_t dx,
                                                uint32_t& y, uint32_t dy) {
#ifdef LPMM_HOST
    if (a <= b) {
        x += dx;
        y += dy;
    }
#else
    asm("{\n\t.reg .pred p;\n\tsetp.le.f32 p, %2, %3;\n\t@p add.u32 %0, %0, %4;\n\t"
        "@p add.u32 %1, %1, %5;\n\t}"
        : "+r"(x), "+r"(y)
        : "f"(a), "f"(b), "r"(dx), "r"(dy));
#endif
}

__device__ __forceinline__ void plan_add_if_lt(uint32_t a, uint32_t b, uint32_t& x, uint32_t dx) {
#ifdef LPMM_HOST
    if (a < b) {
        x += dx;
    }
#else
    asm("{\n\t.reg .pred p;\n\tsetp.lt.u32 p, %1, %2;\n\t@p add.u32 %0, %0, %3;\n\t}"
        : "+r"(x)
        : "r"(a), "r"(b), "r"(dx));
#endif
}

// CodeMap::nearest for |y| <= 1 (a quotient by its block's absmax) with map k, added to `word` at
// bit `at` (the packing: see PlanQuant::store): the number of thresholds at or below y, as the
// count at the bottom of y's bucket plus one comparison (a bucket holds at most one threshold:
// plans.rs checks it of every map a plan quantizes with).
template <bool LINEAR>
__device__ __forceinline__ void plan_nearest(uint32_t k, float y, uint32_t& word, uint32_t at) {
    // sass: search
    uint32_t c = plan_sm[plan_bucket<LINEAR>(k, y)];
    // sass: pack
    word += c << at;
    // sass: search
    uint32_t unused = 0u;
    plan_add2_if_le(plan_keys(k)[c], y, word, 1u << at, unused, 0u);
}

// CodeMap::stochastic for |y| <= 1 (a quotient by its block's absmax) with map k and the draw r,
// added to `word` at bit `at` less 1 (the packing: see PlanQuant::store): i = the number of values
// at or below y (the count at the bottom of y's bucket, plus one where the interval's next value
// is at or below y: the next interval's entry), then the code below y (i - 1) plus one where r <
// floor(frac 2^32) (saturating), frac = (y - lo_v) / (hi_v - lo_v) in f32 as exact_quotient
// divides it (plan_steps: 0 where y is at or above the last value, at least 1 below the first).
// CodeMap::stochastic's `lo` is i - 1: the nearest code less one where its value is above y.
template <bool LINEAR>
__device__ __forceinline__ void plan_stochastic(uint32_t k, float y, uint32_t r, uint32_t& word,
                                                uint32_t at) {
    // sass: search
    uint32_t i = plan_sm[plan_bucket<LINEAR>(k, y)];
    // sass: pack
    word += i << at;
    // sass: search
    plan_add2_if_le(plan_keys(k)[i], y, word, 1u << at, i, 1u);
    uint4 e = plan_lds4(plan_steps(k) + i);
    float frac = exact_quotient(y - u2f(e.x), u2f(e.y), u2f(e.z));
    // Rust's saturating `as u32` of frac 2^32 (frac >= +0: at most 1, but below the first value),
    // as the comparison with the draw sees it: from 2^32 up the reference's cut is 2^32 - 1, here
    // the largest f32 below 2^32 truncated (2^32 - 256); every draw (at most 0xFFFF0000) is below
    // both.
    uint32_t cut = (uint32_t)fminf(frac * 4294967296.0f, 4294967040.0f);
    plan_add_if_lt(r, cut, word, 1u << at);
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

// The host emulation's test hook (kernels/emulate.cpp `lpmm_emulate_force_cold`): with it, every
// thread takes every cold path it has, so that the tests hold those to the reference's bits too.
#ifdef LPMM_HOST
#define PLAN_FORCE_COLD lpmm_force_cold
#else
#define PLAN_FORCE_COLD false
#endif

// The lanes: how a plan reaches one slot. `at` points the lane at a descriptor's slot; `load`
// decodes a thread's 16 elements from element `first` (a multiple of 16) with 16-byte accesses,
// `load_part` its first `count` (the rest 0) with scalar ones; `store` encodes them (with the
// slot's random draws `r` if it rounds stochastically; every thread of the warp calls it) and
// writes all 16 (`count` 16) or the first `count`; `clear` clears an accumulator's. Each mirrors
// formats/<name>.cuh. `store` rounds as exact.cuh does where `exact` is false (the thread's
// values passed the fast checks, plan_step: each is within the lane's FAST_LIMIT), and as its
// format does otherwise. FAST_LIMIT is the largest magnitude (f32 bits) the fast checks let
// through: the format's limit (format/mod.rs `fits`), or less where exact.cuh needs less.

// No slot: zeros in (the rule never changes a state it does not have), nothing out.
struct PlanAbsent {
    static constexpr uint32_t FMT = FMT_NONE;
    static constexpr uint32_t FAST_LIMIT = LIMIT_F32;
    static constexpr bool PRESENT = false;
    static constexpr bool SR = false;
    static constexpr bool LINEAR = false;
    static constexpr uint32_t QUANT = 0u;
    static constexpr uint32_t MAP = 0u;
    __device__ __forceinline__ void at(const Desc* d, uint32_t s, uint32_t k, uint32_t n) {}
    __device__ __forceinline__ void load(uint32_t first, float v[16]) const {
        // sass: loads
#pragma unroll
        for (int j = 0; j < 16; j++) {
            v[j] = 0.0f;
        }
    }
    __device__ __forceinline__ void load_part(uint32_t first, uint32_t count, float v[16]) const {
        // sass: loads
        load(first, v);
    }
    __device__ __forceinline__ void store(uint32_t first, uint32_t count, const float v[16],
                                          const uint32_t r[16], bool exact) const {}
    __device__ __forceinline__ void clear(uint32_t first, uint32_t count) const {}
};

// f32 (formats/f32.cuh).
struct PlanF32 {
    static constexpr uint32_t FMT = FMT_F32;
    static constexpr uint32_t FAST_LIMIT = LIMIT_F32;
    static constexpr bool PRESENT = true;
    static constexpr bool SR = false;
    static constexpr bool LINEAR = false;
    static constexpr uint32_t QUANT = 0u;
    static constexpr uint32_t MAP = 0u;
    uint32_t* a;
    __device__ __forceinline__ void at(const Desc* d, uint32_t s, uint32_t k, uint32_t n) {
        a = reinterpret_cast<uint32_t*>(d->slots[s].region[0]);
    }
    __device__ __forceinline__ void load(uint32_t first, float v[16]) const {
        // sass: loads
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
        // sass: loads
#pragma unroll
        for (int j = 0; j < 16; j++) {
            v[j] = (uint32_t)j < count ? u2f(plan_ld1(a + first + j)) : 0.0f;
        }
    }
    __device__ __forceinline__ void store(uint32_t first, uint32_t count, const float v[16],
                                          const uint32_t r[16], bool exact) const {
        // sass: stores
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
        // sass: stores
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
    // sass: loads
#pragma unroll
    for (int k = 0; k < 8; k++) {
        w[k] = (uint32_t)(2 * k) < count ? plan_ld1(p + k) : 0u;
    }
}

// Writes the 16-bit pairs of `w` (all 8 words when `count` is 16; else the words of the first
// `count` halves, a last odd half with 0 above it, as formats/bf16.cuh writes them).
__device__ __forceinline__ void plan_st8_count(uint32_t* p, uint32_t count, const uint32_t w[8]) {
    // sass: stores
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
    static constexpr bool LINEAR = false;
    // exact.cuh: bf16 rounding without its non-finite and overflow cases.
    static constexpr uint32_t FAST_LIMIT = SR ? 0x7F7EFFFFu : 0x7F7F7FFFu;
    static constexpr uint32_t QUANT = 0u;
    static constexpr uint32_t MAP = 0u;
    uint32_t* a;
    __device__ __forceinline__ void at(const Desc* d, uint32_t s, uint32_t k, uint32_t n) {
        a = reinterpret_cast<uint32_t*>(d->slots[s].region[0]);
    }
    __device__ __forceinline__ static void decode(const uint32_t w[8], float v[16]) {
        // sass: decode
#pragma unroll
        for (int k = 0; k < 8; k++) {
            v[2 * k] = bf16_value(w[k] & 0xFFFFu);
            v[2 * k + 1] = bf16_value(w[k] >> 16u);
        }
    }
    __device__ __forceinline__ void load(uint32_t first, float v[16]) const {
        // sass: loads
        uint32_t w[8];
        plan_ld8(a + first / 2u, w);
        decode(w, v);
    }
    __device__ __forceinline__ void load_part(uint32_t first, uint32_t count, float v[16]) const {
        // sass: loads
        uint32_t w[8];
        plan_ld8_part(a + first / 2u, count, w);
        decode(w, v);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            v[j] = (uint32_t)j < count ? v[j] : 0.0f;
        }
    }
    __device__ __forceinline__ void store(uint32_t first, uint32_t count, const float v[16],
                                          const uint32_t r[16], bool exact) const {
        // sass: round
        uint32_t w[8];
        if (exact) {
            PLAN_COLD();
#pragma unroll
            for (int k = 0; k < 8; k++) {
                uint32_t h0 = SR ? bf16_stochastic(v[2 * k], r[2 * k]) : bf16_nearest(v[2 * k]);
                uint32_t h1 =
                    SR ? bf16_stochastic(v[2 * k + 1], r[2 * k + 1]) : bf16_nearest(v[2 * k + 1]);
                w[k] = h0 | (h1 << 16u);
            }
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) {
                uint32_t h0 = SR ? exact_bf16_stochastic(v[2 * k], r[2 * k])
                                 : exact_bf16_nearest(v[2 * k]);
                uint32_t h1 = SR ? exact_bf16_stochastic(v[2 * k + 1], r[2 * k + 1])
                                 : exact_bf16_nearest(v[2 * k + 1]);
                w[k] = exact_pack_halves(h0, h1);
            }
        }
        // sass: stores
        plan_st8_count(a + first / 2u, count, w);
    }
    __device__ __forceinline__ void clear(uint32_t first, uint32_t count) const {
        // sass: stores
        uint32_t w[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
        plan_st8_count(a + first / 2u, count, w);
    }
};

// Split f32: bf16 halves and remainders (formats/split_f32.cuh).
struct PlanSplit {
    static constexpr uint32_t FMT = FMT_SPLIT_F32;
    static constexpr uint32_t FAST_LIMIT = 0x7F7F7FFFu;
    static constexpr bool PRESENT = true;
    static constexpr bool SR = false;
    static constexpr bool LINEAR = false;
    static constexpr uint32_t QUANT = 0u;
    static constexpr uint32_t MAP = 0u;
    uint32_t* hi;
    uint32_t* rem;
    __device__ __forceinline__ void at(const Desc* d, uint32_t s, uint32_t k, uint32_t n) {
        hi = reinterpret_cast<uint32_t*>(d->slots[s].region[0]);
        rem = reinterpret_cast<uint32_t*>(d->slots[s].region[1]);
    }
    __device__ __forceinline__ static void decode(const uint32_t a[8], const uint32_t b[8],
                                                  float v[16]) {
        // sass: decode
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
        // sass: loads
        uint32_t a[8];
        uint32_t b[8];
        plan_ld8(hi + first / 2u, a);
        plan_ld8(rem + first / 2u, b);
        decode(a, b, v);
    }
    __device__ __forceinline__ void load_part(uint32_t first, uint32_t count, float v[16]) const {
        // sass: loads
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
                                          const uint32_t r[16], bool exact) const {
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
        // sass: stores
        uint32_t w[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
        plan_st8_count(hi + first / 2u, count, w);
        plan_st8_count(rem + first / 2u, count, w);
    }
};

// Block-wise codes of 8 or 4 bits and one absmax per block (formats/blockwise.cuh), blocks of at
// most 512 elements: a block's threads are consecutive lanes of one warp. BUCKETS: the map's
// bucket table, exact.cuh's logarithmic buckets (0) or its linear ones (1: plans.rs `buckets`).
template <uint32_t AUX, uint32_t BUCKETS>
struct PlanQuant {
    static constexpr bool LINEAR = BUCKETS == 1u;
    static constexpr uint32_t FMT = FMT_BLOCKWISE;
    static constexpr uint32_t FAST_LIMIT = LIMIT_F32;
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
    uint32_t m;
    uint32_t len;
    __device__ __forceinline__ void at(const Desc* d, uint32_t s, uint32_t map, uint32_t map_len) {
        codes = reinterpret_cast<uint32_t*>(d->slots[s].region[0]);
        absmax = reinterpret_cast<uint32_t*>(d->slots[s].region[1]);
        m = map;
        len = map_len;
    }
    __device__ __forceinline__ void decode(const uint32_t w[WORDS], float scale,
                                           float v[16]) const {
        // sass: decode
#pragma unroll
        for (int j = 0; j < 16; j++) {
            uint32_t code = (w[j / PER_WORD] >> (BITS * (j % PER_WORD))) & ((1u << BITS) - 1u);
            v[j] = plan_values(m)[code] * scale;
        }
    }
    __device__ __forceinline__ void load(uint32_t first, float v[16]) const {
        // sass: loads
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
        // sass: loads
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
    // The divisors whose quotients exact.cuh's exact_quotient gives as the IEEE division does
    // wherever the code depends on them: nearest rounding needs quotients of magnitude 2^-30 and
    // above (smaller ones share a code: plans.rs checks that no threshold lies within 2^-28 of
    // 0), stochastic rounding 2^-60 and above (plans.rs: every quotient within 2^-58 of 0 rounds
    // to one code whatever its draw). Other divisors divide in IEEE arithmetic.
    static constexpr float DIV_LO = SR ? 0x1p-40f : 0x1p-70f;
    static constexpr float DIV_HI = SR ? 0x1p40f : 0x1p120f;
    // Blockwise::quantize_block: the block's absmax (the largest |x|: finite values, so the float
    // maximum is the maximum of the bits; shuffled across its threads as bits; a thread's elements
    // past `count` are 0), then each code nearest to (or stochastically rounded from) x / absmax.
    __device__ __forceinline__ void store(uint32_t first, uint32_t count, const float v[16],
                                          const uint32_t r[16], bool exact) const {
        // sass: absmax
        float big = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            big = fmaxf(fabsf(v[j]), big);
        }
        uint32_t local = f2u(big);
#pragma unroll
        for (uint32_t off = 1u; off < GROUP; off *= 2u) {
            uint32_t o = __shfl_xor_sync(0xFFFFFFFFu, local, off);
            local = o > local ? o : local;
        }
        // sass: quotient
        float scale = u2f(local);
        // x / 1 for an all-zero block: every quotient is a zero, whose code is 0's (the
        // reference's quotients there are 0).
        float den = scale != 0.0f ? scale : 1.0f;
        float y[16];
        if (den >= DIV_LO && den <= DIV_HI && !PLAN_FORCE_COLD) {
            float rb = 1.0f / den;
#pragma unroll
            for (int j = 0; j < 16; j++) {
                y[j] = exact_quotient(v[j], den, rb);
            }
        } else {
            PLAN_COLD();
#pragma unroll
            for (int j = 0; j < 16; j++) {
                y[j] = v[j] / den;
            }
        }
        // sass: pack
        // The codes' sum (disjoint bits: their packing), less 1 per code where plan_stochastic
        // adds its code plus 1.
        uint32_t w[WORDS];
#pragma unroll
        for (uint32_t k = 0u; k < WORDS; k++) {
            w[k] = SR ? 0u - (BITS == 8u ? 0x01010101u : 0x11111111u) : 0u;
        }
#pragma unroll
        for (int j = 0; j < 16; j++) {
            // Disjoint bits: the sum is the packing (shift-and-adds).
            uint32_t at = BITS * (j % PER_WORD);
            if (SR) {
                plan_stochastic<LINEAR>(m, y[j], r[j], w[j / PER_WORD], at);
            } else {
                plan_nearest<LINEAR>(m, y[j], w[j / PER_WORD], at);
            }
        }
        // sass: stores
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
        // sass: stores
        bool lead = (first & ((1u << LOG) - 1u)) == 0u;
        uint32_t z = *plan_zero(m);
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

