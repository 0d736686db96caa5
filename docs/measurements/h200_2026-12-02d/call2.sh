#!/usr/bin/env bash
# Second call: issue 30's table in eight rounds (run.sh's issue_table step) with the A/B
# against eeb9cc6 (target/ab/alloc_eeb, copied into the bundle), while /proc/stat is
# sampled every second: each core's steal time (the hypervisor running something else on
# it) tells whether the host's slow phases are time taken from the measured cores.
# From the repository root with gpu-bundle.tar.xz and target/ab carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb gpu-bundle/ || exit 1
(while :; do echo "t $SECONDS"; grep -E "^cpu[0-9]+ " /proc/stat; sleep 1; done) > "$OUT/procstat.txt" &
sampler=$!
cd gpu-bundle || exit 1
mkdir -p /tmp/t
OUT=/tmp/t ONLY='^issue_table$' TABLE_ROUNDS=8 AB_ALLOC=alloc_eeb bash run.sh > /tmp/t/run.log 2>&1
kill $sampler
tail -30 /tmp/t/run.log
cp /tmp/t/issue_table.txt /tmp/t/issue_table.log /tmp/t/run.log "$OUT/" 2>/dev/null
cp /tmp/t/torch_table.log "$OUT/" 2>/dev/null
echo "total: $((SECONDS - start)) s"
