// Split f32 (lpmm-optim format/split_f32.rs, lpmm-formats split.rs): the bf16 visible halves and
// the 16-bit remainders in two regions.

fn fmt_split_f32_load(t: Tile, s: u32, i: u32) -> f32 {
    let shift = 16u * (i & 1u);
    let hi = (rd(region(t, s, 0u), i / 2u) >> shift) & 0xFFFFu;
    let rem = (rd(region(t, s, 1u), i / 2u) >> shift) & 0xFFFFu;
    let h = (hi - select(0u, 1u, rem >= 0x8000u)) & 0xFFFFu;
    return bitcast<f32>((h << 16u) | rem);
}

fn fmt_split_f32_store(t: Tile, lt: u32, s: u32, v: array<f32, 16>, count: u32, r: array<u32, 16>) {
    let a = region(t, s, 0u);
    let b = region(t, s, 1u);
    let first = t.start + PER * lt;
    for (var j = 0u; j < count; j = j + 2u) {
        var h = array<u32, 2>(0u, 0u);
        var m = array<u32, 2>(0u, 0u);
        for (var k = 0u; k < 2u; k = k + 1u) {
            if (j + k < count) {
                var bits = bitcast<u32>(v[j + k]);
                if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
                    bits = (bits & 0x80000000u) | 0x7FC00000u;
                }
                m[k] = bits & 0xFFFFu;
                h[k] = ((bits >> 16u) + select(0u, 1u, m[k] >= 0x8000u)) & 0xFFFFu;
            }
        }
        wr(a, (first + j) / 2u, h[0] | (h[1] << 16u));
        wr(b, (first + j) / 2u, m[0] | (m[1] << 16u));
    }
}

fn fmt_split_f32_clear(t: Tile, lt: u32, s: u32, count: u32) {
    let first = t.start + PER * lt;
    for (var j = 0u; j < count; j = j + 2u) {
        wr(region(t, s, 0u), (first + j) / 2u, 0u);
        wr(region(t, s, 1u), (first + j) / 2u, 0u);
    }
}
