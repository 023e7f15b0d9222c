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
    // sass: random
    if (L::SR) {
        thread_bits(t, lt, s, counter, r);
    } else {
#pragma unroll
        for (int j = 0; j < 16; j++) {
            r[j] = 0u;
        }
    }
}

// Which shared code map each slot of a plan reads: slots quantized with the same map share one.
struct PlanMaps {
    // The map of slot s, as an index into the plan's shared maps.
    uint32_t index[5];
    // The shared maps: how many, and each one's map id.
    uint32_t count;
    uint32_t id[5];
};

__device__ constexpr PlanMaps plan_maps(const uint32_t quant[5], const uint32_t map[5]) {
    PlanMaps o{};
    for (uint32_t s = 0u; s < 5u; s++) {
        o.index[s] = 0u;
        if (quant[s] == 0u) {
            continue;
        }
        uint32_t k = 0u;
        while (k < o.count && o.id[k] != map[s]) {
            k++;
        }
        if (k == o.count) {
            o.id[k] = map[s];
            o.count++;
        }
        o.index[s] = k;
    }
    return o;
}

// Is x within `limit` (f32 bits) in magnitude? format/mod.rs `fits` (NaN is not), as one float
// comparison.
__device__ __forceinline__ bool plan_fits(float x, uint32_t limit) {
    // sass: checks
    return fabsf(x) <= u2f(limit);
}

// entries.cuh `lpmm_step` for the items of one plan: rule `R` (a generated adapter over
// `rule_<name>_apply` and, where its file has them, `rule_<name>_prepare` and `_fast`), gradient
// input `IO`, lanes of the parameter, the accumulator and the three states. Every item is whole
// (see kernels/plan_lanes.cuh), the parameter moves (F_UPDATE_PARAM), no state is given and
// nothing is a transform: the host sends other steps to `lpmm_step`.
//
// A thread first takes the fast path over its 16 elements: the rule's fast apply and the fast
// checks, which let through only values every element's `fits` passes and the lanes' exact.cuh
// rounding takes (FAST_LIMIT). If one element fails them, if the thread's run is cut by its
// item's end, or if the rule's constants are outside its fast apply's range (`prepare` gives
// 0), the thread redoes the step as `lpmm_step` does, from its elements as stored (nothing has
// been written yet): the cold path, which keeps the old values of an element that does not fit
// and reports it. Either way the values are the reference's; the stores follow.
template <class R, uint32_t IO, class P, class G, class S1, class S2, class S3>
__device__ __forceinline__ void plan_step(const Desc* descs, uint32_t ndesc, const uint32_t* maps,
                                          uint32_t* flags) {
    constexpr uint32_t QUANT[5] = {P::QUANT, G::QUANT, S1::QUANT, S2::QUANT, S3::QUANT};
    constexpr uint32_t MAP[5] = {P::MAP, G::MAP, S1::MAP, S2::MAP, S3::MAP};
    constexpr PlanMaps PM = plan_maps(QUANT, MAP);
    static_assert(PM.count <= PLAN_MAPS, "at most PLAN_MAPS maps per plan");
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
#pragma unroll
    for (uint32_t k = 0u; k < PM.count; k++) {
        plan_load_map(k, maps, PM.id[k]);
    }
    __syncthreads();
#pragma unroll
    for (uint32_t k = 0u; k < PM.count; k++) {
        plan_build_map(k);
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
        // The descriptor's fields, read once (the stores below may alias nothing of it, but the
        // compiler cannot know).
        const typename R::C c = *reinterpret_cast<const typename R::C*>(d->consts);
        const float clip = d->clip;
        const uint32_t fl = (d->flags & F_FIRST) | F_UPDATE_PARAM;
        const uint64_t counter = d->step;
        const uint32_t flag_index = d->flag_index;
        const uint32_t* io = reinterpret_cast<const uint32_t*>(d->io);
        const float aux = R::prepare(c);
        P p_lane;
        G g_lane;
        S1 s1_lane;
        S2 s2_lane;
        S3 s3_lane;
        p_lane.at(d, S_PARAM, PM.index[0], len_p);
        g_lane.at(d, S_GRAD, PM.index[1], 0u);
        s1_lane.at(d, S_STATE1, PM.index[2], len_1);
        s2_lane.at(d, S_STATE2, PM.index[3], len_2);
        s3_lane.at(d, S_STATE3, PM.index[4], len_3);
        float g[16];
        float x[16];
        float p[16];
        float m[16];
        float v[16];
        float w[16];
        bool exact = count != PER || aux == 0.0f;
        if (!exact) {
            // sass: loads
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
                // sass: decode
                PlanBf16<0u>::decode(y, x);
            }
            // sass: loads
            p_lane.load(first, p);
            s1_lane.load(first, m);
            s2_lane.load(first, v);
            s3_lane.load(first, w);
            bool bad = false;
#pragma unroll
            for (int j = 0; j < 16; j++) {
                // sass: rule
                // entries.cuh `gradient`: the accumulator (0 without one) plus the input.
                float gi = (IO != PLAN_IO_NONE ? g[j] + x[j] : g[j]) * clip;
                Update u = R::fast(c, aux, fl, p[j], gi, m[j], v[j], w[j]);
                // sass: checks
                // One comparison each, accumulated without a branch.
                bad |= !plan_fits(gi, LIMIT_F32);
                bad |= !plan_fits(u.p, P::FAST_LIMIT);
                bad |= !plan_fits(u.d, LIMIT_F32);
                bad |= !plan_fits(u.m, S1::FAST_LIMIT);
                bad |= !plan_fits(u.v, S2::FAST_LIMIT);
                bad |= !plan_fits(u.w, S3::FAST_LIMIT);
                p[j] = u.p;
                m[j] = u.m;
                v[j] = u.v;
                w[j] = u.w;
            }
            exact = bad;
        }
        if (exact) {
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
            const uint32_t lim_p = fmt_limit(P::FMT);
            const uint32_t lim_1 = fmt_limit(S1::FMT);
            const uint32_t lim_2 = fmt_limit(S2::FMT);
            const uint32_t lim_3 = fmt_limit(S3::FMT);
            bool bad = false;
#pragma unroll
            for (int j = 0; j < 16; j++) {
                float gi = (IO != PLAN_IO_NONE ? g[j] + x[j] : g[j]) * clip;
                Update u = R::apply(c, fl, p[j], gi, m[j], v[j], w[j]);
                // entries.cuh `step_ok`. Past `count` (all zeros) nothing is reported: every
                // value there is dropped.
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
        }
        uint32_t r[16];
        plan_bits<S1>(t, lt, S_STATE1, counter, r);
        s1_lane.store(first, count, m, r, exact);
        plan_bits<S2>(t, lt, S_STATE2, counter, r);
        s2_lane.store(first, count, v, r, exact);
        plan_bits<S3>(t, lt, S_STATE3, counter, r);
        s3_lane.store(first, count, w, r, exact);
        plan_bits<P>(t, lt, S_PARAM, counter, r);
        p_lane.store(first, count, p, r, exact);
        // Every thread of a block has read the accumulator's absmax before it is zeroed.
        __syncwarp();
        g_lane.clear(first, count);
        tile++;
    } while (tile < end);
}
