#!/usr/bin/env bash
# Runs the bundled tests and benches against the real CUDA driver. A skipped (ignored) test,
# a missing GPU, or a failed bench counts as a failure. Last line: "N passed, N failed".
# ONLY=<regex> runs just the binaries and steps whose names match (skipping the PyTorch checks
# it does not name); the step "sanitize" (compute-sanitizer on the conformance binaries) and
# PyTorch's anchors "torch_anchor" and "torch_pinned" are such names;
# ONLY=replay runs just the replay comparison (replay.sh: ferrocuda on the fake device and the
# GPU, and PyTorch's allocator, on the same traces).
# MULTI_GPU=1 also runs the multi_* tests and multibench_* benches, which need two GPUs (they
# fail on fewer), and torch_dist.py, PyTorch's side of multibench_multi_gpu, with a ratio table.
set -u -o pipefail
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export FERROCUDA_REQUIRE_GPU=1 CRITERION_HOME="$OUT/criterion"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
# cuBLAS and cuFFT come with PyTorch's wheels, outside the loader's path: name their folders
# (docs/mathlib.md), as a user of PyTorch's libraries would.
if [ -z "${FERROCUDA_CUDA_LIBRARY_PATH:-}" ]; then
  FERROCUDA_CUDA_LIBRARY_PATH=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))' 2>/dev/null) || true
  export FERROCUDA_CUDA_LIBRARY_PATH
  echo "FERROCUDA_CUDA_LIBRARY_PATH=$FERROCUDA_CUDA_LIBRARY_PATH"
fi
passed=0; failed=0
want() { [ -z "${ONLY:-}" ] || [[ "$1" =~ $ONLY ]]; }
# Benches and PyTorch's anchors run on the same nine cores (2-10) where the machine has them:
# left to roam a shared host's vCPUs, the allocator's churn ran 30-60% slower on the H200
# (docs/measurements/h200_2026-11-30b). Single-threaded figures, ours and PyTorch's, come
# from one core (2): spread over 2-10 the churn ran at 88-112 ns in nine runs of ten, on one
# core under 67 ns in half its runs (docs/measurements/h200_2026-12-01g).
# PIN_BENCHES=0 runs them unpinned.
can_pin() { [ "${PIN_BENCHES:-1}" = 1 ] && command -v taskset >/dev/null && [ "$(nproc)" -ge 11 ]; }
pinned_to() {
  local cpus=$1; shift
  if can_pin; then
    taskset -c "$cpus" "$@"
  else
    "$@"
  fi
}
pinned() { pinned_to 2-10 "$@"; }
one_core() { pinned_to 2 "$@"; }
# bench_alloc's single-threaded benches (run on one core) and its many-threaded ones (on
# 2-10); every bench it lists must match exactly one of the two.
ALLOC_ONE_THREAD='^alloc/(pair_(512B|1MiB|100MiB)(_locked|_expandable|_recommended)?|lock_floor(_spin)?|churn_.*)$'
ALLOC_THREADS='^alloc/.*_8threads.*$'
alloc_benches_split() {
  local name listed=0 sets
  while read -r name; do
    listed=$((listed + 1)); sets=0
    [[ "$name" =~ $ALLOC_ONE_THREAD ]] && sets=$((sets + 1))
    [[ "$name" =~ $ALLOC_THREADS ]] && sets=$((sets + 1))
    [ "$sets" = 1 ] || { echo "bench_alloc: $name is in $sets of the two core sets"; return 1; }
  done < <(./bench_alloc --bench --list 2>/dev/null | sed -n 's/: benchmark$//p')
  [ "$listed" -gt 0 ] || { echo "bench_alloc --list named no bench"; return 1; }
}
# A bench binary with its arguments, bench_alloc split over the two core sets.
run_bench() {
  local b=$1; shift
  if [ "$b" = bench_alloc ]; then
    alloc_benches_split || return 1
    one_core ./bench_alloc "$@" "$ALLOC_ONE_THREAD" && pinned ./bench_alloc "$@" "$ALLOC_THREADS"
  else
    pinned ./"$b" "$@"
  fi
}
# The tests of a binary to run, when not all of them (a test filtered out is no skip).
tests_of() {
  case "$1" in
    # @TEST_ONLY@: gpu-bundle fills in the arms of GPU_TEST_ONLY (xtask/src/gpu_bundle.rs)
  esac
}
for t in test_* ${MULTI_GPU:+multi_*}; do
  want "$t" || continue
  echo "=== $t"
  # shellcheck disable=SC2046
  ./"$t" $(tests_of "$t") --include-ignored --test-threads=1 2>&1 | tee "$OUT/$t.log"
  rc=${PIPESTATUS[0]}
  line=$(grep -E '^test result:' "$OUT/$t.log" | tail -n 1)
  p=$(echo "$line" | sed -nE 's/.* ([0-9]+) passed.*/\1/p'); p=${p:-0}
  f=$(echo "$line" | sed -nE 's/.* ([0-9]+) failed.*/\1/p'); f=${f:-0}
  i=$(echo "$line" | sed -nE 's/.* ([0-9]+) ignored.*/\1/p'); i=${i:-0}
  if [ "$i" != 0 ]; then echo "$t: $i test(s) skipped: a skip is a failure here"; f=$((f + i)); fi
  if [ "$rc" != 0 ] && [ "$f" = 0 ]; then f=1; fi
  passed=$((passed + p)); failed=$((failed + f))
done
# compute-sanitizer (memcheck with leak check, racecheck) over the conformance binaries:
# sanitize.sh lists the tests that provoke driver errors on purpose. ONLY=sanitize runs it.
if [ -f sanitize.sh ] && want sanitize; then
  echo "=== sanitize"
  if OUT="$OUT" ./sanitize.sh 2>&1 | tee "$OUT/sanitize.log"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
fi
for e in example_*; do
  want "$e" || continue
  echo "=== $e"
  if ./"$e" 2>&1 | tee "$OUT/$e.log" && grep -q 'on the GPU' "$OUT/$e.log"; then
    passed=$((passed + 1))
  else
    echo "$e failed (or did not run on the GPU)"; failed=$((failed + 1))
  fi
done
# torchrun starting ferrocuda workers: one NCCL rank on the GPU, then four fake-device ranks
# whose collectives move through the store torchrun's agent made. ONLY=torchrun runs it.
if [ -f example_torchrun_worker ] && want torchrun; then
  echo "=== torchrun"
  if python3 -m torch.distributed.run --nproc_per_node=1 --no-python ./example_torchrun_worker 2>&1 | tee "$OUT/torchrun_gpu.log" \
    && grep -q 'on the GPU' "$OUT/torchrun_gpu.log" \
    && FERROCUDA_BACKEND=fake python3 -m torch.distributed.run --nproc_per_node=4 --no-python ./example_torchrun_worker 2>&1 | tee "$OUT/torchrun_fake.log" \
    && [ "$(grep -c 'all_reduce ok (10)' "$OUT/torchrun_fake.log")" = 4 ]; then
    passed=$((passed + 1))
  else
    echo "torchrun failed"; failed=$((failed + 1))
  fi
fi
# CUDA IPC with PyTorch on either side, both kinds of segment (ipc_torch.py: six runs of
# two processes each). ONLY=ipc_torch runs it.
if [ -f example_ipc_peer ] && want ipc_torch; then
  echo "=== ipc_torch"
  if python3 ipc_torch.py ./example_ipc_peer 2>&1 | tee "$OUT/ipc_torch.log"; then
    passed=$((passed + 1))
  else
    echo "ipc_torch failed"; failed=$((failed + 1))
  fi
fi
for b in bench_* ${MULTI_GPU:+multibench_*}; do
  want "$b" || continue
  echo "=== $b"
  if run_bench "$b" --bench 2>&1 | tee "$OUT/$b.log"; then passed=$((passed + 1)); else echo "$b failed"; failed=$((failed + 1)); fi
done
if want replay; then
  echo "=== replay: ferrocuda on the fake device and on the GPU, PyTorch's allocator, same traces"
  if ./replay.sh "$OUT/replay" 2>&1 | tee "$OUT/replay.log"; then
    passed=$((passed + 1))
  else
    echo "replay comparison failed"; failed=$((failed + 1))
  fi
fi
if [ -f snapshot.pickle ] && [ -z "${ONLY:-}" ]; then
  echo "=== PyTorch's memory viewer on ferrocuda's snapshot"
  if python3 - snapshot.pickle <<'PY' 2>&1 | tee "$OUT/memory_viz.log"; then passed=$((passed + 1)); else echo "memory_viz check failed"; failed=$((failed + 1)); fi
import pickle, sys
from torch.cuda import _memory_viz as viz
s = pickle.load(open(sys.argv[1], 'rb'))
assert viz.segment_plot(s) and viz.trace_plot(s)
summary = viz.segsum(s)  # asserts allocated + free == reserved per segment
listing = viz.trace(s)
print(summary.splitlines()[-8])
print('memory_viz accepted it: %d segments, %d trace entries, %d lines of trace listing'
      % (len(s['segments']), len(s['device_traces'][0]), len(listing.splitlines())))
PY
  cp snapshot.pickle "$OUT/" 2>/dev/null
fi
# ferrocuda's allocator inside real PyTorch (libferrocuda_torch.so): the check with an empty
# configuration (PyTorch's behaviour) and the recommended one, then the five-way benchmark.
# ONLY=plugin runs just these; PLUGIN_BENCH_ARGS passes options to the benchmark.
plugin() {
  local name=$1; shift
  want "$name" || return 0
  echo "=== $name"
  if OUT="$OUT" PYTHONUNBUFFERED=1 "$@" 2>&1 | tee "$OUT/$name.log"; then passed=$((passed + 1)); else echo "$name failed"; failed=$((failed + 1)); fi
}
if [ -f plugin_bench.py ] && [ -f libferrocuda_torch.so ]; then
  plugin plugin_check env -u FERROCUDA_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF python3 plugin_bench.py check
  plugin plugin_check_recommended env -u PYTORCH_CUDA_ALLOC_CONF FERROCUDA_ALLOC_CONF=ferrocuda_recommended:True python3 plugin_bench.py check
  # Sleep and wake of weights, KV cache and CUDA graphs' pools, as an inference server.
  plugin plugin_sleep env -u FERROCUDA_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF python3 plugin_sleep.py
  # shellcheck disable=SC2086
  plugin plugin_bench python3 plugin_bench.py bench ${PLUGIN_BENCH_ARGS:-}
  # The decisive one: the ways interleaved request by request, paired ratios with a 95% CI.
  # shellcheck disable=SC2086
  plugin plugin_paired python3 plugin_bench.py paired ${PLUGIN_PAIRED_ARGS:-}
fi
# Twice: on cores 2-10 (its many-threaded pairs), then on one core into $OUT/one_core (its
# single-threaded figures, measured as ours are). ONLY=torch_anchor runs just this.
if [ -f torch_anchor.py ] && want torch_anchor; then
  echo "=== torch_anchor.py (PyTorch, same machine, same run)"
  if PYTHONUNBUFFERED=1 pinned python3 torch_anchor.py 2>&1 | tee "$OUT/torch_anchor.log" \
    && mkdir -p "$OUT/one_core" \
    && OUT="$OUT/one_core" PYTHONUNBUFFERED=1 one_core python3 torch_anchor.py > "$OUT/one_core/torch_anchor.log" 2>&1; then
    passed=$((passed + 1))
  else
    echo "torch_anchor.py failed"; failed=$((failed + 1))
  fi
fi
grep -h 'ratio' "$OUT"/bench_*.log 2>/dev/null
grep -h '^target ' "$OUT"/plugin_bench.log "$OUT"/plugin_paired.log 2>/dev/null
if [ -f "$OUT/torch_anchor.json" ]; then
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
torch = json.load(open(os.path.join(out, "torch_anchor.json")))
# PyTorch's single-threaded figures from its run on one core, as ours are measured.
one_core = os.path.join(out, "one_core", "torch_anchor.json")
if os.path.exists(one_core):
    single = json.load(open(one_core))
    torch.update({k: v for k, v in single.items() if "threads" not in k})
def ours(name):
    p = os.path.join(out, "criterion", "alloc", name, "new", "estimates.json")
    return json.load(open(p))["median"]["point_estimate"] if os.path.exists(p) else None
rows = [("cached pair 512 B", "pair_512B", "torch_alloc_pair_ns_512", 60),
        ("cached pair 1 MiB", "pair_1MiB", "torch_alloc_pair_ns_1048576", 60),
        ("cached pair 100 MiB", "pair_100MiB", "torch_alloc_pair_ns_104857600", 60),
        ("pair 1 MiB, 8 threads", "pair_1MiB_8threads", "torch_alloc_pair_ns_1MiB_8threads", 150),
        ("churn, 1024 live", "churn_1024_live", "torch_alloc_mixed_ns", 60),
        ("churn refilled per sample", "churn_refill_1024_live", "torch_alloc_mixed_ns", None),
        ("pair 1 MiB, no thread cache", "pair_1MiB_locked", "torch_alloc_pair_ns_1048576", None),
        ("pair 1 MiB, expandable", "pair_1MiB_expandable", "torch_alloc_pair_ns_1048576", None),
        ("expandable: 8 threads", "pair_1MiB_8threads_expandable", "torch_alloc_pair_ns_1MiB_8threads", None),
        ("expandable: churn", "churn_1024_live_expandable", "torch_alloc_mixed_ns", None),
        ("recommended: pair 1 MiB", "pair_1MiB_recommended", "torch_alloc_pair_ns_1048576", None),
        ("recommended: 8 threads", "pair_1MiB_8threads_recommended", "torch_alloc_pair_ns_1MiB_8threads", None),
        ("recommended: churn", "churn_1024_live_recommended", "torch_alloc_mixed_ns", None),
        ("recommended: churn refilled", "churn_refill_1024_live_recommended", "torch_alloc_mixed_ns", None)]
print(f"{'allocator hot path':28} {'ferrocuda ns':>13} {'PyTorch ns':>11} {'ratio':>7} {'target ns':>10}")
for label, mine, theirs, target in rows:
    a, b = ours(mine), torch.get(theirs)
    if a is None or b is None:
        print(f"{label:28} missing"); continue
    print(f"{label:28} {a:13.1f} {b:11.1f} {a / b:7.3f} {target or '-':>10}")
PY
fi
if [ -f torch_pinned.py ] && want torch_pinned; then
  echo "=== torch_pinned.py (PyTorch's pinned host allocator, same machine, same run)"
  if PYTHONUNBUFFERED=1 pinned python3 torch_pinned.py 2>&1 | tee "$OUT/torch_pinned.log"; then
    passed=$((passed + 1))
  else
    echo "torch_pinned.py failed"; failed=$((failed + 1))
  fi
fi
if [ -f "$OUT/torch_pinned.json" ]; then
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
torch = json.load(open(os.path.join(out, "torch_pinned.json")))
def ours(group, name):
    p = os.path.join(out, "criterion", group, name, "new", "estimates.json")
    return json.load(open(p))["median"]["point_estimate"] if os.path.exists(p) else None
print(f"{'pinned host memory':28} {'ferrocuda':>13} {'PyTorch':>11} {'ratio':>7}")
for label, mine, theirs in [("alloc+free pair 4 KiB, ns", "pair_4KiB", "torch_pinned_pair_ns_4096"),
                            ("alloc+free pair 1 MiB, ns", "pair_1MiB", "torch_pinned_pair_ns_1048576"),
                            ("alloc+free pair 64 MiB, ns", "pair_64MiB", "torch_pinned_pair_ns_67108864"),
                            ("pair 1 MiB, 8 threads, ns", "pair_1MiB_8threads", "torch_pinned_pair_ns_1MiB_8threads"),
                            ("empty(pinned) 4 KiB, ns", "empty_pair_4KiB", "torch_pinned_empty_ns_4096"),
                            ("empty(pinned) 1 MiB, ns", "empty_pair_1MiB", "torch_pinned_empty_ns_1048576"),
                            ("empty(pinned) 64 MiB, ns", "empty_pair_64MiB", "torch_pinned_empty_ns_67108864")]:
    a, b = ours("pinned", mine), torch.get(theirs)
    print(f"{label:28} missing" if a is None or b is None else f"{label:28} {a:13.1f} {b:11.1f} {a / b:7.3f}")
for group, label, mine, theirs in [("h2d", "H2D 64 MiB pinned, GB/s", "pinned_64MiB", "torch_h2d_pinned_GBps"),
                            ("h2d", "H2D 64 MiB pageable, GB/s", "pageable_64MiB", "torch_h2d_pageable_GBps"),
                            ("h2d", "  staged by 4 threads, GB/s", "pageable_64MiB_staged_4threads", "torch_h2d_pageable_GBps"),
                            ("d2h", "D2H 64 MiB pinned, GB/s", "pinned_64MiB", "torch_d2h_pinned_GBps"),
                            ("d2h", "D2H 64 MiB pageable, GB/s", "pageable_64MiB", "torch_d2h_pageable_GBps"),
                            ("d2h", "  staged by 4 threads, GB/s", "pageable_64MiB_staged_4threads", "torch_d2h_pageable_GBps"),
                            ("d2h", "D2H 64 MiB new (.cpu()), GB/s", "to_host_64MiB", "torch_d2h_cpu_GBps"),
                            ("d2h", "  staged by 4 threads, GB/s", "to_host_64MiB_staged_4threads", "torch_d2h_cpu_GBps")]:
    ns, b = ours(group, mine), torch.get(theirs)
    if ns is None or b is None:
        print(f"{label:28} missing"); continue
    a = (64 << 20) / ns
    print(f"{label:28} {a:13.2f} {b:11.2f} {a / b:7.3f}")
PY
fi
# Paired steps: two ways of measuring the same thing alternated round by round, the order
# flipped every other round, and the median ratio printed with a 95% bootstrap interval
# (paired_summary.py). A shared host drifts by a third from one minute to the next
# (docs/measurements/h200_2026-11-30i), so figures taken minutes apart, as the tables above
# are, cannot decide a ratio near 1; these can. PAIRED_ROUNDS rounds (8).
# rounds PREFIX COUNT WAY...: COUNT rounds, each running `PREFIX_WAY` (which prints one
# line of values) for every WAY, printed as "ROUND WAY VALUES"; the ways' order is reversed
# every other round, and ROUND holds the round's number while they run. Each way starts
# with no criterion results, so a bench that did not run is missing, never an older
# figure (another way's, or an earlier round's) read again.
rounds() {
  local prefix=$1 count=$2 r way order values; shift 2
  for r in $(seq 1 "$count"); do
    ROUND=$r order=$*
    (( r % 2 )) || order=$(printf '%s\n' "$@" | tac)
    for way in $order; do
      rm -rf "$OUT/paired_criterion"
      values=$("${prefix}_$way") || return 1
      echo "$r $way $values"
    done
  done
}
# paired NAME WAY_A WAY_B UNIT LABEL...: runs `NAME_WAY` (printing one value per LABEL)
# for each way each round into $OUT/NAME.txt, then summarizes WAY_A over WAY_B.
paired() {
  local name=$1 a=$2 b=$3 unit=$4; shift 4
  want "$name" || return 0
  echo "=== $name"
  if rounds "$name" "${PAIRED_ROUNDS:-8}" "$a" "$b" > "$OUT/$name.txt" \
    && python3 paired_summary.py "$OUT/$name.txt" "$a" "$b" "$unit" "$@" 2>&1 | tee "$OUT/$name.log"; then
    passed=$((passed + 1))
  else
    echo "$name failed"; failed=$((failed + 1))
  fi
}
# Criterion's median estimate of each bench named (GROUP/NAME) that the paired_bench runs
# of this way wrote, on one line.
criterion_medians() {
  python3 - "$OUT/paired_criterion" "$@" <<'PY'
import json, os, sys
print(" ".join("%.3f" % json.load(open(os.path.join(sys.argv[1], bench, "new", "estimates.json")))["median"]["point_estimate"]
               for bench in sys.argv[2:]))
PY
}
# paired_bench PIN BINARY FILTER: PIN is pinned (cores 2-10) or one_core.
paired_bench() {
  CRITERION_HOME="$OUT/paired_criterion" "$1" ./"$2" --bench "$3" --warm-up-time 0.5 --measurement-time 1.5 \
    > "$OUT/paired_bench.log" 2>&1
}
# The 64 MiB pageable copies, ours (criterion's h2d/ and d2h/pageable_64MiB) against
# PyTorch's (torch_copies.py, GB/s). ONLY=paired_copies runs just this.
paired_copies_ours() {
  paired_bench pinned bench_pinned '^(h2d|d2h)/pageable_64MiB$' || return 1
  criterion_medians h2d/pageable_64MiB d2h/pageable_64MiB \
    | python3 -c "import sys; print(' '.join('%.3f' % ((64 << 20) / float(ns)) for ns in sys.stdin.read().split()))"
}
paired_copies_torch() { pinned python3 torch_copies.py; }
if [ -f torch_copies.py ] && [ -x bench_pinned ]; then
  paired paired_copies ours torch GB/s "H2D 64 MiB from pageable memory" "D2H 64 MiB into a used buffer"
fi
# The churn and the 8-thread pairs of one configuration (the benches' name suffix: "",
# _expandable or _recommended), in ns per operation.
alloc_medians() {
  paired_bench one_core bench_alloc "^alloc/churn_1024_live$1\$" || return 1
  paired_bench pinned bench_alloc "^alloc/pair_1MiB_8threads$1\$" || return 1
  criterion_medians "alloc/churn_1024_live$1" "alloc/pair_1MiB_8threads$1"
}
# The recommended set against the default configuration: issue 30 asks the recommended
# set's churn and 8-thread pairs to be at or below the default's (ONLY=paired_alloc). Its
# two parts: PyTorch's expandable rules against the default (paired_rules), and page
# reclaim, the recommended set against those rules alone (paired_reclaim).
paired_alloc_default() { alloc_medians ""; }
paired_alloc_recommended() { alloc_medians _recommended; }
paired_rules_default() { alloc_medians ""; }
paired_rules_expandable() { alloc_medians _expandable; }
paired_reclaim_expandable() { alloc_medians _expandable; }
paired_reclaim_recommended() { alloc_medians _recommended; }
if [ -x bench_alloc ]; then
  paired paired_alloc recommended default ns "churn, 1024 live" "1 MiB pairs, 8 threads"
  paired paired_rules expandable default ns "churn, 1024 live" "1 MiB pairs, 8 threads"
  paired paired_reclaim recommended expandable ns "churn, 1024 live" "1 MiB pairs, 8 threads"
fi
# Issue 30's table in rounds (ONLY=issue_table; TABLE_ROUNDS rounds, 8): ours (criterion's
# medians) and PyTorch's (torch_table.py) alternated, the order flipped every other round;
# the single-threaded figures of a round on one core, the same for both sides, the next
# round on the next core (2 to 10, then 2 again). A shared host's slow spells belong to one
# core for seconds (docs/measurements/h200_2026-12-02b): a table measured once hangs on
# the spells it met, where the medians of rounds spread over cores and minutes do not.
# AB_ALLOC=FILE (a bench_alloc built at another revision, in this folder) adds its churn and
# 8-thread pairs to every round. issue_table.py prints the table.
table_core_number() { echo $((2 + (ROUND - 1) % 9)); }
table_core() { pinned_to "$(table_core_number)" "$@"; }
# bench_alloc on PIN with the filters A and B, A first in odd rounds and B first in even:
# the default configuration and the recommended set take turns at going first.
table_alternated() {
  local pin=$1 a=$2 b=$3
  (( ROUND % 2 )) || { a=$3; b=$2; }
  paired_bench "$pin" bench_alloc "$a" && paired_bench "$pin" bench_alloc "$b"
}
issue_table_ours() {
  table_alternated table_core '^alloc/(pair_1MiB|churn_1024_live)$' '^alloc/churn_1024_live_recommended$' || return 1
  table_alternated pinned '^alloc/pair_1MiB_8threads$' '^alloc/pair_1MiB_8threads_recommended$' || return 1
  paired_bench pinned bench_pinned '^(pinned/pair_1MiB_8threads|h2d/pageable_64MiB)$' || return 1
  criterion_medians alloc/pair_1MiB alloc/churn_1024_live alloc/churn_1024_live_recommended \
    alloc/pair_1MiB_8threads alloc/pair_1MiB_8threads_recommended pinned/pair_1MiB_8threads h2d/pageable_64MiB
}
issue_table_torch() {
  local core=-
  can_pin && core=$(table_core_number)
  pinned python3 torch_table.py "$core" 2>> "$OUT/torch_table.log"
}
issue_table_reference() {
  paired_bench table_core "$AB_ALLOC" '^alloc/churn_1024_live$' || return 1
  paired_bench pinned "$AB_ALLOC" '^alloc/pair_1MiB_8threads$' || return 1
  criterion_medians alloc/churn_1024_live alloc/pair_1MiB_8threads
}
if [ -x bench_alloc ] && [ -x bench_pinned ] && [ -f torch_table.py ] && [ -f torch_anchor.py ] && want issue_table; then
  echo "=== issue_table"
  # shellcheck disable=SC2046
  if rounds issue_table "${TABLE_ROUNDS:-8}" ours torch $([ -n "${AB_ALLOC:-}" ] && echo reference) \
    > "$OUT/issue_table.txt" \
    && python3 issue_table.py "$OUT/issue_table.txt" 2>&1 | tee "$OUT/issue_table.log"; then
    passed=$((passed + 1))
  else
    echo "issue_table failed"; failed=$((failed + 1))
  fi
fi
if [ -f torch_mathlib.py ] && want torch_mathlib; then
  echo "=== torch_mathlib.py (PyTorch's torch.matmul and torch.fft.fft, same machine, same run)"
  if OUT="$OUT" PYTHONUNBUFFERED=1 python3 torch_mathlib.py 2>&1 | tee "$OUT/torch_mathlib.log"; then
    passed=$((passed + 1))
  else
    echo "torch_mathlib.py failed"; failed=$((failed + 1))
  fi
fi
if [ -f "$OUT/torch_mathlib.json" ]; then
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
torch = json.load(open(os.path.join(out, "torch_mathlib.json")))
def ours(group, name):
    p = os.path.join(out, "criterion", group, name, "new", "estimates.json")
    return json.load(open(p))["median"]["point_estimate"] if os.path.exists(p) else None
print(f"{'GEMM':24} {'ferrocuda':>11} {'PyTorch':>11} {'ratio':>7}  (TFLOP/s, ratio ours/theirs; host ns for the call, ratio ours/theirs)")
for name, dims in [("bf16_4096", (4096,) * 3), ("f16_4096", (4096,) * 3),
                   ("bf16_8192x8192x1024", (8192, 8192, 1024)), ("f16_8192x8192x1024", (8192, 8192, 1024)),
                   ("f32_tf32_4096", (4096,) * 3), ("f32_64_call", None)]:
    mine, theirs = ours("gemm", name), torch.get(f"torch_gemm_ns_{name}")
    if mine is None or theirs is None:
        print(f"{name:24} missing"); continue
    if dims is None:
        print(f"{name:24} {mine:11.0f} {theirs:11.0f} {mine / theirs:7.3f}")
    else:
        m, n, k = dims
        f = 2 * m * n * k / 1e3
        print(f"{name:24} {f / mine:11.1f} {f / theirs:11.1f} {theirs / mine:7.3f}")
for name in ["bf16_1024", "f32_333x4096x77"]:
    t, u = ours("gemm", f"tuned_{name}"), ours("gemm", f"untuned_{name}")
    print(f"tuned {name:18} missing" if t is None or u is None else f"tuned {name:18} {t:11.0f} {u:11.0f} {t / u:7.3f}  (ns tuned, untuned; TunableOp, target <= 1)")
print(f"{'FFT':24} {'ferrocuda':>11} {'PyTorch':>11} {'ratio':>7}  (ns, ratio ours/theirs)")
for name in ["c2c_2p20_batch16", "c2c_256_call"]:
    mine, theirs = ours("fft", name), torch.get(f"torch_fft_ns_{name}")
    print(f"{name:24} missing" if mine is None or theirs is None else f"{name:24} {mine:11.0f} {theirs:11.0f} {mine / theirs:7.3f}")
PY
fi
if [ -f torch_plan.py ] && want torch_plan; then
  echo "=== torch_plan.py (PyTorch's CUDA graph pools against ferrocuda plan, same machine, same run)"
  if OUT="$OUT" PYTHONUNBUFFERED=1 python3 torch_plan.py ./ferrocuda 2>&1 | tee "$OUT/torch_plan.log"; then
    passed=$((passed + 1))
  else
    echo "torch_plan.py failed"; failed=$((failed + 1))
  fi
fi
if [ -n "${MULTI_GPU:-}" ] && [ -f torch_dist.py ] && want torch_dist; then
  echo "=== torch_dist.py (PyTorch's dist.all_reduce, NCCL, and t.to(\"cuda:1\"), same run)"
  if OUT="$OUT" PYTHONUNBUFFERED=1 python3 torch_dist.py 2>&1 | tee "$OUT/torch_dist.log"; then
    passed=$((passed + 1))
  else
    echo "torch_dist.py failed"; failed=$((failed + 1))
  fi
fi
# The all-reduce under torchrun, ferrocuda's workers against PyTorch's, same run.
if [ -n "${MULTI_GPU:-}" ] && [ -f torchrun_allreduce.py ] && [ -f multi_torchrun_multigpu ] && want torchrun_allreduce; then
  echo "=== torchrun_allreduce.py (256 MiB fp32 under torchrun, both sides, 3 rounds)"
  if OUT="$OUT" PYTHONUNBUFFERED=1 python3 torchrun_allreduce.py ./multi_torchrun_multigpu 2>&1 | tee "$OUT/torchrun_allreduce.log"; then
    passed=$((passed + 1))
  else
    echo "torchrun_allreduce.py failed"; failed=$((failed + 1))
  fi
fi
# CUDA IPC between two processes, read from the other GPU through peer access.
if [ -n "${MULTI_GPU:-}" ] && [ -f example_ipc_peer ] && want ipc_peer_multi; then
  echo "=== ipc_peer across GPUs (consumer reads from GPU 1)"
  ok=1
  for conf in "" "expandable_segments:True"; do
    IPC_PEER_DEVICE=1 ./example_ipc_peer consume "$conf" -- ./example_ipc_peer produce "$conf" 2>&1 | tee -a "$OUT/ipc_peer_multi.log" || ok=0
  done
  if [ "$ok" = 1 ] && [ "$(grep -c 'from GPU 1' "$OUT/ipc_peer_multi.log")" = 2 ]; then
    passed=$((passed + 1))
  else
    echo "ipc_peer across GPUs failed"; failed=$((failed + 1))
  fi
fi
if [ -n "${MULTI_GPU:-}" ] && [ -f "$OUT/torch_dist.json" ]; then
  python3 - "$OUT" <<'PY'
import json, os, re, sys
out = sys.argv[1]
torch = json.load(open(os.path.join(out, "torch_dist.json")))
log = os.path.join(out, "multibench_multi_gpu.log")
text = open(log).read() if os.path.exists(log) else ""
def ours(key):
    m = re.search(r"^" + key + r" ([0-9.]+)", text, re.M)
    return float(m.group(1)) if m else None
print(f"{'several GPUs, GB/s':28} {'ferrocuda':>10} {'PyTorch':>10} {'ratio':>7} {'target':>7}")
for label, mine, theirs, target in [
        ("all-reduce 256 MiB busbw", "ferrocuda_allreduce_busbw_GBps", "torch_allreduce_busbw_GBps", ">=0.98"),
        ("peer copy 256 MiB 0->1", "ferrocuda_peer_copy_GBps", "torch_peer_copy_GBps", "-")]:
    a, b = ours(mine), torch.get(theirs)
    print(f"{label:28} missing" if a is None or b is None else f"{label:28} {a:10.2f} {b:10.2f} {a / b:7.3f} {target:>7}")
PY
fi
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
