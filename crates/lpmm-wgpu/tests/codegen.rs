//! The committed kernel program (`src/lpmm.wgsl`) is what `cargo xtask codegen` generates from
//! `kernels/` and the ABI in lpmm-backend; a stale one fails naming the command.

use std::path::{Path, PathBuf};

use lpmm_backend::codegen::{COMMAND, Lang, TARGETS};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn wgsl() -> lpmm_backend::codegen::Target {
    TARGETS
        .into_iter()
        .find(|t| t.lang == Lang::Wgsl)
        .expect("a WGSL target")
}

#[test]
fn the_generated_program_is_up_to_date() {
    let read = |p: &Path| std::fs::read_to_string(p);
    if let Err(e) = wgsl().check(&root(), &read) {
        panic!("{e}");
    }
}

#[test]
fn a_stale_program_fails_naming_the_command() {
    // A format's kernel edited without regenerating the program.
    let read = |p: &Path| {
        let s = std::fs::read_to_string(p)?;
        Ok(if p.ends_with("formats/bf16.wgsl") {
            s.replace("(aux & 1u) == 1u", "(aux & 1u) == 0u")
        } else {
            s
        })
    };
    let err = wgsl().check(&root(), &read).unwrap_err();
    assert!(err.contains(COMMAND) && err.contains("stale"), "{err}");
}
