//! Differentiable layer norm, RMS norm and softmax.
//!
//! candle-nn 0.11's fused operators `candle_nn::ops::layer_norm`, `candle_nn::ops::rms_norm` and
//! `candle_nn::ops::softmax_last_dim` are applied with `apply_op3_no_bwd` / `apply_op2_no_bwd` /
//! `apply_op1_no_bwd`: their output has no backward pass, so a gradient stops there. The module
//! types `candle_nn::LayerNorm` and `candle_nn::RmsNorm` take those fused paths whenever the input
//! is contiguous (and, for `LayerNorm`, has a bias). A model trained through them trains only the
//! parameters after the last such operator (the optimizer's step reports and warns about the
//! parameters left without a gradient); see the crate's documentation, "Does my model train?".
//!
//! The operators here compute the same values (to f32 rounding) and have a backward pass:
//! [`layer_norm`], [`rms_norm`], [`softmax_last_dim`], [`causal_softmax`] (attention weights with
//! the scale and the causal mask inside), and the module types [`LayerNorm`] and [`RmsNorm`],
//! drop-in replacements for candle-nn's (convert with `.into()`, or build with
//! [`LayerNorm::load`] / [`RmsNorm::load`] as with `candle_nn::layer_norm`). f32 tensors on the
//! CPU take fused kernels (one pass forward, one backward, as custom operations with their own
//! backward); every other dtype and device is computed with candle's differentiable tensor
//! operations (several passes), the same formulas.

use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, D, DType, Layout, Module, Result, Shape, Tensor,
};
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
    if size == 0 {
        // Nothing to normalise (candle's reductions refuse an empty dimension): the empty result,
        // through the same differentiable operations.
        let y = x.broadcast_mul(weight)?;
        return match bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        };
    }
    if fused(x) && weight.dtype() == DType::F32 && weight.device().is_cpu() {
        let y = x.contiguous()?.apply_op2(
            &weight.contiguous()?,
            NormOp {
                eps: eps as f32,
                remove_mean,
            },
        )?;
        return match bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        };
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
    if x.dims().last() == Some(&0) {
        return Ok(x.clone()); // no entries to weigh (candle's reductions refuse the dimension)
    }
    if fused(x) {
        x.contiguous()?.apply_op1(SoftmaxOp)
    } else {
        candle_nn::ops::softmax(x, D::Minus1)
    }
}

/// Causal attention weights: the softmax over the last dimension of `scale * x`, where `x` holds
/// attention scores `(..., queries, keys)` and key `j` is hidden from query `i` when
/// `j > i + keys - queries` (the queries are the last `queries` positions of the keys). The
/// values of `softmax_last_dim(scale * x + mask)` with the mask's hidden entries at -inf, with a
/// backward pass; f32 on the CPU skips the hidden entries in one fused pass.
pub fn causal_softmax(x: &Tensor, scale: f64) -> Result<Tensor> {
    let dims = x.dims();
    if dims.len() < 2 {
        candle_core::bail!(
            "causal_softmax needs (..., queries, keys), got {:?}",
            x.shape()
        );
    }
    let (q, k) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    if q > k {
        candle_core::bail!("causal_softmax: {q} queries for {k} keys");
    }
    if k == 0 {
        return Ok(x.clone()); // no keys to weigh
    }
    if fused(x) {
        return x.contiguous()?.apply_op1(CausalSoftmaxOp {
            scale: scale as f32,
        });
    }
    let mask: Vec<f32> = (0..q * k)
        .map(|e| {
            if e % k > e / k + (k - q) {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (q, k), x.device())?.to_dtype(x.dtype())?;
    softmax_last_dim(&(x * scale)?.broadcast_add(&mask)?)
}

/// Whether `x` takes the fused CPU kernels (f32 on the CPU).
fn fused(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// The contiguous f32 slice of a CPU storage.
fn cpu_slice<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&storage.as_slice::<f32>()?[start..end]),
        None => candle_core::bail!("lpmm-candle's fused kernels need contiguous input"),
    }
}

/// A tensor's values as a contiguous f32 vector.
fn values_of(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

/// `(x - mean) / sqrt(var + eps) * weight` (or `x / sqrt(mean(x²) + eps) * weight`) over the
/// last dimension, f32 on the CPU, with its backward pass.
struct NormOp {
    eps: f32,
    remove_mean: bool,
}

impl NormOp {
    /// The row's mean (0 without mean removal) and 1 / sqrt(var + eps).
    fn stats(&self, row: &[f32]) -> (f32, f32) {
        let n = row.len() as f32;
        let mean = if self.remove_mean {
            row.iter().sum::<f32>() / n
        } else {
            0.0
        };
        let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() / n;
        (mean, 1.0 / (var + self.eps).sqrt())
    }
}

impl CustomOp2 for NormOp {
    fn name(&self) -> &'static str {
        "lpmm-candle-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (cpu_slice(s1, l1)?, cpu_slice(s2, l2)?);
        let n = w.len();
        let mut y = vec![0f32; x.len()];
        for (row, out) in x.chunks_exact(n).zip(y.chunks_exact_mut(n)) {
            let (mean, rstd) = self.stats(row);
            for ((o, &v), &g) in out.iter_mut().zip(row).zip(w) {
                *o = (v - mean) * rstd * g;
            }
        }
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    /// With x̂ the normalised input and g the incoming gradient: dw = Σ_rows g·x̂, and
    /// dx = (w·g - mean(w·g) - x̂·mean(w·g·x̂)) / σ (without the `mean(w·g)` term for RMS norm).
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (xs, ws, gs) = (values_of(x)?, values_of(w)?, values_of(grad)?);
        let n = ws.len();
        let mut dx = vec![0f32; xs.len()];
        let mut dw = vec![0f32; n];
        let mut wg = vec![0f32; n];
        let mut xh = vec![0f32; n];
        for ((row, g), out) in xs
            .chunks_exact(n)
            .zip(gs.chunks_exact(n))
            .zip(dx.chunks_exact_mut(n))
        {
            let (mean, rstd) = self.stats(row);
            let (mut m1, mut m2) = (0f32, 0f32);
            for i in 0..n {
                xh[i] = (row[i] - mean) * rstd;
                wg[i] = ws[i] * g[i];
                dw[i] += g[i] * xh[i];
                m1 += wg[i];
                m2 += wg[i] * xh[i];
            }
            let m1 = if self.remove_mean { m1 / n as f32 } else { 0.0 };
            let m2 = m2 / n as f32;
            for i in 0..n {
                out[i] = (wg[i] - m1 - xh[i] * m2) * rstd;
            }
        }
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), x.device())?),
            Some(Tensor::from_vec(dw, w.shape(), w.device())?),
        ))
    }
}

/// [`causal_softmax`], f32 on the CPU, with its backward pass.
struct CausalSoftmaxOp {
    scale: f32,
}

impl CustomOp1 for CausalSoftmaxOp {
    fn name(&self) -> &'static str {
        "lpmm-candle-causal-softmax"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = cpu_slice(storage, layout)?;
        let dims = layout.dims();
        let (q, k) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        let mut y = vec![0f32; x.len()];
        for (r, (row, out)) in x.chunks_exact(k).zip(y.chunks_exact_mut(k)).enumerate() {
            let seen = r % q + (k - q) + 1;
            let (row, out) = (&row[..seen], &mut out[..seen]);
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (o, &v) in out.iter_mut().zip(row) {
                *o = ((v - max) * self.scale).exp();
                sum += *o;
            }
            for o in out.iter_mut() {
                *o /= sum;
            }
        }
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    /// dx = scale · s·(g - Σ g·s), with s the weights (0 where hidden).
    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (s, g) = (values_of(res)?, values_of(grad)?);
        let k = res.dims().last().copied().unwrap_or(1).max(1);
        let mut dx = vec![0f32; s.len()];
        for ((sr, gr), out) in s
            .chunks_exact(k)
            .zip(g.chunks_exact(k))
            .zip(dx.chunks_exact_mut(k))
        {
            let dot: f32 = sr.iter().zip(gr).map(|(a, b)| a * b).sum();
            for ((o, &a), &b) in out.iter_mut().zip(sr).zip(gr) {
                *o = self.scale * a * (b - dot);
            }
        }
        Ok(Some(Tensor::from_vec(dx, res.shape(), res.device())?))
    }
}

/// Softmax over the last dimension, f32 on the CPU, with its backward pass.
struct SoftmaxOp;

impl CustomOp1 for SoftmaxOp {
    fn name(&self) -> &'static str {
        "lpmm-candle-softmax"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = cpu_slice(storage, layout)?;
        let n = layout.dims().last().copied().unwrap_or(1).max(1);
        let mut y = vec![0f32; x.len()];
        for (row, out) in x.chunks_exact(n).zip(y.chunks_exact_mut(n)) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (o, &v) in out.iter_mut().zip(row) {
                *o = (v - max).exp();
                sum += *o;
            }
            for o in out.iter_mut() {
                *o /= sum;
            }
        }
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    /// dx = s·(g - Σ g·s), with s the softmax.
    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (s, g) = (values_of(res)?, values_of(grad)?);
        let n = res.dims().last().copied().unwrap_or(1).max(1);
        let mut dx = vec![0f32; s.len()];
        for ((sr, gr), out) in s
            .chunks_exact(n)
            .zip(g.chunks_exact(n))
            .zip(dx.chunks_exact_mut(n))
        {
            let dot: f32 = sr.iter().zip(gr).map(|(a, b)| a * b).sum();
            for ((o, &a), &b) in out.iter_mut().zip(sr).zip(gr) {
                *o = a * (b - dot);
            }
        }
        Ok(Some(Tensor::from_vec(dx, res.shape(), res.device())?))
    }
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

    /// Builds a layer norm of `size` without bias in `vb` as
    /// `candle_nn::layer_norm_no_bias(size, eps, vb)` does: the variable `weight`, initialised
    /// to 1.
    pub fn load_no_bias(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(LayerNorm::new_no_bias(
            vb.get_with_hints(size, "weight", Init::Const(1.0))?,
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
        use rand_core::{Rng as _, SeedableRng};
        let mut rng = rand_xoshiro::SplitMix64::seed_from_u64(seed ^ 0x9E37_79B9_7F4A_7C15);
        (0..n)
            .map(|_| (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0)
            .collect()
    }

    fn tensor(n: usize, shape: &[usize], seed: u64, dtype: DType) -> Result<Tensor> {
        Tensor::from_vec(values(n, seed), shape, &Device::Cpu)?.to_dtype(dtype)
    }

    #[test]
    fn an_empty_last_dimension_gives_an_empty_result_not_a_panic() -> Result<()> {
        // The fused kernels cut the data into rows of the last dimension: 0 panicked there.
        let x = Tensor::zeros((2, 0), DType::F32, &Device::Cpu)?;
        let w = Tensor::ones(0, DType::F32, &Device::Cpu)?;
        let b = Tensor::zeros(0, DType::F32, &Device::Cpu)?;
        assert_eq!(rms_norm(&x, &w, 1e-5)?.dims(), [2, 0]);
        assert_eq!(layer_norm(&x, &w, &b, 1e-5)?.dims(), [2, 0]);
        assert_eq!(RmsNorm::new(w.clone(), 1e-5).forward(&x)?.dims(), [2, 0]);
        assert_eq!(softmax_last_dim(&x)?.dims(), [2, 0]);
        let scores = Tensor::zeros((1, 0, 0), DType::F32, &Device::Cpu)?;
        assert_eq!(causal_softmax(&scores, 1.0)?.dims(), [1, 0, 0]);
        Ok(())
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
        // Causal: the same as adding a mask of -inf above the diagonal, for square scores and
        // for the last 3 queries of 5 keys.
        let x = tensor(2 * 5 * 5, &[2, 5, 5], 5, DType::F32)?;
        for (queries, from) in [(5, 0), (3, 2)] {
            let xq = x.narrow(1, from, queries)?;
            let mask: Vec<f32> = (0..queries * 5)
                .map(|e| {
                    if e % 5 > e / 5 + from {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
                .collect();
            let mask = Tensor::from_vec(mask, (queries, 5), &Device::Cpu)?;
            let want = candle_nn::ops::softmax_last_dim(&(&xq * 0.7)?.broadcast_add(&mask)?)?;
            let got = causal_softmax(&xq, 0.7)?;
            assert!(
                max_diff(&got, &want)? < 1e-6,
                "causal softmax, {queries} queries"
            );
            let row0 = got.get(0)?.get(0)?.to_vec1::<f32>()?;
            assert_eq!(
                row0[from + 1..].iter().filter(|&&v| v == 0.0).count(),
                4 - from
            );
        }
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
        check_gradient(
            std::slice::from_ref(&x),
            &|| softmax_last_dim(&x),
            &r,
            "softmax",
        )?;
        let sq = Var::from_tensor(&tensor(2 * 5 * 5, &[2, 5, 5], 15, DType::F64)?)?;
        let rq = tensor(2 * 5 * 5, &[2, 5, 5], 16, DType::F64)?;
        check_gradient(
            std::slice::from_ref(&sq),
            &|| causal_softmax(&sq, 0.7),
            &rq,
            "causal softmax",
        )?;
        Ok(())
    }

    /// The closed forms: layer norm dx = (w·g - mean(w·g) - x̂·mean(w·g·x̂)) / σ, dw = Σ g·x̂,
    /// db = Σ g; softmax dx = s·(g - Σ g·s). In f64 (candle's operations) and in f32 (the fused
    /// CPU kernels), with the input transposed so that it is not contiguous.
    #[test]
    fn gradients_match_the_closed_forms() -> Result<()> {
        for (dtype, tol) in [(DType::F64, 1e-9), (DType::F32, 2e-5)] {
            closed_forms(dtype, tol)?;
        }
        Ok(())
    }

    fn closed_forms(dtype: DType, tol: f64) -> Result<()> {
        let (rows, n) = (5, 12);
        let xs = values(rows * n, 21);
        let ws = values(n, 22);
        let gs = values(rows * n, 23);
        let dev = Device::Cpu;
        // x is stored transposed: the (rows, n) view is not contiguous.
        let xt: Vec<f64> = (0..n * rows)
            .map(|k| xs[(k % rows) * n + k / rows])
            .collect();
        let x = Var::from_tensor(&Tensor::from_vec(xt, (n, rows), &dev)?.to_dtype(dtype)?)?;
        let xv = x.t()?;
        assert!(!xv.is_contiguous());
        let w = Var::from_tensor(&Tensor::from_vec(ws.clone(), n, &dev)?.to_dtype(dtype)?)?;
        let b = Var::zeros(n, dtype, &dev)?;
        let g = Tensor::from_vec(gs.clone(), (rows, n), &dev)?.to_dtype(dtype)?;
        let eps = 1e-5;
        let f64s = |t: Option<&Tensor>, what: &str| -> Result<Vec<f64>> {
            t.unwrap_or_else(|| panic!("{dtype:?}: no gradient for {what}"))
                .to_dtype(DType::F64)?
                .flatten_all()?
                .to_vec1::<f64>()
        };
        let grads = layer_norm(&xv, &w, &b, eps)?
            .mul(&g)?
            .sum_all()?
            .backward()?;
        // The gradient of x is laid out as x is: transposed.
        let dx = f64s(grads.get(&x).map(|t| t.t().unwrap()).as_ref(), "x")?;
        let dw = f64s(grads.get(&w), "w")?;
        let db = f64s(grads.get(&b), "b")?;
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
                assert!(
                    (dx[r * n + i] - want).abs() < tol * (1.0 + want.abs()),
                    "{dtype:?}: dx[{r},{i}] {} vs {want}",
                    dx[r * n + i]
                );
                dw_ref[i] += gr[i] * xh[i];
                db_ref[i] += gr[i];
            }
        }
        for i in 0..n {
            assert!(
                (dw[i] - dw_ref[i]).abs() < tol * (1.0 + dw_ref[i].abs()),
                "{dtype:?}: dw[{i}]"
            );
            assert!(
                (db[i] - db_ref[i]).abs() < tol * (1.0 + db_ref[i].abs()),
                "{dtype:?}: db[{i}]"
            );
        }
        let grads = softmax_last_dim(&xv)?.mul(&g)?.sum_all()?.backward()?;
        let dx = f64s(grads.get(&x).map(|t| t.t().unwrap()).as_ref(), "x")?;
        for r in 0..rows {
            let row = &xs[r * n..(r + 1) * n];
            let gr = &gs[r * n..(r + 1) * n];
            let max = row.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = row.iter().map(|v| (v - max).exp()).sum();
            let s: Vec<f64> = row.iter().map(|v| (v - max).exp() / z).collect();
            let gs_dot: f64 = (0..n).map(|i| gr[i] * s[i]).sum();
            for i in 0..n {
                let want = s[i] * (gr[i] - gs_dot);
                assert!(
                    (dx[r * n + i] - want).abs() < tol,
                    "{dtype:?}: softmax dx[{r},{i}]"
                );
            }
        }
        Ok(())
    }

    /// The fused f32 kernels and candle's operations in f64 agree on values and on every
    /// gradient (layer norm with and without bias, RMS norm, softmax), on a 3-d input.
    #[test]
    fn fused_kernels_match_the_differentiable_composition() -> Result<()> {
        let shape = [3, 4, 16];
        let n = 3 * 4 * 16;
        let r = tensor(n, &shape, 44, DType::F64)?;
        type Op = fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;
        let cases: [(&str, Op); 6] = [
            ("layer norm", |x, w, b| layer_norm(x, w, b, 1e-5)),
            ("layer norm, no bias", |x, w, _| {
                LayerNorm::new_no_bias(w.clone(), 1e-5).forward(x)
            }),
            ("rms norm", |x, w, _| rms_norm(x, w, 1e-5)),
            ("softmax", |x, _, _| softmax_last_dim(&(x * 3.0)?)),
            ("causal softmax", |x, _, _| causal_softmax(x, 3.0)),
            ("causal softmax, 2 of 4 queries", |x, _, _| {
                causal_softmax(&x.narrow(2, 0, 4)?.narrow(1, 2, 2)?, 0.5)
            }),
        ];
        for (what, op) in cases {
            let mut outs = Vec::new();
            for dtype in [DType::F64, DType::F32] {
                let x = Var::from_tensor(&tensor(n, &shape, 41, dtype)?)?;
                let w = Var::from_tensor(&tensor(16, &[16], 42, dtype)?)?;
                let b = Var::from_tensor(&tensor(16, &[16], 43, dtype)?)?;
                let y = op(&x, &w, &b)?;
                // r cut to y's shape (smaller where the case narrows its input).
                let ry = r.narrow(1, 0, y.dim(1)?)?.narrow(2, 0, y.dim(2)?)?;
                let grads = y.mul(&ry.to_dtype(dtype)?)?.sum_all()?.backward()?;
                let grad = |v: &Var| -> Result<Option<Tensor>> {
                    grads
                        .get(v.as_tensor())
                        .map(|g| g.to_dtype(DType::F64))
                        .transpose()
                };
                outs.push((y.to_dtype(DType::F64)?, grad(&x)?, grad(&w)?, grad(&b)?));
            }
            let (a, b) = (&outs[0], &outs[1]);
            assert!(max_diff(&a.0, &b.0)? < 1e-5, "{what}: values");
            for (k, (ga, gb)) in [(&a.1, &b.1), (&a.2, &b.2), (&a.3, &b.3)]
                .into_iter()
                .enumerate()
            {
                match (ga, gb) {
                    (Some(ga), Some(gb)) => {
                        assert!(max_diff(ga, gb)? < 1e-4, "{what}: gradient of input {k}")
                    }
                    (None, None) => {}
                    _ => panic!("{what}: input {k} has a gradient in one dtype only"),
                }
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
