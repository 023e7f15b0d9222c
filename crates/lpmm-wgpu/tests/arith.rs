//! The shader's software fma against the CPU's `mul_add`, bit for bit, over random bit patterns
//! (subnormals, cancellations, overflow, underflow included), and what the adapter's probe found.

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
