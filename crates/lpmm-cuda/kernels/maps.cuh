// ---------------------------------------------------------------------------------------------
// Code maps (lpmm-formats codemap.rs): the table (abi.rs `map_table`) every launch is given.

__device__ __forceinline__ uint32_t map_len(const uint32_t* maps, uint32_t map) {
    return maps[MAP_LENS + map];
}

// CodeMap::value: codes past the end decode as the last value.
__device__ __forceinline__ float map_value(const uint32_t* maps, uint32_t map, uint32_t code) {
    uint32_t last = map_len(maps, map) - 1u;
    return u2f(maps[MAP_STRIDE * map + (code < last ? code : last)]);
}

// CodeMap::nearest: the number of thresholds <= y (NaN gives 0), searched as the CPU does: the
// count at the lowest value of y's bucket (abi.rs MAP_BUCKETS), then one step over each of the
// few thresholds the bucket may hold (MAP_SCANS; past the last threshold nothing is counted).
__device__ __forceinline__ uint32_t map_nearest(const uint32_t* maps, uint32_t map, float y) {
    if (!(y == y)) {
        return 0u;
    }
    uint32_t b = f2u(y) >> MAP_BUCKET_SHIFT;
    uint32_t word = maps[MAP_BUCKETS + MAP_BUCKET_WORDS * map + b / 4u];
    uint32_t c = (word >> (8u * (b % 4u))) & 0xFFu;
    uint32_t last = map_len(maps, map) - 1u;
    uint32_t base = MAP_STRIDE * map + 256u;
    uint32_t scan = maps[MAP_SCANS + map];
    for (uint32_t k = 0u; k < scan; k++) {
        if (c < last && u2f(maps[base + c]) <= y) {
            c = c + 1u;
        }
    }
    return c;
}

// CodeMap::stochastic.
__device__ __forceinline__ uint32_t map_stochastic(const uint32_t* maps, uint32_t map, float y,
                                                   uint32_t r) {
    if (!(y == y)) {
        return 0u;
    }
    uint32_t c = map_nearest(maps, map, y);
    uint32_t below = map_value(maps, map, c) > y ? 1u : 0u;
    if (below > c) {
        return 0u;
    }
    uint32_t lo = c - below;
    if (lo + 1u == map_len(maps, map)) {
        return lo;
    }
    float lo_v = map_value(maps, map, lo);
    float hi_v = map_value(maps, map, lo + 1u);
    float frac = (y - lo_v) / (hi_v - lo_v);
    float scaled = frac * 4294967296.0f;
    // Rust's saturating `as u32`.
    uint32_t cut = 0xFFFFFFFFu;
    if (scaled < 4294967296.0f) {
        cut = scaled > 0.0f ? (uint32_t)scaled : 0u;
    }
    return lo + (r < cut ? 1u : 0u);
}
