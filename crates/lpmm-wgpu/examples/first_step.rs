//! How long the first step takes on this adapter, pipeline builds included: the backend's
//! creation (its arithmetic probe), then for each preset a parameter of 2^20 elements, one
//! accumulated gradient and two steps, the first of which builds the step's pipelines. Prints
//! the seconds of each stage, then one JSON line.
//!
//! ```text
//! cargo run --release -p lpmm-wgpu --example first_step [-- generic]
//! ```
//!
//! `generic` turns the specialized pipelines off (`WgpuOptions::with_specialized(false)`): every
//! step is the generic `lpmm_step`, whose pipeline holds the code of every rule and format. The
//! driver's own shader cache makes a second run faster: switch it off for a cold figure (Mesa:
//! `MESA_SHADER_CACHE_DISABLE=true`; NVIDIA: `__GL_SHADER_DISK_CACHE=0`).

use std::time::Instant;

use lpmm_optim::{Accumulated, Optimizer, OptimizerOptions, presets};
use lpmm_wgpu::{Wgpu, WgpuOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let specialized = match std::env::args().nth(1).as_deref() {
        None | Some("specialized") => true,
        Some("generic") => false,
        Some(other) => return Err(format!("unknown mode {other:?}: specialized or generic").into()),
    };
    let start = Instant::now();
    let backend = Wgpu::new(WgpuOptions::default().with_specialized(specialized))?;
    let created = start.elapsed().as_secs_f64();
    let info = backend.adapter_info();
    println!(
        "adapter: {} ({:?}, driver {} {}); {} pipelines; backend created in {created:.3} s",
        info.name,
        info.backend,
        info.driver,
        info.driver_info,
        if specialized {
            "specialized"
        } else {
            "generic"
        }
    );
    let n = 1 << 20;
    let init: Vec<f32> = (0..n).map(|i| ((i % 977) as f32 - 488.0) * 1e-4).collect();
    let grad: Vec<f32> = (0..n).map(|i| ((i % 631) as f32 - 315.0) * 1e-5).collect();
    let mut rows = Vec::new();
    for (name, config) in [
        ("adamw_8bit_bf16", presets::adamw_8bit_bf16(1e-3).build()),
        ("adamw_f32", presets::adamw_f32(1e-3).build()),
    ] {
        let t0 = Instant::now();
        let mut opt = Optimizer::with_backend(backend.clone(), OptimizerOptions::default())?;
        opt.add_group(config)?;
        let w = opt.add_param("w", &[n], &init, 0)?;
        opt.accumulate(w, &grad)?;
        let added = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        opt.step(Accumulated)?;
        let first = t1.elapsed().as_secs_f64();
        opt.accumulate(w, &grad)?;
        let t2 = Instant::now();
        opt.step(Accumulated)?;
        let second = t2.elapsed().as_secs_f64();
        println!(
            "{name:16} add+accumulate {added:8.3} s, first step {first:8.3} s, second step {second:8.3} s; {:.3} s since start",
            start.elapsed().as_secs_f64()
        );
        rows.push(format!(
            "{{\"preset\":\"{name}\",\"add_s\":{added},\"first_step_s\":{first},\"second_step_s\":{second},\"since_start_s\":{}}}",
            start.elapsed().as_secs_f64()
        ));
    }
    println!(
        "{{\"adapter\":{:?},\"driver\":{:?},\"specialized\":{specialized},\"created_s\":{created},\"rows\":[{}]}}",
        info.name,
        format!("{} {}", info.driver, info.driver_info),
        rows.join(",")
    );
    Ok(())
}
