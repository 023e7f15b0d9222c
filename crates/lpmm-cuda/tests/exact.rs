//! kernels/exact.cuh's shortcuts and the specialized steps' code search, as the kernels compute
//! them (the same C++, built for the host: `lpmm_cuda::testing`), against the operations they
//! stand for, on the inputs most likely to expose a wrong bit: every significand of a binade,
//! the ends of each shortcut's range, rounding boundaries, every key of every map and its
//! neighbours, bucket edges, zeros, subnormals. docs/FORMATS.md ("Exact shortcuts of the CUDA
//! specialized steps") has the arguments these check.

use lpmm_backend::plans::{buckets, plans};
use lpmm_cuda::testing;
use lpmm_formats::bf16;
use lpmm_formats::float::bf16_stochastic;
use lpmm_optim::MapKind;

/// A small deterministic generator (xorshift64*), so that the inputs are the same every run.
struct Bits(u64);

impl Bits {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn u32(&mut self) -> u32 {
        (self.next() >> 32) as u32
    }

    /// A float of [1, 2).
    fn significand(&mut self) -> f32 {
        f32::from_bits(0x3F80_0000 | (self.u32() & 0x7F_FFFF))
    }
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits()
}

/// The quotient by a divisor from its IEEE reciprocal and one correction: for every significand
/// of a dividend (a whole binade, above and below the divisor's), a divisor of every kind (1, the
/// largest significand, random ones), and the ends of the ranges the kernels use it on, the IEEE
/// quotient's bits.
#[test]
fn the_quotient_is_the_ieee_quotient_on_its_range() {
    let mut rng = Bits(0x5EED);
    let mut divisors: Vec<f32> = vec![1.0, f32::from_bits(0x3FFF_FFFF), 1.5, 1.0 + f32::EPSILON];
    divisors.extend((0..12).map(|_| rng.significand()));
    let mut checked = 0u64;
    for &b in &divisors {
        let rb = 1.0 / b;
        for m in 0..1u32 << 23 {
            let a = f32::from_bits(0x3F80_0000 | m);
            // a / b in (0.5, 2), and a scaled below b (quotients of a block's absmax are at most 1).
            for a in [a, a * 0.25, -a * 0.5] {
                let q = testing::quotient(a, b, rb);
                assert!(same(q, a / b), "{a:e} / {b:e}: {q:e}, IEEE {:e}", a / b);
                checked += 1;
            }
        }
    }
    // The ends of the ranges: divisors 2^-70 and 2^120 (nearest rounding's absmax), 2^-40 and
    // 2^40 (stochastic rounding's absmax, Adam's bias correction), with dividends from the
    // least exact one (divisor 2^-30, 2^-60) to the divisor.
    for (lo, hi, tiny) in [(-70, 120, -30), (-40, 40, -60)] {
        for e in [lo, lo + 1, 0, hi - 1, hi] {
            for _ in 0..20_000 {
                let b = rng.significand() * 2f32.powi(e);
                let rb = 1.0 / b;
                // |a| in [b 2^tiny, b): the exact range.
                let down = (rng.u32() % (-tiny as u32)) as i32;
                let a = b * rng.significand() * 0.5 * 2f32.powi(-down);
                let a = if rng.u32() & 1 == 0 { a } else { -a };
                let q = testing::quotient(a, b, rb);
                assert!(same(q, a / b), "{a:e} / {b:e}: {q:e}, IEEE {:e}", a / b);
                checked += 1;
            }
        }
    }
    assert!(checked > 100_000_000);
}

/// The inverse of odd `x` modulo 2^64 (Newton's iteration doubles the correct low bits).
fn inverse_odd(x: u64) -> u64 {
    let mut y = x;
    for _ in 0..6 {
        y = y.wrapping_mul(2u64.wrapping_sub(x.wrapping_mul(y)));
    }
    y
}

/// The finite part of the quotient's proof (docs/FORMATS.md, "Quotient by a shared divisor"):
/// with the divisor's significand b = B 2^-23 in (1, 2) and the quotient x = a / b in [1, 2), the
/// value the last fma rounds is within 7 2^-47 / b of x, and x lies at N 2^-47 / b from a rounding
/// midpoint m = M 2^-24 (M odd; N = A 2^24 - B M for a = A 2^-23, never 0), so the result can
/// differ from RN(x) only where |N| <= 6. For each of the 2^23 - 1 divisors and each such N, the
/// midpoints and dividends (B M = A 2^24 - N fixes M modulo 2^(24 - t), t = B's trailing zeros)
/// are computed here, and the kernels' quotient of every one is the IEEE quotient.
#[test]
fn the_quotients_hard_cases_are_all_exact() {
    let mut checked = 0u64;
    for low in 1..1u32 << 23 {
        let big_b = (1u64 << 23) | u64::from(low);
        let b = f32::from_bits(0x3F80_0000 | low);
        let rb = 1.0 / b;
        let t = big_b.trailing_zeros();
        let bits = 24 - t;
        let mask = (1u64 << bits) - 1;
        let inv = inverse_odd(big_b >> t) & mask;
        for n in -6i64..=6 {
            if n == 0 || n % (1 << t) != 0 {
                continue;
            }
            let residue = ((-(n >> t)).rem_euclid(1 << bits) as u64 * inv) & mask;
            for k in 0..1u64 << t {
                let big_m = (1u64 << 24) + residue + (k << bits);
                if big_m & 1 == 0 || big_m >= 1 << 25 {
                    continue;
                }
                let num = big_b as i64 * big_m as i64 + n;
                assert_eq!(num & 0xFF_FFFF, 0, "B {big_b} M {big_m} N {n}");
                let big_a = (num >> 24) as u64;
                // x in [1, 2) and a a float (an even A from 2^24 up: a in [2, 4)).
                if big_a < big_b || big_a >= 2 * big_b || (big_a >= 1 << 24 && big_a & 1 == 1) {
                    continue;
                }
                let a = big_a as f32 * 2f32.powi(-23);
                assert_eq!(f64::from(a), big_a as f64 * 2f64.powi(-23));
                let q = testing::quotient(a, b, rb);
                assert!(same(q, a / b), "{a:e} / {b:e}: {q:e}, IEEE {:e}", a / b);
                checked += 1;
            }
        }
    }
    assert!(checked > 30_000_000, "{checked} hard cases");
}

/// Below the exact range a quotient is not the IEEE one, but small: at most 2^-28 where the exact
/// one is below 2^-30 (2^-58 below 2^-60), with the dividends and divisors that push it
/// furthest (subnormal dividends, the smallest divisors), so a nearest code is 0's and a
/// stochastic one the same for every draw (plans.rs `buckets` checks the maps for it).
#[test]
fn a_quotient_below_the_exact_range_stays_small() {
    let mut rng = Bits(7);
    for (lo, hi, tiny) in [(-70i32, 120i32, -30i32), (-40, 40, -60)] {
        let bound = 2f32.powi(tiny + 2);
        for e in [lo, lo + 1, (lo + hi) / 2, hi] {
            for _ in 0..200_000 {
                let b = rng.significand() * 2f32.powi(e);
                let rb = 1.0 / b;
                // |a| < b 2^tiny, down to the subnormals.
                let a = match rng.u32() % 4 {
                    0 => f32::from_bits(rng.u32() & 0x807F_FFFF),
                    1 => b * 2f32.powi(tiny) * rng.significand() * 0.49,
                    _ => {
                        let d = rng.u32() % 160;
                        b * 2f32.powi(tiny) * 2f32.powi(-(d as i32)) * rng.significand() * 0.5
                    }
                };
                if a.abs() >= b * 2f32.powi(tiny) {
                    continue;
                }
                let q = testing::quotient(a, b, rb);
                assert!(
                    q.abs() <= bound && (a / b).abs() <= 2f32.powi(tiny),
                    "{a:e} / {b:e}: {q:e}"
                );
            }
        }
    }
    // Zeros: +0 gives +0 (Adam's roots), and no quotient of a zero is a NaN.
    assert!(same(testing::quotient(0.0, 3.0, 1.0 / 3.0), 0.0));
    assert_eq!(testing::quotient(-0.0, 3.0, 1.0 / 3.0), 0.0);
}

/// Adam's root over its bias correction: every root of a normal or subnormal second moment
/// (sampled across every binade) over corrections from 2^-40 to 2^40 is the IEEE quotient.
#[test]
fn adams_scaled_root_is_the_ieee_quotient() {
    let mut rng = Bits(11);
    let mut corrections: Vec<f32> = vec![2f32.powi(-40), 2f32.powi(40), 1.0, 0.031622775];
    corrections.extend((0..6).map(|_| rng.significand() * 2f32.powi((rng.u32() % 81) as i32 - 40)));
    for &b in &corrections {
        let rb = 1.0 / b;
        for e in -149..128 {
            for _ in 0..2_000 {
                let v = if e == -149 {
                    f32::from_bits(rng.u32() & 0x7F_FFFF)
                } else {
                    rng.significand() * 2f32.powi(e)
                };
                if !v.is_finite() {
                    continue;
                }
                let a = v.sqrt();
                let q = testing::quotient(a, b, rb);
                assert!(
                    same(q, a / b),
                    "sqrt({v:e}) / {b:e}: {q:e}, IEEE {:e}",
                    a / b
                );
            }
        }
    }
}

/// bf16 rounding without its non-finite cases: to nearest for |x| up to 0x7F7F7FFF, and
/// stochastically for |x| up to 0x7F7EFFFF, the reference's bits (half's `from_f32`; lpmm-formats'
/// `bf16_stochastic`) for every top half with the low halves around each rounding boundary, and
/// a sample of all bit patterns.
#[test]
fn bf16_rounding_of_finite_values_is_the_references() {
    let mut rng = Bits(3);
    let mut draws = Bits(4);
    let lows = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF];
    let mut check = |b: u32| {
        let x = f32::from_bits(b);
        if b & 0x7FFF_FFFF <= 0x7F7F_7FFF {
            let got = testing::bf16(x, 0, false) >> 16;
            assert_eq!(got, u32::from(bf16::from_f32(x).to_bits()), "{b:#010x}");
        }
        if b & 0x7FFF_FFFF <= 0x7F7E_FFFF {
            for r in [
                0,
                0xFFFF_0000,
                draws.u32() & 0xFFFF_0000,
                (b & 0xFFFF) << 16,
            ] {
                let got = testing::bf16(x, r, true) >> 16;
                let want = u32::from(bf16_stochastic(x, r).to_bits());
                assert_eq!(got, want, "{b:#010x}, draw {r:#010x}");
            }
        }
    };
    for top in 0..0x10000u32 {
        for low in lows {
            check(top << 16 | low);
        }
    }
    for _ in 0..4_000_000 {
        check(rng.u32());
    }
}

/// The code search of every map a plan quantizes with, by its rounding and buckets: the count
/// from the bucket table plus one comparison is CodeMap's code for every key of the map and its
/// neighbours, both ends of every bucket, zeros, the smallest magnitudes and a sample of [-1, 1];
/// stochastically with the extreme draws and random ones.
#[test]
fn the_code_search_is_codemaps() {
    let mut rng = Bits(5);
    let mut seen = Vec::new();
    for plan in plans() {
        for f in plan.formats.iter().flatten() {
            let Some(kind) = f.map() else { continue };
            let linear = buckets(*f) == Some(1);
            let key = (kind, f.stochastic(), linear);
            if seen.contains(&key) {
                continue;
            }
            seen.push(key);
            let map = kind.shared();
            let id = MapKind::ALL.iter().position(|&m| m == kind).unwrap() as u32;
            let keys = if f.stochastic() {
                map.values()
            } else {
                map.thresholds()
            };
            let mut ys: Vec<f32> = vec![0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, 2e-31, -2e-31];
            for &k in keys {
                let b = k.to_bits();
                for d in [-2i64, -1, 0, 1, 2] {
                    ys.push(f32::from_bits((i64::from(b) + d) as u32));
                }
            }
            // Both ends of every bucket: the logarithmic buckets' edges (every top-16-bit step
            // of the magnitudes 2^-31 .. 1) and the linear ones' (RN(128 y + 128) steps).
            for h in 0x3000u32..=0x3F80 {
                for s in [0, 0x8000_0000] {
                    ys.push(f32::from_bits(s | h << 16));
                    ys.push(f32::from_bits(s | (h << 16).wrapping_sub(1)));
                }
            }
            for n in 0..=256 {
                let edge = (n as f32 - 128.5) / 128.0;
                for d in [-1i32, 0, 1] {
                    ys.push(f32::from_bits((edge.to_bits() as i32 + d) as u32));
                }
            }
            for _ in 0..200_000 {
                ys.push(rng.significand() - 1.0 + if rng.u32() & 1 == 0 { 0.0 } else { -1.0 });
            }
            ys.retain(|y| y.abs() <= 1.0);
            let n = ys.len();
            let rs: Vec<u32> = (0..n)
                .map(|i| match i % 3 {
                    0 => 0,
                    1 => 0xFFFF_0000,
                    _ => rng.u32() & 0xFFFF_0000,
                })
                .collect();
            let got = testing::codes(id, f.stochastic(), linear, &ys, &rs);
            for i in 0..n {
                let want = if f.stochastic() {
                    map.stochastic(ys[i], rs[i])
                } else {
                    map.nearest(ys[i])
                };
                assert_eq!(
                    got[i],
                    u32::from(want),
                    "{kind:?} (stochastic {}, linear {linear}): y {:e} ({:#010x}), draw {:#010x}",
                    f.stochastic(),
                    ys[i],
                    ys[i].to_bits(),
                    rs[i]
                );
            }
        }
    }
    // Every kind the plans use: 8-bit dynamic maps (logarithmic), the 4-bit linear map, and
    // LPMM-SGDM's stochastically rounded linear one.
    assert!(seen.iter().any(|&(_, sr, linear)| sr && linear));
    assert!(seen.iter().any(|&(_, sr, linear)| !sr && linear));
    assert!(seen.iter().any(|&(_, sr, linear)| !sr && !linear));
}

/// The buckets themselves: exact.cuh's bucket functions are plans.rs's (which decides a map's
/// buckets from them).
#[test]
fn the_kernels_buckets_are_plans_rs() {
    let mut rng = Bits(9);
    for _ in 0..1_000_000 {
        let y = (rng.significand() - 1.0) * if rng.u32() & 1 == 0 { 1.0 } else { -1.0 };
        let y = y * 2f32.powi(-((rng.u32() % 40) as i32));
        assert_eq!(
            testing::bucket(y, false),
            lpmm_backend::plans::log_bucket(y)
        );
        assert_eq!(
            testing::bucket(y, true),
            lpmm_backend::plans::linear_bucket(y)
        );
    }
}
