// The entry points (abi.rs `Entry`): every tile's descriptor says which operation's fields it
// fills. Each takes the launch's descriptors, their count, the code-map table and the flag words
// (one non-finite flag per parameter, then the rule sums' fold words, abi.rs STAT_WORDS); a
// descriptor's `io` is the address of its element 0's input or output.

#define LPMM_ARGS const Desc *descs, uint32_t ndesc, const uint32_t *maps, uint32_t *flags

// Stores the 16 values of thread `lt` in slot `s` (format/*.rs `encode`), drawing the random
// words of a stochastic format from the slot's stream at `counter`. Called by every thread of
// the block.
__device__ __forceinline__ void store(const Tile& t, const uint32_t* maps, uint32_t* red,
                                      uint32_t lt, uint32_t s, const float v[16], uint32_t count,
                                      uint64_t counter) {
    uint32_t r[16] = {};
    if (fmt_stochastic(slot_format(t, s), slot_aux(t, s)) && count > 0u) {
        thread_bits(t, lt, s, counter, r);
    }
    fmt_store(t, maps, red, lt, s, v, count, r);
}

// cpu.rs `allocate`: the initial values stored as the parameter (stream counter 0).
extern "C" __global__ void __launch_bounds__(THREADS) lpmm_init(LPMM_ARGS) {
    __shared__ uint32_t red[THREADS];
    Tile t = tile_of(descs, ndesc);
    if (!t.valid) {
        return;
    }
    uint32_t lt = threadIdx.x;
    uint32_t count = thread_count(t, lt);
    uint32_t first = t.start + PER * lt;
    float v[16];
    for (uint32_t j = 0u; j < count; j++) {
        v[j] = io_load(t, first + j);
    }
    store(t, maps, red, lt, S_PARAM, v, count, 0ull);
}

// cpu.rs `accumulate`: accumulator + micro-batch gradient, stored with the gradient stream.
extern "C" __global__ void __launch_bounds__(THREADS) lpmm_accumulate(LPMM_ARGS) {
    __shared__ uint32_t red[THREADS];
    Tile t = tile_of(descs, ndesc);
    if (!t.valid) {
        return;
    }
    uint32_t lt = threadIdx.x;
    uint32_t count = thread_count(t, lt);
    uint32_t first = t.start + PER * lt;
    float v[16];
    for (uint32_t j = 0u; j < count; j++) {
        v[j] = fmt_load(t, maps, S_GRAD, first + j) + io_load(t, first + j);
    }
    store(t, maps, red, lt, S_GRAD, v, count, t.d->acc);
}

// cpu.rs `read`: slot `mode` decoded into the io values.
extern "C" __global__ void __launch_bounds__(THREADS) lpmm_decode(LPMM_ARGS) {
    Tile t = tile_of(descs, ndesc);
    if (!t.valid) {
        return;
    }
    uint32_t lt = threadIdx.x;
    uint32_t count = thread_count(t, lt);
    uint32_t first = t.start + PER * lt;
    uint32_t s = t.d->mode;
    float v[16];
    for (uint32_t j = 0u; j < count; j++) {
        v[j] = fmt_load(t, maps, s, first + j);
    }
    io_store(t, first, v, count);
}

// cpu.rs `clear_gradients`.
extern "C" __global__ void __launch_bounds__(THREADS) lpmm_clear(LPMM_ARGS) {
    Tile t = tile_of(descs, ndesc);
    if (!t.valid) {
        return;
    }
    uint32_t lt = threadIdx.x;
    fmt_clear(t, maps, lt, S_GRAD, thread_count(t, lt));
}

// Backend::fits of a caller's buffer (no gradient slot in the descriptor), or
// Backend::accumulate_fits (cpu.rs: the accumulator plus the input, as lpmm_accumulate sums
// them): the item's flag is set if a value is not finite or beyond `mode` (f32 bits).
extern "C" __global__ void __launch_bounds__(THREADS) lpmm_check(LPMM_ARGS) {
    Tile t = tile_of(descs, ndesc);
    if (!t.valid) {
        return;
    }
    uint32_t lt = threadIdx.x;
    uint32_t count = thread_count(t, lt);
    uint32_t first = t.start + PER * lt;
    uint32_t limit = t.d->mode;
    bool sum = slot_format(t, S_GRAD) != FMT_NONE;
    bool bad = false;
    for (uint32_t j = 0u; j < count; j++) {
        float x = io_load(t, first + j);
        if (sum) {
            x = fmt_load(t, maps, S_GRAD, first + j) + x;
        }
        bad = bad || !fits(x, limit);
    }
    if (bad) {
        atomicOr(&flags[t.d->flag_index], 1u);
    }
}

// rule/mod.rs `apply_rule`'s test: the gradient and increment finite, the parameter and states
// within their formats' limits (fmt_limit; the parameter's only where it moves, f32's otherwise).
__device__ __forceinline__ bool step_ok(const Tile& t, uint32_t fl, float gi, const Update& u) {
    uint32_t lp = (fl & F_UPDATE_PARAM) != 0u ? fmt_limit(slot_format(t, S_PARAM)) : LIMIT_F32;
    return fits(gi, LIMIT_F32) && fits(u.p, lp) && fits(u.d, LIMIT_F32) &&
           fits(u.m, fmt_limit(slot_format(t, S_STATE1))) &&
           fits(u.v, fmt_limit(slot_format(t, S_STATE2))) &&
           fits(u.w, fmt_limit(slot_format(t, S_STATE3)));
}

// The gradient of item element `i`: the accumulator plus the released gradient, if any.
__device__ __forceinline__ float gradient(const Tile& t, const uint32_t* maps, uint32_t i) {
    float g = fmt_load(t, maps, S_GRAD, i);
    if ((t.d->flags & F_INPUT) != 0u) {
        g = g + io_load(t, i);
    }
    return g;
}

// cpu.rs `fold_piece`: pass `mode & 255` of a tensor-wide phase. Target `(mode >> 8) & 255` is a
// slot (state 2 or 3) whose format folds, per element, its updated value (the rule applied,
// nothing stored; input `mode >> 16` = FOLD_UPDATED) or the rule's moment input for it
// (FOLD_MOMENT); or FOLD_STATS: the rule's `mode >> 24` sums of squares, over a tensor whose
// count has `(mode >> 16) & 255` fractional bits, into its block of flag words at `flag_index`
// (abi.rs STAT_WORDS: the exponents, then the 64-bit sums).
extern "C" __global__ void __launch_bounds__(THREADS) lpmm_fold(LPMM_ARGS) {
    Tile t = tile_of(descs, ndesc);
    if (!t.valid) {
        return;
    }
    uint32_t lt = threadIdx.x;
    uint32_t count = thread_count(t, lt);
    uint32_t first = t.start + PER * lt;
    uint32_t fl = t.d->flags;
    float clip = t.d->clip;
    uint32_t mode = t.d->mode;
    uint32_t phase = mode & 0xFFu;
    uint32_t dest = (mode >> 8u) & 0xFFu;
    uint32_t* stats = flags + t.d->flag_index;
    for (uint32_t j = 0u; j < count; j++) {
        float gi = gradient(t, maps, first + j) * clip;
        float p0 = fmt_load(t, maps, S_PARAM, first + j);
        float m0 = fmt_load(t, maps, S_STATE1, first + j);
        float v0 = fmt_load(t, maps, S_STATE2, first + j);
        float w0 = fmt_load(t, maps, S_STATE3, first + j);
        if (dest == FOLD_STATS) {
            int32_t frac = (int32_t)((mode >> 16u) & 0xFFu);
            for (uint32_t k = 0u; k < (mode >> 24u); k++) {
                float x = stat_input(t.d, fl, k, p0, gi, m0, v0, w0);
                if (!fixed_counts(x)) {
                    continue;
                }
                if (phase == 0u) {
                    wide_max(stats, k, fixed_exponent(x));
                } else {
                    uint32_t stored = rd(stats, k);
                    wide_add64(stats + STAT_SUM, k, fixed_term(x, stored, frac));
                }
            }
            continue;
        }
        float x;
        if ((mode >> 16u) == FOLD_UPDATED) {
            Update u = apply_rule(t.d, fl, p0, gi, m0, v0, w0);
            bool ok = step_ok(t, fl, gi, u);
            if (dest == S_STATE3) {
                x = ok ? u.w : w0;
            } else {
                x = ok ? u.v : v0;
            }
        } else {
            x = moment_input(t.d, fl, dest, p0, gi, m0, v0, w0);
        }
        fmt_fold(t, maps, dest, phase, first + j, x);
    }
}

// cpu.rs `fused_step`: decode gradient (plus the released gradient), parameter and states; apply
// the rule (an element whose gradient or results are not finite, or whose parameter or states do
// not fit their formats, is left unchanged and flags the parameter); store the states, the
// parameter (or add the increment) and clear the accumulator. With F_TRANSFORM: no gradient is
// read, only the parameter is stored.
extern "C" __global__ void __launch_bounds__(THREADS) lpmm_step(LPMM_ARGS) {
    __shared__ uint32_t red[THREADS];
    Tile t = tile_of(descs, ndesc);
    if (!t.valid) {
        return;
    }
    uint32_t lt = threadIdx.x;
    uint32_t count = thread_count(t, lt);
    uint32_t first = t.start + PER * lt;
    uint32_t fl = t.d->flags;
    float clip = t.d->clip;
    bool transform = (fl & F_TRANSFORM) != 0u;
    float p[16];
    float m[16];
    float v[16];
    float w[16];
    float d[16];
    bool bad = false;
    for (uint32_t j = 0u; j < count; j++) {
        float gi = transform ? 0.0f : gradient(t, maps, first + j) * clip;
        float p0 = fmt_load(t, maps, S_PARAM, first + j);
        float m0 = fmt_load(t, maps, S_STATE1, first + j);
        float v0 = fmt_load(t, maps, S_STATE2, first + j);
        float w0 = fmt_load(t, maps, S_STATE3, first + j);
        Update u = apply_rule(t.d, fl, p0, gi, m0, v0, w0);
        bool ok = step_ok(t, fl, gi, u);
        m[j] = ok ? u.m : m0;
        v[j] = ok ? u.v : v0;
        w[j] = ok ? u.w : w0;
        p[j] = ok ? u.p : p0;
        d[j] = ok ? u.d : 0.0f;
        bad = bad || !ok;
    }
    if (bad) {
        atomicOr(&flags[t.d->flag_index], 1u);
    }
    uint64_t counter = t.d->step;
    if (!transform) {
        store(t, maps, red, lt, S_STATE1, m, count, counter);
        store(t, maps, red, lt, S_STATE2, v, count, counter);
        store(t, maps, red, lt, S_STATE3, w, count, counter);
    }
    if ((fl & F_UPDATE_PARAM) != 0u) {
        if (!fmt_add(t, lt, S_PARAM, d, count)) {
            store(t, maps, red, lt, S_PARAM, p, count, counter);
        }
    }
    // Every thread has read the block scales of the gradient it shares with its neighbours
    // before any of them is zeroed.
    __syncthreads();
    if (!transform) {
        fmt_clear(t, maps, lt, S_GRAD, count);
    }
}
