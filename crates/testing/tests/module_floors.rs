//! The workspace stands on floors, at two levels, and the Python package on
//! its own: no crate, file or Python module imports one that (directly or
//! through others) imports it back, so each sits on the floor above
//! everything it uses.
//!
//! An import circle is where a type lives above a file that needs it (a
//! newcomer cannot read the lower file alone, and nothing can move without
//! moving the whole circle). Two guards here:
//!
//! * **Files.** For every crate under `crates/`, this reads the source text
//!   of its `src`, collects every reference from one module to another
//!   (`use crate::…`, `crate::x::…` in code, `super::…`, and a parent's
//!   `child::…`), and fails naming the circle if the graph has one. Comments
//!   and `#[cfg(test)]` modules (and `tests.rs`, `*_tests.rs` files) are not
//!   counted: they import nothing into the build. Run with `--nocapture` to
//!   see each crate's floors (`docs/design.md` shows the server's).
//! * **Crates.** Every crate's `[dependencies]` on workspace crates (optional
//!   ones under the feature that enables them; dev-dependencies are not
//!   counted) must be what the diagram of `docs/design.md`'s "Crates on their
//!   floors" draws, each crate on the floor just above its highest
//!   dependency, so neither the manifests nor the diagram can drift.
//!
//! The Python package's guard is `python/tests/test_import_floors.py`. This
//! lives in the testing crate since it reads text and needs no crate to build.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A crate's modules (by path, the root as `crate`) and who refers to whom.
struct Graph {
    edges: BTreeMap<String, BTreeSet<String>>,
}

const ROOT: &str = "crate";

impl Graph {
    /// Reads every module file under `src`.
    fn of(src: &Path) -> Self {
        let files = module_files(src);
        let modules: BTreeSet<String> = files.iter().map(|(module, _)| module.clone()).collect();
        let code: BTreeMap<&String, String> = files
            .iter()
            .map(|(module, path)| {
                let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                (module, code_only(&text))
            })
            .collect();
        let names = Names { modules, reexports: reexports(code.get(&ROOT.to_owned()).map_or("", |c| c)) };
        let mut edges = BTreeMap::new();
        for (module, code) in &code {
            let module = (*module).clone();
            let targets: BTreeSet<String> =
                references(&module, code, &names).into_iter().filter(|target| *target != module).collect();
            edges.insert(module, targets);
        }
        Self { edges }
    }

    /// Groups of modules that reach each other (Tarjan's strongly connected components), larger than one.
    fn circles(&self) -> Vec<Vec<String>> {
        struct Walk<'a> {
            graph: &'a Graph,
            index: BTreeMap<&'a str, usize>,
            low: BTreeMap<&'a str, usize>,
            stack: Vec<&'a str>,
            on_stack: BTreeSet<&'a str>,
            circles: Vec<Vec<String>>,
        }
        impl<'a> Walk<'a> {
            fn visit(&mut self, node: &'a str) {
                let at = self.index.len();
                self.index.insert(node, at);
                self.low.insert(node, at);
                self.stack.push(node);
                self.on_stack.insert(node);
                for next in self.graph.edges.get(node).into_iter().flatten() {
                    let next = next.as_str();
                    if !self.index.contains_key(next) {
                        self.visit(next);
                        let low = self.low[node].min(self.low[next]);
                        self.low.insert(node, low);
                    } else if self.on_stack.contains(next) {
                        let low = self.low[node].min(self.index[next]);
                        self.low.insert(node, low);
                    }
                }
                if self.low[node] == self.index[node] {
                    let mut component = Vec::new();
                    while let Some(member) = self.stack.pop() {
                        self.on_stack.remove(member);
                        component.push(member.to_owned());
                        if member == node {
                            break;
                        }
                    }
                    if component.len() > 1 {
                        component.sort();
                        self.circles.push(component);
                    }
                }
            }
        }
        let mut walk = Walk {
            graph: self,
            index: BTreeMap::new(),
            low: BTreeMap::new(),
            stack: Vec::new(),
            on_stack: BTreeSet::new(),
            circles: Vec::new(),
        };
        for node in self.edges.keys() {
            if !walk.index.contains_key(node.as_str()) {
                walk.visit(node);
            }
        }
        walk.circles
    }

    /// Each module's floor: 0 if it refers to no other module, else one above the highest it refers to.
    /// Only for a graph without circles.
    fn floors(&self) -> BTreeMap<usize, Vec<String>> {
        fn floor<'a>(graph: &'a Graph, node: &'a str, known: &mut BTreeMap<&'a str, usize>) -> usize {
            if let Some(&floor) = known.get(node) {
                return floor;
            }
            let floor = graph
                .edges
                .get(node)
                .into_iter()
                .flatten()
                .map(|next| floor(graph, next, known) + 1)
                .max()
                .unwrap_or(0);
            known.insert(node, floor);
            floor
        }
        let mut known = BTreeMap::new();
        let mut floors: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for node in self.edges.keys() {
            let at = floor(self, node, &mut known);
            floors.entry(at).or_default().push(node.clone());
        }
        floors
    }

    /// The references inside one circle, for the failure message.
    fn describe(&self, circle: &[String]) -> String {
        let mut lines = Vec::new();
        for from in circle {
            let to: Vec<&str> = self.edges[from].iter().filter(|to| circle.contains(to)).map(String::as_str).collect();
            lines.push(format!("  {from} -> {}", to.join(", ")));
        }
        lines.join("\n")
    }
}

/// Every `.rs` file under `src` with its module path (`crate`, `registry`, `op::import`).
/// `tests.rs` and `*_tests.rs` files are test modules (`#[cfg(test)] mod tests;`, with a
/// `#[path]` for the second) and are left out.
fn module_files(src: &Path) -> Vec<(String, PathBuf)> {
    let mut found = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let test_module =
                path.file_name().is_some_and(|n| n == "tests.rs" || n.to_string_lossy().ends_with("_tests.rs"));
            if path.extension().is_none_or(|ext| ext != "rs") || test_module {
                continue;
            }
            let relative = path.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> =
                relative.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
            if parts.last().is_some_and(|last| last == "mod" || last == "lib" || last == "main") {
                parts.pop();
            }
            let module = if parts.is_empty() { ROOT.to_owned() } else { parts.join("::") };
            found.push((module, path));
        }
    }
    found
}

/// The text without comments and without its `#[cfg(test)]` modules: a `mod x;` line
/// (and the attributes between) is left out, a `mod x { … }` ends the code (by convention
/// it is the last thing in a file).
fn code_only(text: &str) -> String {
    let mut code = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            while lines.peek().is_some_and(|next| next.trim_start().starts_with("#[")) {
                lines.next();
            }
            match lines.peek().map(|next| without_visibility(next.trim())) {
                Some(next) if next.starts_with("mod ") && next.ends_with(';') => {
                    lines.next();
                    continue;
                }
                Some(next) if next.starts_with("mod ") => break,
                _ => {}
            }
        }
        let without_comment = match line.find("//") {
            Some(at) if !line[..at].contains('"') => &line[..at],
            _ => line,
        };
        code.push_str(without_comment);
        code.push('\n');
    }
    code
}

/// `line` without a leading `pub` or `pub(…)`.
fn without_visibility(line: &str) -> &str {
    match line.strip_prefix("pub") {
        Some(rest) if rest.starts_with('(') => rest.split_once(')').map_or(line, |(_, after)| after.trim_start()),
        Some(rest) if rest.starts_with(' ') => rest.trim_start(),
        _ => line,
    }
}

/// What a path can name: the crate's modules, and the items its root re-exports
/// (`pub use error::ClientError;`: `crate::ClientError` is a reference to `error`).
struct Names {
    modules: BTreeSet<String>,
    reexports: BTreeMap<String, Vec<String>>,
}

/// The names the root's `use` declarations bring in, with the path each stands for.
fn reexports(root: &str) -> BTreeMap<String, Vec<String>> {
    let mut names = BTreeMap::new();
    for (at, _) in root.match_indices("use ") {
        if at > 0 && is_ident(root.as_bytes()[at - 1]) {
            continue;
        }
        for (path, alias) in use_tree(&root[at + 4..], Vec::new()) {
            if let Some(name) = alias.or_else(|| path.last().cloned()) {
                names.insert(name, path);
            }
        }
    }
    names
}

/// The modules `module`'s code refers to.
fn references(module: &str, code: &str, names: &Names) -> BTreeSet<String> {
    let modules = &names.modules;
    let mut found = BTreeSet::new();
    let own = if module == ROOT { Vec::new() } else { module.split("::").map(str::to_owned).collect::<Vec<_>>() };
    let parent = own[..own.len().saturating_sub(1)].to_vec();
    let bytes = code.as_bytes();
    let mut at = 0;
    while at < bytes.len() {
        let starts_word = at == 0 || !is_ident(bytes[at - 1]) && bytes[at - 1] != b'$' && bytes[at - 1] != b':';
        if !starts_word || !is_ident(bytes[at]) {
            at += 1;
            continue;
        }
        let end = at + bytes[at..].iter().take_while(|b| is_ident(**b)).count();
        let word = &code[at..end];
        if !code[end..].starts_with("::") {
            at = end;
            continue;
        }
        let base: Option<Vec<String>> = match word {
            "crate" => Some(Vec::new()),
            "super" => Some(parent.clone()),
            "self" => Some(own.clone()),
            // A child module named without `crate::` (the root's `mod x;` then `x::f()`).
            child => {
                let mut path = own.clone();
                path.push(child.to_owned());
                modules.contains(&path.join("::")).then_some(own.clone())
            }
        };
        let tree_at = if matches!(word, "crate" | "super" | "self") { end + 2 } else { at };
        if let Some(base) = base {
            for (path, _) in use_tree(&code[tree_at..], base) {
                found.extend(resolve(&path, names));
            }
        }
        at = end;
    }
    found
}

fn is_ident(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_'
}

/// The paths a use tree (or a plain path) starting at `text` names, each under `base`,
/// with its alias if it has one: `a::b::C` is one, `{a::B as D, c::{E, F}}` three.
fn use_tree(text: &str, base: Vec<String>) -> Vec<(Vec<String>, Option<String>)> {
    let mut paths = Vec::new();
    parse_tree(text.as_bytes(), &mut 0, base, &mut paths);
    paths
}

fn parse_tree(text: &[u8], at: &mut usize, mut path: Vec<String>, out: &mut Vec<(Vec<String>, Option<String>)>) {
    loop {
        while *at < text.len() && text[*at].is_ascii_whitespace() {
            *at += 1;
        }
        if *at < text.len() && text[*at] == b'{' {
            *at += 1;
            loop {
                parse_tree(text, at, path.clone(), out);
                while *at < text.len() && text[*at].is_ascii_whitespace() {
                    *at += 1;
                }
                match text.get(*at) {
                    Some(b',') => *at += 1,
                    Some(b'}') => {
                        *at += 1;
                        break;
                    }
                    _ => break,
                }
                while *at < text.len() && text[*at].is_ascii_whitespace() {
                    *at += 1;
                }
                if text.get(*at) == Some(&b'}') {
                    *at += 1;
                    break;
                }
            }
            return;
        }
        let start = *at;
        while *at < text.len() && (is_ident(text[*at]) || text[*at] == b'*') {
            *at += 1;
        }
        if *at > start {
            path.push(String::from_utf8_lossy(&text[start..*at]).into_owned());
        }
        if text[*at..].starts_with(b"::") {
            *at += 2;
            continue;
        }
        let after = &text[*at..];
        let spaces = after.iter().take_while(|b| b.is_ascii_whitespace()).count();
        let alias = after[spaces..].strip_prefix(b"as ").map(|rest| {
            let rest = rest.trim_ascii_start();
            let len = rest.iter().take_while(|b| is_ident(**b)).count();
            *at += (after.len() - rest.len()) + len;
            String::from_utf8_lossy(&rest[..len]).into_owned()
        });
        out.push((path, alias));
        return;
    }
}

/// The module `path` (from the root) names: its longest prefix that is a
/// module, through the root's re-exports; the root itself if none is; `None`
/// for what the root re-exports from another crate.
fn resolve(path: &[String], names: &Names) -> Option<String> {
    let found = (1..=path.len()).rev().map(|len| path[..len].join("::")).find(|prefix| names.modules.contains(prefix));
    if found.is_some() {
        return found;
    }
    match path.first().and_then(|first| names.reexports.get(first)) {
        Some(target) if target.first().is_some_and(|first| names.modules.contains(first)) => {
            let mut through = target.clone();
            through.extend_from_slice(&path[1..]);
            resolve(&through, names)
        }
        Some(_) => None,
        None => Some(ROOT.to_owned()),
    }
}

fn crate_src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(name).join("src")
}

/// The circles in the crate at `crates/NAME/src`, described; prints its floors when there are none.
fn check_no_circles(name: &str) -> Result<(), String> {
    let graph = Graph::of(&crate_src(name));
    let circles = graph.circles();
    if !circles.is_empty() {
        let described: Vec<String> = circles.iter().map(|circle| graph.describe(circle)).collect();
        return Err(format!(
            "crates/{name}/src has import circles; move what several files share below them:\n{}",
            described.join("\n\n")
        ));
    }
    println!("crates/{name}/src, floor by floor (each refers only to floors below it):");
    for (floor, modules) in graph.floors().iter().rev() {
        println!("  {floor}: {}", modules.join(", "));
    }
    Ok(())
}

/// Every crate of the workspace: each directory under `crates/` with a `src`.
fn workspace_crates() -> Vec<String> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut names: Vec<String> = std::fs::read_dir(&crates)
        .unwrap_or_else(|e| panic!("{}: {e}", crates.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.join("src").is_dir())
        .map(|path| path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn no_crate_has_an_import_circle() {
    let crates = workspace_crates();
    assert!(crates.len() >= 15 && crates.contains(&"cli".to_owned()), "{crates:?}");
    let mut failures = Vec::new();
    for name in &crates {
        if let Err(circles) = check_no_circles(name) {
            failures.push(circles);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn the_reader_sees_every_kind_of_reference() {
    let modules: BTreeSet<String> =
        ["crate", "a", "b", "c", "d", "op", "op::reply", "op::import"].iter().map(|m| (*m).to_owned()).collect();
    let modules = &Names {
        modules,
        reexports: reexports("pub use a::Thing as Other;\nuse b::{Item};\npub use other_crate::Elsewhere;\n"),
    };
    let code = "fn f() { crate::Other::new(); crate::Item::new(); crate::Unknown::new(); crate::Elsewhere::new(); }\n";
    let found = references("d", &code_only(code), modules);
    assert_eq!(found, ["a", "b", "crate"].iter().map(|m| (*m).to_owned()).collect());
    let code = "use crate::{a::X, b::{Y, Z}};\nfn f() { crate::c::g(); usbwire_proto::op::decode(); }\n";
    let found = references("d", &code_only(code), modules);
    assert_eq!(found, ["a", "b", "c"].iter().map(|m| (*m).to_owned()).collect());
    let code = "use super::reply::Reply;\n// crate::a in a comment\nfn f() { crate::Thing::new(); }\n";
    let found = references("op::import", &code_only(code), modules);
    assert_eq!(found, ["crate", "op::reply"].iter().map(|m| (*m).to_owned()).collect());
    let code = "mod reply;\nfn f() { reply::send(); import::run(); }\n#[cfg(test)]\nmod tests { use crate::a; }\n";
    let found = references("op", &code_only(code), modules);
    assert_eq!(found, ["op::import", "op::reply"].iter().map(|m| (*m).to_owned()).collect());
    let code = "#[cfg(test)]\n#[path = \"op_tests.rs\"]\nmod tests;\nfn f() { crate::a::g(); }\n#[cfg(test)]\npub(crate) mod tests {\n    use super::*;\n}\n";
    let found = references("op", &code_only(code), modules);
    assert_eq!(found, ["a"].iter().map(|m| (*m).to_owned()).collect(), "code after a `mod tests;` counts");
    let graph = Graph {
        edges: BTreeMap::from([
            ("a".to_owned(), BTreeSet::from(["b".to_owned()])),
            ("b".to_owned(), BTreeSet::from(["c".to_owned()])),
            ("c".to_owned(), BTreeSet::from(["a".to_owned()])),
            ("d".to_owned(), BTreeSet::from(["a".to_owned()])),
        ]),
    };
    assert_eq!(graph.circles(), vec![vec!["a".to_owned(), "b".to_owned(), "c".to_owned()]]);
}

/// One crate's dependencies on other workspace crates (by directory name): those it
/// always has, and those each feature adds.
#[derive(Debug, Default, PartialEq, Eq)]
struct CrateDeps {
    always: BTreeSet<String>,
    features: BTreeMap<String, BTreeSet<String>>,
}

impl CrateDeps {
    fn all(&self) -> impl Iterator<Item = &String> {
        self.always.iter().chain(self.features.values().flatten())
    }

    fn describe(&self) -> String {
        let mut text = self.always.iter().map(String::as_str).collect::<Vec<_>>().join(", ");
        for (feature, deps) in &self.features {
            let deps: Vec<&str> = deps.iter().map(String::as_str).collect();
            text.push_str(&format!("; with `{feature}`: {}", deps.join(", ")));
        }
        text
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("..")
}

fn read_toml(path: &Path) -> toml::Table {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.parse().unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// What every workspace member's `Cargo.toml` says it depends on among the members:
/// `[dependencies]` and `[target.*.dependencies]`, an optional one under each feature
/// that names it (`dep:x`, or its implicit feature); dev- and build-dependencies are not counted.
fn manifest_deps() -> BTreeMap<String, CrateDeps> {
    let root = workspace_root();
    let workspace = read_toml(&root.join("Cargo.toml"));
    let members: Vec<String> = workspace["workspace"]["members"]
        .as_array()
        .expect("workspace.members")
        .iter()
        .map(|member| member.as_str().expect("a member is a path").to_owned())
        .collect();
    let manifests: BTreeMap<String, toml::Table> = members
        .iter()
        .map(|member| {
            let name = Path::new(member).file_name().expect("a member's directory").to_string_lossy().into_owned();
            (name, read_toml(&root.join(member).join("Cargo.toml")))
        })
        .collect();
    let by_package: BTreeMap<String, String> = manifests
        .iter()
        .map(|(name, manifest)| (manifest["package"]["name"].as_str().expect("package.name").to_owned(), name.clone()))
        .collect();
    let mut graph = BTreeMap::new();
    for (name, manifest) in &manifests {
        let mut tables: Vec<&toml::Table> =
            manifest.get("dependencies").and_then(|d| d.as_table()).into_iter().collect();
        for target in manifest.get("target").and_then(|t| t.as_table()).into_iter().flat_map(|t| t.values()) {
            tables.extend(target.get("dependencies").and_then(|d| d.as_table()));
        }
        let features = manifest.get("features").and_then(|f| f.as_table());
        let mut deps = CrateDeps::default();
        for (key, spec) in tables.into_iter().flatten() {
            let package = spec.get("package").and_then(|p| p.as_str()).unwrap_or(key);
            let Some(member) = by_package.get(package) else { continue };
            if !spec.get("optional").and_then(|o| o.as_bool()).unwrap_or(false) {
                deps.always.insert(member.clone());
                continue;
            }
            let enabling: Vec<&String> = features
                .into_iter()
                .flatten()
                .filter(|(_, enables)| {
                    enables.as_array().into_iter().flatten().any(|e| e.as_str() == Some(&format!("dep:{key}")))
                })
                .map(|(feature, _)| feature)
                .collect();
            if enabling.is_empty() {
                deps.features.entry(key.clone()).or_default().insert(member.clone());
            }
            for feature in enabling {
                deps.features.entry(feature.clone()).or_default().insert(member.clone());
            }
        }
        graph.insert(name.clone(), deps);
    }
    graph
}

/// The crates of a floors diagram, each with its floor and dependencies.
#[derive(Debug, Default, PartialEq, Eq)]
struct Diagram {
    floors: BTreeMap<String, usize>,
    deps: BTreeMap<String, CrateDeps>,
}

/// Reads the first code block of the `## Crates on their floors` section. Each line
/// `floor N   ENTRY   ENTRY …` (a line that starts with spaces continues the floor above);
/// entries are three or more spaces apart; an entry is `NAME` or `NAME ── DEP, DEP` with
/// `; with `FEATURE`: DEP, DEP` for what a feature adds; `(…)` is a remark.
fn parse_diagram(doc: &str) -> Result<Diagram, String> {
    let section = doc
        .split("\n## ")
        .find(|section| section.starts_with("Crates on their floors"))
        .ok_or("no section \"## Crates on their floors\"")?;
    let block = section.split("```").nth(1).ok_or("no diagram (a ``` block) in the section")?;
    let names = |list: &str| -> BTreeSet<String> {
        list.split(',').map(str::trim).filter(|name| !name.is_empty()).map(str::to_owned).collect()
    };
    let mut diagram = Diagram::default();
    let mut floor = None;
    for line in block.lines().skip(1).filter(|line| !line.trim().is_empty()) {
        let entries = if let Some(rest) = line.strip_prefix("floor ") {
            let (number, rest) = rest.split_once(' ').unwrap_or((rest, ""));
            floor = Some(number.parse::<usize>().map_err(|_| format!("not a floor number: {line:?}"))?);
            rest
        } else if line.starts_with(' ') {
            line
        } else {
            return Err(format!("a line that neither starts a floor nor continues one: {line:?}"));
        };
        let floor = floor.ok_or_else(|| format!("a continuation before the first floor: {line:?}"))?;
        for entry in entries.split("   ").map(str::trim).filter(|entry| !entry.is_empty()) {
            let mut text = String::new();
            let mut depth = 0usize;
            for c in entry.chars() {
                match c {
                    '(' => depth += 1,
                    ')' => depth = depth.saturating_sub(1),
                    _ if depth == 0 => text.push(c),
                    _ => {}
                }
            }
            let (name, list) = text.split_once("──").unwrap_or((text.as_str(), ""));
            let name = name.trim().to_owned();
            let mut parts = list.split(';');
            let mut deps = CrateDeps { always: names(parts.next().unwrap_or_default()), features: BTreeMap::new() };
            for part in parts {
                let (feature, list) = part
                    .trim()
                    .strip_prefix("with `")
                    .and_then(|rest| rest.split_once("`:"))
                    .ok_or_else(|| format!("not `with `FEATURE`: DEPS`: {part:?} in {line:?}"))?;
                deps.features.insert(feature.to_owned(), names(list));
            }
            if name.is_empty() || name.contains(' ') {
                return Err(format!("not a crate name: {name:?} in {line:?}"));
            }
            if diagram.floors.insert(name.clone(), floor).is_some() {
                return Err(format!("{name} is drawn twice"));
            }
            diagram.deps.insert(name, deps);
        }
    }
    Ok(diagram)
}

/// What is wrong with `diagram` as a picture of `manifests`: a crate missing from
/// either, dependencies that differ, a crate not on the floor just above its highest dependency.
fn diagram_errors(diagram: &Diagram, manifests: &BTreeMap<String, CrateDeps>) -> Vec<String> {
    let mut errors = Vec::new();
    for (name, deps) in manifests {
        match diagram.deps.get(name) {
            None => errors.push(format!("{name} is a workspace member the diagram does not draw")),
            Some(drawn) if drawn != deps => errors.push(format!(
                "{name}: crates/{name}/Cargo.toml depends on {}; the diagram draws {}",
                deps.describe(),
                drawn.describe()
            )),
            Some(_) => {}
        }
    }
    for (name, drawn) in &diagram.deps {
        if !manifests.contains_key(name) {
            errors.push(format!("{name} is drawn but is not a workspace member"));
        }
        let below: Option<usize> = drawn.all().map(|dep| diagram.floors.get(dep).copied().unwrap_or(usize::MAX)).max();
        let should = below.map_or(0, |floor| floor.saturating_add(1));
        if diagram.floors[name] != should {
            errors.push(format!(
                "{name} is drawn on floor {}; on its dependencies ({}) it belongs on floor {should}",
                diagram.floors[name],
                drawn.describe()
            ));
        }
    }
    errors
}

#[test]
fn the_crates_stand_on_the_floors_design_md_draws() {
    let path = workspace_root().join("docs").join("design.md");
    let doc = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let diagram = parse_diagram(&doc).unwrap_or_else(|e| panic!("docs/design.md: {e}"));
    let manifests = manifest_deps();
    assert!(manifests.len() >= 15 && manifests.contains_key("cli"), "{manifests:?}");
    let on_disk: BTreeSet<String> = workspace_crates().into_iter().collect();
    let members: BTreeSet<String> = manifests.keys().cloned().collect();
    assert_eq!(members, on_disk, "the workspace members are every crate under crates/");
    let errors = diagram_errors(&diagram, &manifests);
    assert!(
        errors.is_empty(),
        "docs/design.md's \"Crates on their floors\" and the manifests disagree; fix whichever is wrong:\n  {}",
        errors.join("\n  ")
    );
}

#[test]
fn the_diagram_reader_reads_every_form() {
    let doc = "# x\n\n## Crates on their floors\n\ntext\n\n```\n\
        floor 2   app (the binary) ── lib, core; with `extra`: side\n\
        floor 1   lib ── core    side ── core (a remark)\n\
        \x20         more ── core\n\
        floor 0   core\n```\n\n## Next\n\n```\nfloor 9   ignored\n```\n";
    let diagram = parse_diagram(doc).unwrap();
    let set = |names: &[&str]| names.iter().map(|n| (*n).to_owned()).collect::<BTreeSet<String>>();
    let floors: Vec<(&str, usize)> = diagram.floors.iter().map(|(n, f)| (n.as_str(), *f)).collect();
    assert_eq!(floors, [("app", 2), ("core", 0), ("lib", 1), ("more", 1), ("side", 1)]);
    assert_eq!(diagram.deps["app"].always, set(&["lib", "core"]));
    assert_eq!(diagram.deps["app"].features, BTreeMap::from([("extra".to_owned(), set(&["side"]))]));
    assert_eq!(diagram.deps["side"].always, set(&["core"]));
    assert!(diagram.deps["core"].always.is_empty());
    let manifests: BTreeMap<String, CrateDeps> = diagram
        .deps
        .iter()
        .map(|(n, d)| (n.clone(), CrateDeps { always: d.always.clone(), features: d.features.clone() }))
        .collect();
    assert!(diagram_errors(&diagram, &manifests).is_empty());
    let mut moved = Diagram {
        floors: diagram.floors.clone(),
        deps: manifests
            .iter()
            .map(|(n, d)| (n.clone(), CrateDeps { always: d.always.clone(), features: d.features.clone() }))
            .collect(),
    };
    moved.floors.insert("app".to_owned(), 3);
    moved.deps.get_mut("lib").unwrap().always.insert("side".to_owned());
    let errors = diagram_errors(&moved, &manifests);
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(errors.iter().any(|e| e.starts_with("app is drawn on floor 3")), "{errors:?}");
    assert!(errors.iter().any(|e| e.starts_with("lib: crates/lib/Cargo.toml depends on core")), "{errors:?}");
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with("lib is drawn on floor 1; on its dependencies (core, side) it belongs on floor 2")),
        "{errors:?}"
    );
    assert!(parse_diagram("## Crates on their floors\n```\nlib ── core\n```\n").is_err());
}
