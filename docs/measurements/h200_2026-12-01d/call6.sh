#!/usr/bin/env bash
# Sixth call: criterion's churn and 8-thread pairs (default and recommended set) alternated
# round by round (../h200_2026-12-01c/ab.sh): the plain release build against fat LTO,
# both at the session's allocator code, six rounds, with the churn example the same way
# (real driver); then eeb9cc6 against fat LTO, four rounds. Stripped binaries carried in
# target/probe24: bench_alloc_{plain,fat,eeb}, churn_{plain,fat}.
set -u
start=$SECONDS
P=target/probe24 A=plain B=fat ROUNDS=6 bash docs/measurements/h200_2026-12-01c/ab.sh | tail -14
P=target/probe24 A=eeb B=fat ROUNDS=4 bash docs/measurements/h200_2026-12-01c/ab.sh | tail -6
echo "total: $((SECONDS - start)) s"
