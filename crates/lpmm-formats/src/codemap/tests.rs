//! Every map against its anchor and the brute-force nearest code, and every SIMD kernel against
//! the portable loops, bit for bit.

use super::*;

#[test]
fn shipped_maps_need_one_comparison_after_the_table() {
    for m in [
        CodeMap::dynamic(true, 8).unwrap(),
        CodeMap::dynamic(false, 8).unwrap(),
        CodeMap::dynamic(true, 4).unwrap(),
        CodeMap::dynamic(false, 4).unwrap(),
        CodeMap::linear_signed(8).unwrap(),
        CodeMap::normal_float(4).unwrap(),
    ] {
        assert_eq!(m.scan, 1, "{m:?}");
    }
}

#[test]
fn spec_examples() {
    let m = CodeMap::dynamic(true, 8).unwrap();
    assert_eq!(m.values()[0], -0.992_968_75);
    assert_eq!(m.values()[127], 0.0);
    assert_eq!(m.values()[255], 1.0);
    let u = CodeMap::dynamic(false, 8).unwrap();
    assert_eq!(u.values()[0], 0.0);
    let de4: Vec<f32> = CodeMap::dynamic(true, 4).unwrap().values().to_vec();
    let want = [
        -0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0, 0.0055, 0.0325, 0.0775,
        0.2125, 0.4375, 0.6625, 0.8875, 1.0,
    ];
    for (a, b) in de4.iter().zip(want) {
        assert!((a - b).abs() < 1e-7, "{a} vs {b}");
    }
}

#[test]
fn thresholds_follow_the_tie_rule() {
    // 0.25 is exactly half-way between 0 and 0.5: it goes to 0 (lower magnitude).
    let m = CodeMap::from_values(2, &[-0.5, 0.0, 0.5, 1.0]).unwrap();
    assert_eq!(m.nearest(0.25), 1);
    assert_eq!(m.nearest(0.25f32.next_up()), 2);
    assert_eq!(m.nearest(-0.25), 1);
    assert_eq!(m.nearest((-0.25f32).next_down()), 0);
    assert_eq!(m.nearest(0.75), 2);
    assert_eq!(m.nearest(-2.0), 0);
    assert_eq!(m.nearest(2.0), 3);
    assert_eq!(m.nearest(f32::NAN), 0);
    // Equal magnitudes: the lower code.
    let sym = CodeMap::from_values(1, &[-0.5, 0.5]).unwrap();
    assert_eq!(sym.nearest(0.0), 0);
    assert_eq!(sym.nearest(1e-30), 1);
}

#[test]
fn nearest_agrees_with_brute_force_on_every_map() {
    let maps = [
        CodeMap::dynamic(true, 8).unwrap(),
        CodeMap::dynamic(false, 8).unwrap(),
        CodeMap::normal_float(4).unwrap(),
        CodeMap::linear_signed(8).unwrap(),
        CodeMap::linear_without_zero(4).unwrap(),
    ];
    for m in &maps {
        for k in 0..200_000u32 {
            let y = (k as f32 / 100_000.0 - 1.0) * 1.01 + (k % 7) as f32 * 1e-9;
            let c = m.nearest(y) as usize;
            let d = (f64::from(y) - f64::from(m.values()[c])).abs();
            for (j, &v) in m.values().iter().enumerate() {
                let dj = (f64::from(y) - f64::from(v)).abs();
                assert!(d <= dj, "{y}: code {c} at {d}, but {j} at {dj}");
            }
        }
    }
}

/// The AVX-512 kernels give the portable kernels' bits: every map, every threshold and its
/// neighbours, a sweep over bit patterns (NaN, ±Inf, subnormals, values outside [-1, 1]),
/// several scales including 0, lengths that leave a tail.
#[test]
fn vector_kernels_equal_the_portable_ones() {
    let maps = [
        CodeMap::dynamic(true, 8).unwrap(),
        CodeMap::dynamic(false, 8).unwrap(),
        CodeMap::dynamic(true, 4).unwrap(),
        CodeMap::normal_float(4).unwrap(),
        CodeMap::linear_signed(8).unwrap(),
        CodeMap::linear_unsigned(3).unwrap(),
        CodeMap::linear_without_zero(4).unwrap(),
        CodeMap::from_values(2, &[-1.0, -1e-8, 1e-8, 1.0]).unwrap(),
        CodeMap::from_values(8, &[-1.0, 0.5]).unwrap(),
    ];
    #[cfg(target_arch = "x86_64")]
    let vector = crate::simd::detected() >= crate::simd::Level::Avx512;
    #[cfg(not(target_arch = "x86_64"))]
    let vector = false;
    if !vector {
        eprintln!("no AVX-512 on this CPU: only the portable kernels ran");
    }
    for m in &maps {
        let mut xs: Vec<f32> = m
            .thresholds()
            .iter()
            .chain(m.values())
            .flat_map(|&t| [t.next_down(), t, t.next_up()])
            .collect();
        xs.extend((0..=u32::MAX).step_by(65_537).map(f32::from_bits));
        xs.extend([f32::NAN, f32::INFINITY, -0.0, 1e-45, -1e-45, 1.0, -1.0, 1.5]);
        xs.push(0.25); // a tail of 3 lanes past the last whole vector
        xs.push(-0.75);
        xs.push(0.125);
        let bits: Vec<u32> = (0..xs.len() as u32)
            .map(|k| k.wrapping_mul(0x9E37_79B9) ^ (k >> 3))
            .chain([0, u32::MAX, 1 << 31])
            .collect();
        let codes: Vec<u8> = (0..xs.len()).map(|k| (k * 37 % 256) as u8).collect();
        for absmax in [1.0f32, 0.0, 2.5, 1e-30, 3e38] {
            let (mut a, mut b) = (vec![0u8; xs.len()], vec![0u8; xs.len()]);
            m.nearest_scaled_portable(&xs, absmax, &mut a);
            for (j, (&x, &c)) in xs.iter().zip(&a).enumerate().take(64) {
                let y = if absmax == 0.0 { 0.0 } else { x / absmax };
                assert_eq!(c, m.nearest(y), "element {j}");
            }
            let (mut sa, mut sb) = (vec![0u8; xs.len()], vec![0u8; xs.len()]);
            m.stochastic_scaled_portable(&xs, absmax, &bits, &mut sa);
            let (mut da, mut db) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
            m.decode_scaled_portable(&codes, absmax, &mut da);
            #[cfg(target_arch = "x86_64")]
            if crate::simd::detected() >= crate::simd::Level::Avx2 {
                let (mut c2, mut d2) = (vec![0u8; xs.len()], vec![0f32; xs.len()]);
                let mut s2 = vec![0xAAu8; xs.len()];
                // SAFETY: AVX2 and FMA were detected on this CPU.
                unsafe {
                    m.nearest_scaled_avx2(&xs, absmax, &mut c2);
                    m.decode_scaled_avx2(&codes, absmax, &mut d2);
                    m.stochastic_scaled_avx2(&xs, absmax, &bits, &mut s2);
                }
                assert_eq!(a, c2, "AVX2 nearest, {m:?}, absmax {absmax}");
                assert_eq!(sa, s2, "AVX2 stochastic, {m:?}, absmax {absmax}");
                let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits_of(&da), bits_of(&d2), "AVX2 decode, absmax {absmax}");
            }
            #[cfg(target_arch = "x86_64")]
            if vector {
                // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
                unsafe {
                    m.nearest_scaled_avx512(&xs, absmax, &mut b);
                    m.stochastic_scaled_avx512(&xs, absmax, &bits, &mut sb);
                    m.decode_scaled_avx512(&codes, absmax, &mut db);
                }
                assert_eq!(a, b, "nearest, {m:?}, absmax {absmax}");
                assert_eq!(sa, sb, "stochastic, {m:?}, absmax {absmax}");
                let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits_of(&da), bits_of(&db), "decode, absmax {absmax}");
                // Both AVX-512 decoders on their own: gathers, and byte tables (VBMI).
                // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
                unsafe { m.decode_scaled_gather(&codes, absmax, &mut db) };
                assert_eq!(bits_of(&da), bits_of(&db), "gather decode, absmax {absmax}");
                // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
                unsafe { m.nearest_scaled_gather(&xs, absmax, &mut b) };
                assert_eq!(a, b, "gather nearest, {m:?}, absmax {absmax}");
                b.fill(0xAA);
                // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
                let done = unsafe { m.nearest_small_avx512(&xs, &[absmax], xs.len(), &mut b) };
                let small = m.values.len() <= 16;
                assert_eq!(done, if small { xs.len() / 16 * 16 } else { 0 });
                assert_eq!(a[..done], b[..done], "register-table nearest, {m:?}");
                // The word-table kernels (AVX-512 without VBMI) on their own.
                b.fill(0xAA);
                // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
                let done = unsafe { m.nearest_scaled_words(&xs, &[absmax], xs.len(), &mut b) };
                assert_eq!(
                    done,
                    if m.keys.is_some() {
                        xs.len() / 32 * 32
                    } else {
                        0
                    }
                );
                assert_eq!(
                    a[..done],
                    b[..done],
                    "word-table nearest, {m:?}, absmax {absmax}"
                );
                db.fill(f32::NAN);
                // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
                let done =
                    unsafe { m.decode_scaled_words(&codes, &[absmax], codes.len(), &mut db) };
                assert_eq!(done, codes.len() / 32 * 32);
                assert_eq!(
                    bits_of(&da[..done]),
                    bits_of(&db[..done]),
                    "word-table decode"
                );
                // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
                unsafe { m.stochastic_scaled_gather(&xs, absmax, &bits, &mut sb) };
                assert_eq!(sa, sb, "gather stochastic, {m:?}, absmax {absmax}");
                if std::is_x86_feature_detected!("avx512vbmi") {
                    sb.fill(0xAA);
                    // SAFETY: AVX-512 F/BW/VL and VBMI were detected on this CPU.
                    let done = unsafe {
                        m.stochastic_scaled_vbmi(&xs, &[absmax], xs.len(), &bits, &mut sb)
                    };
                    let runs = m.scan == 1 || m.grid.is_some();
                    assert_eq!(done, if runs { xs.len() / 64 * 64 } else { 0 });
                    assert_eq!(sa[..done], sb[..done], "VBMI stochastic, {m:?}");
                    b.fill(0xAA);
                    // SAFETY: AVX-512 F/BW/VL and VBMI were detected on this CPU.
                    let done = unsafe { m.nearest_scaled_vbmi(&xs, &[absmax], xs.len(), &mut b) };
                    assert_eq!(done, if m.scan == 1 { xs.len() / 64 * 64 } else { 0 });
                    assert_eq!(a[..done], b[..done], "VBMI nearest, {m:?}");
                    db.fill(f32::NAN);
                    // SAFETY: AVX-512 F/BW/VL and VBMI were detected on this CPU.
                    let done =
                        unsafe { m.decode_scaled_vbmi(&codes, &[absmax], codes.len(), &mut db) };
                    assert_eq!(done, codes.len() / 64 * 64);
                    assert!(done > 0);
                    assert_eq!(bits_of(&da[..done]), bits_of(&db[..done]), "VBMI decode");
                } else {
                    eprintln!("no AVX-512 VBMI on this CPU: its decoder did not run");
                }
            }
            let _ = (&mut b, &mut sb, &mut db);
        }
    }
}

/// Uniform grids are recognised, and the VBMI stochastic rounding's search-free path for
/// them gives the codes of [`CodeMap::stochastic`]: on values in range (where it runs), on
/// the grid's values and their neighbours, and on NaN and out-of-range lanes (which it hands
/// over to the search).
#[test]
fn uniform_grids_round_stochastically_without_a_search() {
    let cases = [
        (CodeMap::linear_signed(8).unwrap(), Some((127, 127.0))),
        (CodeMap::linear_signed(2).unwrap(), Some((1, 1.0))),
        (CodeMap::linear_unsigned(8).unwrap(), Some((0, 255.0))),
        (CodeMap::linear_unsigned(3).unwrap(), Some((0, 7.0))),
        (CodeMap::dynamic(true, 8).unwrap(), None),
        (CodeMap::linear_without_zero(4).unwrap(), None),
        (
            CodeMap::from_values(2, &[-1.0, 0.0, 0.5, 1.0]).unwrap(),
            None,
        ),
    ];
    for (map, grid) in &cases {
        assert_eq!(map.grid, *grid, "{map:?}");
    }
    #[cfg(target_arch = "x86_64")]
    {
        if !(crate::simd::detected() >= crate::simd::Level::Avx512
            && std::is_x86_feature_detected!("avx512vbmi"))
        {
            eprintln!("no AVX-512 VBMI on this CPU: the grid path did not run");
            return;
        }
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for (map, grid) in &cases {
            let Some((_, steps)) = *grid else { continue };
            let low = map.values()[0];
            // 64-lane groups: uniform in the map's range; the grid's values and their
            // neighbours; then a group with one NaN, one below the range and one above.
            let mut xs: Vec<f32> = (0..64 * 40)
                .map(|_| low + (1.0 - low) * (next() >> 40) as f32 / (1u64 << 24) as f32)
                .collect();
            for &v in map.values() {
                xs.extend([v.next_down(), v, v.next_up()]);
            }
            xs.resize(xs.len().next_multiple_of(64), 0.5);
            xs.extend([f32::NAN, low - 0.25, 1.5]);
            xs.resize(xs.len().next_multiple_of(64), -0.0);
            let bits: Vec<u32> = xs.iter().map(|_| next() as u32).collect();
            for absmax in [1.0f32, 1.0 / steps, 3.0] {
                let mut want = vec![0u8; xs.len()];
                map.stochastic_scaled_portable(&xs, absmax, &bits, &mut want);
                let mut got = vec![0xAAu8; xs.len()];
                // SAFETY: AVX-512 F/BW/VL and VBMI were detected on this CPU.
                let done = unsafe {
                    map.stochastic_scaled_vbmi(&xs, &[absmax], xs.len(), &bits, &mut got)
                };
                assert_eq!(done, xs.len());
                assert_eq!(got, want, "{map:?}, absmax {absmax}");
            }
            // The search-free path itself: it takes a group of values in range and hands a
            // group with a NaN, or with an estimate rounded across an integer, to the search.
            let (o, steps) = grid.unwrap();
            let take = |lanes: &[f32]| {
                let y = std::array::from_fn(|m| {
                    // SAFETY: AVX-512 F was detected; 16 values per register.
                    unsafe { std::arch::x86_64::_mm512_loadu_ps(lanes[16 * m..].as_ptr()) }
                });
                let mut out = [0u8; 64];
                // SAFETY: AVX-512 F/BW/VL and VBMI were detected on this CPU.
                unsafe { map.stochastic_grid64(o, steps, y, &bits[..64], &mut out) }
            };
            assert!(take(&xs[..64]), "{map:?}: values in range");
            let mut nan = xs[..64].to_vec();
            nan[17] = f32::NAN;
            assert!(!take(&nan), "{map:?}: NaN");
            // A lane below the map's range: the clamped estimate's value is above it.
            let mut under = xs[..64].to_vec();
            under[40] = low - 0.25;
            assert!(!take(&under), "{map:?}: below the range");
        }
    }
}

/// The AVX2 and AVX-512 (without VBMI) stochastic rounding on uniform grids: the search-free
/// groups of 8 and 16 lanes give the codes of [`CodeMap::stochastic`] (values in range, the grid's
/// values and their neighbours, NaN and out-of-range lanes), and the search-free path is the one
/// that runs on values in range (it hands a group with a NaN or a value below the range over).
#[test]
fn uniform_grids_round_stochastically_on_avx2_and_avx512() {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::simd::{Level, detected};
        if detected() < Level::Avx2 {
            eprintln!("no AVX2 on this CPU: the grid kernels did not run");
            return;
        }
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let maps = [
            CodeMap::linear_signed(8).unwrap(),
            CodeMap::linear_signed(2).unwrap(),
            CodeMap::linear_unsigned(8).unwrap(),
            CodeMap::linear_unsigned(3).unwrap(),
        ];
        for map in &maps {
            let (o, steps) = map.grid.expect("a uniform grid");
            let low = map.values()[0];
            let mut xs: Vec<f32> = (0..16 * 50)
                .map(|_| low + (1.0 - low) * (next() >> 40) as f32 / (1u64 << 24) as f32)
                .collect();
            for &v in map.values() {
                xs.extend([v.next_down(), v, v.next_up()]);
            }
            xs.extend([f32::NAN, low - 0.25, 1.5, f32::INFINITY, -0.0, 0.3]);
            let bits: Vec<u32> = xs
                .iter()
                .map(|_| next() as u32)
                .chain([0, u32::MAX])
                .collect();
            for absmax in [1.0f32, 1.0 / steps, 3.0, 0.0] {
                let mut want = vec![0u8; xs.len()];
                map.stochastic_scaled_portable(&xs, absmax, &bits, &mut want);
                let mut got = vec![0xAAu8; xs.len()];
                // SAFETY: AVX2 and FMA were detected on this CPU.
                unsafe { map.stochastic_scaled_avx2(&xs, absmax, &bits, &mut got) };
                assert_eq!(got, want, "AVX2, {map:?}, absmax {absmax}");
                if detected() >= Level::Avx512 {
                    got.fill(0xAA);
                    // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
                    unsafe { map.stochastic_scaled_gather(&xs, absmax, &bits, &mut got) };
                    assert_eq!(got, want, "AVX-512, {map:?}, absmax {absmax}");
                }
            }
            // The search-free groups themselves: taken in range, handed over otherwise.
            let take8 = |lanes: &[f32]| {
                let mut out = [0u8; 8];
                // SAFETY: AVX2 and FMA were detected; 8 values are loaded.
                unsafe {
                    let y = std::arch::x86_64::_mm256_loadu_ps(lanes.as_ptr());
                    map.stochastic_grid8(o, steps, y, &bits[..8], &mut out)
                }
            };
            assert!(take8(&xs[..8]), "{map:?}: values in range");
            let mut bad = xs[..8].to_vec();
            bad[3] = f32::NAN;
            assert!(!take8(&bad), "{map:?}: NaN");
            bad[3] = low - 0.25;
            assert!(!take8(&bad), "{map:?}: below the range");
            if detected() >= Level::Avx512 {
                let take16 = |lanes: &[f32]| {
                    let mut out = [0u8; 16];
                    // SAFETY: AVX-512 F/BW/VL were detected; 16 values are loaded.
                    unsafe {
                        let y = std::arch::x86_64::_mm512_loadu_ps(lanes.as_ptr());
                        map.stochastic_grid16(o, steps, y, &bits[..16], &mut out)
                    }
                };
                assert!(take16(&xs[..16]), "{map:?}: values in range");
                let mut bad = xs[..16].to_vec();
                bad[11] = f32::NAN;
                assert!(!take16(&bad), "{map:?}: NaN");
                bad[11] = low - 0.25;
                assert!(!take16(&bad), "{map:?}: below the range");
            }
        }
    }
}

/// The run-of-blocks kernels give, at every SIMD level, the codes and values of the
/// one-block kernels called block by block (blocks of 7 to 256, partial last blocks,
/// all-zero blocks).
#[test]
fn run_of_blocks_kernels_equal_block_by_block() {
    use crate::simd::{Level, force};
    let maps = [
        CodeMap::dynamic(true, 8).unwrap(),
        CodeMap::dynamic(false, 8).unwrap(),
        CodeMap::linear_signed(8).unwrap(),
        CodeMap::dynamic(true, 4).unwrap(),
        CodeMap::from_values(8, &[-1.0, 0.5]).unwrap(),
    ];
    let n = 1000;
    let xs: Vec<f32> = (0..n)
        .map(|k| ((k as f32 * 0.618).fract() - 0.5) * (1.0 + (k % 7) as f32))
        .collect();
    let bits: Vec<u32> = (0..n as u32).map(|k| k.wrapping_mul(0x9E37_79B9)).collect();
    let codes: Vec<u8> = (0..n).map(|k| (k * 37 % 256) as u8).collect();
    let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for m in &maps {
        for block in [16usize, 32, 48, 64, 256, 7] {
            let scales: Vec<f32> = xs
                .chunks(block)
                .enumerate()
                .map(|(k, c)| {
                    let a = c.iter().fold(0f32, |a, v| a.max(v.abs()));
                    if k % 5 == 3 { 0.0 } else { a }
                })
                .collect();
            let mut want = (vec![0u8; n], vec![0u8; n], vec![0f32; n]);
            for (k, &a) in scales.iter().enumerate() {
                let r = k * block..((k + 1) * block).min(n);
                m.nearest_scaled_portable(&xs[r.clone()], a, &mut want.0[r.clone()]);
                let (x, b) = (&xs[r.clone()], &bits[r.clone()]);
                m.stochastic_scaled_portable(x, a, b, &mut want.1[r.clone()]);
                m.decode_scaled_portable(&codes[r.clone()], a, &mut want.2[r]);
            }
            for level in [
                Level::Portable,
                Level::Avx2,
                Level::Avx512,
                Level::Avx512Vbmi,
            ] {
                force(Some(level));
                let mut got = (vec![0xAAu8; n], vec![0xAAu8; n], vec![f32::NAN; n]);
                m.nearest_blocks(&xs, &scales, block, &mut got.0);
                m.stochastic_blocks(&xs, &scales, block, &bits, &mut got.1);
                m.decode_blocks(&codes, &scales, block, &mut got.2);
                assert_eq!(got.0, want.0, "nearest {m:?} block {block} {level:?}");
                assert_eq!(got.1, want.1, "stochastic {m:?} block {block} {level:?}");
                assert_eq!(
                    bits_of(&got.2),
                    bits_of(&want.2),
                    "decode {block} {level:?}"
                );
            }
        }
    }
    force(None);
}

/// Why the quantizers divide by the absmax instead of multiplying by its reciprocal
/// (bitsandbytes' CUDA kernel multiplies by `1 / absmax` once per block): `x * (1 / a)`
/// differs from `x / a` by an ulp for some inputs, and where the quotient lands on a
/// decision threshold that moves the nearest code. The search below finds such inputs for
/// bitsandbytes' own 8-bit maps, so the reciprocal would not keep the exact-nearest
/// guarantee (docs/FORMATS.md §4): every backend keeps one IEEE division per element.
#[test]
fn a_reciprocal_would_move_codes_across_thresholds() {
    for map in [
        CodeMap::dynamic(true, 8).unwrap(),
        CodeMap::dynamic(false, 8).unwrap(),
    ] {
        let mut moved = 0;
        'search: for &t in map.thresholds() {
            if t <= 0.0 {
                continue;
            }
            for a in [3.0f32, 0.7, 1.1e-3, 0.123_456_7, 5e-6, 77.7] {
                let r = 1.0 / a;
                // Inputs whose exact quotient lies within a few ulps of the threshold.
                let x0 = t * a;
                let mut x = x0;
                for _ in 0..8 {
                    x = x.next_down();
                }
                for _ in 0..16 {
                    let (exact, fast) = (map.nearest(x / a), map.nearest(x * r));
                    if exact != fast {
                        moved += 1;
                        if moved >= 3 {
                            break 'search;
                        }
                    }
                    x = x.next_up();
                }
            }
        }
        assert!(
            moved >= 3,
            "{map:?}: the reciprocal gave the same codes ({moved} moved)"
        );
    }
}

/// The VBMI kernel's key table gives `nearest` on every bucket: every top-16-bit pattern of
/// a magnitude below 2 with low halves 0, 0x8000, 0xFFFF and a pseudo-random one, and every
/// threshold and value with its neighbours, in runs of 64 (the keyed path's unit).
#[test]
fn keyed_nearest_equals_nearest_on_every_bucket() {
    let maps = [
        CodeMap::dynamic(true, 8).unwrap(),
        CodeMap::dynamic(false, 8).unwrap(),
        CodeMap::linear_signed(8).unwrap(),
        CodeMap::dynamic(true, 4).unwrap(),
    ];
    for m in &maps {
        assert!(m.keys.is_some(), "{m:?} has no key table");
    }
    // A map whose buckets need more than seven mantissa bits has none (the gather path).
    let dense = CodeMap::from_values(8, &[0.5, 0.5f32.next_up(), 0.5f32.next_up().next_up()]);
    assert!(dense.unwrap().keys.is_none());
    #[cfg(target_arch = "x86_64")]
    if crate::simd::detected() < crate::simd::Level::Avx512 {
        eprintln!("no AVX-512 on this CPU: the keyed kernels did not run");
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    return;
    #[cfg(target_arch = "x86_64")]
    for m in &maps {
        let mut ys: Vec<f32> = Vec::new();
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for h in 0..=0xFFFFu32 {
            if h & 0x7FFF >= 0x4000 {
                continue;
            }
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            for low in [0, 0x8000, 0xFFFF, state as u32 & 0xFFFF] {
                ys.push(f32::from_bits(h << 16 | low));
            }
        }
        for &t in m.thresholds().iter().chain(m.values()) {
            ys.extend([t.next_down(), t, t.next_up()]);
        }
        ys.resize(ys.len().div_ceil(64) * 64, 0.25);
        let check = |out: &[u8], kernel: &str| {
            for (&y, &c) in ys.iter().zip(out) {
                assert_eq!(
                    c,
                    m.nearest(y),
                    "{kernel} {m:?}: y {y} ({:#010x})",
                    y.to_bits()
                );
            }
        };
        let mut out = vec![0xAAu8; ys.len()];
        // SAFETY: AVX-512 F/BW/VL were detected on this CPU.
        let done = unsafe { m.nearest_scaled_words(&ys, &[1.0], ys.len(), &mut out) };
        assert_eq!(done, ys.len());
        check(&out, "word tables");
        if !std::is_x86_feature_detected!("avx512vbmi") {
            eprintln!("no AVX-512 VBMI on this CPU: its keyed kernel did not run");
            continue;
        }
        out.fill(0xAA);
        // SAFETY: AVX-512 F/BW/VL and VBMI were detected on this CPU.
        let done = unsafe { m.nearest_scaled_vbmi(&ys, &[1.0], ys.len(), &mut out) };
        assert_eq!(done, ys.len());
        check(&out, "VBMI");
    }
}

/// The grid values the vector kernels compute by a reciprocal and one correction are the IEEE
/// quotients for every numerator and step count a grid of at most 256 codes can have, and for
/// the extremes of each (a failure here would only send such a map to the table paths:
/// `uniform_grid` checks its codes).
#[test]
fn grid_values_by_reciprocal_are_the_quotients() {
    let mut pairs = 0;
    for steps in 1..=255 {
        let l = steps as f32;
        for k in -255..=255 {
            let (want, got) = (k as f32 / l, super::search::grid_value(k, l));
            assert_eq!(got.to_bits(), want.to_bits(), "{k} / {steps}");
            pairs += 1;
        }
    }
    assert_eq!(pairs, 255 * 511);
    // A plain product by the reciprocal is not the quotient for every pair: the correction is
    // what makes it exact.
    let off = (1..=255)
        .flat_map(|s| (-255..=255).map(move |k| (k, s as f32)))
        .filter(|&(k, l)| (k as f32 * (1.0 / l)).to_bits() != (k as f32 / l).to_bits())
        .count();
    assert!(off > 0);
}

#[test]
fn accelerated_search_equals_a_plain_binary_search() {
    let maps = [
        CodeMap::dynamic(true, 8).unwrap(),
        CodeMap::dynamic(false, 8).unwrap(),
        CodeMap::dynamic(true, 4).unwrap(),
        CodeMap::linear_signed(8).unwrap(),
        CodeMap::from_values(2, &[-1.0, -1e-8, 1e-8, 1.0]).unwrap(),
    ];
    for m in &maps {
        // Every threshold and its f32 neighbours, plus a sweep over bit patterns.
        let mut ys: Vec<f32> = m
            .thresholds()
            .iter()
            .flat_map(|&t| [t.next_down(), t, t.next_up()])
            .collect();
        ys.extend(
            (0..=u32::MAX)
                .step_by(9973)
                .map(f32::from_bits)
                .filter(|v| !v.is_nan()),
        );
        ys.extend([f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0]);
        for y in ys {
            let want = m.thresholds().partition_point(|&t| t <= y) as u8;
            assert_eq!(m.nearest(y), want, "{y:e} ({:#x})", y.to_bits());
            let lo = m.values().partition_point(|&v| v <= y).saturating_sub(1);
            let s = m.stochastic(y, u32::MAX);
            assert_eq!(usize::from(s), lo, "stochastic lower neighbour of {y:e}");
        }
    }
}

#[test]
fn bad_maps_are_rejected() {
    assert_eq!(
        CodeMap::from_values(9, &[0.0, 1.0]),
        Err(FormatError::BitWidth { bits: 9 })
    );
    assert_eq!(
        CodeMap::from_values(1, &[0.0, 0.5, 1.0]),
        Err(FormatError::CodeMapLength { bits: 1, len: 3 })
    );
    assert_eq!(
        CodeMap::from_values(2, &[0.0, 0.5, 0.5]),
        Err(FormatError::CodeMapUnsorted {
            index: 2,
            value: 0.5
        })
    );
    assert!(matches!(
        CodeMap::from_values(2, &[0.0, f32::NAN]),
        Err(FormatError::CodeMapOutOfRange { index: 1, .. })
    ));
    assert!(matches!(
        CodeMap::from_values(2, &[0.0, 1.5]),
        Err(FormatError::CodeMapOutOfRange { index: 1, .. })
    ));
    assert!(CodeMap::linear_signed(1).is_err());
    assert_eq!(
        CodeMap::from_values(2, &[-1.0, 2f32.powi(-60), 1.0]),
        Err(FormatError::CodeMapSpread { index: 1 })
    );
    let m = CodeMap::dynamic(true, 8).unwrap();
    assert_eq!(m, m.clone());
    assert_eq!(m, CodeMap::from_values(8, m.values()).unwrap());
    assert_ne!(m, CodeMap::dynamic(false, 8).unwrap());
    assert!(CodeMap::dynamic_with_exponent_bits(false, 3, 8).is_err());
}
