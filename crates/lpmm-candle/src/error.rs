//! Errors across the boundary: lpmm's as candle's and candle's as lpmm's.

use candle_core::Error;
use lpmm_optim::OptimError;

/// lpmm's error as candle's (kept whole: `Error::wrap`).
pub(crate) fn wrap(e: OptimError) -> Error {
    Error::wrap(e)
}

/// candle's error inside a lent `Var` or gradient as lpmm's.
pub(crate) fn candle_error(e: Error) -> OptimError {
    OptimError::Lent {
        param: "a candle Var".into(),
        reason: e.to_string(),
    }
}
