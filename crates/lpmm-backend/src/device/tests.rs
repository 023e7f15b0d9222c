//! [`Device`]'s `Backend` methods on a host runtime that records launches ([`crate::fake`]):
//! options, the checks a step makes before its first launch, export and import, reads, the
//! statistics and limit checks, and the memory a parameter reports.

use lpmm_optim::backend::{Backend, Init, ParamId, ParamLayout, ParamStep, StepWork, run_batch};
use lpmm_optim::{ParamConfig, presets};

use super::*;
use crate::fake::{self, Host, View};

fn options() -> DeviceOptions {
    DeviceOptions::new(4096, 1 << 16)
}

#[test]
fn options_are_checked_when_the_device_is_made() {
    let unsupported = |o: DeviceOptions| match Device::new(Host::bindless(), o) {
        Err(BackendError::Unsupported { what, .. }) => what,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        unsupported(DeviceOptions::new(1000, 4096)),
        "piece_elements = 1000 (a positive multiple of 4096 is needed)"
    );
    assert_eq!(
        unsupported(DeviceOptions::new(0, 4096)),
        "piece_elements = 0 (a positive multiple of 4096 is needed)"
    );
    assert_eq!(
        unsupported(DeviceOptions::new(8192, 4096)),
        "io_floats = 4096 (at least one piece, 8192, is needed)"
    );
    let d = Device::new(Host::bindless(), options()).unwrap();
    // The code-map table is the first thing on the device.
    assert_eq!(d.runtime().words(0), map_table());
}

/// Parameters of `shapes` with `config`, lent where `lent` says, each with a plan.
fn params(
    d: &Device<Host>,
    config: &ParamConfig,
    shapes: &[(usize, bool)],
) -> (
    Vec<ParamLayout>,
    Vec<DeviceParam<Host>>,
    Vec<Option<ParamStep>>,
) {
    let layouts: Vec<_> = shapes
        .iter()
        .map(|&(n, lent)| fake::layout(*config, &[n], lent))
        .collect();
    let params = layouts
        .iter()
        .map(|l| {
            let init = if l.lent { Init::Lent } else { Init::Fresh };
            d.allocate(l, init, 0).unwrap()
        })
        .collect();
    let plans = layouts
        .iter()
        .map(|l| Some(fake::plan(config, l)))
        .collect();
    (layouts, params, plans)
}

#[test]
fn a_step_refuses_bad_lent_and_released_buffers_before_its_first_launch() {
    let d = Device::new(Host::bindless(), options()).unwrap();
    let config = presets::adamw_8bit_bf16(1e-3).build();
    let (layouts, mut params, plans) =
        params(&d, &config, &[(5000, true), (3000, true), (10, false)]);
    let ids = fake::ids(3);
    let good = [
        View::new(1, Dtype::Bf16, 5000),
        View::new(2, Dtype::Bf16, 3000),
    ];
    let host = [0.0f32; 3000];
    let mut bf16 = [lpmm_formats::bf16::ZERO; 5000];
    let grad = [0.0f32; 2];
    let mut try_step = |lent: &mut [(ParamId, DeviceOutput<'_, Host>)],
                        released: Option<(usize, DeviceInput<'_, Host>)>| {
        let mut non_finite = [true; 3];
        let work = StepWork {
            params: &mut params,
            layouts: &layouts,
            plans: &plans,
            released,
            lent,
            seed: 0,
        };
        let r = run_batch(&d, work, &mut non_finite);
        assert_eq!(non_finite, [true; 3], "nothing reported");
        match r {
            Err(BackendError::Buffer { what }) => what,
            other => panic!("{other:?}"),
        }
    };
    // Which parameters have a buffer, and once, is the executor's check (lpmm-optim's
    // `exec`); the device checks what only it can: a device buffer, of the parameter's size.
    let dev = |k: usize, v: View| (ids[k], DeviceOutput::Device(v));
    assert_eq!(
        try_step(
            &mut [
                dev(0, good[0]),
                (
                    ids[1],
                    DeviceOutput::Host(HostValuesMut::Bf16(&mut bf16[..3000]))
                )
            ],
            None
        ),
        "a lent parameter on a device is a device buffer"
    );
    // A short buffer for the second lent parameter.
    assert_eq!(
        try_step(
            &mut [dev(0, good[0]), dev(1, View::new(2, Dtype::Bf16, 2999))],
            None
        ),
        "a bf16 buffer of 2999 values where 3000 values of bf16 are needed"
    );
    let released = Some((1, DeviceInput::Host(HostValues::F32(&grad))));
    assert_eq!(
        try_step(&mut [dev(0, good[0]), dev(1, good[1])], released),
        "2 host values where 3000 are needed"
    );
    assert!(d.runtime().launches().is_empty(), "nothing launched");
    // With good buffers, the step runs.
    let released = Some((1, DeviceInput::Host(HostValues::F32(&host))));
    let mut non_finite = [true; 3];
    let work = StepWork {
        params: &mut params,
        layouts: &layouts,
        plans: &plans,
        released,
        lent: &mut [dev(0, good[0]), dev(1, good[1])],
        seed: 0,
    };
    run_batch(&d, work, &mut non_finite).unwrap();
    assert_eq!(non_finite, [false; 3]);
    assert_eq!(d.runtime().launches().len(), 1);
}

#[test]
fn what_import_writes_export_reads_back() {
    let d = Device::new(Host::binding(1 << 16), options()).unwrap();
    for (config, shape) in [
        (presets::adamw_8bit(1e-3).build(), &[5000][..]),
        (presets::came_f32(1e-3).build(), &[64, 65][..]),
    ] {
        let layout = fake::layout(config, shape, false);
        let mut p = d.allocate(&layout, Init::Fresh, 0).unwrap();
        let _neighbour = d.allocate(&layout, Init::Fresh, 0).unwrap();
        for slot in SlotKind::ALL {
            let fresh = d.export(&p, &layout, slot, None).unwrap();
            if layout.format(slot).is_none() {
                assert!(fresh.regions.is_empty());
                continue;
            }
            // New bytes in every element region, positive floats in every tensor-wide one.
            let mut host = fresh.clone();
            for (r, region) in host.regions.iter_mut().enumerate() {
                if region.spec.per_element() {
                    for (j, b) in region.bytes.iter_mut().enumerate() {
                        *b = (j * 7 + r * 13 + slot as usize) as u8;
                    }
                } else {
                    let words = (0..region.bytes.len() / 4).map(|j| (j + r + 1) as f32);
                    region.bytes = words.flat_map(f32::to_le_bytes).collect();
                }
            }
            assert_ne!(host, fresh);
            d.import(&mut p, &layout, slot, &host, None).unwrap();
            let back = d.export(&p, &layout, slot, None).unwrap();
            assert_eq!(back, host, "{slot:?} of {shape:?}");
        }
    }
}

#[test]
fn a_lent_parameter_is_the_caller_s_to_read_and_comes_with_its_buffer() {
    let d = Device::new(Host::bindless(), options()).unwrap();
    let config = presets::adamw_8bit_bf16(1e-3).build();
    let (layouts, params, _) = params(&d, &config, &[(10, true)]);
    let (l, p) = (&layouts[0], &params[0]);
    let mut out = [0.0f32; 10];
    let unsupported = |e| match e {
        BackendError::Unsupported { what, .. } => what,
        other => panic!("{other:?}"),
    };
    let read = d.read(
        p,
        l,
        SlotKind::Param,
        DeviceOutput::Host(HostValuesMut::F32(&mut out)),
    );
    assert_eq!(
        unsupported(read.unwrap_err()),
        "reading a lent parameter (it is the caller's buffer)"
    );
    let export = d.export(p, l, SlotKind::Param, None);
    assert_eq!(
        unsupported(export.unwrap_err()),
        "exporting a lent parameter without its buffer"
    );
    let values: Vec<lpmm_formats::bf16> = (0..10)
        .map(|j| lpmm_formats::bf16::from_f32(j as f32))
        .collect();
    let host = d
        .export(
            p,
            l,
            SlotKind::Param,
            Some(DeviceInput::Host(HostValues::Bf16(&values))),
        )
        .unwrap();
    assert_eq!(
        host.regions[0].bytes,
        bytemuck::cast_slice::<_, u8>(&values)
    );
    let short = View::new(1, Dtype::Bf16, 9);
    let export = d.export(p, l, SlotKind::Param, Some(DeviceInput::Device(short)));
    assert!(matches!(export, Err(BackendError::Buffer { .. })));
}

#[test]
fn decoded_values_reach_the_host_and_caller_buffers() {
    let mut host = Host::bindless();
    host.decode_keys = true;
    let d = Device::new(host, DeviceOptions::new(4096, 4096)).unwrap();
    let config = presets::adamw_8bit_bf16(1e-3).build();
    let n = 2 * 4096 + 5;
    let (layouts, mut params, _) = params(&d, &config, &[(n, false), (n, false)]);
    let (l, p) = (&layouts[0], &params[0]);
    let want: Vec<f32> = (0..n).map(|j| j as f32).collect();
    let mut out = vec![0.0f32; n];
    d.read(
        p,
        l,
        SlotKind::Grad,
        DeviceOutput::Host(HostValuesMut::F32(&mut out)),
    )
    .unwrap();
    assert_eq!(out, want);
    let mut out = vec![lpmm_formats::bf16::ZERO; n];
    d.read(
        p,
        l,
        SlotKind::State1,
        DeviceOutput::Host(HostValuesMut::Bf16(&mut out)),
    )
    .unwrap();
    let rounded: Vec<_> = want
        .iter()
        .map(|&x| lpmm_formats::bf16::from_f32(x))
        .collect();
    assert_eq!(out, rounded);
    assert!(
        d.runtime()
            .launches()
            .iter()
            .flat_map(|l| &l.descs)
            .all(|d| d.mode == SlotKind::Grad as u32 || d.mode == SlotKind::State1 as u32)
    );
    // Into a caller's bf16 buffer, where it is.
    let view = View::new(5, Dtype::Bf16, n);
    d.read(p, l, SlotKind::Param, DeviceOutput::Device(view))
        .unwrap();
    let last = d.runtime().launches().pop().unwrap();
    assert_eq!((last.entry, last.io), (Entry::Decode, Some(view)));
    assert!(last.descs.iter().all(|d| d.flags & F_OUTPUT_BF16 != 0));
    // The gradient statistics: the selected parameters' decoded gradients, summed on the host.
    let mut stats = [(ExactSum::new(), false); 2];
    d.gradient_stats(&mut params, &layouts, &[true, false], &mut stats)
        .unwrap();
    let mut sum = ExactSum::new();
    assert!(add_squares(&want, &mut sum));
    assert_eq!(stats, [(sum, true), (ExactSum::new(), true)]);
}

#[test]
fn fits_reads_the_flag_its_check_launch_sets() {
    for over in [false, true] {
        let mut host = Host::bindless();
        host.flag_entry = over.then_some(Entry::Check);
        let d = Device::new(host, options()).unwrap();
        let view = View::new(1, Dtype::F32, 3 * 4096);
        assert_eq!(d.fits(DeviceInput::Device(view), 1.0).unwrap(), !over);
        let launches = d.runtime().launches();
        assert_eq!((launches.len(), launches[0].descs.len()), (1, 3));
        assert_eq!(launches[0].descs[0].mode, 1.0f32.to_bits());
        let config = presets::adamw_8bit_bf16(1e-3).build();
        let (layouts, params, _) = params(&d, &config, &[(10, false)]);
        let grad = DeviceInput::Device(View::new(2, Dtype::Bf16, 10));
        let fits = d.accumulate_fits(&params[0], &layouts[0], grad).unwrap();
        assert_eq!(fits, !over);
        // Host values are checked on the host.
        let host = DeviceInput::Host(HostValues::F32(&[f32::MAX, 2.0]));
        assert!(!d.fits(host, 1.0).unwrap());
        assert_eq!(d.runtime().launches().len(), 2);
    }
}

#[test]
fn a_parameter_s_bytes_are_the_memory_reserved_for_it() {
    for specialized in [Specialized::None, Specialized::Aligned { bytes: 16 }] {
        let mut host = Host::bindless();
        host.specialized = specialized;
        let d = Device::new(host, options()).unwrap();
        let mut total = 0;
        let mut kept = Vec::new();
        for (config, n, lent) in [
            (presets::adamw_8bit_bf16(1e-3).build(), 2 * 4096 + 3, true),
            (presets::adamw_4bit(1e-3).build(), 4096 + 1, false),
            (presets::came_f32(1e-3).build(), 77, false),
        ] {
            let (layouts, params, _) = params(&d, &config, &[(n, lent)]);
            total += d.bytes(&params[0], &layouts[0]).iter().sum::<usize>();
            kept.push(params);
        }
        assert_eq!(4 * d.reserved_words() as usize, total, "{specialized:?}");
        drop(kept);
        assert_eq!(d.reserved_words(), 0);
    }
}
