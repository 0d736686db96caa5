#!/usr/bin/env bash
# Fourth call: issue 30's table again in eight rounds (run.sh's issue_table step, the rounds'
# single-threaded figures on cores 2 to 9 in turn), with eeb9cc6's bench_alloc
# (target/ab/alloc_eeb) in every round as the A/B reference.
# From the repository root with gpu-bundle.tar.xz and target/ab/alloc_eeb carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb gpu-bundle/ || exit 1
cd gpu-bundle || exit 1
mkdir -p /tmp/t
OUT=/tmp/t ONLY='^issue_table$' TABLE_ROUNDS=8 AB_ALLOC=alloc_eeb bash run.sh > /tmp/t/run.log 2>&1
tail -25 /tmp/t/run.log
cp /tmp/t/run.log /tmp/t/issue_table.txt /tmp/t/torch_table.log "$OUT/" 2>/dev/null
echo "total: $((SECONDS - start)) s"
