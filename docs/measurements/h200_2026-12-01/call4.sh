#!/usr/bin/env bash
# Fourth call (the session's final allocator, bd13ada): the bundle's GPU tests and
# compute-sanitizer, then issue 30's table, as call1.sh. From the repository root with
# gpu-bundle.tar.xz carried.
set -u
bash docs/measurements/h200_2026-12-01/call1.sh
