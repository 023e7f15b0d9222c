// bf16+8, 24-bit master weights (lpmm-optim format/bf16_plus8.rs): the bf16 visible halves
// (region 0, two per word, low half first) and the correction bytes (region 1, four per word);
// aux bit 0: stochastic rounding onto the 24-bit grid.

__device__ __forceinline__ bool fmt_bf16_plus8_stochastic(uint32_t aux) {
    return (aux & 1u) == 1u;
}

__device__ __forceinline__ float fmt_bf16_plus8_load(const Tile& t, const uint32_t* maps,
                                                     uint32_t s, uint32_t i) {
    uint32_t hi = (rd(region(t, s, 0u), i / 2u) >> (16u * (i & 1u))) & 0xFFFFu;
    uint32_t lo = (rd(region(t, s, 1u), i / 4u) >> (8u * (i & 3u))) & 0xFFu;
    uint32_t h = (hi - (lo >= 0x80u ? 1u : 0u)) & 0xFFFFu;
    return u2f((h << 16u) | (lo << 8u));
}

// bf16_plus8::round24: nearest even, or up when the word's top byte is below the discarded one.
__device__ __forceinline__ uint32_t fmt_bf16_plus8_round(float x, bool sr, uint32_t r) {
    uint32_t b = f2u(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
        return (b | 0x00400000u) & 0xFFFFFF00u;
    }
    uint32_t up;
    if (sr) {
        up = (r >> 24u) < (b & 0xFFu) ? 0x100u : 0u;
    } else {
        up = 0x7Fu + ((b >> 8u) & 1u);
    }
    return (b + up) & 0xFFFFFF00u;
}

__device__ __forceinline__ void fmt_bf16_plus8_store(const Tile& t, const uint32_t* maps,
                                                     uint32_t* red, uint32_t lt, uint32_t s,
                                                     const float v[16], uint32_t count,
                                                     const uint32_t r[16]) {
    uint32_t* a = region(t, s, 0u);
    uint32_t* b = region(t, s, 1u);
    bool sr = fmt_bf16_plus8_stochastic(slot_aux(t, s));
    uint32_t first = t.start + PER * lt;
    for (uint32_t j = 0u; j < count; j += 4u) {
        uint32_t h[4] = {0u, 0u, 0u, 0u};
        uint32_t lo = 0u;
        for (uint32_t k = 0u; k < 4u; k++) {
            if (j + k < count) {
                uint32_t w = fmt_bf16_plus8_round(v[j + k], sr, r[j + k]);
                uint32_t c = (w >> 8u) & 0xFFu;
                h[k] = ((w >> 16u) + (c >= 0x80u ? 1u : 0u)) & 0xFFFFu;
                lo |= c << (8u * k);
            }
        }
        wr(a, (first + j) / 2u, h[0] | (h[1] << 16u));
        if (j + 2u < count) {
            wr(a, (first + j) / 2u + 1u, h[2] | (h[3] << 16u));
        }
        wr(b, (first + j) / 4u, lo);
    }
}

__device__ __forceinline__ void fmt_bf16_plus8_clear(const Tile& t, const uint32_t* maps,
                                                     uint32_t lt, uint32_t s, uint32_t count) {
    uint32_t first = t.start + PER * lt;
    for (uint32_t j = 0u; j < count; j += 4u) {
        wr(region(t, s, 0u), (first + j) / 2u, 0u);
        if (j + 2u < count) {
            wr(region(t, s, 0u), (first + j) / 2u + 1u, 0u);
        }
        wr(region(t, s, 1u), (first + j) / 4u, 0u);
    }
}
