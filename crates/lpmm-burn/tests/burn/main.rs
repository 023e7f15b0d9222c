//! lpmm-burn's integration tests, in one test binary: each file is a module, so burn's stack is
//! compiled into and linked with one binary instead of one per file. `tests/example.rs` stays a
//! binary of its own: the memory example initialises burn's wgpu runtime on the default device
//! itself, and that failed in a process where `wgpu.rs` had initialised it already.

mod common;

mod cpu;
mod cuda;
mod linear;
mod muon;
mod processes;
mod tensor;
mod train;
mod wgpu;
