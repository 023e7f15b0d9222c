// Block-wise absmax quantization (lpmm-optim format/blockwise.rs, lpmm-quant blockwise.rs):
// packed codes (region 0) and one f32 absmax per block (region 1). aux: map | log2(block) << 8 |
// stochastic << 16 | code bits << 24.

__device__ __forceinline__ bool fmt_blockwise_stochastic(uint32_t aux) {
    return ((aux >> 16u) & 1u) == 1u;
}

__device__ __forceinline__ float fmt_blockwise_load(const Tile& t, const uint32_t* maps,
                                                    uint32_t s, uint32_t i) {
    uint32_t aux = slot_aux(t, s);
    uint32_t map = aux & 0xFFu;
    uint32_t log_block = (aux >> 8u) & 0xFFu;
    uint32_t bits = aux >> 24u;
    uint32_t at = i * bits;
    uint32_t code = (rd(region(t, s, 0u), at / 32u) >> (at % 32u)) & ((1u << bits) - 1u);
    float absmax = u2f(rd(region(t, s, 1u), i >> log_block));
    return map_value(maps, map, code) * absmax;
}

// Blockwise::quantize_block over the thread's share of each block: the block's absmax (the
// largest |x| as bits, reduced across the threads of the block), then each code nearest to (or
// stochastically rounded from) x / absmax. Called by every thread of the block.
__device__ __forceinline__ void fmt_blockwise_store(const Tile& t, const uint32_t* maps,
                                                    uint32_t* red, uint32_t lt, uint32_t s,
                                                    const float v[16], uint32_t count,
                                                    const uint32_t r[16]) {
    uint32_t aux = slot_aux(t, s);
    uint32_t map = aux & 0xFFu;
    uint32_t log_block = (aux >> 8u) & 0xFFu;
    bool stochastic = fmt_blockwise_stochastic(aux);
    uint32_t bits = aux >> 24u;
    uint32_t local = 0u;
    for (uint32_t j = 0u; j < count; j++) {
        uint32_t m = f2u(v[j]) & 0x7FFFFFFFu;
        local = m > local ? m : local;
    }
    // Threads per block (blocks are at least 32 elements).
    uint32_t group = (1u << log_block) / PER;
    __syncthreads();
    red[lt] = local;
    __syncthreads();
    for (uint32_t st = 1u; st < THREADS; st = st * 2u) {
        if (st < group && (lt % (2u * st)) == 0u) {
            uint32_t o = red[lt + st];
            red[lt] = o > red[lt] ? o : red[lt];
        }
        __syncthreads();
    }
    float absmax = u2f(red[(lt / group) * group]);
    if (count == 0u) {
        return;
    }
    uint32_t first = t.start + PER * lt;
    uint32_t words[4] = {0u, 0u, 0u, 0u};
    for (uint32_t j = 0u; j < count; j++) {
        float y = 0.0f;
        if (absmax != 0.0f) {
            y = v[j] / absmax;
        }
        uint32_t code;
        if (stochastic) {
            code = map_stochastic(maps, map, y, r[j]);
        } else {
            code = map_nearest(maps, map, y);
        }
        uint32_t at = j * bits;
        words[at / 32u] = words[at / 32u] | (code << (at % 32u));
    }
    uint32_t used = (count * bits + 31u) / 32u;
    uint32_t w0 = (first * bits) / 32u;
    for (uint32_t k = 0u; k < used; k++) {
        wr(region(t, s, 0u), w0 + k, words[k]);
    }
    if ((first & ((1u << log_block) - 1u)) == 0u) {
        wr(region(t, s, 1u), first >> log_block, f2u(absmax));
    }
}

// A zero absmax makes every code decode as 0; 8-bit codes also get the code of 0 (narrower ones
// are left as they are, as on the CPU).
__device__ __forceinline__ void fmt_blockwise_clear(const Tile& t, const uint32_t* maps,
                                                    uint32_t lt, uint32_t s, uint32_t count) {
    uint32_t aux = slot_aux(t, s);
    uint32_t log_block = (aux >> 8u) & 0xFFu;
    uint32_t bits = aux >> 24u;
    uint32_t first = t.start + PER * lt;
    if (bits == 8u && count > 0u) {
        uint32_t zero = map_nearest(maps, aux & 0xFFu, 0.0f);
        uint32_t z = zero | (zero << 8u) | (zero << 16u) | (zero << 24u);
        for (uint32_t k = 0u; k < (count + 3u) / 4u; k++) {
            wr(region(t, s, 0u), first / 4u + k, z);
        }
    }
    if (count > 0u && (first & ((1u << log_block) - 1u)) == 0u) {
        wr(region(t, s, 1u), first >> log_block, 0u);
    }
}
