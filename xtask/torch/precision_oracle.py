"""Records how PyTorch's precision flags answer after each of a list of programs.

Each program starts from PyTorch's defaults (restored in place), runs its steps, then reads
every getter: the legacy ones (`get_float32_matmul_precision`, `cuda.matmul.allow_tf32`,
`cudnn.allow_tf32`), which raise when the legacy and the new API were mixed, and every
`fp32_precision`. A getter that raises is written as {"error": <message>}. One program runs
in a child process with TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1. Needs no GPU.

    python3 precision_oracle.py > precision_oracle_<torch version>.json

The steps are those `crates/amp/tests/amp_scenarios/precision.rs` replays on
`PrecisionSettings`: ["matmul_precision", s], ["allow_tf32_matmul", b],
["allow_tf32_cudnn", b], ["fp32", "<attribute path>", value].
"""
import json
import os
import subprocess
import sys
import warnings

import torch

warnings.simplefilter("ignore")
B = torch.backends
FP32 = {
    "generic": B,
    "cuda.matmul": B.cuda.matmul,
    "cudnn": B.cudnn,
    "cudnn.conv": B.cudnn.conv,
    "cudnn.rnn": B.cudnn.rnn,
    "mkldnn": B.mkldnn,
    "mkldnn.matmul": B.mkldnn.matmul,
    "mkldnn.conv": B.mkldnn.conv,
    "mkldnn.rnn": B.mkldnn.rnn,
}


def read(f):
    try:
        return f()
    except Exception as e:  # the getters raise RuntimeError
        return {"error": str(e)}


def state():
    out = {
        "matmul_precision": read(torch.get_float32_matmul_precision),
        "allow_tf32_matmul": read(lambda: B.cuda.matmul.allow_tf32),
        "allow_tf32_cudnn": read(lambda: B.cudnn.allow_tf32),
    }
    for name, obj in FP32.items():
        out[name] = read(lambda obj=obj: obj.fp32_precision)
    return out


def reset():
    torch.set_float32_matmul_precision("highest")
    B.cudnn.allow_tf32 = True
    for name, obj in FP32.items():
        obj.fp32_precision = "tf32" if name in ("cudnn.conv", "cudnn.rnn") else "none"


def run(step):
    kind, *args = step
    if kind == "matmul_precision":
        torch.set_float32_matmul_precision(args[0])
    elif kind == "allow_tf32_matmul":
        B.cuda.matmul.allow_tf32 = args[0]
    elif kind == "allow_tf32_cudnn":
        B.cudnn.allow_tf32 = args[0]
    elif kind == "fp32":
        FP32[args[0]].fp32_precision = args[1]
    else:
        raise ValueError(kind)


PROGRAMS = [
    [],
    [["matmul_precision", "medium"], ["fp32", "cuda.matmul", "ieee"]],
    [["matmul_precision", "high"], ["fp32", "cuda.matmul", "ieee"]],
    [["fp32", "cuda.matmul", "tf32"]],
    [["fp32", "mkldnn.matmul", "tf32"]],
    [["matmul_precision", "medium"], ["fp32", "mkldnn.matmul", "tf32"]],
    [["matmul_precision", "high"], ["fp32", "mkldnn.matmul", "tf32"]],
    [["fp32", "mkldnn.matmul", "bf16"]],
    [["matmul_precision", "high"], ["fp32", "mkldnn.matmul", "bf16"]],
    [["matmul_precision", "medium"], ["fp32", "mkldnn.matmul", "ieee"]],
    [["fp32", "cudnn.conv", "ieee"], ["fp32", "cudnn.rnn", "ieee"]],
    [["allow_tf32_cudnn", False]],
    [["allow_tf32_cudnn", False], ["fp32", "cudnn.conv", "tf32"], ["fp32", "cudnn.rnn", "tf32"]],
    [["fp32", "cudnn.conv", "ieee"]],
    [["allow_tf32_cudnn", False], ["allow_tf32_cudnn", True]],
    [["allow_tf32_matmul", True]],
    [["matmul_precision", "medium"], ["allow_tf32_matmul", False]],
    [["matmul_precision", "medium"], ["allow_tf32_matmul", True]],
    [["fp32", "generic", "tf32"]],
    [["fp32", "generic", "bf16"]],
    [["fp32", "mkldnn", "bf16"], ["matmul_precision", "medium"]],
    [["fp32", "cudnn", "ieee"]],
    [["fp32", "cuda.matmul", "tf32"], ["fp32", "cuda.matmul", "none"]],
    [["matmul_precision", "high"], ["matmul_precision", "highest"]],
]

if __name__ == "__main__":
    if sys.argv[1:] == ["--state"]:
        print(json.dumps(state()))
        sys.exit()
    records = []
    for steps in PROGRAMS:
        reset()
        for step in steps:
            run(step)
        records.append({"env": {}, "steps": steps, "state": state()})
    env = dict(os.environ, TORCH_ALLOW_TF32_CUBLAS_OVERRIDE="1")
    child = subprocess.run([sys.executable, __file__, "--state"], env=env,
                           capture_output=True, text=True, check=True)
    records.append({"env": {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}, "steps": [],
                    "state": json.loads(child.stdout)})
    json.dump({"torch": torch.__version__, "programs": records}, sys.stdout, indent=1)
    print()
