//! CUDA backend for lpmm-optim (cudarc, PTX built by xtask). Empty until the CUDA backend issue lands.
//!
//! This crate deliberately exposes no API yet (see docs/ARCHITECTURE.md).
