//! Properties of the quantizers: error bounds, unbiased stochastic rounding, determinism across
//! threads and chunking, bad input.

use lpmm_formats::{CodeMap, Fp8, Overflow, Rounding, float, packing};
use lpmm_quant::{
    BlockSize, Blockwise, LinearGroup, QuantError, QuantRounding, RandomStream, Rank1, Rank1OrBlock,
};
use proptest::prelude::*;

fn maps() -> Vec<CodeMap> {
    vec![
        CodeMap::dynamic(true, 8).unwrap(),
        CodeMap::dynamic(false, 8).unwrap(),
        CodeMap::dynamic(true, 4).unwrap(),
        CodeMap::linear_without_zero(4).unwrap(),
        CodeMap::normal_float(4).unwrap(),
        CodeMap::linear_signed(8).unwrap(),
        CodeMap::linear_signed(3).unwrap(),
        CodeMap::dynamic(true, 2).unwrap(),
    ]
}

/// Half the gap between the two codes around `y` (or the distance to the end code outside).
fn allowed_error(map: &CodeMap, y: f32) -> f64 {
    let v = map.values();
    let y = f64::from(y);
    let (first, last) = (f64::from(v[0]), f64::from(v[v.len() - 1]));
    if y <= first {
        return first - y;
    }
    if y >= last {
        return y - last;
    }
    let k = v.partition_point(|&c| f64::from(c) <= y) - 1;
    (f64::from(v[k + 1]) - f64::from(v[k])) / 2.0
}

/// Deterministic test data: normal-ish values with occasional outliers and tiny values.
fn data(n: usize, seed: u64) -> Vec<f32> {
    let stream = RandomStream::new(seed, 0, 0);
    let mut bits = vec![0u32; 2 * n];
    stream.fill(0, &mut bits);
    (0..n)
        .map(|i| {
            let u1 = (f64::from(bits[2 * i]) + 0.5) / 4_294_967_296.0;
            let u2 = f64::from(bits[2 * i + 1]) / 4_294_967_296.0;
            let g = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
            let scale = match bits[2 * i] % 97 {
                0 => 1e3,
                1 => 1e-7,
                _ => 1.0,
            };
            (g * scale) as f32
        })
        .collect()
}

/// [`data`] as a map takes it: magnitudes for a map without negative values (which refuses
/// negative input, `QuantError::Negative`).
fn data_for(map: &CodeMap, n: usize, seed: u64) -> Vec<f32> {
    let x = data(n, seed);
    if map.values()[0] < 0.0 {
        x
    } else {
        x.iter().map(|v| v.abs()).collect()
    }
}

fn block_sizes() -> impl Strategy<Value = BlockSize> {
    (5u32..=12).prop_map(|k| BlockSize::new(1 << k).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    #[test]
    fn nearest_error_is_at_most_half_the_local_gap(
        n in 1usize..5000, seed in any::<u64>(), block in block_sizes(), which in 0usize..8,
    ) {
        let map = &maps()[which];
        let x = data_for(map, n, seed);
        let q = Blockwise::new(map, block);
        let mut codes = vec![0u8; q.codes_len(n)];
        let mut absmax = vec![0f32; q.scales_len(n)];
        q.quantize(&x, &mut codes, &mut absmax, QuantRounding::Nearest).unwrap();
        let mut back = vec![0f32; n];
        q.dequantize(&codes, &absmax, &mut back).unwrap();
        for (i, (&v, &b)) in x.iter().zip(&back).enumerate() {
            let a = absmax[i / block.get()];
            prop_assert_eq!(a, x[i / block.get() * block.get()..].iter().take(block.get()).fold(0f32, |m, v| m.max(v.abs())));
            let y = if a == 0.0 { 0.0 } else { v / a };
            // The code is within half a gap of y; y and the decoded product each carry one f32
            // rounding (2^-24 relative), counted twice over for margin.
            let bound = (allowed_error(map, y) + f64::from(y.abs()) * 2f64.powi(-23)) * f64::from(a)
                + f64::from(b.abs()) * 2f64.powi(-23);
            let err = (f64::from(v) - f64::from(b)).abs();
            prop_assert!(err <= bound, "i={} x={} back={} err={} bound={}", i, v, b, err, bound);
        }
    }

    /// Every code is the map's own rounding of `x / absmax` (f32 division) with element `i`'s
    /// draw (16 bits: half of word `i / 2`), packed as one stream, and dequantizing reads back `map[code] * absmax`:
    /// however the quantizer cuts blocks into spans, chunks and threads.
    #[test]
    fn codes_are_the_elementwise_definition(
        n in 1usize..9000, seed in any::<u64>(), block in block_sizes(), which in 0usize..8,
        stochastic in any::<bool>(), offset in any::<u64>(), sign_fix in any::<bool>(),
    ) {
        let map = &maps()[which];
        let x = data_for(map, n, seed);
        let q = Blockwise::new(map, block).with_sign_fix(sign_fix);
        let stream = RandomStream::new(seed, 7, 3);
        let rounding = if stochastic {
            QuantRounding::Stochastic { stream, offset }
        } else {
            QuantRounding::Nearest
        };
        let mut codes = vec![0u8; q.codes_len(n)];
        let mut absmax = vec![0f32; q.scales_len(n)];
        q.quantize(&x, &mut codes, &mut absmax, rounding).unwrap();
        let mut words = vec![0u32; n];
        stream.fill_draws(offset, &mut words);
        let want: Vec<u8> = x.iter().enumerate().map(|(i, &v)| {
            let a = absmax[i / block.get()];
            let y = if a == 0.0 { 0.0 } else { v / a };
            let c = if stochastic { map.stochastic(y, words[i]) } else { map.nearest(y) };
            // bitsandbytes' sign fix (Blockwise::with_sign_fix): one code toward the value.
            if sign_fix && a != 0.0 && y != 0.0 && map.value(c).is_sign_negative() != y.is_sign_negative() {
                if y > 0.0 { (c + 1).min((map.len() - 1) as u8) } else { c.saturating_sub(1) }
            } else {
                c
            }
        }).collect();
        let mut packed = vec![0u8; q.codes_len(n)];
        packing::pack(&want, map.bits(), &mut packed).unwrap();
        prop_assert_eq!(&codes, &packed);
        let mut back = vec![0f32; n];
        q.dequantize(&codes, &absmax, &mut back).unwrap();
        for (i, (&c, &b)) in want.iter().zip(&back).enumerate() {
            prop_assert_eq!(b.to_bits(), (map.value(c) * absmax[i / block.get()]).to_bits());
        }
    }

    #[test]
    fn packing_round_trips(bits in 1u32..=8, codes in prop::collection::vec(any::<u8>(), 0..300)) {
        let codes: Vec<u8> = codes.iter().map(|c| ((u32::from(*c)) & ((1 << bits) - 1)) as u8).collect();
        let mut packed = vec![0u8; packing::packed_len(codes.len(), bits)];
        packing::pack(&codes, bits, &mut packed).unwrap();
        let mut back = vec![0u8; codes.len()];
        packing::unpack(&packed, bits, &mut back).unwrap();
        prop_assert_eq!(&back, &codes);
        for (i, &c) in codes.iter().enumerate() {
            prop_assert_eq!(packing::get(&packed, bits, i), Some(c));
        }
    }

    #[test]
    fn rank1_scales_are_the_per_dimension_maxima(
        d0 in 1usize..9, d1 in 1usize..40, d2 in 1usize..5, seed in any::<u64>(),
    ) {
        let map = CodeMap::linear_without_zero(4).unwrap();
        let shape = [d0, d1, d2];
        let n = d0 * d1 * d2;
        let x = data_for(&map, n, seed);
        let q = Rank1::new(&map, &shape).unwrap();
        let mut codes = vec![0u8; q.codes_len()];
        let mut scales = vec![0f32; q.scales_len()];
        q.quantize(&x, &mut codes, &mut scales, QuantRounding::Nearest).unwrap();
        let mut want = vec![0f32; d0 + d1 + d2];
        for i in 0..d0 { for j in 0..d1 { for k in 0..d2 {
            let a = x[(i * d1 + j) * d2 + k].abs();
            want[i] = want[i].max(a);
            want[d0 + j] = want[d0 + j].max(a);
            want[d0 + d1 + k] = want[d0 + d1 + k].max(a);
        }}}
        prop_assert_eq!(&scales, &want);
        // Folding the maxima over arbitrary cuts of the tensor gives the same scales.
        let mut folded = vec![0f32; q.scales_len()];
        let cuts = [0, n / 3, n / 3 + n / 5, n];
        for w in cuts.windows(2) {
            q.fold_maxima(&x[w[0]..w[1]], w[0], &mut folded);
        }
        prop_assert_eq!(&folded, &want);
        let mut back = vec![0f32; n];
        q.dequantize(&codes, &scales, &mut back).unwrap();
        for i in 0..d0 { for j in 0..d1 { for k in 0..d2 {
            let f = (i * d1 + j) * d2 + k;
            let s = want[i].min(want[d0 + j]).min(want[d0 + d1 + k]);
            prop_assert!(x[f].abs() <= s);
            let y = if s == 0.0 { 0.0 } else { x[f] / s };
            let bound = (allowed_error(&map, y) + f64::from(y.abs()) * 2f64.powi(-23)) * f64::from(s)
                + f64::from(back[f].abs()) * 2f64.powi(-23);
            prop_assert!((f64::from(x[f]) - f64::from(back[f])).abs() <= bound);
        }}}
    }
}

/// Mean of `samples` decoded values must be within 4 standard errors of `x` (plus a tiny slack
/// for f32 arithmetic), where the per-sample spread is that of a two-point distribution on
/// `lo`/`hi`.
fn assert_unbiased(what: &str, x: f64, lo: f64, hi: f64, samples: &[f64]) {
    let n = samples.len() as f64;
    let mean = samples.iter().sum::<f64>() / n;
    let p = if hi > lo {
        ((x - lo) / (hi - lo)).clamp(0.0, 1.0)
    } else {
        0.0
    };
    let sigma = (p * (1.0 - p)).sqrt() * (hi - lo) / n.sqrt();
    let slack = 4.0 * sigma + 1e-6 * (hi - lo) + f64::EPSILON * x.abs();
    assert!(
        (mean - x).abs() <= slack,
        "{what}: x={x} mean={mean} (|diff| {} > {slack})",
        (mean - x).abs()
    );
    assert!(
        samples.iter().all(|&s| s == lo || s == hi),
        "{what}: a sample left {{{lo}, {hi}}}"
    );
}

const DRAWS: u64 = 20_000;

proptest! {
    // Statistical checks run from a fixed seed: each 4-sigma check fails by chance with probability
    // 6e-5, and a CI run must not depend on luck. Change the seed to explore other values.
    #![proptest_config(ProptestConfig {
        cases: 64,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x1A2B_3C4D),
        failure_persistence: None,
        .. ProptestConfig::default()
    })]

    #[test]
    fn stochastic_rounding_is_unbiased_for_random_values(
        mantissa in 1.0f32..2.0, exponent in -140i32..120, negative in any::<bool>(), tensor in any::<u64>(),
    ) {
        let sign = if negative { -1.0 } else { 1.0 };
        // Scale in f64: f32's powi underflows to 0 before 2^-126.
        let x = (f64::from(mantissa) * 2f64.powi(exponent) * sign) as f32;
        prop_assume!(x.is_finite());
        let bits = || {
            let mut g = RandomStream::new(99, tensor, 0).at(0);
            (0..DRAWS / 4).map(move |_| g.next())
        };
        check_grid("bf16", x, 2f64.powi(-133), |b| f64::from(float::bf16_stochastic(x, b).to_f32()), bits());
        if x.abs() <= 65504.0 {
            check_grid("f16", x, 2f64.powi(-24), |b| f64::from(float::f16_stochastic(x, b).to_f32()), bits());
        }
        for fmt in Fp8::ALL {
            if x.abs() <= fmt.max_finite() {
                let f = |b| f64::from(fmt.decode(fmt.encode(x, Rounding::Stochastic(b), Overflow::Saturate)));
                check_grid(&format!("{fmt:?}"), x, f64::from(fmt.decode(1)), f, bits());
            }
        }
        // A code map and the LPMM linear grid: y = x scaled into [-1, 1].
        let y = mantissa / 2.0 * sign as f32;
        for map in [CodeMap::dynamic(true, 8).unwrap(), CodeMap::linear_signed(8).unwrap(), CodeMap::dynamic(true, 4).unwrap()] {
            let y = y.clamp(map.values()[0], map.values()[map.len() - 1]);
            let f = |b| f64::from(map.value(map.stochastic(y, b)));
            check_grid("code map", y, 0.0, f, bits());
        }
    }
}

fn draws(tensor: u64) -> impl Iterator<Item = u32> {
    let stream = RandomStream::new(0xC0FFEE, tensor, 0);
    let mut bits = stream.at(0);
    (0..DRAWS).map(move |_| bits.next())
}

#[test]
fn stochastic_rounding_is_unbiased_on_float_grids() {
    let values = [
        1.0f32 + 3.0 * f32::EPSILON,
        0.1,
        -7.3e-3,
        3.3e-6,
        -1.2345e4,
        1e-41,
    ];
    for (t, &x) in values.iter().enumerate() {
        let bf = |b| f64::from(float::bf16_stochastic(x, b).to_f32());
        check_grid("bf16", x, 2f64.powi(-133), bf, draws(t as u64));
        let h = |b| f64::from(float::f16_stochastic(x, b).to_f32());
        check_grid("f16", x, 2f64.powi(-24), h, draws(t as u64 + 100));
        for fmt in Fp8::ALL {
            if x.abs() <= fmt.max_finite() {
                let f = |b| {
                    f64::from(fmt.decode(fmt.encode(
                        x,
                        Rounding::Stochastic(b),
                        Overflow::Saturate,
                    )))
                };
                let min_step = f64::from(fmt.decode(1));
                check_grid(&format!("{fmt:?}"), x, min_step, f, draws(t as u64 + 200));
            }
        }
    }
}

/// Samples `round(x, bits)` over `bits` and checks them against the two neighbours of `x`, which
/// the extreme random words give: all ones never rounds away from zero, all zeros always does
/// (unless `x` is on the grid). For negative `x` "away" is downwards, hence the sort.
/// `min_step` is the format's smallest step: a value below 2^-32 of it draws too few random bits
/// to ever round up (the documented bias bound of 2^-32 of a step), so it must round to zero.
fn check_grid(
    what: &str,
    x: f32,
    min_step: f64,
    round: impl Fn(u32) -> f64,
    bits: impl Iterator<Item = u32>,
) {
    let (a, b) = (round(u32::MAX), round(0));
    let (lo, hi) = (a.min(b), a.max(b));
    if f64::from(x).abs() < min_step / 4_294_967_296.0 {
        assert_eq!((lo, hi), (0.0, 0.0), "{what}: {x}");
        return;
    }
    assert!(
        lo <= f64::from(x) && f64::from(x) <= hi,
        "{what}: {x} outside [{lo}, {hi}]"
    );
    let samples: Vec<f64> = bits.map(round).collect();
    assert_unbiased(what, f64::from(x), lo, hi, &samples);
}

#[test]
fn stochastic_rounding_is_unbiased_on_code_maps_and_linear_groups() {
    // One block whose absmax is 1.0, so the decoded value of element 1 is the map value itself.
    for (m, map) in maps().iter().enumerate() {
        for &y in &[0.3f32, -0.011, 2.7e-6, 0.999, -0.5] {
            if y < map.values()[0] || y > *map.values().last().unwrap() {
                continue;
            }
            let q = Blockwise::new(map, BlockSize::new(32).unwrap());
            let x = [1.0f32, y];
            let mut codes = vec![0u8; q.codes_len(2)];
            let mut absmax = [0f32];
            let mut out = [0f32; 2];
            // The map's own stochastic rounding, at the two extreme words, gives the neighbours.
            let (lo, hi) = (
                f64::from(map.value(map.stochastic(y, u32::MAX))),
                f64::from(map.value(map.stochastic(y, 0))),
            );
            assert!(lo <= f64::from(y) && f64::from(y) <= hi);
            let samples: Vec<f64> = (0..DRAWS / 4)
                .map(|s| {
                    let rounding = QuantRounding::Stochastic {
                        stream: RandomStream::new(7, m as u64, s),
                        offset: 0,
                    };
                    q.quantize(&x, &mut codes, &mut absmax, rounding).unwrap();
                    q.dequantize(&codes, &absmax, &mut out).unwrap();
                    f64::from(out[1])
                })
                .collect();
            assert_unbiased(&format!("map {m}"), f64::from(y), lo, hi, &samples);
        }
    }
    let group = LinearGroup::lpmm_parameter();
    let x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.7) / 40.0).collect();
    let mut sums = vec![0f64; 64];
    let mut codes = vec![0u8; 64];
    let mut absmax = [0f32];
    let mut out = vec![0f32; 64];
    let n = 4000;
    for s in 0..n {
        let rounding = QuantRounding::Stochastic {
            stream: RandomStream::new(1, 1, s),
            offset: 0,
        };
        group
            .quantize(&x, &mut codes, &mut absmax, rounding)
            .unwrap();
        group.dequantize(&codes, &absmax, &mut out).unwrap();
        for (acc, &o) in sums.iter_mut().zip(&out) {
            *acc += f64::from(o);
        }
    }
    let step = f64::from(absmax[0]) / 127.0;
    for (i, (&v, &s)) in x.iter().zip(&sums).enumerate() {
        let mean = s / n as f64;
        // 4 sigma of a two-point distribution one step wide is at most 2 * step / sqrt(n).
        assert!(
            (mean - f64::from(v)).abs() <= 2.0 * step / (n as f64).sqrt() + 1e-6,
            "element {i}: {v} vs {mean}"
        );
    }
}

#[test]
fn results_do_not_depend_on_threads_or_chunking() {
    let map = CodeMap::dynamic(true, 4).unwrap();
    let q = Blockwise::new(&map, BlockSize::new(128).unwrap());
    let n = 300_001; // several rayon chunks and a partial block
    let x = data(n, 3);
    let stream = RandomStream::new(11, 2, 5);
    let run = |x: &[f32], offset: u64| {
        let mut codes = vec![0u8; q.codes_len(x.len())];
        let mut absmax = vec![0f32; q.scales_len(x.len())];
        q.quantize(
            x,
            &mut codes,
            &mut absmax,
            QuantRounding::Stochastic { stream, offset },
        )
        .unwrap();
        (codes, absmax)
    };
    let whole = run(&x, 0);
    let single = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| run(&x, 0));
    assert_eq!(whole, single);
    // A block-aligned tail quantized on its own, with its global offset, draws the same bits.
    let cut = 128 * 1000;
    let tail = run(&x[cut..], cut as u64);
    assert_eq!(tail.0[..], whole.0[cut / 2..]);
    assert_eq!(tail.1[..], whole.1[cut / 128..]);
}

#[test]
fn rank1_stochastic_rounding_is_thread_independent_and_unbiased() {
    let map = CodeMap::linear_without_zero(4).unwrap();
    let shape = [300usize, 7, 90]; // 189,000 elements: several parallel tasks in both passes
    let n: usize = shape.iter().product();
    let x: Vec<f32> = data(n, 5).iter().map(|v| v.abs()).collect();
    let q = Rank1::new(&map, &shape).unwrap();
    let run = |stream: RandomStream| {
        let mut codes = vec![0u8; q.codes_len()];
        let mut scales = vec![0f32; q.scales_len()];
        q.quantize(
            &x,
            &mut codes,
            &mut scales,
            QuantRounding::Stochastic { stream, offset: 0 },
        )
        .unwrap();
        let mut back = vec![0f32; n];
        q.dequantize(&codes, &scales, &mut back).unwrap();
        (codes, scales, back)
    };
    let stream = RandomStream::new(4, 4, 4);
    let whole = run(stream);
    let single = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| run(stream));
    assert_eq!(whole.0, single.0);
    assert_eq!(whole.1, single.1);
    // Each code is the map's stochastic rounding of x / s with the element's draw.
    let mut draws = vec![0u32; n];
    stream.fill_draws(0, &mut draws);
    let mut codes = vec![0u8; n];
    packing::unpack(&whole.0, map.bits(), &mut codes).unwrap();
    for (i, (&c, &r)) in codes.iter().zip(&draws).enumerate() {
        let (i0, i1, i2) = (i / (7 * 90), i / 90 % 7, i % 90);
        let s = whole.1[i0].min(whole.1[300 + i1]).min(whole.1[307 + i2]);
        let y = if s == 0.0 { 0.0 } else { x[i] / s };
        assert_eq!(c, map.stochastic(y, r), "element {i}");
    }
    // Mean over 200 draws of a few elements stays within 4 sigma of x.
    let picks = [0usize, 1234, 99_999, n - 1];
    let draws = 200u32;
    let mut sums = [0f64; 4];
    for s in 0..draws {
        let (_, _, back) = run(RandomStream::new(4, 4, 100 + u64::from(s)));
        for (acc, &i) in sums.iter_mut().zip(&picks) {
            *acc += f64::from(back[i]);
        }
    }
    let scales = &whole.1;
    for (&i, &sum) in picks.iter().zip(&sums) {
        let (i0, i1, i2) = (i / (7 * 90), i / 90 % 7, i % 90);
        let s = f64::from(scales[i0].min(scales[300 + i1]).min(scales[307 + i2]));
        let step = s / 16.0;
        let mean = sum / f64::from(draws);
        let v = f64::from(x[i]);
        let tol = 4.0 * 0.5 * step / f64::from(draws).sqrt() + 1e-7 * s;
        // Values below the first code (1/16) round up to it: the map has no zero.
        if v >= step {
            assert!(
                (mean - v).abs() <= tol,
                "element {i}: x={v} mean={mean} tol={tol}"
            );
        }
    }
}

#[test]
fn all_zero_blocks_decode_to_exact_zeros_with_every_map() {
    for map in maps() {
        let q =
            Blockwise::new(&map, BlockSize::new(64).unwrap()).with_sign_fix(map.values()[0] < 0.0);
        let mut x = vec![0f32; 200];
        x[150] = 3.0; // the third block is not all zero
        x[10] = -0.0;
        let mut codes = vec![0u8; q.codes_len(200)];
        let mut absmax = vec![0f32; q.scales_len(200)];
        let mut out = vec![1f32; 200];
        for rounding in [
            QuantRounding::Nearest,
            QuantRounding::Stochastic {
                stream: RandomStream::new(1, 2, 3),
                offset: 0,
            },
        ] {
            q.quantize(&x, &mut codes, &mut absmax, rounding).unwrap();
            q.dequantize(&codes, &absmax, &mut out).unwrap();
            assert!(out[..128].iter().all(|&v| v == 0.0), "{map:?}");
            assert_eq!(absmax[..2], [0.0, 0.0]);
        }
    }
}

#[test]
fn sign_fix_keeps_tiny_values_on_their_side_of_zero() {
    let map = CodeMap::dynamic(true, 8).unwrap();
    let x = [1.0f32, -1e-9, 1e-9, 0.0, -0.0, -0.5];
    let q = Blockwise::new(&map, BlockSize::new(32).unwrap());
    let decode = |q: Blockwise| {
        let mut codes = [0u8; 6];
        let mut absmax = [0f32];
        let mut out = [0f32; 6];
        q.quantize(&x, &mut codes, &mut absmax, QuantRounding::Nearest)
            .unwrap();
        q.dequantize(&codes, &absmax, &mut out).unwrap();
        out
    };
    let plain = decode(q);
    assert_eq!(plain[1], 0.0);
    let fixed = decode(q.with_sign_fix(true));
    assert!(fixed[1] < 0.0 && fixed[1] > -1e-6, "{}", fixed[1]);
    assert_eq!(
        fixed[2], 0.0,
        "zero has the sign bit of a positive value: no fix (bitsandbytes)"
    );
    assert_eq!(fixed[3], 0.0);
    assert_eq!(fixed[4], 0.0, "an exact zero keeps its code");
    assert_eq!(fixed[5], plain[5]);
}

#[test]
fn non_finite_input_is_refused_and_named() {
    let map = CodeMap::dynamic(false, 8).unwrap();
    let q = Blockwise::new(&map, BlockSize::B256);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut x = data_for(&map, 200_000, 1);
        x[150_000] = bad;
        x[199_999] = bad;
        let mut codes = vec![0u8; q.codes_len(x.len())];
        let mut absmax = vec![0f32; q.scales_len(x.len())];
        let err = q
            .quantize(&x, &mut codes, &mut absmax, QuantRounding::Nearest)
            .unwrap_err();
        assert!(
            matches!(err, QuantError::NonFinite { index: 150_000, .. }),
            "{err}"
        );
        assert!(codes.iter().all(|&c| usize::from(c) < map.len()));
        let r = Rank1::new(&map, &[400, 500]).unwrap();
        let mut codes = vec![0u8; r.codes_len()];
        let mut scales = vec![0f32; r.scales_len()];
        let err = r
            .quantize(&x, &mut codes, &mut scales, QuantRounding::Nearest)
            .unwrap_err();
        assert!(
            matches!(err, QuantError::NonFinite { index: 150_000, .. }),
            "{err}"
        );
    }
}

#[test]
fn a_negative_input_to_a_map_without_negative_values_is_refused_and_named() {
    let unsigned = [
        CodeMap::dynamic(false, 8).unwrap(),
        CodeMap::linear_without_zero(4).unwrap(),
        CodeMap::linear_unsigned(4).unwrap(),
    ];
    for map in &unsigned {
        let q = Blockwise::new(map, BlockSize::B256);
        let r = Rank1::new(map, &[400, 500]).unwrap();
        let mut x = data_for(map, 200_000, 2);
        x[7] = -0.0; // not negative
        let mut codes = vec![0u8; q.codes_len(x.len())];
        let mut absmax = vec![0f32; q.scales_len(x.len())];
        let (mut rcodes, mut scales) = (vec![0u8; r.codes_len()], vec![0f32; r.scales_len()]);
        q.quantize(&x, &mut codes, &mut absmax, QuantRounding::Nearest)
            .unwrap();
        r.quantize(&x, &mut rcodes, &mut scales, QuantRounding::Nearest)
            .unwrap();
        x[150_000] = -5.0;
        x[199_999] = -1e-30;
        let before = (codes.clone(), absmax.clone());
        let err = q
            .quantize(&x, &mut codes, &mut absmax, QuantRounding::Nearest)
            .unwrap_err();
        assert_eq!(
            err,
            QuantError::Negative {
                index: 150_000,
                value: -5.0
            }
        );
        assert_eq!((codes, absmax), before, "nothing written");
        let err = r
            .quantize(&x, &mut rcodes, &mut scales, QuantRounding::Nearest)
            .unwrap_err();
        assert!(
            matches!(err, QuantError::Negative { index: 150_000, .. }),
            "{err}"
        );
    }
    // A map with negative values takes them.
    let map = CodeMap::dynamic(true, 8).unwrap();
    let q = Blockwise::new(&map, BlockSize::B256);
    let x = [-5.0f32, 1.0, 2.0, 3.0];
    let (mut codes, mut absmax) = ([0u8; 4], [0f32; 1]);
    q.quantize(&x, &mut codes, &mut absmax, QuantRounding::Nearest)
        .unwrap();
}

#[test]
fn bad_input_gets_typed_errors() {
    for size in [0usize, 16, 31, 48, 100, 8192, usize::MAX] {
        assert_eq!(BlockSize::new(size), Err(QuantError::BlockSize { size }));
    }
    let map = CodeMap::dynamic(true, 4).unwrap();
    let q = Blockwise::new(&map, BlockSize::B128);
    let x = [0.5f32; 300];
    let mut absmax = [0f32; 3];
    let err = q
        .quantize(&x, &mut [0u8; 149], &mut absmax, QuantRounding::Nearest)
        .unwrap_err();
    assert_eq!(
        err,
        QuantError::Length {
            what: "codes",
            expected: 150,
            actual: 149
        }
    );
    let err = q
        .quantize(&x, &mut [0u8; 150], &mut [0f32; 2], QuantRounding::Nearest)
        .unwrap_err();
    assert_eq!(
        err,
        QuantError::Length {
            what: "absmax",
            expected: 3,
            actual: 2
        }
    );
    assert!(
        q.dequantize(&[0u8; 150], &absmax, &mut [0f32; 301])
            .is_err()
    );
    assert_eq!(
        Rank1::new(&map, &[5]).unwrap_err(),
        QuantError::Rank1Dims { ndim: 1 }
    );
    assert!(matches!(
        Rank1::new(&map, &[5, 0]),
        Err(QuantError::Shape { .. })
    ));
    assert!(matches!(
        Rank1::new(&map, &[usize::MAX, 3]),
        Err(QuantError::Shape { .. })
    ));
    let r = Rank1::new(&map, &[10, 30]).unwrap();
    assert!(matches!(
        r.quantize(
            &x[..299],
            &mut [0u8; 150],
            &mut [0f32; 40],
            QuantRounding::Nearest
        ),
        Err(QuantError::Shape { .. })
    ));
    assert!(matches!(
        LinearGroup::new(1, BlockSize::B64),
        Err(QuantError::Format(_))
    ));
    assert!(matches!(
        Rank1OrBlock::for_shape(&map, &[7], BlockSize::B128),
        Ok(Rank1OrBlock::Block(_))
    ));
    assert!(matches!(
        Rank1OrBlock::for_shape(&map, &[7, 3], BlockSize::B128),
        Ok(Rank1OrBlock::Rank1(_))
    ));
}
