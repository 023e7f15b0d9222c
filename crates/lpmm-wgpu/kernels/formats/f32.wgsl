// f32 (lpmm-optim format/f32.rs): one word per element.

fn fmt_f32_load(t: Tile, s: u32, i: u32) -> f32 {
    return bitcast<f32>(rd(region(t, s, 0u), i));
}

fn fmt_f32_store(t: Tile, lt: u32, s: u32, v: array<f32, 16>, count: u32, r: array<u32, 16>) {
    let a = region(t, s, 0u);
    let first = t.start + PER * lt;
    for (var j = 0u; j < count; j = j + 1u) {
        wr(a, first + j, bitcast<u32>(v[j]));
    }
}

fn fmt_f32_clear(t: Tile, lt: u32, s: u32, count: u32) {
    let a = region(t, s, 0u);
    let first = t.start + PER * lt;
    for (var j = 0u; j < count; j = j + 1u) {
        wr(a, first + j, 0u);
    }
}
