// ---------------------------------------------------------------------------------------------
// Code maps (lpmm-formats codemap.rs).

fn map_len(map: u32) -> u32 {
    return maps[MAP_LENS + map];
}

// CodeMap::value: codes past the end decode as the last value.
fn map_value(map: u32, code: u32) -> f32 {
    return bitcast<f32>(maps[MAP_STRIDE * map + min(code, map_len(map) - 1u)]);
}

// CodeMap::nearest: the number of thresholds <= y (NaN gives 0), searched as the CPU does: the
// count at the lowest value of y's bucket (abi.rs MAP_BUCKETS), then one step over each of the
// few thresholds the bucket may hold (MAP_SCANS; past the last threshold nothing is counted).
fn map_nearest(map: u32, y: f32) -> u32 {
    if (!(y == y)) {
        return 0u;
    }
    let b = bitcast<u32>(y) >> MAP_BUCKET_SHIFT;
    let word = maps[MAP_BUCKETS + MAP_BUCKET_WORDS * map + b / 4u];
    var c = (word >> (8u * (b % 4u))) & 0xFFu;
    let last = map_len(map) - 1u;
    let base = MAP_STRIDE * map + 256u;
    let scan = maps[MAP_SCANS + map];
    for (var k = 0u; k < scan; k++) {
        if (c < last && bitcast<f32>(maps[base + c]) <= y) {
            c = c + 1u;
        }
    }
    return c;
}

// CodeMap::stochastic.
fn map_stochastic(map: u32, y: f32, r: u32) -> u32 {
    if (!(y == y)) {
        return 0u;
    }
    let c = map_nearest(map, y);
    let below = select(0u, 1u, map_value(map, c) > y);
    if (below > c) {
        return 0u;
    }
    let lo = c - below;
    if (lo + 1u == map_len(map)) {
        return lo;
    }
    let lo_v = map_value(map, lo);
    let hi_v = map_value(map, lo + 1u);
    let frac = divf(y - lo_v, hi_v - lo_v);
    let scaled = frac * 4294967296.0;
    // Rust's saturating `as u32`.
    var cut = 0xFFFFFFFFu;
    if (scaled < 4294967296.0) {
        cut = u32(max(scaled, 0.0));
    }
    return lo + select(0u, 1u, r < cut);
}

