// bf16 with a bf16 Kahan compensation (lpmm-optim format/kahan.rs): value and compensation in
// two regions; an update is added as an increment (split.rs `kahan_add`).

fn fmt_kahan_load(t: Tile, s: u32, i: u32) -> f32 {
    // The parameter a model sees is the bf16 value; the compensation only feeds updates.
    return bf16_value((rd(region(t, s, 0u), i / 2u) >> (16u * (i & 1u))) & 0xFFFFu);
}

fn fmt_kahan_store(t: Tile, lt: u32, s: u32, v: array<f32, 16>, count: u32, r: array<u32, 16>) {
    // Re-initialisation: the value itself and no compensation beyond its rounding.
    let a = region(t, s, 0u);
    let b = region(t, s, 1u);
    let first = t.start + PER * lt;
    for (var j = 0u; j < count; j = j + 2u) {
        var h = array<u32, 2>(0u, 0u);
        var c = array<u32, 2>(0u, 0u);
        for (var k = 0u; k < 2u; k = k + 1u) {
            if (j + k < count) {
                let x = v[j + k];
                h[k] = bf16_nearest(x);
                c[k] = bf16_nearest(x - bf16_value(h[k]));
            }
        }
        wr(a, (first + j) / 2u, h[0] | (h[1] << 16u));
        wr(b, (first + j) / 2u, c[0] | (c[1] << 16u));
    }
}

fn fmt_kahan_clear(t: Tile, lt: u32, s: u32, count: u32) {
    let first = t.start + PER * lt;
    for (var j = 0u; j < count; j = j + 2u) {
        wr(region(t, s, 0u), (first + j) / 2u, 0u);
        wr(region(t, s, 1u), (first + j) / 2u, 0u);
    }
}

fn fmt_kahan_add(t: Tile, lt: u32, s: u32, d: array<f32, 16>, count: u32) -> bool {
    let a = region(t, s, 0u);
    let b = region(t, s, 1u);
    let first = t.start + PER * lt;
    for (var j = 0u; j < count; j = j + 2u) {
        var h = array<u32, 2>(0u, 0u);
        var cw = array<u32, 2>(0u, 0u);
        let word_v = rd(a, (first + j) / 2u);
        let word_c = rd(b, (first + j) / 2u);
        for (var k = 0u; k < 2u; k = k + 1u) {
            if (j + k < count) {
                let old = bf16_value((word_v >> (16u * k)) & 0xFFFFu);
                let comp = bf16_value((word_c >> (16u * k)) & 0xFFFFu);
                let c = comp + d[j + k];
                h[k] = bf16_nearest(old + c);
                cw[k] = bf16_nearest(c + (old - bf16_value(h[k])));
            }
        }
        wr(a, (first + j) / 2u, h[0] | (h[1] << 16u));
        wr(b, (first + j) / 2u, cw[0] | (cw[1] << 16u));
    }
    return true;
}
