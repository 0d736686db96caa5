#!/usr/bin/env bash
# Third call: issue 30's table again, nine rounds (cores 2 to 10 in turn), with eeb9cc6's
# bench_alloc in every round; then paired_reclaim (the recommended set against
# expandable_segments:True alone, six rounds), to see whether page reclaim is what made the
# recommended churn slower in half of call 1's rounds.
# From the repository root with gpu-bundle.tar.xz and target/ab/alloc_eeb carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb gpu-bundle/ || exit 1
cd gpu-bundle || exit 1
mkdir -p /tmp/t
OUT=/tmp/t ONLY='^issue_table$' TABLE_ROUNDS=9 AB_ALLOC=alloc_eeb bash run.sh > /tmp/t/run.log 2>&1
tail -25 /tmp/t/run.log
echo "=== table: $((SECONDS - start)) s"
OUT=/tmp/t PAIRED_ROUNDS=6 ONLY='^paired_reclaim$' bash run.sh > /tmp/t/reclaim.log 2>&1
tail -4 /tmp/t/reclaim.log
cp /tmp/t/run.log /tmp/t/issue_table.txt /tmp/t/torch_table.log /tmp/t/reclaim.log /tmp/t/paired_reclaim.txt "$OUT/" 2>/dev/null
echo "total: $((SECONDS - start)) s"
