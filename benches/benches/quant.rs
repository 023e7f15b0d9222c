//! Block-wise quantize / dequantize over 16M elements (multi-threaded), with memcpy measured in
//! the same run as the reference.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use lpmm_formats::CodeMap;
use lpmm_quant::{BlockSize, Blockwise, QuantRounding, RandomStream};
use std::hint::black_box;

#[path = "common.rs"]
mod common;
use common::{N, data, describe, memcpy_reference};

fn blockwise(c: &mut Criterion) {
    let x = data(N);
    let maps = [
        ("dynamic8", CodeMap::dynamic(true, 8).unwrap()),
        ("dynamic4", CodeMap::dynamic(true, 4).unwrap()),
    ];
    let mut group = c.benchmark_group("quant");
    group.sample_size(10);
    memcpy_reference(&mut group, "quant");
    describe("quant", "random_bits", 4.0);
    group.throughput(Throughput::Elements(N as u64));
    // The cost of the random words stochastic rounding draws (one u32 per element).
    let mut words = vec![0u32; N];
    group.bench_function("random_bits", |b| {
        b.iter(|| RandomStream::new(1, 2, 3).fill(0, black_box(&mut words)))
    });
    for (name, map) in &maps {
        for block in [64usize, 256, 2048] {
            let q = Blockwise::new(map, BlockSize::new(block).unwrap());
            // f32 in, packed codes and one f32 scale per block out (or the reverse).
            let bytes = 4.0 + f64::from(map.bits()) / 8.0 + 4.0 / block as f64;
            for op in ["quantize", "quantize_sr", "dequantize"] {
                describe("quant", &format!("{op}_{name}/{block}"), bytes);
            }
            let mut codes = vec![0u8; q.codes_len(N)];
            let mut absmax = vec![0f32; q.scales_len(N)];
            let mut out = vec![0f32; N];
            group.bench_with_input(
                BenchmarkId::new(format!("quantize_{name}"), block),
                &block,
                |b, _| {
                    b.iter(|| {
                        q.quantize(
                            black_box(&x),
                            &mut codes,
                            &mut absmax,
                            QuantRounding::Nearest,
                        )
                        .unwrap()
                    })
                },
            );
            let sr = QuantRounding::Stochastic {
                stream: RandomStream::new(1, 2, 3),
                offset: 0,
            };
            group.bench_with_input(
                BenchmarkId::new(format!("quantize_sr_{name}"), block),
                &block,
                |b, _| {
                    b.iter(|| {
                        q.quantize(black_box(&x), &mut codes, &mut absmax, sr)
                            .unwrap()
                    })
                },
            );
            group.bench_with_input(
                BenchmarkId::new(format!("dequantize_{name}"), block),
                &block,
                |b, _| b.iter(|| q.dequantize(black_box(&codes), &absmax, &mut out).unwrap()),
            );
        }
    }
    group.finish();
}

criterion_group!(benches, blockwise);
criterion_main!(benches);
