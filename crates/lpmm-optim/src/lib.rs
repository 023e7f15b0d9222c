//! The optimizer core: optimizers, state layouts, fused steps, checkpoints, memory accounting. Empty until the optimizer-core issue lands.
//!
//! This crate deliberately exposes no API yet (see docs/ARCHITECTURE.md).
