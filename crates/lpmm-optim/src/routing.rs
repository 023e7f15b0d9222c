//! Two configurations for one model, each parameter routed by its name and shape: Muon for the
//! hidden matrices and AdamW for everything else (embeddings, the output head, norms, biases),
//! as torch's and burn-optim's documentation of `Muon` recommend.
//!
//! ```
//! use lpmm_optim::{Hybrid, Route, presets};
//!
//! // 8-bit Muon (bf16 parameters, stochastic rounding) and AdamW with the same storages.
//! let hybrid = presets::muon_adamw_8bit_bf16_sr(0.02, 3e-4)
//!     // This model's embeddings are called `tokens` and `positions`.
//!     .route("tokens.*", Route::Others)
//!     .route("positions.*", Route::Others);
//! assert_eq!(hybrid.route_of("block0.qkv.weight", &[64, 192]), Route::Matrices);
//! assert_eq!(hybrid.route_of("tokens.weight", &[65, 64]), Route::Others);
//! assert_eq!(hybrid.route_of("lm_head.weight", &[65, 64]), Route::Others);
//! assert_eq!(hybrid.route_of("block0.ln1.weight", &[64]), Route::Others);
//! assert_eq!(hybrid.config_for("block0.qkv.weight", &[64, 192]), hybrid.matrices);
//! ```

use crate::config::ParamConfig;

/// Where [`Hybrid`] sends a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// [`Hybrid::matrices`] (Muon).
    Matrices,
    /// [`Hybrid::others`] (AdamW).
    Others,
}

/// The name patterns routed to [`Route::Others`] unless a route of the user's says otherwise:
/// the names torch's examples and Keller Jordan's Muon give a model's embeddings and output head
/// (`*` matches any run of characters).
pub const DEFAULT_OTHERS: [&str; 4] = ["*embed*", "*head*", "*wte*", "*wpe*"];

/// Two configurations and the rule that picks one per parameter ([`Hybrid::route_of`]): the
/// user's routes by name first (the first pattern that matches wins), then
/// [`DEFAULT_OTHERS`], then the shape — a matrix (two dimensions) goes to
/// [`Hybrid::matrices`], anything else to [`Hybrid::others`].
///
/// A route may send a parameter that is not a matrix to a rule that steps only matrices (Muon):
/// its registration is then refused ([`crate::OptimError::NotAMatrix`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Hybrid {
    /// The configuration of the hidden matrices (Muon).
    pub matrices: ParamConfig,
    /// The configuration of every other parameter (AdamW).
    pub others: ParamConfig,
    /// The user's routes: a name pattern (`*` matches any run of characters) and where the
    /// parameters it matches go; the first match wins.
    pub routes: Vec<(String, Route)>,
}

impl Hybrid {
    /// Matrices to `matrices`, the rest to `others`.
    pub fn new(matrices: impl Into<ParamConfig>, others: impl Into<ParamConfig>) -> Self {
        Hybrid {
            matrices: matrices.into(),
            others: others.into(),
            routes: Vec::new(),
        }
    }

    /// With the parameters whose name matches `pattern` sent to `route`. Routes are tried in
    /// the order they were added (the first match wins), before [`DEFAULT_OTHERS`] and the
    /// shape rule.
    pub fn route(mut self, pattern: &str, route: Route) -> Self {
        self.routes.push((pattern.to_string(), route));
        self
    }

    /// Where parameter `name` of `shape` goes.
    pub fn route_of(&self, name: &str, shape: &[usize]) -> Route {
        if let Some((_, r)) = self.routes.iter().find(|(p, _)| name_matches(p, name)) {
            return *r;
        }
        if DEFAULT_OTHERS.iter().any(|p| name_matches(p, name)) || shape.len() != 2 {
            Route::Others
        } else {
            Route::Matrices
        }
    }

    /// The configuration of parameter `name` of `shape`.
    pub fn config_for(&self, name: &str, shape: &[usize]) -> ParamConfig {
        match self.route_of(name, shape) {
            Route::Matrices => self.matrices,
            Route::Others => self.others,
        }
    }
}

/// Whether `name` matches `pattern`, where `*` matches any run of characters (and nothing else
/// is special).
pub fn name_matches(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if parts.len() == 1 {
        return pattern == name;
    }
    if name.len() < first.len() + last.len() || !name.starts_with(first) || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets;

    #[test]
    fn patterns_match_runs_of_characters() {
        assert!(name_matches("*bias", "fc.bias"));
        assert!(name_matches("embed.*", "embed.weight"));
        assert!(name_matches("a*b*c", "a.x.b.y.c"));
        assert!(name_matches("*", ""));
        assert!(!name_matches("a*b*c", "a.c.b"));
        assert!(!name_matches("ab*ba", "aba"));
        assert!(!name_matches("fc.weight", "fc.weights"));
    }

    #[test]
    fn the_users_routes_come_first_then_the_defaults_then_the_shape() {
        let h = Hybrid::new(presets::muon_f32(0.02), presets::adamw_f32(1e-3))
            .route("lm_head.*", Route::Matrices)
            .route("*.bias", Route::Matrices)
            .route("block.*", Route::Others);
        assert_eq!(h.route_of("lm_head.weight", &[10, 8]), Route::Matrices);
        assert_eq!(h.route_of("encoder.embed_tokens", &[10, 8]), Route::Others);
        assert_eq!(h.route_of("block.w", &[10, 8]), Route::Others);
        assert_eq!(h.route_of("mlp.w", &[10, 8]), Route::Matrices);
        assert_eq!(h.route_of("mlp.w", &[10, 8, 3]), Route::Others);
        // A route may send a vector to Muon: registration refuses it.
        assert_eq!(h.route_of("fc.bias", &[8]), Route::Matrices);
        assert_eq!(h.config_for("mlp.w", &[8]), h.others);
    }
}
