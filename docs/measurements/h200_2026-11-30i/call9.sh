#!/usr/bin/env bash
# Ninth call (a5a60ed): the bundle's new paired_copies step (run.sh: criterion's h2d/ and
# d2h/pageable_64MiB alternated with torch_copies.py round by round, eight rounds). From the
# repository root with gpu-bundle.tar.xz carried.
set -u
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
OUT=$OUT ONLY='^paired_copies$' bash run.sh 2>&1 | tail -4
cat "$OUT/paired_copies.txt"
