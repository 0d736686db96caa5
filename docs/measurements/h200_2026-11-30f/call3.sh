#!/usr/bin/env bash
# Third call: issue 30's table again (../h200_2026-11-30e/table.sh), then the paired churn
# of call1.sh for six rounds. From the repository root with gpu-bundle.tar.xz and target/ab
# carried.
set -u
e=docs/measurements/h200_2026-11-30e
bash $e/table.sh 2>&1 | tee "$OUT/table_final.txt"
BUILDS="churn_final2 churn_box" ROUNDS=${ROUNDS:-6} bash $e/ab.sh > "$OUT/ab_box3.txt" 2>&1
python3 docs/measurements/h200_2026-11-30d/paired.py "$OUT/ab_box3.txt" churn_final2 churn_box
