// Rank-1 normalized codes of a second moment (lpmm-optim format/rank1.rs, lpmm-quant rank1.rs):
// packed codes (region 0), the current per-dimension maxima (region 1) and the next step's
// (region 2, folded with atomic max). aux: map | code bits << 24.

// Where dimension k's maxima start, and tensor element e's index along it. (The loops run over
// MAX_DIMS with a test against the tensor's rank, so that they unroll and the arrays stay in
// registers.)
struct Rank1Index {
    uint32_t off[MAX_DIMS];
    uint32_t idx[MAX_DIMS];
    uint32_t nd;
};

__device__ __forceinline__ Rank1Index rank1_index(const Tile& t, uint64_t e) {
    Rank1Index r;
    r.nd = t.d->ndim;
    uint32_t acc = 0u;
#pragma unroll
    for (uint32_t k = 0u; k < MAX_DIMS; k++) {
        r.off[k] = acc;
        if (k < r.nd) {
            acc = acc + t.d->shape[k];
        }
    }
    uint64_t rest = e;
#pragma unroll
    for (uint32_t k = MAX_DIMS; k > 0u; k--) {
        r.idx[k - 1u] = 0u;
        if (k <= r.nd) {
            uint32_t d = t.d->shape[k - 1u];
            r.idx[k - 1u] = (uint32_t)(rest % d);
            rest = rest / d;
        }
    }
    return r;
}

// Rank1::for_each_scale: min over the outer dimensions, then with the last one's.
__device__ __forceinline__ float rank1_scale(const Tile& t, const uint32_t* a, uint64_t e) {
    Rank1Index r = rank1_index(t, e);
    float outer = u2f(0x7F800000u);
    float last = outer;
#pragma unroll
    for (uint32_t k = 0u; k < MAX_DIMS; k++) {
        if (k + 1u < r.nd) {
            outer = fminf(outer, u2f(rd(a, r.off[k] + r.idx[k])));
        } else if (k + 1u == r.nd) {
            last = u2f(rd(a, r.off[k] + r.idx[k]));
        }
    }
    return fminf(outer, last);
}

__device__ __forceinline__ float fmt_rank1_load(const Tile& t, const uint32_t* maps, uint32_t s,
                                                uint32_t i) {
    uint32_t aux = slot_aux(t, s);
    uint32_t bits = aux >> 24u;
    uint32_t at = i * bits;
    uint32_t code = (rd(region(t, s, 0u), at / 32u) >> (at % 32u)) & ((1u << bits) - 1u);
    return map_value(maps, aux & 0xFFu, code) *
           rank1_scale(t, region(t, s, 1u), global_index(t, i));
}

// The codes nearest to v / s with the next step's maxima.
__device__ __forceinline__ void fmt_rank1_store(const Tile& t, const uint32_t* maps,
                                                uint32_t* red, uint32_t lt, uint32_t s,
                                                const float v[16], uint32_t count,
                                                const uint32_t r[16]) {
    uint32_t aux = slot_aux(t, s);
    uint32_t map = aux & 0xFFu;
    uint32_t bits = aux >> 24u;
    uint32_t first = t.start + PER * lt;
    uint32_t words[4] = {0u, 0u, 0u, 0u};
    for (uint32_t j = 0u; j < count; j++) {
        float sc = rank1_scale(t, region(t, s, 2u), global_index(t, first + j));
        float y = 0.0f;
        if (sc != 0.0f) {
            y = v[j] / sc;
        }
        uint32_t at = j * bits;
        words[at / 32u] = words[at / 32u] | (map_nearest(maps, map, y) << (at % 32u));
    }
    uint32_t used = (count * bits + 31u) / 32u;
    uint32_t w0 = (first * bits) / 32u;
    for (uint32_t k = 0u; k < used; k++) {
        wr(region(t, s, 0u), w0 + k, words[k]);
    }
}

// Rank1::fold_maxima of the updated second moment: every dimension's maximum at the element's
// index (a max of non-negative floats is a max of their bits, the same in any order).
__device__ __forceinline__ void fmt_rank1_fold(const Tile& t, const uint32_t* maps, uint32_t s,
                                               uint32_t phase, uint32_t i, float x) {
    Rank1Index r = rank1_index(t, global_index(t, i));
    uint32_t* a = region(t, s, 2u);
    uint32_t bits = f2u(x) & 0x7FFFFFFFu;
#pragma unroll
    for (uint32_t k = 0u; k < MAX_DIMS; k++) {
        if (k < r.nd) {
            wide_max(a, r.off[k] + r.idx[k], bits);
        }
    }
}
