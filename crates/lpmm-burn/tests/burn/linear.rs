//! `LpmmLinear`: a layer whose weight lives only in lpmm's storage, decoded for the forward pass
//! and again in the backward pass, its gradient added straight into lpmm's accumulator.

use burn_core as burn;

use crate::common::{BATCH, D_IN, D_OUT, HIDDEN, batch, uniform};
use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor, TensorData, activation::relu};
use burn_optim::GradientsParams;
use lpmm_burn::{LpmmLinear, LpmmOptimizer, LpmmOptimizerConfig};
use lpmm_optim::testing::Rng;
use lpmm_optim::{MissingGradientPolicy, presets};

#[allow(deprecated)] // burn 0.22 deprecates ndarray in favour of flex; both are supported.
fn ndarray() -> Device {
    Device::ndarray().autodiff()
}

#[derive(Module, Debug)]
struct Layers {
    l1: LpmmLinear,
    l2: LpmmLinear,
}

/// The same model with plain burn parameters.
#[derive(Module, Debug)]
struct Plain {
    w1: Param<Tensor<2>>,
    b1: Param<Tensor<1>>,
    w2: Param<Tensor<2>>,
    b2: Param<Tensor<1>>,
}

fn init(seed: u64) -> [Vec<f32>; 4] {
    let mut rng = Rng::new(seed);
    [
        uniform(&mut rng, D_IN * HIDDEN, 0.15),
        uniform(&mut rng, HIDDEN, 0.05),
        uniform(&mut rng, HIDDEN * D_OUT, 0.1),
        uniform(&mut rng, D_OUT, 0.05),
    ]
}

fn t2(v: &[f32], s: [usize; 2], d: &Device) -> Tensor<2> {
    Tensor::from_data(TensorData::new(v.to_vec(), s), d)
}

fn t1(v: &[f32], d: &Device) -> Tensor<1> {
    Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), d)
}

fn layers(optim: &LpmmOptimizer, d: &Device, seed: u64) -> Layers {
    let [w1, b1, w2, b2] = init(seed);
    Layers {
        l1: optim
            .linear(t2(&w1, [D_IN, HIDDEN], d), Some(t1(&b1, d)))
            .unwrap(),
        l2: optim
            .linear(t2(&w2, [HIDDEN, D_OUT], d), Some(t1(&b2, d)))
            .unwrap(),
    }
}

fn plain(d: &Device, seed: u64) -> Plain {
    let [w1, b1, w2, b2] = init(seed);
    Plain {
        w1: Param::from_tensor(t2(&w1, [D_IN, HIDDEN], d)),
        b1: Param::from_tensor(t1(&b1, d)),
        w2: Param::from_tensor(t2(&w2, [HIDDEN, D_OUT], d)),
        b2: Param::from_tensor(t1(&b2, d)),
    }
}

fn loss_layers(m: &Layers, step: usize, d: &Device) -> Tensor<1> {
    let (x, y) = batch(step, d);
    let h = relu(m.l1.forward(x).unwrap());
    (m.l2.forward(h).unwrap() - y).powf_scalar(2.0).mean()
}

fn loss_plain(m: &Plain, step: usize, d: &Device) -> Tensor<1> {
    let (x, y) = batch(step, d);
    let h = relu(x.matmul(m.w1.val()) + m.b1.val().unsqueeze::<2>());
    (h.matmul(m.w2.val()) + m.b2.val().unsqueeze::<2>() - y)
        .powf_scalar(2.0)
        .mean()
}

fn bits(t: Tensor<2>) -> Vec<u32> {
    t.into_data()
        .try_to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

#[test]
fn an_f32_layer_weight_steps_exactly_as_a_burn_parameter_would() {
    // f32 storage everywhere: the layer's custom backward must give burn's own gradients, so
    // both models step to the same bits.
    let d = ndarray();
    let config = LpmmOptimizerConfig::from(presets::adamw_f32(0.0));
    let mut o1 = config.init_whole_module();
    let mut o2 = config.init_whole_module();
    let mut a = layers(&o1, &d, 3);
    let mut b = plain(&d, 3);
    for step in 0..4 {
        let ga = GradientsParams::from_grads(loss_layers(&a, step, &d).backward(), &a);
        a = o1.step(1e-2, a, ga).unwrap();
        let gb = GradientsParams::from_grads(loss_plain(&b, step, &d).backward(), &b);
        b = o2.step(1e-2, b, gb).unwrap();
        assert_eq!(
            bits(a.l1.weight().decode().unwrap()),
            bits(b.w1.val()),
            "step {step}"
        );
        assert_eq!(
            bits(a.l2.weight().decode().unwrap()),
            bits(b.w2.val()),
            "step {step}"
        );
    }
    assert_eq!(o1.last_report().unwrap().updated, 4);
    // Every weight and bias received its gradient; the empty anchors are not counted.
    for o in [&o1, &o2] {
        let missing = o.last_report().unwrap().missing_gradients;
        assert!(missing.is_empty() && missing.checked == 4, "{missing:?}");
    }
}

#[test]
fn a_layer_left_out_of_the_forward_pass_is_reported() {
    let d = ndarray();
    let config = LpmmOptimizerConfig::from(presets::adamw_f32(0.0))
        .with_missing_gradient(MissingGradientPolicy::Error);
    let mut optim = config.init_whole_module();
    let m = layers(&optim, &d, 3);
    // Only `l2`, on an input of its width: `l1`'s weight and bias receive no gradient.
    let (_, y) = batch(0, &d);
    let x = Tensor::<2>::ones([BATCH, HIDDEN], &d);
    let loss = (m.l2.forward(x).unwrap() - y).powf_scalar(2.0).mean();
    let g = GradientsParams::from_grads(loss.backward(), &m);
    let e = optim.step(1e-2, m, g).unwrap_err().to_string();
    assert!(
        e.contains("2 of 4 parameters received no gradient")
            && e.contains("(l1.bias)")
            && e.contains("(an LpmmLinear weight)"),
        "{e}"
    );
}

#[test]
fn eight_bit_layers_train_and_hold_only_their_lpmm_storage() {
    let d = ndarray();
    // LPMM-SGDM: 8-bit parameters, gradients and momentum.
    let config = LpmmOptimizerConfig::from(
        presets::lpmm_sgdm(0.0, 0.9)
            .with_min_quantized_size(0)
            .build(),
    )
    .with_seed(4);
    let mut optim = config.init_whole_module();
    let mut m = layers(&optim, &d, 5);
    let first = loss_layers(&m, 0, &d).into_scalar::<f32>();
    for step in 0..30 {
        let g = GradientsParams::from_grads(loss_layers(&m, step % 4, &d).backward(), &m);
        m = optim.step(0.05, m, g).unwrap();
    }
    let last = loss_layers(&m, 0, &d).into_scalar::<f32>();
    assert!(last < 0.8 * first, "{first} -> {last}");
    // The module's own parameters are the biases (and two empty anchors); the weights are in
    // lpmm, about 1 byte each per slot (8-bit codes and a scale per 64).
    assert_eq!(m.num_params(), HIDDEN + D_OUT);
    let report = optim.memory_report();
    let w = D_IN * HIDDEN + HIDDEN * D_OUT;
    let weights: usize = report
        .params
        .iter()
        .filter(|p| p.shape.len() == 2)
        .map(|p| p.bytes[0])
        .sum();
    assert_eq!(weights, w + 4 * w.div_ceil(64));
}

#[test]
fn a_model_with_lpmm_layers_resumes_from_its_records_exactly() {
    let d = ndarray();
    let config = LpmmOptimizerConfig::from(presets::lpmm_sgdm(0.0, 0.9)).with_seed(8);
    let mut optim = config.init_whole_module();
    let mut m = layers(&optim, &d, 6);
    for step in 0..3 {
        let g = GradientsParams::from_grads(loss_layers(&m, step, &d).backward(), &m);
        m = optim.step(0.05, m, g).unwrap();
    }
    let module_record = m.clone().into_record();
    let record = optim.to_record().unwrap();
    // Another process would build the model again (same layer order, other initial values).
    let mut resumed = config.init_whole_module();
    let other = layers(&resumed, &d, 99).load_record(module_record);
    resumed = resumed.load_record(record).unwrap();
    // Its weights come from the optimizer's record: attach before the first forward pass.
    let mut other = resumed.attach(other).unwrap();
    for step in 3..6 {
        let g = GradientsParams::from_grads(loss_layers(&m, step, &d).backward(), &m);
        m = optim.step(0.05, m, g).unwrap();
        let g = GradientsParams::from_grads(loss_layers(&other, step, &d).backward(), &other);
        other = resumed.step(0.05, other, g).unwrap();
        assert_eq!(
            bits(m.l1.weight().decode().unwrap()),
            bits(other.l1.weight().decode().unwrap()),
            "step {step}"
        );
    }
}
