#!/usr/bin/env bash
# Fifth call: the default configuration against the recommended set, paired: criterion's
# `alloc/pair_1MiB_8threads` and `alloc/churn_1024_live` and their `_recommended` twins from
# the bundle's bench binary (ce9b9b1), one bench per run, the four in a rotated order each
# round, ROUNDS rounds, on cores 2-10. Each line: round, bench, criterion's median estimate.
set -u
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
export FERROCUDA_REQUIRE_GPU=1
names=(pair_1MiB_8threads pair_1MiB_8threads_recommended churn_1024_live churn_1024_live_recommended)
for r in $(seq 1 "${ROUNDS:-8}"); do
  for k in 0 1 2 3; do
    name=${names[$(( (k + r) % 4 ))]}
    t=$(taskset -c 2-10 ./bench_alloc --bench "^alloc/${name}\$" --warm-up-time 0.5 \
      --measurement-time 1.5 2>&1 | grep -m1 "time:" | sed -E 's/.*time: +\[[^ ]+ [^ ]+ ([^ ]+) ([^ ]+) .*/\1 \2/')
    echo "$r $name $t"
  done
done | tee "$OUT/paired.txt"
