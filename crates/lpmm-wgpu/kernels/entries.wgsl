// The entry points (abi.rs `Entry`): every tile's descriptor says which operation's fields it
// fills.

// Stores the 16 values of thread `lt` in slot `s` (format/*.rs `encode`), drawing the random
// words of a stochastic format from the slot's stream at `counter`. Uniform control flow.
fn store(t: Tile, lt: u32, s: u32, v: array<f32, 16>, count: u32, counter: vec2<u32>) {
    var r: array<u32, 16>;
    if (fmt_stochastic(slot_format(t, s), slot_aux(t, s)) && count > 0u) {
        r = thread_bits(t, lt, s, counter);
    }
    fmt_store(t, lt, s, v, count, r);
}

// cpu.rs `allocate`: the initial values stored as the parameter (stream counter 0).
@compute @workgroup_size(256)
fn lpmm_init(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lt: u32) {
    let t = tile_of(wid, nwg);
    if (!t.valid) {
        return;
    }
    let count = thread_count(t, lt);
    let first = t.start + PER * lt;
    var v: array<f32, 16>;
    for (var j = 0u; j < count; j = j + 1u) {
        v[j] = io_load(t, first + j);
    }
    store(t, lt, S_PARAM, v, count, vec2<u32>(0u, 0u));
}

// cpu.rs `accumulate`: accumulator + micro-batch gradient, stored with the gradient stream.
@compute @workgroup_size(256)
fn lpmm_accumulate(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lt: u32) {
    let t = tile_of(wid, nwg);
    if (!t.valid) {
        return;
    }
    let count = thread_count(t, lt);
    let first = t.start + PER * lt;
    var v: array<f32, 16>;
    for (var j = 0u; j < count; j = j + 1u) {
        v[j] = fmt_load(t, S_GRAD, first + j) + io_load(t, first + j);
    }
    store(t, lt, S_GRAD, v, count, pair(t, D_ACC));
}

// cpu.rs `read`: slot `mode` decoded into the io binding.
@compute @workgroup_size(256)
fn lpmm_decode(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lt: u32) {
    let t = tile_of(wid, nwg);
    if (!t.valid) {
        return;
    }
    let count = thread_count(t, lt);
    let first = t.start + PER * lt;
    let s = dw(t, D_MODE);
    var v: array<f32, 16>;
    for (var j = 0u; j < count; j = j + 1u) {
        v[j] = fmt_load(t, s, first + j);
    }
    io_store(t, first, v, count);
}

// cpu.rs `clear_gradients`.
@compute @workgroup_size(256)
fn lpmm_clear(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lt: u32) {
    let t = tile_of(wid, nwg);
    if (!t.valid) {
        return;
    }
    fmt_clear(t, lt, S_GRAD, thread_count(t, lt));
}

// Backend::fits of a caller's buffer (no gradient slot in the descriptor), or
// Backend::accumulate_fits (cpu.rs: the accumulator plus the input, as lpmm_accumulate sums
// them): the item's flag is set if a value is not finite or beyond `mode` (f32 bits).
@compute @workgroup_size(256)
fn lpmm_check(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lt: u32) {
    let t = tile_of(wid, nwg);
    if (!t.valid) {
        return;
    }
    let count = thread_count(t, lt);
    let first = t.start + PER * lt;
    let limit = dw(t, D_MODE);
    let sum = slot_format(t, S_GRAD) != FMT_NONE;
    var bad = false;
    for (var j = 0u; j < count; j = j + 1u) {
        var x = io_load(t, first + j);
        if (sum) {
            x = fmt_load(t, S_GRAD, first + j) + x;
        }
        bad = bad || !fits(x, limit);
    }
    if (bad) {
        atomicOr(&flags[dw(t, D_FLAG_INDEX)], 1u);
    }
}

// rule/mod.rs `apply_rule`'s test: the gradient and increment finite, the parameter and states
// within their formats' limits (fmt_limit; the parameter's only where it moves, f32's otherwise).
fn step_ok(t: Tile, fl: u32, gi: f32, u: Update) -> bool {
    var lp = LIMIT_F32;
    if ((fl & F_UPDATE_PARAM) != 0u) {
        lp = fmt_limit(slot_format(t, S_PARAM));
    }
    return fits(gi, LIMIT_F32) && fits(u.p, lp) && fits(u.d, LIMIT_F32) && fits(u.m, fmt_limit(slot_format(t, S_STATE1))) && fits(u.v, fmt_limit(slot_format(t, S_STATE2))) && fits(u.w, fmt_limit(slot_format(t, S_STATE3)));
}

// The gradient of item element `i`: the accumulator plus the released gradient, if any.
fn gradient(t: Tile, i: u32) -> f32 {
    var g = fmt_load(t, S_GRAD, i);
    if ((dw(t, D_FLAGS) & F_INPUT) != 0u) {
        g = g + io_load(t, i);
    }
    return g;
}

// cpu.rs `fold_piece`: pass `mode & 255` of a tensor-wide phase. Target `(mode >> 8) & 255` is a
// slot (state 2 or 3) whose format folds, per element, its updated value (the rule applied,
// nothing stored; input `mode >> 16` = FOLD_UPDATED) or the rule's moment input for it
// (FOLD_MOMENT); or FOLD_STATS: the rule's `mode >> 24` sums of squares, over a tensor whose
// count has `(mode >> 16) & 255` fractional bits, into its block of flag words at `flag_index`
// (abi.rs STAT_WORDS: the exponents, then the 64-bit sums).
@compute @workgroup_size(256)
fn lpmm_fold(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lt: u32) {
    let t = tile_of(wid, nwg);
    if (!t.valid) {
        return;
    }
    let count = thread_count(t, lt);
    let first = t.start + PER * lt;
    let fl = dw(t, D_FLAGS);
    let clip = df(t, D_CLIP);
    let mode = dw(t, D_MODE);
    let phase = mode & 0xFFu;
    let dest = (mode >> 8u) & 0xFFu;
    let base = dw(t, D_FLAG_INDEX);
    for (var j = 0u; j < count; j = j + 1u) {
        let gi = mulr(gradient(t, first + j), clip);
        let p0 = fmt_load(t, S_PARAM, first + j);
        let m0 = fmt_load(t, S_STATE1, first + j);
        let v0 = fmt_load(t, S_STATE2, first + j);
        let w0 = fmt_load(t, S_STATE3, first + j);
        if (dest == FOLD_STATS) {
            let frac = i32((mode >> 16u) & 0xFFu);
            for (var k = 0u; k < (mode >> 24u); k = k + 1u) {
                let x = stat_input(t, fl, k, p0, gi, m0, v0, w0);
                if (!fixed_counts(x)) {
                    continue;
                }
                if (phase == 0u) {
                    atomicMax(&flags[base + k], fixed_exponent(x));
                } else {
                    let stored = atomicLoad(&flags[base + k]);
                    flag_add64(base + STAT_SUM + 2u * k, fixed_term(x, stored, frac));
                }
            }
            continue;
        }
        var x: f32;
        if ((mode >> 16u) == FOLD_UPDATED) {
            let u = apply_rule(t, fl, p0, gi, m0, v0, w0);
            let ok = step_ok(t, fl, gi, u);
            if (dest == S_STATE3) {
                x = select(w0, u.w, ok);
            } else {
                x = select(v0, u.v, ok);
            }
        } else {
            x = moment_input(t, fl, dest, p0, gi, m0, v0, w0);
        }
        fmt_fold(t, dest, phase, first + j, x);
    }
}

// cpu.rs `fused_step`: decode gradient (plus the released gradient), parameter and states; apply
// the rule (an element whose gradient or results are not finite, or whose parameter or states do
// not fit their formats, is left unchanged and flags the parameter); store the states, the
// parameter (or add the increment) and clear the accumulator. With F_TRANSFORM: no gradient is
// read, only the parameter is stored.
@compute @workgroup_size(256)
fn lpmm_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lt: u32) {
    let t = tile_of(wid, nwg);
    if (!t.valid) {
        return;
    }
    let count = thread_count(t, lt);
    let first = t.start + PER * lt;
    let fl = dw(t, D_FLAGS);
    let clip = df(t, D_CLIP);
    let transform = (fl & F_TRANSFORM) != 0u;
    var p: array<f32, 16>;
    var m: array<f32, 16>;
    var v: array<f32, 16>;
    var w: array<f32, 16>;
    var d: array<f32, 16>;
    var bad = false;
    for (var j = 0u; j < count; j = j + 1u) {
        var gi = 0.0;
        if (!transform) {
            gi = mulr(gradient(t, first + j), clip);
        }
        let p0 = fmt_load(t, S_PARAM, first + j);
        let m0 = fmt_load(t, S_STATE1, first + j);
        let v0 = fmt_load(t, S_STATE2, first + j);
        let w0 = fmt_load(t, S_STATE3, first + j);
        let u = apply_rule(t, fl, p0, gi, m0, v0, w0);
        let ok = step_ok(t, fl, gi, u);
        m[j] = select(m0, u.m, ok);
        v[j] = select(v0, u.v, ok);
        w[j] = select(w0, u.w, ok);
        p[j] = select(p0, u.p, ok);
        d[j] = select(0.0, u.d, ok);
        bad = bad || !ok;
    }
    if (bad) {
        atomicOr(&flags[dw(t, D_FLAG_INDEX)], 1u);
    }
    let counter = pair(t, D_STEP);
    if (!transform) {
        store(t, lt, S_STATE1, m, count, counter);
        store(t, lt, S_STATE2, v, count, counter);
        store(t, lt, S_STATE3, w, count, counter);
    }
    if ((fl & F_UPDATE_PARAM) != 0u) {
        if (!fmt_add(t, lt, S_PARAM, d, count)) {
            store(t, lt, S_PARAM, p, count, counter);
        }
    }
    // Every invocation has read the block scales of the gradient it shares with its neighbours
    // before any of them is zeroed.
    workgroupBarrier();
    if (!transform) {
        fmt_clear(t, lt, S_GRAD, count);
    }
}
