#!/usr/bin/env bash
# First call: issue 30's table as the twenty-fifth session ran it (../h200_2026-11-30e/table.sh:
# every bench and PyTorch's anchors on cores 2-10), over the bundle built at aea403f.
# From the repository root with gpu-bundle.tar.xz carried.
set -u
bash docs/measurements/h200_2026-11-30e/table.sh
