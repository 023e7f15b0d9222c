// Counter-based random bits (lpmm-quant random.rs, docs/FORMATS.md §9).

// ---------------------------------------------------------------------------------------------
// ChaCha8 (lpmm-quant random.rs): word i of the keystream with key (seed, tensor, 0, 0) and
// nonce `step` is word i % 16 of the block with 64-bit counter i / 16.

__device__ __forceinline__ void qr(uint32_t x[16], int a, int b, int c, int d) {
    // sass: random
    x[a] = x[a] + x[b];
    uint32_t r = x[d] ^ x[a];
    x[d] = (r << 16u) | (r >> 16u);
    x[c] = x[c] + x[d];
    r = x[b] ^ x[c];
    x[b] = (r << 12u) | (r >> 20u);
    x[a] = x[a] + x[b];
    r = x[d] ^ x[a];
    x[d] = (r << 8u) | (r >> 24u);
    x[c] = x[c] + x[d];
    r = x[b] ^ x[c];
    x[b] = (r << 7u) | (r >> 25u);
}

__device__ __forceinline__ void chacha8(uint64_t seed, uint64_t tensor, uint64_t counter,
                                        uint64_t nonce, uint32_t out[16]) {
    // sass: random
    uint32_t s[16];
    s[0] = 0x61707865u;
    s[1] = 0x3320646eu;
    s[2] = 0x79622d32u;
    s[3] = 0x6b206574u;
    s[4] = (uint32_t)seed;
    s[5] = (uint32_t)(seed >> 32);
    s[6] = (uint32_t)tensor;
    s[7] = (uint32_t)(tensor >> 32);
    s[8] = 0u;
    s[9] = 0u;
    s[10] = 0u;
    s[11] = 0u;
    s[12] = (uint32_t)counter;
    s[13] = (uint32_t)(counter >> 32);
    s[14] = (uint32_t)nonce;
    s[15] = (uint32_t)(nonce >> 32);
    uint32_t x[16];
#pragma unroll
    for (int i = 0; i < 16; i++) {
        x[i] = s[i];
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        qr(x, 0, 4, 8, 12);
        qr(x, 1, 5, 9, 13);
        qr(x, 2, 6, 10, 14);
        qr(x, 3, 7, 11, 15);
        qr(x, 0, 5, 10, 15);
        qr(x, 1, 6, 11, 12);
        qr(x, 2, 7, 8, 13);
        qr(x, 3, 4, 9, 14);
    }
#pragma unroll
    for (int i = 0; i < 16; i++) {
        out[i] = x[i] + s[i];
    }
}

// The stochastic-rounding draws of the 16 elements thread `lt` owns, from slot `slot`'s stream
// at `counter` (ParamLayout::stream: tensor id = stream << 2 | slot; element = the item's key +
// its index). Element g's draw is half of word g / 2 (the low half for even g, the high half for
// odd g) in the high 16 bits: the thread's 16 elements take words 0-7 or 8-15 of block g / 32
// (lpmm-quant `RandomStream::draws_at`).
__device__ __forceinline__ void thread_bits(const Tile& t, uint32_t lt, uint32_t slot,
                                            uint64_t counter, uint32_t r[16]) {
    // sass: random
    // backend `stream_tensor`: stream << 2 | slot; state 3's 2^63 | stream << 2.
    uint64_t tensor = slot == S_STATE3 ? (1ull << 63) | (t.d->stream << 2) : (t.d->stream << 2) | slot;
    // The logical index of the thread's first element (a multiple of 16).
    uint64_t key = t.d->key + t.start + PER * lt;
    uint32_t words[16];
    chacha8(t.d->seed, tensor, key >> 5, counter, words);
    // Selected with constant indices, so `words` stays in registers.
    bool upper = ((key >> 4) & 1u) != 0u;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        uint32_t w = upper ? words[8 + j] : words[j];
        r[2 * j] = w << 16u;
        r[2 * j + 1] = w & 0xFFFF0000u;
    }
}
