//! The files of the server and the client stand on floors: no module imports
//! one that (directly or through others) imports it back.
//!
//! An import circle is where a type lives above a file that needs it (a
//! newcomer cannot read the lower file alone, and nothing can move without
//! moving the whole circle). This test reads the source text of
//! `crates/server/src` and `crates/client/src`, collects every reference
//! from one module to another (`use crate::…`, `crate::x::…` in code,
//! `super::…`, and a parent's `child::…`), and fails naming the circle if
//! the graph has one. Comments and `#[cfg(test)]` modules are not counted:
//! they import nothing into the build. Run with `--nocapture` to see the
//! floors (`docs/design.md` shows the server's).
//!
//! It lives in the server crate for both, since it reads text and needs
//! neither crate to build.

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
/// `tests.rs` files are test modules (`#[cfg(test)] mod tests;`) and are left out.
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
            if path.extension().is_none_or(|ext| ext != "rs") || path.file_name().is_some_and(|n| n == "tests.rs") {
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

/// The text without comments and without its `#[cfg(test)]` modules (which come last).
fn code_only(text: &str) -> String {
    let mut code = String::new();
    let mut rest = text;
    while let Some(line) = rest.lines().next() {
        rest = rest[line.len()..].strip_prefix('\n').unwrap_or(&rest[line.len()..]);
        if line.trim_start().starts_with("#[cfg(test)]") && rest.trim_start().starts_with("mod ") {
            // The test module: by convention the last thing in a file.
            break;
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

/// Fails naming every circle in the crate at `src`; prints its floors otherwise.
fn assert_no_circles(name: &str) {
    let graph = Graph::of(&crate_src(name));
    let circles = graph.circles();
    let described: Vec<String> = circles.iter().map(|circle| graph.describe(circle)).collect();
    assert!(
        circles.is_empty(),
        "crates/{name}/src has import circles; move what several files share below them:\n{}",
        described.join("\n\n")
    );
    println!("crates/{name}/src, floor by floor (each refers only to floors below it):");
    for (floor, modules) in graph.floors().iter().rev() {
        println!("  {floor}: {}", modules.join(", "));
    }
}

#[test]
fn the_server_has_no_import_circle() {
    assert_no_circles("server");
}

#[test]
fn the_client_has_no_import_circle() {
    assert_no_circles("client");
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
