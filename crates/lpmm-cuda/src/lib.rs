//! The CUDA backend of lpmm-optim: parameters, gradient accumulators and optimizer states live in
//! device memory, and every operation of the [`Backend`] seam is one kernel launch over all the
//! tensors it touches (kernels/lpmm.cu). The kernels reproduce the CPU reference bit for bit:
//! the same formats, the same ChaCha8 random words for stochastic rounding, and f32 arithmetic
//! in the CPU's order (fma only where the CPU fuses, IEEE division and square root, subnormals
//! kept). docs/BACKENDS.md states what is supported.
//!
//! The crate builds without a CUDA toolkit or driver: the PTX is committed (built by
//! `cargo xtask kernels` with a pinned NVRTC) and the driver is loaded at run time; without
//! one, [`Cuda::new`] returns [`CudaError::NoDriver`].
//!
//! ```no_run
//! use lpmm_cuda::Cuda;
//! use lpmm_optim::{Optimizer, OptimizerOptions, presets};
//!
//! let backend = Cuda::new(0)?;
//! let mut opt = Optimizer::with_backend(backend, OptimizerOptions::default())?;
//! opt.add_group(presets::adamw_8bit_bf16(1e-3))?;
//! let w = opt.add_param("w", &[1024, 1024], &vec![0.01; 1 << 20], 0)?;
//! opt.accumulate(w, &vec![1e-3; 1 << 20])?;
//! opt.step()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Work runs on one stream ([`Cuda::with_stream`] takes the caller's): launches and copies are
//! enqueued in order and the host waits only where a result must come back (the non-finite
//! flags of a step, decoded values, exported state), never per tensor.
//!
//! With the `emulate` feature, [`Cuda::emulated`] runs the same kernels compiled for the CPU
//! (C++), driven by the same code: how this crate is tested on machines without a GPU.

use std::sync::{Arc, Mutex, MutexGuard};

use bytemuck::{Pod, Zeroable};
use lpmm_formats::packing::packed_len;
use lpmm_optim::device::{self as layout, FMT_QUANT, RuleWords, SlotFormat, Words};
use lpmm_optim::{Backend, HostSlot, OptimError, ParamMeta, SlotKind, Storage};

mod device;
#[cfg(feature = "emulate")]
mod emulate;
pub mod kernels;

use device::{Buf, Device, Kernel, LaunchBufs};

/// Elements one block handles (the CPU's chunk): every quantization block divides it.
const TILE: usize = 4096;
/// Threads per block.
const THREADS: u32 = 256;
const NAME: &str = "cuda";

/// Why the CUDA backend could not be created or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The CUDA driver library (libcuda) could not be loaded.
    #[error(
        "no CUDA driver: libcuda could not be loaded (an NVIDIA driver is needed at run time; building lpmm-cuda needs no CUDA toolkit)"
    )]
    NoDriver,
    /// No device with this ordinal.
    #[error("no CUDA device {ordinal} ({count} found)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices present.
        count: i32,
    },
    /// The device is older than the oldest architecture the PTX is built for (sm_80).
    #[error(
        "compute capability {major}.{minor} is below 8.0, the oldest architecture lpmm's PTX targets"
    )]
    Arch {
        /// Major version.
        major: i32,
        /// Minor version.
        minor: i32,
    },
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
}

impl From<CudaError> for OptimError {
    fn from(e: CudaError) -> Self {
        OptimError::Device {
            backend: NAME,
            reason: e.to_string(),
        }
    }
}

/// How the backend sizes its scratch memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// Floats of the staging buffer that carries gradients in and decoded values out: larger
    /// transfers go in several launches (rounded down to a multiple of 4096, at least 4096).
    pub io_floats: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            io_floats: 64 << 20,
        }
    }
}

/// One slot's descriptor (mirrors `Slot` in kernels/lpmm.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
struct SlotDesc {
    fmt: u32,
    aux: u32,
    a: u64,
    b: u64,
}

/// One tensor range's part in a launch (mirrors `Desc` in kernels/lpmm.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
struct Desc {
    len: u64,
    offset: u64,
    index: u64,
    step: u64,
    acc: u64,
    seed: u64,
    tile_begin: u64,
    input: u64,
    flags: u32,
    flag_index: u32,
    rule: u32,
    rule_flags: u32,
    mode: u32,
    clip: f32,
    rc: [f32; 11],
    pad: u32,
    slots: [SlotDesc; 4],
}

const F_FIRST: u32 = 1;
const F_UPDATE_PARAM: u32 = 2;
const F_INPUT: u32 = 4;

/// The CUDA backend. Cheap to clone (clones share the device and its stream).
#[derive(Clone)]
pub struct Cuda {
    inner: Arc<Inner>,
}

struct Inner {
    device: Device,
    maps: Buf,
    io_floats: usize,
    launches: std::sync::atomic::AtomicU64,
    scratch: Mutex<Scratch>,
}

/// Buffers reused across launches; replaced (grown) only after the stream has been synchronised.
#[derive(Default)]
struct Scratch {
    descs: Option<Buf>,
    io: Option<Buf>,
    flags: Option<Buf>,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda")
            .field("device", &self.device_name())
            .field("io_floats", &self.inner.io_floats)
            .finish()
    }
}

/// Everything the CUDA backend holds for one parameter: one allocation with every slot's
/// regions. Cloning copies the device memory; dropping frees it.
pub struct CudaParam {
    backend: Cuda,
    formats: [SlotFormat; 4],
    len: usize,
    buf: Buf,
    /// Word offsets of each slot's two regions in `buf`.
    regions: [(usize, usize); 4],
    /// `ParamMeta::stream` and `ParamMeta::offset`: what keys the random words.
    stream: usize,
    offset: usize,
}

impl std::fmt::Debug for CudaParam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaParam")
            .field("formats", &self.formats)
            .field("len", &self.len)
            .field("regions", &self.regions)
            .finish()
    }
}

impl Clone for CudaParam {
    /// A deep copy: new device memory with the same contents.
    ///
    /// # Panics
    ///
    /// If the device has no memory left for the copy (`Clone` cannot return an error).
    fn clone(&self) -> Self {
        let buf = self
            .backend
            .inner
            .device
            .duplicate(&self.buf)
            .unwrap_or_else(|e| panic!("cuda: cloning a parameter: {e}"));
        CudaParam {
            backend: self.backend.clone(),
            formats: self.formats,
            len: self.len,
            buf,
            regions: self.regions,
            stream: self.stream,
            offset: self.offset,
        }
    }
}

/// One tensor range's part in a launch.
struct Item<'a> {
    desc: Desc,
    /// Values to upload into `io` (gradients, initial values).
    input: Option<&'a [f32]>,
    /// Whether the range's decoded values come back through `io`.
    output: bool,
}

impl Item<'_> {
    fn io_need(&self) -> usize {
        if self.input.is_some() || self.output {
            self.desc.len as usize
        } else {
            0
        }
    }
}

/// The operation failed on the device; the [`Backend`] methods without an error path panic with
/// this message (a lost device cannot give model memory back, and carrying on would corrupt it).
fn fatal(what: &str, e: CudaError) -> ! {
    panic!("cuda: {what}: {e}")
}

impl Cuda {
    /// The backend on device `ordinal`, with a new stream and default options.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        Self::with_stream(device::open(ordinal)?, CudaOptions::default())
    }

    /// The backend on the caller's stream: every copy and launch is enqueued on it, in order.
    pub fn with_stream(
        stream: Arc<cudarc::driver::CudaStream>,
        options: CudaOptions,
    ) -> Result<Self, CudaError> {
        Self::build(Device::Gpu(device::Gpu::new(stream)?), options)
    }

    /// The kernels compiled for the host CPU (feature `emulate`): slow, but driven by exactly the
    /// code that drives a GPU, so the backend's logic is tested without one.
    #[cfg(feature = "emulate")]
    pub fn emulated(options: CudaOptions) -> Result<Self, CudaError> {
        // The descriptors are shared memory between Rust and C++: their layouts must agree.
        let expected = [
            std::mem::size_of::<Desc>() as u32,
            std::mem::offset_of!(Desc, slots) as u32,
            std::mem::size_of::<SlotDesc>() as u32,
        ];
        let found = emulate::layout();
        if found != expected {
            return Err(CudaError::Driver(format!(
                "the emulated kernels lay descriptors out as {found:?}, Rust as {expected:?}"
            )));
        }
        Self::build(Device::Host, options)
    }

    /// Whether a CUDA driver library can be loaded on this machine.
    pub fn driver_present() -> bool {
        device::driver_present()
    }

    fn build(device: Device, options: CudaOptions) -> Result<Self, CudaError> {
        let io_floats = (options.io_floats / TILE).max(1) * TILE;
        let table = layout::map_table();
        let mut maps = device.alloc(table.len())?;
        device.upload(&mut maps, 0, &table)?;
        Ok(Cuda {
            inner: Arc::new(Inner {
                device,
                maps,
                io_floats,
                launches: Default::default(),
                scratch: Mutex::new(Scratch::default()),
            }),
        })
    }

    /// The device's name ("NVIDIA H100 80GB HBM3", "host emulation").
    pub fn device_name(&self) -> String {
        match &self.inner.device {
            Device::Gpu(g) => g.name.clone(),
            #[cfg(feature = "emulate")]
            Device::Host => "host emulation".into(),
        }
    }

    /// The PTX architecture loaded ("sm_80", "sm_90"; "host" when emulated).
    pub fn arch(&self) -> &'static str {
        match &self.inner.device {
            Device::Gpu(g) => g.arch,
            #[cfg(feature = "emulate")]
            Device::Host => "host",
        }
    }

    /// The stream every operation is enqueued on (None when emulated).
    pub fn stream(&self) -> Option<&Arc<cudarc::driver::CudaStream>> {
        match &self.inner.device {
            Device::Gpu(g) => Some(&g.stream),
            #[cfg(feature = "emulate")]
            Device::Host => None,
        }
    }

    /// Kernel launches issued so far (a step launches once for all of its tensors, however many,
    /// unless their gradients exceed the io buffer).
    pub fn launches(&self) -> u64 {
        self.inner
            .launches
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits until the stream has run everything enqueued so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.inner.device.synchronize()
    }

    /// Seconds per device-to-device copy of `bytes` bytes (mean of `iters` copies after one
    /// warm-up): the reference a bandwidth figure is compared with, measured in the same run.
    pub fn time_device_copy(&self, bytes: usize, iters: usize) -> Result<f64, CudaError> {
        let dev = &self.inner.device;
        let src = dev.alloc(bytes.div_ceil(4))?;
        let mut dst = dev.alloc(bytes.div_ceil(4))?;
        dev.copy(&src, &mut dst)?;
        dev.synchronize()?;
        let start = std::time::Instant::now();
        for _ in 0..iters.max(1) {
            dev.copy(&src, &mut dst)?;
        }
        dev.synchronize()?;
        Ok(start.elapsed().as_secs_f64() / iters.max(1) as f64)
    }

    fn scratch(&self) -> MutexGuard<'_, Scratch> {
        // A panic while the lock was held leaves at worst a buffer that is replaced next time.
        self.inner.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The descriptor of elements `start .. start + len` of `param` (`start` a multiple of the
    /// tile, so every block, packed word and random block stays whole).
    fn desc(&self, param: &CudaParam, start: usize, len: usize, seed: u64) -> Desc {
        let dev = &self.inner.device;
        let mut d = Desc::zeroed();
        d.len = len as u64;
        // Random words are keyed by the logical parameter and element (a shard's `offset`).
        d.offset = (param.offset + start) as u64;
        d.index = param.stream as u64;
        d.seed = seed;
        for (s, f) in param.formats.iter().enumerate() {
            let (ra, rb) = param.regions[s];
            // Word offsets of element `start` in the two regions.
            let (oa, ob) = match (f.code, f.storage) {
                (_, None) => (0, 0),
                (FMT_QUANT, Some(Storage::Quantized { map, block, .. })) => (
                    packed_len(start, map.shared().bits()) / 4,
                    start / block.get(),
                ),
                _ => {
                    let (wa, wb) = f.words(start);
                    (wa, wb)
                }
            };
            d.slots[s] = SlotDesc {
                fmt: f.code,
                aux: f.aux,
                a: dev.ptr(&param.buf, ra + oa),
                b: dev.ptr(&param.buf, rb + ob),
            };
        }
        d
    }

    /// Descriptors covering the whole of `param`, in ranges of at most `io_floats` elements when
    /// the operation moves values through `io`.
    fn ranges(&self, param: &CudaParam, with_io: bool) -> Vec<(usize, usize)> {
        let step = if with_io {
            self.inner.io_floats
        } else {
            param.len.max(1)
        };
        (0..param.len.max(1))
            .step_by(step)
            .map(|s| (s, step.min(param.len - s)))
            .collect()
    }

    /// Runs `kernel` over every item, in as few launches as the io buffer allows, and returns the
    /// `output` items' values (in item order) and, for the step, the flag words (`flag_words` of
    /// them, indexed by `Desc::flag_index`).
    fn run(
        &self,
        kernel: Kernel,
        items: &mut [Item<'_>],
        flag_words: usize,
    ) -> Result<(Vec<Vec<f32>>, Vec<u32>), CudaError> {
        let dev = &self.inner.device;
        let mut scratch = self.scratch();
        let flag_words = flag_words.max(1);
        if scratch.flags.as_ref().is_none_or(|b| b.len() < flag_words) {
            dev.synchronize()?;
            scratch.flags = Some(dev.alloc(flag_words.next_power_of_two())?);
        }
        if kernel == Kernel::Step {
            let zeros = vec![0u32; flag_words];
            dev.upload(scratch.flags.as_mut().expect("allocated"), 0, &zeros)?;
        }
        let mut outputs = vec![Vec::new(); items.len()];
        let mut k = 0;
        while k < items.len() {
            // A batch: consecutive items whose io needs fit the io buffer.
            let first = k;
            let mut used = 0usize;
            let mut tiles = 0u64;
            while k < items.len()
                && (k == first || used + items[k].io_need() <= self.inner.io_floats)
            {
                let it = &mut items[k];
                it.desc.input = used as u64;
                it.desc.tile_begin = tiles;
                tiles += (it.desc.len as usize).div_ceil(TILE) as u64;
                used += it.io_need();
                k += 1;
            }
            let batch = &items[first..k];
            let descs: Vec<Desc> = batch.iter().map(|it| it.desc).collect();
            let words: &[u32] = bytemuck::cast_slice(&descs);
            if scratch.descs.as_ref().is_none_or(|b| b.len() < words.len()) {
                dev.synchronize()?;
                scratch.descs = Some(dev.alloc(words.len().next_power_of_two())?);
            }
            if scratch.io.as_ref().is_none_or(|b| b.len() < used) {
                dev.synchronize()?;
                scratch.io = Some(dev.alloc(used.next_power_of_two().min(self.inner.io_floats))?);
            }
            dev.upload(scratch.descs.as_mut().expect("allocated"), 0, words)?;
            for it in batch {
                if let Some(input) = it.input {
                    let io = scratch.io.as_mut().expect("allocated");
                    dev.upload(io, it.desc.input as usize, bytemuck::cast_slice(input))?;
                }
            }
            let grid = u32::try_from(tiles).map_err(|_| {
                CudaError::Driver(format!("{tiles} blocks exceed one launch's grid"))
            })?;
            let s = &*scratch;
            dev.launch(
                kernel,
                grid,
                descs.len() as u32,
                LaunchBufs {
                    descs: s.descs.as_ref().expect("allocated"),
                    io: s.io.as_ref().expect("allocated"),
                    maps: &self.inner.maps,
                    flags: s.flags.as_ref().expect("allocated"),
                },
            )?;
            self.inner
                .launches
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            for (j, it) in batch.iter().enumerate() {
                if it.output {
                    let io = s.io.as_ref().expect("allocated");
                    let words = dev.download(io, it.desc.input as usize, it.desc.len as usize)?;
                    outputs[first + j] = words.into_iter().map(f32::from_bits).collect();
                }
            }
        }
        let flags = if kernel == Kernel::Step {
            dev.download(scratch.flags.as_ref().expect("allocated"), 0, flag_words)?
        } else {
            Vec::new()
        };
        Ok((outputs, flags))
    }

    /// Decodes one slot of `param` (host order).
    fn decode(&self, param: &CudaParam, slot: SlotKind) -> Result<Vec<f32>, CudaError> {
        let mut items: Vec<Item<'_>> = self
            .ranges(param, true)
            .into_iter()
            .map(|(s, n)| {
                let mut desc = self.desc(param, s, n, 0);
                desc.mode = slot as u32;
                Item {
                    desc,
                    input: None,
                    output: true,
                }
            })
            .collect();
        let (outputs, _) = self.run(Kernel::Decode, &mut items, 0)?;
        Ok(outputs.concat())
    }

    /// The raw words of `slot`'s two regions.
    fn raw(&self, param: &CudaParam, slot: SlotKind) -> Result<Words, CudaError> {
        let (wa, wb) = param.formats[slot as usize].words(param.len);
        let (a, b) = param.regions[slot as usize];
        let dev = &self.inner.device;
        Ok((
            dev.download(&param.buf, a, wa)?,
            dev.download(&param.buf, b, wb)?,
        ))
    }

    fn write_raw(
        &self,
        param: &mut CudaParam,
        slot: SlotKind,
        words: &Words,
    ) -> Result<(), CudaError> {
        let (a, b) = param.regions[slot as usize];
        let dev = &self.inner.device;
        dev.upload(&mut param.buf, a, &words.0)?;
        dev.upload(&mut param.buf, b, &words.1)
    }

    fn allocate_param(
        &self,
        _index: usize,
        meta: &ParamMeta,
        init: &[f32],
        seed: u64,
    ) -> Result<CudaParam, OptimError> {
        let formats = layout::slot_formats(meta, NAME)?;
        let n = meta.numel;
        let mut at = 0;
        let regions = formats.map(|f| {
            let (wa, wb) = f.words(n);
            let r = (at, at + wa);
            at += wa + wb;
            r
        });
        let buf = self.inner.device.alloc(at)?;
        let mut param = CudaParam {
            backend: self.clone(),
            formats,
            len: n,
            buf,
            regions,
            stream: meta.stream,
            offset: meta.offset,
        };
        // Quantized codes start as the CPU initialises them (every byte the code of 0); the rest
        // of the fresh allocation is already zero.
        for slot in SlotKind::ALL {
            let f = formats[slot as usize];
            if f.code == FMT_QUANT {
                self.write_raw(&mut param, slot, &f.fresh(n))?;
            }
        }
        let mut items: Vec<Item<'_>> = self
            .ranges(&param, true)
            .into_iter()
            .map(|(s, len)| Item {
                desc: self.desc(&param, s, len, seed),
                input: Some(&init[s..s + len]),
                output: false,
            })
            .collect();
        self.run(Kernel::Init, &mut items, 0)?;
        Ok(param)
    }

    fn step_params(
        &self,
        params: &[CudaParam],
        metas: &[ParamMeta],
        seed: u64,
        clip: f32,
        released: Option<(usize, &[f32])>,
        non_finite: &mut [bool],
    ) -> Result<(), CudaError> {
        let mut items = Vec::new();
        let stepping = layout::stepping(metas, released);
        for &(index, extra, rule) in &stepping {
            let (p, meta) = (&params[index], &metas[index]);
            let words = RuleWords::of(rule);
            for (s, n) in self.ranges(p, extra.is_some()) {
                let mut desc = self.desc(p, s, n, seed);
                desc.step = meta.steps + 1;
                desc.flags = if meta.steps == 0 { F_FIRST } else { 0 }
                    | if meta.update_param { F_UPDATE_PARAM } else { 0 }
                    | if extra.is_some() { F_INPUT } else { 0 };
                desc.flag_index = index as u32;
                desc.clip = clip;
                desc.rule = words.kind;
                desc.rc = words.constants;
                desc.rule_flags = words.flags;
                items.push(Item {
                    desc,
                    input: extra.map(|g| &g[s..s + n]),
                    output: false,
                });
            }
        }
        let (_, flags) = self.run(Kernel::Step, &mut items, params.len())?;
        for (f, w) in non_finite
            .iter_mut()
            .zip(flags.iter().chain(std::iter::repeat(&0)))
        {
            *f = *w != 0;
        }
        Ok(())
    }
}

impl Backend for Cuda {
    type Param = CudaParam;

    fn name(&self) -> &'static str {
        NAME
    }

    fn allocate(
        &self,
        index: usize,
        meta: &ParamMeta,
        init: &[f32],
        seed: u64,
    ) -> Result<CudaParam, OptimError> {
        self.allocate_param(index, meta, init, seed)
    }

    fn accumulate(
        &self,
        _index: usize,
        param: &mut CudaParam,
        meta: &ParamMeta,
        grad: &[f32],
        seed: u64,
    ) {
        let mut items: Vec<Item<'_>> = self
            .ranges(param, true)
            .into_iter()
            .map(|(s, n)| {
                let mut desc = self.desc(param, s, n, seed);
                desc.acc = meta.accumulations;
                Item {
                    desc,
                    input: Some(&grad[s..s + n]),
                    output: false,
                }
            })
            .collect();
        if let Err(e) = self.run(Kernel::Accumulate, &mut items, 0) {
            fatal("accumulate", e);
        }
    }

    fn gradient_stats(
        &self,
        params: &mut [CudaParam],
        metas: &[ParamMeta],
        out: &mut [(lpmm_optim::ExactSum, bool)],
    ) {
        // Every active accumulator decoded in as few launches as the io buffer allows, summed on
        // the host in the CPU's order (the price of a bit-identical norm: 4 bytes per element).
        let mut items = Vec::new();
        let mut owner = Vec::new();
        for (index, (p, m)) in params.iter().zip(metas).enumerate() {
            if m.active {
                for (s, n) in self.ranges(p, true) {
                    let mut desc = self.desc(p, s, n, 0);
                    desc.mode = SlotKind::Grad as u32;
                    items.push(Item {
                        desc,
                        input: None,
                        output: true,
                    });
                    owner.push(index);
                }
            }
        }
        let outputs = match self.run(Kernel::Decode, &mut items, 0) {
            Ok((o, _)) => o,
            Err(e) => fatal("gradient statistics", e),
        };
        layout::stats_by_owner(&owner, &outputs, out);
    }

    fn step(
        &self,
        params: &mut [CudaParam],
        metas: &[ParamMeta],
        seed: u64,
        clip: f32,
        released: Option<(usize, &[f32])>,
        non_finite: &mut [bool],
    ) {
        if let Err(e) = self.step_params(params, metas, seed, clip, released, non_finite) {
            fatal("step", e);
        }
    }

    fn clear_gradients(&self, params: &mut [CudaParam]) {
        let mut items: Vec<Item<'_>> = params
            .iter()
            .map(|p| Item {
                desc: self.desc(p, 0, p.len, 0),
                input: None,
                output: false,
            })
            .collect();
        if let Err(e) = self.run(Kernel::Clear, &mut items, 0) {
            fatal("clear gradients", e);
        }
    }

    fn read(&self, param: &CudaParam, _meta: &ParamMeta, slot: SlotKind, out: &mut [f32]) {
        let values = self
            .decode(param, slot)
            .unwrap_or_else(|e| fatal("read", e));
        let n = out.len().min(values.len());
        out[..n].copy_from_slice(&values[..n]);
    }

    fn export(&self, param: &CudaParam, _meta: &ParamMeta, slot: SlotKind) -> HostSlot {
        let f = param.formats[slot as usize];
        let words = self.raw(param, slot).unwrap_or_else(|e| fatal("export", e));
        layout::export(f.storage, &[param.len], &[words])
    }

    fn import(
        &self,
        param: &mut CudaParam,
        meta: &ParamMeta,
        slot: SlotKind,
        host: HostSlot,
    ) -> Result<(), String> {
        let f = param.formats[slot as usize];
        let parts = layout::import(f.storage, meta.numel, &[param.len], slot, host)?;
        self.write_raw(param, slot, &parts[0])
            .map_err(|e| e.to_string())
    }

    fn bytes(&self, param: &CudaParam) -> [usize; 4] {
        param.formats.map(|f| {
            let (a, b) = f.words(param.len);
            4 * (a + b)
        })
    }
}
