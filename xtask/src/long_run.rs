//! `cargo xtask alloc-fuzz`, `thread-diff` and `graph-fuzz`: long release runs of the
//! randomized tests (the allocator's fuzz, the cross-thread differential test, the graph
//! data-integrity fuzz), their sizes and seeds set from the command line.

use crate::cargo_with_env;

/// A long run of one of the randomized tests in release: each `--name N` option of
/// `options` (flag, environment variable, default) sets that variable.
pub(crate) struct LongRun {
    task: &'static str,
    /// `cargo test` selects the test binary with these.
    select: &'static [&'static str],
    options: &'static [(&'static str, &'static str, &'static str)],
}

/// `alloc-fuzz [--programs N] [--seed S]`: `crates/alloc/tests/alloc_fuzz.rs`.
pub(crate) const ALLOC_FUZZ: LongRun = LongRun {
    task: "alloc-fuzz",
    select: &["-p", "ferrocuda-alloc", "--test", "alloc_fuzz"],
    options: &[
        ("--programs", "FERROCUDA_FUZZ_PROGRAMS", "100000"),
        ("--seed", "FERROCUDA_FUZZ_SEED", "20261123"),
    ],
};

/// `thread-diff [--scripts N] [--seed S]`: `crates/alloc/tests/alloc_diff.rs`.
pub(crate) const THREAD_DIFF: LongRun = LongRun {
    task: "thread-diff",
    select: &["-p", "ferrocuda-alloc", "--test", "alloc_diff"],
    options: &[
        ("--scripts", "FERROCUDA_DIFF_CASES", "100000"),
        ("--seed", "FERROCUDA_DIFF_SEED", "1592590336"),
    ],
};

/// `graph-fuzz [--programs N] [--seed S]`: the graph data-integrity fuzz
/// (`crates/graph/tests/graph_fuzz.rs`).
pub(crate) const GRAPH_FUZZ: LongRun = LongRun {
    task: "graph-fuzz",
    select: &["-p", "ferrocuda-graph", "--test", "graph_fuzz"],
    options: &[
        ("--programs", "FERROCUDA_GRAPH_FUZZ_PROGRAMS", "10000"),
        ("--seed", "FERROCUDA_GRAPH_FUZZ_SEED", "20261205"),
    ],
};

impl LongRun {
    pub(crate) fn run(&self, args: &[String]) -> Result<(), String> {
        let mut values: Vec<(&str, String)> = self
            .options
            .iter()
            .map(|(_, var, default)| (*var, (*default).to_owned()))
            .collect();
        let usage = || {
            let flags: Vec<String> = self
                .options
                .iter()
                .map(|(f, _, _)| format!("[{f} N]"))
                .collect();
            format!("{} {}", self.task, flags.join(" "))
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let i = self
                .options
                .iter()
                .position(|(flag, _, _)| flag == a)
                .ok_or_else(|| format!("unknown option {a}: {}", usage()))?;
            let value = it.next().ok_or(format!("{a} needs a number"))?;
            value
                .parse::<u64>()
                .map_err(|e| format!("{a} {value}: {e}"))?;
            values[i].1 = value.clone();
        }
        let env: Vec<(&str, &str)> = values.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut cmd = vec!["test", "--release"];
        cmd.extend_from_slice(self.select);
        cmd.extend_from_slice(&["--", "--nocapture"]);
        cargo_with_env(&cmd, &env)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each long run selects a test binary of the package it names.
    #[test]
    fn each_long_run_selects_a_test_that_exists() -> Result<(), String> {
        let targets = crate::workspace_targets()?;
        for run in [&ALLOC_FUZZ, &THREAD_DIFF, &GRAPH_FUZZ] {
            let after = |flag: &str| {
                let at = run.select.iter().position(|a| *a == flag);
                at.and_then(|i| run.select.get(i + 1)).copied()
            };
            let (package, test) = (after("-p"), after("--test"));
            assert!(
                targets.iter().any(|t| Some(t.package.as_str()) == package
                    && t.kind == "test"
                    && Some(t.name.as_str()) == test),
                "{}: no test {test:?} in {package:?}",
                run.task
            );
        }
        Ok(())
    }
}
