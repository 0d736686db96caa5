#!/usr/bin/env bash
# Fourth call: the A/B issue 30 asks for, eeb9cc6 (the issue's reference) against the
# session's code, then the session's start (2e9417b) against it: criterion's churn and
# 8-thread pairs, default and recommended set, alternated (ab.sh). Stripped bench
# binaries in target/probe23 (carried): bench_alloc_{eeb,base,head}, churn_{base,head}.
set -u
here=$(cd "$(dirname "$0")" && pwd)
A=eeb B=head ROUNDS=${ROUNDS:-4} bash "$here/ab.sh" | tail -12
A=base B=head ROUNDS=${ROUNDS:-4} bash "$here/ab.sh" | tail -16
