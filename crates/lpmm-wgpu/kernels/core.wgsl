// lpmm's kernels: the bindings, tiles and memory access every other file uses. Each function of
// this program mirrors the CPU reference routine named in its comment (crates/lpmm-optim,
// crates/lpmm-formats, crates/lpmm-quant); docs/FORMATS.md and docs/OPTIMIZERS.md define them.
//
// One workgroup handles one tile: up to TILE consecutive elements of one item (a range of one
// parameter piece). Thread t owns elements PER t .. PER t + PER of the tile: 16 is a multiple of
// every packing (bf16 pairs, 8-bit and 4-bit codes), so every storage word belongs to one
// thread, and the 16 elements are one ChaCha block of random words. Quantization blocks
// (32 ..= 4096 elements, powers of two) fall whole inside a tile, so a block's absmax is a
// reduction over the threads that own it.

// A region's address (abi.rs): word index (x) and binding (y: 0 the arena, 1 a lent parameter's
// buffer, 2 the tensor-wide arena).
@group(0) @binding(0) var<storage, read_write> arena: array<u32>;
@group(0) @binding(1) var<storage, read> work: array<u32>;
@group(0) @binding(2) var<storage, read_write> io: array<u32>;
@group(0) @binding(3) var<storage, read> maps: array<u32>;
@group(0) @binding(4) var<storage, read_write> flags: array<atomic<u32>>;
@group(0) @binding(5) var<storage, read_write> lent: array<u32>;
@group(0) @binding(6) var<storage, read_write> wide: array<atomic<u32>>;

var<workgroup> red: array<u32, 256>;

struct Tile {
    valid: bool,
    // The descriptor's first word in `work`.
    desc: u32,
    // The tile's first element, item-relative.
    start: u32,
    // Elements in the tile.
    n: u32,
}

fn dw(t: Tile, field: u32) -> u32 {
    return work[t.desc + field];
}

fn df(t: Tile, field: u32) -> f32 {
    return bitcast<f32>(work[t.desc + field]);
}

fn pair(t: Tile, field: u32) -> vec2<u32> {
    return vec2<u32>(dw(t, field), dw(t, field + 1u));
}

// The item of workgroup `index`: the last descriptor whose first tile is at or before it.
fn tile_of(wid: vec3<u32>, nwg: vec3<u32>) -> Tile {
    var t: Tile;
    // Zero: every dispatch has one workgroup in z (see `mulr`).
    UNFUSED = wid.z;
    let index = wid.x + wid.y * nwg.x;
    var lo = 0u;
    var hi = work[0];
    while (hi - lo > 1u) {
        let mid = (lo + hi) / 2u;
        if (work[DESC_BASE + DESC_WORDS * mid + D_TILE_BEGIN] <= index) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    t.desc = DESC_BASE + DESC_WORDS * lo;
    t.start = (index - work[t.desc + D_TILE_BEGIN]) * TILE;
    let len = work[t.desc + D_LEN];
    t.valid = work[0] > 0u && index >= work[t.desc + D_TILE_BEGIN] && t.start < len;
    t.n = min(TILE, len - min(len, t.start));
    return t;
}

// The elements thread `lt` owns in its tile (16, fewer at the end of an item).
fn thread_count(t: Tile, lt: u32) -> u32 {
    let first = PER * lt;
    if (first >= t.n) {
        return 0u;
    }
    return min(PER, t.n - first);
}

// Slot `s`'s format and aux word: fixed by a specialized step's pipeline (`plan_format`,
// generated), else read from the item's descriptor.
fn slot_format(t: Tile, s: u32) -> u32 {
    let fixed = plan_format(s);
    if (fixed != PLAN_ANY) {
        return fixed;
    }
    return dw(t, D_SLOTS + SLOT_WORDS * s);
}

fn slot_aux(t: Tile, s: u32) -> u32 {
    let fixed = plan_aux(s);
    if (fixed != PLAN_ANY) {
        return fixed;
    }
    return dw(t, D_SLOTS + SLOT_WORDS * s + 1u);
}

fn region(t: Tile, s: u32, r: u32) -> vec2<u32> {
    return pair(t, D_SLOTS + SLOT_WORDS * s + 2u + 2u * r);
}

// Word k of a region.
fn rd(a: vec2<u32>, k: u32) -> u32 {
    switch a.y {
        case 0u: { return arena[a.x + k]; }
        case 1u: { return lent[a.x + k]; }
        default: { return atomicLoad(&wide[a.x + k]); }
    }
}

fn wr(a: vec2<u32>, k: u32, v: u32) {
    switch a.y {
        case 0u: { arena[a.x + k] = v; }
        case 1u: { lent[a.x + k] = v; }
        default: { atomicStore(&wide[a.x + k], v); }
    }
}

// Atomics on tensor-wide regions (folds).
fn wide_max(a: vec2<u32>, k: u32, v: u32) {
    atomicMax(&wide[a.x + k], v);
}

fn wide_add(a: vec2<u32>, k: u32, v: u32) -> u32 {
    return atomicAdd(&wide[a.x + k], v);
}

// The tensor index of item element `i` (rank-1 and factorized states; below 2^32 on wgpu).
fn global_index(t: Tile, i: u32) -> u32 {
    return dw(t, D_GLOBAL) + i;
}

// Item element `i` of the io binding: the input (f32, or bf16 with F_INPUT_BF16).
fn io_load(t: Tile, i: u32) -> f32 {
    let at = dw(t, D_IO) + i;
    if ((dw(t, D_FLAGS) & F_INPUT_BF16) != 0u) {
        return bf16_value((io[at / 2u] >> (16u * (at & 1u))) & 0xFFFFu);
    }
    return bitcast<f32>(io[at]);
}

// Writes the thread's decoded values (f32, or bf16 nearest with F_OUTPUT_BF16; a thread's 16
// elements start at an even element, so bf16 pairs are whole words).
fn io_store(t: Tile, first: u32, v: array<f32, 16>, count: u32) {
    let at = dw(t, D_IO) + first;
    if ((dw(t, D_FLAGS) & F_OUTPUT_BF16) != 0u) {
        for (var j = 0u; j < count; j = j + 2u) {
            var h = bf16_nearest(v[j]);
            if (j + 1u < count) {
                h = h | (bf16_nearest(v[j + 1u]) << 16u);
            } else {
                h = h | (io[(at + j) / 2u] & 0xFFFF0000u);
            }
            io[(at + j) / 2u] = h;
        }
        return;
    }
    for (var j = 0u; j < count; j = j + 1u) {
        io[at + j] = bitcast<u32>(v[j]);
    }
}

// What one element's update produced (rule.rs `Updated` and the states).
struct Update {
    p: f32,
    d: f32,
    m: f32,
    v: f32,
    w: f32,
}

// 64-bit unsigned integers as (low, high) words.
fn add64(x: vec2<u32>, y: vec2<u32>) -> vec2<u32> {
    let lo = x.x + y.x;
    return vec2<u32>(lo, x.y + y.y + select(0u, 1u, lo < x.x));
}

fn shl64(v: vec2<u32>, s: u32) -> vec2<u32> {
    if (s == 0u) {
        return v;
    }
    if (s >= 64u) {
        return vec2<u32>(0u);
    }
    if (s >= 32u) {
        return vec2<u32>(0u, v.x << (s - 32u));
    }
    return vec2<u32>(v.x << s, (v.y << s) | (v.x >> (32u - s)));
}

fn shr64(v: vec2<u32>, s: u32) -> vec2<u32> {
    if (s == 0u) {
        return v;
    }
    if (s >= 64u) {
        return vec2<u32>(0u);
    }
    if (s >= 32u) {
        return vec2<u32>(v.y >> (s - 32u), 0u);
    }
    return vec2<u32>((v.x >> s) | (v.y << (32u - s)), v.y >> s);
}

// Bits needed for `v` (0 for zero).
fn bitlen64(v: vec2<u32>) -> u32 {
    if (v.y != 0u) {
        return 64u - countLeadingZeros(v.y);
    }
    return 32u - countLeadingZeros(v.x);
}

// Adds `v` to the 64-bit integer in words 2k (low) and 2k + 1 (high) of a tensor-wide region:
// exact in any order (factored.rs `add64`).
fn wide_add64(a: vec2<u32>, k: u32, v: vec2<u32>) {
    let old = wide_add(a, 2u * k, v.x);
    let carry = select(0u, 1u, old > 0xFFFFFFFFu - v.x);
    let hi = v.y + carry;
    if (hi != 0u) {
        wide_add(a, 2u * k + 1u, hi);
    }
}
