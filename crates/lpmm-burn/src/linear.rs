//! [`LpmmLinear`]: a linear layer whose weight lives only in lpmm's storage (8-bit, 4-bit,
//! bf16, ...), materialised in full precision one layer at a time.
//!
//! The weight is a parameter of the [`LpmmOptimizer`], not of the module. The forward pass
//! decodes it into a temporary tensor, multiplies, and drops it; the backward pass (a burn
//! custom autodiff operation) decodes it again for the input's gradient, computes the weight's
//! gradient and adds it straight into lpmm's gradient accumulator, and drops both. So the
//! full-precision weight and its gradient exist for one layer at a time, and the model memory of
//! the layer is what its lpmm storage takes (LPMM-SGDM: about 3.2 bytes per weight in all).
//!
//! A zero-sized anchor parameter ties the operation to the graph (so the backward pass runs for
//! the first layer too, whose input needs no gradient); it takes no memory and no gradient.

use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_backend::{Backend, tensor::FloatTensor};
use burn_core as burn;
use burn_core::backend::DispatchDevice;
use burn_core::module::{Module, Param, ParamId as BurnId};
use burn_core::tensor::{Device, GradientCheckpointingStrategy, Tensor};
use burn_dispatch::{DispatchKindConversion, DispatchTensor};

use crate::{BurnError, LpmmOptimizer};

/// A handle to a layer weight held by an optimizer.
#[derive(Clone, Debug)]
pub struct LpmmWeight {
    optim: LpmmOptimizer,
    id: BurnId,
    shape: [usize; 2],
    device: Device,
}

impl LpmmWeight {
    /// `[d_input, d_output]`.
    pub fn shape(&self) -> [usize; 2] {
        self.shape
    }

    /// Its id in the optimizer's records.
    pub fn id(&self) -> BurnId {
        self.id
    }

    /// The weight decoded into a new f32 tensor (what the forward pass multiplies by).
    pub fn decode(&self) -> Result<Tensor<2>, BurnError> {
        let mut shared = self.optim.lock();
        if shared.pending_external(self.id) {
            return Err(BurnError::Record(
                "a record was loaded for this layer's optimizer: call LpmmOptimizer::attach(model) before the forward pass"
                    .into(),
            ));
        }
        let engine = shared.engine(&self.device)?;
        on_engine!(engine, core => core.decode_external(self.id, &self.device))
    }

    fn decode_prim<B: Backend>(&self) -> Result<FloatTensor<B>, BurnError>
    where
        DispatchTensor: DispatchKindConversion<B>,
    {
        self.decode()?
            .try_into_primitive::<B>()
            .map_err(|e| BurnError::device(&self.device, format!("{e:?}")))
    }

    /// Adds a gradient of the weight into lpmm's accumulator; an error is kept for the next step
    /// (a backward pass cannot return one).
    fn accumulate<B: Backend>(&self, grad: FloatTensor<B>)
    where
        DispatchTensor: DispatchKindConversion<B>,
    {
        let grad = Tensor::<2>::from_primitive::<B>(grad);
        let mut shared = self.optim.lock();
        let result = shared
            .engine(&self.device)
            .and_then(|engine| on_engine!(engine, core => core.accumulate_external(self.id, grad)));
        if let Err(e) = result
            && shared.deferred.is_none()
        {
            shared.deferred = Some(e);
        }
    }
}

/// A linear layer `y = x W + b` whose weight `W` (`[d_input, d_output]`, burn's `Linear` layout)
/// lives only in the optimizer's storage ([`LpmmOptimizer::linear`]). The bias is an ordinary
/// burn parameter (stepped in place like any other).
#[derive(Module, Debug)]
pub struct LpmmLinear {
    /// The bias.
    pub bias: Option<Param<Tensor<1>>>,
    anchor: Param<Tensor<1>>,
    #[module(skip)]
    weight: LpmmWeight,
}

impl LpmmOptimizer {
    /// A linear layer whose weight, initialised from `weight` (`[d_input, d_output]`, which is
    /// dropped: lpmm keeps the only copy, in the configuration's parameter storage), is held by
    /// this optimizer; `bias` stays a burn parameter. Layers created in the same order in another
    /// process get the same ids, so records apply to them.
    pub fn linear(
        &self,
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
    ) -> Result<LpmmLinear, BurnError> {
        let device = weight.device();
        let inner = device.clone().inner();
        let shape = weight.dims();
        if let Some(b) = &bias
            && b.dims()[0] != shape[1]
        {
            return Err(BurnError::param(
                "bias",
                format!("{} values for {} outputs", b.dims()[0], shape[1]),
            ));
        }
        let id = {
            let mut shared = self.lock();
            let config = shared.routing().config_for("", &shape);
            shared.device = Some(inner.clone());
            let engine = shared.engine(&inner)?;
            on_engine!(engine, core => core.add_external(weight.inner(), config))?
        };
        let train = device.is_autodiff();
        let anchor = Tensor::<1>::zeros([0], &device);
        let anchor = Param::from_tensor(if train { anchor.require_grad() } else { anchor });
        Ok(LpmmLinear {
            bias: bias.map(Param::from_tensor),
            anchor,
            weight: LpmmWeight {
                optim: self.clone(),
                id,
                shape,
                device: inner,
            },
        })
    }
}

/// `x W` on autodiff backend `Autodiff<B, _>` with the tensor's checkpointing strategy.
fn forward_on<B: Backend>(
    x: Tensor<2>,
    anchor: Tensor<1>,
    weight: &LpmmWeight,
) -> Result<Tensor<2>, BurnError>
where
    DispatchTensor: DispatchKindConversion<B>
        + DispatchKindConversion<Autodiff<B, NoCheckpointing>>
        + DispatchKindConversion<Autodiff<B, BalancedCheckpointing>>,
{
    match x.gradient_checkpointing_strategy() {
        Some(GradientCheckpointingStrategy::Balanced) => {
            forward_with::<B, BalancedCheckpointing>(x, anchor, weight)
        }
        _ => forward_with::<B, NoCheckpointing>(x, anchor, weight),
    }
}

fn forward_with<B: Backend, C: CheckpointStrategy>(
    x: Tensor<2>,
    anchor: Tensor<1>,
    weight: &LpmmWeight,
) -> Result<Tensor<2>, BurnError>
where
    DispatchTensor: DispatchKindConversion<B> + DispatchKindConversion<Autodiff<B, C>>,
{
    let device = x.device();
    let fail = |e| BurnError::device(&device, format!("{e:?}"));
    let xp = x.try_into_primitive::<Autodiff<B, C>>().map_err(fail)?;
    let ap = anchor
        .try_into_primitive::<Autodiff<B, C>>()
        .map_err(fail)?;
    let y = linear_ad::<B, C>(xp, ap, weight)?;
    Ok(Tensor::<2>::from_primitive::<Autodiff<B, C>>(y))
}

impl LpmmLinear {
    /// The weight's handle.
    pub fn weight(&self) -> &LpmmWeight {
        &self.weight
    }

    /// `x W + b` over the last dimension of `x`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Result<Tensor<D>, BurnError> {
        let dims = x.dims();
        let [d_in, d_out] = self.weight.shape;
        if D == 0 || dims[D - 1] != d_in {
            return Err(BurnError::param(
                self.weight.id.val(),
                format!("an input of shape {dims:?} for {d_in} input features"),
            ));
        }
        let rows: usize = dims[..D - 1].iter().product();
        let x2 = x.reshape([rows, d_in]);
        let y2 = if x2.is_autodiff() {
            let device = x2.device();
            let anchor = self.anchor.val();
            match device.clone().inner().as_dispatch() {
                #[cfg(feature = "ndarray")]
                #[allow(deprecated)]
                DispatchDevice::NdArray(_) => {
                    forward_on::<burn_core::backend::NdArray>(x2, anchor, &self.weight)?
                }
                #[cfg(feature = "flex")]
                DispatchDevice::Flex(_) => {
                    forward_on::<burn_core::backend::Flex>(x2, anchor, &self.weight)?
                }
                #[cfg(any(feature = "wgpu", feature = "cuda"))]
                DispatchDevice::Cube(_) => {
                    forward_on::<burn_cubecl::Cube>(x2, anchor, &self.weight)?
                }
                #[allow(unreachable_patterns)]
                other => {
                    return Err(BurnError::device(
                        other,
                        "LpmmLinear runs on burn's ndarray, flex, wgpu and CUDA devices",
                    ));
                }
            }
        } else {
            x2.matmul(self.weight.decode()?)
        };
        let mut out = dims;
        out[D - 1] = d_out;
        let y = y2.reshape(out);
        Ok(match &self.bias {
            Some(b) => y + b.val().unsqueeze::<D>(),
            None => y,
        })
    }
}

/// What the backward pass keeps: the input (which any linear layer keeps) and the weight's
/// handle, not the weight.
#[derive(Debug, Clone)]
struct LinearState<P> {
    x: P,
    weight: LpmmWeight,
}

#[derive(Debug)]
struct LinearBackward;

impl<B: Backend> Backward<B, 2> for LinearBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = LinearState<FloatTensor<B>>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let LinearState { x, weight } = ops.state;
        let dy = grads.consume::<B>(&ops.node);
        // The weight's gradient goes straight into lpmm's accumulator.
        let dw = B::float_matmul(B::float_transpose(x), dy.clone());
        weight.accumulate::<B>(dw);
        let [input, _anchor] = ops.parents;
        if let Some(input) = input {
            match weight.decode_prim::<B>() {
                Ok(w) => {
                    let dx = B::float_matmul(dy, B::float_transpose(w));
                    grads.register::<B>(input.id, dx);
                }
                Err(e) => {
                    let mut shared = weight.optim.lock();
                    if shared.deferred.is_none() {
                        shared.deferred = Some(e);
                    }
                }
            }
        }
    }
}

/// `x W` as a burn custom autodiff operation over `x` (2-D) and the anchor.
fn linear_ad<B: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    anchor: FloatTensor<Autodiff<B, C>>,
    weight: &LpmmWeight,
) -> Result<FloatTensor<Autodiff<B, C>>, BurnError>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    let (x, x_node) = x.into_parts();
    let (_, anchor_node) = anchor.into_parts();
    let w = weight.decode_prim::<B>()?;
    let y = B::float_matmul(x.clone(), w);
    Ok(
        match LinearBackward
            .prepare::<C>([x_node, anchor_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                LinearState {
                    x,
                    weight: weight.clone(),
                },
                y,
            ),
            OpsKind::UnTracked(prep) => prep.finish(y),
        },
    )
}
