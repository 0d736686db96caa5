#!/usr/bin/env bash
# On a machine with a GPU and PyTorch: records snapshots with record_snapshots.py, then runs
# the `ferrocuda` command (FERROCUDA=path, default target/release/ferrocuda) on each, with
# its exit code, wall time and peak RSS. Usage: snapshots_on_gpu.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
bin=${FERROCUDA:-target/release/ferrocuda}
here=$(dirname "$0")
mkdir -p "$out"
PYTHONUNBUFFERED=1 python3 "$here/record_snapshots.py" "$out/snaps" 2>&1 | tee "$out/record.log"
measure() {
  python3 - "$@" <<'PY'
import resource, subprocess, sys, time
t = time.time()
r = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print("$", " ".join(sys.argv[2:]), "-> exit %d, %.2f s, peak RSS %.1f MiB" % (r.returncode, time.time() - t, rss))
sys.stdout.write(r.stdout.decode()[-6000:])
sys.stdout.write(r.stderr.decode()[-2000:])
PY
}
for f in "$out"/snaps/*.pickle "$out"/snaps/*.pickle.xz; do
  measure "$bin" summary "$f"
  measure "$bin" replay "$f" --conf "" --conf expandable_segments:True
  measure "$bin" plot "$f" -o "$out/plot.html"
done 2>&1 | tee "$out/cli.log"
