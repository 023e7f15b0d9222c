//! The layers inside lpmm-optim (docs/ARCHITECTURE.md, "Layers"): no module's code imports a
//! module of a layer above its own. Read from the sources: every `crate::module` path (also
//! `$crate::` in macros and the paths inside `use crate::{...}` groups) outside a file's
//! `#[cfg(test)] mod tests` names the module it depends on; a path through the crate root's
//! re-exports (`crate::Optimizer`) hides its module and is refused below the top layer.
//!
//! `cargo test -p lpmm-optim --test layers`

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The layers, bottom up. A module may import its own layer and those below.
const LAYERS: &[&[&str]] = &[
    // The shared vocabulary (slots, ids, dtypes, limits, piece sizes) and exact arithmetic.
    &["vocab", "exact", "fixed"],
    &["error"],
    &["rule"],
    // Formats own what a user names to choose them (Storage, MapKind, StoreRounding).
    &["format"],
    &["config", "presets", "routing"],
    // The seam backends implement, the step plan it runs, where lent buffers come from, and
    // the step executor that runs plans over the seam.
    &["backend", "plan", "lent", "exec"],
    &["cpu"],
    &["optimizer", "checkpoint", "memory", "coverage"],
    // The conformance suite and the checkpoint oracle (feature `testing`) see everything.
    &["testing", "fuzzing"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module a file belongs to: its first path component under `src/`, without `.rs`.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let first = rel.components().next().expect("a component");
    let name = first.as_os_str().to_string_lossy();
    name.trim_end_matches(".rs").to_string()
}

/// The file's code without comments and without its `#[cfg(test)] mod ... { }` blocks (rustfmt
/// closes a top-level block with `}` alone at column 0, and nothing inside it sits there).
fn code(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("//") {
            continue;
        }
        if line == "#[cfg(test)]"
            && lines
                .peek()
                .is_some_and(|next| next.starts_with("mod ") && next.ends_with('{'))
        {
            for skipped in lines.by_ref() {
                if skipped == "}" {
                    break;
                }
            }
            continue;
        }
        // A trailing comment (`x; // crate::y`) is not code either.
        let line = match line.find("//") {
            Some(at) if !line[..at].contains('"') => &line[..at],
            _ => line,
        };
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// What `code` reaches through `crate::`: module names, and the names taken from the crate root.
fn dependencies(code: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut modules, mut root) = (BTreeSet::new(), BTreeSet::new());
    let mut add = |path: &str| {
        let ident: String = path
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // `$crate::name!`: a macro exported at the root, not a module.
        if ident.is_empty() || ident == "self" || path[ident.len()..].starts_with('!') {
            return;
        }
        if ident.chars().next().is_some_and(char::is_lowercase) {
            modules.insert(ident);
        } else {
            root.insert(ident);
        }
    };
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let after = &rest[at + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            // The top-level paths of the group: split at commas outside nested braces.
            let (mut depth, mut start) = (0usize, 0usize);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        add(group[start..i].trim());
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        add(group[start..i].trim());
                        start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            add(after);
        }
        rest = after;
    }
    (modules, root)
}

#[test]
fn no_module_imports_a_layer_above_its_own() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let top = LAYERS.len() - 1;
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for file in &files {
        let module = module_of(&src, file);
        if module == "lib" {
            continue;
        }
        seen.insert(module.clone());
        let shown = file.strip_prefix(&src).unwrap().display().to_string();
        let Some(layer) = layer_of(&module) else {
            problems.push(format!(
                "{shown}: module `{module}` is in no layer (add it to LAYERS here and to docs/ARCHITECTURE.md)"
            ));
            continue;
        };
        let text = std::fs::read_to_string(file).expect("read source");
        let (modules, root) = dependencies(&code(&text));
        for dep in &modules {
            match layer_of(dep) {
                Some(l) if l > layer => problems.push(format!(
                    "{shown}: `{module}` (layer {layer}) imports `crate::{dep}` (layer {l})"
                )),
                Some(_) => {}
                None => problems.push(format!(
                    "{shown}: imports `crate::{dep}`, a module in no layer"
                )),
            }
        }
        if layer < top {
            for name in &root {
                problems.push(format!(
                    "{shown}: takes `crate::{name}` from the crate root; name the module that defines it"
                ));
            }
        }
    }
    for layer in LAYERS {
        for module in *layer {
            if !seen.contains(*module) {
                problems.push(format!("LAYERS names `{module}`, which has no source file"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "the layers of lpmm-optim are broken:\n{}",
        problems.join("\n")
    );
}

/// The check itself can fail: an upward import, a root re-export and a group are all seen, and a
/// test module is not.
#[test]
fn the_check_sees_what_it_must() {
    let text = "use crate::rule::Adam;\n\
                use crate::{format::Format, backend::{SlotKind, SLOTS}, Optimizer};\n\
                fn f() { let _ = $crate::cpu::CHUNK; $crate::suite!(); } // crate::checkpoint\n\
                #[cfg(test)]\n\
                mod tests {\n    use crate::optimizer::Optimizer;\n}\n";
    let (modules, root) = dependencies(&code(text));
    let modules: Vec<&str> = modules.iter().map(String::as_str).collect();
    assert_eq!(modules, ["backend", "cpu", "format", "rule"]);
    assert_eq!(root.into_iter().collect::<Vec<_>>(), ["Optimizer"]);
}
