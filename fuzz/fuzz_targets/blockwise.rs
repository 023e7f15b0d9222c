//! `Blockwise::quantize` on arbitrary bytes (map, block size, rounding and sign fix from the
//! first two bytes, f32 values from the rest): a negative value into a map without negative values,
//! then a non-finite value, refused naming its first element; otherwise exact block scales and decoded values within them (`lpmm_optim::fuzzing::blockwise`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = lpmm_optim::fuzzing::blockwise(data);
});
