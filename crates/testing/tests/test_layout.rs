//! One place for a module's unit tests, everywhere: a child module named
//! `tests` at the bottom of the module, inline (`#[cfg(test)] mod tests { … }`)
//! or, once the tests outgrow the file, in the module's own directory where
//! Rust looks for a child by default (`foo.rs` → `foo/tests.rs`,
//! `foo/mod.rs` → `foo/tests.rs`), declared `#[cfg(test)] mod tests;`.
//! Never a `#[path]` to a sibling, never a second name (`write_tests`). Tests
//! that drive a crate from outside live in its `tests/` directory.
//!
//! This reads every file under every crate's `src` and fails naming each file
//! that departs from it: a `*_tests.rs` file, a `#[path]` attribute, a
//! `#[cfg(test)]` module with another name (shared fixtures, `mod testing`,
//! excepted), or an inline `mod tests { … }` followed by more items.

use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// What is wrong with one source file's tests, if anything.
fn departures(name: &str, text: &str) -> Vec<String> {
    let mut found = Vec::new();
    if name.ends_with("_tests.rs") {
        found.push("a `*_tests.rs` sibling: make it the module's own `tests.rs` child".to_owned());
    }
    let lines: Vec<&str> = text.lines().collect();
    for (index, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[path") {
            found.push(format!("line {}: a `#[path]` attribute", index + 1));
        }
        if trimmed.starts_with("#[cfg(test)]") {
            let Some(offset) = lines[index + 1..].iter().position(|l| !l.trim().starts_with("#[")) else {
                continue;
            };
            let module_line = index + 1 + offset;
            let module = lines[module_line].trim().trim_start_matches("pub(crate) ").trim_start_matches("pub ");
            let Some(rest) = module.strip_prefix("mod ") else { continue };
            let module_name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            if module_name != "tests" && module_name != "testing" {
                found.push(format!("line {}: a test module named `{module_name}`, not `tests`", index + 1));
            }
            // Inline at column 0: nothing but its own indented body and closing brace may follow.
            if module_name == "tests" && rest.trim_end().ends_with('{') && !line.starts_with(char::is_whitespace) {
                let body_end = lines.iter().rposition(|l| !l.trim().is_empty()).unwrap_or(index);
                let items_after = lines[module_line + 1..body_end].iter().any(|l| starts_an_item(l));
                if items_after || lines[body_end] != "}" {
                    found.push(format!("line {}: `mod tests {{ … }}` is not at the bottom of the file", index + 1));
                }
            }
        }
    }
    found
}

/// Whether a line starts an item at the file's top level (not a line of a
/// multi-line string literal that happens to start at column 0).
fn starts_an_item(line: &str) -> bool {
    const ITEMS: [&str; 16] = [
        "fn ",
        "pub ",
        "pub(",
        "impl",
        "struct ",
        "enum ",
        "const ",
        "static ",
        "use ",
        "mod ",
        "#[",
        "type ",
        "trait ",
        "macro_rules!",
        "async fn ",
        "unsafe ",
    ];
    ITEMS.iter().any(|item| line.starts_with(item))
}

#[test]
fn every_crate_keeps_its_unit_tests_one_way() {
    let crates = workspace_root().join("crates");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&crates).expect("crates/") {
        let src = entry.expect("crate").path().join("src");
        if src.is_dir() {
            rust_files(&src, &mut files);
        }
    }
    assert!(files.len() > 100, "read only {} files under {}", files.len(), crates.display());
    let mut report = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        for departure in departures(name, &text) {
            report.push(format!("{}: {departure}", path.strip_prefix(&crates).unwrap_or(path).display()));
        }
    }
    assert!(report.is_empty(), "unit tests kept another way than this file's doc says:\n{}", report.join("\n"));
}

#[test]
fn the_reader_sees_each_departure() {
    let good_inline = "fn f() {}\n\n#[cfg(test)]\nmod tests {\n    use super::*;\n\n    #[test]\n    fn t() {}\n}\n";
    assert_eq!(departures("a.rs", good_inline), Vec::<String>::new());
    let good_child = "fn f() {}\n#[cfg(test)]\nmod tests;\n";
    assert_eq!(departures("a.rs", good_child), Vec::<String>::new());
    let fixtures = "#[cfg(test)]\npub(crate) mod testing;\n";
    assert_eq!(departures("lib.rs", fixtures), Vec::<String>::new());

    assert_eq!(departures("a_tests.rs", "").len(), 1);
    let path = "#[cfg(test)]\n#[path = \"a_tests.rs\"]\nmod tests;\n";
    assert_eq!(departures("a.rs", path), ["line 2: a `#[path]` attribute"]);
    let named = "#[cfg(test)]\nmod write_tests {\n}\n";
    assert_eq!(departures("a.rs", named), ["line 1: a test module named `write_tests`, not `tests`"]);
    let not_last = "#[cfg(test)]\nmod tests {\n    fn t() {}\n}\n\nfn after() {}\n";
    assert_eq!(departures("a.rs", not_last), ["line 1: `mod tests { … }` is not at the bottom of the file"]);
}
