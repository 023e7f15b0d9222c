//! The training comparison behind the README's main command
//! (`cargo run --release -p lpmm-candle-examples --example compare`): the two tasks and their
//! embedded data (`experiments`), the judging of each preset against its reference (`judge`),
//! the process-memory probe (`footprint`), and the examples that
//! run them (`examples/compare.rs`, `examples/char_lm.rs`). Results: docs/RESULTS.md. Not
//! published: lpmm-candle is the library.

pub mod device_memory;
pub mod experiments;
pub mod footprint;
pub mod gpt;
pub mod judge;
pub mod process;
