#!/usr/bin/env bash
# Third call (d69c394, the session's allocator code: the credit check's walk and the lone
# frontier block taken without a walk): call1.sh again (the bundle's tests, sanitize, issue
# 30's table, paired_alloc), then call2.sh's 8-thread A/B of 74b7ff2 (bench_alloc_walk)
# against 8dc76af (bench_alloc_alone), four rounds. From the repository root with
# gpu-bundle.tar.xz and target/probe22 carried.
set -u
start=$SECONDS
bash docs/measurements/h200_2026-12-01b/call1.sh
A=walk B=alone ROUNDS=4 bash docs/measurements/h200_2026-12-01b/call2.sh
echo "total: $((SECONDS - start)) s"
