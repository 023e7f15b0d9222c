//! The checkpoint loader on arbitrary bytes, as they are and resealed (the checksum recomputed):
//! never a panic; a file loads and survives save, load, save bit for bit, or is refused
//! (`lpmm_optim::fuzzing::checkpoint`). Seed corpus: `fuzz/corpus/checkpoint/`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = lpmm_optim::fuzzing::checkpoint(data);
});
