// f32 (lpmm-optim format/f32.rs): one word per element.

__device__ __forceinline__ float fmt_f32_load(const Tile& t, const uint32_t* maps, uint32_t s,
                                              uint32_t i) {
    return u2f(rd(region(t, s, 0u), i));
}

__device__ __forceinline__ void fmt_f32_store(const Tile& t, const uint32_t* maps, uint32_t* red,
                                              uint32_t lt, uint32_t s, const float v[16],
                                              uint32_t count, const uint32_t r[16]) {
    uint32_t* a = region(t, s, 0u);
    uint32_t first = t.start + PER * lt;
    for (uint32_t j = 0u; j < count; j++) {
        wr(a, first + j, f2u(v[j]));
    }
}

__device__ __forceinline__ void fmt_f32_clear(const Tile& t, const uint32_t* maps, uint32_t lt,
                                              uint32_t s, uint32_t count) {
    uint32_t* a = region(t, s, 0u);
    uint32_t first = t.start + PER * lt;
    for (uint32_t j = 0u; j < count; j++) {
        wr(a, first + j, 0u);
    }
}
