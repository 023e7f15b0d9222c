//! The code-map kernels alone, at every SIMD level this CPU has: nearest rounding onto
//! bitsandbytes' signed and unsigned 8-bit dynamic maps (an 8-bit AdamW step's two encodes),
//! decoding from them, and stochastic rounding onto the signed 8-bit linear map and decoding from
//! it (LPMM-SGDM's), over 64K roughly normal values in blocks of 256 (or the block size given as
//! the argument: LPMM-SGDM's is 64), each block divided by its absmax. Prints the best of nine
//! timings of 200 passes, in ns per element, one thread.
//!
//! ```sh
//! cargo run --release -p lpmm-formats --example code_maps
//! cargo run --release -p lpmm-formats --example code_maps -- 64
//! ```

use lpmm_formats::CodeMap;
use lpmm_formats::simd::{self, Level};
use std::time::Instant;

fn best(n: usize, mut f: impl FnMut()) -> f64 {
    (0..9)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..200 {
                f();
            }
            t.elapsed().as_secs_f64() * 1e9 / (200.0 * n as f64)
        })
        .fold(f64::MAX, f64::min)
}

fn absmax(values: &[f32], block: usize) -> Vec<f32> {
    values
        .chunks(block)
        .map(|c| c.iter().fold(0f32, |m, x| m.max(x.abs())))
        .collect()
}

fn main() -> Result<(), lpmm_formats::FormatError> {
    let block: usize = match std::env::args().nth(1) {
        Some(a) => match a.parse() {
            Ok(b) if b > 0 => b,
            _ => {
                eprintln!("usage: code_maps [block size > 0]");
                std::process::exit(2);
            }
        },
        None => 256,
    };
    let n = 1 << 16;
    // xorshift64: the same inputs every run.
    let mut state = 0x1234_5678_9ABC_DEF0u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    // The sum of four uniforms: roughly normal, like a moment's values in a block.
    let xs: Vec<f32> = (0..n)
        .map(|_| {
            (0..4)
                .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                .sum()
        })
        .collect();
    let squares: Vec<f32> = xs.iter().map(|x| x * x).collect();
    let bits: Vec<u32> = (0..n).map(|_| next() as u32).collect();
    let (x_max, sq_max) = (absmax(&xs, block), absmax(&squares, block));
    let signed = CodeMap::dynamic(true, 8)?;
    let unsigned = CodeMap::dynamic(false, 8)?;
    let linear = CodeMap::linear_signed(8)?;
    let mut codes = vec![0u8; n];
    let mut out = vec![0f32; n];
    let levels: Vec<Level> = Level::ALL
        .into_iter()
        .filter(|&l| l <= simd::detected())
        .rev()
        .collect();
    let names: Vec<&str> = levels.iter().map(|l| l.name()).collect();
    println!(
        "ns per element, one thread; CPU levels {}",
        names.join(", ")
    );
    println!("| kernel | {} |", names.join(" | "));
    println!("|---|{}", "---|".repeat(levels.len()));
    // Each decode reads the codes the encode before it wrote.
    type Kernel<'a> = Box<dyn FnMut(&mut [u8], &mut [f32]) + 'a>;
    let kernels: Vec<(&str, Kernel)> = vec![
        (
            "nearest, unsigned dynamic",
            Box::new(|c, _| unsigned.nearest_blocks(&squares, &sq_max, block, c)),
        ),
        (
            "nearest, signed dynamic",
            Box::new(|c, _| signed.nearest_blocks(&xs, &x_max, block, c)),
        ),
        (
            "decode, signed dynamic",
            Box::new(|c, o| signed.decode_blocks(c, &x_max, block, o)),
        ),
        (
            "stochastic, signed linear",
            Box::new(|c, _| linear.stochastic_blocks(&xs, &x_max, block, &bits, c)),
        ),
        (
            "decode, signed linear",
            Box::new(|c, o| linear.decode_blocks(c, &x_max, block, o)),
        ),
    ];
    for (name, mut kernel) in kernels {
        let cells: Vec<String> = levels
            .iter()
            .map(|&level| {
                simd::force(Some(level));
                kernel(&mut codes, &mut out); // warm-up
                format!("{:.3}", best(n, || kernel(&mut codes, &mut out)))
            })
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    simd::force(None);
    Ok(())
}
