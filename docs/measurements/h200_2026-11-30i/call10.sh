#!/usr/bin/env bash
# Tenth call (f70d7d1): the bundle's two paired steps (run.sh: paired_copies, criterion's
# pageable copies against torch_copies.py; paired_alloc, the recommended set's churn and
# 8-thread pairs against the default's), eight rounds each. From the repository root with
# gpu-bundle.tar.xz carried.
set -u
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
OUT=$OUT ONLY='^paired_(copies|alloc)$' bash run.sh 2>&1 | grep -E "^(paired|===|[0-9]+ passed)"
