//! Descriptors and launches: the descriptor of a parameter's piece, the items covering a
//! parameter, and `run`, which runs an entry over items in as few launches as their bindings and
//! the staging buffer allow.

use std::sync::atomic::Ordering;

use lpmm_optim::backend::{BackendError, Dtype, HostValues, ParamLayout};

use crate::abi::{
    Binding, Desc, Entry, F_INPUT, F_INPUT_BF16, MAX_DIMS, SLOT_REGIONS, SlotDesc, TILE,
};
use crate::arena::{DeviceParam, Piece, State, elem_specs};
use crate::device::Device;
use crate::runtime::{Io, Launch, Runtime};
use crate::views::DeviceInput;

/// One item of a launch before it is laid out: its descriptor, where its values come from or go
/// to, and what it binds.
pub(crate) struct Item<'a, R: Runtime> {
    pub(crate) desc: Desc,
    /// Host values to upload for the item (element range of the tensor).
    pub(crate) host_in: Option<(HostValues<'a>, usize)>,
    /// The item's values come back through staging.
    pub(crate) host_out: bool,
    /// A caller's buffer as the io binding, and the element of it the item starts at.
    pub(crate) view_io: Option<(R::View<'a>, usize)>,
    /// A lent parameter's buffer.
    pub(crate) lent: Option<R::View<'a>>,
    /// The arena of the item's piece and of its tensor-wide regions.
    pub(crate) arena: usize,
    pub(crate) wide: Option<usize>,
    /// The specialized step that runs the item ([`crate::plans`]), if any.
    pub(crate) plan: Option<usize>,
}

impl<R: Runtime> Device<R> {
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
    pub(crate) fn run<'v>(
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
    pub(crate) fn items<'a>(
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
}

#[cfg(test)]
mod tests {
    use lpmm_optim::backend::{Backend, Init, ParamLayout};
    use lpmm_optim::presets;

    use super::*;
    use crate::fake::{self, Host, View};

    /// `n` values `0, 1, ..`.
    fn counting(n: usize) -> Vec<f32> {
        (0..n).map(|j| j as f32).collect()
    }

    #[test]
    fn an_item_s_descriptor_addresses_every_slot_of_its_piece() {
        let d = fake::device(Host::binding(1 << 20), 4096, 4096);
        let came = ParamLayout {
            offset: 100_000,
            ..fake::layout(presets::came_f32(1e-3).build(), &[3, 4096], false)
        };
        let p = d.allocate(&came, Init::Fresh, 0).unwrap();
        let state = d.inner.lock();
        let mut items = Vec::new();
        d.items(&state, &p, &came, 42, None, None, false, &mut items);
        assert_eq!(items.len(), 3);
        let wide_span = p.wide.expect("a factorized state");
        let wide = Device::<Host>::buffer(&state.wide, wide_span.arena).0;
        for (it, piece) in items.iter().zip(&p.pieces) {
            let d = &it.desc;
            assert_eq!(
                (d.len, d.key, d.global, d.stream, d.seed),
                (
                    4096,
                    100_000 + piece.offset as u64,
                    piece.offset as u64,
                    3,
                    42
                )
            );
            assert_eq!((d.ndim, &d.shape[..3]), (2, &[3, 4096, 0][..]));
            assert_eq!((d.flags, d.io, d.tile_begin), (0, 0, 0));
            assert!(it.host_in.is_none() && it.view_io.is_none() && !it.host_out);
            assert_eq!(
                (it.arena, it.wide),
                (piece.span.arena, Some(wide_span.arena))
            );
            let arena = Device::<Host>::buffer(&state.pieces, piece.span.arena).0;
            for (k, slot) in d.slots.iter().enumerate() {
                let Some(format) = came.formats[k] else {
                    assert_eq!(slot.region, [0; SLOT_REGIONS], "slot {k} is not allocated");
                    continue;
                };
                assert_eq!(
                    (slot.format, slot.aux),
                    (format.kernel_id(), format.kernel_aux())
                );
                let elems = elem_specs(Some(format), &came.shape).len();
                let mut want: Vec<(usize, usize)> =
                    (0..elems).map(|r| (arena, piece.regions[k][r].0)).collect();
                want.extend(
                    p.wide_regions[k]
                        .iter()
                        .map(|&(at, _)| (wide, wide_span.start + at)),
                );
                let got: Vec<_> = slot.region[..want.len()]
                    .iter()
                    .map(|&a| Host::at(a))
                    .collect();
                assert_eq!(got, want, "slot {k}");
                assert!(slot.region[want.len()..].iter().all(|&a| a == 0));
            }
        }
    }

    #[test]
    fn a_lent_parameter_s_values_are_addressed_in_the_caller_s_buffer() {
        let d = fake::device(Host::bindless(), 4096, 4096);
        let n = 2 * 4096 + 5;
        let layout = fake::layout(presets::adamw_8bit_bf16(1e-3).build(), &[n], true);
        let p = d.allocate(&layout, Init::Lent, 0).unwrap();
        let view = View::new(7, Dtype::Bf16, n);
        let grad = View::new(9, Dtype::Bf16, n);
        let state = d.inner.lock();
        let mut items = Vec::new();
        let input = Some(DeviceInput::Device(grad));
        d.items(&state, &p, &layout, 0, input, Some(view), false, &mut items);
        for (it, piece) in items.iter().zip(&p.pieces) {
            // bf16: two bytes an element.
            assert_eq!(
                it.desc.slots[0].region[0],
                (7 << 48) | (2 * piece.offset as u64)
            );
            assert_eq!(
                (it.lent, it.view_io),
                (Some(view), Some((grad, piece.offset)))
            );
            assert_eq!(it.desc.flags, F_INPUT | F_INPUT_BF16);
        }
    }

    #[test]
    fn a_launch_takes_items_until_the_staging_buffer_is_full() {
        let d = fake::device(Host::bindless(), 4096, 3 * 4096);
        let n = 5 * 4096 - 10;
        let layout = fake::layout(presets::adamw_8bit(1e-3).build(), &[n], false);
        let p = d.allocate(&layout, Init::Fresh, 0).unwrap();
        let values = counting(n);
        let mut state = d.inner.lock();
        let mut items = Vec::new();
        let input = Some(DeviceInput::Host(HostValues::F32(&values)));
        d.items(&state, &p, &layout, 0, input, None, false, &mut items);
        d.run(&mut state, Entry::Accumulate, &mut items).unwrap();
        let launches = d.runtime().launches();
        let staging = state.io.unwrap().0;
        let io = |l: &crate::fake::Recorded| -> Vec<(u64, (usize, usize))> {
            l.descs
                .iter()
                .map(|d| (d.tile_begin, Host::at(d.io)))
                .collect()
        };
        assert_eq!(launches.len(), 2);
        assert_eq!((launches[0].tiles, launches[1].tiles), (3, 2));
        let at = |w| (staging, w);
        assert_eq!(io(&launches[0]), [(0, at(0)), (1, at(4096)), (2, at(8192))]);
        assert_eq!(io(&launches[1]), [(0, at(0)), (1, at(4096))]);
        assert!(launches.iter().all(|l| l.io.is_none()), "staging is bound");
        // The staging buffer holds the last launch's values, each at its item's place.
        let words = d.runtime().words(staging);
        let bits: Vec<u32> = values[3 * 4096..].iter().map(|v| v.to_bits()).collect();
        assert_eq!(words[..bits.len()], bits);
        // Without values to carry, every item goes in one launch.
        let mut items = Vec::new();
        d.items(&state, &p, &layout, 0, None, None, false, &mut items);
        d.run(&mut state, Entry::Clear, &mut items).unwrap();
        let launches = d.runtime().launches();
        assert_eq!((launches.len(), launches[2].descs.len()), (3, 5));
        assert_eq!(d.launches(), 3);
    }

    #[test]
    fn each_item_s_values_start_at_a_multiple_of_16_bytes_of_staging() {
        let d = fake::device(Host::bindless(), 4096, 4096);
        let layout = fake::layout(presets::adamw_8bit(1e-3).build(), &[5], false);
        let (a, b) = (
            d.allocate(&layout, Init::Fresh, 0),
            d.allocate(&layout, Init::Fresh, 0),
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        let values = counting(5);
        let mut state = d.inner.lock();
        let mut items = Vec::new();
        for p in [&a, &b, &a] {
            let input = Some(DeviceInput::Host(HostValues::F32(&values)));
            d.items(&state, p, &layout, 0, input, None, false, &mut items);
        }
        d.run(&mut state, Entry::Accumulate, &mut items).unwrap();
        let launches = d.runtime().launches();
        assert_eq!(launches.len(), 1);
        let words: Vec<usize> = launches[0].descs.iter().map(|d| Host::at(d.io).1).collect();
        assert_eq!(words, [0, 8, 16]);
    }

    #[test]
    fn items_that_bind_different_buffers_go_in_different_launches_where_the_runtime_binds() {
        // Arenas that hold one piece: a parameter of three pieces lies in three arenas.
        let layout = fake::layout(presets::adamw_8bit(1e-3).build(), &[3 * 4096], false);
        let words = {
            let d = fake::device(Host::bindless(), 4096, 4096);
            let p = d.allocate(&layout, Init::Fresh, 0).unwrap();
            p.pieces[0].span.words
        };
        let grads = [
            View::new(1, Dtype::F32, 3 * 4096),
            View::new(2, Dtype::F32, 3 * 4096),
        ];
        for (host, launches) in [(Host::binding(words), 6), (Host::bindless(), 1)] {
            let d = fake::device(host, 4096, 4096);
            let p = d.allocate(&layout, Init::Fresh, 0).unwrap();
            let mut state = d.inner.lock();
            let mut items = Vec::new();
            for g in grads {
                let input = Some(DeviceInput::Device(g));
                d.items(&state, &p, &layout, 0, input, None, false, &mut items);
            }
            d.run(&mut state, Entry::Accumulate, &mut items).unwrap();
            let got = d.runtime().launches();
            assert_eq!(got.len(), launches);
            if launches == 1 {
                assert_eq!(got[0].arena, None, "nothing bound");
                continue;
            }
            // One launch per (arena, gradient), the gradient bound as the io binding.
            let mut bound: Vec<_> = got
                .iter()
                .map(|l| (l.arena.unwrap(), l.io.unwrap().id))
                .collect();
            bound.sort();
            bound.dedup();
            assert_eq!(bound.len(), 6);
            for l in &got {
                let d = &l.descs[0];
                assert_eq!(Host::at(d.slots[0].region[0]).0, l.arena.unwrap());
                assert_eq!(d.io, (l.io.unwrap().id << 48) | (4 * d.global));
            }
        }
    }

    #[test]
    fn values_that_come_back_are_each_item_s_own_in_item_order() {
        let mut host = Host::bindless();
        host.decode_keys = true;
        let d = fake::device(host, 4096, 2 * 4096);
        let n = 5 * 4096 - 10;
        let layout = fake::layout(presets::adamw_8bit(1e-3).build(), &[n], false);
        let p = d.allocate(&layout, Init::Fresh, 0).unwrap();
        let mut state = d.inner.lock();
        let mut items = Vec::new();
        d.items(&state, &p, &layout, 0, None, None, true, &mut items);
        let outputs = d.run(&mut state, Entry::Decode, &mut items).unwrap();
        assert_eq!(d.launches(), 3);
        let values: Vec<f32> = outputs.concat();
        assert_eq!(values, counting(n));
    }
}
