#!/usr/bin/env bash
# Fourth call (the bundle at aea403f, the last device seconds): issue 30's table alone
# (../h200_2026-11-30e/table.sh), hoping for a faster phase of the host. From the
# repository root with gpu-bundle.tar.xz carried.
set -u
bash docs/measurements/h200_2026-11-30e/table.sh
