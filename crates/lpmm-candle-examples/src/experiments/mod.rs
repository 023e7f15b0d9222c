//! The training runs behind the README's main command (`examples/compare.rs`): two real tasks,
//! every preset, the same initialisation and data order for all of them, and the measurements
//! the report prints. Data: `data/` (see its README for sources, licences and the fixed splits).

// The parts: the embedded data and its splits (data.rs), the count-model baselines
// (baselines.rs), the seeded generator and initialiser (init.rs), the two models (models.rs),
// the presets of the comparison (presets.rs), a run and the digits task (run.rs), and the
// character-level language-model task (char_lm.rs).

mod baselines;
mod char_lm;
mod data;
mod init;
mod models;
mod presets;
mod run;

pub use baselines::{Baselines, baselines};
pub use char_lm::{LmRecipe, evaluate, run_char_lm};
pub(crate) use char_lm::{window_starts, windows_of};
pub use data::{
    Digits, PLAYS, Text, digits, play_from, play_index, play_ranges, shakespeare,
    shakespeare_held_out, shakespeare_play, text_file,
};
pub use init::{Rng, seeded_var_builder};
pub use models::{CharLm, LmShape, Mlp};
pub use presets::{Goal, Preset, more_presets, presets};
pub use run::{Budget, RunResult, run_digits, schedule};
