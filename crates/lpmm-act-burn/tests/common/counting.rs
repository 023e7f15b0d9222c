//! A counting global allocator (current and peak live heap bytes) and the measurement of one
//! training step of the block under it. Shared by `tests/peak_memory.rs` and
//! `examples/block_memory.rs` (each binary registers `Counting` as its `#[global_allocator]`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use lpmm_act_burn::RandomStream;
use lpmm_act_burn::block::{Block, Variant};

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting the bytes it hands out.
pub struct Counting;

fn grew(n: usize) {
    let now = CURRENT.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

fn shrank(n: usize) {
    CURRENT.fetch_sub(n, Ordering::Relaxed);
}

// SAFETY: every method forwards to `System` with the caller's arguments, so `System`'s
// guarantees carry over unchanged; the counters are only bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract for `layout`.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator (that is, by `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` was allocated by `System` with `layout`; the caller upholds `realloc`'s
        // contract for `new_size`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // Count the move as the new block appearing before the old one is released: the
            // peak includes both when the allocator has to copy.
            grew(new_size);
            shrank(layout.size());
        }
        p
    }
}

/// Live heap bytes now.
pub fn current() -> usize {
    CURRENT.load(Ordering::Relaxed)
}

/// Resets the peak to the current live bytes.
pub fn reset_peak() {
    PEAK.store(current(), Ordering::Relaxed);
}

/// The peak live bytes since the last reset.
pub fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// One step's memory and time.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    /// Bytes the graph holds after the forward pass (loss computed, backward not started),
    /// above what was live before the step.
    pub held_after_forward: usize,
    /// Peak live bytes during forward + backward, above what was live before the step (median over
    /// the steps).
    pub peak: usize,
    /// Median wall time of a step, milliseconds.
    pub median_ms: f64,
    /// The loss of the first measured step.
    pub loss: f32,
}

/// One forward + backward step, returning `(held after forward, peak, loss)` above the bytes live
/// at its start.
fn step(
    block: &Block,
    x: &burn_tensor::Tensor<3>,
    target: &burn_tensor::Tensor<3>,
    variant: Variant,
    stream: RandomStream,
) -> (usize, usize, f32) {
    let base = current();
    reset_peak();
    let out = block.forward(x.clone(), variant, stream);
    let diff = out - target.clone();
    let loss = (diff.clone() * diff).mean();
    let held = current().saturating_sub(base);
    let grads = loss.backward();
    let sq = block.grad_square_sum(&grads);
    assert!(
        sq.is_finite() && sq > 0.0,
        "gradients are finite and nonzero"
    );
    let peak = peak().saturating_sub(base);
    drop(grads);
    (held, peak, loss.into_scalar::<f32>())
}

/// `steps` steps of `variant` (after one warm-up step): the median of each quantity.
pub fn measure(
    block: &Block,
    x: &burn_tensor::Tensor<3>,
    target: &burn_tensor::Tensor<3>,
    variant: Variant,
    steps: usize,
) -> Measured {
    assert!(steps > 0, "at least one step");
    let stream = |i: u64| RandomStream::new(7, 1, i);
    step(block, x, target, variant, stream(0));
    let (mut times, mut held, mut peaks) = (Vec::new(), Vec::new(), Vec::new());
    let mut loss = 0.0;
    for i in 0..steps {
        let t = Instant::now();
        let (h, p, l) = step(block, x, target, variant, stream(i as u64 + 1));
        times.push(t.elapsed().as_secs_f64() * 1e3);
        held.push(h);
        peaks.push(p);
        if i == 0 {
            loss = l;
        }
    }
    times.sort_by(f64::total_cmp);
    held.sort_unstable();
    peaks.sort_unstable();
    Measured {
        held_after_forward: held[steps / 2],
        peak: peaks[steps / 2],
        median_ms: times[steps / 2],
        loss,
    }
}
