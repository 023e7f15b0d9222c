// Rank-1 normalized codes of a second moment (lpmm-optim format/rank1.rs, lpmm-quant rank1.rs):
// packed codes (region 0), the current per-dimension maxima (region 1) and the next step's
// (region 2, folded with atomic max). aux: map | code bits << 24.

// Where dimension k's maxima start, and tensor element e's index along it.
struct Rank1Index {
    off: array<u32, 8>,
    idx: array<u32, 8>,
    nd: u32,
}

fn rank1_index(t: Tile, e: u32) -> Rank1Index {
    var r: Rank1Index;
    r.nd = dw(t, D_NDIM);
    var acc = 0u;
    for (var k = 0u; k < r.nd; k = k + 1u) {
        r.off[k] = acc;
        acc = acc + dw(t, D_SHAPE + k);
    }
    var rest = e;
    for (var k = r.nd; k > 0u; k = k - 1u) {
        let d = dw(t, D_SHAPE + k - 1u);
        r.idx[k - 1u] = rest % d;
        rest = rest / d;
    }
    return r;
}

// Rank1::for_each_scale: min over the outer dimensions, then with the last one's.
fn rank1_scale(t: Tile, a: vec2<u32>, e: u32) -> f32 {
    let r = rank1_index(t, e);
    var outer = bitcast<f32>(0x7F800000u);
    for (var k = 0u; k + 1u < r.nd; k = k + 1u) {
        outer = min(outer, bitcast<f32>(rd(a, r.off[k] + r.idx[k])));
    }
    let last = r.nd - 1u;
    return min(outer, bitcast<f32>(rd(a, r.off[last] + r.idx[last])));
}

fn fmt_rank1_load(t: Tile, s: u32, i: u32) -> f32 {
    let aux = slot_aux(t, s);
    let bits = aux >> 24u;
    let at = i * bits;
    let code = (rd(region(t, s, 0u), at / 32u) >> (at % 32u)) & ((1u << bits) - 1u);
    return mulr(map_value(aux & 0xFFu, code), rank1_scale(t, region(t, s, 1u), global_index(t, i)));
}

// The codes nearest to v / s with the next step's maxima.
fn fmt_rank1_store(t: Tile, lt: u32, s: u32, v: array<f32, 16>, count: u32, r: array<u32, 16>) {
    let aux = slot_aux(t, s);
    let map = aux & 0xFFu;
    let bits = aux >> 24u;
    let first = t.start + PER * lt;
    var words = array<u32, 4>(0u, 0u, 0u, 0u);
    for (var j = 0u; j < count; j = j + 1u) {
        let sc = rank1_scale(t, region(t, s, 2u), global_index(t, first + j));
        var y = 0.0;
        if (sc != 0.0) {
            y = divf(v[j], sc);
        }
        let at = j * bits;
        words[at / 32u] = words[at / 32u] | (map_nearest(map, y) << (at % 32u));
    }
    let used = (count * bits + 31u) / 32u;
    let w0 = (first * bits) / 32u;
    for (var k = 0u; k < used; k = k + 1u) {
        wr(region(t, s, 0u), w0 + k, words[k]);
    }
}

// Rank1::fold_maxima of the updated second moment: every dimension's maximum at the element's
// index (a max of non-negative floats is a max of their bits, the same in any order).
fn fmt_rank1_fold(t: Tile, s: u32, phase: u32, i: u32, x: f32) {
    let r = rank1_index(t, global_index(t, i));
    let a = region(t, s, 2u);
    let bits = bitcast<u32>(abs(x));
    for (var k = 0u; k < r.nd; k = k + 1u) {
        wide_max(a, r.off[k] + r.idx[k], bits);
    }
}
