#!/usr/bin/env bash
# Eleventh call: the two PyTorch anchors after torch_pinned.py took its copy timing from
# torch_copies.py's `rate` (the review's deduplication): both run, and print figures.
set -u
cd xtask/anchors || exit 1
taskset -c 2-10 python3 torch_copies.py
OUT=$OUT taskset -c 2-10 python3 torch_pinned.py 2>&1 | tail -12
