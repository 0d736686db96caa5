#!/usr/bin/env bash
# First call (74b7ff2: the thread cache's credit check runs best fit's walk): the bundle's
# GPU tests, compute-sanitizer, issue 30's table and the bundle's paired_alloc step, as the
# previous session's sixth call ran them. From the repository root with
# gpu-bundle.tar.xz carried.
exec bash docs/measurements/h200_2026-12-01/call6.sh
