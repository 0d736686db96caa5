#!/usr/bin/env bash
# Second call (2f61e31: the slot fixes, copy_to_host, the legacy-stream case): the bundle's
# GPU tests and compute-sanitizer, then the read probe (read_probe.rs built at 2f61e31 and
# carried in target/probe: into a Vec used again and into a new one). From the repository
# root with gpu-bundle.tar.xz and target/probe carried.
set -u
nproc; lscpu | grep -E "Model name" | head -1
tar xJf gpu-bundle.tar.xz || exit 1
(cd gpu-bundle && FERROCUDA_REQUIRE_GPU=1 OUT=$OUT ONLY='^(test_.*|sanitize)$' bash run.sh > "$OUT/tests.log" 2>&1)
grep -E "^[0-9]+ passed" "$OUT/tests.log" | tail -1
grep -E "staged|pageable" "$OUT"/test_cuda_conformance.log | head
tail -1 "$OUT/sanitize.log"
rm -rf gpu-bundle
taskset -c 2-10 target/probe/read_probe 2 2>&1 | tee "$OUT/read_probe.log"
