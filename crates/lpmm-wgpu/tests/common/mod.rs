//! Shared by the wgpu tests: the adapter (or a clear skip), deterministic data, and a bit-level
//! comparison of two optimizers' model memory.

#![allow(dead_code)]

use lpmm_optim::{Backend, HostSlot, Optimizer, ParamId, SlotKind};
use lpmm_wgpu::{Wgpu, WgpuOptions};

/// The backend, or `None` with a message when no adapter exists. With `LPMM_REQUIRE_WGPU=1`
/// (as `.ci/run` sets it) a missing adapter fails the test instead.
pub fn backend(options: WgpuOptions) -> Option<Wgpu> {
    match Wgpu::new(options) {
        Ok(b) => Some(b),
        Err(e) => {
            if std::env::var("LPMM_REQUIRE_WGPU").is_ok_and(|v| v == "1") {
                panic!("LPMM_REQUIRE_WGPU=1 but {e}");
            }
            eprintln!("skipping the wgpu test: {e}");
            None
        }
    }
}

/// Small segments, pieces and io buffer, so that parameters span pieces and segments and
/// dispatches are cut into batches (the results must not depend on any of it).
pub fn small() -> WgpuOptions {
    WgpuOptions {
        segment_bytes: 160 << 10,
        piece_elements: 8192,
        io_bytes: 40 << 10,
    }
}

/// SplitMix64: the same numbers everywhere.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Values over several orders of magnitude (down to 1e-6 relative), with exact zeros.
    pub fn spread(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u = self.uniform();
                let e = (self.next() % 7) as i32 - 5;
                if self.next().is_multiple_of(61) {
                    0.0
                } else {
                    u * scale * 10f32.powi(e)
                }
            })
            .collect()
    }
}

/// A host slot with floats as bit patterns, so that -0.0 and 0.0 differ.
pub fn bits(h: &HostSlot) -> (Vec<u32>, Vec<u32>) {
    let w16 = |v: &[u16]| v.iter().map(|&x| u32::from(x)).collect::<Vec<_>>();
    let f = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    match h {
        HostSlot::Empty => (vec![], vec![]),
        HostSlot::F32(v) => (f(v), vec![]),
        HostSlot::Bf16(v) => (w16(v), vec![]),
        HostSlot::Kahan { value, comp } => (w16(value), w16(comp)),
        HostSlot::Split { hi, rem } => (w16(hi), w16(rem)),
        HostSlot::Quantized { codes, absmax } => {
            (codes.iter().map(|&c| u32::from(c)).collect(), f(absmax))
        }
        HostSlot::Factored { row, col } => (f(row), f(col)),
        HostSlot::Rank1 { codes, scales } => {
            (codes.iter().map(|&c| u32::from(c)).collect(), f(scales))
        }
    }
}

/// Every slot of every parameter of `a` and `b` must hold the same bits; panics naming the
/// first difference (parameter, slot, element, both values).
pub fn assert_same<A: Backend, B: Backend>(
    a: &Optimizer<A>,
    b: &Optimizer<B>,
    ids: &[ParamId],
    what: &str,
) {
    for &id in ids {
        for slot in SlotKind::ALL {
            let (x, y) = (
                a.export_slot(id, slot).unwrap(),
                b.export_slot(id, slot).unwrap(),
            );
            assert_eq!(
                std::mem::discriminant(&x),
                std::mem::discriminant(&y),
                "{what}: {} {} layouts differ",
                a.name(id).unwrap(),
                slot.name()
            );
            let (bx, by) = (bits(&x), bits(&y));
            for (part, (u, v)) in [(&bx.0, &by.0), (&bx.1, &by.1)].into_iter().enumerate() {
                assert_eq!(u.len(), v.len(), "{what}: lengths differ");
                if let Some(k) = u.iter().zip(v.iter()).position(|(p, q)| p != q) {
                    panic!(
                        "{what}: parameter {} slot {} part {part} element {k}: {:#x} vs {:#x}",
                        a.name(id).unwrap(),
                        slot.name(),
                        u[k],
                        v[k]
                    );
                }
            }
        }
    }
}
