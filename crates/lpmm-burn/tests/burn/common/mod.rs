//! A small burn MLP, deterministic data, and lpmm's own optimizer as the reference the burn
//! integration must reproduce bit for bit.

#![allow(dead_code)]

use std::sync::OnceLock;

use burn_core as burn;
use lpmm_optim::SlotKind;

use burn::module::{Module, Param};
use burn::tensor::{DType, Device, Tensor, TensorData, activation::relu};
use burn_optim::GradientsParams;
use lpmm_optim::testing::Rng;

/// Two dense layers; `w1` is large enough (8192 elements) for 8-bit states, the rest keep f32
/// states (lpmm's minimum quantized size is 4096).
#[derive(Module, Debug)]
pub struct Mlp {
    pub w1: Param<Tensor<2>>,
    pub b1: Param<Tensor<1>>,
    pub w2: Param<Tensor<2>>,
    pub b2: Param<Tensor<1>>,
}

pub const D_IN: usize = 64;
pub const HIDDEN: usize = 128;
pub const D_OUT: usize = 16;
pub const BATCH: usize = 32;

/// `n` values uniform in `[-scale, scale)`.
pub fn uniform(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.uniform() * 2.0 - 1.0) * scale)
        .collect()
}

fn param<const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &Device,
    dtype: DType,
) -> Param<Tensor<D>> {
    // burn converts data to the device's default float dtype unless told otherwise.
    let data = TensorData::new(values, shape).convert_dtype(dtype);
    Param::from_tensor(Tensor::from_data(data, (device, dtype)))
}

impl Mlp {
    pub fn new(device: &Device, seed: u64) -> Self {
        Self::new_in(device, seed, DType::F32)
    }

    /// The model with parameters of `dtype`.
    pub fn new_in(device: &Device, seed: u64, dtype: DType) -> Self {
        let mut rng = Rng::new(seed);
        Mlp {
            w1: param(
                uniform(&mut rng, D_IN * HIDDEN, 0.15),
                [D_IN, HIDDEN],
                device,
                dtype,
            ),
            b1: param(uniform(&mut rng, HIDDEN, 0.05), [HIDDEN], device, dtype),
            w2: param(
                uniform(&mut rng, HIDDEN * D_OUT, 0.1),
                [HIDDEN, D_OUT],
                device,
                dtype,
            ),
            b2: param(uniform(&mut rng, D_OUT, 0.05), [D_OUT], device, dtype),
        }
    }

    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = relu(x.matmul(self.w1.val()) + self.b1.val().unsqueeze::<2>());
        h.matmul(self.w2.val()) + self.b2.val().unsqueeze::<2>()
    }

    /// The parameters' values in visiting order, as f32 bits.
    pub fn bits(&self) -> Vec<Vec<u32>> {
        [
            self.w1.val().into_data(),
            self.b1.val().into_data(),
            self.w2.val().into_data(),
            self.b2.val().into_data(),
        ]
        .into_iter()
        .map(|d| {
            d.convert::<f32>()
                .try_to_vec::<f32>()
                .expect("f32 values")
                .into_iter()
                .map(f32::to_bits)
                .collect()
        })
        .collect()
    }
}

/// Batch `step` of a fixed regression task.
pub fn batch(step: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let mut rng = Rng::new(1000 + step as u64);
    let x = uniform(&mut rng, BATCH * D_IN, 1.0);
    let y = uniform(&mut rng, BATCH * D_OUT, 1.0);
    (
        Tensor::from_data(TensorData::new(x, [BATCH, D_IN]), device),
        Tensor::from_data(TensorData::new(y, [BATCH, D_OUT]), device),
    )
}

/// The gradients of the mean squared error on batch `step`.
pub fn grads(model: &Mlp, step: usize, device: &Device) -> GradientsParams {
    let (x, y) = batch(step, device);
    let dtype = model.w1.val().dtype();
    let (x, y) = (x.cast(dtype), y.cast(dtype));
    let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
    GradientsParams::from_grads(loss.backward(), model)
}

/// The gradients' values in visiting order (for the reference optimizer).
pub fn host_grads(model: &Mlp, grads: &GradientsParams) -> Vec<Vec<f32>> {
    fn get<const D: usize>(g: &GradientsParams, p: &Param<Tensor<D>>) -> Vec<f32> {
        g.get::<D>(p.id)
            .expect("a gradient")
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .expect("f32")
    }
    vec![
        get(grads, &model.w1),
        get(grads, &model.b1),
        get(grads, &model.w2),
        get(grads, &model.b2),
    ]
}

/// The model's shapes in visiting order.
pub fn shapes() -> [Vec<usize>; 4] {
    [
        vec![D_IN, HIDDEN],
        vec![HIDDEN],
        vec![HIDDEN, D_OUT],
        vec![D_OUT],
    ]
}

/// The model's values in visiting order.
pub fn values(model: &Mlp) -> Vec<Vec<f32>> {
    model
        .bits()
        .into_iter()
        .map(|b| b.into_iter().map(f32::from_bits).collect())
        .collect()
}

/// lpmm's own optimizer over the same parameters, registered in the module's visiting order.
pub fn reference(
    config: &lpmm_burn::LpmmOptimizerConfig,
    init: &[Vec<f32>],
) -> (lpmm_optim::Optimizer, Vec<lpmm_optim::ParamId>) {
    let mut r = lpmm_optim::Optimizer::new(config.options).unwrap();
    r.add_group(config.param).unwrap();
    let ids = shapes()
        .iter()
        .zip(init)
        .enumerate()
        .map(|(i, (s, v))| r.add_param(&format!("p{i}"), s, v, 0).unwrap())
        .collect();
    (r, ids)
}

/// One step of the reference at `lr` on `grads` (host vectors in visiting order), taken with
/// `Optimizer::step` with `Step::given` as lpmm-burn takes it from burn's tensors. (With an f32
/// accumulator or none this equals accumulating and stepping, lpmm-optim's `tests/gradients.rs`;
/// with a lossy gradient storage the norm is of the gradients as given, before their rounding
/// into the accumulator.)
pub fn reference_step(
    r: &mut lpmm_optim::Optimizer,
    ids: &[lpmm_optim::ParamId],
    grads: Vec<Vec<f32>>,
    lr: f64,
) -> lpmm_optim::StepReport {
    r.set_lr(lr).unwrap();
    let mut given = vec![Vec::new(); r.status().params];
    for (&id, g) in ids.iter().zip(grads) {
        given[id.index()] = g;
    }
    r.step(lpmm_optim::Step::given(&mut given)).unwrap()
}

/// The same step as accumulating the gradients and stepping (`Optimizer::accumulate`,
/// `Optimizer::step`).
pub fn reference_accumulated_step(
    r: &mut lpmm_optim::Optimizer,
    ids: &[lpmm_optim::ParamId],
    grads: Vec<Vec<f32>>,
    lr: f64,
) -> lpmm_optim::StepReport {
    r.set_lr(lr).unwrap();
    for (&id, g) in ids.iter().zip(grads) {
        r.accumulate(id, &g).unwrap();
    }
    r.step(lpmm_optim::Accumulated).unwrap()
}

/// The reference's parameters as f32 bits.
pub fn read(r: &lpmm_optim::Optimizer, ids: &[lpmm_optim::ParamId]) -> Vec<Vec<u32>> {
    ids.iter()
        .zip(shapes())
        .map(|(&id, s)| {
            let mut out = vec![0f32; s.iter().product()];
            r.read(id, SlotKind::Param, &mut out).unwrap();
            out.into_iter().map(f32::to_bits).collect()
        })
        .collect()
}

/// The MLP beside a parameter its forward pass does not use (an unused layer, say).
#[derive(Module, Debug)]
pub struct WithSpare {
    pub mlp: Mlp,
    pub spare: Param<Tensor<1>>,
}

impl WithSpare {
    /// The model; `frozen`: the spare parameter does not require a gradient (burn's way to
    /// freeze a parameter on purpose).
    pub fn new(device: &Device, seed: u64, frozen: bool) -> Self {
        let spare = param(vec![0.25; 8], [8], device, DType::F32);
        WithSpare {
            mlp: Mlp::new(device, seed),
            spare: spare.set_require_grad(!frozen),
        }
    }

    /// The gradients of the MLP's loss on batch `step`, for this whole module.
    pub fn grads(&self, step: usize, device: &Device) -> GradientsParams {
        let (x, y) = batch(step, device);
        let loss = (self.mlp.forward(x) - y).powf_scalar(2.0).mean();
        GradientsParams::from_grads(loss.backward(), self)
    }

    /// The spare parameter's label in lpmm-burn's reports: its id and module path.
    pub fn spare_label(&self) -> String {
        format!("{} (spare)", self.spare.id.val())
    }
}

/// The wgpu tests share one device and its read counters: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// burn's wgpu device shared with lpmm (initialised once per process), or `None` with a message
/// when there is no adapter; `LPMM_REQUIRE_WGPU=1` (CI) makes that a failure.
pub fn wgpu_device() -> Option<Device> {
    static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();
    match DEVICE
        .get_or_init(|| lpmm_burn::wgpu::init(Device::wgpu_options()).map_err(|e| e.to_string()))
    {
        Ok(d) => Some(d.clone().autodiff()),
        Err(e) => {
            if std::env::var("LPMM_REQUIRE_WGPU").is_ok_and(|v| v == "1") {
                panic!("LPMM_REQUIRE_WGPU=1 but {e}");
            }
            eprintln!("skipping the burn wgpu test: {e}");
            None
        }
    }
}
