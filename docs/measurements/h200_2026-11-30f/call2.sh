#!/usr/bin/env bash
# Second call: the bundle's tests and compute-sanitizer step, the A/B against eeb9cc6
# (../h200_2026-11-30e/ab_eeb.sh, criterion's churn of both, interleaved on core 3), and
# the paired churn of call1.sh again. From the repository root with gpu-bundle.tar.xz and
# target/ab carried.
set -u
e=docs/measurements/h200_2026-11-30e
tar xJf gpu-bundle.tar.xz || exit 1
(cd gpu-bundle && FERROCUDA_REQUIRE_GPU=1 OUT=$OUT ONLY='^(test_.*|sanitize)$' bash run.sh > "$OUT/tests.log" 2>&1)
grep -E "^[0-9]+ passed|^sanitize" "$OUT/tests.log"
ROUNDS=4 bash $e/ab_eeb.sh > "$OUT/ab_eeb.log" 2>&1; tail -1 "$OUT/ab_eeb.log"
BUILDS="churn_final2 churn_box" ROUNDS=${ROUNDS:-8} bash $e/ab.sh > "$OUT/ab_box2.txt" 2>&1
python3 docs/measurements/h200_2026-11-30d/paired.py "$OUT/ab_box2.txt" churn_final2 churn_box
