// Split f32 (lpmm-optim format/split_f32.rs, lpmm-formats split.rs): the bf16 visible halves and
// the 16-bit remainders in two regions.

__device__ __forceinline__ float fmt_split_f32_load(const Tile& t, const uint32_t* maps,
                                                    uint32_t s, uint32_t i) {
    uint32_t shift = 16u * (i & 1u);
    uint32_t hi = (rd(region(t, s, 0u), i / 2u) >> shift) & 0xFFFFu;
    uint32_t rem = (rd(region(t, s, 1u), i / 2u) >> shift) & 0xFFFFu;
    uint32_t h = (hi - (rem >= 0x8000u ? 1u : 0u)) & 0xFFFFu;
    return u2f((h << 16u) | rem);
}

__device__ __forceinline__ void fmt_split_f32_store(const Tile& t, const uint32_t* maps,
                                                    uint32_t* red, uint32_t lt, uint32_t s,
                                                    const float v[16], uint32_t count,
                                                    const uint32_t r[16]) {
    uint32_t* a = region(t, s, 0u);
    uint32_t* b = region(t, s, 1u);
    uint32_t first = t.start + PER * lt;
    for (uint32_t j = 0u; j < count; j += 2u) {
        uint32_t h[2] = {0u, 0u};
        uint32_t m[2] = {0u, 0u};
        for (uint32_t k = 0u; k < 2u; k++) {
            if (j + k < count) {
                uint32_t bits = f2u(v[j + k]);
                if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
                    bits = (bits & 0x80000000u) | 0x7FC00000u;
                }
                m[k] = bits & 0xFFFFu;
                h[k] = ((bits >> 16u) + (m[k] >= 0x8000u ? 1u : 0u)) & 0xFFFFu;
            }
        }
        wr(a, (first + j) / 2u, h[0] | (h[1] << 16u));
        wr(b, (first + j) / 2u, m[0] | (m[1] << 16u));
    }
}

__device__ __forceinline__ void fmt_split_f32_clear(const Tile& t, const uint32_t* maps,
                                                    uint32_t lt, uint32_t s, uint32_t count) {
    uint32_t first = t.start + PER * lt;
    for (uint32_t j = 0u; j < count; j += 2u) {
        wr(region(t, s, 0u), (first + j) / 2u, 0u);
        wr(region(t, s, 1u), (first + j) / 2u, 0u);
    }
}
