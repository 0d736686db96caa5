#!/bin/bash
# A/B of churn example builds, alternated round by round, pinned to one core.
# usage: ab_ex.sh ROUNDS CORE bin1 bin2 ...
R=$1; C=$2; shift 2
for shape in mixed pairs; do for conf in "" "ferrocuda_recommended:True"; do
  for r in $(seq $R); do for b in "$@"; do
    v=$(FERROCUDA_BACKEND=fake taskset -c $C ./$b "$conf" 2000000 3 $shape | sed -n 's/.*operation //p')
    echo "$shape ${conf:-default} $b $v"
  done; done
done; done
