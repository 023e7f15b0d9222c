// Adafactor's factorized second moment (lpmm-optim format/factored.rs): the row averages
// (region 0), column averages (1), mean(r) (2), and the folds' scratch: per row, then per
// column, the largest exponent of the squares + 1024 (3) and the 64-bit fixed-point sum (4).

// (rows, cols) of the tensor viewed as a matrix (leading dimensions x last).
fn factored_dims(t: Tile) -> vec2<u32> {
    let nd = dw(t, D_NDIM);
    var rows = 1u;
    for (var k = 0u; k + 1u < nd; k = k + 1u) {
        rows = rows * dw(t, D_SHAPE + k);
    }
    return vec2<u32>(rows, dw(t, D_SHAPE + nd - 1u));
}

fn fmt_factored_load(t: Tile, s: u32, i: u32) -> f32 {
    let dims = factored_dims(t);
    let e = global_index(t, i);
    let mean = bitcast<f32>(rd(region(t, s, 2u), 0u));
    if (mean > 0.0) {
        let r = bitcast<f32>(rd(region(t, s, 0u), e / dims.y));
        let c = bitcast<f32>(rd(region(t, s, 1u), e % dims.y));
        return r * c / mean;
    }
    return 0.0;
}

// x = m 2^e0 with an integer significand m < 2^24: (m^2 as 64 bits, e0).
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

// Fractional bits of a sum over `count` terms (factored.rs `frac_bits`).
fn frac_bits(count: u32) -> i32 {
    return 62 - i32(32u - countLeadingZeros(count));
}

// Pass 0: the exponent of x^2 into its row's and column's maxima; pass 1: floor(x^2 2^(F - E))
// into their sums.
fn fmt_factored_fold(t: Tile, s: u32, phase: u32, i: u32, x: f32) {
    if (!is_finite(x) || x == 0.0) {
        return;
    }
    let dims = factored_dims(t);
    let e = global_index(t, i);
    let keys = array<u32, 2>(e / dims.y, dims.x + e % dims.y);
    let counts = array<u32, 2>(dims.y, dims.x);
    let q = square(x);
    let ex = i32(bitlen64(q.sq)) - 1 + 2 * q.e0;
    for (var k = 0u; k < 2u; k = k + 1u) {
        if (phase == 0u) {
            wide_max(region(t, s, 3u), keys[k], u32(ex + 1024));
        } else {
            let big = i32(rd(region(t, s, 3u), keys[k])) - 1024;
            let shift = 2 * q.e0 + frac_bits(counts[k]) - big;
            var term: vec2<u32>;
            if (shift >= 0) {
                term = shl64(q.sq, u32(shift));
            } else {
                term = shr64(q.sq, u32(-shift));
            }
            wide_add64(region(t, s, 4u), keys[k], term);
        }
    }
}
