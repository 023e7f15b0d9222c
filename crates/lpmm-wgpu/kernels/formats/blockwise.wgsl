// Block-wise absmax quantization (lpmm-optim format/blockwise.rs, lpmm-quant blockwise.rs):
// packed codes (region 0) and one f32 absmax per block (region 1). aux: map | log2(block) << 8 |
// stochastic << 16 | code bits << 24.

fn fmt_blockwise_stochastic(aux: u32) -> bool {
    return ((aux >> 16u) & 1u) == 1u;
}

fn fmt_blockwise_load(t: Tile, s: u32, i: u32) -> f32 {
    let aux = slot_aux(t, s);
    let map = aux & 0xFFu;
    let log_block = (aux >> 8u) & 0xFFu;
    let bits = aux >> 24u;
    let at = i * bits;
    let code = (rd(region(t, s, 0u), at / 32u) >> (at % 32u)) & ((1u << bits) - 1u);
    let absmax = bitcast<f32>(rd(region(t, s, 1u), i >> log_block));
    return mulr(map_value(map, code), absmax);
}

// Blockwise::quantize_block over the thread's share of each block: the block's absmax (the
// largest |x| as bits, reduced across the threads of the block), then each code nearest to (or
// stochastically rounded from) x / absmax. Called in uniform control flow.
fn fmt_blockwise_store(t: Tile, lt: u32, s: u32, v: array<f32, 16>, count: u32, r: array<u32, 16>) {
    let aux = slot_aux(t, s);
    let map = aux & 0xFFu;
    let log_block = (aux >> 8u) & 0xFFu;
    let stochastic = fmt_blockwise_stochastic(aux);
    let bits = aux >> 24u;
    var local = 0u;
    for (var j = 0u; j < count; j = j + 1u) {
        local = max(local, bitcast<u32>(v[j]) & 0x7FFFFFFFu);
    }
    // Threads per block (blocks are at least 32 elements).
    let group = (1u << log_block) / PER;
    workgroupBarrier();
    red[lt] = local;
    workgroupBarrier();
    for (var st = 1u; st < 256u; st = st * 2u) {
        if (st < group && (lt % (2u * st)) == 0u) {
            red[lt] = max(red[lt], red[lt + st]);
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
            y = divf(v[j], absmax);
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
        wr(region(t, s, 0u), w0 + k, words[k]);
    }
    if ((first & ((1u << log_block) - 1u)) == 0u) {
        wr(region(t, s, 1u), first >> log_block, bitcast<u32>(absmax));
    }
}

// A zero absmax makes every code decode as 0; 8-bit codes also get the code of 0 (narrower ones
// are left as they are, as on the CPU).
fn fmt_blockwise_clear(t: Tile, lt: u32, s: u32, count: u32) {
    let aux = slot_aux(t, s);
    let log_block = (aux >> 8u) & 0xFFu;
    let bits = aux >> 24u;
    let first = t.start + PER * lt;
    if (bits == 8u && count > 0u) {
        let zero = map_nearest(aux & 0xFFu, 0.0);
        let z = zero | (zero << 8u) | (zero << 16u) | (zero << 24u);
        for (var k = 0u; k < (count + 3u) / 4u; k = k + 1u) {
            wr(region(t, s, 0u), first / 4u + k, z);
        }
    }
    if (count > 0u && (first & ((1u << log_block) - 1u)) == 0u) {
        wr(region(t, s, 1u), first >> log_block, 0u);
    }
}
