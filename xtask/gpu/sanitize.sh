#!/usr/bin/env bash
# compute-sanitizer on the bundle's conformance binaries, run.sh's "sanitize" step:
# - memcheck with --leak-check full over each binary whole (one test at a time), skipping the
#   tests listed below: 0 errors, 0 leaks;
# - each listed test alone under memcheck: every error it reports is one of those it provokes
#   on purpose (a failing driver call "CODE@call", or "leak:BYTES"), and it provokes at least
#   one (a list entry that no longer holds fails, so the list stays true);
# - racecheck over each binary whole: 0 hazards.
# Last line: "sanitize: N passed, N failed"; exit status 0 only when none failed.
set -u -o pipefail
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/out}
LOGS="$OUT/sanitizer"
mkdir -p "$LOGS"
S=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
export FERROCUDA_REQUIRE_GPU=1
if ! [ -x "$S" ]; then
  echo "sanitize: compute-sanitizer not found at $S"
  echo "sanitize: 0 passed, 1 failed"
  exit 1
fi
BINARIES="test_alloc_conformance test_amp_conformance test_async_conformance test_cuda_conformance
  test_graph_conformance test_optim_conformance test_pinned_conformance test_trees_conformance"
# binary~test~what it provokes on purpose (an extended regex over each reported error)~why
PROVOKED='
test_alloc_conformance~cuda::out_of_memory_text_and_retry~CUDA_ERROR_OUT_OF_MEMORY@cuMemAlloc_v2~asks for more than the device holds, then retries after freeing the cache
test_async_conformance~cuda::capture_fork_join_and_unjoined~CUDA_ERROR_STREAM_CAPTURE_UNJOINED@cuStreamEndCapture~ends a capture whose forked stream never joined
test_async_conformance~cuda::capture_refuses_sync_and_captured_event_query~CUDA_ERROR_(CAPTURED_EVENT|STREAM_CAPTURE_INVALIDATED|STREAM_CAPTURE_UNSUPPORTED)@cu[A-Za-z_0-9]+~synchronizes and queries an event inside a capture, which the driver refuses
test_async_conformance~cuda::kernel_cache_hits_and_repairs~CUDA_ERROR_(INVALID_IMAGE|NOT_FOUND)@cuModule(LoadData|GetFunction)~loads a corrupted cached kernel image, which must be repaired
test_cuda_conformance~capture_fork_join_and_unjoined~CUDA_ERROR_STREAM_CAPTURE_UNJOINED@cuStreamEndCapture~ends a capture whose forked stream never joined
test_cuda_conformance~capture_modes_and_other_threads~CUDA_ERROR_(ILLEGAL_STATE|STREAM_CAPTURE_INVALIDATED|STREAM_CAPTURE_UNSUPPORTED|STREAM_CAPTURE_WRONG_THREAD)@cu[A-Za-z_0-9]+~calls what each capture mode forbids, from other threads
test_cuda_conformance~device_synchronize_breaks_every_capture~CUDA_ERROR_(STREAM_CAPTURE_INVALIDATED|STREAM_CAPTURE_UNSUPPORTED)@cu(CtxSynchronize|StreamEndCapture)~synchronizes the device while a stream captures, which the driver refuses
test_cuda_conformance~capture_refuses_legacy_stream_and_nesting~CUDA_ERROR_(ILLEGAL_STATE|STREAM_CAPTURE_UNSUPPORTED)@cuStream(BeginCapture_v2|EndCapture)|CUDA_ERROR_STREAM_CAPTURE_IMPLICIT@cuStreamGetCaptureInfo_v3~captures the legacy stream, nests captures, and asks the legacy stream about a capture while a blocking stream captures, which the driver refuses
test_cuda_conformance~capture_refuses_sync_and_captured_event_query~CUDA_ERROR_(CAPTURED_EVENT|STREAM_CAPTURE_INVALIDATED|STREAM_CAPTURE_UNSUPPORTED)@cu[A-Za-z_0-9]+~synchronizes and queries an event inside a capture, which the driver refuses
test_cuda_conformance~kernel_cache_hits_and_repairs~CUDA_ERROR_(INVALID_IMAGE|NOT_FOUND)@cuModule(LoadData|GetFunction)~loads a corrupted cached kernel image, which must be repaired
test_cuda_conformance~out_of_memory_is_a_typed_error~CUDA_ERROR_OUT_OF_MEMORY@cuMemAlloc_v2~asks for more than the device holds
test_cuda_conformance~staged_reads_meet_a_capture_elsewhere_as_the_drivers_do~CUDA_ERROR_STREAM_CAPTURE_(INVALIDATED|UNSUPPORTED|IMPLICIT)@cu[A-Za-z_0-9]+~reads into pageable memory beside a capture whose mode forbids waiting for a stream, and on the legacy stream while a blocking stream captures (the driver copy and the staged one alike), which the driver refuses and which invalidates the capture
test_graph_conformance~cuda::async_stats_during_a_capture_invalidate_it~CUDA_ERROR_STREAM_CAPTURE_(INVALIDATED|UNSUPPORTED)@cu[A-Za-z_0-9]+|CUDA_ERROR_INVALID_VALUE@cuMemFreeAsync~reads cudaMallocAsync statistics inside a capture, which invalidates it; the driver then refuses to free what the dead capture allocated
test_graph_conformance~cuda::capture_rules_are_typed_errors~CUDA_ERROR_(STREAM_CAPTURE_INVALIDATED|STREAM_CAPTURE_UNSUPPORTED)@cu[A-Za-z_0-9]+~synchronizes inside a capture, which the driver refuses
test_graph_conformance~cuda::forked_streams_join_the_capture~CUDA_ERROR_STREAM_CAPTURE_UNJOINED@cuStreamEndCapture~ends a capture whose forked stream never joined
test_pinned_conformance~cuda::capture_copies_from_a_private_pinned_pool~leak:4,096~keeps a pinned block retired for a graph that copied from it: it is never reused, and never freed
'
passed=0; failed=0
pass() { passed=$((passed + 1)); echo "sanitize: $1: ok"; }
fail() { failed=$((failed + 1)); echo "sanitize: $1: FAILED"; shift; printf '%s\n' "$@"; }
# The errors of a sanitizer log, one per line: "CODE@call" for a failing driver call,
# "leak:BYTES" for leaked memory, the message itself for anything else. (A message can
# follow the test harness's "test NAME ... " on its line.)
errors_of() {
  grep -oE '========= [^ ].*' "$1" \
    | grep -vE '^========= (ERROR|LEAK|RACECHECK) SUMMARY|^========= (COMPUTE-SANITIZER|Target application)' \
    | sed -E 's/^========= Program hit (CUDA_ERROR_[A-Z_0-9]+) \(error [0-9]+\)( due to "[^"]*")? on CUDA API call to ([A-Za-z_0-9]+)\..*/\1@\3/;
              s/^========= Leaked ([0-9,]+) bytes.*/leak:\1/'
}
error_count() { sed -nE 's/^========= ERROR SUMMARY: ([0-9]+) error.*/\1/p' "$1" | tail -n 1; }
provoked_in() { echo "$PROVOKED" | awk -F'~' -v b="$1" '$1 == b { print $2 }'; }
# A log's messages without their backtraces, for a failure's report.
messages_of() { grep -oE '=========.*' "$1" | grep -vE '^=========  +(at|Host Frame|Saved host)|^========= *$' | head -n 20; }

for bin in $BINARIES; do
  [ -x "./$bin" ] || { fail "$bin" "not in the bundle"; continue; }
  skips=()
  while IFS= read -r t; do [ -n "$t" ] && skips+=(--skip "$t"); done < <(provoked_in "$bin")
  log="$LOGS/memcheck_$bin.log"
  "$S" --tool memcheck --leak-check full --print-limit 100 ./"$bin" --include-ignored \
    --test-threads=1 --exact "${skips[@]}" > "$log" 2>&1
  rc=$?
  n=$(error_count "$log")
  if [ "$rc" = 0 ] && [ "${n:-x}" = 0 ] && grep -qE '^test result: ok' "$log"; then
    pass "memcheck $bin ($(grep -E '^test result' "$log" | sed -E 's/.* ([0-9]+) passed.*/\1/') tests)"
  else
    fail "memcheck $bin" "rc=$rc errors=${n:-?}" "$(messages_of "$log")" \
      "$(grep -E '^test .* FAILED|panicked' "$log" | head -5)"
  fi
done

while IFS='~' read -r bin test allowed why; do
  [ -n "$bin" ] || continue
  log="$LOGS/provoked_${bin}_${test//::/_}.log"
  "$S" --tool memcheck --leak-check full --print-limit 100 ./"$bin" --include-ignored \
    --test-threads=1 --exact "$test" > "$log" 2>&1
  rc=$?
  n=$(error_count "$log")
  seen=$(errors_of "$log")
  others=$(echo "$seen" | grep -vE "^($allowed)\$" | grep -v '^$')
  count=$(echo "$seen" | grep -cvE '^$')
  if [ "$rc" = 0 ] && grep -qE '^test result: ok. 1 passed' "$log" && [ -z "$others" ] \
    && [ "$count" -gt 0 ] && [ "${n:-x}" = "$count" ]; then
    pass "$bin $test provokes $(echo "$seen" | sort -u | tr '\n' ' ')($why)"
  else
    fail "$bin $test" "rc=$rc errors=${n:-?} listed=$count, allowed: $allowed" \
      "unexpected: $(echo "$others" | sort | uniq -c | head -10)" "$(messages_of "$log")"
  fi
done <<< "$PROVOKED"

for bin in $BINARIES; do
  [ -x "./$bin" ] || continue
  log="$LOGS/racecheck_$bin.log"
  "$S" --tool racecheck --print-limit 100 ./"$bin" --include-ignored --test-threads=1 > "$log" 2>&1
  rc=$?
  if [ "$rc" = 0 ] && grep -qE '^========= RACECHECK SUMMARY: 0 hazards' "$log"; then
    pass "racecheck $bin"
  else
    fail "racecheck $bin" "rc=$rc $(grep -E 'RACECHECK SUMMARY' "$log")" \
      "$(grep -E '^test .* FAILED|panicked' "$log" | head -5)"
  fi
done
echo "sanitize: $passed passed, $failed failed"
[ "$failed" = 0 ]
