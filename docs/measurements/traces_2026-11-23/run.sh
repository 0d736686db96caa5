#!/bin/bash
# The one device call of 2026-11-23 (run from a folder holding record.py and a copy of
# shared/tools/torch_replay.py): record 6 traces (default and expandable runs), then replay the default
# recordings through PyTorch's allocator under both confs; everything into $OUT/traces.tar.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
W=/tmp/tw; mkdir -p $W/logs; export DEST=$W
cd "$(dirname "$0")"
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, torchvision, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "torchvision", torchvision.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
} > $W/versions.txt 2>&1
cat $W/versions.txt
MODELS="llama_serve_random bert_train_varlen vit_train_fixed bert_serve llama_decode llama_serve_fixed"
jobs=""
for m in $MODELS; do jobs="$jobs $m:default $m:expandable_segments:True"; done
one() {
  m=${1%%:*}; c=${1#*:}
  if [ "$c" = default ]; then unset PYTORCH_CUDA_ALLOC_CONF; else export PYTORCH_CUDA_ALLOC_CONF=$c; fi
  tag=$([ "$c" = default ] && echo default || echo expandable)
  RECORD=1 timeout 150 python3 record.py $m > $W/logs/$m.$tag.log 2>&1
  echo "$m $tag rc=$? $(grep -h '^trace' $W/logs/$m.$tag.log) t=$(( $(date +%s) - T0 ))"
}
export -f one; export W T0
echo $jobs | tr ' ' '\n' | timeout 330 xargs -P 4 -I{} bash -c 'one {}'
grep -h '^FIGURES' $W/logs/*.log | sed 's/^FIGURES //' > $W/figures.jsonl
echo "phase A done t=$(( $(date +%s) - T0 ))"
# Phase B: PyTorch's allocator replaying each default recording (C++ loop), both confs
rep() {
  m=${1%%:*}; c=${1#*:}
  if [ "$c" = default ]; then unset PYTORCH_CUDA_ALLOC_CONF; else export PYTORCH_CUDA_ALLOC_CONF=$c; fi
  tag=$([ "$c" = default ] && echo default || echo expandable)
  timeout 150 python3 torch_replay.py $W/$m.default.pickle.xz --repeat 1 --json $W/replay.$m.$tag.json > $W/logs/replay.$m.$tag.log 2>&1
  echo "replay $m $tag rc=$? t=$(( $(date +%s) - T0 ))"
}
export -f rep
first=${MODELS%% *}
timeout 200 bash -c "rep $first:default"
rjobs=""
for m in $MODELS; do rjobs="$rjobs $m:expandable_segments:True"; [ $m != $first ] && rjobs="$rjobs $m:default"; done
echo $rjobs | tr ' ' '\n' | timeout $(( 550 - ($(date +%s) - T0) )) xargs -P 4 -I{} bash -c 'rep {}'
echo "phase B done t=$(( $(date +%s) - T0 ))"
tail -n 3 $W/logs/*.log | cut -c1-300
cd $W && tar cf $OUT/traces.tar *.pickle.xz figures.jsonl versions.txt replay.*.json logs
ls -la $OUT
