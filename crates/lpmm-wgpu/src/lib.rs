//! wgpu backend for lpmm-optim (compute shaders). Empty until the wgpu backend issue lands.
//!
//! This crate deliberately exposes no API yet (see docs/ARCHITECTURE.md).
