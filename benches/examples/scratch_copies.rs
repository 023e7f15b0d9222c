//! What stepping through chunk-sized scratch copies costs against stepping in place, with the
//! optimizer arithmetic held fixed: f32 AdamW (torch's arithmetic, as lpmm's `Adam` computes it)
//! over `params` parameters on all threads (rayon, pieces of 2^18 elements), three ways:
//!
//! - `in_place`: one loop over the parameter, gradient and both moments;
//! - `scratch_4096`: per chunk of 4096 (lpmm's `CHUNK`), copy the four into stack buffers, step
//!   the buffers, copy the three results back (how lpmm's fused step moves an f32 slot);
//! - `scratch_256`: the same with chunks of 256.
//!
//! The three give the same bits (checked before timing). The runs alternate; the best and the
//! median of `reps` runs of `steps` steps are printed, in ns per parameter and step.
//!
//! `cargo run --release -p lpmm-benches --example scratch_copies -- [params] [steps] [reps]`

use rayon::prelude::*;
use std::time::Instant;

const PIECE: usize = 1 << 18;

/// torch's AdamW constants for lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, step 1.
#[derive(Clone, Copy)]
struct Consts {
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    beta2: f32,
    bias_correction2_sqrt: f32,
    eps: f32,
    decay: f32,
    neg_step_size: f32,
}

const C: Consts = Consts {
    one_minus_beta1: 0.1,
    one_minus_beta2: 0.001,
    beta2: 0.999,
    bias_correction2_sqrt: 0.031_622_775,
    eps: 1e-8,
    decay: 1.0 - 1e-5,
    neg_step_size: -1e-2,
};

lpmm_formats::multiversion! {
    /// One AdamW step of every element of the four slices, in place.
    fn adamw(g: &[f32], p: &mut [f32], m: &mut [f32], v: &mut [f32]) {
        let n = g.len().min(p.len()).min(m.len()).min(v.len());
        let (g, p, m, v) = (&g[..n], &mut p[..n], &mut m[..n], &mut v[..n]);
        for i in 0..n {
            let gi = g[i];
            let mi = (gi - m[i]).mul_add(C.one_minus_beta1, m[i]);
            let vi = (C.one_minus_beta2 * gi).mul_add(gi, v[i] * C.beta2);
            let denom = vi.sqrt() / C.bias_correction2_sqrt + C.eps;
            m[i] = mi;
            v[i] = vi;
            p[i] = p[i] * C.decay + C.neg_step_size * mi / denom;
        }
    }
}

/// The four buffers of one model.
struct Model {
    g: Vec<f32>,
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

impl Model {
    fn new(n: usize) -> Self {
        Model {
            g: (0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-5).collect(),
            p: (0..n).map(|i| ((i % 1000) as f32 - 500.0) * 1e-4).collect(),
            m: vec![0.0; n],
            v: vec![0.0; n],
        }
    }

    fn bits(&self) -> Vec<u32> {
        [&self.p, &self.m, &self.v]
            .iter()
            .flat_map(|s| s.iter().map(|x| x.to_bits()))
            .collect()
    }
}

fn in_place(model: &mut Model) {
    let Model { g, p, m, v } = model;
    p.par_chunks_mut(PIECE)
        .zip(m.par_chunks_mut(PIECE))
        .zip(v.par_chunks_mut(PIECE))
        .zip(g.par_chunks(PIECE))
        .for_each(|(((p, m), v), g)| adamw(g, p, m, v));
}

fn scratch<const CHUNK: usize>(model: &mut Model) {
    let Model { g, p, m, v } = model;
    p.par_chunks_mut(PIECE)
        .zip(m.par_chunks_mut(PIECE))
        .zip(v.par_chunks_mut(PIECE))
        .zip(g.par_chunks(PIECE))
        .for_each(|(((p, m), v), g)| {
            let mut s = [[0f32; CHUNK]; 4];
            for at in (0..p.len()).step_by(CHUNK) {
                let n = CHUNK.min(p.len() - at);
                let [sg, sp, sm, sv] = &mut s;
                sg[..n].copy_from_slice(&g[at..at + n]);
                sp[..n].copy_from_slice(&p[at..at + n]);
                sm[..n].copy_from_slice(&m[at..at + n]);
                sv[..n].copy_from_slice(&v[at..at + n]);
                adamw(&sg[..n], &mut sp[..n], &mut sm[..n], &mut sv[..n]);
                p[at..at + n].copy_from_slice(&sp[..n]);
                m[at..at + n].copy_from_slice(&sm[..n]);
                v[at..at + n].copy_from_slice(&sv[..n]);
            }
        });
}

type Variant = (&'static str, fn(&mut Model));

fn main() -> Result<(), String> {
    let arg = |k: usize, default: usize| -> Result<usize, String> {
        std::env::args().nth(k).map_or(Ok(default), |s| {
            s.parse().map_err(|e| format!("argument {k} ({s}): {e}"))
        })
    };
    let (n, steps, reps) = (arg(1, 1 << 24)?, arg(2, 10)?.max(1), arg(3, 5)?.max(1));
    let variants: [Variant; 3] = [
        ("in_place", in_place),
        ("scratch_4096", scratch::<4096>),
        ("scratch_256", scratch::<256>),
    ];
    // The same bits every way: the comparison is of data movement alone.
    let check = n.min(1 << 20);
    let want = {
        let mut model = Model::new(check);
        in_place(&mut model);
        model.bits()
    };
    for (name, step) in &variants[1..] {
        let mut model = Model::new(check);
        step(&mut model);
        if model.bits() != want {
            return Err(format!("{name} computed other bits than in_place"));
        }
    }
    let mut model = Model::new(n);
    let mut times = vec![Vec::new(); variants.len()];
    for _ in 0..reps {
        for ((_, step), t) in variants.iter().zip(&mut times) {
            step(&mut model); // warm
            let start = Instant::now();
            for _ in 0..steps {
                step(&mut model);
            }
            t.push(start.elapsed().as_secs_f64() * 1e9 / (steps * n) as f64);
        }
    }
    println!(
        "{n} params, {} threads, {steps} steps x {reps} runs, ns/param/step (best / median):",
        rayon::current_num_threads()
    );
    for ((name, _), t) in variants.iter().zip(&mut times) {
        t.sort_by(f64::total_cmp);
        println!("  {name:<13} {:.3} / {:.3}", t[0], t[t.len() / 2]);
    }
    Ok(())
}
