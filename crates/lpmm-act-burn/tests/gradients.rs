//! Each operator's output and gradients against burn's own uncompressed operators on
//! `Autodiff<Flex>` (the host kernels) and on burn's wgpu device (the CubeCL kernels; lavapipe in
//! CI): the exact ones (GELU and LayerNorm from their outputs, softmax·dropout,
//! softmax·dropout·matmul, few-bit ReLU) to f32 tolerance, the few-bit activations to their table's
//! error (and bit for bit to `dy × level[code]`), the compressed matmul's `dw` to its compression
//! error, unbiased. Module [`device`] checks the device kernels against the host kernels.

use burn_tensor::{Device, Tensor, TensorData, activation, module};
use lpmm_act_burn::block::Rng;
use lpmm_act_burn::{
    Activation, FewBit, Grid, RandomStream, Table, Weight, few_bit, gelu_few_bit, gelu_from_output,
    gelu_table, layer_norm_from_output, matmul_compressed, softmax_dropout, softmax_dropout_matmul,
};

/// The device kernels against the host kernels, kernel by kernel.
#[path = "gradients/device.rs"]
mod device;

fn flex() -> Device {
    Device::flex().autodiff()
}

/// burn's wgpu device, or `None` with a message when there is no adapter (a failure with
/// `LPMM_REQUIRE_WGPU=1`, as CI sets it).
fn wgpu() -> Option<Device> {
    static DEVICE: std::sync::OnceLock<Result<Device, String>> = std::sync::OnceLock::new();
    match DEVICE.get_or_init(|| Device::wgpu_options().init().map_err(|e| e.to_string())) {
        Ok(d) => Some(d.clone().autodiff()),
        Err(e) => {
            if std::env::var("LPMM_REQUIRE_WGPU").is_ok_and(|v| v == "1") {
                panic!("LPMM_REQUIRE_WGPU=1 but burn's wgpu device: {e}");
            }
            eprintln!("skipping the wgpu case: {e}");
            None
        }
    }
}

/// `#[test] $name` on flex and `$name_wgpu` on burn's wgpu device, both running `$body(dev)`.
macro_rules! on_devices {
    ($name:ident, $wgpu:ident, $body:ident) => {
        #[test]
        fn $name() {
            $body(flex());
        }

        #[test]
        fn $wgpu() {
            if let Some(dev) = wgpu() {
                $body(dev);
            }
        }
    };
}

/// Whether `dev` is burn-flex (the host kernels) rather than a cubecl device.
fn on_host(dev: &Device) -> bool {
    matches!(
        dev.clone().inner().as_dispatch(),
        burn_dispatch::DispatchDevice::Flex(_)
    )
}

fn values<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.to_data().try_into_vec_as::<f32>().expect("f32 tensor")
}

/// `max |a - b| / max |b|` (or the absolute difference where `b` is all zeros); NaN where
/// exactly one of a pair is NaN.
fn rel_max(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut diff = 0f32;
    for (x, y) in a.iter().zip(b) {
        if x.is_nan() != y.is_nan() {
            return f32::NAN;
        }
        if !x.is_nan() {
            diff = diff.max((x - y).abs());
        }
    }
    let scale = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    if scale > 0.0 { diff / scale } else { diff }
}

fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    let e = rel_max(a, b);
    assert!(e <= tol, "{what}: relative max error {e:e} > {tol:e}");
}

/// `Σ y ⊙ w` (so that `dy = w`).
fn weighted_sum<const D: usize>(y: Tensor<D>, w: &Tensor<D>) -> Tensor<1> {
    (y * w.clone()).sum()
}

on_devices!(
    gelu_from_output_matches_burn_gelu,
    gelu_from_output_matches_burn_gelu_on_wgpu,
    gelu_from_output_matches_burn_gelu_on
);

fn gelu_from_output_matches_burn_gelu_on(dev: Device) {
    let mut rng = Rng::new(11);
    // Beyond one chunk, both branches, around the minimum.
    let shape = [3, 100, 301];
    let x0 = rng.tensor(shape, 2.0, &dev);
    let w = rng.tensor(shape, 1.0, &dev);

    let x = x0.clone().require_grad();
    let y = gelu_from_output(x.clone());
    let g = weighted_sum(y.clone(), &w).backward();
    let dx = x.grad(&g).unwrap();

    let xr = x0.clone().require_grad();
    let yr = activation::gelu(xr.clone());
    let gr = weighted_sum(yr.clone(), &w).backward();
    let dxr = xr.grad(&gr).unwrap();

    assert_close("gelu output", &values(&y), &values(&yr), 1e-6);
    // burn's `gelu_backward` is the derivative of the tanh approximation of GELU (its forward is
    // the exact erf GELU): it is off by up to ~1e-3 relative. Against it, that bound; against the
    // exact derivative (f64), the from-output backward is f32-accurate except next to GELU's
    // minimum, where recovering x from y is ill-conditioned (|Δx| ~ sqrt(ulp(y)), giving
    // |Δ GELU'(x)| ~ 1e-4 at most there).
    let (xs, ws) = (values(&x0), values(&w));
    let exact: Vec<f32> = xs
        .iter()
        .zip(&ws)
        .map(|(&x, &w)| (f64::from(w) * Activation::Gelu.derivative(f64::from(x))) as f32)
        .collect();
    assert_close("gelu dx vs burn", &values(&dx), &values(&dxr), 2e-3);
    // On the host the input is recovered in f64; the device kernel recovers it in f32, where
    // evaluating GELU next to its minimum is noisier (measured 3.3e-5 on lavapipe).
    let tol = if on_host(&dev) { 2e-5 } else { 1e-4 };
    assert_close("gelu dx vs exact", &values(&dx), &exact, tol);
    let burn_error = rel_max(&values(&dxr), &exact);
    eprintln!(
        "GELU dx, relative max error against the exact derivative: from output {:e}, burn {burn_error:e}",
        rel_max(&values(&dx), &exact)
    );
}

on_devices!(
    few_bit_gelu_is_the_table_derivative_within_its_error,
    few_bit_gelu_is_the_table_derivative_within_its_error_on_wgpu,
    few_bit_gelu_is_the_table_derivative_within_its_error_on
);

fn few_bit_gelu_is_the_table_derivative_within_its_error_on(dev: Device) {
    let mut rng = Rng::new(12);
    let shape = [8, 64, 64];
    let x0 = rng.tensor(shape, 1.0, &dev);
    let w = rng.tensor(shape, 1.0, &dev);

    let yr = activation::gelu(x0.clone());
    let (xs, ws) = (values(&x0), values(&w));
    let exact: Vec<f64> = xs
        .iter()
        .zip(&ws)
        .map(|(&x, &w)| f64::from(w) * Activation::Gelu.derivative(f64::from(x)))
        .collect();
    let mean_sq_derivative = xs
        .iter()
        .map(|&x| Activation::Gelu.derivative(f64::from(x)).powi(2))
        .sum::<f64>()
        / xs.len() as f64;

    for bits in [1, 2, 4] {
        let table = gelu_table(bits);
        let x = x0.clone().require_grad();
        let y = gelu_few_bit(x.clone(), &table);
        let dx = values(&x.grad(&weighted_sum(y.clone(), &w).backward()).unwrap());
        // The forward pass is burn's GELU itself.
        assert_eq!(values(&y), values(&yr), "{bits} bits: forward");
        // The backward pass is exactly dy × level[code(x)].
        let expect = table.backward(&ws, &table.encode(&xs)).unwrap();
        assert_eq!(dx, expect, "{bits} bits: dx is the table's");
        // Against the exact gradient. With dy independent of x, the relative L2 error of dx is
        // the table's N(0, 1)-weighted RMS derivative error over the RMS derivative: the bound
        // is that prediction + 10% (sampling), and the cosine similarity follows.
        let (mut num, mut den, mut dot, mut na) = (0f64, 0f64, 0f64, 0f64);
        for (&a, &b) in dx.iter().zip(&exact) {
            let a = f64::from(a);
            num += (a - b) * (a - b);
            den += b * b;
            dot += a * b;
            na += a * a;
        }
        let rel = (num / den).sqrt();
        let cos = dot / (na.sqrt() * den.sqrt());
        let predicted =
            table.rms_error(Activation::Gelu, Weight::STANDARD, Grid::default(), 20_000)
                / mean_sq_derivative.sqrt();
        eprintln!(
            "few-bit GELU, {bits} bits: relative L2 error of dx {rel:.4} (table predicts \
             {predicted:.4}), cosine {cos:.5}"
        );
        assert!(
            rel < 1.1 * predicted,
            "{bits} bits: relative L2 error {rel} > 1.1 × {predicted}"
        );
        assert!(
            cos > (1.0 - 0.6 * predicted * predicted),
            "{bits} bits: cosine {cos}"
        );
    }
}

on_devices!(
    layer_norm_from_output_matches_burn_layer_norm,
    layer_norm_from_output_matches_burn_layer_norm_on_wgpu,
    layer_norm_from_output_matches_burn_layer_norm_on
);

fn layer_norm_from_output_matches_burn_layer_norm_on(dev: Device) {
    let mut rng = Rng::new(13);
    let (rows, cols) = (6, 48);
    let shape = [2, rows, cols];
    let x0 = rng.tensor(shape, 3.0, &dev).add_scalar(0.5);
    let w = rng.tensor(shape, 1.0, &dev);
    // γ away from the guard (|γ| >= 1e-3) in most columns, one exactly 0 (the guarded path).
    let mut gamma: Vec<f32> = (0..cols).map(|_| 1.0 + 0.5 * rng.normal()).collect();
    gamma[5] = 0.0;
    let beta: Vec<f32> = (0..cols).map(|_| 0.3 * rng.normal()).collect();
    let gamma0: Tensor<1> = Tensor::from_data(TensorData::new(gamma, [cols]), &dev);
    let beta0: Tensor<1> = Tensor::from_data(TensorData::new(beta, [cols]), &dev);
    let eps = 1e-5;

    let (x, g, b) = (
        x0.clone().require_grad(),
        gamma0.clone().require_grad(),
        beta0.clone().require_grad(),
    );
    let y = layer_norm_from_output(x.clone(), g.clone(), b.clone(), eps);
    let grads = weighted_sum(y.clone(), &w).backward();

    let (xr, gr, br) = (
        x0.require_grad(),
        gamma0.require_grad(),
        beta0.require_grad(),
    );
    let yr = module::layer_norm(xr.clone(), gr.clone(), Some(br.clone()), f64::from(eps));
    let gradsr = weighted_sum(yr.clone(), &w).backward();

    assert_close("layer norm output", &values(&y), &values(&yr), 1e-5);
    for (what, a, b) in [
        ("dx", x.grad(&grads), xr.grad(&gradsr)),
        (
            "dgamma",
            g.grad(&grads).map(|t| t.unsqueeze()),
            gr.grad(&gradsr).map(|t| t.unsqueeze()),
        ),
        (
            "dbeta",
            b.grad(&grads).map(|t| t.unsqueeze()),
            br.grad(&gradsr).map(|t| t.unsqueeze()),
        ),
    ] {
        let (a, b): (Tensor<3>, Tensor<3>) = (a.unwrap(), b.unwrap());
        assert_close(what, &values(&a), &values(&b), 1e-4);
    }
}

/// burn's softmax, then dropout with the keep mask `mask` (0/1), scaled by `1 / (1 - p)`.
fn burn_softmax_dropout(x: Tensor<4>, mask: &Tensor<4>, p: f32) -> Tensor<4> {
    (activation::softmax(x, 3) * mask.clone()).mul_scalar(1.0 / (1.0 - p))
}

on_devices!(
    softmax_dropout_matches_burn_softmax_and_dropout,
    softmax_dropout_matches_burn_softmax_and_dropout_on_wgpu,
    softmax_dropout_matches_burn_softmax_and_dropout_on
);

fn softmax_dropout_matches_burn_softmax_and_dropout_on(dev: Device) {
    let mut rng = Rng::new(14);
    let shape = [2, 3, 17, 40];
    let stream = RandomStream::new(5, 9, 1);
    for p in [0.0f32, 0.1, 0.5] {
        let x0 = rng.tensor(shape, 2.0, &dev);
        let w = rng.tensor(shape, 1.0, &dev);
        let x = x0.clone().require_grad();
        let y = softmax_dropout(x.clone(), p, &stream);
        let dx = values(&x.grad(&weighted_sum(y.clone(), &w).backward()).unwrap());
        // softmax is positive: the dropped elements are exactly the zeros of the output.
        let mask = y.clone().inner().not_equal_elem(0.0).float().autodiff();
        let kept = values(&mask).iter().sum::<f32>() / values(&mask).len() as f32;
        assert!((kept - (1.0 - p)).abs() < 0.03, "p = {p}: kept {kept}");

        let xr = x0.require_grad();
        let yr = burn_softmax_dropout(xr.clone(), &mask, p);
        let dxr = values(&xr.grad(&weighted_sum(yr.clone(), &w).backward()).unwrap());
        assert_close("softmax·dropout output", &values(&y), &values(&yr), 1e-5);
        assert_close("softmax·dropout dx", &dx, &dxr, 1e-4);
    }
}

on_devices!(
    softmax_dropout_matmul_matches_burn,
    softmax_dropout_matmul_matches_burn_on_wgpu,
    softmax_dropout_matmul_matches_burn_on
);

fn softmax_dropout_matmul_matches_burn_on(dev: Device) {
    let mut rng = Rng::new(15);
    let (b, h, n, m, k) = (2, 3, 17, 23, 8);
    let stream = RandomStream::new(5, 10, 2);
    let p = 0.2;
    let s0 = rng.tensor([b, h, n, m], 2.0, &dev);
    let v0 = rng.tensor([b, h, m, k], 1.0, &dev);
    let w = rng.tensor([b, h, n, k], 1.0, &dev);

    let (s, v) = (s0.clone().require_grad(), v0.clone().require_grad());
    let y = softmax_dropout_matmul(s.clone(), v.clone(), p, &stream);
    let g = weighted_sum(y.clone(), &w).backward();
    // The same stream gives the same mask as the unfused operator.
    let mask = softmax_dropout(s0.clone(), p, &stream)
        .inner()
        .not_equal_elem(0.0)
        .float()
        .autodiff();

    let (sr, vr) = (s0.require_grad(), v0.require_grad());
    let yr = burn_softmax_dropout(sr.clone(), &mask, p).matmul(vr.clone());
    let gr = weighted_sum(yr.clone(), &w).backward();

    assert_close("attention output", &values(&y), &values(&yr), 1e-5);
    assert_close(
        "d scores",
        &values(&s.grad(&g).unwrap()),
        &values(&sr.grad(&gr).unwrap()),
        1e-4,
    );
    assert_close(
        "d v",
        &values(&v.grad(&g).unwrap()),
        &values(&vr.grad(&gr).unwrap()),
        1e-5,
    );
}

on_devices!(
    operators_run_without_autodiff_and_with_checkpointing,
    operators_run_without_autodiff_and_with_checkpointing_on_wgpu,
    modes_on
);

fn modes_on(dev: Device) {
    let plain = dev.clone().inner();
    let balanced = dev.clone().gradient_checkpointing();
    let mut rng = Rng::new(16);
    let shape = [2, 5, 12];
    let x0 = rng.tensor(shape, 1.0, &plain);
    let w = rng.tensor(shape, 1.0, &plain);
    let (gamma, beta) = (
        Tensor::<1>::ones([12], &plain),
        Tensor::<1>::zeros([12], &plain),
    );
    let stream = RandomStream::new(1, 2, 3);
    let table = gelu_table(2);
    let chain = |x: Tensor<3>, g: Tensor<1>, b: Tensor<1>| {
        let h = layer_norm_from_output(x, g, b, 1e-5);
        let h = gelu_from_output(h.clone()) + gelu_few_bit(h, &table);
        let s: Tensor<4> = h.clone().unsqueeze();
        let a = softmax_dropout(s.clone(), 0.1, &stream);
        let scores = s.clone().matmul(s.swap_dims(2, 3));
        softmax_dropout_matmul(scores, a, 0.1, &stream).squeeze_dim::<3>(0)
    };
    // Without autodiff: a plain forward pass, no graph.
    let y_plain = chain(x0.clone(), gamma.clone(), beta.clone());
    assert!(!y_plain.is_autodiff());
    // Default autodiff and balanced checkpointing give the same values and gradients.
    let mut results = Vec::new();
    for dev in [dev, balanced] {
        let x = Tensor::<3>::from_data(x0.to_data(), &dev).require_grad();
        let g = Tensor::<1>::from_data(gamma.to_data(), &dev).require_grad();
        let b = Tensor::<1>::from_data(beta.to_data(), &dev).require_grad();
        let y = chain(x.clone(), g.clone(), b.clone());
        let grads = weighted_sum(y.clone(), &Tensor::from_data(w.to_data(), &dev)).backward();
        results.push((
            values(&y),
            values(&x.grad(&grads).unwrap()),
            values(&g.grad(&grads).unwrap()),
        ));
    }
    assert_eq!(values(&y_plain), results[0].0);
    assert_eq!(results[0], results[1]);
}

on_devices!(
    matmul_compressed_is_exact_in_dx_and_unbiased_in_dw,
    matmul_compressed_is_exact_in_dx_and_unbiased_in_dw_on_wgpu,
    matmul_compressed_on
);

fn matmul_compressed_on(dev: Device) {
    let mut rng = Rng::new(17);
    let x0 = rng.tensor([4, 32, 64], 1.0, &dev);
    let w0: Tensor<2> = rng.tensor([64, 48], 0.5, &dev);
    let dy = rng.tensor([4, 32, 48], 1.0, &dev);

    let (xr, wr) = (x0.clone().require_grad(), w0.clone().require_grad());
    let yr = xr.clone().matmul(wr.clone().unsqueeze::<3>());
    let gr = weighted_sum(yr.clone(), &dy).backward();
    let (dxr, dwr) = (
        values(&xr.grad(&gr).unwrap()),
        values(&wr.grad(&gr).unwrap()),
    );

    let l2 = |a: &[f32], b: &[f32]| {
        let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
        (num / den).sqrt()
    };
    let mut mean_dw = vec![0f64; dwr.len()];
    let draws = 24;
    // Bounds about 1.5x lpmm-act's measured relative RMS (docs/ACTIVATIONS.md: 0.0099 / 0.18 / 1.2).
    for (bits, bound) in [(8, 0.015), (4, 0.27), (2, 1.8)] {
        for s in 0..draws {
            let stream = RandomStream::new(3, 4, s);
            let (x, w) = (x0.clone().require_grad(), w0.clone().require_grad());
            let y = matmul_compressed(x.clone(), w.clone(), bits, &stream);
            let g = weighted_sum(y.clone(), &dy).backward();
            if s == 0 {
                assert_close("compressed matmul output", &values(&y), &values(&yr), 1e-6);
                // dx does not use the compressed input: burn's own.
                assert_close(
                    "compressed matmul dx",
                    &values(&x.grad(&g).unwrap()),
                    &dxr,
                    1e-6,
                );
            }
            let dw = values(&w.grad(&g).unwrap());
            let e = l2(&dw, &dwr);
            if s == 0 {
                eprintln!("{bits}-bit dw: relative L2 error {e:.4}");
            }
            assert!(e < bound, "{bits}-bit dw relative L2 error {e} >= {bound}");
            if bits == 2 {
                for (m, v) in mean_dw.iter_mut().zip(&dw) {
                    *m += f64::from(*v) / f64::from(draws as u32);
                }
            }
        }
    }
    // Unbiased: the mean over draws of the 2-bit dw is closer to the exact dw than one draw is
    // (by about sqrt(draws): measured 0.247 against one draw's 1.21).
    let mean: Vec<f32> = mean_dw.iter().map(|&v| v as f32).collect();
    let e = l2(&mean, &dwr);
    eprintln!("2-bit dw: relative L2 error of the mean of {draws} draws {e}");
    assert!(
        e < 1.8 / f64::from(draws as u32).sqrt(),
        "2-bit dw mean error {e}"
    );
}

on_devices!(
    few_bit_activations_are_burns_forward_and_the_table_backward,
    few_bit_activations_are_burns_forward_and_the_table_backward_on_wgpu,
    few_bit_activations_on
);

fn few_bit_activations_on(dev: Device) {
    let mut rng = Rng::new(18);
    let x0 = rng.tensor([6, 50, 40], 1.5, &dev);
    let w = rng.tensor([6, 50, 40], 1.0, &dev);
    let (xs, ws) = (values(&x0), values(&w));
    for (act, kind) in [
        (FewBit::Silu, Some(Activation::Silu)),
        (FewBit::Tanh, Some(Activation::Tanh)),
        (FewBit::Sigmoid, Some(Activation::Sigmoid)),
        (FewBit::Relu, None),
    ] {
        let table = std::sync::Arc::new(match kind {
            Some(a) => Table::solve(a, 3, Weight::STANDARD, Grid::default()).unwrap(),
            None => Table::relu(),
        });
        let x = x0.clone().require_grad();
        let y = few_bit(x.clone(), act, &table);
        let dx = values(&x.grad(&weighted_sum(y.clone(), &w).backward()).unwrap());
        let xr = x0.clone().require_grad();
        let yr = match act {
            FewBit::Silu => activation::silu(xr.clone()),
            FewBit::Tanh => activation::tanh(xr.clone()),
            FewBit::Sigmoid => activation::sigmoid(xr.clone()),
            _ => activation::relu(xr.clone()),
        };
        let dxr = values(&xr.grad(&weighted_sum(yr.clone(), &w).backward()).unwrap());
        assert_close(&format!("{act:?} output"), &values(&y), &values(&yr), 1e-6);
        // Bit for bit dy × level[code], the code the number of thresholds at or below x.
        let expected: Vec<f32> = xs
            .iter()
            .zip(&ws)
            .map(|(&x, &g)| g * table.levels[table.code(x) as usize])
            .collect();
        assert_eq!(dx, expected, "{act:?}: dy × level[code]");
        match kind {
            // ReLU's 1-bit table is its derivative: burn's gradient exactly.
            None => assert_eq!(dx, dxr, "few-bit ReLU is exact"),
            // 3 bits: within the table's derivative error of burn's gradient.
            Some(_) => assert_close(&format!("{act:?} dx vs burn"), &dx, &dxr, 0.25),
        }
    }
}
