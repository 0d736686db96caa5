#!/usr/bin/env bash
# The recommended set's memory on the eight recorded traces (no GPU: the fake device),
# with `expandable_segments_small_page_bound` (today's set) and without it (the set as it
# was): peak reserved over peak requested, the device keeping up (lag 0) or catching up
# every N trace steps, and the set without reclaim. Run from the repository root after
# `cargo build --release -p ferrocuda-cli`; prints a TSV.
set -eu
F=target/release/ferrocuda
R=ferrocuda_recommended:True
ratio() { "$F" replay "$@" --json | python3 -c 'import json,sys; print("%.4f" % json.load(sys.stdin)[0]["reserved_over_requested"])'; }
printf 'trace\tlag\tbound\twithout bound\n'
for t in gpt2_train resnet50_train bert_train_varlen vit_train_fixed llama_decode llama_serve_fixed bert_serve llama_serve_random; do
  for lag in 0 100 1000 10000 noreclaim; do
    conf=$R lagging=()
    case $lag in
      0) ;;
      noreclaim) conf=$R,expandable_segments_reclaim:False ;;
      *) lagging=(--catch-up-every "$lag") ;;
    esac
    on=$(ratio "tests/data/$t.pickle.xz" --conf "$conf" "${lagging[@]}")
    off=$(ratio "tests/data/$t.pickle.xz" --conf "$conf,expandable_segments_small_page_bound:False" "${lagging[@]}")
    printf '%s\t%s\t%s\t%s\n' "$t" "$lag" "$on" "$off"
  done
done
