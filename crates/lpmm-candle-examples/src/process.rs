//! Process settings the examples make before they train (one copy for `compare` and `char_lm`).

/// Thread settings for candle 0.11's CPU backend, unless the environment gives its own:
/// `CANDLE_NUM_THREADS=1` runs element-wise operations on the calling thread (candle's pool for
/// them spins while it waits; on a 2-core machine with anything else running, that made a step
/// up to 5 times slower), and `RAYON_NUM_THREADS` (the matrix products' threads, every core)
/// spares candle from reading /proc/cpuinfo for it before every matrix product.
///
/// # Safety
///
/// Sets environment variables: call it first thing in `main`, before any other thread exists,
/// so that nothing reads the environment concurrently.
pub unsafe fn candle_threads() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (name, value) in [
        ("CANDLE_NUM_THREADS", "1".to_string()),
        ("RAYON_NUM_THREADS", cores.to_string()),
    ] {
        if std::env::var_os(name).is_none() {
            // SAFETY: the caller guarantees that no other thread exists (this function's
            // contract).
            unsafe { std::env::set_var(name, value) };
        }
    }
}

/// Keeps freed memory in the process (glibc): candle allocates and frees a buffer for every
/// tensor operation, and with glibc's defaults large ones are returned to the kernel and faulted
/// in again on every step (about a third of the step time on 2 cores). Not for the memory
/// probes, which measure a process with glibc's defaults. A no-op elsewhere than glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        // SAFETY: mallopt only changes allocator thresholds, under glibc's arena lock (callable
        // from any thread at any time), with values glibc accepts (the mmap threshold at its
        // 32 MiB maximum).
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 32 << 20);
            mallopt(M_TRIM_THRESHOLD, 1 << 30);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn keeping_freed_memory_leaves_allocation_working() {
        super::keep_freed_memory();
        // Allocations on both sides of the new mmap threshold still work after mallopt.
        let small = vec![1u8; 1 << 20];
        let large = vec![2u8; 64 << 20];
        assert_eq!(small.iter().map(|&b| b as usize).sum::<usize>(), 1 << 20);
        assert_eq!(large[(64 << 20) - 1], 2);
    }
}
