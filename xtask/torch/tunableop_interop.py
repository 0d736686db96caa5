# Does PyTorch read the TunableOp results files ferrocuda writes? Each case runs in a
# fresh process (TunableOp reads its file once): what ferrocuda writes (PyTorch's validator
# and Default rows, its cuBLASLt choices in `<file>.ferrocuda` beside it), and the two
# layouts that decided that split: ferrocuda's validator line in PyTorch's file, and a row
# naming a ferrocuda solution (Gemm_Cublaslt_<rank>) there. Prints what read_file
# returned, the results PyTorch kept, and whether a matmul of that signature then runs and
# is right.
import os, subprocess, sys, tempfile

ROW = "GemmTunableOp_float_NN,nn_64_64_64_ld_64_64_64,{},0.0123\n"
SIDECAR = ("Validator,PT_VERSION,2.11.0\nValidator,FERROCUDA_CUBLASLT_VERSION,130400\n"
           "GemmTunableOp_float_NT,nt_64_64_64_ld_64_64_64,Gemm_Cublaslt_0,0.01\n")
CASES = {
    "as_ferrocuda_writes_it": "Validator,PT_VERSION,2.11.0\n" + ROW.format("Default"),
    "ours_validator_default_row": "Validator,PT_VERSION,2.11.0\n"
    "Validator,FERROCUDA_CUBLASLT_VERSION,130400\n" + ROW.format("Default"),
    "pytorch_validators_our_solution": "Validator,PT_VERSION,2.11.0\n" + ROW.format("Gemm_Cublaslt_0"),
}

CHILD = r"""
import sys, torch, torch.cuda.tunable as t
t.enable(True); t.tuning_enable(False)
ok = t.read_file(sys.argv[1])
print("read_file", ok, "results", t.get_results(), flush=True)
a = torch.randn(64, 64, device="cuda"); b = torch.randn(64, 64, device="cuda")
c = torch.matmul(a, b); torch.cuda.synchronize()
ref = (a.double() @ b.double()).float()
print("matmul ran, max error", (c - ref).abs().max().item(), flush=True)
"""

for name, text in CASES.items():
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "results.csv")
    with open(path, "w") as f:
        f.write(text)
    with open(path + ".ferrocuda", "w") as f:
        f.write(SIDECAR)
    env = dict(os.environ, PYTORCH_TUNABLEOP_VERBOSE="1",
               PYTORCH_TUNABLEOP_FILENAME=os.path.join(folder, "unused.csv"))
    r = subprocess.run([sys.executable, "-c", CHILD, path], env=env,
                       capture_output=True, text=True, timeout=300)
    print(f"== {name}: exit {r.returncode}")
    print(r.stdout.strip())
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    print("stderr:", "\n  ".join(lines[-12:]))
