//! Sharded optimizer state across data-parallel ranks (ZeRO-1 and ZeRO-2), bit-identical to the
//! unsharded optimizer, over MPI (feature `mpi`) or NCCL (feature `nccl`), with checkpoints in
//! one canonical, unsharded layout ([docs/DISTRIBUTED.md]).
//!
//! ```
//! use lpmm_dist::{ParamDef, ShardOptions, ShardedOptimizer, Single};
//! use lpmm_optim::{OptimizerOptions, presets};
//!
//! let mut opt = ShardedOptimizer::new(
//!     Single,
//!     OptimizerOptions::default(),
//!     ShardOptions::default(),
//!     vec![presets::adamw_8bit_bf16(1e-3).build()],
//!     vec![ParamDef::new("w", &[64, 128], 0)],
//!     &[vec![0.01; 64 * 128]],
//! )?;
//! opt.step(&[&vec![1e-3; 64 * 128]])?;
//! assert_eq!(opt.params()[0].len(), 64 * 128);
//! # Ok::<(), lpmm_dist::DistError>(())
//! ```
//!
//! [docs/DISTRIBUTED.md]: https://github.com/lpmm-rs/lpmm/blob/main/docs/DISTRIBUTED.md

pub mod collective;
pub mod layout;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod sharded;
pub mod slots;

pub use collective::{Collective, Single, Threads};
pub use layout::{ParamSpec, Shard, ShardLayout, UNIT};
#[cfg(feature = "mpi")]
pub use mpi::Mpi;
#[cfg(feature = "nccl")]
pub use nccl::{Nccl, NcclId};
pub use sharded::{
    ParamDef, Reduction, ShardOptions, ShardedOptimizer, ShardedReport, Zero, fixed_all_reduce,
    fixed_reduce_scatter, rank_order_sum,
};

/// Why a sharded operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// A collective operation failed or was called with inconsistent arguments.
    #[error("collective: {0}")]
    Collective(String),
    /// A checkpoint could not be assembled, cut or written.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The optimizer core refused an operation.
    #[error(transparent)]
    Optim(#[from] lpmm_optim::OptimError),
}
