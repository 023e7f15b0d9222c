// bf16 (lpmm-optim format/bf16.rs): two elements per word, low half first; rounded to nearest
// even, or stochastically (aux bit 0).

fn fmt_bf16_stochastic(aux: u32) -> bool {
    return (aux & 1u) == 1u;
}

fn fmt_bf16_load(t: Tile, s: u32, i: u32) -> f32 {
    return bf16_value((rd(region(t, s, 0u), i / 2u) >> (16u * (i & 1u))) & 0xFFFFu);
}

fn fmt_bf16_store(t: Tile, lt: u32, s: u32, v: array<f32, 16>, count: u32, r: array<u32, 16>) {
    let a = region(t, s, 0u);
    let sr = fmt_bf16_stochastic(slot_aux(t, s));
    let first = t.start + PER * lt;
    for (var j = 0u; j < count; j = j + 2u) {
        var h = array<u32, 2>(0u, 0u);
        for (var k = 0u; k < 2u; k = k + 1u) {
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

fn fmt_bf16_clear(t: Tile, lt: u32, s: u32, count: u32) {
    let a = region(t, s, 0u);
    let first = t.start + PER * lt;
    for (var j = 0u; j < count; j = j + 2u) {
        wr(a, (first + j) / 2u, 0u);
    }
}
