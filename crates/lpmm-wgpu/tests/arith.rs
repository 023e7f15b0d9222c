//! The shader's software fma, division and square root against the CPU's `mul_add`, `/` and
//! `sqrt`, bit for bit, over random bit patterns (subnormals, cancellations, overflow, underflow,
//! Inf and NaN included), and what the adapter's probe found.

mod common;

use common::backend;
use lpmm_optim::testing::Rng;

#[test]
fn software_fma_is_correctly_rounded() {
    let Some(gpu) = backend(Default::default()) else {
        return;
    };
    let mut rng = Rng::new(42);
    let mut triples = lpmm_wgpu::probe_inputs();
    let pick = |rng: &mut Rng| {
        let b = rng.next_u64() as u32;
        // Favour small exponents (subnormal products) and exponents near each other.
        let b = match rng.next_u64() % 4 {
            0 => b & 0x80FF_FFFF,
            1 => b & 0x83FF_FFFF | 0x3C00_0000,
            _ => b,
        };
        let x = f32::from_bits(b);
        if x.is_finite() { x } else { 0.5 }
    };
    for _ in 0..200_000 {
        let (a, b) = (pick(&mut rng), pick(&mut rng));
        let c = match rng.next_u64() % 3 {
            0 => -(a * b),
            1 => pick(&mut rng),
            _ => -(a * b) * (1.0 + f32::EPSILON),
        };
        triples.push([a, b, c]);
    }
    let out = gpu.probe_arith(&triples).unwrap();
    let mut wrong = 0;
    for (&[a, b, c], o) in triples.iter().zip(&out) {
        let want = a.mul_add(b, c);
        if o[1].to_bits() != want.to_bits() && !(want.is_nan() && o[1].is_nan()) {
            if wrong < 5 {
                eprintln!("fma({a:e}, {b:e}, {c:e}) = {want:e}, shader {:e}", o[1]);
            }
            wrong += 1;
        }
    }
    assert_eq!(wrong, 0, "of {} inputs", triples.len());
    eprintln!(
        "adapter {:?}: {:?}",
        gpu.adapter_info().name,
        gpu.float_behaviour()
    );
}

#[test]
fn software_division_and_square_root_are_correctly_rounded() {
    let Some(gpu) = backend(Default::default()) else {
        return;
    };
    let mut rng = Rng::new(7);
    let mut triples = lpmm_wgpu::probe_inputs();
    let any = |rng: &mut Rng| f32::from_bits(rng.next_u64() as u32);
    // Exponent fields: anywhere, near the bottom (subnormals), near the top (overflow).
    let pick = |rng: &mut Rng| {
        let b = rng.next_u64() as u32;
        f32::from_bits(match rng.next_u64() % 4 {
            0 => b & 0x80FF_FFFF,
            1 => b | 0x7E00_0000,
            _ => b,
        })
    };
    for _ in 0..200_000 {
        let (a, b) = (pick(&mut rng), pick(&mut rng));
        triples.push([a, b, 0.0]);
    }
    for _ in 0..2_000 {
        // Arbitrary patterns: Inf and NaN included.
        triples.push([any(&mut rng), any(&mut rng), 0.0]);
    }
    let specials = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x007F_FFFF),
        f32::MAX,
        1.0,
        -3.0,
        4.0,
    ];
    for &a in &specials {
        for &b in &specials {
            triples.push([a, b, 0.0]);
        }
    }
    // Ties on the subnormal grid (to even: 0 and 2^-148), exact quotients and roots, and the
    // smallest subnormal results.
    triples.push([f32::from_bits(1), 2.0, 0.0]);
    triples.push([f32::from_bits(3), 2.0, 0.0]);
    triples.push([f32::from_bits(3), -2.0, 0.0]);
    for k in 1..=64u32 {
        let x = k as f32;
        triples.push([x * x * 3.0, x, 0.0]);
        triples.push([f32::from_bits(k), 2.0 + k as f32, 0.0]);
    }
    let out = gpu.probe_arith(&triples).unwrap();
    let same = |x: f32, y: f32| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
    let (mut wrong_div, mut wrong_sqrt) = (0, 0);
    for (&[a, b, _], o) in triples.iter().zip(&out) {
        if !same(o[5], a / b) {
            if wrong_div < 5 {
                eprintln!("{a:e} / {b:e} = {:e}, shader {:e}", a / b, o[5]);
            }
            wrong_div += 1;
        }
        let r = a.abs().sqrt();
        if !same(o[6], r) {
            if wrong_sqrt < 5 {
                eprintln!("sqrt({:e}) = {r:e}, shader {:e}", a.abs(), o[6]);
            }
            wrong_sqrt += 1;
        }
    }
    assert_eq!(
        (wrong_div, wrong_sqrt),
        (0, 0),
        "of {} inputs",
        triples.len()
    );
}
