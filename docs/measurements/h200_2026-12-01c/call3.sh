#!/usr/bin/env bash
# Third call (the session's allocator code, 0a9212d): the bundle's GPU tests,
# compute-sanitizer, issue 30's table and the paired_alloc step, as the twentieth session's
# sixth call ran them. From the repository root with gpu-bundle.tar.xz carried.
exec bash docs/measurements/h200_2026-12-01/call6.sh
