//! What the wgpu and CUDA lanes share: burn's cubecl backend as burn's dispatch holds it (fused,
//! as burn's default build is).

use burn_backend::BackendTypes;
use burn_cubecl::CubeBackend;

/// burn's cubecl backend, fused.
pub(crate) type Cube = burn_cubecl::Cube;
/// Its float tensor primitive.
pub(crate) type FusionPrim = <Cube as BackendTypes>::FloatTensorPrimitive;
/// burn's fusion client of a cubecl device.
pub(crate) type FusionClient = burn_fusion::Client<burn_cubecl::fusion::FusionCubeRuntime>;

/// A new fusion tensor holding the cube tensor `c` (registered with burn's fusion stream as an
/// initialised tensor: no copy, no host read).
pub(crate) fn register(c: burn_cubecl::tensor::CubeTensor, client: &FusionClient) -> FusionPrim {
    use burn_backend::TensorMetadata as _;
    use burn_ir::{BackendIr, InitOperationIr, OperationIr, OperationOutput};
    let (shape, dtype) = (c.shape(), c.dtype());
    let handle = CubeBackend::float_tensor_handle(c);
    let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            burn_fusion::stream::StreamId::current(),
            OperationIr::Init(desc),
            burn_fusion::NoOp::<CubeBackend>::new(),
        )
        .output()
}
