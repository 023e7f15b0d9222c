//! A global allocator that counts live bytes and calls, for the tests that measure what the
//! optimizer allocates (each such test alone in its binary: no other test allocates while it
//! measures). Included with `#[path]`; the including file installs it as `#[global_allocator]`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};

pub struct Counting;

pub static LIVE: AtomicIsize = AtomicIsize::new(0);
pub static CALLS: AtomicUsize = AtomicUsize::new(0);
/// The largest `LIVE` seen since the last [`reset_peak`].
#[allow(dead_code)]
pub static PEAK: AtomicIsize = AtomicIsize::new(0);

/// Starts a new peak measurement at the current live size.
#[allow(dead_code)]
pub fn reset_peak() {
    PEAK.store(LIVE.load(Ordering::SeqCst), Ordering::SeqCst);
}

// SAFETY: every method forwards to the system allocator with the caller's own arguments, which
// upholds GlobalAlloc's contract; the counters are atomics and never affect the allocation.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live =
            LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst) + layout.size() as isize;
        PEAK.fetch_max(live, Ordering::SeqCst);
        CALLS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: forwarded unchanged; the caller guarantees a non-zero-size layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
        // SAFETY: `ptr` was allocated by `System` with `layout` (every allocation goes through
        // `alloc` or `realloc` above).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let delta = new_size as isize - layout.size() as isize;
        let live = LIVE.fetch_add(delta, Ordering::SeqCst) + delta;
        PEAK.fetch_max(live, Ordering::SeqCst);
        CALLS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: forwarded unchanged; `ptr` came from `System` with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
