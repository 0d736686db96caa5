#!/usr/bin/env bash
# First call (sixteenth session): the continuous churn of the fifteenth session's final code
# (churn_final2, 5b9e66c) and this session's (churn_box, 36079c2), paired on core 3
# (../h200_2026-11-30e/ab.sh), then issue 30's table (../h200_2026-11-30e/table.sh). From
# the repository root with gpu-bundle.tar.xz and target/ab carried.
set -u
e=docs/measurements/h200_2026-11-30e
BUILDS="churn_final2 churn_box" ROUNDS=${ROUNDS:-12} bash $e/ab.sh > "$OUT/ab_box.txt" 2>&1
python3 docs/measurements/h200_2026-11-30d/paired.py "$OUT/ab_box.txt" churn_final2 churn_box
bash $e/table.sh 2>&1 | tee "$OUT/table_box.txt"
