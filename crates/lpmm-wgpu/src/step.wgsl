// lpmm's optimizer kernels. Each function mirrors the CPU reference routine named in its comment
// (crates/lpmm-optim, crates/lpmm-formats, crates/lpmm-quant); docs/FORMATS.md and
// docs/OPTIMIZERS.md define them.
//
// One workgroup handles one tile: up to 4096 consecutive elements of one piece (a contiguous range
// of one parameter, with all of its slots in the bound segment). Thread t owns elements
// 16t .. 16t + 16 of the tile: 16 is a multiple of every packing (bf16 pairs, 8-bit and 4-bit
// codes), so every storage word belongs to one thread, and the 16 elements are one ChaCha block
// of random words. Quantization blocks (32 ..= 4096 elements, powers of two) fall whole inside a
// tile, so a block's absmax is a reduction over the threads that own it.

@group(0) @binding(0) var<storage, read_write> seg: array<u32>;
@group(0) @binding(1) var<storage, read> work: array<u32>;
@group(0) @binding(2) var<storage, read_write> io: array<f32>;
@group(0) @binding(3) var<storage, read> maps: array<u32>;
@group(0) @binding(4) var<storage, read_write> flags: array<atomic<u32>>;

const TILE: u32 = 4096u;
const PER: u32 = 16u;

// `work`: [tile count, descriptor base, then (descriptor index, tile start) per tile], and the
// descriptors at the base, DESC_WORDS each.
const DESC_WORDS: u32 = 48u;
const D_LEN: u32 = 0u;
const D_OFF_LO: u32 = 1u;
const D_OFF_HI: u32 = 2u;
const D_IDX_LO: u32 = 3u;
const D_IDX_HI: u32 = 4u;
const D_STEP_LO: u32 = 5u;
const D_STEP_HI: u32 = 6u;
const D_ACC_LO: u32 = 7u;
const D_ACC_HI: u32 = 8u;
const D_SEED_LO: u32 = 9u;
const D_SEED_HI: u32 = 10u;
const D_FLAGS: u32 = 11u;
const D_INPUT: u32 = 12u;
const D_FLAG_INDEX: u32 = 13u;
const D_SLOTS: u32 = 14u; // 4 x (format, aux, region a, region b)
const D_RULE: u32 = 30u;
const D_RC: u32 = 31u; // 11 rule constants (f32 bits)
const D_CLIP: u32 = 42u;
const D_RULE_FLAGS: u32 = 43u;
const D_MODE: u32 = 44u; // decode: which slot

const F_FIRST: u32 = 1u;
const F_UPDATE_PARAM: u32 = 2u;
const F_INPUT: u32 = 4u;

const R_NESTEROV: u32 = 1u;
const R_HAS_MOMENTUM: u32 = 2u;
const R_DECOUPLED: u32 = 4u;
const R_GIVEN_V: u32 = 8u;

const S_PARAM: u32 = 0u;
const S_GRAD: u32 = 1u;
const S_STATE1: u32 = 2u;
const S_STATE2: u32 = 3u;

const FMT_EMPTY: u32 = 0u;
const FMT_F32: u32 = 1u;
const FMT_BF16: u32 = 2u;
const FMT_BF16_SR: u32 = 3u;
const FMT_KAHAN: u32 = 4u;
const FMT_SPLIT: u32 = 5u;
const FMT_QUANT: u32 = 6u;

// `maps`: map k's 256 values at k * 512 and its thresholds at k * 512 + 256 (f32 bits); the
// number of values of map k at MAP_LENS + k.
const MAP_STRIDE: u32 = 512u;
const MAP_LENS: u32 = 2560u;

var<workgroup> red: array<u32, 256>;

// ---------------------------------------------------------------------------------------------
// Tile addressing.

struct Tile {
    valid: bool,
    desc: u32,
    // The tile's first element, piece-relative.
    start: u32,
    // Elements in the tile.
    n: u32,
}

fn tile_of(wid: vec3<u32>, nwg: vec3<u32>) -> Tile {
    var t: Tile;
    let index = wid.x + wid.y * nwg.x;
    t.valid = index < work[0];
    if (!t.valid) {
        return t;
    }
    t.desc = work[1] + DESC_WORDS * work[2u + 2u * index];
    t.start = work[3u + 2u * index];
    t.n = min(TILE, work[t.desc + D_LEN] - t.start);
    return t;
}

fn dw(t: Tile, field: u32) -> u32 {
    return work[t.desc + field];
}

fn df(t: Tile, field: u32) -> f32 {
    return bitcast<f32>(work[t.desc + field]);
}

fn slot_word(t: Tile, slot: u32, k: u32) -> u32 {
    return work[t.desc + D_SLOTS + 4u * slot + k];
}

// ---------------------------------------------------------------------------------------------
// Floats (lpmm-formats float.rs, split.rs; half's bf16 conversion).

fn is_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7F800000u) != 0x7F800000u;
}

// half::bf16::from_f32: round to nearest even, NaN kept quiet with its sign.
fn bf16_nearest(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
        return (b >> 16u) | 0x40u;
    }
    if ((b & 0x8000u) != 0u && (b & 0x17FFFu) != 0u) {
        return (b >> 16u) + 1u;
    }
    return b >> 16u;
}

// float::bf16_stochastic.
fn bf16_stochastic(x: f32, r: u32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7FFFFFFFu) >= 0x7F800000u) {
        return bf16_nearest(x);
    }
    let up = select(0u, 1u, (r >> 16u) < (b & 0xFFFFu));
    let res = (b >> 16u) + up;
    if ((res & 0x7FFFu) == 0x7F80u) {
        return bf16_nearest(x);
    }
    return res;
}

fn bf16_value(h: u32) -> f32 {
    return bitcast<f32>(h << 16u);
}

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

// The random words of the 16 elements thread `lt` owns, from slot `slot`'s stream at `counter`
// (cpu.rs `stream`: tensor id = parameter index << 2 | slot).
fn thread_bits(t: Tile, lt: u32, slot: u32, counter: vec2<u32>) -> array<u32, 16> {
    let lo = dw(t, D_IDX_LO);
    let hi = dw(t, D_IDX_HI);
    let tensor = vec2<u32>((lo << 2u) | slot, (hi << 2u) | (lo >> 30u));
    // Global index of the thread's first element: piece offset + tile start + 16 lt (a multiple
    // of 16), as a 64-bit sum.
    let off_lo = dw(t, D_OFF_LO);
    let add = t.start + PER * lt;
    let g_lo = off_lo + add;
    let g_hi = dw(t, D_OFF_HI) + select(0u, 1u, g_lo < off_lo);
    let block = vec2<u32>((g_lo >> 4u) | (g_hi << 28u), g_hi >> 4u);
    let seed = vec2<u32>(dw(t, D_SEED_LO), dw(t, D_SEED_HI));
    return chacha8(seed, tensor, block, counter);
}

// ---------------------------------------------------------------------------------------------
// Fused multiply-add. WGSL's `fma` may be evaluated as a multiply and an add (lavapipe does), so
// unless the backend's probe found the driver's `fma` correctly rounded (FMA_NATIVE), `fmaf`
// computes round-to-nearest-even(a * b + c) exactly in integer arithmetic: the 48-bit product and
// the addend are placed in a 128-bit fixed-point window (bits shifted out of the window fold into
// a sticky bit), added or subtracted, and rounded once, subnormal results included.

override FMA_NATIVE: bool = false;

fn fmaf(a: f32, b: f32, c: f32) -> f32 {
    if (FMA_NATIVE) {
        return fma(a, b, c);
    }
    return fma_soft(a, b, c);
}

fn shl128(v: vec4<u32>, s: u32) -> vec4<u32> {
    var out = vec4<u32>(0u);
    let q = s / 32u;
    let r = s % 32u;
    for (var i = 0u; i < 4u; i = i + 1u) {
        if (i >= q) {
            var x = v[i - q] << r;
            if (r > 0u && i >= q + 1u) {
                x = x | (v[i - q - 1u] >> (32u - r));
            }
            out[i] = x;
        }
    }
    return out;
}

// Shifts right by `s`; `sticky` says whether a set bit was shifted out.
struct Shifted {
    v: vec4<u32>,
    sticky: bool,
}

fn shr128(v: vec4<u32>, s: u32) -> Shifted {
    var out: Shifted;
    out.v = vec4<u32>(0u);
    out.sticky = false;
    if (s >= 128u) {
        out.sticky = any(v != vec4<u32>(0u));
        return out;
    }
    let q = s / 32u;
    let r = s % 32u;
    for (var i = 0u; i < 4u; i = i + 1u) {
        if (i < q && v[i] != 0u) {
            out.sticky = true;
        }
        if (i + q < 4u) {
            var x = v[i + q] >> r;
            if (r > 0u && i + q + 1u < 4u) {
                x = x | (v[i + q + 1u] << (32u - r));
            }
            out.v[i] = x;
        }
    }
    if (r > 0u && q < 4u && (v[q] & ((1u << r) - 1u)) != 0u) {
        out.sticky = true;
    }
    return out;
}

fn add128(x: vec4<u32>, y: vec4<u32>) -> vec4<u32> {
    var out = vec4<u32>(0u);
    var carry = 0u;
    for (var i = 0u; i < 4u; i = i + 1u) {
        let s = x[i] + y[i];
        let c1 = select(0u, 1u, s < x[i]);
        let t = s + carry;
        let c2 = select(0u, 1u, t < s);
        out[i] = t;
        carry = c1 + c2;
    }
    return out;
}

fn sub128(x: vec4<u32>, y: vec4<u32>) -> vec4<u32> {
    var out = vec4<u32>(0u);
    var borrow = 0u;
    for (var i = 0u; i < 4u; i = i + 1u) {
        let d = x[i] - y[i];
        let b1 = select(0u, 1u, x[i] < y[i]);
        let t = d - borrow;
        let b2 = select(0u, 1u, d < borrow);
        out[i] = t;
        borrow = b1 + b2;
    }
    return out;
}

// x < y as unsigned 128-bit integers.
fn less128(x: vec4<u32>, y: vec4<u32>) -> bool {
    for (var k = 0; k < 4; k = k + 1) {
        let i = u32(3 - k);
        if (x[i] != y[i]) {
            return x[i] < y[i];
        }
    }
    return false;
}

// Index of the highest set bit (-1 for zero).
fn msb128(v: vec4<u32>) -> i32 {
    for (var k = 0; k < 4; k = k + 1) {
        let i = 3 - k;
        if (v[u32(i)] != 0u) {
            return 32 * i + 31 - i32(countLeadingZeros(v[u32(i)]));
        }
    }
    return -1;
}

// Places m * 2^lsb in the window whose bit 0 is worth 2^frame; bits below it become a sticky 1.
fn place(m: vec4<u32>, lsb: i32, frame: i32) -> vec4<u32> {
    let s = lsb - frame;
    if (s >= 0) {
        return shl128(m, u32(s));
    }
    let r = shr128(m, u32(-s));
    var v = r.v;
    if (r.sticky) {
        v.x = v.x | 1u;
    }
    return v;
}

fn fma_soft(a: f32, b: f32, c: f32) -> f32 {
    let ua = bitcast<u32>(a);
    let ub = bitcast<u32>(b);
    let uc = bitcast<u32>(c);
    var ea = i32((ua >> 23u) & 0xFFu);
    var eb = i32((ub >> 23u) & 0xFFu);
    var ec = i32((uc >> 23u) & 0xFFu);
    if (ea == 255 || eb == 255) {
        // A non-finite factor: IEEE's a * b + c gives the fma's result (Inf or NaN).
        return a * b + c;
    }
    if (ec == 255) {
        // A finite product plus Inf or NaN is c (the rounded product could overflow instead).
        return c;
    }
    var ma = ua & 0x7FFFFFu;
    var mb = ub & 0x7FFFFFu;
    var mc = uc & 0x7FFFFFu;
    if (ea == 0) { ea = 1; } else { ma = ma | 0x800000u; }
    if (eb == 0) { eb = 1; } else { mb = mb | 0x800000u; }
    if (ec == 0) { ec = 1; } else { mc = mc | 0x800000u; }
    let sp = (ua ^ ub) >> 31u;
    let sc = uc >> 31u;
    if (ma == 0u || mb == 0u) {
        // An exact zero product: c itself, or a zero whose sign is negative only if both are.
        if (mc == 0u) {
            return bitcast<f32>((sp & sc) << 31u);
        }
        return c;
    }
    // The 48-bit product of the significands, from 16-bit limbs.
    let a0 = ma & 0xFFFFu;
    let a1 = ma >> 16u;
    let b0 = mb & 0xFFFFu;
    let b1 = mb >> 16u;
    let mid = a0 * b1 + a1 * b0;
    let p00 = a0 * b0;
    let lo = p00 + (mid << 16u);
    let hi = a1 * b1 + (mid >> 16u) + select(0u, 1u, lo < p00);
    let pm = vec4<u32>(lo, hi, 0u, 0u);
    let cm = vec4<u32>(mc, 0u, 0u, 0u);
    // Values: pm * 2^lsb_p and cm * 2^lsb_c (a = ma * 2^(ea - 150)).
    let lsb_p = ea + eb - 300;
    let lsb_c = ec - 150;
    var top = lsb_p + msb128(pm);
    if (mc != 0u) {
        top = max(top, lsb_c + msb128(cm));
    }
    let frame = top - 126;
    let xp = place(pm, lsb_p, frame);
    let xc = place(cm, lsb_c, frame);
    var sign = sp;
    var r: vec4<u32>;
    if (sp == sc) {
        r = add128(xp, xc);
    } else if (less128(xp, xc)) {
        r = sub128(xc, xp);
        sign = sc;
    } else {
        r = sub128(xp, xc);
    }
    let k = msb128(r);
    if (k < 0) {
        // Exact cancellation: +0 under round-to-nearest.
        return 0.0;
    }
    // Drop `drop` bits: down to 24 significant bits, or to the subnormal grid (2^-149).
    let drop = max(k - 23, -149 - frame);
    var mant: u32;
    if (drop <= 0) {
        mant = shl128(r, u32(-drop)).x;
    } else {
        let t = shr128(r, u32(drop - 1));
        let round = (t.v.x & 1u) == 1u;
        mant = t.v.x >> 1u;
        if (round && (t.sticky || (mant & 1u) == 1u)) {
            mant = mant + 1u;
        }
    }
    // mant * 2^(frame + drop): the exponent field and the significand add up (a carry out of the
    // significand moves the exponent; subnormals have exponent field 0).
    let e = frame + drop + 149;
    if (e >= 254 && (u32(e) << 23u) + mant >= 0x7F800000u) {
        return bitcast<f32>((sign << 31u) | 0x7F800000u);
    }
    return bitcast<f32>((sign << 31u) | ((u32(e) << 23u) + mant));
}

// The backend's probe of the driver's arithmetic: for each (a, b, c) in `io` (8 floats apart),
// writes fma(a, b, c), fma_soft(a, b, c), a * b + c, a / b, sqrt(|a|).
@compute @workgroup_size(64)
fn arith_main(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = 8u * id.x;
    if (i + 8u > arrayLength(&io) || i / 8u >= work[0]) {
        return;
    }
    let a = io[i];
    let b = io[i + 1u];
    let c = io[i + 2u];
    io[i + 3u] = fma(a, b, c);
    io[i + 4u] = fma_soft(a, b, c);
    io[i + 5u] = a * b + c;
    io[i + 6u] = a / b;
    io[i + 7u] = sqrt(abs(a));
}

// ---------------------------------------------------------------------------------------------
// Code maps (lpmm-formats codemap.rs).

fn map_len(map: u32) -> u32 {
    return maps[MAP_LENS + map];
}

// CodeMap::value: codes past the end decode as the last value.
fn map_value(map: u32, code: u32) -> f32 {
    return bitcast<f32>(maps[MAP_STRIDE * map + min(code, map_len(map) - 1u)]);
}

// CodeMap::nearest: the number of thresholds <= y (NaN gives 0).
fn map_nearest(map: u32, y: f32) -> u32 {
    if (!(y == y)) {
        return 0u;
    }
    var lo = 0u;
    var hi = map_len(map) - 1u;
    let base = MAP_STRIDE * map + 256u;
    while (lo < hi) {
        let mid = (lo + hi) / 2u;
        if (bitcast<f32>(maps[base + mid]) <= y) {
            lo = mid + 1u;
        } else {
            hi = mid;
        }
    }
    return lo;
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
    let frac = (y - lo_v) / (hi_v - lo_v);
    let scaled = frac * 4294967296.0;
    // Rust's saturating `as u32`.
    var cut = 0xFFFFFFFFu;
    if (scaled < 4294967296.0) {
        cut = u32(max(scaled, 0.0));
    }
    return lo + select(0u, 1u, r < cut);
}

// ---------------------------------------------------------------------------------------------
// Slots: decode one element (slot.rs `Slot::decode`).

fn load(t: Tile, slot: u32, i: u32) -> f32 {
    let fmt = slot_word(t, slot, 0u);
    let aux = slot_word(t, slot, 1u);
    let a = slot_word(t, slot, 2u);
    let b = slot_word(t, slot, 3u);
    switch fmt {
        case FMT_F32: {
            return bitcast<f32>(seg[a + i]);
        }
        case FMT_BF16, FMT_BF16_SR, FMT_KAHAN: {
            return bf16_value((seg[a + i / 2u] >> (16u * (i & 1u))) & 0xFFFFu);
        }
        case FMT_SPLIT: {
            let shift = 16u * (i & 1u);
            let hi = (seg[a + i / 2u] >> shift) & 0xFFFFu;
            let rem = (seg[b + i / 2u] >> shift) & 0xFFFFu;
            let h = (hi - select(0u, 1u, rem >= 0x8000u)) & 0xFFFFu;
            return bitcast<f32>((h << 16u) | rem);
        }
        case FMT_QUANT: {
            let map = aux & 0xFFu;
            let log_block = (aux >> 8u) & 0xFFu;
            let bits = aux >> 24u;
            let at = i * bits;
            let code = (seg[a + at / 32u] >> (at % 32u)) & ((1u << bits) - 1u);
            let absmax = bitcast<f32>(seg[b + (i >> log_block)]);
            return map_value(map, code) * absmax;
        }
        default: {
            return 0.0;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Slots: store the 16 values of thread `lt` (slot.rs `Slot::encode_keyed`). Must be called in
// uniform control flow (quantized slots reduce their block maxima across the workgroup).
// `counter`: the slot's random-stream counter. Elements at or past `count` are not stored (their
// half of a shared word, their bits of a packed word, are zero).

fn store(t: Tile, lt: u32, slot: u32, vals: array<f32, 16>, count: u32, counter: vec2<u32>) {
    let fmt = slot_word(t, slot, 0u);
    let aux = slot_word(t, slot, 1u);
    let a = slot_word(t, slot, 2u);
    let b = slot_word(t, slot, 3u);
    let first = t.start + PER * lt;
    var r: array<u32, 16>;
    let stochastic = fmt == FMT_BF16_SR || (fmt == FMT_QUANT && ((aux >> 16u) & 1u) == 1u);
    if (stochastic && count > 0u) {
        r = thread_bits(t, lt, slot, counter);
    }
    switch fmt {
        case FMT_F32: {
            for (var j = 0u; j < count; j = j + 1u) {
                seg[a + first + j] = bitcast<u32>(vals[j]);
            }
        }
        case FMT_BF16, FMT_BF16_SR: {
            for (var j = 0u; j < count; j = j + 2u) {
                var h = array<u32, 2>(0u, 0u);
                for (var k = 0u; k < 2u; k = k + 1u) {
                    if (j + k < count) {
                        if (fmt == FMT_BF16_SR) {
                            h[k] = bf16_stochastic(vals[j + k], r[j + k]);
                        } else {
                            h[k] = bf16_nearest(vals[j + k]);
                        }
                    }
                }
                seg[a + (first + j) / 2u] = h[0] | (h[1] << 16u);
            }
        }
        case FMT_KAHAN: {
            // Re-initialisation: the value itself and no compensation beyond its rounding.
            for (var j = 0u; j < count; j = j + 2u) {
                var h = array<u32, 2>(0u, 0u);
                var c = array<u32, 2>(0u, 0u);
                for (var k = 0u; k < 2u; k = k + 1u) {
                    if (j + k < count) {
                        let x = vals[j + k];
                        h[k] = bf16_nearest(x);
                        c[k] = bf16_nearest(x - bf16_value(h[k]));
                    }
                }
                seg[a + (first + j) / 2u] = h[0] | (h[1] << 16u);
                seg[b + (first + j) / 2u] = c[0] | (c[1] << 16u);
            }
        }
        case FMT_SPLIT: {
            for (var j = 0u; j < count; j = j + 2u) {
                var h = array<u32, 2>(0u, 0u);
                var m = array<u32, 2>(0u, 0u);
                for (var k = 0u; k < 2u; k = k + 1u) {
                    if (j + k < count) {
                        var bits = bitcast<u32>(vals[j + k]);
                        if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
                            bits = (bits & 0x80000000u) | 0x7FC00000u;
                        }
                        m[k] = bits & 0xFFFFu;
                        h[k] = ((bits >> 16u) + select(0u, 1u, m[k] >= 0x8000u)) & 0xFFFFu;
                    }
                }
                seg[a + (first + j) / 2u] = h[0] | (h[1] << 16u);
                seg[b + (first + j) / 2u] = m[0] | (m[1] << 16u);
            }
        }
        default: {}
    }
    if (fmt == FMT_QUANT) {
        store_quantized(t, lt, aux, a, b, vals, count, r);
    }
}

// Blockwise::quantize_block over the thread's share of each block: the block's absmax (the
// largest |x| as bits), then each code nearest to (or stochastically rounded from) x / absmax.
fn store_quantized(t: Tile, lt: u32, aux: u32, a: u32, b: u32, vals: array<f32, 16>, count: u32, r: array<u32, 16>) {
    let map = aux & 0xFFu;
    let log_block = (aux >> 8u) & 0xFFu;
    let stochastic = ((aux >> 16u) & 1u) == 1u;
    let bits = aux >> 24u;
    var local = 0u;
    for (var j = 0u; j < count; j = j + 1u) {
        local = max(local, bitcast<u32>(vals[j]) & 0x7FFFFFFFu);
    }
    // Threads per block (blocks are at least 32 elements).
    let group = (1u << log_block) / PER;
    workgroupBarrier();
    red[lt] = local;
    workgroupBarrier();
    for (var s = 1u; s < 256u; s = s * 2u) {
        if (s < group && (lt % (2u * s)) == 0u) {
            red[lt] = max(red[lt], red[lt + s]);
        }
        workgroupBarrier();
    }
    let absmax = bitcast<f32>(red[(lt / group) * group]);
    if (count == 0u) {
        return;
    }
    let first = t.start + PER * lt;
    var words = array<u32, 4>(0u, 0u, 0u, 0u);
    for (var j = 0u; j < count; j = j + 1u) {
        var y = 0.0;
        if (absmax != 0.0) {
            y = vals[j] / absmax;
        }
        var code: u32;
        if (stochastic) {
            code = map_stochastic(map, y, r[j]);
        } else {
            code = map_nearest(map, y);
        }
        let at = j * bits;
        words[at / 32u] = words[at / 32u] | (code << (at % 32u));
    }
    let used = (count * bits + 31u) / 32u;
    let w0 = (first * bits) / 32u;
    for (var k = 0u; k < used; k = k + 1u) {
        seg[a + w0 + k] = words[k];
    }
    if ((first & ((1u << log_block) - 1u)) == 0u) {
        seg[b + (first >> log_block)] = bitcast<u32>(absmax);
    }
}

// slot.rs `Slot::clear` of the thread's elements: zeros; a quantized slot gets zero scales (and,
// at 8 bits, the code of 0; narrower codes are left as they are, as on the CPU).
fn clear(t: Tile, lt: u32, slot: u32, count: u32) {
    let fmt = slot_word(t, slot, 0u);
    let aux = slot_word(t, slot, 1u);
    let a = slot_word(t, slot, 2u);
    let b = slot_word(t, slot, 3u);
    let first = t.start + PER * lt;
    switch fmt {
        case FMT_F32: {
            for (var j = 0u; j < count; j = j + 1u) {
                seg[a + first + j] = 0u;
            }
        }
        case FMT_BF16, FMT_BF16_SR: {
            for (var j = 0u; j < count; j = j + 2u) {
                seg[a + (first + j) / 2u] = 0u;
            }
        }
        case FMT_KAHAN, FMT_SPLIT: {
            for (var j = 0u; j < count; j = j + 2u) {
                seg[a + (first + j) / 2u] = 0u;
                seg[b + (first + j) / 2u] = 0u;
            }
        }
        case FMT_QUANT: {
            let log_block = (aux >> 8u) & 0xFFu;
            let bits = aux >> 24u;
            if (bits == 8u && count > 0u) {
                let zero = map_nearest(aux & 0xFFu, 0.0);
                let z = zero | (zero << 8u) | (zero << 16u) | (zero << 24u);
                for (var k = 0u; k < (count + 3u) / 4u; k = k + 1u) {
                    seg[a + first / 4u + k] = z;
                }
            }
            if (count > 0u && (first & ((1u << log_block) - 1u)) == 0u) {
                seg[b + (first >> log_block)] = 0u;
            }
        }
        default: {}
    }
}

// ---------------------------------------------------------------------------------------------
// The update rules (lpmm-optim rule.rs `Rule::apply`), PyTorch's order of operations; `fma`
// where the CPU writes `mul_add`.

struct Update {
    p: f32,
    d: f32,
    m: f32,
    v: f32,
}

fn apply_rule(t: Tile, p: f32, g: f32, m0: f32, v0: f32, first: bool) -> Update {
    var u: Update;
    u.m = m0;
    u.v = v0;
    let kind = dw(t, D_RULE);
    let rf = dw(t, D_RULE_FLAGS);
    if (kind == 0u) {
        // SGD
        let neg_lr = df(t, D_RC + 0u);
        let wd = df(t, D_RC + 1u);
        let momentum = df(t, D_RC + 2u);
        let one_minus_dampening = df(t, D_RC + 3u);
        var d = g;
        if (wd != 0.0) {
            d = fmaf(p, wd, g);
        }
        if ((rf & R_HAS_MOMENTUM) != 0u) {
            if (first) {
                u.m = d;
            } else {
                u.m = fmaf(d, one_minus_dampening, m0 * momentum);
            }
            if ((rf & R_NESTEROV) != 0u) {
                d = fmaf(u.m, momentum, d);
            } else {
                d = u.m;
            }
        }
        u.p = fmaf(d, neg_lr, p);
        u.d = d * neg_lr;
    } else if (kind == 1u) {
        // Adam / AdamW
        let decay = df(t, D_RC + 0u);
        let neg_lr_wd = df(t, D_RC + 1u);
        let wd = df(t, D_RC + 2u);
        let one_minus_beta1 = df(t, D_RC + 3u);
        let beta2 = df(t, D_RC + 4u);
        let one_minus_beta2 = df(t, D_RC + 5u);
        let bias_correction2_sqrt = df(t, D_RC + 6u);
        let eps = df(t, D_RC + 7u);
        let neg_step_size = df(t, D_RC + 8u);
        var gg = g;
        var decayed = p;
        var decay_delta = 0.0;
        if ((rf & R_DECOUPLED) != 0u) {
            decayed = p * decay;
            decay_delta = p * neg_lr_wd;
        } else if (wd != 0.0) {
            gg = fmaf(p, wd, g);
        }
        if (one_minus_beta1 < 0.5) {
            u.m = fmaf(gg - m0, one_minus_beta1, m0);
        } else {
            u.m = fmaf(gg - m0, one_minus_beta1 - 1.0, gg);
        }
        if ((rf & R_GIVEN_V) == 0u) {
            u.v = fmaf(one_minus_beta2 * gg, gg, v0 * beta2);
        }
        let denom = sqrt(u.v) / bias_correction2_sqrt + eps;
        let step = neg_step_size * u.m / denom;
        u.p = decayed + step;
        u.d = decay_delta + step;
    } else {
        // Lion
        let decay = df(t, D_RC + 0u);
        let neg_lr_wd = df(t, D_RC + 1u);
        let neg_lr = df(t, D_RC + 2u);
        let beta1 = df(t, D_RC + 3u);
        let one_minus_beta1 = df(t, D_RC + 4u);
        let beta2 = df(t, D_RC + 5u);
        let one_minus_beta2 = df(t, D_RC + 6u);
        let decayed = p * decay;
        let c = fmaf(g, one_minus_beta1, m0 * beta1);
        var s = 0.0;
        if (c > 0.0) {
            s = 1.0;
        } else if (c < 0.0) {
            s = -1.0;
        }
        u.m = fmaf(g, one_minus_beta2, m0 * beta2);
        u.p = fmaf(s, neg_lr, decayed);
        u.d = p * neg_lr_wd + s * neg_lr;
    }
    return u;
}

fn thread_count(t: Tile, lt: u32) -> u32 {
    let first = PER * lt;
    if (first >= t.n) {
        return 0u;
    }
    return min(PER, t.n - first);
}

fn pair(lo_field: u32, t: Tile) -> vec2<u32> {
    return vec2<u32>(dw(t, lo_field), dw(t, lo_field + 1u));
}

// ---------------------------------------------------------------------------------------------
// Entry points. Every tile's descriptor says which operation's fields it fills.

// cpu.rs `allocate`: the initial values from `io` stored as the parameter (stream counter 0).
@compute @workgroup_size(256)
fn init_main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lt: u32) {
    let t = tile_of(wid, nwg);
    if (!t.valid) {
        return;
    }
    let count = thread_count(t, lt);
    let base = dw(t, D_INPUT) + t.start + PER * lt;
    var vals: array<f32, 16>;
    for (var j = 0u; j < count; j = j + 1u) {
        vals[j] = io[base + j];
    }
    store(t, lt, S_PARAM, vals, count, vec2<u32>(0u, 0u));
}

// cpu.rs `accumulate`: accumulator + micro-batch gradient, stored with the gradient stream.
@compute @workgroup_size(256)
fn accumulate_main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lt: u32) {
    let t = tile_of(wid, nwg);
    if (!t.valid) {
        return;
    }
    let count = thread_count(t, lt);
    let first = t.start + PER * lt;
    let base = dw(t, D_INPUT) + first;
    var vals: array<f32, 16>;
    for (var j = 0u; j < count; j = j + 1u) {
        vals[j] = load(t, S_GRAD, first + j) + io[base + j];
    }
    store(t, lt, S_GRAD, vals, count, pair(D_ACC_LO, t));
}

// cpu.rs `read`: one slot decoded into `io`.
@compute @workgroup_size(256)
fn decode_main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lt: u32) {
    let t = tile_of(wid, nwg);
    if (!t.valid) {
        return;
    }
    let count = thread_count(t, lt);
    let first = t.start + PER * lt;
    let base = dw(t, D_INPUT) + first;
    let slot = dw(t, D_MODE);
    for (var j = 0u; j < count; j = j + 1u) {
        io[base + j] = load(t, slot, first + j);
    }
}

// cpu.rs `clear_gradients`.
@compute @workgroup_size(256)
fn clear_main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lt: u32) {
    let t = tile_of(wid, nwg);
    if (!t.valid) {
        return;
    }
    clear(t, lt, S_GRAD, thread_count(t, lt));
}

// cpu.rs `fused_step`: decode gradient (plus the released gradient), parameter and states; apply
// the rule (an element whose gradient or results are not finite is left unchanged and flags the
// piece); store the states, the parameter (Kahan: add the increment) and clear the accumulator.
@compute @workgroup_size(256)
fn step_main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lt: u32) {
    let t = tile_of(wid, nwg);
    if (!t.valid) {
        return;
    }
    let count = thread_count(t, lt);
    let first = t.start + PER * lt;
    let fl = dw(t, D_FLAGS);
    let is_first = (fl & F_FIRST) != 0u;
    let clip = df(t, D_CLIP);
    let base = dw(t, D_INPUT) + first;
    var p: array<f32, 16>;
    var m: array<f32, 16>;
    var v: array<f32, 16>;
    var d: array<f32, 16>;
    var bad = false;
    for (var j = 0u; j < count; j = j + 1u) {
        var g = load(t, S_GRAD, first + j);
        if ((fl & F_INPUT) != 0u) {
            g = g + io[base + j];
        }
        let gi = g * clip;
        let p0 = load(t, S_PARAM, first + j);
        let m0 = load(t, S_STATE1, first + j);
        let v0 = load(t, S_STATE2, first + j);
        let u = apply_rule(t, p0, gi, m0, v0, is_first);
        let ok = is_finite(gi) && is_finite(u.p) && is_finite(u.d) && is_finite(u.m) && is_finite(u.v);
        m[j] = select(m0, u.m, ok);
        v[j] = select(v0, u.v, ok);
        p[j] = select(p0, u.p, ok);
        d[j] = select(0.0, u.d, ok);
        bad = bad || !ok;
    }
    if (bad) {
        atomicOr(&flags[dw(t, D_FLAG_INDEX)], 1u);
    }
    let counter = pair(D_STEP_LO, t);
    store(t, lt, S_STATE1, m, count, counter);
    store(t, lt, S_STATE2, v, count, counter);
    if ((fl & F_UPDATE_PARAM) != 0u) {
        if (slot_word(t, S_PARAM, 0u) == FMT_KAHAN) {
            // split.rs `kahan_add`.
            let a = slot_word(t, S_PARAM, 2u);
            let b = slot_word(t, S_PARAM, 3u);
            for (var j = 0u; j < count; j = j + 2u) {
                var h = array<u32, 2>(0u, 0u);
                var cw = array<u32, 2>(0u, 0u);
                let word_v = seg[a + (first + j) / 2u];
                let word_c = seg[b + (first + j) / 2u];
                for (var k = 0u; k < 2u; k = k + 1u) {
                    if (j + k < count) {
                        let old = bf16_value((word_v >> (16u * k)) & 0xFFFFu);
                        let comp = bf16_value((word_c >> (16u * k)) & 0xFFFFu);
                        let c = comp + d[j + k];
                        h[k] = bf16_nearest(old + c);
                        cw[k] = bf16_nearest(c + (old - bf16_value(h[k])));
                    }
                }
                seg[a + (first + j) / 2u] = h[0] | (h[1] << 16u);
                seg[b + (first + j) / 2u] = cw[0] | (cw[1] << 16u);
            }
        } else {
            store(t, lt, S_PARAM, p, count, counter);
        }
    }
    // Every invocation has read the block scales of the gradient it shares with its neighbours
    // before any of them is zeroed.
    workgroupBarrier();
    clear(t, lt, S_GRAD, count);
}
