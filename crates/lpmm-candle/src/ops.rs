//! Differentiable layer norm, RMS norm and softmax, built from candle's differentiable tensor
//! operations.
//!
//! candle-nn 0.11's fused operators `candle_nn::ops::layer_norm`, `candle_nn::ops::rms_norm` and
//! `candle_nn::ops::softmax_last_dim` are applied with `apply_op3_no_bwd` / `apply_op2_no_bwd` /
//! `apply_op1_no_bwd`: their output has no backward pass, so a gradient stops there. The module
//! types `candle_nn::LayerNorm` and `candle_nn::RmsNorm` take those fused paths whenever the input
//! is contiguous (and, for `LayerNorm`, has a bias). A model trained through them trains only the
//! parameters after the last such operator; see the crate's documentation, "A warning for candle
//! users".
//!
//! The operators here compute the same values (to f32 rounding) with operations that candle
//! differentiates: [`layer_norm`], [`rms_norm`], [`softmax_last_dim`], and the module types
//! [`LayerNorm`] and [`RmsNorm`], drop-in replacements for candle-nn's (convert with `.into()`, or
//! build with [`LayerNorm::load`] / [`RmsNorm::load`] as with `candle_nn::layer_norm`).
//! They are slower than the fused kernels (a few passes over the activations instead of one).

use candle_core::{D, DType, Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};

/// Computes in f32 for half-precision input, as candle-nn's operators do.
fn widen(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F16 | DType::BF16 => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// Normalises over the last dimension: `(x - mean) / sqrt(var + eps)` when `remove_mean`, else
/// `x / sqrt(mean(x²) + eps)`; then `* weight` and `+ bias` if given (both of the last
/// dimension's size). Differentiable in `x`, `weight` and `bias`.
fn normalize(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
    remove_mean: bool,
) -> Result<Tensor> {
    let size = x.dim(D::Minus1)?;
    if weight.dims1()? != size || bias.is_some_and(|b| b.dims1().ok() != Some(size)) {
        candle_core::bail!(
            "shape mismatch in normalization: x {:?}, weight {:?}, bias {:?}",
            x.shape(),
            weight.shape(),
            bias.map(|b| b.shape())
        );
    }
    let dtype = x.dtype();
    let wide = widen(x)?;
    let centred = if remove_mean {
        wide.broadcast_sub(&wide.mean_keepdim(D::Minus1)?)?
    } else {
        wide
    };
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centred.broadcast_div(&(var + eps)?.sqrt()?)?;
    let y = normed.to_dtype(dtype)?.broadcast_mul(weight)?;
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// Layer norm over the last dimension with gain `weight` and `bias`: the values of
/// `candle_nn::ops::layer_norm`, with a backward pass.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    normalize(x, weight, Some(bias), eps, true)
}

/// RMS norm over the last dimension with gain `weight`: the values of `candle_nn::ops::rms_norm`,
/// with a backward pass.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    normalize(x, weight, None, eps, false)
}

/// Softmax over the last dimension: the values of `candle_nn::ops::softmax_last_dim`, with a
/// backward pass (it is `candle_nn::ops::softmax(x, D::Minus1)`, which candle differentiates).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    candle_nn::ops::softmax(x, D::Minus1)
}

/// A layer norm (or, without mean removal, RMS norm) module that gradients cross: use it in place
/// of `candle_nn::LayerNorm`.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    remove_mean: bool,
    eps: f64,
}

impl LayerNorm {
    /// Layer norm with gain `weight` and `bias`.
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        LayerNorm {
            weight,
            bias: Some(bias),
            remove_mean: true,
            eps,
        }
    }

    /// Layer norm with gain `weight` and no bias.
    pub fn new_no_bias(weight: Tensor, eps: f64) -> Self {
        LayerNorm {
            weight,
            bias: None,
            remove_mean: true,
            eps,
        }
    }

    /// Builds a layer norm of `size` in `vb` as `candle_nn::layer_norm(size, eps, vb)` does: the
    /// variables `weight` (initialised to 1) and `bias` (initialised to 0).
    pub fn load(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(LayerNorm::new(
            vb.get_with_hints(size, "weight", Init::Const(1.0))?,
            vb.get_with_hints(size, "bias", Init::Const(0.0))?,
            eps,
        ))
    }

    /// The gain.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The epsilon added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

impl From<candle_nn::LayerNorm> for LayerNorm {
    /// The same weights, bias, epsilon and mean removal, made differentiable.
    fn from(ln: candle_nn::LayerNorm) -> Self {
        LayerNorm {
            weight: ln.weight().clone(),
            bias: ln.bias().cloned(),
            remove_mean: ln.remove_mean(),
            eps: ln.eps(),
        }
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        normalize(
            x,
            &self.weight,
            self.bias.as_ref(),
            self.eps,
            self.remove_mean,
        )
    }
}

/// An RMS norm module that gradients cross: use it in place of `candle_nn::RmsNorm`.
#[derive(Debug, Clone)]
pub struct RmsNorm(LayerNorm);

impl RmsNorm {
    /// RMS norm with gain `weight`.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm(LayerNorm {
            weight,
            bias: None,
            remove_mean: false,
            eps,
        })
    }

    /// Builds an RMS norm of `size` in `vb` as `candle_nn::rms_norm(size, eps, vb)` does: the
    /// variable `weight`, initialised to 1.
    pub fn load(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(RmsNorm::new(
            vb.get_with_hints(size, "weight", Init::Const(1.0))?,
            eps,
        ))
    }

    /// The gain.
    pub fn weight(&self) -> &Tensor {
        &self.0.weight
    }
}

impl From<candle_nn::RmsNorm> for RmsNorm {
    /// The same weight and epsilon, made differentiable.
    fn from(n: candle_nn::RmsNorm) -> Self {
        RmsNorm::new(n.weight().clone(), n.eps())
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
        (a - b)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()
    }

    /// Deterministic, non-trivial values in [-2, 2).
    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut rng = crate::experiments::Rng::new(seed);
        (0..n).map(|_| rng.uniform() * 4.0 - 2.0).collect()
    }

    fn tensor(n: usize, shape: &[usize], seed: u64, dtype: DType) -> Result<Tensor> {
        Tensor::from_vec(values(n, seed), shape, &Device::Cpu)?.to_dtype(dtype)
    }

    #[test]
    fn forward_values_match_candle_nn_fused_operators() -> Result<()> {
        let x = tensor(4 * 5 * 16, &[4, 5, 16], 1, DType::F32)?;
        let w = tensor(16, &[16], 2, DType::F32)?;
        let b = tensor(16, &[16], 3, DType::F32)?;
        let ln = layer_norm(&x, &w, &b, 1e-5)?;
        let fused = candle_nn::ops::layer_norm(&x, &w, &b, 1e-5)?;
        assert!(max_diff(&ln, &fused)? < 1e-5, "layer norm");
        let module = LayerNorm::from(candle_nn::LayerNorm::new(w.clone(), b.clone(), 1e-5));
        assert!(max_diff(&module.forward(&x)?, &fused)? < 1e-5, "module");
        let rms = rms_norm(&x, &w, 1e-5)?;
        let fused = candle_nn::ops::rms_norm(&x, &w, 1e-5)?;
        assert!(max_diff(&rms, &fused)? < 1e-5, "rms norm");
        let s = softmax_last_dim(&(x.clone() * 4.0)?)?;
        let fused = candle_nn::ops::softmax_last_dim(&(x * 4.0)?)?;
        assert!(max_diff(&s, &fused)? < 1e-6, "softmax");
        Ok(())
    }

    /// d/dθ sum(f(θ) * r) by autograd against central finite differences, in f64.
    fn check_gradient(
        vars: &[Var],
        f: &dyn Fn() -> Result<Tensor>,
        r: &Tensor,
        what: &str,
    ) -> Result<()> {
        let loss = || f()?.mul(r)?.sum_all()?.to_scalar::<f64>();
        let grads = f()?.mul(r)?.sum_all()?.backward()?;
        for (k, var) in vars.iter().enumerate() {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{what}: no gradient for input {k}"))
                .flatten_all()?
                .to_vec1::<f64>()?;
            let v0 = var.as_tensor().flatten_all()?.to_vec1::<f64>()?;
            let h = 1e-6;
            for i in 0..v0.len() {
                let mut v = v0.clone();
                v[i] = v0[i] + h;
                var.set(&Tensor::from_vec(v.clone(), var.shape(), &Device::Cpu)?)?;
                let up = loss()?;
                v[i] = v0[i] - h;
                var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu)?)?;
                let down = loss()?;
                var.set(&Tensor::from_vec(v0.clone(), var.shape(), &Device::Cpu)?)?;
                let numeric = (up - down) / (2.0 * h);
                assert!(
                    (g[i] - numeric).abs() < 1e-6 * (1.0 + numeric.abs()),
                    "{what}, input {k}, element {i}: autograd {} vs finite difference {numeric}",
                    g[i]
                );
            }
        }
        Ok(())
    }

    #[test]
    fn gradients_match_finite_differences() -> Result<()> {
        let x = Var::from_tensor(&tensor(3 * 8, &[3, 8], 11, DType::F64)?)?;
        let w = Var::from_tensor(&tensor(8, &[8], 12, DType::F64)?)?;
        let b = Var::from_tensor(&tensor(8, &[8], 13, DType::F64)?)?;
        let r = tensor(3 * 8, &[3, 8], 14, DType::F64)?;
        check_gradient(
            &[x.clone(), w.clone(), b.clone()],
            &|| layer_norm(&x, &w, &b, 1e-5),
            &r,
            "layer norm",
        )?;
        check_gradient(
            &[x.clone(), w.clone()],
            &|| rms_norm(&x, &w, 1e-5),
            &r,
            "rms norm",
        )?;
        check_gradient(&[x.clone()], &|| softmax_last_dim(&x), &r, "softmax")?;
        Ok(())
    }

    /// The closed forms: layer norm dx = (w·g - mean(w·g) - x̂·mean(w·g·x̂)) / σ, dw = Σ g·x̂,
    /// db = Σ g; softmax dx = s·(g - Σ g·s).
    #[test]
    fn gradients_match_the_closed_forms() -> Result<()> {
        let (rows, n) = (5, 12);
        let xs = values(rows * n, 21);
        let ws = values(n, 22);
        let gs = values(rows * n, 23);
        let x = Var::from_tensor(&Tensor::from_vec(xs.clone(), (rows, n), &Device::Cpu)?)?;
        let w = Var::from_tensor(&Tensor::from_vec(ws.clone(), n, &Device::Cpu)?)?;
        let b = Var::zeros(n, DType::F64, &Device::Cpu)?;
        let g = Tensor::from_vec(gs.clone(), (rows, n), &Device::Cpu)?;
        let eps = 1e-5;
        let grads = layer_norm(&x, &w, &b, eps)?
            .mul(&g)?
            .sum_all()?
            .backward()?;
        let dx = grads.get(&x).expect("dx").flatten_all()?.to_vec1::<f64>()?;
        let dw = grads.get(&w).expect("dw").to_vec1::<f64>()?;
        let db = grads.get(&b).expect("db").to_vec1::<f64>()?;
        let (mut dw_ref, mut db_ref) = (vec![0.0; n], vec![0.0; n]);
        for r in 0..rows {
            let row = &xs[r * n..(r + 1) * n];
            let gr = &gs[r * n..(r + 1) * n];
            let mean = row.iter().sum::<f64>() / n as f64;
            let sigma =
                (row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64 + eps).sqrt();
            let xh: Vec<f64> = row.iter().map(|v| (v - mean) / sigma).collect();
            let wg: Vec<f64> = (0..n).map(|i| ws[i] * gr[i]).collect();
            let m1 = wg.iter().sum::<f64>() / n as f64;
            let m2 = (0..n).map(|i| wg[i] * xh[i]).sum::<f64>() / n as f64;
            for i in 0..n {
                let want = (wg[i] - m1 - xh[i] * m2) / sigma;
                assert!((dx[r * n + i] - want).abs() < 1e-9, "dx[{r},{i}]");
                dw_ref[i] += gr[i] * xh[i];
                db_ref[i] += gr[i];
            }
        }
        for i in 0..n {
            assert!((dw[i] - dw_ref[i]).abs() < 1e-9, "dw[{i}]");
            assert!((db[i] - db_ref[i]).abs() < 1e-9, "db[{i}]");
        }
        let grads = softmax_last_dim(&x)?.mul(&g)?.sum_all()?.backward()?;
        let dx = grads.get(&x).expect("dx").flatten_all()?.to_vec1::<f64>()?;
        for r in 0..rows {
            let row = &xs[r * n..(r + 1) * n];
            let gr = &gs[r * n..(r + 1) * n];
            let max = row.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = row.iter().map(|v| (v - max).exp()).sum();
            let s: Vec<f64> = row.iter().map(|v| (v - max).exp() / z).collect();
            let gs_dot: f64 = (0..n).map(|i| gr[i] * s[i]).sum();
            for i in 0..n {
                let want = s[i] * (gr[i] - gs_dot);
                assert!((dx[r * n + i] - want).abs() < 1e-12, "softmax dx[{r},{i}]");
            }
        }
        Ok(())
    }

    /// What the warning says of candle-nn 0.11: its fused operators, and the module types on
    /// contiguous input, pass no gradient. If this fails, candle-nn has gained backward passes
    /// and the warning in the crate's documentation needs updating.
    #[test]
    fn candle_nn_fused_operators_pass_no_gradient() -> Result<()> {
        let x = Var::from_tensor(&tensor(2 * 8, &[2, 8], 31, DType::F32)?)?;
        let w = Var::from_tensor(&tensor(8, &[8], 32, DType::F32)?)?;
        let b = Var::from_tensor(&tensor(8, &[8], 33, DType::F32)?)?;
        let r = tensor(2 * 8, &[2, 8], 34, DType::F32)?;
        let through = |y: Tensor| -> Result<usize> {
            let grads = y.mul(&r)?.sum_all()?.backward()?;
            Ok([&x, &w, &b]
                .iter()
                .filter(|v| grads.get(v.as_tensor()).is_some())
                .count())
        };
        let module = candle_nn::LayerNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), 1e-5);
        let rms = candle_nn::RmsNorm::new(w.as_tensor().clone(), 1e-5);
        let fused = [
            (
                "ops::layer_norm",
                candle_nn::ops::layer_norm(&x, &w, &b, 1e-5)?,
            ),
            ("ops::rms_norm", candle_nn::ops::rms_norm(&x, &w, 1e-5)?),
            (
                "ops::softmax_last_dim",
                candle_nn::ops::softmax_last_dim(&x)?,
            ),
            ("LayerNorm::forward", module.forward(&x)?),
            ("RmsNorm::forward", rms.forward(&x)?),
        ];
        for (name, y) in fused {
            assert_eq!(through(y)?, 0, "candle_nn::{name} now has a backward pass");
        }
        // Ours: every input gets a gradient.
        assert_eq!(through(layer_norm(&x, &w, &b, 1e-5)?)?, 3);
        assert_eq!(through(LayerNorm::from(module).forward(&x)?)?, 3);
        assert_eq!(through(RmsNorm::from(rms).forward(&x)?)?, 2);
        assert_eq!(through(softmax_last_dim(&x)?)?, 1);
        Ok(())
    }
}
