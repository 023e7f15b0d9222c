//! The reference the Python tests compare `lpmm.torch` with, bit for bit: lpmm-optim's Rust API as
//! a Rust user calls it (parameters held by lpmm, gradients from host slices, `Optimizer::save`),
//! none of this crate's engine.
//!
//! ```text
//! cargo run --release -p lpmm-python --example reference -- SPEC.json
//! ```
//!
//! `SPEC.json` (written by `tests/test_bits.py`): `{"options": OptimizerOptions, "steps": N,
//! "checkpoint": PATH, "params": [{"name", "shape", "config": ParamConfig, "init": FILE,
//! "grads": [FILE per step], "dtype": "f32" | "bf16"}]}`; each file holds the values as
//! little-endian bytes of `dtype`. The checkpoint is `Optimizer::save`'s safetensors file: every
//! parameter's slots after the steps.

use lpmm_optim::Checkpoint;
use std::error::Error;

use half::bf16;
use lpmm_optim::backend::HostValues;
use lpmm_optim::{
    Gradients, OptimError, Optimizer, OptimizerOptions, ParamConfig, ParamId, Step, WithGradient,
};
use serde::Deserialize;

#[derive(Deserialize)]
struct Spec {
    options: OptimizerOptions,
    steps: usize,
    checkpoint: String,
    params: Vec<Param>,
}

#[derive(Deserialize)]
struct Param {
    name: String,
    shape: Vec<usize>,
    config: ParamConfig,
    init: String,
    grads: Vec<String>,
    dtype: String,
}

/// Values of one file, in their dtype.
enum Values {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl Values {
    fn read(path: &str, dtype: &str) -> Result<Self, Box<dyn Error>> {
        let bytes = std::fs::read(path)?;
        Ok(match dtype {
            "f32" => Values::F32(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            "bf16" => Values::Bf16(
                bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                    .collect(),
            ),
            other => return Err(format!("dtype {other}").into()),
        })
    }

    fn host(&self) -> HostValues<'_> {
        match self {
            Values::F32(v) => HostValues::F32(v),
            Values::Bf16(v) => HostValues::Bf16(v),
        }
    }

    fn to_f32(&self) -> Vec<f32> {
        match self {
            Values::F32(v) => v.clone(),
            Values::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
}

/// One step's gradients, by parameter.
struct StepGrads(Vec<Values>);

impl Gradients<lpmm_optim::Cpu> for StepGrads {
    fn gradient(
        &mut self,
        id: ParamId,
        f: &mut WithGradient<'_, lpmm_optim::Cpu>,
    ) -> Result<(), OptimError> {
        f(self.0.get(id.index()).map(Values::host))
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: reference SPEC.json")?;
    let spec: Spec = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let mut opt = Optimizer::new(spec.options)?;
    for p in &spec.params {
        // One group per parameter, with its configuration (the learning rate is the config's).
        let group = opt.add_group(p.config)?;
        let init = Values::read(&p.init, &p.dtype)?.to_f32();
        opt.add_param_with(&p.name, &p.shape, &init, group, p.config)?;
    }
    for step in 0..spec.steps {
        let grads = spec
            .params
            .iter()
            .map(|p| Values::read(&p.grads[step], &p.dtype))
            .collect::<Result<Vec<_>, _>>()?;
        let report = opt.step(Step::given(&mut StepGrads(grads)))?;
        if report.skipped {
            return Err(format!("step {step} was skipped").into());
        }
    }
    opt.save(&spec.checkpoint, Checkpoint::new())?;
    Ok(())
}
