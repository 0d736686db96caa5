#!/usr/bin/env bash
# Third call, from the bundle built at 81cee7b (the final allocator code): the allocator's
# conformance suite on the H200 (the recommended set's data-integrity fuzz and small blocks
# inside their pages over the real virtual-memory API among it), then issue 30's table
# again in ten rounds, with the A/B against eeb9cc6. Written straight into $OUT.
# From the repository root with gpu-bundle.tar.xz and target/ab/alloc_eeb carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb gpu-bundle/ || exit 1
cd gpu-bundle || exit 1
mkdir -p "$OUT/c" "$OUT/t"
OUT="$OUT/c" ONLY='^test_alloc_conformance$' bash run.sh > "$OUT/c/run.log" 2>&1
grep -E "^test |passed|failed" "$OUT/c/run.log" | tail -30
echo "conformance done: $((SECONDS - start)) s"
OUT="$OUT/t" ONLY='^issue_table$' TABLE_ROUNDS=10 AB_ALLOC=alloc_eeb bash run.sh > "$OUT/t/run.log" 2>&1
tail -20 "$OUT/t/run.log"
echo "total: $((SECONDS - start)) s"
