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
    common::configure(&mut group);
    memcpy_reference(&mut group, "quant");
    describe("quant", "random_bits", 4.0);
    group.throughput(Throughput::Elements(N as u64));
    // The cost of the random words stochastic rounding draws (one u32 per element).
    let mut words = vec![0u32; N];
    group.bench_function("random_bits", |b| {
        b.iter(|| RandomStream::new(1, 2, 3).fill(0, black_box(&mut words)))
    });
    // The draws stochastic rounding uses (16 bits each, two per word), a span of 256 elements
    // at a time into one cache-resident buffer, as the quantizers and the optimizer's stores
    // take them; beside it whole words the same way (the rounding's random bits before draws).
    describe("quant", "random_draws_span", 4.0);
    group.bench_function("random_draws_span", |b| {
        b.iter(|| {
            let mut draws = RandomStream::new(1, 2, 3).draws_at(0);
            let mut span = [0u32; 256];
            for _ in 0..N / 256 {
                draws.fill(black_box(&mut span));
            }
        })
    });
    describe("quant", "random_words_span", 4.0);
    group.bench_function("random_words_span", |b| {
        b.iter(|| {
            let mut bits = RandomStream::new(1, 2, 3).at(0);
            let mut span = [0u32; 256];
            for _ in 0..N / 256 {
                bits.fill(black_box(&mut span));
            }
        })
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
