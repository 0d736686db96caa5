#!/usr/bin/env bash
# The session's final call: the continuous churn of 8507d38 (churn_base), f5a6645
# (churn_map: address map and in-place split) and 19dd5a9 (churn_head), paired on core 3;
# issue 30's table; the bundle's tests; the A/B against eeb9cc6. From the repository root
# with gpu-bundle.tar.xz and target/ab carried.
set -u
here=docs/measurements/h200_2026-11-30e
BUILDS="churn_base churn_map churn_head" ROUNDS=${ROUNDS:-10} bash $here/ab.sh > "$OUT/ab_final.txt" 2>&1
python3 docs/measurements/h200_2026-11-30d/paired.py "$OUT/ab_final.txt" churn_base churn_map churn_head
bash $here/table.sh 2>&1 | tee "$OUT/table.txt"
(cd gpu-bundle && FERROCUDA_REQUIRE_GPU=1 OUT=$OUT ONLY='^(test_.*|sanitize)$' bash run.sh > "$OUT/tests.log" 2>&1; grep -E "^[0-9]+ passed|^sanitize" "$OUT/tests.log")
ROUNDS=4 bash $here/ab_eeb.sh > "$OUT/ab_eeb.log" 2>&1; tail -1 "$OUT/ab_eeb.log"
