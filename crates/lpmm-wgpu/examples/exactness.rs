//! Does this adapter give the CPU's bits? Prints the adapter, its float behaviour as
//! `Wgpu::new`'s probe found it (fused `fma`, correctly rounded division and `sqrt`, subnormals
//! kept), then steps the conformance suite's presets (`lpmm_optim::testing::preset_cases`) 4
//! times on the adapter and on the CPU reference from the same inputs and prints, per preset,
//! "bit-exact" or the first element that differs (GPU against CPU).
//!
//! ```text
//! cargo run --release -p lpmm-wgpu --example exactness
//! ```
//!
//! docs/BACKENDS.md ("Bit-exactness") has its output on NVIDIA's Vulkan driver.

use lpmm_optim::{OptimizerOptions, testing};

fn main() -> Result<(), lpmm_wgpu::WgpuError> {
    let gpu = lpmm_wgpu::Wgpu::new(Default::default())?;
    println!("adapter: {:?}", gpu.adapter_info());
    println!("float behaviour: {:?}", gpu.float_behaviour());
    // The comparison reports the first difference by panicking; print it instead.
    std::panic::set_hook(Box::new(|_| {}));
    for (name, config) in testing::preset_cases() {
        let compared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            testing::compare(&gpu, name, config, OptimizerOptions::default(), 4)
        }));
        match compared {
            Ok(()) => println!("{name}: bit-exact"),
            Err(e) => {
                let why = e
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| e.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)");
                println!("{name}: DIFFERS: {why}");
            }
        }
    }
    Ok(())
}
