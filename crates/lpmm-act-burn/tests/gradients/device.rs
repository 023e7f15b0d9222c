//! The device kernels (CubeCL, on burn's wgpu device: lavapipe in CI) against the host kernels
//! (lpmm-act on burn-flex), kernel by kernel: codes, masks and packing bit for bit; values within
//! the bounds stated here, where the device computes in f32 what the host computes in f64. And the
//! operators through the public API read nothing into host memory on the device.
//!
//! A module of the `gradients` test binary (one link of burn's wgpu stack for both); skipped with
//! a message when there is no wgpu adapter, a failure with `LPMM_REQUIRE_WGPU=1` (as CI sets it).

use std::sync::Arc;

use burn_backend::{TensorMetadata, ops::FloatTensorOps, tensor::FloatTensor};
use burn_tensor::{Device, Tensor, TensorData};
use lpmm_act_burn::block::Rng;
use lpmm_act_burn::kernels::ActBackend;
use lpmm_act_burn::{
    Activation, Cpu, Cube, FewBit, Grid, RandomStream, Table, Weight, few_bit, gelu_from_output,
    host_reads, layer_norm_from_output, softmax_dropout, softmax_dropout_matmul,
};

/// burn's wgpu device without autodiff (see [`super::wgpu`]).
fn wgpu() -> Option<Device> {
    super::wgpu().map(Device::inner)
}

/// The same values as a flex primitive and a cube primitive.
fn both<const D: usize>(
    values: &[f32],
    shape: [usize; D],
    dev: &Device,
) -> (FloatTensor<Cpu>, FloatTensor<Cube>) {
    let data = TensorData::new(values.to_vec(), shape);
    let host = Tensor::<D>::from_data(data.clone(), &Device::flex())
        .try_into_primitive::<Cpu>()
        .expect("a flex tensor");
    let device = Tensor::<D>::from_data(data, dev)
        .try_into_primitive::<Cube>()
        .expect("a cube tensor");
    (host, device)
}

fn host_values(t: FloatTensor<Cpu>) -> Vec<f32> {
    lpmm_act_burn::kernels::to_host::<Cpu>(t)
}

fn device_values(t: FloatTensor<Cube>) -> Vec<f32> {
    let shape = t.shape();
    let n = shape.num_elements();
    Tensor::<1>::from_primitive::<Cube>(Cube::float_reshape(t, [n].into()))
        .to_data()
        .try_into_vec_as::<f32>()
        .expect("f32")
}

fn assert_close(what: &str, device: &[f32], host: &[f32], tol: f32) {
    let e = super::rel_max(device, host);
    eprintln!("{what}: device vs host relative max error {e:e} (bound {tol:e})");
    assert!(e <= tol, "{what}: relative max error {e:e} > {tol:e}");
}

fn assert_bits_equal(what: &str, device: &[f32], host: &[f32]) {
    assert_eq!(device.len(), host.len());
    for (i, (d, h)) in device.iter().zip(host).enumerate() {
        assert_eq!(
            d.to_bits(),
            h.to_bits(),
            "{what}: element {i}: device {d} host {h}"
        );
    }
}

/// Normal values with a few exact zeros, ties on thresholds and non-finite values: what a
/// careless caller sends too.
fn inputs(n: usize, scale: f32, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.normal() * scale).collect()
}

#[test]
fn few_bit_codes_and_gradients_are_the_hosts_bit_for_bit() {
    let Some(dev) = wgpu() else { return };
    // Not a multiple of 32 (the last word is partial), every width 1..=8 (3, 5, 6, 7 straddle
    // words), and the table's own thresholds among the inputs (ties).
    let n = 3 * 1000 + 17;
    for (act, bits) in [
        (Activation::Gelu, 1),
        (Activation::Gelu, 2),
        (Activation::Silu, 3),
        (Activation::Tanh, 4),
        (Activation::Sigmoid, 5),
        (Activation::Gelu, 6),
        (Activation::Silu, 7),
        (Activation::Gelu, 8),
    ] {
        let table = Table::solve(act, bits, Weight::STANDARD, Grid::default()).unwrap();
        let mut x = inputs(n, 2.0, 5 + u64::from(bits));
        x[..table.thresholds.len().min(64)]
            .copy_from_slice(&table.thresholds[..table.thresholds.len().min(64)]);
        x[100] = f32::NAN;
        x[101] = f32::INFINITY;
        x[102] = f32::NEG_INFINITY;
        let (hx, dx) = both(&x, [n], &dev);
        let hc = Cpu::few_bit_encode(hx, &table);
        let dc = Cube::few_bit_encode(dx, &table);
        assert_eq!(
            Cube::read_codes(&dc, n, bits),
            Cpu::read_codes(&hc, n, bits),
            "{act:?} {bits}-bit codes"
        );
        let dy = inputs(n, 1.0, 99);
        let (hdy, ddy) = both(&dy, [n], &dev);
        let h = host_values(Cpu::few_bit_backward(hdy, &hc, &table));
        let d = device_values(Cube::few_bit_backward(ddy, &dc, &table));
        assert_bits_equal(&format!("{act:?} {bits}-bit dx"), &d, &h);
    }
    // ReLU's exact 1-bit table.
    let table = Table::relu();
    let mut x = inputs(999, 1.0, 3);
    x[0] = 0.0;
    x[1] = -0.0;
    x[2] = f32::from_bits(1);
    let (hx, dx) = both(&x, [999], &dev);
    let (hc, dc) = (
        Cpu::few_bit_encode(hx, &table),
        Cube::few_bit_encode(dx, &table),
    );
    assert_eq!(Cube::read_codes(&dc, 999, 1), Cpu::read_codes(&hc, 999, 1));
}

#[test]
fn gelu_mask_is_the_hosts_and_values_are_within_bounds() {
    let Some(dev) = wgpu() else { return };
    let n = 70_000; // beyond one host chunk (65,536), not a multiple of 32
    let mut x = inputs(n, 2.0, 21);
    // Around the minimum, where the branch bit decides.
    let argmin = lpmm_act::tempo::GELU_ARGMIN as f32;
    x[0] = argmin;
    x[1] = argmin.next_up();
    x[2] = argmin.next_down();
    for (k, v) in x[3..2003].iter_mut().enumerate() {
        *v = argmin + (k as f32 - 1000.0) * 1e-4;
    }
    let (hx, dx) = both(&x, [n], &dev);
    let (hy, hm) = Cpu::gelu_mask_forward(hx);
    let (dy_, dm) = Cube::gelu_mask_forward(dx);
    assert_eq!(
        Cube::read_mask(&dm, n),
        Cpu::read_mask(&hm, n),
        "GELU branch mask"
    );
    let hyv = host_values(hy.clone());
    assert_close("GELU output", &device_values(dy_), &hyv, 1e-6);
    // Backward from the host's output (so that only the backward kernel differs).
    let (_, y_dev) = both(&hyv, [n], &dev);
    let g = inputs(n, 1.0, 22);
    let (hg, dg) = both(&g, [n], &dev);
    let h = host_values(Cpu::gelu_output_backward(hg, hy, &hm));
    let d = device_values(Cube::gelu_output_backward(dg, y_dev, &dm));
    // f32 recovery next to the minimum: |Δx| ~ sqrt(ulp(y) / GELU''), see tests/gradients.rs.
    assert_close("GELU dx from output", &d, &h, 1e-4);
}

#[test]
fn layer_norm_is_within_bounds_of_the_host_and_guards_small_gamma() {
    let Some(dev) = wgpu() else { return };
    let (rows, cols) = (37, 200);
    let x: Vec<f32> = inputs(rows * cols, 3.0, 31)
        .iter()
        .map(|v| v + 5.0)
        .collect();
    let mut gamma: Vec<f32> = inputs(cols, 0.5, 32).iter().map(|v| v + 1.0).collect();
    // Three columns below the guard: their x̂ is saved, not recovered.
    gamma[3] = 0.0;
    gamma[50] = 1e-4;
    gamma[199] = -5e-4;
    let beta = inputs(cols, 1.0, 33);
    let dy = inputs(rows * cols, 1.0, 34);
    let run = |gamma: &[f32]| {
        let (hx, dx) = both(&x, [rows, cols], &dev);
        let (hg, dg) = both(gamma, [cols], &dev);
        let (hb, db) = both(&beta, [cols], &dev);
        let (hy, hs) = Cpu::layer_norm_forward(hx, hg.clone(), hb.clone(), 1e-5);
        let (yd, ds) = Cube::layer_norm_forward(dx, dg.clone(), db.clone(), 1e-5);
        let hyv = host_values(hy.clone());
        let dyv = device_values(yd.clone());
        let (hdy, ddy) = both(&dy, [rows, cols], &dev);
        let (hdx, hdg, hdb) = Cpu::layer_norm_backward(hdy, hy, &hs, hg, hb);
        let (ddx, ddg, ddb) = Cube::layer_norm_backward(ddy, yd, &ds, dg, db);
        [
            (dyv, hyv),
            (device_values(ddx), host_values(hdx)),
            (device_values(ddg), host_values(hdg)),
            (device_values(ddb), host_values(hdb)),
        ]
    };
    let [y, dx, dg, db] = run(&gamma);
    assert_close("LayerNorm output", &y.0, &y.1, 2e-6);
    assert_close("LayerNorm dx", &dx.0, &dx.1, 2e-6);
    assert_close("LayerNorm dγ", &dg.0, &dg.1, 5e-6);
    assert_close("LayerNorm dβ", &db.0, &db.1, 2e-6);
    // More guarded columns than the device saves: NaN gradients (reported, not silent).
    let mut small = gamma.clone();
    for g in small.iter_mut().take(20) {
        *g = 0.0;
    }
    let [_, dx, dg, _] = run(&small);
    assert!(dx.0.iter().all(|v| v.is_nan()), "device dx past the cap");
    assert!(dx.1.iter().all(|v| v.is_finite()), "host dx");
    assert!(dg.0[..20].iter().skip(8).all(|v| v.is_nan()));
}

#[test]
fn dropout_mask_is_the_hosts_bit_for_bit_and_softmax_within_bounds() {
    let Some(dev) = wgpu() else { return };
    for (rows, cols, p, stream) in [
        (8, 128, 0.1, RandomStream::new(7, 3, 11)),
        (
            13,
            77,
            0.5,
            RandomStream::new(u64::MAX, 1 << 40, u64::MAX - 3),
        ),
        (5, 33, 0.0, RandomStream::new(0, 0, 0)),
        (3, 1, 0.9, RandomStream::new(1, 2, 3)),
    ] {
        let n = rows * cols;
        let x = inputs(n, 3.0, 41 + n as u64);
        let (hx, dx) = both(&x, [rows, cols], &dev);
        let (ho, hs, hm) = Cpu::softmax_dropout_forward(hx, p, &stream);
        let (dout, ds, dm) = Cube::softmax_dropout_forward(dx, p, &stream);
        assert_eq!(
            Cube::read_mask(&dm, n),
            Cpu::read_mask(&hm, n),
            "keep mask {rows}x{cols} p {p}"
        );
        let hsv = host_values(hs.clone());
        assert_close("softmax", &device_values(ds), &hsv, 1e-6);
        assert_close(
            "softmax·dropout output",
            &device_values(dout),
            &host_values(ho),
            1e-6,
        );
        // From the host's softmax the recomputed dropout output is bit for bit the host's.
        let (_, s_dev) = both(&hsv, [rows, cols], &dev);
        let d = device_values(Cube::dropout_apply(s_dev.clone(), &dm, p));
        let h = host_values(Cpu::dropout_apply(hs.clone(), &hm, p));
        assert_bits_equal("dropout output", &d, &h);
        let g = inputs(n, 1.0, 43);
        let (hg, dg) = both(&g, [rows, cols], &dev);
        let h = host_values(Cpu::softmax_dropout_backward(hg, hs, &hm, p));
        let d = device_values(Cube::softmax_dropout_backward(dg, s_dev, &dm, p));
        assert_close("softmax·dropout dx", &d, &h, 1e-6);
    }
}

#[test]
fn the_operators_read_nothing_into_host_memory_on_the_device() {
    let Some(dev) = wgpu() else { return };
    let dev = dev.autodiff();
    let mut rng = Rng::new(51);
    let x = rng.tensor([4, 16, 64], 1.0, &dev).require_grad();
    let v = rng.tensor([4, 16, 64], 1.0, &dev).require_grad();
    let gamma = rng.tensor([64], 1.0, &dev).require_grad();
    let beta = rng.tensor([64], 1.0, &dev).require_grad();
    let w = rng.tensor([64, 32], 1.0, &dev).require_grad();
    let table =
        Arc::new(Table::solve(Activation::Silu, 2, Weight::STANDARD, Grid::default()).unwrap());
    let stream = RandomStream::new(1, 2, 3);
    let count = |f: &dyn Fn()| {
        let before = host_reads();
        f();
        host_reads() - before
    };
    let reads = count(&|| {
        let h = layer_norm_from_output(x.clone(), gamma.clone(), beta.clone(), 1e-5);
        let h = gelu_from_output(h);
        let h = few_bit(h, FewBit::Silu, &table);
        let scores = h.clone().matmul(h.clone().swap_dims(1, 2));
        let a = softmax_dropout(scores.clone(), 0.1, &stream);
        let b = softmax_dropout_matmul(scores, v.clone(), 0.1, &stream);
        let c = lpmm_act_burn::matmul_compressed(h, w.clone(), 4, &stream);
        let loss = a.sum() + b.sum() + c.sum();
        let grads = loss.backward();
        // The gradients exist (reading them is the test's, after the count).
        assert!(x.grad(&grads).is_some() && gamma.grad(&grads).is_some());
        assert!(w.grad(&grads).is_some());
    });
    assert_eq!(reads, 0, "host reads by the operators on the device");
    // The counter counts: the same on burn-flex reads every operator's tensors.
    let flex = Device::flex().autodiff();
    let xf = Tensor::<3>::from_data(x.to_data(), &flex).require_grad();
    let reads = count(&|| {
        let _ = gelu_from_output(xf.clone()).sum().backward();
    });
    assert!(reads >= 2, "burn-flex reads counted: {reads}");
}

#[test]
fn compression_is_the_hosts_bit_for_bit() {
    let Some(dev) = wgpu() else { return };
    for (bits, block, n, stream) in [
        (2, 256, 1000, RandomStream::new(1, 2, 3)),
        (4, 32, 4096 + 31, RandomStream::new(u64::MAX, 7, u64::MAX)),
        (8, 256, 777, RandomStream::new(0, 0, 0)),
        (4, 1024, 5000, RandomStream::new(9, 9, 9)),
    ] {
        let mut x = inputs(n, 2.0, 61 + n as u64);
        // An all-zero block and values exactly on the map's levels (ties).
        x[..block.min(n)].iter_mut().for_each(|v| *v = 0.0);
        // In the second block (or what of it fits), the block's absmax times every level.
        let side = (1i32 << (bits - 1)) - 1;
        let second = &mut x[block.min(n)..(2 * block).min(n)];
        if let Some((first, rest)) = second.split_first_mut() {
            *first = 3.0;
            for (v, k) in rest.iter_mut().zip(-side..=side) {
                *v = 3.0 * (k as f32 / side as f32);
            }
        }
        let block = lpmm_act_burn::BlockSize::new(block).unwrap();
        let (hx, dx) = both(&x, [n], &dev);
        let hc = Cpu::compress(hx, bits, block, &stream);
        let dc = Cube::compress(dx, bits, block, &stream);
        // The same codes and scales; the device rounds the packed codes up to whole u32 words.
        assert!(Cube::compressed_bytes(&dc) >= Cpu::compressed_bytes(&hc));
        assert!(Cube::compressed_bytes(&dc) < Cpu::compressed_bytes(&hc) + 4 * bits as usize);
        let h = host_values(Cpu::decompress(&hc));
        let d = device_values(Cube::decompress(&dc));
        assert_bits_equal(
            &format!("{bits}-bit compression, block {}", block.get()),
            &d,
            &h,
        );
        // The rounding is stochastic, not nearest: some element is not at its nearest level.
        let other = Cube::compress(
            both(&x, [n], &dev).1,
            bits,
            block,
            &RandomStream::new(5, 5, 5),
        );
        assert_ne!(
            device_values(Cube::decompress(&other)),
            d,
            "another stream rounds otherwise"
        );
    }
}

/// Device bytes in use on `device` (cubecl's memory report).
fn device_bytes(device: &Device) -> u64 {
    match device.clone().inner().as_dispatch() {
        burn_dispatch::DispatchDevice::Cube(d) => {
            d.client()
                .memory_report(burn_cubecl::cubecl::MemoryScope::Device)
                .usage()
                .bytes_in_use
        }
        other => panic!("not a cubecl device: {other:?}"),
    }
}

#[test]
fn the_block_holds_less_device_memory_after_its_forward_pass() {
    use lpmm_act_burn::block::{Block, BlockConfig, Variant};
    let Some(dev) = wgpu() else { return };
    let dev = dev.autodiff();
    let cfg = BlockConfig::small();
    let block = Block::new(cfg, &dev, 1);
    let mut rng = Rng::new(2);
    let x = rng.tensor([cfg.batch, cfg.seq, cfg.d_model], 1.0, &dev);
    let held = |variant: Variant| {
        dev.sync().unwrap();
        let base = device_bytes(&dev);
        let reads = host_reads();
        let y = block.forward(x.clone(), variant, RandomStream::new(1, 0, 0));
        let loss = (y.clone() * y).mean();
        dev.sync().unwrap();
        let held = device_bytes(&dev) - base;
        let grads = loss.backward();
        dev.sync().unwrap();
        drop(grads);
        (held, host_reads() - reads)
    };
    let (base, _) = held(Variant::Baseline);
    for v in Variant::ALL.into_iter().skip(1) {
        let (h, reads) = held(v);
        eprintln!("{v:?}: {h} B held after the forward pass, baseline {base} B");
        assert_eq!(reads, 0, "{v:?}: host reads");
        assert!(h < base, "{v:?}: {h} >= baseline {base}");
    }
}
