#!/usr/bin/env bash
# The bundle's replay comparison (issue 15): every trace in traces/ replayed by ferrocuda on
# the fake device and on the GPU, and by PyTorch's own allocator (torch_replay.py, from C++),
# under the default configuration and expandable_segments:True; then replay_compare.py
# checks that the memory figures of the fake and the real device agree, the fake device
# placing its segments where the driver placed the GPU run's (`--addresses-from`), and that
# ours on the GPU equal PyTorch's (a mismatch fails), and prints ns per event, ours against
# PyTorch's.
#
#   replay.sh OUTDIR
#
# Both sides read the configuration from PYTORCH_CUDA_ALLOC_CONF (unset for the default).
# Each timed replay runs in a fresh process, once per process (`torch_replay.py --repeat 1`:
# its later repeats would reuse a warm allocator and driver, ours cannot), REPLAY_RUNS times
# each (default 3); the comparison keeps each side's fastest. FERROCUDA and TORCH_REPLAY
# name the two commands (default: the bundle's).
set -u -o pipefail
cd "$(dirname "$0")"
out=${1:?usage: replay.sh OUTDIR}
mkdir -p "$out"
FERROCUDA=${FERROCUDA:-./ferrocuda}
TORCH_REPLAY=${TORCH_REPLAY:-./torch_replay.py}
runs=${REPLAY_RUNS:-3}
unset FERROCUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
status=0
shopt -s nullglob
traces=(traces/*.pickle.xz)
if [ ${#traces[@]} = 0 ]; then echo "replay.sh: no traces in traces/"; exit 1; fi
for trace in "${traces[@]}"; do
  name=$(basename "$trace" .pickle.xz)
  for conf in default expandable_segments:True; do
    if [ "$conf" = default ]; then unset PYTORCH_CUDA_ALLOC_CONF; else export PYTORCH_CUDA_ALLOC_CONF=$conf; fi
    tag=$([ "$conf" = default ] && echo default || echo expandable)
    base="$out/$name.$tag"
    echo "--- $name, $conf"
    for r in $(seq 1 "$runs"); do
      if ! timeout 300 "$FERROCUDA" replay "$trace" --device cuda --json > "$base.cuda.$r.json"; then
        echo "ferrocuda replay --device cuda failed on $name ($conf), run $r"; status=1
      fi
      # The fake device with the segment addresses the driver gave this run.
      if ! timeout 300 "$FERROCUDA" replay "$trace" --device fake --json \
          --addresses-from "$base.cuda.$r.json" > "$base.fake.$r.json"; then
        echo "ferrocuda replay --device fake failed on $name ($conf), run $r"; status=1
      fi
      if ! timeout 300 python3 "$TORCH_REPLAY" "$trace" --repeat 1 --json "$base.torch.$r.json" > /dev/null; then
        echo "torch_replay.py failed on $name ($conf), run $r"; status=1
      fi
    done
  done
done
python3 replay_compare.py "$out" || status=1
exit $status
