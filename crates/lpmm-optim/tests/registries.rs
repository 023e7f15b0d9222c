//! docs/REGISTRIES.md — the rules, storage formats, presets and conformance cases, with their
//! counts — is what lpmm-optim's registries generate (`lpmm_optim::testing::registries_doc`);
//! `cargo xtask codegen` writes it.
//!
//! `cargo test -p lpmm-optim --test registries`

use std::path::Path;

use lpmm_optim::testing::{REGISTRIES_COMMAND, REGISTRIES_PATH, registries_doc};

#[test]
fn the_registries_doc_is_up_to_date() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(REGISTRIES_PATH);
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == registries_doc(),
        "{REGISTRIES_PATH} is stale: it is not what lpmm-optim's registries generate; run \
         `{REGISTRIES_COMMAND}` and commit the result"
    );
}
