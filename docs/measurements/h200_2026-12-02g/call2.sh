#!/usr/bin/env bash
# Second call: issue 30's table in fourteen rounds, with the A/B against eeb9cc6, from the
# bundle built at 49739aa (the recommended set with `expandable_segments_small_page_bound`).
# Written straight into $OUT, so that a run cut short still brings back its rounds.
# From the repository root with gpu-bundle.tar.xz and target/ab/alloc_eeb carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb gpu-bundle/ || exit 1
cd gpu-bundle || exit 1
mkdir -p "$OUT/t"
OUT="$OUT/t" ONLY='^issue_table$' TABLE_ROUNDS=14 AB_ALLOC=alloc_eeb bash run.sh > "$OUT/t/run.log" 2>&1
tail -24 "$OUT/t/run.log"
echo "total: $((SECONDS - start)) s"
