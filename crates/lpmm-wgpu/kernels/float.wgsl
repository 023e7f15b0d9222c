// Floats: bf16 rounding (lpmm-formats float.rs; half's conversion), an exact fused multiply-add
// for drivers whose `fma` is not fused, and the probe of the driver's arithmetic.

// ---------------------------------------------------------------------------------------------
// Floats (lpmm-formats float.rs, split.rs; half's bf16 conversion).

fn is_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7F800000u) != 0x7F800000u;
}

// format/mod.rs `fits`: finite and at most `limit` (f32 bits) in magnitude.
fn fits(x: f32, limit: u32) -> bool {
    return (bitcast<u32>(x) & 0x7FFFFFFFu) <= limit;
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
// Rounded products. A driver may contract a product and the addition that takes it into one fma
// (SPIR-V allows it unless told NoContraction, which naga does not emit; NVIDIA's driver does
// it), which skips the product's rounding that the CPU does. `mulr` rounds the product to f32
// bits and ORs in a zero the compiler cannot know (`tile_of` sets it from the workgroup id's z,
// which the host dispatches as 1), so the driver must keep that rounding. Every f32 product that
// could reach an addition goes through it; others are only compared, converted to integers or
// operands of `fmaf`, `divf` and `sqrtf` (tests/codegen.rs checks).

var<private> UNFUSED: u32;

fn mulr(a: f32, b: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(a * b) | UNFUSED);
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

// ---------------------------------------------------------------------------------------------
// Division and square root. WGSL allows `a / b` an error of 2.5 ulp and `sqrt` the accuracy it
// inherits from `inverseSqrt`, so unless the backend's probe found the driver's correctly rounded
// (DIV_NATIVE, SQRT_NATIVE), `divf` and `sqrtf` compute round-to-nearest-even of the exact result
// in integer arithmetic: the significands' quotient or root digit by digit (26 bits), a sticky
// bit from the remainder, one rounding, subnormal operands and results included. Every f32
// division and square root of the program goes through them (tests/codegen.rs checks that in
// the program's IR). Ties (a quotient can fall halfway between two subnormals) go to even.

override DIV_NATIVE: bool = false;
override SQRT_NATIVE: bool = false;

fn divf(a: f32, b: f32) -> f32 {
    if (DIV_NATIVE) {
        return a / b;
    }
    return div_soft(a, b);
}

fn sqrtf(x: f32) -> f32 {
    if (SQRT_NATIVE) {
        return sqrt(x);
    }
    return sqrt_soft(x);
}

// The significand of a finite non-zero f32 with its leading bit at bit 23, and the exponent
// field that goes with it (below 1 for a subnormal).
struct Unpacked {
    m: u32,
    e: i32,
}

fn unpack(u: u32) -> Unpacked {
    var out: Unpacked;
    let e = i32((u >> 23u) & 0xFFu);
    let m = u & 0x7FFFFFu;
    if (e == 0) {
        let s = countLeadingZeros(m) - 8u;
        out.m = m << s;
        out.e = 1 - i32(s);
    } else {
        out.m = m | 0x800000u;
        out.e = e;
    }
    return out;
}

// q * 2^(e - 152) (q a 26-bit quotient or root, its leading bit at bit 25; `sticky`: a non-zero
// remainder) rounded to nearest even, with `sign`; e is the biased exponent of the leading bit.
fn round_packed(q: u32, sticky: bool, e: i32, sign: u32) -> f32 {
    if (e >= 255) {
        return bitcast<f32>(sign | 0x7F800000u);
    }
    // Two bits below the 24 of a normal result; more down to the subnormal grid (2^-149).
    var drop = 2u;
    if (e < 1) {
        if (3 - e > 26) {
            return bitcast<f32>(sign);
        }
        drop = u32(3 - e);
    }
    var mant = q >> drop;
    let half = (q >> (drop - 1u)) & 1u;
    let rest = sticky || (q & ((1u << (drop - 1u)) - 1u)) != 0u;
    if (half == 1u && (rest || (mant & 1u) == 1u)) {
        mant = mant + 1u;
    }
    // A normal result's significand carries its leading bit, which adds 1 to the exponent field
    // e - 1 (a carry out of rounding moves it once more, up to Inf at the top); a subnormal's
    // field is 0 (rounding up to 2^23 gives the smallest normal).
    var field = 0u;
    if (e >= 1) {
        field = u32(e - 1);
    }
    return bitcast<f32>(sign | ((field << 23u) + mant));
}

fn div_soft(a: f32, b: f32) -> f32 {
    let ua = bitcast<u32>(a);
    let ub = bitcast<u32>(b);
    let sign = (ua ^ ub) & 0x80000000u;
    let fa = ua & 0x7FFFFFFFu;
    let fb = ub & 0x7FFFFFFFu;
    // NaN, Inf and zero operands: the IEEE results, built from bits.
    if (fa > 0x7F800000u || fb > 0x7F800000u || (fa == 0u && fb == 0u)
        || (fa == 0x7F800000u && fb == 0x7F800000u)) {
        return bitcast<f32>(0x7FC00000u);
    }
    if (fa == 0x7F800000u || fb == 0u) {
        return bitcast<f32>(sign | 0x7F800000u);
    }
    if (fa == 0u || fb == 0x7F800000u) {
        return bitcast<f32>(sign);
    }
    let x = unpack(ua);
    let y = unpack(ub);
    var r = x.m;
    var e = x.e - y.e + 127;
    if (r < y.m) {
        r = r << 1u;
        e = e - 1;
    }
    // r / y.m in [1, 2): 26 bits of it, restoring division (r stays below 2^25).
    var q = 0u;
    for (var i = 0u; i < 26u; i = i + 1u) {
        q = q << 1u;
        if (r >= y.m) {
            r = r - y.m;
            q = q | 1u;
        }
        r = r << 1u;
    }
    return round_packed(q, r != 0u, e, sign);
}

fn sqrt_soft(x: f32) -> f32 {
    let u = bitcast<u32>(x);
    if ((u & 0x7FFFFFFFu) == 0u || u == 0x7F800000u) {
        // sqrt(+-0) = +-0, sqrt(+Inf) = +Inf.
        return x;
    }
    if (u > 0x7F800000u) {
        // NaN and negative operands.
        return bitcast<f32>(0x7FC00000u);
    }
    let v = unpack(u);
    var m = v.m;
    // x = m 2^(k - 23) with k even, m in [2^23, 2^25).
    var k = v.e - 127;
    if ((k & 1) != 0) {
        m = m << 1u;
        k = k - 1;
    }
    // floor(sqrt(m 2^27)) (26 bits), two radicand bits at a time from the top of the 52-bit
    // m 2^27; the remainder stays below 2^27.
    var root = 0u;
    var rem = 0u;
    for (var i = 0u; i < 26u; i = i + 1u) {
        let lo = 50u - 2u * i;
        var pair = 0u;
        if (lo >= 27u) {
            pair = (m >> (lo - 27u)) & 3u;
        } else if (lo == 26u) {
            pair = (m & 1u) << 1u;
        }
        rem = (rem << 2u) | pair;
        let trial = (root << 2u) | 1u;
        if (rem >= trial) {
            rem = rem - trial;
            root = (root << 1u) | 1u;
        } else {
            root = root << 1u;
        }
    }
    return round_packed(root, rem != 0u, k / 2 + 127, 0u);
}

// The backend's probe of the driver's arithmetic: for each (a, b, c) in `io` (10 floats apart),
// writes fma(a, b, c), fma_soft(a, b, c), a * b + c (the product rounded: `mulr`, so that a
// driver that fuses does not pass for one that flushes subnormals), a / b, sqrt(|a|),
// div_soft(a, b), sqrt_soft(|a|).
@compute @workgroup_size(64)
fn arith_main(@builtin(global_invocation_id) id: vec3<u32>) {
    // Zero: the probe is dispatched with one workgroup in y and z (see `mulr`).
    UNFUSED = id.z;
    let i = 10u * id.x;
    if (i + 10u > arrayLength(&io) || i / 10u >= work[0]) {
        return;
    }
    let a = bitcast<f32>(io[i]);
    let b = bitcast<f32>(io[i + 1u]);
    let c = bitcast<f32>(io[i + 2u]);
    let abs_a = bitcast<f32>(io[i] & 0x7FFFFFFFu);
    io[i + 3u] = bitcast<u32>(fma(a, b, c));
    io[i + 4u] = bitcast<u32>(fma_soft(a, b, c));
    io[i + 5u] = bitcast<u32>(mulr(a, b) + c);
    io[i + 6u] = bitcast<u32>(a / b);
    io[i + 7u] = bitcast<u32>(sqrt(abs_a));
    io[i + 8u] = bitcast<u32>(div_soft(a, b));
    io[i + 9u] = bitcast<u32>(sqrt_soft(abs_a));
}

// Order-free sums of squares (lpmm-optim fixed.rs): x = m 2^e0 with an integer significand
// m < 2^24: (m^2 as 64 bits, e0).
struct Square {
    sq: vec2<u32>,
    e0: i32,
}

fn square(x: f32) -> Square {
    let b = bitcast<u32>(x) & 0x7FFFFFFFu;
    let eb = b >> 23u;
    var m = b & 0x7FFFFFu;
    var e0 = -149;
    if (eb != 0u) {
        m = m | 0x800000u;
        e0 = i32(eb) - 150;
    }
    // m^2 from 12-bit halves: hh 2^24 + hl 2^12 + ll.
    let h = m >> 12u;
    let l = m & 0xFFFu;
    var v = vec2<u32>(l * l, 0u);
    v = add64(v, shl64(vec2<u32>(2u * h * l, 0u), 12u));
    v = add64(v, shl64(vec2<u32>(h * h, 0u), 24u));
    var out: Square;
    out.sq = v;
    out.e0 = e0;
    return out;
}

// Fractional bits of a sum over `count` terms (fixed.rs `frac_bits`).
fn frac_bits(count: u32) -> i32 {
    return 62 - i32(32u - countLeadingZeros(count));
}

// Whether x counts in a fold: finite and not zero.
fn fixed_counts(x: f32) -> bool {
    return is_finite(x) && x != 0.0;
}

// The first fold's value: the exponent of x^2 + 1024 (fixed.rs `exponent` + EXP_BIAS).
fn fixed_exponent(x: f32) -> u32 {
    let q = square(x);
    return u32(i32(bitlen64(q.sq)) - 1 + 2 * q.e0 + 1024);
}

// The second fold's term: floor(x^2 2^(frac - E)) for the stored exponent of the sum (fixed.rs
// `term`).
fn fixed_term(x: f32, stored: u32, frac: i32) -> vec2<u32> {
    let q = square(x);
    let shift = 2 * q.e0 + frac - (i32(stored) - 1024);
    if (shift >= 0) {
        return shl64(q.sq, u32(shift));
    }
    return shr64(q.sq, u32(-shift));
}

// Adds `v` to the 64-bit integer in flag words k (low) and k + 1 (high): exact in any order.
fn flag_add64(k: u32, v: vec2<u32>) {
    let old = atomicAdd(&flags[k], v.x);
    let carry = select(0u, 1u, old > 0xFFFFFFFFu - v.x);
    let hi = v.y + carry;
    if (hi != 0u) {
        atomicAdd(&flags[k + 1u], hi);
    }
}
