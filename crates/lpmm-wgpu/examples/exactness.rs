//! Does this adapter give the CPU's bits? Prints the adapter, its float behaviour as
//! `Wgpu::new`'s probe found it (fused `fma`, correctly rounded division and `sqrt`, subnormals
//! kept), then steps the conformance suite's presets (`lpmm_optim::testing::preset_cases`) 4
//! times on the adapter and on the CPU reference from the same inputs and prints, per preset,
//! "bit-exact" or the first element that differs (GPU against CPU), with the seconds since the
//! start (the first preset's include building the step's pipelines).
//!
//! ```text
//! cargo run --release -p lpmm-wgpu --example exactness [-- exact|software|driver-division]
//! ```
//!
//! The argument picks `WgpuOptions::arithmetic` (default `exact`). docs/BACKENDS.md
//! ("Bit-exactness") has its output on NVIDIA's Vulkan driver.

use lpmm_optim::{OptimizerOptions, testing};
use lpmm_wgpu::{Arithmetic, Wgpu, WgpuOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arithmetic = match std::env::args().nth(1).as_deref() {
        None | Some("exact") => Arithmetic::Exact,
        Some("software") => Arithmetic::Software,
        Some("driver-division") => Arithmetic::DriverDivision,
        Some(other) => {
            return Err(format!(
                "unknown arithmetic {other:?}: exact, software or driver-division"
            )
            .into());
        }
    };
    let start = std::time::Instant::now();
    let gpu = Wgpu::new(WgpuOptions::default().with_arithmetic(arithmetic))?;
    println!("adapter: {:?}", gpu.adapter_info());
    println!("float behaviour: {:?}", gpu.float_behaviour());
    println!(
        "arithmetic: {arithmetic:?} (the CPU's bits expected: {})",
        gpu.float_behaviour().bit_exact_with(arithmetic)
    );
    // The comparison reports the first difference by panicking; print it instead.
    std::panic::set_hook(Box::new(|_| {}));
    for (name, config) in testing::preset_cases() {
        let compared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            testing::compare(&gpu, name, config, OptimizerOptions::default(), 4)
        }));
        let at = start.elapsed().as_secs_f64();
        match compared {
            Ok(()) => println!("{name}: bit-exact ({at:.1} s)"),
            Err(e) => {
                let why = e
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| e.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)");
                println!("{name}: DIFFERS ({at:.1} s): {why}");
            }
        }
    }
    Ok(())
}
