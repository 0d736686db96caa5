#!/usr/bin/env bash
# Third call: call 2's A/B again (fc79e43 against 991be14, both built as the bundle builds
# them), twelve alternated rounds, to see whether the 8-thread pairs' higher medians in
# call 2 repeat. From the repository root with target/probe25 carried.
set -u
start=$SECONDS
P=target/probe25 A=final B=new ROUNDS=12 bash docs/measurements/h200_2026-12-01c/ab.sh | tail -12
echo "total: $((SECONDS - start)) s"
