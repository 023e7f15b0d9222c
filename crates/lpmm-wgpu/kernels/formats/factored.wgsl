// Adafactor's factorized second moment (lpmm-optim format/factored.rs): the row averages
// (region 0), column averages (1), mean(r) (2), and the folds' scratch (fixed.rs): per row, then
// per column, the largest exponent of the squares + 1024 (3) and the 64-bit fixed-point sum (4).

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
        return mulr(divf(r, mean), c);
    }
    return 0.0;
}

// Pass 0: the exponent of x^2 into its row's and column's maxima; pass 1: floor(x^2 2^(F - E))
// into their sums.
fn fmt_factored_fold(t: Tile, s: u32, phase: u32, i: u32, x: f32) {
    if (!fixed_counts(x)) {
        return;
    }
    let dims = factored_dims(t);
    let e = global_index(t, i);
    let keys = array<u32, 2>(e / dims.y, dims.x + e % dims.y);
    let counts = array<u32, 2>(dims.y, dims.x);
    for (var k = 0u; k < 2u; k = k + 1u) {
        if (phase == 0u) {
            wide_max(region(t, s, 3u), keys[k], fixed_exponent(x));
        } else {
            let term = fixed_term(x, rd(region(t, s, 3u), keys[k]), frac_bits(counts[k]));
            wide_add64(region(t, s, 4u), keys[k], term);
        }
    }
}
