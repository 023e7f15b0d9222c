//! lpmm-candle on candle's CUDA device (feature `cuda`): lpmm-cuda steps the `Var`s in candle's
//! device memory, on candle's stream, from the gradients where candle computed them, and every
//! step equals the CPU path bit for bit. Runs where a CUDA driver and a device are present and
//! says so plainly elsewhere; `LPMM_REQUIRE_CUDA=1` makes their absence a failure.
//!
//! candle-core's `cuda` feature links the CUDA libraries (cudarc's `dynamic-linking`), so this
//! test binary starts only where they are installed; without a GPU it is compile-checked
//! (`cargo clippy -p lpmm-candle --features cuda --all-targets`, crate docs "CUDA").

#![cfg(feature = "cuda")]

use candle_core::backprop::GradStore;
use candle_core::cuda_backend::cudarc::driver::DevicePtr;
use candle_core::{DType, Device, Storage, Tensor, Var};
use lpmm_candle::{LpmmConfig, LpmmOptimizer};
use lpmm_optim::{OptimizerOptions, presets};

/// candle's CUDA device 0, or `None` with a message when there is no driver or device.
fn device() -> Option<Device> {
    let fail = |e: String| {
        if std::env::var("LPMM_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
            panic!("LPMM_REQUIRE_CUDA=1 but {e}");
        }
        eprintln!("skipping the candle CUDA test: {e}");
        None
    };
    if let Err(e) = lpmm_cuda::Cuda::new(0) {
        return fail(e.to_string());
    }
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => fail(e.to_string()),
    }
}

/// Shapes of the model's `Var`s (a bias-like vector, a matrix above one piece of 4096, a scalar).
const SHAPES: [(&str, &[usize]); 3] =
    [("a.bias", &[37]), ("a.weight", &[96, 80]), ("b.scale", &[])];

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Deterministic values (bf16-representable, so f32 and bf16 Vars start equal).
fn pattern(n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|j| {
            let v = ((j * 7919 + salt * 104_729) % 2000) as f32 / 1000.0 - 1.0;
            half::bf16::from_f32(v * 0.1).to_f32()
        })
        .collect()
}

/// The model's `Var`s on `device` in `dtype`, by name.
fn vars(device: &Device, dtype: DType) -> candle_core::Result<Vec<(String, Var)>> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(k, (name, shape))| {
            let t = Tensor::from_vec(pattern(numel(shape).max(1), k), *shape, &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(device)?;
            Ok((name.to_string(), Var::from_tensor(&t)?))
        })
        .collect()
}

/// Step `step`'s gradients for `vars`: the same values on every device, exactly (a GradStore
/// from a backward pass, each gradient replaced by the step's values).
fn grads(vars: &[(String, Var)], step: usize) -> candle_core::Result<GradStore> {
    let mut loss = Tensor::zeros((), DType::F32, vars[0].1.device())?;
    for (_, v) in vars {
        loss = (loss + v.as_tensor().sum_all()?.to_dtype(DType::F32)?)?;
    }
    let mut store = loss.backward()?;
    for (k, (_, v)) in vars.iter().enumerate() {
        let g = Tensor::from_vec(
            pattern(v.elem_count(), 10 * step + k + 3),
            v.shape(),
            &Device::Cpu,
        )?
        .to_dtype(v.dtype())?
        .to_device(v.device())?;
        store.insert(v.as_tensor(), g);
    }
    Ok(store)
}

/// Every Var's bits (as f32), in name order.
fn bits(vars: &[(String, Var)]) -> candle_core::Result<Vec<u32>> {
    let mut out = Vec::new();
    for (_, v) in vars {
        let values = v
            .as_tensor()
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec1::<f32>()?;
        out.extend(values.into_iter().map(f32::to_bits));
    }
    Ok(out)
}

/// The device address of a CUDA Var's first value.
fn address(var: &Var) -> u64 {
    let (storage, layout) = var.as_tensor().storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        panic!("not a CUDA Var");
    };
    let stream = s.device.cuda_stream();
    let offset = layout.start_offset() as u64;
    match var.dtype() {
        DType::F32 => {
            let slice = s.as_cuda_slice::<f32>().unwrap();
            slice.device_ptr(&stream).0 + 4 * offset
        }
        DType::BF16 => {
            let slice = s.as_cuda_slice::<half::bf16>().unwrap();
            slice.device_ptr(&stream).0 + 2 * offset
        }
        d => panic!("a {d:?} Var"),
    }
}

/// State `k` (1 or 2) of parameter `name`, as bits.
fn state_bits<B: lpmm_optim::backend::Backend>(
    opt: &lpmm_optim::Optimizer<B>,
    name: &str,
    k: usize,
    n: usize,
) -> Vec<u32> {
    let mut v = vec![0f32; n];
    let id = opt.param(name).unwrap().id;
    opt.read(id, lpmm_optim::SlotKind::ALL[k + 1], &mut v)
        .unwrap();
    v.into_iter().map(f32::to_bits).collect()
}

/// Trains the same Vars on CUDA and on the CPU for `steps` steps and compares every bit.
fn same_as_cpu(config: fn() -> LpmmConfig, dtype: DType, steps: usize) {
    let Some(cuda) = device() else {
        return;
    };
    let on_cuda = vars(&cuda, dtype).unwrap();
    let on_cpu = vars(&Device::Cpu, dtype).unwrap();
    let mut opt_cuda = LpmmOptimizer::empty(config()).unwrap();
    opt_cuda.add_vars(on_cuda.clone()).unwrap();
    let mut opt_cpu = LpmmOptimizer::empty(config()).unwrap();
    opt_cpu.add_vars(on_cpu.clone()).unwrap();
    assert_eq!(opt_cuda.device_name(), "cuda:0");
    assert_eq!(opt_cuda.copied_vars(), opt_cpu.copied_vars());
    let addresses: Vec<u64> = on_cuda.iter().map(|(_, v)| address(v)).collect();
    for step in 0..steps {
        let mut g_cuda = grads(&on_cuda, step).unwrap();
        let mut g_cpu = grads(&on_cpu, step).unwrap();
        let r_cuda = opt_cuda.step_grads(&mut g_cuda).unwrap();
        let r_cpu = opt_cpu.step_grads(&mut g_cpu).unwrap();
        assert_eq!(r_cuda, r_cpu, "step {step}'s report");
        assert_eq!(
            bits(&on_cuda).unwrap(),
            bits(&on_cpu).unwrap(),
            "step {step}"
        );
        // Each gradient dropped once its parameter stepped.
        for (_, v) in &on_cuda {
            assert!(g_cuda.get(v.as_tensor()).is_none());
        }
    }
    // Stepped in place: the Vars' storage never moved. No gradient accumulator on either side
    // (stepped from candle's gradients), and where the CPU path holds no parameter bytes (lent
    // Vars), lpmm-cuda holds none either (its other slots are laid out in device pieces, so their
    // byte counts are the device's own).
    let after: Vec<u64> = on_cuda.iter().map(|(_, v)| address(v)).collect();
    assert_eq!(addresses, after);
    let (on_dev, on_host) = (opt_cuda.memory_report(), opt_cpu.memory_report());
    assert_eq!(on_dev.numel(), on_host.numel());
    assert_eq!(on_dev.slot_totals()[1], 0);
    assert_eq!(on_host.slot_totals()[1], 0);
    if on_host.slot_totals()[0] == 0 {
        assert_eq!(on_dev.slot_totals()[0], 0);
    }
    // The optimizer states too, bit for bit (state 1 and 2 of every parameter).
    let states = |opt: &LpmmOptimizer| -> Vec<u32> {
        let mut out = Vec::new();
        for (name, shape) in SHAPES {
            for k in [1, 2] {
                let n = numel(shape).max(1);
                out.extend(match opt.device_name().as_str() {
                    "cpu" => opt.with_optimizer(|o| state_bits(o, name, k, n)).unwrap(),
                    _ => opt
                        .with_cuda_optimizer(|o| state_bits(o, name, k, n))
                        .unwrap(),
                });
            }
        }
        out
    };
    assert_eq!(states(&opt_cuda), states(&opt_cpu));
}

#[test]
fn bf16_vars_with_8bit_adamw_and_stochastic_rounding_equal_the_cpu_path() {
    same_as_cpu(
        || LpmmConfig::from(presets::adamw_8bit_bf16_sr(1e-2)),
        DType::BF16,
        4,
    );
}

#[test]
fn f32_vars_with_8bit_adamw_equal_the_cpu_path() {
    same_as_cpu(
        || LpmmConfig::from(presets::adamw_8bit(1e-2)),
        DType::F32,
        3,
    );
}

#[test]
fn copied_f32_vars_of_bf16_storage_and_clipping_equal_the_cpu_path() {
    // f32 Vars, bf16 storage: lpmm holds the parameter and decodes it into the Var on the device.
    same_as_cpu(
        || {
            LpmmConfig::from(presets::adamw_8bit_bf16_sr(1e-2))
                .with_options(OptimizerOptions::default().with_max_grad_norm(Some(0.05)))
        },
        DType::F32,
        3,
    );
}

#[test]
fn a_checkpoint_of_cuda_vars_resumes_on_the_cpu_bit_exactly() {
    let Some(cuda) = device() else {
        return;
    };
    let config = || LpmmConfig::from(presets::adamw_8bit_bf16_sr(1e-2));
    let on_cuda = vars(&cuda, DType::BF16).unwrap();
    let mut opt_cuda = LpmmOptimizer::empty(config()).unwrap();
    opt_cuda.add_vars(on_cuda.clone()).unwrap();
    for step in 0..2 {
        opt_cuda
            .step_grads(&mut grads(&on_cuda, step).unwrap())
            .unwrap();
    }
    let dir = std::env::temp_dir().join(format!("lpmm-candle-cuda-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ckpt.safetensors");
    opt_cuda.save(&path).unwrap();
    let on_cpu = vars(&Device::Cpu, DType::BF16).unwrap();
    let mut opt_cpu = LpmmOptimizer::empty(config()).unwrap();
    opt_cpu.add_vars(on_cpu.clone()).unwrap();
    opt_cpu.load(&path).unwrap();
    assert_eq!(bits(&on_cuda).unwrap(), bits(&on_cpu).unwrap());
    for step in 2..4 {
        opt_cuda
            .step_grads(&mut grads(&on_cuda, step).unwrap())
            .unwrap();
        opt_cpu
            .step_grads(&mut grads(&on_cpu, step).unwrap())
            .unwrap();
        assert_eq!(
            bits(&on_cuda).unwrap(),
            bits(&on_cpu).unwrap(),
            "step {step}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn vars_on_two_devices_are_refused() {
    let Some(cuda) = device() else {
        return;
    };
    let mut named = vars(&cuda, DType::F32).unwrap();
    let cpu = Var::from_tensor(&Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap()).unwrap();
    named.push(("z.cpu".into(), cpu));
    let mut opt = LpmmOptimizer::empty(LpmmConfig::from(presets::adamw_8bit(1e-2))).unwrap();
    let e = opt.add_vars(named).unwrap_err();
    assert!(e.to_string().contains("one device"), "{e}");
}
