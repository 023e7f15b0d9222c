//! The host side of every optimizer operation over device memory: [`Device`] runs lpmm-optim's
//! [`Backend`] seam on any [`Runtime`] — memory layout (pieces in arenas, tensor-wide regions),
//! descriptors, batching into as few launches as the bindings and the staging buffer allow,
//! gradient statistics, the step primitives (a tensor-wide phase's folds and their read-back,
//! the fused pass, the swaps), export and import, lent parameters and device-resident inputs and
//! outputs. lpmm-optim's executor orders the primitives and combines the folds on the host.
//!
//! This file holds [`Device`], its options and the [`Backend`] implementation; the parts it is
//! built from are the crate's modules beside it: `arena` (memory: arenas, reservations, a
//! parameter's pieces and tensor-wide regions), `launch` (descriptors, items, batching into
//! launches), `views` (device-resident inputs and outputs, lent buffers and their checks) and
//! `step` (a step's items and the step primitives).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lpmm_optim::backend::{
    Backend, BackendError, Dtype, Folded, HostRegion, HostSlot, HostValues, HostValuesMut, Init,
    ParamLayout, Phase, Place, SLOTS, SlotKind, StepWork, Walked,
};
use lpmm_optim::backend::{ExactSum, add_squares};

use crate::abi::{Desc, Entry, F_INPUT, F_INPUT_BF16, F_OUTPUT_BF16, TILE, map_table};
use crate::arena::{DeviceParam, Piece, Pool, State, elem_specs, wide_specs};
use crate::launch::Item;
use crate::runtime::{Runtime, Specialized};
use crate::views::{DeviceInput, DeviceOutput};

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
pub(crate) struct Inner<R: Runtime> {
    pub(crate) rt: R,
    pub(crate) options: DeviceOptions,
    pub(crate) maps: R::Buffer,
    pub(crate) lost: Mutex<Option<BackendError>>,
    pub(crate) state: Mutex<State<R::Buffer>>,
    pub(crate) launches: AtomicU64,
    pub(crate) plan_launches: AtomicU64,
    pub(crate) reserved: AtomicU64,
}

/// lpmm-optim's [`Backend`] on a device runtime. Cheap to clone (clones share the device).
pub struct Device<R: Runtime> {
    pub(crate) inner: Arc<Inner<R>>,
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
    pub(crate) fn check(&self) -> Result<(), BackendError> {
        match &*self.inner.lost.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Remembers a device loss, so every later call fails the same way.
    pub(crate) fn guard<T>(&self, r: Result<T, BackendError>) -> Result<T, BackendError> {
        if let Err(e @ BackendError::DeviceLost { .. }) = &r {
            let mut lost = self.inner.lost.lock().unwrap_or_else(|e| e.into_inner());
            lost.get_or_insert_with(|| e.clone());
        }
        r
    }

    pub(crate) fn unsupported(&self, what: &str) -> BackendError {
        BackendError::Unsupported {
            backend: self.inner.rt.name(),
            what: what.into(),
        }
    }
}

impl<R: Runtime> Backend for Device<R> {
    type Param = DeviceParam<R>;
    type Input<'a> = DeviceInput<'a, R>;
    type Output<'a> = DeviceOutput<'a, R>;
    // No matrix phase: the trait's defaults refuse it, so a rule that takes one (Muon) cannot
    // be registered on a device (docs/BACKENDS.md).
    type Matrices = ();

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

    fn prepare(&self, work: &mut StepWork<'_, '_, '_, Self>) -> Result<(), BackendError> {
        self.step_prepare(work)
    }

    fn begin_phase(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        phase: Phase,
    ) -> Result<(), BackendError> {
        self.step_begin(work, phase)
    }

    fn fold(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        phase: Phase,
        pass: usize,
    ) -> Result<(), BackendError> {
        self.step_fold(work, phase, pass)
    }

    fn folded(
        &self,
        params: &mut [DeviceParam<R>],
        _layouts: &[ParamLayout],
        ran: &[bool],
        phase: Phase,
        combine: &mut dyn FnMut(usize, Folded<'_>),
    ) -> Result<(), BackendError> {
        self.step_folded(params, ran, phase, combine)
    }

    fn fused(
        &self,
        work: &mut StepWork<'_, '_, '_, Self>,
        non_finite: &mut [bool],
    ) -> Result<(), BackendError> {
        self.step_fused(work, non_finite)
    }

    fn swap_wide(&self, param: &mut DeviceParam<R>, slot: SlotKind, a: usize, b: usize) {
        param.wide_regions[slot as usize].swap(a, b);
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

/// f32 to bf16, round to nearest even (the CPU's read of a bf16 output).
fn lpmm_formats_bf16(values: &[f32], out: &mut [lpmm_formats::bf16]) {
    lpmm_formats::simd::f32_to_bf16_nearest(values, out);
}

#[cfg(test)]
mod tests;
