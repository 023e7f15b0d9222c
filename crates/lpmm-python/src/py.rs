//! The extension module `lpmm._lpmm` (feature `python`): the engine for Python, over torch's CPU
//! tensors lent in place.
//!
//! Every tensor is checked before the engine sees it — an exact `torch.Tensor` or
//! `torch.nn.Parameter` (a subclass may not describe its memory), strided, on the CPU, float32 or
//! bfloat16, contiguous, no lazy negation, its elements inside its storage, aligned — and the
//! tensors of one call must not overlap where one of them is written. A tensor that fails raises
//! the package's exception for it (`lpmm._errors`, naming the parameter) before anything is
//! written. Only then are the tensors viewed as Rust slices, the one `unsafe` of the crate.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use half::bf16;
use lpmm_optim::backend::{Dtype, HostValues, HostValuesMut};
use lpmm_optim::{MissingGradientPolicy, NonFinitePolicy, OptimizerOptions};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict, PyList, PyTuple};

use crate::engine::{Engine as Inner, GroupEntry, Report};
use crate::{EngineError, config, state};

/// The Rust heap of the extension, counted: the tests measure what a step allocates (over lent
/// tensors, no buffer of the parameters' size).
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static ALLOCATED: AtomicU64 = AtomicU64::new(0);
static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

fn allocated(size: usize) {
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    ALLOCATED.fetch_add(size as u64, Ordering::Relaxed);
    let live = LIVE.fetch_add(size as u64, Ordering::Relaxed) + size as u64;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

fn freed(size: usize) {
    LIVE.fetch_sub(size as u64, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are only
// statistics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is `System.alloc`'s.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            allocated(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc_zeroed` is `System.alloc_zeroed`'s.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            allocated(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        freed(layout.size());
        // SAFETY: `ptr` was allocated by `System` (above) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract for `realloc` is `System.realloc`'s.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            freed(layout.size());
            allocated(new_size);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The extension's Rust allocations so far: `(count, bytes, live bytes, peak live bytes)`.
/// `reset_peak` first sets the peak to what is live now.
#[pyfunction]
#[pyo3(signature = (reset_peak=false))]
fn allocations(reset_peak: bool) -> (u64, u64, u64, u64) {
    if reset_peak {
        PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    }
    (
        ALLOCATIONS.load(Ordering::Relaxed),
        ALLOCATED.load(Ordering::Relaxed),
        LIVE.load(Ordering::Relaxed),
        PEAK.load(Ordering::Relaxed),
    )
}

/// Raises `lpmm._errors.<class>(message, param)`.
fn raise(py: Python<'_>, class: &str, message: String, param: Option<&str>) -> PyErr {
    let made = py
        .import("lpmm._errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.call1((message.clone(), param)));
    match made {
        Ok(e) => PyErr::from_value(e),
        Err(e) => e,
    }
}

fn engine_err(py: Python<'_>, e: EngineError) -> PyErr {
    match e {
        EngineError::Config(m) => raise(py, "ConfigError", m, None),
        EngineError::State(m) => raise(py, "StateDictError", m, None),
        EngineError::Optim(e) => {
            let class = match e {
                lpmm_optim::OptimError::Hyperparameter { .. }
                | lpmm_optim::OptimError::StorageNotAllowed { .. }
                | lpmm_optim::OptimError::Nesterov
                | lpmm_optim::OptimError::NotAMatrix { .. } => "ConfigError",
                lpmm_optim::OptimError::Lent { .. } => "TensorError",
                _ => "StepError",
            };
            raise(py, class, e.to_string(), None)
        }
    }
}

/// torch's objects the checks compare with, looked up once per call.
struct Torch<'py> {
    tensor: Bound<'py, PyAny>,
    parameter: Bound<'py, PyAny>,
    strided: Bound<'py, PyAny>,
    float32: Bound<'py, PyAny>,
    bfloat16: Bound<'py, PyAny>,
    uint8: Bound<'py, PyAny>,
}

impl<'py> Torch<'py> {
    fn new(py: Python<'py>) -> PyResult<Self> {
        let torch = py.import("torch")?;
        Ok(Torch {
            tensor: torch.getattr("Tensor")?,
            parameter: torch.getattr("nn")?.getattr("Parameter")?,
            strided: torch.getattr("strided")?,
            float32: torch.getattr("float32")?,
            bfloat16: torch.getattr("bfloat16")?,
            uint8: torch.getattr("uint8")?,
        })
    }
}

/// The element types a view may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    F32,
    Bf16,
    U8,
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::Bf16 => 2,
            Elem::U8 => 1,
        }
    }

    fn dtype(self) -> Dtype {
        match self {
            Elem::F32 => Dtype::F32,
            Elem::Bf16 => Dtype::Bf16,
            Elem::U8 => Dtype::U8,
        }
    }
}

/// A checked tensor: `len` elements of `elem` at `ptr`, inside its storage, held alive by
/// `_tensor`.
struct View<'py> {
    ptr: usize,
    len: usize,
    elem: Elem,
    /// The parameter it belongs to (errors name it) and what it is (`"parameter"`, `"gradient"`).
    name: String,
    what: &'static str,
    writable: bool,
    _tensor: Bound<'py, PyAny>,
}

/// Checks `t`, the `what` of parameter `name`, and describes its memory. `floats`: a parameter or
/// gradient (float32, bfloat16); otherwise a state-dict entry (uint8).
fn view<'py>(
    torch: &Torch<'py>,
    t: &Bound<'py, PyAny>,
    name: &str,
    what: &'static str,
    floats: bool,
) -> PyResult<View<'py>> {
    let py = t.py();
    let fail = |class: &str, reason: String| {
        raise(
            py,
            class,
            format!("{what} {name}: {reason}; nothing was changed"),
            Some(name),
        )
    };
    let ty = t.get_type();
    if !(ty.is(&torch.tensor) || ty.is(&torch.parameter)) {
        return Err(fail(
            "TensorError",
            format!(
                "it is a {}, not a torch.Tensor or torch.nn.Parameter (lpmm steps plain tensors in place; a tensor subclass may not describe its memory)",
                ty.name()?
            ),
        ));
    }
    if !t.getattr("layout")?.is(&torch.strided) {
        return Err(fail(
            "LayoutError",
            format!(
                "its layout is {} (sparse tensors are not supported: lpmm steps dense tensors)",
                t.getattr("layout")?.str()?
            ),
        ));
    }
    let device = t.getattr("device")?;
    let device_type: String = device.getattr("type")?.extract()?;
    if device_type != "cpu" {
        let class = if device_type == "cuda" {
            "CudaError"
        } else {
            "DeviceError"
        };
        return Err(fail(
            class,
            format!(
                "it is on {} and lpmm.torch steps CPU tensors only (no copy to the host is ever made; docs/PYTHON.md, \"CUDA\")",
                device.str()?
            ),
        ));
    }
    let dtype = t.getattr("dtype")?;
    let elem = if floats && dtype.is(&torch.float32) {
        Elem::F32
    } else if floats && dtype.is(&torch.bfloat16) {
        Elem::Bf16
    } else if !floats && dtype.is(&torch.uint8) {
        Elem::U8
    } else {
        let want = if floats {
            "torch.float32 or torch.bfloat16"
        } else {
            "torch.uint8"
        };
        return Err(fail(
            "DtypeError",
            format!("its dtype is {}, not {want}", dtype.str()?),
        ));
    };
    if !t.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(fail(
            "LayoutError",
            "it is not contiguous (lpmm steps a tensor's memory in place: make the parameter contiguous before creating the optimizer)".into(),
        ));
    }
    if t.call_method0("is_neg")?.extract::<bool>()? {
        return Err(fail(
            "LayoutError",
            "it is a lazily negated view (torch._neg_view): its memory does not hold its values"
                .into(),
        ));
    }
    let len: usize = t.call_method0("numel")?.extract()?;
    let ptr: usize = t.call_method0("data_ptr")?.extract()?;
    let offset: usize = t.call_method0("storage_offset")?.extract()?;
    let storage = t.call_method0("untyped_storage")?;
    let base: usize = storage.call_method0("data_ptr")?.extract()?;
    let nbytes: usize = storage.call_method0("nbytes")?.extract()?;
    let size = elem.size();
    let end = offset
        .checked_add(len)
        .and_then(|e| e.checked_mul(size))
        .filter(|&e| e <= nbytes);
    let at = offset.checked_mul(size).and_then(|o| base.checked_add(o));
    if len == 0 || ptr == 0 || end.is_none() || at != Some(ptr) || !ptr.is_multiple_of(size) {
        return Err(fail(
            "LayoutError",
            format!(
                "its {len} elements at offset {offset} do not lie inside its storage of {nbytes} bytes (data_ptr {ptr:#x}, storage {base:#x})"
            ),
        ));
    }
    Ok(View {
        ptr,
        len,
        elem,
        name: name.to_string(),
        what,
        writable: false,
        _tensor: t.clone(),
    })
}

/// Refuses views whose memory overlaps where one of them is written (a parameter listed twice,
/// two parameters sharing storage, a gradient that is a parameter's memory).
fn check_aliasing(py: Python<'_>, views: &[&View<'_>]) -> PyResult<()> {
    let mut order: Vec<&View<'_>> = views.to_vec();
    order.sort_by_key(|v| v.ptr);
    let end = |v: &View<'_>| v.ptr + v.len * v.elem.size();
    let mut widest: Option<&View<'_>> = None;
    let mut widest_written: Option<&View<'_>> = None;
    for &v in &order {
        let clash = widest_written
            .filter(|w| end(w) > v.ptr)
            .or_else(|| widest.filter(|w| v.writable && end(w) > v.ptr));
        if let Some(w) = clash {
            let (a, b) = if v.writable { (v, w) } else { (w, v) };
            return Err(raise(
                py,
                "AliasError",
                format!(
                    "the {} {} shares memory with the {} {}: lpmm would write one while reading or writing the other; nothing was changed",
                    a.what, a.name, b.what, b.name
                ),
                Some(&a.name),
            ));
        }
        if widest.is_none_or(|w| end(v) > end(w)) {
            widest = Some(v);
        }
        if v.writable && widest_written.is_none_or(|w| end(v) > end(w)) {
            widest_written = Some(v);
        }
    }
    Ok(())
}

/// Writable host values over a checked view.
fn slice_mut<'a>(v: &'a View<'_>) -> HostValuesMut<'a> {
    debug_assert!(v.writable);
    // SAFETY: `view` checked that the tensor is a dense, contiguous CPU tensor of exactly
    // `v.elem`, whose `v.len` elements start at `v.ptr` (non-null, aligned to the element size)
    // and end inside its storage's allocation; `check_aliasing` checked that no other view of
    // this call overlaps a writable one, and each writable view is turned into one slice once per
    // call. The tensor is kept alive by the view (`_tensor`) for longer than the slice (`'a`
    // borrows the view). No Python code runs while the slices exist (the engine calls no Python
    // and the GIL is held throughout the call), so neither torch nor the caller can free, resize
    // or write the storage meanwhile; another thread running torch kernels on the same tensor
    // without the GIL would race with torch's own in-place optimizers in the same way.
    unsafe {
        match v.elem {
            Elem::F32 => {
                HostValuesMut::F32(std::slice::from_raw_parts_mut(v.ptr as *mut f32, v.len))
            }
            Elem::Bf16 => {
                HostValuesMut::Bf16(std::slice::from_raw_parts_mut(v.ptr as *mut bf16, v.len))
            }
            Elem::U8 => unreachable!("a state-dict entry is never written"),
        }
    }
}

/// Read-only host values over a checked view.
fn slice<'a>(v: &'a View<'_>) -> HostValues<'a> {
    // SAFETY: as in `slice_mut`; no writable view of this call overlaps it (`check_aliasing`).
    unsafe {
        match v.elem {
            Elem::F32 => HostValues::F32(std::slice::from_raw_parts(v.ptr as *const f32, v.len)),
            Elem::Bf16 => HostValues::Bf16(std::slice::from_raw_parts(v.ptr as *const bf16, v.len)),
            Elem::U8 => unreachable!("read with `bytes`"),
        }
    }
}

/// A uint8 view's bytes.
fn bytes<'a>(v: &'a View<'_>) -> &'a [u8] {
    // SAFETY: as in `slice`: a checked uint8 view (`v.len` bytes inside its storage), never
    // written in this call.
    unsafe { std::slice::from_raw_parts(v.ptr as *const u8, v.len) }
}

fn report_dict<'py>(py: Python<'py>, r: Report) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("updated", r.updated)?;
    d.set_item("skipped", r.skipped)?;
    d.set_item("non_finite", r.non_finite)?;
    d.set_item("grad_norm", r.grad_norm)?;
    d.set_item("missing", r.missing)?;
    Ok(d)
}

/// The checked parameters and gradients of a call (by registered parameter, `None` where absent).
type Views<'py> = (Vec<Option<View<'py>>>, Vec<Option<View<'py>>>);

/// One parameter's state for Python: metadata JSON, steps, regions by key.
type SavedParam<'py> = (String, u64, Vec<(String, Bound<'py, PyByteArray>)>);

/// The engine of one `lpmm.torch` optimizer.
#[pyclass(module = "lpmm._lpmm")]
struct Engine {
    inner: Inner,
}

impl Engine {
    fn param_name(&self, index: usize) -> &str {
        &self.inner.params()[index].name
    }

    /// Checks `params` (a list aligned with the registered parameters, `None` where not needed)
    /// and `grads` (the same, `None`: no gradient), with no overlap where written.
    fn views<'py>(
        &self,
        torch: &Torch<'py>,
        params: &Bound<'py, PyAny>,
        grads: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Views<'py>> {
        let py = params.py();
        let n = self.inner.params().len();
        let params: Vec<Bound<'py, PyAny>> = params.extract()?;
        let grads: Vec<Bound<'py, PyAny>> = match grads {
            Some(g) => g.extract()?,
            None => Vec::new(),
        };
        if params.len() != n || !(grads.is_empty() || grads.len() == n) {
            return Err(raise(
                py,
                "ConfigError",
                format!(
                    "{} tensors and {} gradients for {n} registered parameters",
                    params.len(),
                    grads.len()
                ),
                None,
            ));
        }
        let mut pv = Vec::with_capacity(n);
        let mut gv = Vec::with_capacity(n);
        for (i, p) in params.iter().enumerate() {
            let entry = &self.inner.params()[i];
            let name = &entry.name;
            let v = if p.is_none() {
                None
            } else {
                let mut v = view(torch, p, name, "parameter", true)?;
                if v.elem.dtype() != entry.dtype || v.len != entry.numel {
                    return Err(raise(
                        py,
                        "DtypeError",
                        format!(
                            "parameter {name} was a {}-element {} tensor when it was registered and is a {}-element {} tensor now (create the optimizer after converting the model); nothing was changed",
                            entry.numel,
                            entry.dtype.name(),
                            v.len,
                            v.elem.dtype().name()
                        ),
                        Some(name),
                    ));
                }
                v.writable = true;
                Some(v)
            };
            let g = match grads.get(i) {
                Some(g) if !g.is_none() => {
                    let g = view(torch, g, name, "gradient of", true)?;
                    if g.len != entry.numel {
                        return Err(raise(
                            py,
                            "TensorError",
                            format!(
                                "gradient of {name}: {} elements for a {}-element parameter; nothing was changed",
                                g.len, entry.numel
                            ),
                            Some(name),
                        ));
                    }
                    if v.is_none() {
                        return Err(raise(
                            py,
                            "ConfigError",
                            format!("parameter {name} has a gradient but its tensor was not given"),
                            Some(name),
                        ));
                    }
                    Some(g)
                }
                _ => None,
            };
            pv.push(v);
            gv.push(g);
        }
        let all: Vec<&View<'py>> = pv.iter().chain(gv.iter()).flatten().collect();
        check_aliasing(py, &all)?;
        Ok((pv, gv))
    }
}

fn non_finite(policy: &str) -> Result<NonFinitePolicy, EngineError> {
    match policy {
        "skip_step" => Ok(NonFinitePolicy::SkipStep),
        "skip_elements" => Ok(NonFinitePolicy::SkipElements),
        other => Err(EngineError::Config(format!(
            "non_finite {other:?}: one of \"skip_step\", \"skip_elements\""
        ))),
    }
}

fn missing_policy(policy: &str) -> Result<MissingGradientPolicy, EngineError> {
    match policy {
        "ignore" => Ok(MissingGradientPolicy::Ignore),
        "warn" => Ok(MissingGradientPolicy::Warn),
        "error" => Ok(MissingGradientPolicy::Error),
        other => Err(EngineError::Config(format!(
            "missing_gradient {other:?}: one of \"ignore\", \"warn\", \"error\""
        ))),
    }
}

/// A group's configuration: preset `preset` at `lr` with the hyperparameters in `hyper` (JSON).
fn group_config(
    preset: &str,
    lr: f64,
    hyper: &str,
) -> Result<lpmm_optim::ParamConfig, EngineError> {
    config::with_hyper(&config::preset(preset, lr)?, hyper)
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (seed, max_grad_norm, non_finite_policy, missing_gradient))]
    fn new(
        py: Python<'_>,
        seed: u64,
        max_grad_norm: Option<f64>,
        non_finite_policy: &str,
        missing_gradient: &str,
    ) -> PyResult<Self> {
        let made = (|| {
            let options = OptimizerOptions::default()
                .with_seed(seed)
                .with_max_grad_norm(max_grad_norm)
                .with_non_finite(non_finite(non_finite_policy)?);
            Inner::new(options, missing_policy(missing_gradient)?)
        })();
        Ok(Engine {
            inner: made.map_err(|e| engine_err(py, e))?,
        })
    }

    /// Adds a group of preset `preset` with hyperparameters `hyper` (a JSON object of the rule's
    /// fields) and parameter storage `param_storage`; returns its index.
    #[pyo3(signature = (preset, hyper, param_storage, min_quantized_size=None))]
    fn add_group(
        &mut self,
        py: Python<'_>,
        preset: &str,
        hyper: &str,
        param_storage: &str,
        min_quantized_size: Option<usize>,
    ) -> PyResult<usize> {
        let made = group_config(preset, 0.0, hyper).and_then(|c| {
            let c = match min_quantized_size {
                Some(n) => c.with_min_quantized_size(n),
                None => c,
            };
            self.inner.add_group(c, param_storage)
        });
        made.map_err(|e| engine_err(py, e))
    }

    /// Registers tensor `tensor` as parameter `name` of group `group`; returns whether it is lent
    /// (stepped in place) and the storage lpmm keeps its value in.
    fn add_param(
        &mut self,
        py: Python<'_>,
        name: &str,
        tensor: &Bound<'_, PyAny>,
        shape: Vec<usize>,
        group: usize,
    ) -> PyResult<(bool, String)> {
        let torch = Torch::new(py)?;
        let mut v = view(&torch, tensor, name, "parameter", true)?;
        v.writable = true;
        if self.inner.params().iter().any(|p| p.name == name) {
            return Err(raise(
                py,
                "ConfigError",
                format!("two parameters are named {name:?}"),
                Some(name),
            ));
        }
        let index = self
            .inner
            .add_param(name, &shape, slice_mut(&v), group)
            .map_err(|e| engine_err(py, e))?;
        let p = &self.inner.params()[index];
        let storage = self
            .inner
            .optimizer()
            .param(p.id)
            .map(|p| p.config)
            .map_err(|e| engine_err(py, e.into()))?
            .param
            .describe();
        Ok((p.lent, storage))
    }

    /// The rule's name and default hyperparameters (JSON) of preset `preset` at `lr`.
    #[staticmethod]
    fn defaults(py: Python<'_>, preset: &str, lr: f64) -> PyResult<(String, String)> {
        let made = config::preset(preset, lr).and_then(|c| config::hyper_json(&c));
        let (rule, fields) = made.map_err(|e| engine_err(py, e))?;
        Ok((rule, serde_json::Value::Object(fields).to_string()))
    }

    /// Sets group `group`'s learning rate.
    fn set_group_lr(&mut self, py: Python<'_>, group: usize, lr: f64) -> PyResult<()> {
        self.inner
            .set_group_lr(group, lr)
            .map_err(|e| engine_err(py, e))
    }

    /// Whether registered parameter `index` counts as missing a gradient in a step without one
    /// (`False`: a tensor removed from its param group).
    fn set_expects_gradient(
        &mut self,
        py: Python<'_>,
        index: usize,
        expects: bool,
    ) -> PyResult<()> {
        self.inner
            .set_expects_gradient(index, expects)
            .map_err(|e| engine_err(py, e))
    }

    /// Sets group `group`'s hyperparameters (JSON, its preset's fields): the state moves to an
    /// optimizer with the new ones (`params`: every registered tensor).
    fn set_group_hyper(
        &mut self,
        py: Python<'_>,
        group: usize,
        hyper: &str,
        params: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let config = self
            .inner
            .groups()
            .get(group)
            .ok_or_else(|| raise(py, "ConfigError", format!("no group {group}"), None))
            .and_then(|g| config::with_hyper(&g.config, hyper).map_err(|e| engine_err(py, e)))?;
        let torch = Torch::new(py)?;
        let (pv, _) = self.views(&torch, params, None)?;
        let mut buffers: Vec<Option<HostValuesMut<'_>>> =
            pv.iter().map(|v| v.as_ref().map(slice_mut)).collect();
        self.inner = state::reconfigure(&self.inner, group, config, &mut buffers)
            .map_err(|e| engine_err(py, e))?;
        Ok(())
    }

    /// One step: `params[i]` and `grads[i]` are registered parameter `i`'s tensor and gradient
    /// (`None` for both where it has no gradient). Returns the step's report.
    fn step<'py>(
        &mut self,
        py: Python<'py>,
        params: &Bound<'py, PyAny>,
        grads: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let torch = Torch::new(py)?;
        let (pv, gv) = self.views(&torch, params, Some(grads))?;
        let mut buffers: Vec<Option<HostValuesMut<'_>>> =
            pv.iter().map(|v| v.as_ref().map(slice_mut)).collect();
        let gradients: Vec<Option<HostValues<'_>>> =
            gv.iter().map(|v| v.as_ref().map(slice)).collect();
        let report = self
            .inner
            .step(&mut buffers, &gradients)
            .map_err(|e| engine_err(py, e))?;
        report_dict(py, report)
    }

    /// Gradient release: steps parameter `index` now, in `param`, with `grad`.
    fn step_param<'py>(
        &mut self,
        py: Python<'py>,
        index: usize,
        param: &Bound<'py, PyAny>,
        grad: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        if index >= self.inner.params().len() {
            return Err(raise(
                py,
                "ConfigError",
                format!("no parameter {index}"),
                None,
            ));
        }
        let torch = Torch::new(py)?;
        let n = self.inner.params().len();
        let mut params = vec![py.None().into_bound(py); n];
        let mut grads = params.clone();
        params[index] = param.clone();
        grads[index] = grad.clone();
        let (pv, gv) = self.views(
            &torch,
            PyList::new(py, params)?.as_any(),
            Some(PyList::new(py, grads)?.as_any()),
        )?;
        let (Some(p), Some(g)) = (&pv[index], &gv[index]) else {
            return Err(raise(
                py,
                "ConfigError",
                format!(
                    "parameter {} has no gradient to release",
                    self.param_name(index)
                ),
                None,
            ));
        };
        let report = self
            .inner
            .step_param(index, slice_mut(p), slice(g))
            .map_err(|e| engine_err(py, e))?;
        report_dict(py, report)
    }

    /// Moves the parameters to their evaluation point (`True`) or back (`False`).
    fn set_eval(&mut self, py: Python<'_>, eval: bool, params: &Bound<'_, PyAny>) -> PyResult<()> {
        let torch = Torch::new(py)?;
        let (pv, _) = self.views(&torch, params, None)?;
        let mut buffers: Vec<Option<HostValuesMut<'_>>> =
            pv.iter().map(|v| v.as_ref().map(slice_mut)).collect();
        self.inner
            .set_eval(eval, &mut buffers)
            .map_err(|e| engine_err(py, e))
    }

    /// Whether the parameters hold their evaluation point.
    fn in_eval(&self) -> bool {
        self.inner.in_eval()
    }

    /// Every parameter's state: `(metadata JSON, steps, [(key, bytearray)])` each.
    fn state<'py>(
        &self,
        py: Python<'py>,
        params: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<SavedParam<'py>>> {
        let torch = Torch::new(py)?;
        let (pv, _) = self.views(&torch, params, None)?;
        let mut buffers: Vec<Option<HostValuesMut<'_>>> =
            pv.iter().map(|v| v.as_ref().map(slice_mut)).collect();
        let saved = state::save(&self.inner, &mut buffers).map_err(|e| engine_err(py, e))?;
        Ok(saved
            .into_iter()
            .map(|s| {
                let regions = s
                    .regions
                    .into_iter()
                    .map(|(k, b)| (k, PyByteArray::new(py, &b)))
                    .collect();
                (s.meta, s.steps, regions)
            })
            .collect())
    }

    /// Replaces the state with `saved` (`[(metadata JSON, {key: uint8 tensor})]` per parameter),
    /// the groups taking hyperparameters `hypers` (JSON per group). Nothing changes on error.
    fn load_state(
        &mut self,
        py: Python<'_>,
        hypers: Vec<String>,
        saved: &Bound<'_, PyAny>,
        params: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let torch = Torch::new(py)?;
        if hypers.len() != self.inner.groups().len() {
            return Err(raise(
                py,
                "StateDictError",
                format!(
                    "{} parameter groups for an optimizer of {}",
                    hypers.len(),
                    self.inner.groups().len()
                ),
                None,
            ));
        }
        let groups = self
            .inner
            .groups()
            .iter()
            .zip(&hypers)
            .map(|(g, h)| {
                Ok(GroupEntry {
                    config: config::with_hyper(&g.config, h)?,
                    param_storage: g.param_storage.clone(),
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()
            .map_err(|e| engine_err(py, e))?;
        let entries: Vec<(String, Bound<'_, PyDict>)> = saved.extract()?;
        let mut views = Vec::new();
        let mut metas = Vec::new();
        for (i, (meta, regions)) in entries.iter().enumerate() {
            let name = self
                .inner
                .params()
                .get(i)
                .map_or_else(|| format!("#{i}"), |p| p.name.clone());
            let mut rs = Vec::new();
            for (k, t) in regions.iter() {
                let key: String = k.extract()?;
                rs.push((key, view(&torch, &t, &name, "state entry of", false)?));
            }
            metas.push(meta.clone());
            views.push(rs);
        }
        let saved: Vec<state::Saved> = metas
            .into_iter()
            .zip(&views)
            .map(|(meta, rs)| state::Saved {
                meta,
                regions: rs
                    .iter()
                    .map(|(k, v)| (k.clone(), bytes(v).to_vec()))
                    .collect(),
                steps: 0,
            })
            .collect();
        drop(views);
        let (pv, _) = self.views(&torch, params, None)?;
        let mut buffers: Vec<Option<HostValuesMut<'_>>> =
            pv.iter().map(|v| v.as_ref().map(slice_mut)).collect();
        self.inner = state::load_with_groups(&self.inner, &groups, &saved, &mut buffers)
            .map_err(|e| engine_err(py, e))?;
        Ok(())
    }

    /// Bytes lpmm holds per slot: parameter, gradient, states 1, 2 and 3.
    fn memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.memory())
    }

    /// Parameter `index`'s name.
    fn name(&self, py: Python<'_>, index: usize) -> PyResult<String> {
        self.inner
            .params()
            .get(index)
            .map(|p| p.name.clone())
            .ok_or_else(|| raise(py, "ConfigError", format!("no parameter {index}"), None))
    }

    /// Parameter `index`: `{"name", "lent", "storage", "dtype", "shape"}`.
    fn info<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyDict>> {
        let p = self
            .inner
            .params()
            .get(index)
            .ok_or_else(|| raise(py, "ConfigError", format!("no parameter {index}"), None))?;
        let config = self
            .inner
            .optimizer()
            .param(p.id)
            .map(|p| p.config)
            .map_err(|e| engine_err(py, e.into()))?;
        let d = PyDict::new(py);
        d.set_item("name", &p.name)?;
        d.set_item("lent", p.lent)?;
        d.set_item("storage", config.param.describe())?;
        d.set_item("dtype", p.dtype.name())?;
        d.set_item("shape", p.shape.clone())?;
        Ok(d)
    }

    /// Number of registered parameters.
    fn __len__(&self) -> usize {
        self.inner.params().len()
    }
}

/// Checks tensors `tensors` (named `names`) as parameters: each one lpmm can step in place, and
/// no two sharing memory.
#[pyfunction]
fn check(py: Python<'_>, names: Vec<String>, tensors: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
    let torch = Torch::new(py)?;
    let mut views = Vec::with_capacity(tensors.len());
    for (name, t) in names.iter().zip(&tensors) {
        let mut v = view(&torch, t, name, "parameter", true)?;
        v.writable = true;
        views.push(v);
    }
    check_aliasing(py, &views.iter().collect::<Vec<_>>())
}

/// The preset names, and the parameter storages' names.
#[pyfunction]
fn names() -> (Vec<&'static str>, Vec<&'static str>) {
    (config::PRESETS.to_vec(), config::PARAM_STORAGES.to_vec())
}

#[pymodule]
fn _lpmm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add_function(wrap_pyfunction!(allocations, m)?)?;
    m.add_function(wrap_pyfunction!(names, m)?)?;
    m.add_function(wrap_pyfunction!(check, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
