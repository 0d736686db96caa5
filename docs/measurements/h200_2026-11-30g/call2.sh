#!/usr/bin/env bash
# Second bundle call (b24fc99: staged copies in the relaxed capture mode, the slot bound
# counting lent slots): the bundle's GPU tests and compute-sanitizer, then PyTorch's pinned
# anchor and the pinned bench (pageable rows). From the repository root with
# gpu-bundle.tar.xz carried.
set -u
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
export FERROCUDA_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
OUT=$OUT ONLY='^(test_.*|sanitize)$' bash run.sh > "$OUT/tests.log" 2>&1
grep -E "^[0-9]+ passed|sanitize: [0-9]+ passed" "$OUT/tests.log" "$OUT/sanitize.log" | tail -3
OUT=$OUT taskset -c 2-10 python3 torch_pinned.py > "$OUT/torch_pinned.log" 2>&1; tail -2 "$OUT/torch_pinned.log"
OUT=$OUT ONLY='^bench_pinned$' bash run.sh > "$OUT/bench.log" 2>&1
sed -n '/pinned host memory/,$p' "$OUT/bench.log" | head -14
rm -rf "$OUT"/criterion/*/*/report "$OUT"/criterion/*/report
