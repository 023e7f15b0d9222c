// Adafactor's factorized second moment (lpmm-optim format/factored.rs): the row averages
// (region 0), column averages (1), mean(r) (2), and the folds' scratch (fixed.rs): per row, then
// per column, the largest exponent of the squares + 1024 (3) and the 64-bit fixed-point sum (4).

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
        return r / mean * c;
    }
    return 0.0f;
}

// Pass 0: the exponent of x^2 into its row's and column's maxima; pass 1: floor(x^2 2^(F - E))
// into their sums.
__device__ __forceinline__ void fmt_factored_fold(const Tile& t, const uint32_t* maps, uint32_t s,
                                                  uint32_t phase, uint32_t i, float x) {
    if (!fixed_counts(x)) {
        return;
    }
    FactoredDims dims = factored_dims(t);
    uint64_t e = global_index(t, i);
    uint64_t keys[2] = {e / dims.cols, dims.rows + e % dims.cols};
    uint64_t counts[2] = {dims.cols, dims.rows};
    for (uint32_t k = 0u; k < 2u; k++) {
        if (phase == 0u) {
            wide_max(region(t, s, 3u), keys[k], fixed_exponent(x));
        } else {
            uint64_t term = fixed_term(x, rd(region(t, s, 3u), keys[k]), frac_bits(counts[k]));
            wide_add64(region(t, s, 4u), keys[k], term);
        }
    }
}
