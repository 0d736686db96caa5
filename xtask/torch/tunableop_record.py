import os, sys, glob
out = os.environ.get("OUT", "/tmp")
os.environ["PYTORCH_TUNABLEOP_ENABLED"] = "1"
os.environ["PYTORCH_TUNABLEOP_TUNING"] = "1"
os.environ["PYTORCH_TUNABLEOP_VERBOSE"] = "0"
os.environ["PYTORCH_TUNABLEOP_FILENAME"] = os.path.join(out, "tunableop_results.csv")
import torch
import torch.cuda.tunable as tunable
print([n for n in dir(tunable) if not n.startswith("_")])
print("enabled", tunable.is_enabled(), "tuning", tunable.tuning_is_enabled(), "file", tunable.get_filename())
for dt in (torch.float32, torch.float16, torch.bfloat16):
    for (m, n, k) in ((64, 64, 64), (128, 256, 512)):
        a = torch.randn(m, k, device="cuda", dtype=dt); b = torch.randn(k, n, device="cuda", dtype=dt)
        torch.matmul(a, b); torch.matmul(a.t().contiguous().t(), b)
        torch.bmm(a.unsqueeze(0).repeat(3, 1, 1), b.unsqueeze(0).repeat(3, 1, 1))
torch.cuda.synchronize()
print("validators", tunable.get_validators())
res = tunable.get_results()
print("results", len(res), list(res)[:8])
for fn in ("write_file", "write_file_on_exit"):
    if hasattr(tunable, fn):
        print("calling", fn)
        getattr(tunable, fn)() if fn == "write_file" else tunable.write_file_on_exit(True)
        break
sys.stdout.flush()
