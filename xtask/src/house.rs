//! The house rules a reviewer would otherwise check by eye, run with the xtask's tests (so in
//! CI): `unsafe` only in `crates/driver` (every other crate root forbids it), no source file
//! over 800 lines, and no two sibling modules importing each other (an import circle between
//! two files means neither can be read, moved or tested alone; a parent and its own child
//! modules are one unit and may).
#![cfg(test)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use crate::root;

/// The longest a source file may be (inline unit tests included).
const MAX_LINES: usize = 800;

/// A crate's `src` folder and the source files in it, by module path (`[]` is the root).
struct Crate {
    src: PathBuf,
    modules: BTreeMap<Vec<String>, PathBuf>,
}

fn crates() -> Vec<Crate> {
    let root = root();
    let mut srcs = vec![root.join("src"), root.join("xtask/src")];
    let members = fs::read_dir(root.join("crates")).expect("crates/");
    srcs.extend(members.flatten().map(|e| e.path().join("src")));
    srcs.retain(|s| s.is_dir());
    srcs.sort();
    srcs.into_iter()
        .map(|src| {
            let mut modules = BTreeMap::new();
            collect(&src, &src, &mut modules);
            Crate { src, modules }
        })
        .collect()
}

fn collect(src: &Path, dir: &Path, modules: &mut BTreeMap<Vec<String>, PathBuf>) {
    for entry in fs::read_dir(dir).expect("a source folder").flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(src, &path, modules);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path
                .strip_prefix(src)
                .expect("under src")
                .with_extension("");
            let mut module: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if module.last().is_some_and(|l| l == "mod") || module == ["lib"] || module == ["main"]
            {
                module.pop();
            }
            modules.insert(module, path);
        }
    }
}

/// The file's code without comments and without its inline `mod tests`.
fn code(path: &Path) -> String {
    let text = fs::read_to_string(path).expect("a readable source file");
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => &text[..],
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(at) => &l[..at],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules of its crate that `module`'s code names through `super::` or `crate::` paths.
fn imports(krate: &Crate, module: &[String], code: &str) -> BTreeSet<Vec<String>> {
    let mut found = BTreeSet::new();
    let words: Vec<&str> = code
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
        .filter(|w| w.starts_with("super::") || w.starts_with("crate::"))
        .collect();
    for word in words {
        let parts: Vec<&str> = word.split("::").filter(|p| !p.is_empty()).collect();
        let supers = parts.iter().take_while(|p| **p == "super").count();
        let mut target: Vec<String> = if parts[0] == "crate" {
            Vec::new()
        } else {
            module[..module.len().saturating_sub(supers)].to_vec()
        };
        let skip = if parts[0] == "crate" { 1 } else { supers };
        target.extend(parts[skip..].iter().map(|p| (*p).to_owned()));
        while !target.is_empty() && !krate.modules.contains_key(&target) {
            target.pop();
        }
        if target != module {
            found.insert(target);
        }
    }
    found
}

#[test]
fn no_two_sibling_files_import_each_other() {
    let mut circles = Vec::new();
    for krate in crates() {
        let edges: BTreeMap<&Vec<String>, BTreeSet<Vec<String>>> = krate
            .modules
            .iter()
            .map(|(m, path)| (m, imports(&krate, m, &code(path))))
            .collect();
        for (a, targets) in &edges {
            for b in targets {
                let nested = b.starts_with(a) || a.starts_with(b);
                if *a < b && !nested && edges.get(b).is_some_and(|t| t.contains(*a)) {
                    circles.push(format!(
                        "{}: {} <-> {}",
                        krate.src.display(),
                        a.join("::"),
                        b.join("::")
                    ));
                }
            }
        }
    }
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_scanner_sees_a_circle() {
    let krate = Crate {
        src: PathBuf::new(),
        modules: [vec![], vec!["a".to_owned()], vec!["b".to_owned()]]
            .into_iter()
            .map(|m| (m, PathBuf::new()))
            .collect(),
    };
    let a = imports(
        &krate,
        &["a".to_owned()],
        "use super::b::{X, Y};\nfn f() { crate::a::g() }",
    );
    assert_eq!(a, BTreeSet::from([vec!["b".to_owned()]]));
}

#[test]
fn only_the_driver_crate_has_unsafe_code() {
    for krate in crates() {
        let root_file = &krate.modules[&Vec::new()];
        let text = fs::read_to_string(root_file).expect("a crate root");
        let is_driver = krate.src.ends_with("crates/driver/src");
        assert!(
            is_driver || text.contains("#![forbid(unsafe_code)]"),
            "{} does not forbid unsafe code",
            root_file.display()
        );
    }
}

#[test]
fn no_source_file_is_over_the_limit() {
    let long: Vec<String> = crates()
        .iter()
        .flat_map(|k| k.modules.values())
        .filter_map(|path| {
            let lines = fs::read_to_string(path)
                .expect("a source file")
                .lines()
                .count();
            (lines > MAX_LINES).then(|| format!("{}: {lines} lines", path.display()))
        })
        .collect();
    assert!(
        long.is_empty(),
        "over {MAX_LINES} lines:\n{}",
        long.join("\n")
    );
}
