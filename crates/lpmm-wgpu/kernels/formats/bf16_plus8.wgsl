// bf16+8, 24-bit master weights (lpmm-optim format/bf16_plus8.rs): the bf16 visible halves
// (region 0, two per word, low half first) and the correction bytes (region 1, four per word);
// aux bit 0: stochastic rounding onto the 24-bit grid.

fn fmt_bf16_plus8_stochastic(aux: u32) -> bool {
    return (aux & 1u) == 1u;
}

fn fmt_bf16_plus8_load(t: Tile, s: u32, i: u32) -> f32 {
    let hi = (rd(region(t, s, 0u), i / 2u) >> (16u * (i & 1u))) & 0xFFFFu;
    let lo = (rd(region(t, s, 1u), i / 4u) >> (8u * (i & 3u))) & 0xFFu;
    let h = (hi - select(0u, 1u, lo >= 0x80u)) & 0xFFFFu;
    return bitcast<f32>((h << 16u) | (lo << 8u));
}

// bf16_plus8::round24: nearest even, or up when the word's top byte is below the discarded one.
fn fmt_bf16_plus8_round(x: f32, sr: bool, r: u32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
        return (b | 0x00400000u) & 0xFFFFFF00u;
    }
    var up = 0x7Fu + ((b >> 8u) & 1u);
    if (sr) {
        up = select(0u, 0x100u, (r >> 24u) < (b & 0xFFu));
    }
    return (b + up) & 0xFFFFFF00u;
}

fn fmt_bf16_plus8_store(t: Tile, lt: u32, s: u32, v: array<f32, 16>, count: u32, r: array<u32, 16>) {
    let a = region(t, s, 0u);
    let b = region(t, s, 1u);
    let sr = fmt_bf16_plus8_stochastic(slot_aux(t, s));
    let first = t.start + PER * lt;
    for (var j = 0u; j < count; j = j + 4u) {
        var h = array<u32, 4>(0u, 0u, 0u, 0u);
        var lo = 0u;
        for (var k = 0u; k < 4u; k = k + 1u) {
            if (j + k < count) {
                let w = fmt_bf16_plus8_round(v[j + k], sr, r[j + k]);
                let c = (w >> 8u) & 0xFFu;
                h[k] = ((w >> 16u) + select(0u, 1u, c >= 0x80u)) & 0xFFFFu;
                lo = lo | (c << (8u * k));
            }
        }
        wr(a, (first + j) / 2u, h[0] | (h[1] << 16u));
        if (j + 2u < count) {
            wr(a, (first + j) / 2u + 1u, h[2] | (h[3] << 16u));
        }
        wr(b, (first + j) / 4u, lo);
    }
}

fn fmt_bf16_plus8_clear(t: Tile, lt: u32, s: u32, count: u32) {
    let first = t.start + PER * lt;
    for (var j = 0u; j < count; j = j + 4u) {
        wr(region(t, s, 0u), (first + j) / 2u, 0u);
        if (j + 2u < count) {
            wr(region(t, s, 0u), (first + j) / 2u + 1u, 0u);
        }
        wr(region(t, s, 1u), (first + j) / 4u, 0u);
    }
}
