//! Device memory: arenas (device buffers carved into reservations, first fit, coalesced on
//! release) in pools, what a [`Device`] holds for one parameter ([`DeviceParam`]: its pieces'
//! element regions and its tensor-wide regions), reads and writes of tensor-wide regions, and the
//! flag buffer.

use std::sync::MutexGuard;
use std::sync::atomic::{AtomicU32, Ordering};

use lpmm_optim::backend::{BackendError, Format, RegionSpec, SLOTS};

use crate::device::{Device, Inner};
use crate::runtime::Runtime;

/// One reservation: `words` words at `start` of arena `arena`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) arena: usize,
    pub(crate) start: usize,
    pub(crate) words: usize,
}

/// An arena: one device buffer and its free word ranges (first fit, coalesced on release).
#[derive(Debug)]
pub(crate) struct Arena<B> {
    buffer: B,
    free: Vec<(usize, usize)>,
}

#[derive(Debug)]
pub(crate) struct Pool<B> {
    pub(crate) arenas: Vec<Option<Arena<B>>>,
}

impl<B> Default for Pool<B> {
    fn default() -> Self {
        Pool { arenas: Vec::new() }
    }
}

#[derive(Debug)]
pub(crate) struct State<B> {
    pub(crate) pieces: Pool<B>,
    pub(crate) wide: Pool<B>,
    pub(crate) io: Option<B>,
    pub(crate) flags: Option<B>,
}

/// One piece of a parameter on the device: its range and its slots' element regions (word
/// offsets in its arena), all in one reservation.
#[derive(Debug, Clone)]
pub(crate) struct Piece {
    pub(crate) offset: usize,
    pub(crate) len: usize,
    pub(crate) span: Span,
    /// `(word offset in the arena, words)` of each slot's element regions.
    pub(crate) regions: [[(usize, usize); 3]; SLOTS],
    /// Words of padding before each element region (where the runtime wants regions aligned:
    /// [`crate::Specialized::Aligned`]), counted in the slot's bytes.
    pub(crate) pads: [[usize; 3]; SLOTS],
}

/// Everything a [`Device`] holds for one parameter. Dropping it returns its memory.
pub struct DeviceParam<R: Runtime> {
    pub(crate) device: Device<R>,
    pub(crate) pieces: Vec<Piece>,
    /// The reservation of every tensor-wide region of every slot.
    pub(crate) wide: Option<Span>,
    /// `(word offset in the wide arena, words)` of each slot's tensor-wide regions.
    pub(crate) wide_regions: [Vec<(usize, usize)>; SLOTS],
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

/// The element regions of a slot of a tensor of `shape` (byte lengths for `n` elements).
pub(crate) fn elem_specs(format: Option<Format>, shape: &[usize]) -> Vec<RegionSpec> {
    format.map_or_else(Vec::new, |f| {
        f.regions(shape)
            .into_iter()
            .filter(|r| r.per_element())
            .collect()
    })
}

pub(crate) fn wide_specs(format: Option<Format>, shape: &[usize]) -> Vec<RegionSpec> {
    format.map_or_else(Vec::new, |f| {
        f.regions(shape)
            .into_iter()
            .filter(|r| !r.per_element())
            .collect()
    })
}

impl<R: Runtime> Inner<R> {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State<R::Buffer>> {
        // A panic while the lock was held cannot leave the free lists in a state worse than
        // refusing all further work would.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<R: Runtime> Device<R> {
    pub(crate) fn reserve(
        &self,
        pool: &mut Pool<R::Buffer>,
        words: usize,
    ) -> Result<Span, BackendError> {
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

    pub(crate) fn release(&self, pool: &mut Pool<R::Buffer>, span: Span) {
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

    pub(crate) fn buffer(pool: &Pool<R::Buffer>, arena: usize) -> &R::Buffer {
        &pool.arenas[arena]
            .as_ref()
            .expect("a live reservation's arena exists")
            .buffer
    }

    pub(crate) fn wide_words(
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

    pub(crate) fn write_wide(
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

    pub(crate) fn ensure_flags(
        &self,
        state: &mut State<R::Buffer>,
        n: usize,
    ) -> Result<(), BackendError> {
        let rt = &self.inner.rt;
        let n = n.max(1);
        if state.flags.as_ref().is_none_or(|f| rt.len(f) < n) {
            state.flags = Some(self.guard(rt.alloc(n.next_power_of_two()))?);
        }
        let zeros = vec![0u32; n];
        self.guard(rt.write(state.flags.as_ref().expect("allocated"), 0, &zeros))
    }
}

#[cfg(test)]
mod tests {
    use lpmm_optim::backend::{Backend, Init, SlotKind};
    use lpmm_optim::presets;

    use super::*;
    use crate::fake::{self, Buf, Host};
    use crate::runtime::Specialized;

    fn free(pool: &Pool<Buf>, arena: usize) -> Vec<(usize, usize)> {
        pool.arenas[arena].as_ref().unwrap().free.clone()
    }

    #[test]
    fn reservations_are_first_fit_and_released_ranges_coalesce() {
        let d = fake::device(Host::binding(100), 4096, 4096);
        let mut pool = Pool::default();
        let a = d.reserve(&mut pool, 30).unwrap();
        let b = d.reserve(&mut pool, 30).unwrap();
        let c = d.reserve(&mut pool, 30).unwrap();
        assert_eq!(
            [a, b, c].map(|s| (s.arena, s.start)),
            [(0, 0), (0, 30), (0, 60)]
        );
        // 10 words are left in the first arena: a larger reservation opens a second one.
        let e = d.reserve(&mut pool, 20).unwrap();
        assert_eq!((e.arena, e.start, e.words), (1, 0, 20));
        assert_eq!(d.runtime().len(Device::<Host>::buffer(&pool, 1)), 100);
        assert_eq!(d.reserved_words(), 110);
        d.release(&mut pool, b);
        d.release(&mut pool, a);
        assert_eq!(free(&pool, 0), [(0, 60), (90, 10)]);
        // The coalesced range takes what neither half could.
        let f = d.reserve(&mut pool, 50).unwrap();
        assert_eq!((f.arena, f.start), (0, 0));
        d.release(&mut pool, c);
        assert_eq!(free(&pool, 0), [(50, 50)], "merged with both neighbours");
        d.release(&mut pool, f);
        d.release(&mut pool, e);
        assert_eq!(free(&pool, 0), [(0, 100)]);
        assert_eq!(free(&pool, 1), [(0, 100)]);
        assert_eq!(d.reserved_words(), 0);
        // Arenas stay for the next reservations.
        assert!(pool.arenas.iter().all(Option::is_some));
        // An empty reservation takes a word.
        assert_eq!(d.reserve(&mut pool, 0).unwrap().words, 1);
    }

    #[test]
    fn a_reservation_larger_than_an_arena_is_refused() {
        let d = fake::device(Host::binding(100), 4096, 4096);
        let mut pool = Pool::default();
        let err = d.reserve(&mut pool, 101).unwrap_err();
        assert!(
            matches!(&err, BackendError::Unsupported { backend: "host", what }
                if what.contains("a reservation of 101 words") && what.contains("(100)")),
            "{err}"
        );
        assert!(pool.arenas.is_empty());
        assert_eq!(d.reserved_words(), 0);
    }

    #[test]
    fn an_exact_runtime_allocates_each_reservation_and_frees_it_on_release() {
        let d = fake::device(Host::bindless(), 4096, 4096);
        let mut pool = Pool::default();
        let a = d.reserve(&mut pool, 30).unwrap();
        let b = d.reserve(&mut pool, 50).unwrap();
        assert_eq!([a, b].map(|s| (s.arena, s.start)), [(0, 0), (1, 0)]);
        assert_eq!(d.runtime().len(Device::<Host>::buffer(&pool, 1)), 50);
        d.release(&mut pool, a);
        assert!(
            pool.arenas[0].is_none(),
            "the arena went with its reservation"
        );
        let c = d.reserve(&mut pool, 10).unwrap();
        assert_eq!(c.arena, 0, "the free slot is reused");
        assert_eq!(d.runtime().len(Device::<Host>::buffer(&pool, 0)), 10);
        assert_eq!(d.reserved_words(), 60);
    }

    /// `(start, words)` of every non-empty element region of `p`'s pieces.
    fn regions(p: &DeviceParam<Host>) -> Vec<Vec<(usize, usize)>> {
        p.pieces
            .iter()
            .map(|piece| {
                let mut r: Vec<_> = piece.regions.iter().flatten().copied().collect();
                r.retain(|&(_, w)| w > 0);
                r.sort();
                r
            })
            .collect()
    }

    #[test]
    fn element_regions_start_where_the_runtime_asks_and_do_not_overlap() {
        let config = presets::adamw_8bit_bf16(1e-3).build();
        let layout = fake::layout(config, &[2 * 4096 + 3], false);
        for (specialized, align) in [
            (Specialized::None, 1),
            (Specialized::Aligned { bytes: 16 }, 4),
        ] {
            let mut host = Host::bindless();
            host.specialized = specialized;
            let d = fake::device(host, 4096, 4096);
            let p = d.allocate(&layout, Init::Fresh, 0).unwrap();
            assert_eq!(
                p.pieces.iter().map(|p| p.len).collect::<Vec<_>>(),
                [4096, 4096, 3]
            );
            let padded = p
                .pieces
                .iter()
                .flat_map(|p| p.pads.iter().flatten())
                .sum::<usize>();
            // Only the short last piece has regions whose lengths are not multiples of 16 bytes.
            assert_eq!(padded > 0, align > 1, "{specialized:?}");
            for (piece, regions) in p.pieces.iter().zip(regions(&p)) {
                let mut end = piece.span.start;
                for (at, w) in regions {
                    assert_eq!(at % align, 0, "{specialized:?}: a region at word {at}");
                    assert!(at >= end, "regions overlap");
                    end = at + w;
                }
                assert!(end <= piece.span.start + piece.span.words);
            }
        }
    }

    #[test]
    fn a_reused_range_starts_fresh_and_a_dropped_parameter_returns_its_memory() {
        let d = fake::device(Host::binding(1 << 16), 4096, 4096);
        let layout = fake::layout(presets::adamw_8bit(1e-3).build(), &[5000], false);
        let p = d.allocate(&layout, Init::Fresh, 0).unwrap();
        assert!(d.reserved_words() > 0);
        let span = p.pieces[1].span;
        let buffer = Device::<Host>::buffer(&d.inner.lock().pieces, span.arena).0;
        let fresh = d.runtime().words(buffer);
        let scribbled = vec![0xdead_beef; span.words];
        d.runtime()
            .write(&Buf(buffer), span.start, &scribbled)
            .unwrap();
        drop(p);
        assert_eq!(d.reserved_words(), 0);
        assert_eq!(d.arenas(), 1, "the arena stays for reuse");
        let q = d.allocate(&layout, Init::Fresh, 0).unwrap();
        assert_eq!(q.pieces[1].span, span, "the same range again");
        assert_eq!(d.runtime().words(buffer), fresh);
    }

    #[test]
    fn tensor_wide_regions_are_written_and_read_where_their_parameter_holds_them() {
        let d = fake::device(Host::binding(1 << 16), 4096, 4096);
        let layout = fake::layout(presets::came_f32(1e-3).build(), &[64, 64], false);
        let a = d.allocate(&layout, Init::Fresh, 0).unwrap();
        let b = d.allocate(&layout, Init::Fresh, 0).unwrap();
        let slot = SlotKind::State2 as usize;
        let lens: Vec<usize> = b.wide_regions[slot].iter().map(|r| r.1).collect();
        assert!(lens.len() >= 2, "a factorized second moment: {lens:?}");
        let state = d.inner.lock();
        let value = |r: usize, j: usize| (1000 * (r + 1) + j) as u32;
        d.write_wide(&state, &b, slot, &mut |r| {
            Some((0..lens[r]).map(|j| value(r, j)).collect())
        })
        .unwrap();
        // `None` leaves a region as it is.
        d.write_wide(&state, &b, slot, &mut |r| {
            (r == 0).then(|| vec![7; lens[0]])
        })
        .unwrap();
        let read = |p: &DeviceParam<Host>| -> Vec<Vec<u32>> {
            d.wide_words(&state, p, slot)
                .unwrap()
                .iter()
                .map(|w| w.iter().map(|x| x.load(Ordering::Relaxed)).collect())
                .collect()
        };
        let got = read(&b);
        assert_eq!(got[0], vec![7; lens[0]]);
        for (r, words) in got.iter().enumerate().skip(1) {
            assert_eq!(
                *words,
                (0..lens[r]).map(|j| value(r, j)).collect::<Vec<_>>()
            );
        }
        assert!(
            read(&a).iter().flatten().all(|&w| w == 0),
            "a's regions untouched"
        );
    }

    #[test]
    fn the_flag_buffer_grows_to_a_power_of_two_and_its_words_in_use_are_zeroed() {
        let d = fake::device(Host::bindless(), 4096, 4096);
        let mut state = d.inner.lock();
        d.ensure_flags(&mut state, 3).unwrap();
        let flags = state.flags.unwrap();
        assert_eq!(d.runtime().len(&flags), 4);
        d.runtime().write(&flags, 0, &[1; 4]).unwrap();
        d.ensure_flags(&mut state, 2).unwrap();
        assert_eq!(state.flags, Some(flags), "big enough: kept");
        assert_eq!(d.runtime().words(flags.0), [0, 0, 1, 1]);
        d.ensure_flags(&mut state, 5).unwrap();
        assert_eq!(d.runtime().len(state.flags.as_ref().unwrap()), 8);
    }
}
