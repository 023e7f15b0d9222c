// The specialized fused steps' kernel body, `plan_step` (see plan_lanes.cuh for what they are and
// how they differ from `lpmm_step`), and the thread pairs' random draws.

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

// random.cuh `qr` on four registers.
__device__ __forceinline__ void plan_qr(uint32_t& a, uint32_t& b, uint32_t& c, uint32_t& d) {
    // sass: random
    a = a + b;
    d = d ^ a;
    d = (d << 16u) | (d >> 16u);
    c = c + d;
    b = b ^ c;
    b = (b << 12u) | (b >> 20u);
    a = a + b;
    d = d ^ a;
    d = (d << 8u) | (d >> 24u);
    c = c + d;
    b = b ^ c;
    b = (b << 7u) | (b >> 25u);
}

// random.cuh `thread_bits` for a pair of threads that share one ChaCha8 block (lanes 2i and
// 2i + 1 when the tile's first key is a multiple of 32: the even lane takes words 0-7, the odd
// one 8-15), computed by both: each lane holds two of its four columns (lane q: columns 2q and
// 2q + 1), runs the two quarter rounds of a column round on them, trades four words with its
// partner for the diagonal round's two (its diagonals 2q and 2q + 1), and trades them back; at
// the end each hands its partner the four words of the partner's half. The same words as
// `chacha8`, in half its rounds per lane. Every lane of the warp calls it.
__device__ __forceinline__ void plan_pair_bits(const Tile& t, uint32_t lt, uint32_t slot,
                                               uint64_t counter, uint32_t r[16]) {
    // sass: random
    uint64_t tensor = slot == S_STATE3 ? (1ull << 63) | (t.d->stream << 2) : (t.d->stream << 2) | slot;
    uint64_t block = (t.d->key + t.start + PER * lt) >> 5;
    uint64_t seed = t.d->seed;
    bool q = (lt & 1u) != 0u;
    // Lane q's columns of the initial state: constants, key (seed, tensor), zeros, the block
    // counter and the nonce (the step).
    const uint32_t s_a0 = q ? 0x79622d32u : 0x61707865u;
    const uint32_t s_a1 = q ? 0x6b206574u : 0x3320646eu;
    const uint32_t s_b0 = q ? (uint32_t)tensor : (uint32_t)seed;
    const uint32_t s_b1 = q ? (uint32_t)(tensor >> 32) : (uint32_t)(seed >> 32);
    const uint32_t s_d0 = q ? (uint32_t)counter : (uint32_t)block;
    const uint32_t s_d1 = q ? (uint32_t)(counter >> 32) : (uint32_t)(block >> 32);
    uint32_t a0 = s_a0, a1 = s_a1, b0 = s_b0, b1 = s_b1;
    uint32_t c0 = 0u, c1 = 0u, d0 = s_d0, d1 = s_d1;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        plan_qr(a0, b0, c0, d0);
        plan_qr(a1, b1, c1, d1);
        uint32_t pb0 = __shfl_xor_sync(0xFFFFFFFFu, b0, 1u);
        uint32_t pc0 = __shfl_xor_sync(0xFFFFFFFFu, c0, 1u);
        uint32_t pc1 = __shfl_xor_sync(0xFFFFFFFFu, c1, 1u);
        uint32_t pd1 = __shfl_xor_sync(0xFFFFFFFFu, d1, 1u);
        plan_qr(a0, b1, pc0, pd1);
        plan_qr(a1, pb0, pc1, d0);
        b0 = __shfl_xor_sync(0xFFFFFFFFu, pb0, 1u);
        c0 = __shfl_xor_sync(0xFFFFFFFFu, pc0, 1u);
        c1 = __shfl_xor_sync(0xFFFFFFFFu, pc1, 1u);
        d1 = __shfl_xor_sync(0xFFFFFFFFu, pd1, 1u);
    }
    // The keystream: the state plus the initial state (the zeros add nothing).
    a0 += s_a0;
    a1 += s_a1;
    b0 += s_b0;
    b1 += s_b1;
    d0 += s_d0;
    d1 += s_d1;
    // Lane 0 takes rows 0 and 1 (words 0-7), lane 1 rows 2 and 3 (words 8-15), each row's
    // other two columns from its partner.
    uint32_t r0 = __shfl_xor_sync(0xFFFFFFFFu, q ? a0 : c0, 1u);
    uint32_t r1 = __shfl_xor_sync(0xFFFFFFFFu, q ? a1 : c1, 1u);
    uint32_t r2 = __shfl_xor_sync(0xFFFFFFFFu, q ? b0 : d0, 1u);
    uint32_t r3 = __shfl_xor_sync(0xFFFFFFFFu, q ? b1 : d1, 1u);
    uint32_t w[8];
    w[0] = q ? r0 : a0;
    w[1] = q ? r1 : a1;
    w[2] = q ? c0 : r0;
    w[3] = q ? c1 : r1;
    w[4] = q ? r2 : b0;
    w[5] = q ? r3 : b1;
    w[6] = q ? d0 : r2;
    w[7] = q ? d1 : r3;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        r[2 * j] = w[j] << 16u;
        r[2 * j + 1] = w[j] & 0xFFFF0000u;
    }
}

// The random draws of slot `s` for a thread's 16 elements (random.cuh `thread_bits`), if the
// lane rounds stochastically: shared by thread pairs where the tile's first key is a multiple
// of 32 (`paired`: every item, as pieces and shards start at multiples of 256), else one ChaCha8
// block per thread (a cold path). Every thread of the warp calls it.
template <class L>
__device__ __forceinline__ void plan_bits(const Tile& t, uint32_t lt, uint32_t s,
                                          uint64_t counter, bool paired, uint32_t r[16]) {
    // sass: random
    if (L::SR) {
        if (paired && !PLAN_FORCE_COLD) {
            plan_pair_bits(t, lt, s, counter, r);
        } else {
            PLAN_COLD();
            thread_bits(t, lt, s, counter, r);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 16; j++) {
            r[j] = 0u;
        }
    }
}

// Which shared code map each slot of a plan reads: slots quantized with the same map share one,
// whose keys are its values if a slot stores with stochastic rounding (`sr`), its thresholds
// otherwise; the accumulator (slot 1) only decodes and clears, with either. No map serves both
// roundings or both kinds of buckets (`mixed`).
struct PlanMaps {
    // The map of slot s, as an index into the plan's shared maps.
    uint32_t index[5];
    // The shared maps: how many, each one's map id and rounding.
    uint32_t count;
    uint32_t id[5];
    bool sr[5];
    bool linear[5];
    bool mixed;
};

__device__ constexpr PlanMaps plan_maps(const uint32_t quant[5], const uint32_t map[5],
                                        const bool sr[5], const bool linear[5]) {
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
            o.sr[k] = false;
            o.linear[k] = linear[s];
            o.count++;
        }
        o.mixed = o.mixed || o.linear[k] != linear[s];
        if (s != 1u) {
            bool first = true;
            for (uint32_t t = 0u; t < s; t++) {
                first = first && !(t != 1u && quant[t] != 0u && map[t] == map[s]);
            }
            o.mixed = o.mixed || (!first && o.sr[k] != sr[s]);
            o.sr[k] = sr[s];
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
    constexpr bool SR[5] = {P::SR, G::SR, S1::SR, S2::SR, S3::SR};
    constexpr bool LINEAR[5] = {P::LINEAR, G::LINEAR, S1::LINEAR, S2::LINEAR, S3::LINEAR};
    constexpr PlanMaps PM = plan_maps(QUANT, MAP, SR, LINEAR);
    static_assert(PM.count <= PLAN_MAPS, "at most PLAN_MAPS maps per plan");
    static_assert(!PM.mixed, "a map with both roundings or both kinds of buckets");
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
        plan_load_map(k, maps, PM.id[k], PM.sr[k]);
    }
    __syncthreads();
#pragma unroll
    for (uint32_t k = 0u; k < PM.count; k++) {
        plan_build_map(k, PM.linear[k]);
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
        bool exact = count != PER || aux == 0.0f || PLAN_FORCE_COLD;
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
        const bool paired = ((d->key + t.start) & 16u) == 0u;
        plan_bits<S1>(t, lt, S_STATE1, counter, paired, r);
        s1_lane.store(first, count, m, r, exact);
        plan_bits<S2>(t, lt, S_STATE2, counter, paired, r);
        s2_lane.store(first, count, v, r, exact);
        plan_bits<S3>(t, lt, S_STATE3, counter, paired, r);
        s3_lane.store(first, count, w, r, exact);
        plan_bits<P>(t, lt, S_PARAM, counter, paired, r);
        p_lane.store(first, count, p, r, exact);
        // Every thread of a block has read the accumulator's absmax before it is zeroed.
        __syncwarp();
        g_lane.clear(first, count);
        tile++;
    } while (tile < end);
}
