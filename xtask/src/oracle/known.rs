//! Differences from PyTorch that the oracle found in ferrocuda's allocator and that are not
//! fixed yet. Each is reported on every run; `--strict` makes them fail. A program on the
//! list that has become equal fails the run, so the list only ever shrinks.
//! `docs/measurements/oracle_h100_2026-11-23.md` has each class's minimal program.

/// Class A: freeing a block whose merge leaves it split moves `inactive_split` by the net
/// change in PyTorch (`free_block` sums the merged neighbours and the result, then applies
/// one increase or decrease); ferrocuda applies a decrease per merged neighbour and then an
/// increase, so the `allocated` and `freed` counters of `inactive_split` and
/// `inactive_split_bytes` grow by the same extra amount (current and peak agree).
pub(crate) const CLASS_A: &str = "A";

/// The statistics keys of class A.
pub(crate) fn key_class(key: &str) -> Option<&'static str> {
    let family = key.split('.').next()?;
    let counter = key.rsplit('.').next()?;
    let inactive = family == "inactive_split" || family == "inactive_split_bytes";
    (inactive && (counter == "allocated" || counter == "freed")).then_some(CLASS_A)
}

/// Programs known to differ beyond class A, with their class:
/// - B: with expandable segments, mapping pages for a request that an unmapped range
///   covers on its own leaves the newly mapped remainder beside a free mapped block
///   instead of merging them (PyTorch's `map_block` merges with both neighbours), so later
///   best fits, mappings and `empty_cache` unmaps differ (`reserved_bytes`,
///   `num_device_alloc`, `num_device_free`);
/// - C: with expandable segments, `garbage_collection_threshold` and a memory fraction,
///   ferrocuda takes the free-everything-and-retry path once more than PyTorch
///   (`num_alloc_retries`), with no class B state before it; cause not located.
pub(crate) const KNOWN_PROGRAMS: &[(&str, &str)] = &[
    ("exp-101", "B"),
    ("exp-102", "B"),
    ("exp-103", "C"),
    ("exp-104", "B"),
];

/// The known class of program `name`, if it is on the list.
pub(crate) fn program_class(name: &str) -> Option<&'static str> {
    KNOWN_PROGRAMS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, class)| *class)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_a_is_the_accumulated_inactive_split_counters_only() {
        assert_eq!(key_class("inactive_split.all.allocated"), Some(CLASS_A));
        assert_eq!(
            key_class("inactive_split_bytes.small_pool.freed"),
            Some(CLASS_A)
        );
        assert_eq!(key_class("inactive_split.all.current"), None);
        assert_eq!(key_class("inactive_split_bytes.large_pool.peak"), None);
        assert_eq!(key_class("active_bytes.all.freed"), None);
        assert_eq!(program_class("exp-103"), Some("C"));
        assert_eq!(program_class("seed-1"), None);
    }
}
