//! The one host orchestration of every optimizer operation over device memory: [`Device`] runs
//! lpmm-optim's [`Backend`] seam on any [`Runtime`] — memory layout (pieces in arenas, tensor-wide
//! regions), descriptors, batching into as few launches as the bindings and the staging buffer
//! allow, gradient statistics, the step's tensor-wide phases (folds, combine on the host) and
//! fused pass,
//! export and import, lent parameters and device-resident inputs and outputs.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use lpmm_optim::backend::{
    Backend, BackendError, Dtype, FoldInput, Format, HostRegion, HostSlot, HostValues,
    HostValuesMut, Init, ParamLayout, ParamStep, Phase, Place, PlanRunner, RegionSpec, SLOTS,
    SlotKind, StepWork, Walked, run_step,
};
use lpmm_optim::backend::{ExactSum, add_squares};

use crate::abi::{
    Binding, CONST_WORDS, Desc, Entry, F_GIVEN_V, F_GIVEN_W, F_INPUT, F_INPUT_BF16, F_OUTPUT_BF16,
    F_TRANSFORM, F_UPDATE_PARAM, FOLD_MOMENT, FOLD_STATS, FOLD_UPDATED, MAX_DIMS, SLOT_REGIONS,
    STAT_SUM, STAT_WORDS, SlotDesc, TILE, map_table,
};
use crate::plans::{self, GradInput};
use crate::runtime::{Io, Launch, Runtime, Specialized};

/// How a [`Device`] lays out memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceOptions {
    /// Elements per piece: a multiple of 4096 (every quantization block stays whole). A piece's
    /// element regions lie together in one arena.
    pub piece_elements: usize,
    /// Floats of the staging buffer that carries host values in and out (at least one piece).
    pub io_floats: usize,
    /// Whether steps use the runtime's specialized kernels ([`crate::plans`]) where a plan
    /// has one (the default); `false` steps every parameter with the generic kernel (the same
    /// bits, slower).
    pub specialized: bool,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        Self {
            piece_elements: 1 << 20,
            io_floats: 16 << 20,
            specialized: true,
        }
    }
}

impl DeviceOptions {
    /// `piece_elements` per piece and a staging buffer of `io_floats` floats.
    pub const fn new(piece_elements: usize, io_floats: usize) -> Self {
        Self {
            piece_elements,
            io_floats,
            specialized: true,
        }
    }

    /// With `n` elements per piece.
    pub fn with_piece_elements(self, n: usize) -> Self {
        Self {
            piece_elements: n,
            ..self
        }
    }

    /// With a staging buffer of `n` floats.
    pub fn with_io_floats(self, n: usize) -> Self {
        Self {
            io_floats: n,
            ..self
        }
    }

    /// With the specialized kernels on or off ([`DeviceOptions::specialized`]).
    pub fn with_specialized(self, on: bool) -> Self {
        Self {
            specialized: on,
            ..self
        }
    }
}

/// A buffer of values in the backend's memory or on the host.
#[derive(Debug)]
pub enum DeviceInput<'a, R: Runtime> {
    /// Host values (uploaded through the staging buffer).
    Host(HostValues<'a>),
    /// A caller's device buffer (read where it is).
    Device(R::View<'a>),
}

impl<R: Runtime> Clone for DeviceInput<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: Runtime> Copy for DeviceInput<'_, R> {}

/// A writable buffer in the backend's memory or on the host.
#[derive(Debug)]
pub enum DeviceOutput<'a, R: Runtime> {
    /// Host values (read back through the staging buffer).
    Host(HostValuesMut<'a>),
    /// A caller's device buffer (written where it is).
    Device(R::View<'a>),
}

/// One reservation: `words` words at `start` of arena `arena`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    arena: usize,
    start: usize,
    words: usize,
}

/// An arena: one device buffer and its free word ranges (first fit, coalesced on release).
#[derive(Debug)]
struct Arena<B> {
    buffer: B,
    free: Vec<(usize, usize)>,
}

#[derive(Debug)]
struct Pool<B> {
    arenas: Vec<Option<Arena<B>>>,
}

impl<B> Default for Pool<B> {
    fn default() -> Self {
        Pool { arenas: Vec::new() }
    }
}

#[derive(Debug)]
struct State<B> {
    pieces: Pool<B>,
    wide: Pool<B>,
    io: Option<B>,
    flags: Option<B>,
}

struct Inner<R: Runtime> {
    rt: R,
    options: DeviceOptions,
    maps: R::Buffer,
    lost: Mutex<Option<BackendError>>,
    state: Mutex<State<R::Buffer>>,
    launches: AtomicU64,
    plan_launches: AtomicU64,
    reserved: AtomicU64,
}

/// lpmm-optim's [`Backend`] on a device runtime. Cheap to clone (clones share the device).
pub struct Device<R: Runtime> {
    inner: Arc<Inner<R>>,
}

impl<R: Runtime> Clone for Device<R> {
    fn clone(&self) -> Self {
        Device {
            inner: self.inner.clone(),
        }
    }
}

impl<R: Runtime> std::fmt::Debug for Device<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("runtime", &self.inner.rt.name())
            .field("options", &self.inner.options)
            .finish()
    }
}

/// One piece of a parameter on the device: its range and its slots' element regions (word
/// offsets in its arena), all in one reservation.
#[derive(Debug, Clone)]
struct Piece {
    offset: usize,
    len: usize,
    span: Span,
    /// `(word offset in the arena, words)` of each slot's element regions.
    regions: [[(usize, usize); 3]; SLOTS],
    /// Words of padding before each element region (where the runtime wants regions aligned:
    /// [`Specialized::Aligned`]), counted in the slot's bytes.
    pads: [[usize; 3]; SLOTS],
}

/// Everything a [`Device`] holds for one parameter. Dropping it returns its memory.
pub struct DeviceParam<R: Runtime> {
    device: Device<R>,
    pieces: Vec<Piece>,
    /// The reservation of every tensor-wide region of every slot.
    wide: Option<Span>,
    /// `(word offset in the wide arena, words)` of each slot's tensor-wide regions.
    wide_regions: [Vec<(usize, usize)>; SLOTS],
}

impl<R: Runtime> std::fmt::Debug for DeviceParam<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceParam")
            .field("pieces", &self.pieces.len())
            .field("wide", &self.wide)
            .finish()
    }
}

impl<R: Runtime> Drop for DeviceParam<R> {
    fn drop(&mut self) {
        let mut state = self.device.inner.lock();
        for piece in &self.pieces {
            self.device.release(&mut state.pieces, piece.span);
        }
        if let Some(span) = self.wide {
            self.device.release(&mut state.wide, span);
        }
    }
}

/// One item of a launch before it is laid out: its descriptor, where its values come from or go
/// to, and what it binds.
struct Item<'a, R: Runtime> {
    desc: Desc,
    /// Host values to upload for the item (element range of the tensor).
    host_in: Option<(HostValues<'a>, usize)>,
    /// The item's values come back through staging.
    host_out: bool,
    /// A caller's buffer as the io binding, and the element of it the item starts at.
    view_io: Option<(R::View<'a>, usize)>,
    /// A lent parameter's buffer.
    lent: Option<R::View<'a>>,
    /// The arena of the item's piece and of its tensor-wide regions.
    arena: usize,
    wide: Option<usize>,
    /// The specialized step that runs the item ([`crate::plans`]), if any.
    plan: Option<usize>,
}

/// What the step's items are made of.
struct StepCtx<'a, 'v, R: Runtime> {
    params: &'a [DeviceParam<R>],
    layouts: &'a [ParamLayout],
    stepping: &'a [(usize, ParamStep)],
    released: Option<(usize, DeviceInput<'v, R>)>,
    views: &'a [Option<R::View<'v>>],
    seed: u64,
}

/// The element regions of a slot of a tensor of `shape` (byte lengths for `n` elements).
fn elem_specs(format: Option<Format>, shape: &[usize]) -> Vec<RegionSpec> {
    format.map_or_else(Vec::new, |f| {
        f.regions(shape)
            .into_iter()
            .filter(|r| r.per_element())
            .collect()
    })
}

fn wide_specs(format: Option<Format>, shape: &[usize]) -> Vec<RegionSpec> {
    format.map_or_else(Vec::new, |f| {
        f.regions(shape)
            .into_iter()
            .filter(|r| !r.per_element())
            .collect()
    })
}

fn to_words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

fn to_bytes(words: &[u32], n: usize) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).take(n).collect()
}

impl<R: Runtime> Inner<R> {
    fn lock(&self) -> MutexGuard<'_, State<R::Buffer>> {
        // A panic while the lock was held cannot leave the free lists in a state worse than
        // refusing all further work would.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<R: Runtime> Device<R> {
    /// The backend on `runtime`.
    pub fn new(runtime: R, options: DeviceOptions) -> Result<Self, BackendError> {
        let name = runtime.name();
        if options.piece_elements == 0 || !options.piece_elements.is_multiple_of(TILE as usize) {
            return Err(BackendError::Unsupported {
                backend: name,
                what: format!(
                    "piece_elements = {} (a positive multiple of {TILE} is needed)",
                    options.piece_elements
                ),
            });
        }
        if options.io_floats < options.piece_elements {
            return Err(BackendError::Unsupported {
                backend: name,
                what: format!(
                    "io_floats = {} (at least one piece, {}, is needed)",
                    options.io_floats, options.piece_elements
                ),
            });
        }
        let table = map_table();
        let maps = runtime.alloc(table.len())?;
        runtime.write(&maps, 0, &table)?;
        Ok(Device {
            inner: Arc::new(Inner {
                rt: runtime,
                options,
                maps,
                lost: Mutex::new(None),
                state: Mutex::new(State {
                    pieces: Pool::default(),
                    wide: Pool::default(),
                    io: None,
                    flags: None,
                }),
                launches: AtomicU64::new(0),
                plan_launches: AtomicU64::new(0),
                reserved: AtomicU64::new(0),
            }),
        })
    }

    /// The runtime.
    pub fn runtime(&self) -> &R {
        &self.inner.rt
    }

    /// The layout options.
    pub fn options(&self) -> DeviceOptions {
        self.inner.options
    }

    /// Launches issued so far (a step issues one per group of items that share bindings,
    /// however many tensors the group holds).
    pub fn launches(&self) -> u64 {
        self.inner.launches.load(Ordering::Relaxed)
    }

    /// Launches of specialized steps issued so far ([`crate::plans`]; counted in
    /// [`Device::launches`] too).
    pub fn plan_launches(&self) -> u64 {
        self.inner.plan_launches.load(Ordering::Relaxed)
    }

    /// Words of device memory reserved for parameters now (arenas may hold more).
    pub fn reserved_words(&self) -> u64 {
        self.inner.reserved.load(Ordering::Relaxed)
    }

    /// Arenas allocated now (pieces and tensor-wide regions).
    pub fn arenas(&self) -> usize {
        let state = self.inner.lock();
        let live = |p: &Pool<R::Buffer>| p.arenas.iter().filter(|a| a.is_some()).count();
        live(&state.pieces) + live(&state.wide)
    }

    /// The error every call returns after the device was lost.
    fn check(&self) -> Result<(), BackendError> {
        match &*self.inner.lost.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Remembers a device loss, so every later call fails the same way.
    fn guard<T>(&self, r: Result<T, BackendError>) -> Result<T, BackendError> {
        if let Err(e @ BackendError::DeviceLost { .. }) = &r {
            let mut lost = self.inner.lost.lock().unwrap_or_else(|e| e.into_inner());
            lost.get_or_insert_with(|| e.clone());
        }
        r
    }

    fn reserve(&self, pool: &mut Pool<R::Buffer>, words: usize) -> Result<Span, BackendError> {
        let words = words.max(1);
        let rt = &self.inner.rt;
        let limit = rt.limits().arena_words;
        if let Some(limit) = limit {
            if words > limit {
                return Err(BackendError::Unsupported {
                    backend: rt.name(),
                    what: format!(
                        "a reservation of {words} words (a piece, or one parameter's tensor-wide statistics), more than an arena holds ({limit}): lower piece_elements or raise the segment size"
                    ),
                });
            }
            for (a, arena) in pool.arenas.iter_mut().enumerate() {
                let Some(arena) = arena else { continue };
                if let Some(k) = arena.free.iter().position(|&(_, len)| len >= words) {
                    let (start, len) = arena.free[k];
                    if len == words {
                        arena.free.remove(k);
                    } else {
                        arena.free[k] = (start + words, len - words);
                    }
                    self.inner
                        .reserved
                        .fetch_add(words as u64, Ordering::Relaxed);
                    return Ok(Span {
                        arena: a,
                        start,
                        words,
                    });
                }
            }
        }
        let size = limit.unwrap_or(words);
        let buffer = self.guard(rt.alloc(size))?;
        let arena = Arena {
            buffer,
            free: if size > words {
                vec![(words, size - words)]
            } else {
                Vec::new()
            },
        };
        let a = match pool.arenas.iter().position(|x| x.is_none()) {
            Some(a) => {
                pool.arenas[a] = Some(arena);
                a
            }
            None => {
                pool.arenas.push(Some(arena));
                pool.arenas.len() - 1
            }
        };
        self.inner
            .reserved
            .fetch_add(words as u64, Ordering::Relaxed);
        Ok(Span {
            arena: a,
            start: 0,
            words,
        })
    }

    fn release(&self, pool: &mut Pool<R::Buffer>, span: Span) {
        self.inner
            .reserved
            .fetch_sub(span.words as u64, Ordering::Relaxed);
        let exact = self.inner.rt.limits().arena_words.is_none();
        let Some(Some(arena)) = pool.arenas.get_mut(span.arena) else {
            return;
        };
        if exact {
            pool.arenas[span.arena] = None;
            return;
        }
        let at = arena.free.partition_point(|&(s, _)| s < span.start);
        arena.free.insert(at, (span.start, span.words));
        if at + 1 < arena.free.len() && arena.free[at].0 + arena.free[at].1 == arena.free[at + 1].0
        {
            arena.free[at].1 += arena.free[at + 1].1;
            arena.free.remove(at + 1);
        }
        if at > 0 && arena.free[at - 1].0 + arena.free[at - 1].1 == arena.free[at].0 {
            arena.free[at - 1].1 += arena.free[at].1;
            arena.free.remove(at);
        }
    }

    fn buffer(pool: &Pool<R::Buffer>, arena: usize) -> &R::Buffer {
        &pool.arenas[arena]
            .as_ref()
            .expect("a live reservation's arena exists")
            .buffer
    }

    /// The descriptor of `piece` of `param` (every slot addressed, no operation fields yet).
    fn desc(
        &self,
        state: &State<R::Buffer>,
        param: &DeviceParam<R>,
        piece: &Piece,
        layout: &ParamLayout,
        seed: u64,
        lent: Option<&R::View<'_>>,
    ) -> Desc {
        let rt = &self.inner.rt;
        let mut d = bytemuck::Zeroable::zeroed();
        let Desc {
            len,
            key,
            global,
            stream,
            seed: s,
            ndim,
            shape,
            slots,
            ..
        } = &mut d;
        *len = piece.len as u64;
        *key = layout.offset + piece.offset as u64;
        *global = piece.offset as u64;
        *stream = layout.stream;
        *s = seed;
        let dims = &layout.shape[layout.shape.len().saturating_sub(MAX_DIMS)..];
        *ndim = dims.len() as u32;
        for (o, &x) in shape.iter_mut().zip(dims) {
            *o = x as u32;
        }
        let arena = Self::buffer(&state.pieces, piece.span.arena);
        for (k, slot) in slots.iter_mut().enumerate() {
            let Some(format) = layout.formats[k] else {
                continue;
            };
            let mut region = [0u64; SLOT_REGIONS];
            let specs = elem_specs(Some(format), &layout.shape);
            for (r, &(at, _)) in piece.regions[k][..specs.len()].iter().enumerate() {
                region[r] = match lent {
                    Some(view) if k == 0 && r == 0 => rt.lent_address(
                        view,
                        specs[0].byte_range(piece.offset, piece.offset).start / 4,
                    ),
                    _ => rt.address(Binding::Arena, arena, at),
                };
            }
            if let Some(span) = param.wide {
                let wide = Self::buffer(&state.wide, span.arena);
                for (r, &(at, _)) in param.wide_regions[k].iter().enumerate() {
                    region[specs.len() + r] = rt.address(Binding::Wide, wide, span.start + at);
                }
            }
            *slot = SlotDesc {
                format: format.kernel_id(),
                aux: format.kernel_aux(),
                region,
            };
        }
        d
    }

    /// Runs `entry` over `items` in as few launches as their bindings and the staging buffer
    /// allow; returns the values of `host_out` items, in item order.
    fn run<'v>(
        &self,
        state: &mut State<R::Buffer>,
        entry: Entry,
        items: &mut [Item<'v, R>],
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let rt = &self.inner.rt;
        let limits = rt.limits();
        let io_floats = self.inner.options.io_floats;
        // Every launch binds a staging buffer and a flag buffer (real ones: a runtime that binds
        // may not bind one buffer both read-only and writable).
        if state.io.is_none() {
            state.io = Some(self.guard(rt.alloc(io_floats))?);
        }
        if state.flags.is_none() {
            state.flags = Some(self.guard(rt.alloc(1))?);
        }
        let mut outputs: Vec<Vec<f32>> = (0..items.len()).map(|_| Vec::new()).collect();
        // Groups of items that run the same kernel (a specialized step's, or the generic one)
        // and share their bindings (all of them, where launches use pointers).
        let key = |it: &Item<'_, R>| {
            if limits.bindless {
                (it.plan, 0, None, 0usize, 0usize)
            } else {
                let addr =
                    |v: Option<R::View<'_>>| v.map_or(0, |v| rt.lent_address(&v, 0) as usize + 1);
                (
                    it.plan,
                    it.arena,
                    it.wide,
                    addr(it.lent),
                    addr(it.view_io.map(|(v, _)| v)),
                )
            }
        };
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by_key(|&k| key(&items[k]));
        let mut k = 0;
        while k < order.len() {
            let first = order[k];
            let group = key(&items[first]);
            let mut batch = Vec::new();
            let (mut used, mut tiles) = (0usize, 0u64);
            while k < order.len() && key(&items[order[k]]) == group {
                let it = &items[order[k]];
                let need = if it.host_in.is_some() || it.host_out {
                    it.desc.len as usize
                } else {
                    0
                };
                if !batch.is_empty() && used + need > io_floats {
                    break;
                }
                let it = &mut items[order[k]];
                it.desc.tile_begin = tiles;
                tiles += it.desc.len.div_ceil(u64::from(TILE));
                if need > 0 {
                    let io = state.io.as_ref().expect("allocated above");
                    it.desc.io = rt.io_address(&Io::Staging(io), used);
                    if let Some((values, at)) = it.host_in {
                        let mut words = vec![0f32; need];
                        values.read_f32(at, &mut words);
                        self.guard(rt.write(io, used, bytemuck::cast_slice(&words)))?;
                    }
                } else if let Some((view, at)) = it.view_io {
                    it.desc.io = rt.io_address(&Io::View(view), at);
                }
                batch.push((order[k], used));
                // Each item's values start at a multiple of 16 bytes (the specialized steps'
                // vector loads).
                used = (used + need).next_multiple_of(4);
                k += 1;
            }
            let descs: Vec<Desc> = batch.iter().map(|&(i, _)| items[i].desc).collect();
            let (head_lent, head_view_io, head_host, head_arena, head_wide, plan) = {
                let h = &items[first];
                (
                    h.lent,
                    h.view_io,
                    h.host_in.is_some() || h.host_out,
                    h.arena,
                    h.wide,
                    h.plan,
                )
            };
            let tiles = u32::try_from(tiles).map_err(|_| BackendError::Unsupported {
                backend: rt.name(),
                what: format!("{tiles} tiles in one launch"),
            })?;
            let io: Io<'_, 'v, R> = match head_view_io {
                Some((view, _)) if !head_host => Io::View(view),
                _ => Io::Staging(state.io.as_ref().expect("allocated above")),
            };
            let flags = state.flags.as_ref().expect("allocated above");
            let launch = Launch {
                tiles,
                descs: &descs,
                arena: (!limits.bindless).then(|| Self::buffer(&state.pieces, head_arena)),
                wide: head_wide
                    .filter(|_| !limits.bindless)
                    .map(|w| Self::buffer(&state.wide, w)),
                lent: head_lent,
                io,
                maps: &self.inner.maps,
                flags,
                plan,
            };
            self.guard(rt.launch(entry, &launch))?;
            self.inner.launches.fetch_add(1, Ordering::Relaxed);
            if plan.is_some() {
                self.inner.plan_launches.fetch_add(1, Ordering::Relaxed);
            }
            for &(i, at) in &batch {
                if items[i].host_out {
                    let io = state.io.as_ref().expect("allocated above");
                    let words = self.guard(rt.read(io, at, items[i].desc.len as usize))?;
                    outputs[i] = words.into_iter().map(f32::from_bits).collect();
                }
            }
        }
        Ok(outputs)
    }

    /// Items covering every piece of `param`.
    #[allow(clippy::too_many_arguments)]
    fn items<'a>(
        &self,
        state: &State<R::Buffer>,
        param: &DeviceParam<R>,
        layout: &ParamLayout,
        seed: u64,
        input: Option<DeviceInput<'a, R>>,
        lent: Option<R::View<'a>>,
        host_out: bool,
        out: &mut Vec<Item<'a, R>>,
    ) {
        for piece in &param.pieces {
            let mut desc = self.desc(state, param, piece, layout, seed, lent.as_ref());
            let (mut host_in, mut view_io) = (None, None);
            match input {
                Some(DeviceInput::Host(v)) => {
                    host_in = Some((v, piece.offset));
                    desc.flags |= F_INPUT;
                }
                Some(DeviceInput::Device(v)) => {
                    view_io = Some((v, piece.offset));
                    desc.flags |= F_INPUT;
                    if self.inner.rt.view_info(&v).0 == Dtype::Bf16 {
                        desc.flags |= F_INPUT_BF16;
                    }
                }
                None => {}
            }
            out.push(Item {
                desc,
                host_in,
                host_out,
                view_io,
                lent,
                arena: piece.span.arena,
                wide: param.wide.map(|w| w.arena),
                plan: None,
            });
        }
    }

    fn check_view(
        &self,
        view: &R::View<'_>,
        dtypes: &[Dtype],
        n: usize,
    ) -> Result<(), BackendError> {
        let (dtype, len) = self.inner.rt.view_info(view);
        if !dtypes.contains(&dtype) || len != n {
            return Err(BackendError::Buffer {
                what: format!(
                    "a {} buffer of {len} values where {n} values of {} are needed",
                    dtype.name(),
                    dtypes
                        .iter()
                        .map(|d| d.name())
                        .collect::<Vec<_>>()
                        .join(" or ")
                ),
            });
        }
        Ok(())
    }

    fn check_input(&self, input: &DeviceInput<'_, R>, n: usize) -> Result<(), BackendError> {
        match input {
            DeviceInput::Host(v) if v.info().1 != n => Err(BackendError::Buffer {
                what: format!("{} host values where {n} are needed", v.info().1),
            }),
            DeviceInput::Host(_) => Ok(()),
            DeviceInput::Device(v) => self.check_view(v, &[Dtype::F32, Dtype::Bf16], n),
        }
    }

    /// The lent buffer of a lent parameter slot, checked.
    fn lent_view<'a>(
        &self,
        layout: &ParamLayout,
        view: Option<R::View<'a>>,
    ) -> Result<Option<R::View<'a>>, BackendError> {
        if !layout.lent {
            return Ok(None);
        }
        let want = layout
            .format(SlotKind::Param)
            .and_then(|f| f.lendable())
            .ok_or_else(|| self.unsupported("lending a parameter of this storage"))?;
        let view = view.ok_or_else(|| BackendError::Buffer {
            what: "a lent parameter needs its buffer".into(),
        })?;
        self.check_view(&view, &[want], layout.numel)?;
        Ok(Some(view))
    }

    fn unsupported(&self, what: &str) -> BackendError {
        BackendError::Unsupported {
            backend: self.inner.rt.name(),
            what: what.into(),
        }
    }

    fn wide_words(
        &self,
        state: &State<R::Buffer>,
        param: &DeviceParam<R>,
        slot: usize,
    ) -> Result<Vec<Box<[AtomicU32]>>, BackendError> {
        let Some(span) = param.wide else {
            return Ok(Vec::new());
        };
        let buffer = Self::buffer(&state.wide, span.arena);
        param.wide_regions[slot]
            .iter()
            .map(|&(at, n)| {
                let words = self.guard(self.inner.rt.read(buffer, span.start + at, n))?;
                Ok(words.into_iter().map(AtomicU32::new).collect())
            })
            .collect()
    }

    fn write_wide(
        &self,
        state: &State<R::Buffer>,
        param: &DeviceParam<R>,
        slot: usize,
        which: &mut dyn FnMut(usize) -> Option<Vec<u32>>,
    ) -> Result<(), BackendError> {
        let Some(span) = param.wide else {
            return Ok(());
        };
        let buffer = Self::buffer(&state.wide, span.arena);
        for (r, &(at, _)) in param.wide_regions[slot].iter().enumerate() {
            if let Some(words) = which(r) {
                self.guard(self.inner.rt.write(buffer, span.start + at, &words))?;
            }
        }
        Ok(())
    }

    /// The step's items of the stepping parameters `which` selects, with their plans. With
    /// `specialize` (the fused pass), an item whose parameter's plan has a specialized step
    /// ([`crate::plans`]) is marked to run it, where its addresses suit the runtime
    /// ([`Specialized::Aligned`]; the generic step runs it otherwise).
    fn step_items<'v>(
        &self,
        state: &State<R::Buffer>,
        ctx: &StepCtx<'_, 'v, R>,
        which: &dyn Fn(usize) -> bool,
        specialize: bool,
        items: &mut Vec<Item<'v, R>>,
    ) {
        let rt = &self.inner.rt;
        let mode = if specialize && self.inner.options.specialized {
            rt.specialized()
        } else {
            Specialized::None
        };
        for &(i, ref plan) in ctx.stepping {
            let layout = &ctx.layouts[i];
            if !which(i) {
                continue;
            }
            let input = ctx.released.filter(|(r, _)| *r == i).map(|(_, g)| g);
            let flags = layout.step_flags(plan.flags).0;
            // The specialized steps move the parameter by the rule, from gradients.
            let moves =
                flags & F_UPDATE_PARAM != 0 && flags & (F_TRANSFORM | F_GIVEN_V | F_GIVEN_W) == 0;
            let grad = match input {
                None => GradInput::None,
                Some(DeviceInput::Host(_)) => GradInput::F32,
                Some(DeviceInput::Device(v)) => match rt.view_info(&v).0 {
                    Dtype::Bf16 => GradInput::Bf16,
                    _ => GradInput::F32,
                },
            };
            let kernel = match mode {
                Specialized::None => None,
                _ if !moves => None,
                _ => plans::find(layout, &plan.rule, grad),
            };
            let before = items.len();
            self.items(
                state,
                &ctx.params[i],
                layout,
                ctx.seed,
                input,
                ctx.views[i],
                false,
                items,
            );
            for it in &mut items[before..] {
                it.plan = kernel.filter(|_| match mode {
                    // Every region and the io start where the kernel's vector accesses can.
                    Specialized::Aligned { bytes } => {
                        let regions = it.desc.slots.iter().flat_map(|s| s.region);
                        let io = it.view_io.map(|(v, at)| rt.io_address(&Io::View(v), at));
                        regions.chain(io).all(|a| a % bytes == 0)
                    }
                    _ => true,
                });
            }
            let words = plan.rule.words();
            let n = words.len().min(CONST_WORDS);
            for it in &mut items[before..] {
                let d = &mut it.desc;
                d.step = plan.t;
                d.flags |= flags;
                d.flag_index = i as u32;
                d.rule = plan.rule.kernel_id();
                d.clip = plan.clip;
                d.consts[..n].copy_from_slice(&words[..n]);
            }
        }
    }

    fn ensure_flags(&self, state: &mut State<R::Buffer>, n: usize) -> Result<(), BackendError> {
        let rt = &self.inner.rt;
        let n = n.max(1);
        if state.flags.as_ref().is_none_or(|f| rt.len(f) < n) {
            state.flags = Some(self.guard(rt.alloc(n.next_power_of_two()))?);
        }
        let zeros = vec![0u32; n];
        self.guard(rt.write(state.flags.as_ref().expect("allocated"), 0, &zeros))
    }
}

impl<R: Runtime> Backend for Device<R> {
    type Param = DeviceParam<R>;
    type Input<'a> = DeviceInput<'a, R>;
    type Output<'a> = DeviceOutput<'a, R>;

    fn name(&self) -> &'static str {
        self.inner.rt.name()
    }

    fn host_input<'a>(&self, values: HostValues<'a>) -> DeviceInput<'a, R> {
        DeviceInput::Host(values)
    }

    fn host_output<'a>(&self, out: HostValuesMut<'a>) -> DeviceOutput<'a, R> {
        DeviceOutput::Host(out)
    }

    fn input_info(&self, input: &DeviceInput<'_, R>) -> (Dtype, usize) {
        match input {
            DeviceInput::Host(v) => v.info(),
            DeviceInput::Device(v) => self.inner.rt.view_info(v),
        }
    }

    fn output_info(&self, output: &DeviceOutput<'_, R>) -> (Dtype, usize) {
        match output {
            DeviceOutput::Host(v) => v.info(),
            DeviceOutput::Device(v) => self.inner.rt.view_info(v),
        }
    }

    fn allocate(
        &self,
        layout: &ParamLayout,
        init: Init<'_, Self>,
        seed: u64,
    ) -> Result<DeviceParam<R>, BackendError> {
        self.check()?;
        let (shape, n) = (&layout.shape[..], layout.numel);
        let elems = layout.formats.map(|f| elem_specs(f, shape));
        let wides = layout.formats.map(|f| wide_specs(f, shape));
        let mut param = DeviceParam {
            device: self.clone(),
            pieces: Vec::new(),
            wide: None,
            wide_regions: Default::default(),
        };
        let mut state = self.inner.lock();
        let wide_total: usize = wides.iter().flatten().map(|r| r.words(n)).sum();
        if wide_total > 0 {
            let span = self.reserve(&mut state.wide, wide_total)?;
            param.wide = Some(span);
            let mut at = 0;
            for (s, specs) in wides.iter().enumerate() {
                for r in specs {
                    param.wide_regions[s].push((at, r.words(n)));
                    at += r.words(n);
                }
            }
            let buffer = Self::buffer(&state.wide, span.arena);
            self.guard(
                self.inner
                    .rt
                    .write(buffer, span.start, &vec![0; wide_total]),
            )?;
        }
        let piece = self.inner.options.piece_elements;
        // Element regions start where the runtime's specialized steps can address them.
        let align = match self.inner.rt.specialized() {
            Specialized::Aligned { bytes } => (bytes as usize / 4).max(1),
            _ => 1,
        };
        for offset in (0..n).step_by(piece) {
            let len = piece.min(n - offset);
            let lent_region = |s: usize, k: usize| s == 0 && k == 0 && layout.lent;
            let mut regions = [[(0usize, 0usize); 3]; SLOTS];
            let mut pads = [[0usize; 3]; SLOTS];
            let mut words = 0usize;
            for (s, specs) in elems.iter().enumerate() {
                for (k, r) in specs.iter().enumerate() {
                    let w = if lent_region(s, k) { 0 } else { r.words(len) };
                    if w > 0 {
                        pads[s][k] = words.next_multiple_of(align) - words;
                        words += pads[s][k];
                    }
                    regions[s][k] = (words, w);
                    words += w;
                }
            }
            let span = self.reserve(&mut state.pieces, words)?;
            // Fresh memory as the CPU initialises it: a reused range must not keep an earlier
            // parameter's words.
            let mut fresh = vec![0u32; words];
            for (s, specs) in elems.iter().enumerate() {
                for (k, region) in regions[s].iter_mut().take(specs.len()).enumerate() {
                    let (at, w) = *region;
                    if let Some(format) = layout.formats[s] {
                        format.fresh(k, &mut fresh[at..at + w], len);
                    }
                    region.0 += span.start;
                }
            }
            let buffer = Self::buffer(&state.pieces, span.arena);
            self.guard(self.inner.rt.write(buffer, span.start, &fresh))?;
            param.pieces.push(Piece {
                offset,
                len,
                span,
                regions,
                pads,
            });
        }
        if let Init::Values(values) = init {
            self.check_input(&values, n)?;
            let mut items = Vec::new();
            self.items(
                &state,
                &param,
                layout,
                seed,
                Some(values),
                None,
                false,
                &mut items,
            );
            self.run(&mut state, Entry::Init, &mut items)?;
        }
        Ok(param)
    }

    fn accumulate(
        &self,
        param: &mut DeviceParam<R>,
        layout: &ParamLayout,
        counter: u64,
        grad: DeviceInput<'_, R>,
        seed: u64,
    ) -> Result<(), BackendError> {
        self.check()?;
        self.check_input(&grad, layout.numel)?;
        let mut state = self.inner.lock();
        let mut items = Vec::new();
        self.items(
            &state,
            param,
            layout,
            seed,
            Some(grad),
            None,
            false,
            &mut items,
        );
        for it in &mut items {
            it.desc.acc = counter;
        }
        self.run(&mut state, Entry::Accumulate, &mut items)?;
        Ok(())
    }

    fn fits(&self, values: DeviceInput<'_, R>, limit: f32) -> Result<bool, BackendError> {
        self.check()?;
        let view = match values {
            DeviceInput::Host(v) => return lpmm_optim::Cpu.fits(v, limit),
            DeviceInput::Device(v) => v,
        };
        let limit = limit.abs().min(f32::MAX).to_bits();
        let (dtype, n) = self.inner.rt.view_info(&view);
        self.check_view(&view, &[Dtype::F32, Dtype::Bf16], n)?;
        let mut state = self.inner.lock();
        self.ensure_flags(&mut state, 1)?;
        let mut items = Vec::new();
        for start in (0..n).step_by(self.inner.options.piece_elements) {
            let mut desc: Desc = bytemuck::Zeroable::zeroed();
            desc.len = self.inner.options.piece_elements.min(n - start) as u64;
            desc.mode = limit;
            desc.flags = F_INPUT
                | if dtype == Dtype::Bf16 {
                    F_INPUT_BF16
                } else {
                    0
                };
            items.push(Item {
                desc,
                host_in: None,
                host_out: false,
                view_io: Some((view, start)),
                lent: None,
                arena: 0,
                wide: None,
                plan: None,
            });
        }
        if state.pieces.arenas.is_empty() {
            // A launch on a runtime that binds needs an arena; make one.
            let span = self.reserve(&mut state.pieces, 1)?;
            self.release(&mut state.pieces, span);
        }
        self.run(&mut state, Entry::Check, &mut items)?;
        let flags = state.flags.as_ref().expect("allocated");
        let word = self.guard(self.inner.rt.read(flags, 0, 1))?;
        Ok(word[0] == 0)
    }

    fn accumulate_fits(
        &self,
        param: &DeviceParam<R>,
        layout: &ParamLayout,
        grad: DeviceInput<'_, R>,
    ) -> Result<bool, BackendError> {
        self.check()?;
        self.check_input(&grad, layout.numel)?;
        let Some(format) = layout.format(SlotKind::Grad) else {
            return Err(self.unsupported("accumulating into a parameter without an accumulator"));
        };
        let mut state = self.inner.lock();
        self.ensure_flags(&mut state, 1)?;
        let mut items = Vec::new();
        self.items(
            &state,
            param,
            layout,
            0,
            Some(grad),
            None,
            false,
            &mut items,
        );
        for it in &mut items {
            // Entries' `lpmm_check`: the accumulator plus the input against the format's limit.
            it.desc.mode = format.limit_bits();
            it.desc.flag_index = 0;
        }
        self.run(&mut state, Entry::Check, &mut items)?;
        let flags = state.flags.as_ref().expect("allocated");
        let word = self.guard(self.inner.rt.read(flags, 0, 1))?;
        Ok(word[0] == 0)
    }

    fn input_stats(&self, values: DeviceInput<'_, R>) -> Result<(ExactSum, bool), BackendError> {
        self.check()?;
        match values {
            DeviceInput::Host(v) => lpmm_optim::Cpu.input_stats(v),
            DeviceInput::Device(view) => {
                // Summed on the host in the CPU's order, as the accumulators' statistics are (the
                // price of a bit-identical norm: the gradient comes back).
                let (dtype, n) = self.inner.rt.view_info(&view);
                self.check_view(&view, &[Dtype::F32, Dtype::Bf16], n)?;
                let bytes = self.guard(self.inner.rt.read_view(&view))?;
                let values: Vec<f32> = match dtype {
                    Dtype::Bf16 => bytes
                        .chunks_exact(2)
                        .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                        .collect(),
                    _ => bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                };
                let mut sum = ExactSum::new();
                let finite = add_squares(&values, &mut sum);
                Ok((sum, finite))
            }
        }
    }

    fn gradient_stats(
        &self,
        params: &mut [DeviceParam<R>],
        layouts: &[ParamLayout],
        select: &[bool],
        out: &mut [(ExactSum, bool)],
    ) -> Result<(), BackendError> {
        self.check()?;
        let mut state = self.inner.lock();
        let mut items = Vec::new();
        let mut owner = Vec::new();
        for (index, ((p, l), &s)) in params.iter().zip(layouts).zip(select).enumerate() {
            if s && l.format(SlotKind::Grad).is_some() {
                let before = items.len();
                self.items(&state, p, l, 0, None, None, true, &mut items);
                owner.extend(std::iter::repeat_n(index, items.len() - before));
            }
        }
        for it in &mut items {
            it.desc.mode = SlotKind::Grad as u32;
        }
        // Decoded on the device, summed on the host in the CPU's order (the price of a
        // bit-identical norm: 4 bytes per element come back).
        let outputs = self.run(&mut state, Entry::Decode, &mut items)?;
        out.iter_mut().for_each(|o| *o = (ExactSum::new(), true));
        for (values, &index) in outputs.iter().zip(&owner) {
            let o = &mut out[index];
            o.1 &= add_squares(values, &mut o.0);
        }
        Ok(())
    }

    fn step(&self, work: StepWork<'_, '_, '_, Self>) -> Result<(), BackendError> {
        self.check()?;
        let StepWork {
            params,
            layouts,
            plans,
            released,
            lent,
            seed,
            non_finite,
        } = work;
        // One lifetime for the caller's lent and released buffers (both outlive this call).
        let released = released.map(|(i, g)| {
            let g = match g {
                DeviceInput::Host(v) => DeviceInput::Host(v),
                DeviceInput::Device(v) => DeviceInput::Device(R::shorten(v)),
            };
            (i, g)
        });
        let mut views: Vec<Option<R::View<'_>>> = vec![None; params.len()];
        for (id, out) in lent.iter() {
            let DeviceOutput::Device(view) = out else {
                return Err(BackendError::Buffer {
                    what: "a lent parameter on a device is a device buffer".into(),
                });
            };
            let i = id.index();
            if !layouts[i].lent {
                return Err(BackendError::Buffer {
                    what: format!("parameter #{i} is not lent, but a buffer was lent for it"),
                });
            }
            views[i] = self.lent_view(&layouts[i], Some(R::shorten(*view)))?;
        }
        for (i, (l, p)) in layouts.iter().zip(plans).enumerate() {
            if p.is_some() && l.lent && views[i].is_none() {
                return Err(BackendError::Buffer {
                    what: format!("parameter #{i} is lent: its buffer must be lent to the step"),
                });
            }
        }
        if let Some((i, g)) = released {
            self.check_input(&g, layouts[i].numel)?;
        }
        non_finite.iter_mut().for_each(|f| *f = false);
        if plans.iter().all(Option::is_none) {
            return Ok(());
        }
        let mut state = self.inner.lock();
        // One flag per parameter, then each parameter's block of the rule's fold words.
        let n = params.len();
        self.ensure_flags(&mut state, n * (1 + STAT_WORDS as usize))?;
        // The plans' constants change as the rule's sums are combined.
        let stepping: Vec<(usize, ParamStep)> = plans
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.map(|p| (i, p)))
            .collect();
        let mut runner = Runner {
            device: self,
            state: &mut state,
            params,
            layouts,
            stepping,
            released,
            views: &views,
            seed,
            kept: vec![false; n],
            non_finite,
        };
        run_step(&mut runner)
    }

    fn clear_gradients(
        &self,
        params: &mut [DeviceParam<R>],
        layouts: &[ParamLayout],
        only: Option<usize>,
    ) -> Result<(), BackendError> {
        self.check()?;
        let mut state = self.inner.lock();
        let mut items = Vec::new();
        for (i, (p, l)) in params.iter().zip(layouts).enumerate() {
            if only.is_none_or(|o| o == i) && l.format(SlotKind::Grad).is_some() {
                self.items(&state, p, l, 0, None, None, false, &mut items);
            }
        }
        self.run(&mut state, Entry::Clear, &mut items)?;
        Ok(())
    }

    fn read(
        &self,
        param: &DeviceParam<R>,
        layout: &ParamLayout,
        slot: SlotKind,
        out: DeviceOutput<'_, R>,
    ) -> Result<(), BackendError> {
        self.check()?;
        if slot == SlotKind::Param && layout.lent {
            return Err(self.unsupported("reading a lent parameter (it is the caller's buffer)"));
        }
        let mut state = self.inner.lock();
        let mut items = Vec::new();
        self.items(&state, param, layout, 0, None, None, false, &mut items);
        match out {
            DeviceOutput::Host(mut host) => {
                for it in &mut items {
                    it.host_out = true;
                    it.desc.mode = slot as u32;
                }
                let outputs = self.run(&mut state, Entry::Decode, &mut items)?;
                for (piece, values) in param.pieces.iter().zip(outputs) {
                    let at = piece.offset;
                    match &mut host {
                        HostValuesMut::F32(o) => o[at..at + piece.len].copy_from_slice(&values),
                        HostValuesMut::Bf16(o) => {
                            lpmm_formats_bf16(&values, &mut o[at..at + piece.len])
                        }
                    }
                }
            }
            DeviceOutput::Device(view) => {
                self.check_view(&view, &[Dtype::F32, Dtype::Bf16], layout.numel)?;
                let bf16 = self.inner.rt.view_info(&view).0 == Dtype::Bf16;
                for (it, piece) in items.iter_mut().zip(&param.pieces) {
                    it.desc.mode = slot as u32;
                    it.view_io = Some((view, piece.offset));
                    if bf16 {
                        it.desc.flags |= F_OUTPUT_BF16;
                    }
                }
                self.run(&mut state, Entry::Decode, &mut items)?;
            }
        }
        Ok(())
    }

    fn export(
        &self,
        param: &DeviceParam<R>,
        layout: &ParamLayout,
        slot: SlotKind,
        lent: Option<DeviceInput<'_, R>>,
    ) -> Result<HostSlot, BackendError> {
        self.check()?;
        let Some(format) = layout.format(slot) else {
            return Ok(HostSlot::empty());
        };
        let lent_here = slot == SlotKind::Param && layout.lent;
        let state = self.inner.lock();
        let s = slot as usize;
        let wide = self.wide_words(&state, param, s)?;
        let mut regions = Vec::new();
        for Walked { spec, place, .. } in format.walk(&layout.shape, None) {
            let bytes = match place {
                Place::Element(0) if lent_here => match lent {
                    Some(DeviceInput::Host(v)) => v.bytes().to_vec(),
                    Some(DeviceInput::Device(v)) => {
                        let v = self.lent_view(layout, Some(v))?.expect("lent");
                        self.guard(self.inner.rt.read_view(&v))?
                    }
                    None => {
                        return Err(
                            self.unsupported("exporting a lent parameter without its buffer")
                        );
                    }
                },
                Place::Element(k) => {
                    let mut bytes = Vec::with_capacity(spec.bytes(layout.numel));
                    for piece in &param.pieces {
                        let (at, words) = piece.regions[s][k];
                        let buffer = Self::buffer(&state.pieces, piece.span.arena);
                        let got = self.guard(self.inner.rt.read(buffer, at, words))?;
                        bytes.extend(to_bytes(&got, spec.bytes(piece.len)));
                    }
                    bytes
                }
                Place::Wide(k) => {
                    let words: Vec<u32> =
                        wide[k].iter().map(|x| x.load(Ordering::Relaxed)).collect();
                    to_bytes(&words, spec.bytes(layout.numel))
                }
            };
            if spec.saved {
                regions.push(HostRegion { spec, bytes });
            }
        }
        Ok(HostSlot { regions })
    }

    fn import(
        &self,
        param: &mut DeviceParam<R>,
        layout: &ParamLayout,
        slot: SlotKind,
        host: &HostSlot,
        lent: Option<DeviceOutput<'_, R>>,
    ) -> Result<(), BackendError> {
        self.check()?;
        let Some(format) = layout.format(slot) else {
            return Ok(());
        };
        let lent_here = slot == SlotKind::Param && layout.lent;
        let mut lent = lent;
        let state = self.inner.lock();
        let s = slot as usize;
        let mut wide_bytes: Vec<Option<Vec<u8>>> = Vec::new();
        for Walked { spec, place, bytes } in format.walk(&layout.shape, Some(host)) {
            match place {
                Place::Element(k) => {
                    let Some(bytes) = bytes else { continue };
                    if lent_here && k == 0 {
                        match lent.take() {
                            Some(DeviceOutput::Host(mut v)) => v.bytes_mut().copy_from_slice(bytes),
                            Some(DeviceOutput::Device(v)) => {
                                let v = self.lent_view(layout, Some(v))?.expect("lent");
                                self.guard(self.inner.rt.write_view(&v, bytes))?;
                            }
                            None => {
                                return Err(self
                                    .unsupported("importing a lent parameter without its buffer"));
                            }
                        }
                        continue;
                    }
                    for piece in &param.pieces {
                        let (at, _) = piece.regions[s][k];
                        let range = spec.byte_range(piece.offset, piece.offset + piece.len);
                        let buffer = Self::buffer(&state.pieces, piece.span.arena);
                        self.guard(self.inner.rt.write(buffer, at, &to_words(&bytes[range])))?;
                    }
                }
                Place::Wide(_) => wide_bytes.push(bytes.map(<[u8]>::to_vec)),
            }
        }
        if !wide_bytes.is_empty() {
            let wide: Vec<Box<[AtomicU32]>> = param.wide_regions[s]
                .iter()
                .zip(&wide_bytes)
                .map(|(&(_, n), b)| {
                    let mut words = b.as_deref().map(to_words).unwrap_or_default();
                    words.resize(n, 0);
                    words.into_iter().map(AtomicU32::new).collect()
                })
                .collect();
            format.loaded(&wide, &layout.shape);
            self.write_wide(&state, param, s, &mut |r| {
                Some(wide[r].iter().map(|x| x.load(Ordering::Relaxed)).collect())
            })?;
        }
        Ok(())
    }

    fn bytes(&self, param: &DeviceParam<R>, _layout: &ParamLayout) -> [usize; SLOTS] {
        let mut bytes = [0usize; SLOTS];
        for (s, b) in bytes.iter_mut().enumerate() {
            *b = param
                .pieces
                .iter()
                .map(|p| {
                    let pads = p.pads[s].iter().sum::<usize>();
                    4 * (pads + p.regions[s].iter().map(|r| r.1).sum::<usize>())
                })
                .sum::<usize>()
                + param.wide_regions[s].iter().map(|r| 4 * r.1).sum::<usize>();
        }
        bytes
    }
}

/// One step's plans on a device: each phase of the shared schedule ([`run_step`]) batched over
/// every stepping parameter into as few launches as the bindings allow.
struct Runner<'d, 's, 'a, 'v, R: Runtime> {
    device: &'d Device<R>,
    state: &'s mut State<R::Buffer>,
    params: &'a mut [DeviceParam<R>],
    layouts: &'a [ParamLayout],
    /// The stepping parameters and their plans (the constants change as the rule's sums are
    /// combined).
    stepping: Vec<(usize, ParamStep)>,
    released: Option<(usize, DeviceInput<'v, R>)>,
    views: &'a [Option<R::View<'v>>],
    seed: u64,
    /// Parameters whose tensor-wide statistics kept an old value (reported as non-finite).
    kept: Vec<bool>,
    non_finite: &'a mut [bool],
}

impl<R: Runtime> PlanRunner for Runner<'_, '_, '_, '_, R> {
    type Error = BackendError;

    fn passes(&self, phase: Phase) -> usize {
        self.stepping
            .iter()
            .map(|(_, p)| p.plan.passes(phase, p.flags))
            .max()
            .unwrap_or(0)
    }

    fn begin(&mut self, phase: Phase) -> Result<(), BackendError> {
        // The rule's fold words follow each parameter's flag word: `ensure_flags` zeroed them.
        let Phase::Slot(slot) = phase else {
            return Ok(());
        };
        for (i, p) in &self.stepping {
            if p.plan.passes(phase, p.flags) == 0 {
                continue;
            }
            let f = self.layouts[*i].format(slot).expect("folds");
            let targets = f.fold_targets();
            let regions = self.params[*i].wide_regions[slot as usize].clone();
            self.device
                .write_wide(self.state, &self.params[*i], slot as usize, &mut |r| {
                    targets.contains(&r).then(|| vec![0u32; regions[r].1])
                })?;
        }
        Ok(())
    }

    fn fold(&mut self, phase: Phase, pass: usize) -> Result<(), BackendError> {
        let n = self.params.len();
        let mut items = Vec::new();
        let ctx = StepCtx {
            params: self.params,
            layouts: self.layouts,
            stepping: &self.stepping,
            released: self.released,
            views: self.views,
            seed: self.seed,
        };
        let passes = self.passes_of_all(phase);
        self.device
            .step_items(self.state, &ctx, &|i| pass < passes[i], false, &mut items);
        // Each parameter's step, by parameter index.
        let mut steps: Vec<Option<&ParamStep>> = vec![None; n];
        for (i, p) in &self.stepping {
            steps[*i] = Some(p);
        }
        for it in &mut items {
            // `pass | target << 8 | input << 16` (entries' `lpmm_fold`).
            let i = it.desc.flag_index as usize;
            let Some(step) = steps[i] else { continue };
            it.desc.mode = match phase {
                Phase::Stats => {
                    // The sums' count, as fractional bits, and how many.
                    let frac = lpmm_optim::backend::fixed_frac_bits(self.layouts[i].numel) as u32;
                    let stats = step.rule.stats() as u32;
                    // The fold writes no flag: its words are the parameter's block.
                    it.desc.flag_index = (n + i * STAT_WORDS as usize) as u32;
                    pass as u32 | FOLD_STATS << 8 | frac << 16 | stats << 24
                }
                Phase::Slot(slot) => {
                    let input = match step.plan.fold_input(phase, pass) {
                        Some(FoldInput::MomentGradient) => FOLD_MOMENT,
                        _ => FOLD_UPDATED,
                    };
                    pass as u32 | (slot as u32) << 8 | input << 16
                }
            };
        }
        self.device.run(self.state, Entry::Fold, &mut items)?;
        Ok(())
    }

    fn combine(&mut self, phase: Phase) -> Result<(), BackendError> {
        let n = self.params.len();
        match phase {
            Phase::Stats => {
                let flags = self.state.flags.as_ref().expect("allocated");
                let stat_words = STAT_WORDS as usize;
                let rt = &self.device.inner.rt;
                let words = self.device.guard(rt.read(flags, n, n * stat_words))?;
                for (i, plan) in self.stepping.iter_mut() {
                    if plan.plan.passes(phase, plan.flags) == 0 {
                        continue;
                    }
                    let base = *i * stat_words;
                    let scratch: Vec<AtomicU32> = words[base..base + stat_words]
                        .iter()
                        .map(|&w| AtomicU32::new(w))
                        .collect();
                    let (exp, sum) = scratch.split_at(STAT_SUM as usize);
                    let numel = self.layouts[*i].numel;
                    let sums: Vec<f64> = (0..plan.rule.stats())
                        .map(|k| lpmm_optim::backend::fixed_total(exp, sum, k, numel))
                        .collect();
                    plan.rule.combine_stats(&sums, numel);
                }
            }
            Phase::Slot(slot) => {
                for (i, plan) in &self.stepping {
                    let i = *i;
                    if plan.plan.passes(phase, plan.flags) == 0 {
                        continue;
                    }
                    let f = self.layouts[i].format(slot).expect("folds");
                    let wide =
                        self.device
                            .wide_words(self.state, &self.params[i], slot as usize)?;
                    self.kept[i] |= f.combine(&wide, &self.layouts[i].shape, &plan.rule, slot);
                    self.device.write_wide(
                        self.state,
                        &self.params[i],
                        slot as usize,
                        &mut |r| Some(wide[r].iter().map(|w| w.load(Ordering::Relaxed)).collect()),
                    )?;
                }
            }
        }
        Ok(())
    }

    fn fused(&mut self) -> Result<(), BackendError> {
        let n = self.params.len();
        let mut items = Vec::new();
        let ctx = StepCtx {
            params: self.params,
            layouts: self.layouts,
            stepping: &self.stepping,
            released: self.released,
            views: self.views,
            seed: self.seed,
        };
        self.device
            .step_items(self.state, &ctx, &|_| true, true, &mut items);
        self.device.run(self.state, Entry::Step, &mut items)?;
        let flags = self.state.flags.as_ref().expect("allocated");
        let rt = &self.device.inner.rt;
        let words = self.device.guard(rt.read(flags, 0, n.max(1)))?;
        for ((f, w), k) in self.non_finite.iter_mut().zip(words).zip(&self.kept) {
            *f = w != 0 || *k;
        }
        Ok(())
    }

    fn swap(&mut self) -> Result<(), BackendError> {
        for (i, p) in &self.stepping {
            for (slot, a, b) in p.plan.swaps(p.flags) {
                self.params[*i].wide_regions[slot as usize].swap(a, b);
            }
        }
        Ok(())
    }
}

impl<R: Runtime> Runner<'_, '_, '_, '_, R> {
    /// Each parameter's fold passes in `phase` (0: none), by parameter index.
    fn passes_of_all(&self, phase: Phase) -> Vec<usize> {
        let mut passes = vec![0usize; self.params.len()];
        for (i, p) in &self.stepping {
            passes[*i] = p.plan.passes(phase, p.flags);
        }
        passes
    }
}

/// f32 to bf16, round to nearest even (the CPU's read of a bf16 output).
fn lpmm_formats_bf16(values: &[f32], out: &mut [lpmm_formats::bf16]) {
    lpmm_formats::simd::f32_to_bf16_nearest(values, out);
}
