// bf16 (lpmm-optim format/bf16.rs): two elements per word, low half first; rounded to nearest
// even, or stochastically (aux bit 0).

__device__ __forceinline__ bool fmt_bf16_stochastic(uint32_t aux) {
    return (aux & 1u) == 1u;
}

__device__ __forceinline__ float fmt_bf16_load(const Tile& t, const uint32_t* maps, uint32_t s,
                                               uint32_t i) {
    return bf16_value((rd(region(t, s, 0u), i / 2u) >> (16u * (i & 1u))) & 0xFFFFu);
}

__device__ __forceinline__ void fmt_bf16_store(const Tile& t, const uint32_t* maps, uint32_t* red,
                                               uint32_t lt, uint32_t s, const float v[16],
                                               uint32_t count, const uint32_t r[16]) {
    uint32_t* a = region(t, s, 0u);
    bool sr = fmt_bf16_stochastic(slot_aux(t, s));
    uint32_t first = t.start + PER * lt;
    for (uint32_t j = 0u; j < count; j += 2u) {
        uint32_t h[2] = {0u, 0u};
        for (uint32_t k = 0u; k < 2u; k++) {
            if (j + k < count) {
                if (sr) {
                    h[k] = bf16_stochastic(v[j + k], r[j + k]);
                } else {
                    h[k] = bf16_nearest(v[j + k]);
                }
            }
        }
        wr(a, (first + j) / 2u, h[0] | (h[1] << 16u));
    }
}

__device__ __forceinline__ void fmt_bf16_clear(const Tile& t, const uint32_t* maps, uint32_t lt,
                                               uint32_t s, uint32_t count) {
    uint32_t* a = region(t, s, 0u);
    uint32_t first = t.start + PER * lt;
    for (uint32_t j = 0u; j < count; j += 2u) {
        wr(a, (first + j) / 2u, 0u);
    }
}
