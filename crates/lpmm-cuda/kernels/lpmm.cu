// lpmm's CUDA kernels. Each function mirrors the CPU reference routine named in its comment
// (crates/lpmm-optim, crates/lpmm-formats, crates/lpmm-quant); docs/FORMATS.md and
// docs/OPTIMIZERS.md define them, and crates/lpmm-wgpu/src/step.wgsl is the same program in WGSL.
//
// Compiled to PTX by `cargo xtask kernels` (NVRTC, options in src/kernels.rs: no contraction of
// a * b + c, IEEE division and square root, subnormals kept), and to host code by
// kernels/emulate.cpp for the tests on machines without a GPU.
//
// One launch covers every tensor of an operation: descriptor k owns blocks
// tile_begin[k] .. tile_begin[k + 1]; block b handles the tile of up to 4096 consecutive
// elements starting at 4096 (b - tile_begin) of its tensor. Thread t owns elements
// 16t .. 16t + 16 of the tile: 16 is a multiple of every packing (bf16 pairs, 8-bit and 4-bit
// codes), so every storage word belongs to one thread, and the 16 elements are one ChaCha block
// of random words. Quantization blocks (32 ..= 4096 elements, powers of two) fall whole inside a
// tile, so a block's absmax is a reduction over the threads that own it.

#ifndef LPMM_HOST
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef int int32_t;
#endif

#define TILE 4096u
#define PER 16u
#define THREADS 256u

#define F_FIRST 1u
#define F_UPDATE_PARAM 2u
#define F_INPUT 4u

#define R_NESTEROV 1u
#define R_HAS_MOMENTUM 2u
#define R_DECOUPLED 4u
#define R_GIVEN_V 8u

#define S_PARAM 0u
#define S_GRAD 1u
#define S_STATE1 2u
#define S_STATE2 3u

#define FMT_EMPTY 0u
#define FMT_F32 1u
#define FMT_BF16 2u
#define FMT_BF16_SR 3u
#define FMT_KAHAN 4u
#define FMT_SPLIT 5u
#define FMT_QUANT 6u

// `maps`: map k's 256 values at k * 512 and its thresholds at k * 512 + 256 (f32 bits); the
// number of values of map k at MAP_LENS + k.
#define MAP_STRIDE 512u
#define MAP_LENS 2560u

// One slot of a tensor: its format, the format's parameters (quantized: map | log2 block << 8 |
// stochastic << 16 | bits << 24) and its two regions (values; compensations, remainders or
// block scales). Mirrors `Slot` in src/lib.rs (repr(C), 24 bytes).
struct Slot {
    uint32_t fmt;
    uint32_t aux;
    uint32_t* a;
    uint32_t* b;
};

// One tensor's part in a launch. Mirrors `Desc` in src/lib.rs (repr(C), 232 bytes).
struct Desc {
    uint64_t len;        // elements
    uint64_t offset;     // global index of element 0 (keys the random words)
    uint64_t index;      // parameter index (the random stream's tensor id is index << 2 | slot)
    uint64_t step;       // the states' and parameter's stream counter
    uint64_t acc;        // the gradient's stream counter
    uint64_t seed;
    uint64_t tile_begin; // first block of the launch that works on this tensor
    uint64_t input;      // offset in `io` of element 0's value (gradients in, decoded out)
    uint32_t flags;
    uint32_t flag_index;
    uint32_t rule;
    uint32_t rule_flags;
    uint32_t mode;       // decode: which slot
    float clip;
    float rc[11];        // rule constants
    uint32_t pad;
    Slot slots[4];
};

struct Tile {
    const Desc* d;
    uint64_t start; // the tile's first element, tensor-relative
    uint32_t n;     // elements in the tile
};

__device__ __forceinline__ Tile tile_of(const Desc* descs, uint32_t ndesc) {
    // The last descriptor whose first block is at or before this one.
    uint64_t b = blockIdx.x;
    uint32_t lo = 0, hi = ndesc;
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (descs[mid].tile_begin <= b) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Tile t;
    t.d = &descs[lo];
    t.start = (b - t.d->tile_begin) * TILE;
    uint64_t rest = t.d->len - t.start;
    t.n = rest < TILE ? (uint32_t)rest : TILE;
    return t;
}

// ---------------------------------------------------------------------------------------------
// Floats (lpmm-formats float.rs, split.rs; half's bf16 conversion).

__device__ __forceinline__ uint32_t f2u(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float u2f(uint32_t x) { return __uint_as_float(x); }

__device__ __forceinline__ bool is_finite(float x) {
    return (f2u(x) & 0x7F800000u) != 0x7F800000u;
}

// half::bf16::from_f32: round to nearest even, NaN kept quiet with its sign.
__device__ __forceinline__ uint32_t bf16_nearest(float x) {
    uint32_t b = f2u(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
        return (b >> 16) | 0x40u;
    }
    if ((b & 0x8000u) != 0u && (b & 0x17FFFu) != 0u) {
        return (b >> 16) + 1u;
    }
    return b >> 16;
}

// float::bf16_stochastic.
__device__ __forceinline__ uint32_t bf16_stochastic(float x, uint32_t r) {
    uint32_t b = f2u(x);
    if ((b & 0x7FFFFFFFu) >= 0x7F800000u) {
        return bf16_nearest(x);
    }
    uint32_t res = (b >> 16) + ((r >> 16) < (b & 0xFFFFu) ? 1u : 0u);
    if ((res & 0x7FFFu) == 0x7F80u) {
        return bf16_nearest(x);
    }
    return res;
}

__device__ __forceinline__ float bf16_value(uint32_t h) { return u2f(h << 16); }

// ---------------------------------------------------------------------------------------------
// ChaCha8 (lpmm-quant random.rs): word i of the keystream with key (seed, tensor, 0, 0) and
// nonce `step` is word i % 16 of the block with 64-bit counter i / 16.

#define ROTL(v, n) (((v) << (n)) | ((v) >> (32 - (n))))
#define QR(a, b, c, d)                                                                             \
    x[a] += x[b]; x[d] = ROTL(x[d] ^ x[a], 16);                                                    \
    x[c] += x[d]; x[b] = ROTL(x[b] ^ x[c], 12);                                                    \
    x[a] += x[b]; x[d] = ROTL(x[d] ^ x[a], 8);                                                     \
    x[c] += x[d]; x[b] = ROTL(x[b] ^ x[c], 7);

__device__ __forceinline__ void chacha8(uint64_t seed, uint64_t tensor, uint64_t counter,
                                        uint64_t nonce, uint32_t out[16]) {
    uint32_t s[16] = {
        0x61707865u, 0x3320646eu, 0x79622d32u, 0x6b206574u,
        (uint32_t)seed, (uint32_t)(seed >> 32), (uint32_t)tensor, (uint32_t)(tensor >> 32),
        0u, 0u, 0u, 0u,
        (uint32_t)counter, (uint32_t)(counter >> 32), (uint32_t)nonce, (uint32_t)(nonce >> 32),
    };
    uint32_t x[16];
#pragma unroll
    for (int i = 0; i < 16; i++) {
        x[i] = s[i];
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        QR(0, 4, 8, 12) QR(1, 5, 9, 13) QR(2, 6, 10, 14) QR(3, 7, 11, 15)
        QR(0, 5, 10, 15) QR(1, 6, 11, 12) QR(2, 7, 8, 13) QR(3, 4, 9, 14)
    }
#pragma unroll
    for (int i = 0; i < 16; i++) {
        out[i] = x[i] + s[i];
    }
}

// The random words of the 16 elements thread `lt` owns, from slot `slot`'s stream at `counter`
// (cpu.rs `stream`: tensor id = parameter index << 2 | slot).
__device__ __forceinline__ void thread_bits(const Tile& t, uint32_t lt, uint32_t slot,
                                            uint64_t counter, uint32_t r[16]) {
    uint64_t tensor = (t.d->index << 2) | slot;
    uint64_t g = t.d->offset + t.start + PER * lt;
    chacha8(t.d->seed, tensor, g >> 4, counter, r);
}

// ---------------------------------------------------------------------------------------------
// Code maps (lpmm-formats codemap.rs).

__device__ __forceinline__ uint32_t map_len(const uint32_t* maps, uint32_t map) {
    return maps[MAP_LENS + map];
}

// CodeMap::value: codes past the end decode as the last value.
__device__ __forceinline__ float map_value(const uint32_t* maps, uint32_t map, uint32_t code) {
    uint32_t last = map_len(maps, map) - 1u;
    return u2f(maps[MAP_STRIDE * map + (code < last ? code : last)]);
}

// CodeMap::nearest: the number of thresholds <= y (NaN gives 0).
__device__ __forceinline__ uint32_t map_nearest(const uint32_t* maps, uint32_t map, float y) {
    if (!(y == y)) {
        return 0u;
    }
    uint32_t lo = 0u;
    uint32_t hi = map_len(maps, map) - 1u;
    const uint32_t* th = maps + MAP_STRIDE * map + 256u;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2u;
        if (u2f(th[mid]) <= y) {
            lo = mid + 1u;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// CodeMap::stochastic.
__device__ __forceinline__ uint32_t map_stochastic(const uint32_t* maps, uint32_t map, float y,
                                                   uint32_t r) {
    if (!(y == y)) {
        return 0u;
    }
    uint32_t c = map_nearest(maps, map, y);
    uint32_t below = map_value(maps, map, c) > y ? 1u : 0u;
    if (below > c) {
        return 0u;
    }
    uint32_t lo = c - below;
    if (lo + 1u == map_len(maps, map)) {
        return lo;
    }
    float lo_v = map_value(maps, map, lo);
    float hi_v = map_value(maps, map, lo + 1u);
    float frac = (y - lo_v) / (hi_v - lo_v);
    float scaled = frac * 4294967296.0f;
    // Rust's saturating `as u32`.
    uint32_t cut = 0xFFFFFFFFu;
    if (scaled < 4294967296.0f) {
        cut = scaled > 0.0f ? (uint32_t)scaled : 0u;
    }
    return lo + (r < cut ? 1u : 0u);
}

// ---------------------------------------------------------------------------------------------
// Slots: decode one element (slot.rs `Slot::decode`).

__device__ __forceinline__ float load(const Tile& t, const uint32_t* maps, uint32_t slot,
                                      uint64_t i) {
    const Slot& s = t.d->slots[slot];
    switch (s.fmt) {
    case FMT_F32:
        return u2f(s.a[i]);
    case FMT_BF16:
    case FMT_BF16_SR:
    case FMT_KAHAN:
        return bf16_value((s.a[i / 2] >> (16u * (uint32_t)(i & 1u))) & 0xFFFFu);
    case FMT_SPLIT: {
        uint32_t shift = 16u * (uint32_t)(i & 1u);
        uint32_t hi = (s.a[i / 2] >> shift) & 0xFFFFu;
        uint32_t rem = (s.b[i / 2] >> shift) & 0xFFFFu;
        uint32_t h = (hi - (rem >= 0x8000u ? 1u : 0u)) & 0xFFFFu;
        return u2f((h << 16) | rem);
    }
    case FMT_QUANT: {
        uint32_t map = s.aux & 0xFFu;
        uint32_t log_block = (s.aux >> 8) & 0xFFu;
        uint32_t bits = s.aux >> 24;
        uint64_t at = i * bits;
        uint32_t code = (s.a[at / 32] >> (uint32_t)(at % 32)) & ((1u << bits) - 1u);
        float absmax = u2f(s.b[i >> log_block]);
        return map_value(maps, map, code) * absmax;
    }
    default:
        return 0.0f;
    }
}

// ---------------------------------------------------------------------------------------------
// Slots: store the 16 values of thread `lt` (slot.rs `Slot::encode_keyed`). Must be called by
// every thread of the block (quantized slots reduce their block maxima across the block).
// `counter`: the slot's random-stream counter. Elements at or past `count` are not stored (their
// half of a shared word, their bits of a packed word, are zero).

__device__ __forceinline__ void store_quantized(const Tile& t, const uint32_t* maps,
                                                uint32_t* red, uint32_t lt, const Slot& s,
                                                const float vals[16], uint32_t count,
                                                const uint32_t r[16]) {
    uint32_t map = s.aux & 0xFFu;
    uint32_t log_block = (s.aux >> 8) & 0xFFu;
    bool stochastic = ((s.aux >> 16) & 1u) == 1u;
    uint32_t bits = s.aux >> 24;
    // Blockwise::quantize_block over the thread's share of each block: the block's absmax (the
    // largest |x| as bits), then each code nearest to (or stochastically rounded from)
    // x / absmax.
    uint32_t local = 0u;
    for (uint32_t j = 0; j < count; j++) {
        uint32_t m = f2u(vals[j]) & 0x7FFFFFFFu;
        local = m > local ? m : local;
    }
    // Threads per block (blocks are at least 32 elements).
    uint32_t group = (1u << log_block) / PER;
    __syncthreads();
    red[lt] = local;
    __syncthreads();
    for (uint32_t st = 1u; st < THREADS; st *= 2u) {
        if (st < group && (lt % (2u * st)) == 0u) {
            uint32_t o = red[lt + st];
            if (o > red[lt]) {
                red[lt] = o;
            }
        }
        __syncthreads();
    }
    float absmax = u2f(red[(lt / group) * group]);
    if (count == 0u) {
        return;
    }
    uint64_t first = t.start + PER * lt;
    uint32_t words[4] = {0u, 0u, 0u, 0u};
    for (uint32_t j = 0; j < count; j++) {
        float y = 0.0f;
        if (absmax != 0.0f) {
            y = vals[j] / absmax;
        }
        uint32_t code = stochastic ? map_stochastic(maps, map, y, r[j]) : map_nearest(maps, map, y);
        uint32_t at = j * bits;
        words[at / 32u] |= code << (at % 32u);
    }
    uint32_t used = (count * bits + 31u) / 32u;
    uint64_t w0 = (first * bits) / 32u;
    for (uint32_t k = 0; k < used; k++) {
        s.a[w0 + k] = words[k];
    }
    if ((first & ((1ull << log_block) - 1u)) == 0u) {
        s.b[first >> log_block] = f2u(absmax);
    }
}

__device__ void store(const Tile& t, const uint32_t* maps, uint32_t* red, uint32_t lt,
                      uint32_t slot, const float vals[16], uint32_t count, uint64_t counter) {
    const Slot& s = t.d->slots[slot];
    uint64_t first = t.start + PER * lt;
    uint32_t r[16];
    bool stochastic = s.fmt == FMT_BF16_SR || (s.fmt == FMT_QUANT && ((s.aux >> 16) & 1u) == 1u);
    if (stochastic && count > 0u) {
        thread_bits(t, lt, slot, counter, r);
    }
    switch (s.fmt) {
    case FMT_F32:
        for (uint32_t j = 0; j < count; j++) {
            s.a[first + j] = f2u(vals[j]);
        }
        break;
    case FMT_BF16:
    case FMT_BF16_SR:
        for (uint32_t j = 0; j < count; j += 2u) {
            uint32_t h[2] = {0u, 0u};
            for (uint32_t k = 0; k < 2u; k++) {
                if (j + k < count) {
                    h[k] = s.fmt == FMT_BF16_SR ? bf16_stochastic(vals[j + k], r[j + k])
                                                : bf16_nearest(vals[j + k]);
                }
            }
            s.a[(first + j) / 2] = h[0] | (h[1] << 16);
        }
        break;
    case FMT_KAHAN:
        // Re-initialisation: the value itself and no compensation beyond its rounding.
        for (uint32_t j = 0; j < count; j += 2u) {
            uint32_t h[2] = {0u, 0u};
            uint32_t c[2] = {0u, 0u};
            for (uint32_t k = 0; k < 2u; k++) {
                if (j + k < count) {
                    float x = vals[j + k];
                    h[k] = bf16_nearest(x);
                    c[k] = bf16_nearest(x - bf16_value(h[k]));
                }
            }
            s.a[(first + j) / 2] = h[0] | (h[1] << 16);
            s.b[(first + j) / 2] = c[0] | (c[1] << 16);
        }
        break;
    case FMT_SPLIT:
        for (uint32_t j = 0; j < count; j += 2u) {
            uint32_t h[2] = {0u, 0u};
            uint32_t m[2] = {0u, 0u};
            for (uint32_t k = 0; k < 2u; k++) {
                if (j + k < count) {
                    uint32_t bits = f2u(vals[j + k]);
                    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
                        bits = (bits & 0x80000000u) | 0x7FC00000u;
                    }
                    m[k] = bits & 0xFFFFu;
                    h[k] = ((bits >> 16) + (m[k] >= 0x8000u ? 1u : 0u)) & 0xFFFFu;
                }
            }
            s.a[(first + j) / 2] = h[0] | (h[1] << 16);
            s.b[(first + j) / 2] = m[0] | (m[1] << 16);
        }
        break;
    default:
        break;
    }
    if (s.fmt == FMT_QUANT) {
        store_quantized(t, maps, red, lt, s, vals, count, r);
    }
}

// slot.rs `Slot::clear` of the thread's elements: zeros; a quantized slot gets zero scales (and,
// at 8 bits, the code of 0; narrower codes are left as they are, as on the CPU).
__device__ void clear(const Tile& t, const uint32_t* maps, uint32_t lt, uint32_t slot,
                      uint32_t count) {
    const Slot& s = t.d->slots[slot];
    uint64_t first = t.start + PER * lt;
    switch (s.fmt) {
    case FMT_F32:
        for (uint32_t j = 0; j < count; j++) {
            s.a[first + j] = 0u;
        }
        break;
    case FMT_BF16:
    case FMT_BF16_SR:
        for (uint32_t j = 0; j < count; j += 2u) {
            s.a[(first + j) / 2] = 0u;
        }
        break;
    case FMT_KAHAN:
    case FMT_SPLIT:
        for (uint32_t j = 0; j < count; j += 2u) {
            s.a[(first + j) / 2] = 0u;
            s.b[(first + j) / 2] = 0u;
        }
        break;
    case FMT_QUANT: {
        uint32_t log_block = (s.aux >> 8) & 0xFFu;
        uint32_t bits = s.aux >> 24;
        if (bits == 8u && count > 0u) {
            uint32_t zero = map_nearest(maps, s.aux & 0xFFu, 0.0f);
            uint32_t z = zero | (zero << 8) | (zero << 16) | (zero << 24);
            for (uint32_t k = 0; k < (count + 3u) / 4u; k++) {
                s.a[first / 4 + k] = z;
            }
        }
        if (count > 0u && (first & ((1ull << log_block) - 1u)) == 0u) {
            s.b[first >> log_block] = 0u;
        }
        break;
    }
    default:
        break;
    }
}

// ---------------------------------------------------------------------------------------------
// The update rules (lpmm-optim rule.rs `Rule::apply`), PyTorch's order of operations; `__fmaf_rn`
// where the CPU writes `mul_add`, and nothing else fused (--fmad=false).

struct Update {
    float p, d, m, v;
};

__device__ __forceinline__ Update apply_rule(const Desc* d, float p, float g, float m0, float v0,
                                             bool first) {
    Update u;
    u.m = m0;
    u.v = v0;
    const float* rc = d->rc;
    uint32_t rf = d->rule_flags;
    if (d->rule == 0u) {
        // SGD
        float neg_lr = rc[0], wd = rc[1], momentum = rc[2], one_minus_dampening = rc[3];
        float dd = g;
        if (wd != 0.0f) {
            dd = __fmaf_rn(p, wd, g);
        }
        if ((rf & R_HAS_MOMENTUM) != 0u) {
            if (first) {
                u.m = dd;
            } else {
                u.m = __fmaf_rn(dd, one_minus_dampening, m0 * momentum);
            }
            if ((rf & R_NESTEROV) != 0u) {
                dd = __fmaf_rn(u.m, momentum, dd);
            } else {
                dd = u.m;
            }
        }
        u.p = __fmaf_rn(dd, neg_lr, p);
        u.d = dd * neg_lr;
    } else if (d->rule == 1u) {
        // Adam / AdamW
        float decay = rc[0], neg_lr_wd = rc[1], wd = rc[2], one_minus_beta1 = rc[3];
        float beta2 = rc[4], one_minus_beta2 = rc[5], bias_correction2_sqrt = rc[6];
        float eps = rc[7], neg_step_size = rc[8];
        float gg = g;
        float decayed = p;
        float decay_delta = 0.0f;
        if ((rf & R_DECOUPLED) != 0u) {
            decayed = p * decay;
            decay_delta = p * neg_lr_wd;
        } else if (wd != 0.0f) {
            gg = __fmaf_rn(p, wd, g);
        }
        if (one_minus_beta1 < 0.5f) {
            u.m = __fmaf_rn(gg - m0, one_minus_beta1, m0);
        } else {
            u.m = __fmaf_rn(gg - m0, one_minus_beta1 - 1.0f, gg);
        }
        if ((rf & R_GIVEN_V) == 0u) {
            u.v = __fmaf_rn(one_minus_beta2 * gg, gg, v0 * beta2);
        }
        float denom = sqrtf(u.v) / bias_correction2_sqrt + eps;
        float step = neg_step_size * u.m / denom;
        u.p = decayed + step;
        u.d = decay_delta + step;
    } else {
        // Lion
        float decay = rc[0], neg_lr_wd = rc[1], neg_lr = rc[2], beta1 = rc[3];
        float one_minus_beta1 = rc[4], beta2 = rc[5], one_minus_beta2 = rc[6];
        float decayed = p * decay;
        float c = __fmaf_rn(g, one_minus_beta1, m0 * beta1);
        float s = 0.0f;
        if (c > 0.0f) {
            s = 1.0f;
        } else if (c < 0.0f) {
            s = -1.0f;
        }
        u.m = __fmaf_rn(g, one_minus_beta2, m0 * beta2);
        u.p = __fmaf_rn(s, neg_lr, decayed);
        u.d = p * neg_lr_wd + s * neg_lr;
    }
    return u;
}

__device__ __forceinline__ uint32_t thread_count(const Tile& t, uint32_t lt) {
    uint32_t first = PER * lt;
    if (first >= t.n) {
        return 0u;
    }
    return t.n - first < PER ? t.n - first : PER;
}

// ---------------------------------------------------------------------------------------------
// Entry points: (descriptors, descriptor count, io, code maps, flags); one block of THREADS
// threads per tile.

#define KERNEL_ARGS                                                                                \
    const Desc *descs, uint32_t ndesc, float *io, const uint32_t *maps, uint32_t *flags

// cpu.rs `allocate`: the initial values from `io` stored as the parameter (stream counter 0).
extern "C" __global__ void __launch_bounds__(THREADS) lpmm_init(KERNEL_ARGS) {
    __shared__ uint32_t red[THREADS];
    Tile t = tile_of(descs, ndesc);
    uint32_t lt = threadIdx.x;
    uint32_t count = thread_count(t, lt);
    const float* in = io + t.d->input + t.start + PER * lt;
    float vals[16];
    for (uint32_t j = 0; j < count; j++) {
        vals[j] = in[j];
    }
    store(t, maps, red, lt, S_PARAM, vals, count, 0ull);
}

// cpu.rs `accumulate`: accumulator + micro-batch gradient, stored with the gradient stream.
extern "C" __global__ void __launch_bounds__(THREADS) lpmm_accumulate(KERNEL_ARGS) {
    __shared__ uint32_t red[THREADS];
    Tile t = tile_of(descs, ndesc);
    uint32_t lt = threadIdx.x;
    uint32_t count = thread_count(t, lt);
    uint64_t first = t.start + PER * lt;
    const float* in = io + t.d->input + first;
    float vals[16];
    for (uint32_t j = 0; j < count; j++) {
        vals[j] = load(t, maps, S_GRAD, first + j) + in[j];
    }
    store(t, maps, red, lt, S_GRAD, vals, count, t.d->acc);
}

// cpu.rs `read`: one slot decoded into `io` (dequantization).
extern "C" __global__ void __launch_bounds__(THREADS) lpmm_decode(KERNEL_ARGS) {
    Tile t = tile_of(descs, ndesc);
    uint32_t lt = threadIdx.x;
    uint32_t count = thread_count(t, lt);
    uint64_t first = t.start + PER * lt;
    float* out = io + t.d->input + first;
    for (uint32_t j = 0; j < count; j++) {
        out[j] = load(t, maps, t.d->mode, first + j);
    }
}

// cpu.rs `clear_gradients`.
extern "C" __global__ void __launch_bounds__(THREADS) lpmm_clear(KERNEL_ARGS) {
    Tile t = tile_of(descs, ndesc);
    uint32_t lt = threadIdx.x;
    clear(t, maps, lt, S_GRAD, thread_count(t, lt));
}

// cpu.rs `fused_step`: decode gradient (plus the released gradient), parameter and states; apply
// the rule (an element whose gradient or results are not finite is left unchanged and flags the
// tensor); store the states, the parameter (Kahan: add the increment) and clear the accumulator.
extern "C" __global__ void __launch_bounds__(THREADS) lpmm_step(KERNEL_ARGS) {
    __shared__ uint32_t red[THREADS];
    Tile t = tile_of(descs, ndesc);
    const Desc* d = t.d;
    uint32_t lt = threadIdx.x;
    uint32_t count = thread_count(t, lt);
    uint64_t first = t.start + PER * lt;
    uint32_t fl = d->flags;
    bool is_first = (fl & F_FIRST) != 0u;
    float clip = d->clip;
    const float* in = io + d->input + first;
    float p[16], m[16], v[16], dl[16];
    bool bad = false;
    for (uint32_t j = 0; j < count; j++) {
        float g = load(t, maps, S_GRAD, first + j);
        if ((fl & F_INPUT) != 0u) {
            g = g + in[j];
        }
        float gi = g * clip;
        float p0 = load(t, maps, S_PARAM, first + j);
        float m0 = load(t, maps, S_STATE1, first + j);
        float v0 = load(t, maps, S_STATE2, first + j);
        Update u = apply_rule(d, p0, gi, m0, v0, is_first);
        bool ok = is_finite(gi) && is_finite(u.p) && is_finite(u.d) && is_finite(u.m) &&
                  is_finite(u.v);
        m[j] = ok ? u.m : m0;
        v[j] = ok ? u.v : v0;
        p[j] = ok ? u.p : p0;
        dl[j] = ok ? u.d : 0.0f;
        bad = bad || !ok;
    }
    if (bad) {
        atomicOr(&flags[d->flag_index], 1u);
    }
    uint64_t counter = d->step;
    store(t, maps, red, lt, S_STATE1, m, count, counter);
    store(t, maps, red, lt, S_STATE2, v, count, counter);
    if ((fl & F_UPDATE_PARAM) != 0u) {
        const Slot& s = d->slots[S_PARAM];
        if (s.fmt == FMT_KAHAN) {
            // split.rs `kahan_add`.
            for (uint32_t j = 0; j < count; j += 2u) {
                uint32_t h[2] = {0u, 0u};
                uint32_t cw[2] = {0u, 0u};
                uint32_t word_v = s.a[(first + j) / 2];
                uint32_t word_c = s.b[(first + j) / 2];
                for (uint32_t k = 0; k < 2u; k++) {
                    if (j + k < count) {
                        float old = bf16_value((word_v >> (16u * k)) & 0xFFFFu);
                        float comp = bf16_value((word_c >> (16u * k)) & 0xFFFFu);
                        float c = comp + dl[j + k];
                        h[k] = bf16_nearest(old + c);
                        cw[k] = bf16_nearest(c + (old - bf16_value(h[k])));
                    }
                }
                s.a[(first + j) / 2] = h[0] | (h[1] << 16);
                s.b[(first + j) / 2] = cw[0] | (cw[1] << 16);
            }
        } else {
            store(t, maps, red, lt, S_PARAM, p, count, counter);
        }
    }
    // Every thread has read the block scales of the gradient it shares with its neighbours
    // before any of them is zeroed.
    __syncthreads();
    clear(t, maps, lt, S_GRAD, count);
}
