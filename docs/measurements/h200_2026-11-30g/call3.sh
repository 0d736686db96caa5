#!/usr/bin/env bash
# Third bundle call (4bc6cf4): the conformance suite on the real driver, with the new
# `staged_copies_leave_a_capture_elsewhere_intact` (a staged copy beside a capture on another
# stream, each mode and from another thread), and compute-sanitizer. From the repository root
# with gpu-bundle.tar.xz carried.
set -u
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
export FERROCUDA_REQUIRE_GPU=1
OUT=$OUT ONLY='^(test_.*|sanitize)$' bash run.sh > "$OUT/tests.log" 2>&1
grep -E "^[0-9]+ passed" "$OUT/tests.log" | tail -1
grep -E "staged|pageable" "$OUT"/test_cuda_conformance.log | head
tail -1 "$OUT/sanitize.log"
