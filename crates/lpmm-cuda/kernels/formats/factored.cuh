// Adafactor's factorized second moment (lpmm-optim format/factored.rs): the row averages
// (region 0), column averages (1), mean(r) (2), and the folds' scratch: per row, then per
// column, the largest exponent of the squares + 1024 (3) and the 64-bit fixed-point sum (4).

// (rows, cols) of the tensor viewed as a matrix (leading dimensions x last).
struct FactoredDims {
    uint64_t rows;
    uint64_t cols;
};

__device__ __forceinline__ FactoredDims factored_dims(const Tile& t) {
    uint32_t nd = t.d->ndim;
    uint64_t rows = 1u;
    for (uint32_t k = 0u; k + 1u < nd; k++) {
        rows = rows * t.d->shape[k];
    }
    FactoredDims dims;
    dims.rows = rows;
    dims.cols = t.d->shape[nd - 1u];
    return dims;
}

__device__ __forceinline__ float fmt_factored_load(const Tile& t, const uint32_t* maps,
                                                   uint32_t s, uint32_t i) {
    FactoredDims dims = factored_dims(t);
    uint64_t e = global_index(t, i);
    float mean = u2f(rd(region(t, s, 2u), 0u));
    if (mean > 0.0f) {
        float r = u2f(rd(region(t, s, 0u), e / dims.cols));
        float c = u2f(rd(region(t, s, 1u), e % dims.cols));
        return r * c / mean;
    }
    return 0.0f;
}

// x = m 2^e0 with an integer significand m < 2^24: (m^2, exact in 64 bits, and e0).
struct Square {
    uint64_t sq;
    int32_t e0;
};

__device__ __forceinline__ Square square(float x) {
    uint32_t b = f2u(x) & 0x7FFFFFFFu;
    uint32_t eb = b >> 23u;
    uint32_t m = b & 0x7FFFFFu;
    int32_t e0 = -149;
    if (eb != 0u) {
        m = m | 0x800000u;
        e0 = (int32_t)eb - 150;
    }
    Square out;
    out.sq = (uint64_t)m * (uint64_t)m;
    out.e0 = e0;
    return out;
}

// Fractional bits of a sum over `count` terms (factored.rs `frac_bits`).
__device__ __forceinline__ int32_t frac_bits(uint64_t count) {
    return 62 - (int32_t)bitlen64(count);
}

// Pass 0: the exponent of x^2 into its row's and column's maxima; pass 1: floor(x^2 2^(F - E))
// into their sums.
__device__ __forceinline__ void fmt_factored_fold(const Tile& t, const uint32_t* maps, uint32_t s,
                                                  uint32_t phase, uint32_t i, float x) {
    if (!is_finite(x) || x == 0.0f) {
        return;
    }
    FactoredDims dims = factored_dims(t);
    uint64_t e = global_index(t, i);
    uint64_t keys[2] = {e / dims.cols, dims.rows + e % dims.cols};
    uint64_t counts[2] = {dims.cols, dims.rows};
    Square q = square(x);
    int32_t ex = (int32_t)bitlen64(q.sq) - 1 + 2 * q.e0;
    for (uint32_t k = 0u; k < 2u; k++) {
        if (phase == 0u) {
            wide_max(region(t, s, 3u), keys[k], (uint32_t)(ex + 1024));
        } else {
            int32_t big = (int32_t)rd(region(t, s, 3u), keys[k]) - 1024;
            int32_t shift = 2 * q.e0 + frac_bits(counts[k]) - big;
            uint64_t term;
            if (shift >= 0) {
                term = shl64(q.sq, (uint32_t)shift);
            } else {
                term = shr64(q.sq, (uint32_t)(-shift));
            }
            wide_add64(region(t, s, 4u), keys[k], term);
        }
    }
}
