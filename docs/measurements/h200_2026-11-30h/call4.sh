#!/usr/bin/env bash
# Fourth call (ce9b9b1: reads staged from 16 MiB with 2 threads or more; sanitize.sh's list
# fixed): the bundle's GPU tests and compute-sanitizer. From the repository root with
# gpu-bundle.tar.xz carried.
set -u
tar xJf gpu-bundle.tar.xz || exit 1
(cd gpu-bundle && FERROCUDA_REQUIRE_GPU=1 OUT=$OUT ONLY='^(test_.*|sanitize)$' bash run.sh > "$OUT/tests.log" 2>&1)
grep -E "^[0-9]+ passed" "$OUT/tests.log" | tail -1
grep -E "staged|pageable" "$OUT"/test_cuda_conformance.log | head
grep -E "^sanitize" "$OUT/sanitize.log" | grep -vE ": ok$"
