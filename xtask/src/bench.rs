//! `cargo xtask bench`: the criterion benches (they need a GPU; without one they say they
//! skipped), all but the two-GPU one.

use crate::cargo;

/// The several-GPU bench (`ferrocuda-dist`) fails on fewer than two GPUs:
/// `MULTI_GPU=1 run.sh` runs it.
pub(crate) fn bench() -> Result<(), String> {
    cargo(&["bench", "--workspace", "--exclude", "ferrocuda-dist"])
}
