//! `docs/amp_op_policies.md` is generated from the policy tables; this test fails when the
//! committed page is stale. Regenerate with
//! `FERROCUDA_BLESS=1 cargo test -p ferrocuda-amp --test amp_scenarios op_policy_page`.
use std::error::Error;
use std::path::PathBuf;

#[test]
fn committed_op_policy_page_is_current() -> Result<(), Box<dyn Error>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/amp_op_policies.md");
    let page = ferrocuda_amp::autocast::op_policy_page();
    if std::env::var_os("FERROCUDA_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &page)?;
        return Ok(());
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == page,
        "docs/amp_op_policies.md is stale: run \
         `FERROCUDA_BLESS=1 cargo test -p ferrocuda-amp --test amp_scenarios op_policy_page` and commit it"
    );
    Ok(())
}

#[test]
fn the_page_lists_every_op_and_the_counts() {
    let page = ferrocuda_amp::autocast::op_policy_page();
    for op in ferrocuda_amp::autocast::all_listed_ops() {
        assert!(page.contains(&format!("| `{op}` |")), "{op}");
    }
    assert!(page.contains("| cuda | 121 |") && page.contains("| mps | 95 |"));
}
