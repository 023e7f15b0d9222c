// Counter-based random bits (lpmm-quant random.rs, docs/FORMATS.md §9).

// ---------------------------------------------------------------------------------------------
// ChaCha8 (lpmm-quant random.rs): word i of the keystream with key (seed, tensor, 0, 0) and
// nonce `step` is word i % 16 of the block with 64-bit counter i / 16.

fn qr(x: ptr<function, array<u32, 16>>, a: u32, b: u32, c: u32, d: u32) {
    (*x)[a] = (*x)[a] + (*x)[b];
    var r = (*x)[d] ^ (*x)[a];
    (*x)[d] = (r << 16u) | (r >> 16u);
    (*x)[c] = (*x)[c] + (*x)[d];
    r = (*x)[b] ^ (*x)[c];
    (*x)[b] = (r << 12u) | (r >> 20u);
    (*x)[a] = (*x)[a] + (*x)[b];
    r = (*x)[d] ^ (*x)[a];
    (*x)[d] = (r << 8u) | (r >> 24u);
    (*x)[c] = (*x)[c] + (*x)[d];
    r = (*x)[b] ^ (*x)[c];
    (*x)[b] = (r << 7u) | (r >> 25u);
}

fn chacha8(seed: vec2<u32>, tensor: vec2<u32>, counter: vec2<u32>, nonce: vec2<u32>) -> array<u32, 16> {
    var s: array<u32, 16>;
    s[0] = 0x61707865u;
    s[1] = 0x3320646eu;
    s[2] = 0x79622d32u;
    s[3] = 0x6b206574u;
    s[4] = seed.x;
    s[5] = seed.y;
    s[6] = tensor.x;
    s[7] = tensor.y;
    s[8] = 0u;
    s[9] = 0u;
    s[10] = 0u;
    s[11] = 0u;
    s[12] = counter.x;
    s[13] = counter.y;
    s[14] = nonce.x;
    s[15] = nonce.y;
    var x = s;
    for (var i = 0u; i < 4u; i = i + 1u) {
        qr(&x, 0u, 4u, 8u, 12u);
        qr(&x, 1u, 5u, 9u, 13u);
        qr(&x, 2u, 6u, 10u, 14u);
        qr(&x, 3u, 7u, 11u, 15u);
        qr(&x, 0u, 5u, 10u, 15u);
        qr(&x, 1u, 6u, 11u, 12u);
        qr(&x, 2u, 7u, 8u, 13u);
        qr(&x, 3u, 4u, 9u, 14u);
    }
    for (var i = 0u; i < 16u; i = i + 1u) {
        x[i] = x[i] + s[i];
    }
    return x;
}

// The stochastic-rounding draws of the 16 elements thread `lt` owns, from slot `slot`'s stream
// at `counter` (backend `stream_tensor`: tensor id = stream << 2 | slot, state 3's
// 2^63 | stream << 2; element = the item's key + its index). Element g's draw is half of word
// g / 2 (the low half for even g, the high half for odd g) in the high 16 bits: the thread's 16
// elements take words 0-7 or 8-15 of block g / 32 (lpmm-quant `RandomStream::draws_at`).
fn thread_bits(t: Tile, lt: u32, slot: u32, counter: vec2<u32>) -> array<u32, 16> {
    let id = pair(t, D_STREAM);
    var tensor = vec2<u32>((id.x << 2u) | slot, (id.y << 2u) | (id.x >> 30u));
    if (slot == S_STATE3) {
        tensor = vec2<u32>(id.x << 2u, (id.y << 2u) | (id.x >> 30u) | 0x80000000u);
    }
    // The logical index of the thread's first element (a multiple of 16), as a 64-bit sum.
    let key = pair(t, D_KEY);
    let add = t.start + PER * lt;
    let g_lo = key.x + add;
    let g_hi = key.y + select(0u, 1u, g_lo < key.x);
    let block = vec2<u32>((g_lo >> 5u) | (g_hi << 27u), g_hi >> 5u);
    let words = chacha8(pair(t, D_SEED), tensor, block, counter);
    let upper = ((g_lo >> 4u) & 1u) != 0u;
    var r: array<u32, 16>;
    for (var j = 0u; j < 8u; j = j + 1u) {
        let w = select(words[j], words[8u + j], upper);
        r[2u * j] = w << 16u;
        r[2u * j + 1u] = w & 0xFFFF0000u;
    }
    return r;
}
