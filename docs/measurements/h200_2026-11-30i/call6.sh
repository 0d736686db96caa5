#!/usr/bin/env bash
# Sixth call: where PyTorch's 64 MiB CPU tensors start (mod 4 KiB), then align_probe:
# the driver's pageable copies from and to a Vec's start and from 64-byte and 4 KiB
# aligned places, alternated over six rounds, on cores 2-10.
set -u
python3 -c "
import torch
ts = [torch.full((64 << 20,), 7, dtype=torch.uint8) for _ in range(3)]
print('torch 64 MiB CPU tensors start at', [t.data_ptr() % 4096 for t in ts], 'mod 4096')
"
taskset -c 2-10 target/probe/align_probe 6 | tee "$OUT/align.txt"
