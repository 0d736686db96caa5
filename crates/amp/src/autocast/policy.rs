//! Cast policies and the compiled lookup built once from the declarative rules in
//! [`tables`](super::tables): op names are interned to dense [`OpId`]s so that a policy
//! lookup on the hot path is one array index.
use std::collections::BTreeMap;
use std::sync::OnceLock;

use rustc_hash::FxHashMap;

use super::device::DeviceKind;
pub use super::tables::CastPolicy;
use super::tables::{DEVICES, Rule};

/// An op name interned once (`OpId::resolve`) so that repeated policy lookups skip hashing.
/// Ids are dense over the union of every device's ops and stable within a process.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(u16);

impl OpId {
    /// The id of an op listed on any device, `None` for an op autocast never touches.
    pub fn resolve(name: &str) -> Option<OpId> {
        tables().index.get(name).copied()
    }

    /// The op's name (`op` or `op.overload`).
    pub fn name(self) -> &'static str {
        tables()
            .names
            .get(usize::from(self.0))
            .copied()
            .unwrap_or("")
    }
}

/// The policy of `op` on `device`; `None` = not autocast-listed there (runs as is).
#[inline]
pub fn policy(device: DeviceKind, op: OpId) -> Option<CastPolicy> {
    tables().by_device[device.index()]
        .get(usize::from(op.0))
        .copied()
        .flatten()
}

/// The policy of the op named `name` on `device`; unknown names are not listed.
pub fn policy_by_name(device: DeviceKind, name: &str) -> Option<CastPolicy> {
    OpId::resolve(name).and_then(|op| policy(device, op))
}

/// Every op listed on `device` with its policy, sorted by name.
pub fn listed_ops(device: DeviceKind) -> impl Iterator<Item = (&'static str, CastPolicy)> {
    let t = tables();
    t.names
        .iter()
        .zip(&t.by_device[device.index()])
        .filter_map(|(name, p)| p.map(|p| (*name, p)))
}

/// Every op listed on at least one device, sorted by name.
pub fn all_listed_ops() -> &'static [&'static str] {
    &tables().names
}

/// The compiled tables: interned names and one dense policy row per device kind.
#[derive(Debug)]
struct Tables {
    names: Vec<&'static str>,
    index: FxHashMap<&'static str, OpId>,
    by_device: [Vec<Option<CastPolicy>>; DeviceKind::COUNT],
}

#[inline]
fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(compile)
}

fn compile() -> Tables {
    let per_device: Vec<(DeviceKind, BTreeMap<&'static str, CastPolicy>)> = DEVICES
        .iter()
        .map(|d| (d.device, apply(d.rules, &mut Vec::new())))
        .collect();
    let mut names: Vec<&'static str> = per_device
        .iter()
        .flat_map(|(_, ops)| ops.keys().copied())
        .collect();
    names.sort_unstable();
    names.dedup();
    let index = names
        .iter()
        .enumerate()
        .map(|(i, n)| (*n, OpId(i as u16)))
        .collect();
    let by_device = DeviceKind::ALL.map(|kind| {
        let ops = per_device.iter().find(|(d, _)| *d == kind).map(|(_, o)| o);
        names
            .iter()
            .map(|n| ops.and_then(|o| o.get(n).copied()))
            .collect()
    });
    Tables {
        names,
        index,
        by_device,
    }
}

/// Applies rules to an empty table; each rule that does not do what it says (adds an op
/// already there, removes or overrides one that is not) is reported in `problems`.
fn apply(rules: &'static [Rule], problems: &mut Vec<String>) -> BTreeMap<&'static str, CastPolicy> {
    let mut ops = BTreeMap::new();
    apply_into(rules, &mut ops, problems);
    ops
}

fn apply_into(
    rules: &'static [Rule],
    ops: &mut BTreeMap<&'static str, CastPolicy>,
    problems: &mut Vec<String>,
) {
    for rule in rules {
        match rule {
            Rule::Include(inner) => apply_into(inner, ops, problems),
            Rule::Add(policy, names) => {
                for n in *names {
                    if ops.insert(*n, *policy).is_some() {
                        problems.push(format!("add of `{n}`, already registered"));
                    }
                }
            }
            Rule::Remove(names) => {
                for n in *names {
                    if ops.remove(n).is_none() {
                        problems.push(format!("remove of `{n}`, not registered"));
                    }
                }
            }
            Rule::Override(policy, names) => {
                for n in *names {
                    match ops.get_mut(n) {
                        Some(p) if p != policy => *p = *policy,
                        Some(_) => problems.push(format!("override of `{n}` changes nothing")),
                        None => problems.push(format!("override of `{n}`, not registered")),
                    }
                }
            }
        }
    }
}

/// Every rule of the declarative tables that does not do what it says, per device (empty
/// when the tables are consistent; a test keeps it so).
#[cfg(test)]
fn rule_problems() -> Vec<(DeviceKind, String)> {
    DEVICES
        .iter()
        .flat_map(|d| {
            let mut problems = Vec::new();
            apply(d.rules, &mut problems);
            problems.into_iter().map(move |p| (d.device, p))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_are_consistent() {
        assert_eq!(rule_problems(), Vec::<(DeviceKind, String)>::new());
    }

    #[test]
    fn op_ids_round_trip() {
        for name in all_listed_ops() {
            let id = OpId::resolve(name);
            assert_eq!(id.map(OpId::name), Some(*name));
        }
        assert_eq!(OpId::resolve("add"), None);
        assert_eq!(OpId::resolve("addmm_"), None);
    }

    #[test]
    fn lookup_by_id_matches_listing() {
        for d in DeviceKind::ALL {
            for (name, p) in listed_ops(d) {
                assert_eq!(policy_by_name(d, name), Some(p));
            }
        }
    }
}
