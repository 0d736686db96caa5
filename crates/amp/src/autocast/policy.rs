//! Cast policies and the compiled lookup built once from the declarative rules in
//! [`tables`](super::tables) (PyTorch 2.15) and `tables_2_11` (PyTorch 2.11): op names are
//! interned to dense [`OpId`]s so that a policy lookup on the hot path is one array index.
//!
//! Which release's lists decide is process-wide ([`select_op_tables`]), 2.15's by default:
//! the newest lists, and the ones the rest of this crate's autocast behaviour was verified
//! against; a program that must match a PyTorch 2.11 installation selects 2.11's once.
use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

use rustc_hash::FxHashMap;

use super::device::DeviceKind;
pub use super::tables::CastPolicy;
use super::tables::{DEVICES_2_15, DeviceRules, Rule};
use super::tables_2_11::DEVICES_2_11;

/// Which PyTorch release's autocast lists decide the policies.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OpTables {
    /// PyTorch 2.15's (the default): no `Dimname` overloads, CPU without `cholesky` and
    /// `qr`, `rms_norm` fp32, `linalg_matrix_sqrth`.
    #[default]
    Pytorch2_15,
    /// PyTorch 2.11's, for programs that must match a PyTorch 2.11 installation.
    Pytorch2_11,
}

impl OpTables {
    /// Both, in index order.
    pub const ALL: [OpTables; 2] = [OpTables::Pytorch2_15, OpTables::Pytorch2_11];

    fn index(self) -> usize {
        self as usize
    }

    fn rules(self) -> &'static [DeviceRules] {
        match self {
            OpTables::Pytorch2_15 => DEVICES_2_15,
            OpTables::Pytorch2_11 => DEVICES_2_11,
        }
    }
}

/// The selected tables' index in [`OpTables::ALL`].
static SELECTED: AtomicU8 = AtomicU8::new(0);

/// Selects the release whose lists decide every later lookup, in every thread (PyTorch has
/// one set per build; select once, before autocasting).
pub fn select_op_tables(tables: OpTables) {
    SELECTED.store(tables.index() as u8, Ordering::Relaxed);
}

/// The release whose lists decide lookups now.
pub fn op_tables() -> OpTables {
    OpTables::ALL[usize::from(SELECTED.load(Ordering::Relaxed)) % OpTables::ALL.len()]
}

/// An op name interned once (`OpId::resolve`) so that repeated policy lookups skip hashing.
/// Ids are dense over the union of every device's ops and stable within a process.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(u16);

impl OpId {
    /// The id of an op listed on any device in either release's tables, `None` for an op
    /// autocast never touches.
    pub fn resolve(name: &str) -> Option<OpId> {
        compiled().index.get(name).copied()
    }

    /// The op's name (`op` or `op.overload`).
    pub fn name(self) -> &'static str {
        compiled()
            .names
            .get(usize::from(self.0))
            .copied()
            .unwrap_or("")
    }
}

/// The policy of `op` on `device` in the selected tables; `None` = not autocast-listed
/// there (runs as is).
#[inline]
pub fn policy(device: DeviceKind, op: OpId) -> Option<CastPolicy> {
    policy_in(op_tables(), device, op)
}

/// The policy of `op` on `device` in `tables`.
#[inline]
pub fn policy_in(tables: OpTables, device: DeviceKind, op: OpId) -> Option<CastPolicy> {
    compiled().by_device[tables.index()][device.index()]
        .get(usize::from(op.0))
        .copied()
        .flatten()
}

/// The policy of the op named `name` on `device` in the selected tables; unknown names are
/// not listed.
pub fn policy_by_name(device: DeviceKind, name: &str) -> Option<CastPolicy> {
    OpId::resolve(name).and_then(|op| policy(device, op))
}

/// Every op listed on `device` in the selected tables with its policy, sorted by name.
pub fn listed_ops(device: DeviceKind) -> impl Iterator<Item = (&'static str, CastPolicy)> {
    listed_ops_in(op_tables(), device)
}

/// Every op listed on `device` in `tables` with its policy, sorted by name.
pub fn listed_ops_in(
    tables: OpTables,
    device: DeviceKind,
) -> impl Iterator<Item = (&'static str, CastPolicy)> {
    let t = compiled();
    t.names
        .iter()
        .zip(&t.by_device[tables.index()][device.index()])
        .filter_map(|(name, p)| p.map(|p| (*name, p)))
}

/// Every op listed on at least one device in the selected tables, sorted by name.
pub fn all_listed_ops() -> &'static [&'static str] {
    &compiled().listed[op_tables().index()]
}

/// One release's tables, applied: each device kind with its ops.
type Applied = Vec<(DeviceKind, BTreeMap<&'static str, CastPolicy>)>;

/// The compiled tables: names interned over both releases, one dense policy row per
/// (release, device kind), and each release's listed names.
#[derive(Debug)]
struct Tables {
    names: Vec<&'static str>,
    index: FxHashMap<&'static str, OpId>,
    by_device: [[Vec<Option<CastPolicy>>; DeviceKind::COUNT]; OpTables::ALL.len()],
    listed: [Vec<&'static str>; OpTables::ALL.len()],
}

#[inline]
fn compiled() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(compile)
}

fn compile() -> Tables {
    let applied: [Applied; OpTables::ALL.len()] = OpTables::ALL.map(|t| {
        t.rules()
            .iter()
            .map(|d| (d.device, apply(d.rules, &mut Vec::new())))
            .collect()
    });
    let names_of = |per_device: &Applied| {
        let mut names: Vec<&'static str> = per_device
            .iter()
            .flat_map(|(_, ops)| ops.keys().copied())
            .collect();
        names.sort_unstable();
        names.dedup();
        names
    };
    let listed = applied.each_ref().map(names_of);
    let mut names: Vec<&'static str> = listed.iter().flatten().copied().collect();
    names.sort_unstable();
    names.dedup();
    let index = names
        .iter()
        .enumerate()
        .map(|(i, n)| (*n, OpId(i as u16)))
        .collect();
    let by_device = applied.each_ref().map(|per_device| {
        DeviceKind::ALL.map(|kind| {
            let ops = per_device.iter().find(|(d, _)| *d == kind).map(|(_, o)| o);
            names
                .iter()
                .map(|n| ops.and_then(|o| o.get(n).copied()))
                .collect()
        })
    });
    Tables {
        names,
        index,
        by_device,
        listed,
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
fn rule_problems() -> Vec<(OpTables, DeviceKind, String)> {
    OpTables::ALL
        .iter()
        .flat_map(|t| t.rules().iter().map(move |d| (*t, d)))
        .flat_map(|(t, d)| {
            let mut problems = Vec::new();
            apply(d.rules, &mut problems);
            problems.into_iter().map(move |p| (t, d.device, p))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_are_consistent() {
        assert_eq!(
            rule_problems(),
            Vec::<(OpTables, DeviceKind, String)>::new()
        );
    }

    #[test]
    fn op_ids_round_trip() {
        for name in &compiled().names {
            let id = OpId::resolve(name);
            assert_eq!(id.map(OpId::name), Some(*name));
        }
        assert_eq!(OpId::resolve("add"), None);
        assert_eq!(OpId::resolve("addmm_"), None);
    }

    #[test]
    fn lookup_by_id_matches_listing() {
        for t in OpTables::ALL {
            for d in DeviceKind::ALL {
                for (name, p) in listed_ops_in(t, d) {
                    assert_eq!(
                        OpId::resolve(name).and_then(|op| policy_in(t, d, op)),
                        Some(p)
                    );
                }
            }
        }
    }
}
