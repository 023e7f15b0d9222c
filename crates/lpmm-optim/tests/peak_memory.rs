//! The memory accounting is what the process really holds: the peak resident memory an
//! optimizer of 100M parameters (8-bit AdamW, bf16 parameters and gradient accumulator) adds
//! during construction, accumulation and steps equals `memory_report().total()` within 5%.
//! Linux only (reads `/proc/self/status`); its own test binary, so nothing else shares the
//! process. `cargo xtask bench` quotes the line it prints.

#[cfg(target_os = "linux")]
fn status_kib(field: &str) -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(target_os = "linux")]
#[test]
fn peak_resident_memory_equals_the_accounting() {
    use lpmm_optim::{Optimizer, OptimizerOptions, presets};
    const N: usize = 100_000_000;
    // One buffer serves as initial values and gradient; it exists before the baseline.
    let x: Vec<f32> = (0..N)
        .map(|i| ((i % 2001) as f32 - 1000.0) * 1e-4)
        .collect();
    // Reset the peak to the current resident size (Linux >= 4.0).
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let before = status_kib("VmHWM:").expect("VmHWM") * 1024;
    let rss_before = status_kib("VmRSS:").expect("VmRSS") * 1024;
    let mut opt = Optimizer::new(OptimizerOptions::default()).unwrap();
    let g = opt.add_group(presets::adamw_8bit_bf16(1e-3)).unwrap();
    let id = opt.add_param("w", &[N], &x, g).unwrap();
    for _ in 0..3 {
        opt.accumulate(id, &x).unwrap();
        opt.step(lpmm_optim::Accumulated).unwrap();
    }
    let accounted = opt.memory_report().total();
    let (peak, baseline) = if reset {
        (status_kib("VmHWM:").expect("VmHWM") * 1024, before)
    } else {
        // No peak reset available: the resident size now, which bounds the peak from below.
        (status_kib("VmRSS:").expect("VmRSS") * 1024, rss_before)
    };
    let growth = peak.saturating_sub(baseline);
    let ratio = growth as f64 / accounted as f64;
    println!(
        "peak_memory {{\"params\": {N}, \"accounted_bytes\": {accounted}, \"peak_growth_bytes\": {growth}, \"ratio\": {ratio:.4}, \"peak_reset\": {reset}}}"
    );
    assert!(
        (ratio - 1.0).abs() <= 0.05,
        "peak resident growth {growth} B vs accounted {accounted} B (ratio {ratio:.4})"
    );
}
