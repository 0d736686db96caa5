#!/usr/bin/env bash
# Eighteenth session, first call: the bundle's GPU tests and compute-sanitizer (the
# conformance suite now also stages copies to pageable memory on the real driver, and
# compares a staged read with the driver's beside a capture on another stream), then the
# read probe (read_probe.rs, built here and carried in target/probe). From the repository
# root with gpu-bundle.tar.xz and target/probe carried.
set -u
nproc; lscpu | grep -E "Model name" | head -1
tar xJf gpu-bundle.tar.xz || exit 1
(cd gpu-bundle && FERROCUDA_REQUIRE_GPU=1 OUT=$OUT ONLY='^(test_.*|sanitize)$' bash run.sh > "$OUT/tests.log" 2>&1)
grep -E "^[0-9]+ passed" "$OUT/tests.log" | tail -1
grep -E "staged|pageable" "$OUT"/test_cuda_conformance.log | head
tail -1 "$OUT/sanitize.log"
rm -rf gpu-bundle
taskset -c 2-10 target/probe/read_probe 3 2>&1 | tee "$OUT/read_probe.log"
