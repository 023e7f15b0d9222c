//! Does this adapter give the CPU's bits? Prints the adapter, its float behaviour as
//! `Wgpu::new`'s probe found it (fused `fma`, correctly rounded division and `sqrt`, subnormals
//! kept), then steps nine presets 4 times on the adapter and on the CPU reference from the same
//! inputs (lpmm-optim's conformance comparison) and prints, per preset, "bit-exact" or the first
//! element that differs (GPU against CPU).
//!
//! ```text
//! cargo run --release -p lpmm-wgpu --example exactness
//! ```
//!
//! docs/BACKENDS.md ("Bit-exactness") has its output on NVIDIA's Vulkan driver.

use lpmm_optim::{Hyper, OptimizerOptions, presets, testing};

fn main() -> Result<(), lpmm_wgpu::WgpuError> {
    let gpu = lpmm_wgpu::Wgpu::new(Default::default())?;
    println!("adapter: {:?}", gpu.adapter_info());
    println!("float behaviour: {:?}", gpu.float_behaviour());
    let cases = [
        ("sgdm f32", presets::sgdm_f32(0.05, 0.9).build()),
        ("lpmm sgdm", presets::lpmm_sgdm(0.05, 0.9).build()),
        ("adamw f32", presets::adamw_f32(1e-3).build()),
        ("adamw 8-bit bf16", presets::adamw_8bit_bf16(1e-3).build()),
        (
            "adamw 8-bit bf16 sr",
            presets::adamw_8bit_bf16_sr(1e-3).build(),
        ),
        ("adamw 4-bit split", presets::adamw_4bit_split(1e-3).build()),
        (
            "bf16 nearest lion",
            presets::bf16_nearest(Hyper::lion(1e-4)).build(),
        ),
        ("adafactor f32", presets::adafactor_f32().build()),
        ("came f32", presets::came_f32(2e-4).build()),
    ];
    // The comparison reports the first difference by panicking; print it instead.
    std::panic::set_hook(Box::new(|_| {}));
    for (name, config) in cases {
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
