//! The wgpu backend of lpmm-optim: parameters, gradient accumulators and optimizer states live
//! in device buffers, and every operation of the [`Backend`] seam runs as a WGSL compute shader
//! (`src/step.wgsl`) that reproduces the CPU reference: integer, comparison and rounding paths
//! bit for bit everywhere, and the whole step bit for bit where the driver's f32 arithmetic is
//! IEEE (correctly rounded division and square root, no contraction of `a * b + c`, subnormals
//! kept), as on Mesa's lavapipe. docs/BACKENDS.md states what is supported and the bounds.
//!
//! ```no_run
//! use lpmm_optim::{Optimizer, OptimizerOptions, presets};
//! use lpmm_wgpu::Wgpu;
//!
//! let backend = Wgpu::new(Default::default())?;
//! let mut opt = Optimizer::with_backend(backend, OptimizerOptions::default())?;
//! opt.add_group(presets::adamw_8bit_bf16(1e-3))?;
//! let w = opt.add_param("w", &[1024, 1024], &vec![0.01; 1 << 20], 0)?;
//! opt.accumulate(w, &vec![1e-3; 1 << 20])?;
//! opt.step()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Layout: device memory is a list of *segments* (storage buffers no larger than the adapter's
//! storage-binding limit). A parameter is cut into *pieces* of at most
//! [`WgpuOptions::piece_elements`] elements (a multiple of 4096, so quantization blocks stay
//! whole), and each piece keeps all of its slots in one segment. One dispatch steps every piece
//! of a segment, whatever parameter it belongs to: a model of thousands of small tensors costs a
//! dispatch per segment, not per tensor.

use std::sync::{Arc, Mutex, MutexGuard};

use lpmm_optim::device::{self, RuleWords, SlotFormat, Words};
use lpmm_optim::{Backend, HostSlot, OptimError, ParamMeta, Rule, SlotKind};
use wgpu::util::DeviceExt;

/// Elements one workgroup handles (the CPU's chunk): every block size divides it.
const TILE: usize = 4096;
/// Words per piece descriptor (see `step.wgsl`).
const DESC_WORDS: usize = 48;
/// Workgroups per dispatch dimension (WebGPU's guaranteed minimum).
const MAX_GROUPS_X: usize = 65_535;
const NAME: &str = "wgpu";

/// How the backend lays out device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WgpuOptions {
    /// Bytes per segment buffer (clamped to the adapter's storage-binding and buffer limits).
    pub segment_bytes: u64,
    /// Elements per piece: a multiple of 4096; a piece's slots must fit one segment.
    pub piece_elements: usize,
    /// Bytes of the staging buffer that carries gradients in and decoded values out (clamped
    /// like segments; at least one piece of f32).
    pub io_bytes: u64,
}

impl Default for WgpuOptions {
    fn default() -> Self {
        Self {
            segment_bytes: 128 << 20,
            piece_elements: 1 << 20,
            io_bytes: 64 << 20,
        }
    }
}

/// Why a wgpu backend could not be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WgpuError {
    /// No adapter (GPU driver, or a software one such as lavapipe) was found.
    #[error(
        "no wgpu adapter: {0} (on Linux without a GPU, install Mesa's lavapipe: apt-get install mesa-vulkan-drivers)"
    )]
    NoAdapter(String),
    /// The adapter refused the device.
    #[error("wgpu device request failed: {0}")]
    Device(String),
    /// The options do not fit the adapter's limits.
    #[error("wgpu backend options: {0}")]
    Options(String),
}

/// The wgpu backend. Cheap to clone (clones share the device and its memory).
#[derive(Clone)]
pub struct Wgpu {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Wgpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wgpu")
            .field("adapter", &self.inner.info.name)
            .field("backend", &self.inner.info.backend)
            .field("segment_words", &self.inner.segment_words)
            .field("piece_elements", &self.inner.piece)
            .finish()
    }
}

struct Inner {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    layout: wgpu::BindGroupLayout,
    pipelines: [wgpu::ComputePipeline; 5],
    arith: wgpu::ComputePipeline,
    behaviour: FloatBehaviour,
    maps: wgpu::Buffer,
    io: wgpu::Buffer,
    io_floats: usize,
    segment_words: usize,
    piece: usize,
    dispatches: std::sync::atomic::AtomicU64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    segments: Vec<Segment>,
    flags: Option<(wgpu::Buffer, usize)>,
}

/// One storage buffer and its free word ranges (first fit, coalesced on release).
struct Segment {
    buffer: wgpu::Buffer,
    free: Vec<(usize, usize)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    Init = 0,
    Accumulate = 1,
    Decode = 2,
    Clear = 3,
    Step = 4,
}

const ENTRIES: [&str; 5] = [
    "init_main",
    "accumulate_main",
    "decode_main",
    "clear_main",
    "step_main",
];

/// One piece of a parameter on the device.
#[derive(Debug, Clone)]
struct Piece {
    segment: usize,
    /// First element, tensor-relative.
    offset: usize,
    len: usize,
    /// The piece's word range in its segment.
    base: usize,
    words: usize,
    /// Word offsets of each slot's two regions.
    regions: [(usize, usize); 4],
}

/// Everything the wgpu backend holds for one parameter. Cloning copies the device memory;
/// dropping returns it to its segments.
pub struct WgpuParam {
    backend: Wgpu,
    formats: [SlotFormat; 4],
    pieces: Vec<Piece>,
    /// `ParamMeta::stream` and `ParamMeta::offset`: what keys the random words.
    stream: usize,
    offset: usize,
}

impl std::fmt::Debug for WgpuParam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgpuParam")
            .field("formats", &self.formats)
            .field("pieces", &self.pieces)
            .finish()
    }
}

impl Clone for WgpuParam {
    /// A deep copy: new device memory with the same contents.
    ///
    /// # Panics
    ///
    /// If the device has no memory left for the copy (`Clone` cannot return an error).
    fn clone(&self) -> Self {
        let inner = &self.backend.inner;
        let mut state = inner.lock();
        let mut encoder = inner.device.create_command_encoder(&Default::default());
        let mut pieces = Vec::with_capacity(self.pieces.len());
        for piece in &self.pieces {
            let (segment, base) = state
                .reserve(inner, piece.words)
                .expect("wgpu: no device memory left to clone a parameter");
            encoder.copy_buffer_to_buffer(
                &state.segments[piece.segment].buffer,
                4 * piece.base as u64,
                &state.segments[segment].buffer,
                4 * base as u64,
                4 * piece.words as u64,
            );
            let shift = |w: usize| w - piece.base + base;
            pieces.push(Piece {
                segment,
                base,
                regions: piece.regions.map(|(a, b)| (shift(a), shift(b))),
                ..piece.clone()
            });
        }
        inner.queue.submit([encoder.finish()]);
        WgpuParam {
            backend: self.backend.clone(),
            formats: self.formats,
            pieces,
            stream: self.stream,
            offset: self.offset,
        }
    }
}

impl Drop for WgpuParam {
    fn drop(&mut self) {
        let mut state = self.backend.inner.lock();
        for piece in &self.pieces {
            state.release(piece.segment, piece.base, piece.words);
        }
    }
}

impl State {
    /// Reserves `words` contiguous words in some segment (first fit; a new segment if none has
    /// room).
    fn reserve(&mut self, inner: &Inner, words: usize) -> Result<(usize, usize), OptimError> {
        if words > inner.segment_words {
            return Err(OptimError::Device {
                backend: NAME,
                reason: format!(
                    "a piece needs {words} words, more than a segment holds ({}); lower piece_elements",
                    inner.segment_words
                ),
            });
        }
        let words = words.max(1);
        for (s, seg) in self.segments.iter_mut().enumerate() {
            if let Some(k) = seg.free.iter().position(|&(_, len)| len >= words) {
                let (start, len) = seg.free[k];
                if len == words {
                    seg.free.remove(k);
                } else {
                    seg.free[k] = (start + words, len - words);
                }
                return Ok((s, start));
            }
        }
        let scope = inner
            .device
            .push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = inner.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("lpmm segment"),
            size: 4 * inner.segment_words as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if let Some(error) = pollster::block_on(scope.pop()) {
            return Err(OptimError::Device {
                backend: NAME,
                reason: error.to_string(),
            });
        }
        self.segments.push(Segment {
            buffer,
            free: vec![(words, inner.segment_words - words)],
        });
        Ok((self.segments.len() - 1, 0))
    }

    fn release(&mut self, segment: usize, start: usize, words: usize) {
        let Some(seg) = self.segments.get_mut(segment) else {
            return;
        };
        let words = words.max(1);
        let at = seg.free.partition_point(|&(s, _)| s < start);
        seg.free.insert(at, (start, words));
        // Coalesce with the neighbours.
        if at + 1 < seg.free.len() && seg.free[at].0 + seg.free[at].1 == seg.free[at + 1].0 {
            seg.free[at].1 += seg.free[at + 1].1;
            seg.free.remove(at + 1);
        }
        if at > 0 && seg.free[at - 1].0 + seg.free[at - 1].1 == seg.free[at].0 {
            seg.free[at - 1].1 += seg.free[at].1;
            seg.free.remove(at);
        }
    }
}

/// One piece's part in a dispatch.
struct Item<'a> {
    piece: &'a Piece,
    desc: [u32; DESC_WORDS],
    /// Values to upload into `io` for the piece (gradients, initial values).
    input: Option<&'a [f32]>,
    /// Whether the piece's decoded values come back through `io`.
    output: bool,
}

// Descriptor fields (see step.wgsl).
const D_LEN: usize = 0;
const D_OFF: usize = 1;
const D_IDX: usize = 3;
const D_STEP: usize = 5;
const D_ACC: usize = 7;
const D_SEED: usize = 9;
const D_FLAGS: usize = 11;
const D_INPUT: usize = 12;
const D_FLAG_INDEX: usize = 13;
const D_SLOTS: usize = 14;
const D_RULE: usize = 30;
const D_RC: usize = 31;
const D_CLIP: usize = 42;
const D_RULE_FLAGS: usize = 43;
const D_MODE: usize = 44;

const F_FIRST: u32 = 1;
const F_UPDATE_PARAM: u32 = 2;
const F_INPUT: u32 = 4;

fn put64(desc: &mut [u32; DESC_WORDS], at: usize, x: u64) {
    desc[at] = x as u32;
    desc[at + 1] = (x >> 32) as u32;
}

/// The rule's kind, constants and flags as the shader reads them.
fn put_rule(desc: &mut [u32; DESC_WORDS], rule: Rule) {
    let words = RuleWords::of(rule);
    desc[D_RULE] = words.kind;
    for (k, c) in words.constants.iter().enumerate() {
        desc[D_RC + k] = c.to_bits();
    }
    desc[D_RULE_FLAGS] = words.flags;
}

fn piece_lens(param: &WgpuParam) -> Vec<usize> {
    param.pieces.iter().map(|p| p.len).collect()
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held cannot leave the free lists inconsistent in a way that
        // matters more than refusing all further work would.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Wgpu {
    /// The first adapter wgpu offers (a discrete GPU first; lavapipe on a machine without one),
    /// with `options`. `WGPU_BACKEND` (e.g. `vulkan`) and `WGPU_ADAPTER_NAME` narrow the choice.
    pub fn new(options: WgpuOptions) -> Result<Self, WgpuError> {
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            force_fallback_adapter: false,
            compatible_surface: None,
            apply_limit_buckets: false,
        }))
        .map_err(|e| WgpuError::NoAdapter(e.to_string()))?;
        Self::with_adapter(&adapter, options)
    }

    /// The backend on a given adapter.
    pub fn with_adapter(adapter: &wgpu::Adapter, options: WgpuOptions) -> Result<Self, WgpuError> {
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("lpmm"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| WgpuError::Device(e.to_string()))?;
        let cap = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size)
            & !3;
        let segment_words = (options.segment_bytes.min(cap) / 4) as usize;
        let io_floats = (options.io_bytes.min(cap) / 4) as usize;
        let piece = options.piece_elements;
        if piece == 0 || !piece.is_multiple_of(TILE) {
            return Err(WgpuError::Options(format!(
                "piece_elements = {piece} is not a positive multiple of {TILE}"
            )));
        }
        if io_floats < piece {
            return Err(WgpuError::Options(format!(
                "io_bytes holds {io_floats} floats, fewer than one piece ({piece})"
            )));
        }
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("lpmm step.wgsl"),
            source: wgpu::ShaderSource::Wgsl(include_str!("step.wgsl").into()),
        });
        let storage = |binding: u32, read_only: bool| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("lpmm"),
            entries: &[
                storage(0, false),
                storage(1, true),
                storage(2, false),
                storage(3, true),
                storage(4, false),
            ],
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("lpmm"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let maps = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("lpmm code maps"),
            contents: bytemuck::cast_slice(&device::map_table()),
            usage: wgpu::BufferUsages::STORAGE,
        });
        let io = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("lpmm io"),
            size: 4 * io_floats as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let pipeline = |entry: &str, fma_native: bool| {
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&pipeline_layout),
                module: &module,
                entry_point: Some(entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &[("FMA_NATIVE", if fma_native { 1.0 } else { 0.0 })],
                    zero_initialize_workgroup_memory: true,
                },
                cache: None,
            })
        };
        let arith = pipeline("arith_main", false);
        let behaviour = probe(&device, &queue, &layout, &arith, &maps, &io);
        if !behaviour.fma_soft_exact {
            return Err(WgpuError::Device(format!(
                "the software fma disagrees with the CPU's on this adapter ({behaviour:?})"
            )));
        }
        let pipelines = ENTRIES.map(|entry| pipeline(entry, behaviour.fma_fused));
        let info = adapter.get_info();
        let inner = Inner {
            device,
            queue,
            info,
            layout,
            pipelines,
            arith,
            behaviour,
            maps,
            io,
            io_floats,
            segment_words,
            piece,
            dispatches: Default::default(),
            state: Mutex::new(State::default()),
        };
        Ok(Wgpu {
            inner: Arc::new(inner),
        })
    }

    /// What the probe at creation found about the driver's f32 arithmetic, and so which results
    /// equal the CPU's bit for bit (docs/BACKENDS.md).
    pub fn float_behaviour(&self) -> FloatBehaviour {
        self.inner.behaviour
    }

    /// Runs the arithmetic probe kernel on `triples`: for each `(a, b, c)`, the driver's
    /// `fma(a, b, c)`, the shader's exact software fma, `a * b + c`, `a / b` and `sqrt(|a|)`.
    /// For tests and diagnostics.
    pub fn probe_arith(&self, triples: &[[f32; 3]]) -> Vec<[f32; 5]> {
        let inner = &*self.inner;
        let _state = inner.lock();
        run_arith(
            &inner.device,
            &inner.queue,
            &inner.layout,
            &inner.arith,
            &inner.maps,
            &inner.io,
            triples,
        )
    }

    /// The adapter in use.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.inner.info
    }

    /// Words per segment after clamping to the adapter's limits.
    pub fn segment_words(&self) -> usize {
        self.inner.segment_words
    }

    /// Compute dispatches issued so far (a step issues one per segment it touches, however many
    /// tensors the segment holds).
    pub fn dispatches(&self) -> u64 {
        self.inner
            .dispatches
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Number of segment buffers allocated so far.
    pub fn segments(&self) -> usize {
        self.inner.lock().segments.len()
    }

    /// Runs `entry` over every tile of `items`, in as few dispatches as the segments and the io
    /// buffer allow, and returns the `output` items' values (in item order) and the flags.
    fn run(&self, entry: Entry, items: &[Item<'_>]) -> (Vec<Vec<f32>>, Vec<bool>) {
        let inner = &*self.inner;
        let mut state = inner.lock();
        let flag_words = items.len().max(1);
        let flags = match &state.flags {
            Some((buffer, n)) if *n >= flag_words => buffer.clone(),
            _ => {
                let n = flag_words.next_power_of_two();
                let buffer = inner.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("lpmm flags"),
                    size: 4 * n as u64,
                    usage: wgpu::BufferUsages::STORAGE
                        | wgpu::BufferUsages::COPY_SRC
                        | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                state.flags = Some((buffer.clone(), n));
                buffer
            }
        };
        let mut outputs: Vec<Vec<f32>> = vec![Vec::new(); items.len()];
        if entry == Entry::Step {
            let mut encoder = inner.device.create_command_encoder(&Default::default());
            encoder.clear_buffer(&flags, 0, Some(4 * flag_words as u64));
            inner.queue.submit([encoder.finish()]);
        }
        // Batches: consecutive items of one segment whose io needs fit the io buffer.
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by_key(|&k| items[k].piece.segment);
        let io_need = |it: &Item<'_>| {
            if it.input.is_some() || it.output {
                it.piece.len
            } else {
                0
            }
        };
        let mut k = 0;
        while k < order.len() {
            let segment = items[order[k]].piece.segment;
            let mut batch = Vec::new();
            let mut used = 0usize;
            while k < order.len()
                && items[order[k]].piece.segment == segment
                && used + io_need(&items[order[k]]) <= inner.io_floats
            {
                batch.push((order[k], used));
                used += io_need(&items[order[k]]);
                k += 1;
            }
            self.dispatch(&state, entry, items, &batch, &flags, &mut outputs);
        }
        let flagged = if entry == Entry::Step {
            let words = read_back(inner, &flags, flag_words);
            words.iter().map(|&w| w != 0).collect()
        } else {
            Vec::new()
        };
        (outputs, flagged)
    }

    fn dispatch(
        &self,
        state: &State,
        entry: Entry,
        items: &[Item<'_>],
        batch: &[(usize, usize)],
        flags: &wgpu::Buffer,
        outputs: &mut [Vec<f32>],
    ) {
        let inner = &*self.inner;
        let Some(&(first, _)) = batch.first() else {
            return;
        };
        let segment = &state.segments[items[first].piece.segment].buffer;
        let tiles: usize = batch
            .iter()
            .map(|&(k, _)| items[k].piece.len.div_ceil(TILE))
            .sum();
        let desc_base = 2 + 2 * tiles;
        let mut work = vec![0u32; desc_base + DESC_WORDS * batch.len()];
        work[0] = tiles as u32;
        work[1] = desc_base as u32;
        let mut t = 0;
        for (d, &(k, io_at)) in batch.iter().enumerate() {
            let item = &items[k];
            let mut desc = item.desc;
            desc[D_INPUT] = io_at as u32;
            desc[D_FLAG_INDEX] = k as u32;
            work[desc_base + DESC_WORDS * d..][..DESC_WORDS].copy_from_slice(&desc);
            for start in (0..item.piece.len).step_by(TILE) {
                work[2 + 2 * t] = d as u32;
                work[3 + 2 * t] = start as u32;
                t += 1;
            }
            if let Some(input) = item.input {
                inner
                    .queue
                    .write_buffer(&inner.io, 4 * io_at as u64, bytemuck::cast_slice(input));
            }
        }
        let work = inner
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("lpmm work"),
                contents: bytemuck::cast_slice(&work),
                usage: wgpu::BufferUsages::STORAGE,
            });
        let bind = inner.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("lpmm"),
            layout: &inner.layout,
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: segment.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: work.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 2,
                    resource: inner.io.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 3,
                    resource: inner.maps.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 4,
                    resource: flags.as_entire_binding(),
                },
            ],
        });
        let mut encoder = inner.device.create_command_encoder(&Default::default());
        {
            let mut pass = encoder.begin_compute_pass(&Default::default());
            pass.set_pipeline(&inner.pipelines[entry as usize]);
            pass.set_bind_group(0, &bind, &[]);
            let x = tiles.min(MAX_GROUPS_X);
            pass.dispatch_workgroups(x as u32, tiles.div_ceil(x) as u32, 1);
        }
        inner
            .dispatches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        inner.queue.submit([encoder.finish()]);
        let out_floats: usize = batch
            .iter()
            .filter(|&&(k, _)| items[k].output)
            .map(|&(k, at)| at + items[k].piece.len)
            .max()
            .unwrap_or(0);
        if out_floats > 0 {
            let words = read_back(inner, &inner.io, out_floats);
            for &(k, at) in batch.iter().filter(|&&(k, _)| items[k].output) {
                outputs[k] = words[at..at + items[k].piece.len]
                    .iter()
                    .map(|&w| f32::from_bits(w))
                    .collect();
            }
        }
    }

    /// The descriptor of `piece` of parameter `index`.
    fn desc(&self, param: &WgpuParam, piece: &Piece, seed: u64) -> [u32; DESC_WORDS] {
        let mut desc = [0u32; DESC_WORDS];
        desc[D_LEN] = piece.len as u32;
        // Random words are keyed by the logical parameter and element (a shard's `offset`).
        put64(&mut desc, D_OFF, (param.offset + piece.offset) as u64);
        put64(&mut desc, D_IDX, param.stream as u64);
        put64(&mut desc, D_SEED, seed);
        for (s, f) in param.formats.iter().enumerate() {
            let (a, b) = piece.regions[s];
            desc[D_SLOTS + 4 * s..][..4].copy_from_slice(&[f.code, f.aux, a as u32, b as u32]);
        }
        desc
    }

    /// Decodes one slot of every piece of `param` (host order).
    fn decode(&self, _index: usize, param: &WgpuParam, slot: SlotKind) -> Vec<f32> {
        let items: Vec<Item<'_>> = param
            .pieces
            .iter()
            .map(|piece| {
                let mut desc = self.desc(param, piece, 0);
                desc[D_MODE] = slot as u32;
                Item {
                    piece,
                    desc,
                    input: None,
                    output: true,
                }
            })
            .collect();
        let (outputs, _) = self.run(Entry::Decode, &items);
        outputs.concat()
    }

    /// Reads the raw words of each piece's regions of `slot`.
    fn raw(&self, param: &WgpuParam, slot: SlotKind) -> Vec<Words> {
        let inner = &*self.inner;
        let state = inner.lock();
        let f = param.formats[slot as usize];
        param
            .pieces
            .iter()
            .map(|piece| {
                let (wa, wb) = f.words(piece.len);
                let (a, b) = piece.regions[slot as usize];
                let buffer = &state.segments[piece.segment].buffer;
                (
                    read_range(inner, buffer, a, wa),
                    read_range(inner, buffer, b, wb),
                )
            })
            .collect()
    }

    /// Writes raw words into each piece's regions of `slot`.
    fn write_raw(&self, param: &WgpuParam, slot: SlotKind, parts: &[Words]) {
        let inner = &*self.inner;
        let state = inner.lock();
        for (piece, (wa, wb)) in param.pieces.iter().zip(parts) {
            let (a, b) = piece.regions[slot as usize];
            let buffer = &state.segments[piece.segment].buffer;
            if !wa.is_empty() {
                inner
                    .queue
                    .write_buffer(buffer, 4 * a as u64, bytemuck::cast_slice(wa));
            }
            if !wb.is_empty() {
                inner
                    .queue
                    .write_buffer(buffer, 4 * b as u64, bytemuck::cast_slice(wb));
            }
        }
        inner.queue.submit([]);
    }
}

/// What the driver's f32 arithmetic does, measured by running the probe kernel on inputs whose
/// correctly rounded results are known on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FloatBehaviour {
    /// WGSL `fma` is fused (one rounding) on every probe input: the shader uses it; otherwise
    /// it uses its exact software fma.
    pub fma_fused: bool,
    /// The software fma equals the CPU's `mul_add` on every probe input (always expected).
    pub fma_soft_exact: bool,
    /// `a / b` is correctly rounded on every probe input.
    pub div_exact: bool,
    /// `sqrt` is correctly rounded on every probe input.
    pub sqrt_exact: bool,
    /// Subnormal results are kept (not flushed to zero).
    pub subnormals_kept: bool,
}

impl FloatBehaviour {
    /// Whether every step is bit-exact with the CPU backend: correctly rounded division and
    /// square root, and subnormals kept (fma is exact either way).
    pub fn bit_exact(&self) -> bool {
        self.fma_soft_exact && self.div_exact && self.sqrt_exact && self.subnormals_kept
    }
}

/// The probe's inputs: products that need a fused rounding, cancellations, results that are
/// subnormal or overflow, and quotients and roots across the exponent range.
pub fn probe_inputs() -> Vec<[f32; 3]> {
    let mut s = 0x1234_5678_9ABC_DEF0u64;
    let mut next = move || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut out = Vec::new();
    let finite = |b: u32| {
        let x = f32::from_bits(b);
        if x.is_finite() { x } else { 1.0 }
    };
    for k in 0..4096 {
        let r = next();
        let a = finite(r as u32);
        let b = finite((r >> 32) as u32);
        let c = match k % 4 {
            // Cancellation: c close to -(a * b).
            0 => -(a * b) * (1.0 + f32::EPSILON * ((next() % 5) as f32 - 2.0)),
            1 => finite(next() as u32),
            // Moderate magnitudes, where fused and unfused differ most often.
            2 => a * b * 1e-3,
            _ => 0.0,
        };
        out.push([a, b, c]);
        // Ordinary magnitudes.
        let u = |x: u64| (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        out.push([u(next()) + 0.5, u(next()) * 3.0, u(next())]);
    }
    // Subnormal results of the plain product and of fma.
    for k in 0..64 {
        let a = 1.5e-20f32 * (1.0 + k as f32 / 64.0);
        out.push([a, 3.1e-20, 0.0]);
        out.push([a, -2.7e-19, 1e-39]);
    }
    out
}

fn probe(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    layout: &wgpu::BindGroupLayout,
    arith: &wgpu::ComputePipeline,
    maps: &wgpu::Buffer,
    io: &wgpu::Buffer,
) -> FloatBehaviour {
    let inputs = probe_inputs();
    let out = run_arith(device, queue, layout, arith, maps, io, &inputs);
    let same = |x: f32, y: f32| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
    let mut b = FloatBehaviour {
        fma_fused: true,
        fma_soft_exact: true,
        div_exact: true,
        sqrt_exact: true,
        subnormals_kept: true,
    };
    for (&[x, y, z], o) in inputs.iter().zip(&out) {
        let fused = x.mul_add(y, z);
        b.fma_fused &= same(o[0], fused);
        b.fma_soft_exact &= same(o[1], fused);
        let plain = x * y + z;
        if plain != 0.0 && plain.abs() < f32::MIN_POSITIVE {
            b.subnormals_kept &= same(o[2], plain);
        }
        let q = x / y;
        if q.is_normal() && x.is_normal() && y.is_normal() {
            b.div_exact &= same(o[3], q);
        }
        if x.is_normal() {
            b.sqrt_exact &= same(o[4], x.abs().sqrt());
        }
    }
    b
}

fn run_arith(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    layout: &wgpu::BindGroupLayout,
    arith: &wgpu::ComputePipeline,
    maps: &wgpu::Buffer,
    io: &wgpu::Buffer,
    triples: &[[f32; 3]],
) -> Vec<[f32; 5]> {
    let per_batch = (io.size() / 32) as usize;
    let mut results = Vec::with_capacity(triples.len());
    let flags = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("lpmm probe flags"),
        size: 4,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    for batch in triples.chunks(per_batch.max(1)) {
        let mut data = vec![0f32; 8 * batch.len()];
        for (k, t) in batch.iter().enumerate() {
            data[8 * k..8 * k + 3].copy_from_slice(t);
        }
        queue.write_buffer(io, 0, bytemuck::cast_slice(&data));
        let work = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("lpmm probe work"),
            contents: bytemuck::cast_slice(&[batch.len() as u32, 0u32]),
            usage: wgpu::BufferUsages::STORAGE,
        });
        // A segment binding the probe does not touch.
        let entries = [io, &work, io, maps, &flags];
        let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("lpmm probe"),
            layout,
            entries: &entries
                .iter()
                .enumerate()
                .map(|(k, b)| wgpu::BindGroupEntry {
                    binding: k as u32,
                    resource: b.as_entire_binding(),
                })
                .collect::<Vec<_>>(),
        });
        let mut encoder = device.create_command_encoder(&Default::default());
        {
            let mut pass = encoder.begin_compute_pass(&Default::default());
            pass.set_pipeline(arith);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(batch.len().div_ceil(64) as u32, 1, 1);
        }
        queue.submit([encoder.finish()]);
        let words = read_words(device, queue, io, 0, 8 * batch.len());
        for k in 0..batch.len() {
            let w = &words[8 * k + 3..8 * k + 8];
            results.push([0, 1, 2, 3, 4].map(|j| f32::from_bits(w[j])));
        }
    }
    results
}

/// Copies `words` words at word `at` of `buffer` to the host.
fn read_range(inner: &Inner, buffer: &wgpu::Buffer, at: usize, words: usize) -> Vec<u32> {
    read_words(&inner.device, &inner.queue, buffer, at, words)
}

fn read_words(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    buffer: &wgpu::Buffer,
    at: usize,
    words: usize,
) -> Vec<u32> {
    if words == 0 {
        return Vec::new();
    }
    let staging = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("lpmm readback"),
        size: 4 * words as u64,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut encoder = device.create_command_encoder(&Default::default());
    encoder.copy_buffer_to_buffer(buffer, 4 * at as u64, &staging, 0, 4 * words as u64);
    queue.submit([encoder.finish()]);
    let slice = staging.slice(..);
    slice.map_async(wgpu::MapMode::Read, |_| {});
    // A device that is lost cannot give the memory back: the Backend seam has no error path
    // for reads, and returning anything but the contents would corrupt a checkpoint silently.
    let _ = device.poll(wgpu::PollType::Wait {
        submission_index: None,
        timeout: None,
    });
    let data = slice
        .get_mapped_range()
        .expect("wgpu: the device was lost while reading memory back");
    let out = bytemuck::cast_slice::<u8, u32>(&data).to_vec();
    drop(data);
    staging.unmap();
    out
}

fn read_back(inner: &Inner, buffer: &wgpu::Buffer, words: usize) -> Vec<u32> {
    read_range(inner, buffer, 0, words)
}

impl Backend for Wgpu {
    type Param = WgpuParam;

    fn name(&self) -> &'static str {
        NAME
    }

    fn allocate(
        &self,
        _index: usize,
        meta: &ParamMeta,
        init: &[f32],
        seed: u64,
    ) -> Result<WgpuParam, OptimError> {
        let formats = device::slot_formats(meta, NAME)?;
        let mut param = WgpuParam {
            backend: self.clone(),
            formats,
            pieces: Vec::new(),
            stream: meta.stream,
            offset: meta.offset,
        };
        {
            let mut state = self.inner.lock();
            for offset in (0..meta.numel).step_by(self.inner.piece) {
                let len = self.inner.piece.min(meta.numel - offset);
                let sizes = formats.map(|f| f.words(len));
                let words: usize = sizes.iter().map(|(a, b)| a + b).sum();
                let (segment, base) = state.reserve(&self.inner, words)?;
                let mut at = base;
                let regions = sizes.map(|(a, b)| {
                    let r = (at, at + a);
                    at += a + b;
                    r
                });
                param.pieces.push(Piece {
                    segment,
                    offset,
                    len,
                    base,
                    words,
                    regions,
                });
            }
        }
        // Fresh memory: zeros, and quantized codes as the CPU initialises them (every byte the
        // code of 0); a reused range must not keep an earlier parameter's words.
        for slot in SlotKind::ALL {
            let f = formats[slot as usize];
            let parts: Vec<Words> = param.pieces.iter().map(|p| f.fresh(p.len)).collect();
            self.write_raw(&param, slot, &parts);
        }
        let items: Vec<Item<'_>> = param
            .pieces
            .iter()
            .map(|piece| Item {
                piece,
                desc: self.desc(&param, piece, seed),
                input: Some(&init[piece.offset..piece.offset + piece.len]),
                output: false,
            })
            .collect();
        self.run(Entry::Init, &items);
        Ok(param)
    }

    fn accumulate(
        &self,
        _index: usize,
        param: &mut WgpuParam,
        meta: &ParamMeta,
        grad: &[f32],
        seed: u64,
    ) {
        let items: Vec<Item<'_>> = param
            .pieces
            .iter()
            .map(|piece| {
                let mut desc = self.desc(param, piece, seed);
                put64(&mut desc, D_ACC, meta.accumulations);
                Item {
                    piece,
                    desc,
                    input: Some(&grad[piece.offset..piece.offset + piece.len]),
                    output: false,
                }
            })
            .collect();
        self.run(Entry::Accumulate, &items);
    }

    fn gradient_stats(
        &self,
        params: &mut [WgpuParam],
        metas: &[ParamMeta],
        out: &mut [(lpmm_optim::ExactSum, bool)],
    ) {
        // Every active accumulator decoded in as few dispatches as the io buffer allows.
        let mut items = Vec::new();
        let mut owner = Vec::new();
        for (index, (p, m)) in params.iter().zip(metas).enumerate() {
            if m.active {
                for piece in &p.pieces {
                    let mut desc = self.desc(p, piece, 0);
                    desc[D_MODE] = SlotKind::Grad as u32;
                    items.push(Item {
                        piece,
                        desc,
                        input: None,
                        output: true,
                    });
                    owner.push(index);
                }
            }
        }
        let (outputs, _) = self.run(Entry::Decode, &items);
        device::stats_by_owner(&owner, &outputs, out);
    }

    fn step(
        &self,
        params: &mut [WgpuParam],
        metas: &[ParamMeta],
        seed: u64,
        clip: f32,
        released: Option<(usize, &[f32])>,
        non_finite: &mut [bool],
    ) {
        let mut items = Vec::new();
        let mut owner = Vec::new();
        let stepping = device::stepping(metas, released);
        for &(index, extra, rule) in &stepping {
            let (p, meta) = (&params[index], &metas[index]);
            for piece in &p.pieces {
                let mut desc = self.desc(p, piece, seed);
                put64(&mut desc, D_STEP, meta.steps + 1);
                desc[D_FLAGS] = if meta.steps == 0 { F_FIRST } else { 0 }
                    | if meta.update_param { F_UPDATE_PARAM } else { 0 }
                    | if extra.is_some() { F_INPUT } else { 0 };
                desc[D_CLIP] = clip.to_bits();
                put_rule(&mut desc, rule);
                items.push(Item {
                    piece,
                    desc,
                    input: extra.map(|g| &g[piece.offset..piece.offset + piece.len]),
                    output: false,
                });
                owner.push(index);
            }
        }
        let (_, flagged) = self.run(Entry::Step, &items);
        non_finite.iter_mut().for_each(|f| *f = false);
        for (k, &index) in owner.iter().enumerate() {
            if flagged.get(k).copied().unwrap_or(false) {
                non_finite[index] = true;
            }
        }
    }

    fn clear_gradients(&self, params: &mut [WgpuParam]) {
        let items: Vec<Item<'_>> = params
            .iter()
            .flat_map(|p| {
                p.pieces.iter().map(move |piece| Item {
                    piece,
                    desc: self.desc(p, piece, 0),
                    input: None,
                    output: false,
                })
            })
            .collect();
        self.run(Entry::Clear, &items);
    }

    fn read(&self, param: &WgpuParam, _meta: &ParamMeta, slot: SlotKind, out: &mut [f32]) {
        let values = self.decode(0, param, slot);
        let n = out.len().min(values.len());
        out[..n].copy_from_slice(&values[..n]);
    }

    fn export(&self, param: &WgpuParam, _meta: &ParamMeta, slot: SlotKind) -> HostSlot {
        let f = param.formats[slot as usize];
        let parts = self.raw(param, slot);
        device::export(f.storage, &piece_lens(param), &parts)
    }

    fn import(
        &self,
        param: &mut WgpuParam,
        meta: &ParamMeta,
        slot: SlotKind,
        host: HostSlot,
    ) -> Result<(), String> {
        let f = param.formats[slot as usize];
        let parts = device::import(f.storage, meta.numel, &piece_lens(param), slot, host)?;
        self.write_raw(param, slot, &parts);
        Ok(())
    }

    fn bytes(&self, param: &WgpuParam) -> [usize; 4] {
        let mut bytes = [0usize; 4];
        for piece in &param.pieces {
            for (b, f) in bytes.iter_mut().zip(&param.formats) {
                let (a, c) = f.words(piece.len);
                *b += 4 * (a + c);
            }
        }
        bytes
    }
}
