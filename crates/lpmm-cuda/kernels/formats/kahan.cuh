// bf16 with a bf16 Kahan compensation (lpmm-optim format/kahan.rs): value and compensation in
// two regions; an update is added as an increment (split.rs `kahan_add`).

__device__ __forceinline__ float fmt_kahan_load(const Tile& t, const uint32_t* maps, uint32_t s,
                                                uint32_t i) {
    // The parameter a model sees is the bf16 value; the compensation only feeds updates.
    return bf16_value((rd(region(t, s, 0u), i / 2u) >> (16u * (i & 1u))) & 0xFFFFu);
}

__device__ __forceinline__ void fmt_kahan_store(const Tile& t, const uint32_t* maps,
                                                uint32_t* red, uint32_t lt, uint32_t s,
                                                const float v[16], uint32_t count,
                                                const uint32_t r[16]) {
    // Re-initialisation: the value itself and no compensation beyond its rounding.
    uint32_t* a = region(t, s, 0u);
    uint32_t* b = region(t, s, 1u);
    uint32_t first = t.start + PER * lt;
    for (uint32_t j = 0u; j < count; j += 2u) {
        uint32_t h[2] = {0u, 0u};
        uint32_t c[2] = {0u, 0u};
        for (uint32_t k = 0u; k < 2u; k++) {
            if (j + k < count) {
                float x = v[j + k];
                h[k] = bf16_nearest(x);
                c[k] = bf16_nearest(x - bf16_value(h[k]));
            }
        }
        wr(a, (first + j) / 2u, h[0] | (h[1] << 16u));
        wr(b, (first + j) / 2u, c[0] | (c[1] << 16u));
    }
}

__device__ __forceinline__ void fmt_kahan_clear(const Tile& t, const uint32_t* maps, uint32_t lt,
                                                uint32_t s, uint32_t count) {
    uint32_t first = t.start + PER * lt;
    for (uint32_t j = 0u; j < count; j += 2u) {
        wr(region(t, s, 0u), (first + j) / 2u, 0u);
        wr(region(t, s, 1u), (first + j) / 2u, 0u);
    }
}

__device__ __forceinline__ bool fmt_kahan_add(const Tile& t, uint32_t lt, uint32_t s,
                                              const float d[16], uint32_t count) {
    uint32_t* a = region(t, s, 0u);
    uint32_t* b = region(t, s, 1u);
    uint32_t first = t.start + PER * lt;
    for (uint32_t j = 0u; j < count; j += 2u) {
        uint32_t h[2] = {0u, 0u};
        uint32_t cw[2] = {0u, 0u};
        uint32_t word_v = rd(a, (first + j) / 2u);
        uint32_t word_c = rd(b, (first + j) / 2u);
        for (uint32_t k = 0u; k < 2u; k++) {
            if (j + k < count) {
                float old = bf16_value((word_v >> (16u * k)) & 0xFFFFu);
                float comp = bf16_value((word_c >> (16u * k)) & 0xFFFFu);
                float c = comp + d[j + k];
                h[k] = bf16_nearest(old + c);
                cw[k] = bf16_nearest(c + (old - bf16_value(h[k])));
            }
        }
        wr(a, (first + j) / 2u, h[0] | (h[1] << 16u));
        wr(b, (first + j) / 2u, cw[0] | (cw[1] << 16u));
    }
    return true;
}
