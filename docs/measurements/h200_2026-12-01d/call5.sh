#!/usr/bin/env bash
# Fifth call (the bundle at the session's code, benches built with fat LTO): the bundle's
# GPU tests, compute-sanitizer and issue 30's table (../h200_2026-12-01/call1.sh), then the
# bundle's paired_alloc step. From the repository root with gpu-bundle.tar.xz carried.
exec bash docs/measurements/h200_2026-12-01/call6.sh
