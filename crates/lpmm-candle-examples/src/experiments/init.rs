//! Seeded numbers: the generator behind initialisation, data order and sampling, and a
//! `VarBuilder` whose variables draw from it.

use rand_core::{Rng as _, SeedableRng};
use rand_xoshiro::SplitMix64;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{VarBuilder, VarMap};

/// A small deterministic generator (SplitMix64 from `rand_xoshiro`) for initialisation and data
/// order, so every preset sees the same numbers.
#[derive(Debug, Clone)]
pub struct Rng(SplitMix64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(SplitMix64::seed_from_u64(seed ^ 0x9E37_79B9_7F4A_7C15))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize
    }

    /// Standard normal (Box-Muller, one value per call).
    pub fn normal(&mut self) -> f64 {
        let u = 1.0 - self.uniform(); // in (0, 1]
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

/// A `VarBuilder` whose new variables (kept in `varmap`) take the distribution candle-nn's
/// initialiser would give them (constant, uniform, normal, Kaiming) but draw their values from
/// this module's generator, seeded by `seed` and the variable's name: the same bits on every run
/// and whatever the order the model asks for them. (candle's own CPU initialiser cannot be
/// seeded.)
pub fn seeded_var_builder(varmap: &VarMap, seed: u64, device: &Device) -> VarBuilder<'static> {
    VarBuilder::from_backend(
        Box::new(SeededInit {
            varmap: varmap.clone(),
            seed,
        }),
        DType::F32,
        device.clone(),
    )
}

/// The backend of [`seeded_var_builder`].
struct SeededInit {
    varmap: VarMap,
    seed: u64,
}

/// FNV-1a of a name, to key a variable's random stream.
fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl candle_nn::var_builder::SimpleBackend for SeededInit {
    fn get(
        &self,
        shape: candle_core::Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        use candle_nn::init::NormalOrUniform;
        let mut data = self
            .varmap
            .data()
            .lock()
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        if let Some(var) = data.get(name) {
            if var.shape() != &shape {
                candle_core::bail!("{name}: shape {:?}, asked for {shape:?}", var.shape());
            }
            return Ok(var.as_tensor().clone());
        }
        let mut rng = Rng::new(self.seed ^ name_key(name));
        let n = shape.elem_count();
        let uniform = |rng: &mut Rng, lo: f64, up: f64| lo + (up - lo) * rng.uniform();
        let values: Vec<f64> = match init {
            candle_nn::Init::Const(c) => vec![c; n],
            candle_nn::Init::Uniform { lo, up } => {
                (0..n).map(|_| uniform(&mut rng, lo, up)).collect()
            }
            candle_nn::Init::Randn { mean, stdev } => {
                (0..n).map(|_| mean + stdev * rng.normal()).collect()
            }
            candle_nn::Init::Kaiming {
                dist,
                fan,
                non_linearity,
            } => {
                let std = non_linearity.gain() / (fan.for_shape(&shape) as f64).sqrt();
                match dist {
                    NormalOrUniform::Normal => (0..n).map(|_| std * rng.normal()).collect(),
                    NormalOrUniform::Uniform => {
                        let bound = 3f64.sqrt() * std;
                        (0..n).map(|_| uniform(&mut rng, -bound, bound)).collect()
                    }
                }
            }
        };
        let var =
            candle_core::Var::from_tensor(&Tensor::from_vec(values, shape, dev)?.to_dtype(dtype)?)?;
        let tensor = var.as_tensor().clone();
        data.insert(name.to_string(), var);
        Ok(tensor)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        candle_core::bail!("{name}: a seeded VarBuilder creates variables; ask with a shape")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.varmap
            .data()
            .lock()
            .is_ok_and(|data| data.contains_key(name))
    }
}
