//! A parameter lent by the caller (a framework's tensor) is stepped in place with no copy: what
//! the allocator hands out, measured. One test in this binary, so no other test allocates while
//! it measures.

#[path = "support/counting.rs"]
mod counting;

use lpmm_optim::Parts;
use std::sync::atomic::Ordering;

use counting::{CALLS, Counting, LIVE};
use lpmm_optim::{Optimizer, OptimizerOptions, Storage};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A parameter lent by the caller (a framework's tensor) is stepped in place: registering it
/// allocates only its other slots (no copy of the parameter), a step allocates nothing, and the
/// bits equal those of the same parameter held by lpmm.
#[test]
fn a_lent_parameter_is_stepped_in_place_without_a_copy() {
    use lpmm_optim::backend::{HostValues, HostValuesMut};
    use lpmm_optim::{SlotKind, presets};
    // Start the thread pool outside the measured windows.
    rayon::join(|| (), || ());
    let n = 3 << 20; // three pieces
    let shape = [3 << 10, 1 << 10];
    let init: Vec<f32> = (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 1e-3).collect();
    let grads: Vec<Vec<f32>> = (0..3)
        .map(|t| {
            (0..n)
                .map(|i| ((i * (t + 1) % 777) as f32 - 388.0) * 1e-4)
                .collect()
        })
        .collect();
    let options = OptimizerOptions::default()
        .with_seed(5)
        .with_max_grad_norm(Some(1.0));
    for (name, config) in [
        ("f32 sgdm", presets::sgdm_f32(0.1, 0.9).build()),
        (
            "8-bit adamw, bf16 sr",
            presets::adamw_8bit_bf16_sr(1e-3).build(),
        ),
        (
            "4-bit adamw, split f32",
            presets::adamw_4bit_split(1e-3).build(),
        ),
    ] {
        let f32_param = config.param == Storage::F32;
        // The caller's tensor: f32, or bf16 (the values the owned parameter starts from too).
        let bf: Vec<lpmm_formats::bf16> = init
            .iter()
            .map(|&x| lpmm_formats::bf16::from_f32(x))
            .collect();
        let start: Vec<f32> = if f32_param {
            init.clone()
        } else {
            bf.iter().map(|x| x.to_f32()).collect()
        };
        let mut owned = Optimizer::new(options).unwrap();
        owned.add_group(config).unwrap();
        let a = owned.add_param("w", &shape, &start, 0).unwrap();

        let mut lent = Optimizer::new(options).unwrap();
        lent.add_group(config).unwrap();
        let (mut buf32, mut buf16) = (init.clone(), bf.clone());
        let values = if f32_param {
            HostValues::F32(&buf32)
        } else {
            HostValues::Bf16(&buf16)
        };
        let before = LIVE.load(Ordering::SeqCst);
        let b = lent.add_lent_param("w", &shape, values, 0, config).unwrap();
        let grown = LIVE.load(Ordering::SeqCst) - before;
        let (lent_bytes, owned_bytes) =
            (lent.memory_report().total(), owned.memory_report().total());
        let param_bytes = owned.memory_report().params[0].bytes[0];
        let kept = lent.memory_report().params[0].bytes[0];
        assert_eq!(lent_bytes, owned_bytes - param_bytes + kept, "{name}");
        // Bookkeeping (48 pieces of 2^16 elements, about 0.9 KiB each) may add some KiB; a copy
        // of the parameter would add 12 MiB.
        assert!(
            (grown - lent_bytes as isize).abs() < 65536,
            "{name}: allocated {grown}, accounted {lent_bytes} (no copy of the {param_bytes}-byte parameter)"
        );

        for (k, g) in grads.iter().enumerate() {
            owned.accumulate(a, g).unwrap();
            lent.accumulate(b, g).unwrap();
            let r1 = owned.step(lpmm_optim::Accumulated).unwrap();
            let calls = CALLS.load(Ordering::SeqCst);
            let out = if f32_param {
                HostValuesMut::F32(&mut buf32)
            } else {
                HostValuesMut::Bf16(&mut buf16)
            };
            let r2 = lent
                .step(
                    lpmm_optim::Step::accumulated()
                        .lent(lpmm_optim::Lent::Buffers(&mut [(b, out)])),
                )
                .unwrap();
            if k > 0 {
                assert_eq!(
                    CALLS.load(Ordering::SeqCst) - calls,
                    0,
                    "{name}: step allocated"
                );
            }
            assert_eq!(r1, r2, "{name}");
        }
        // The caller's buffer holds the parameter's bits, and the other slots are the same.
        let want = Parts::of(&owned)
            .export_slot(a, SlotKind::Param, None)
            .unwrap();
        let have = if f32_param {
            HostValues::F32(&buf32)
        } else {
            HostValues::Bf16(&buf16)
        };
        assert_eq!(want.regions[0].bytes, have.bytes(), "{name}: parameter");
        let got = Parts::of(&lent)
            .export_slot(b, SlotKind::Param, Some(have))
            .unwrap();
        assert_eq!(want, got, "{name}: parameter slot");
        for slot in [SlotKind::Grad, SlotKind::State1, SlotKind::State2] {
            assert_eq!(
                Parts::of(&owned).export_slot(a, slot, None).unwrap(),
                Parts::of(&lent).export_slot(b, slot, None).unwrap(),
                "{name}: {}",
                slot.name()
            );
        }
        // Without its buffer the step is a typed error, not a panic.
        lent.accumulate(b, &grads[0]).unwrap();
        assert!(matches!(
            lent.step(lpmm_optim::Accumulated),
            Err(lpmm_optim::OptimError::Lent { .. })
        ));
    }
}
