import os, sys, tempfile, struct, glob
import torch, torch.distributed as dist
mode = sys.argv[1]
path = tempfile.mktemp()
store = dist.FileStore(path, 1)
kw = {"device_id": torch.device("cuda:0")} if mode == "eager" else {}
dist.init_process_group("nccl", store=store, rank=0, world_size=1, **kw)
t = torch.ones(4, device="cuda"); dist.all_reduce(t); torch.cuda.synchronize()
data = open(path, "rb").read()
print(mode, "filestore bytes", len(data), repr(data))
i = 0
def rd():
    global i
    n = struct.unpack_from("<Q", data, i)[0]; i += 8
    s = data[i:i+n]; i += n
    return s
try:
    while i < len(data):
        k = rd(); v = rd()
        print("  key", k, "len", len(v), v[:40] if len(v) < 40 else "")
except Exception as e:
    print("parse stopped", e, data[i:i+64])
dist.destroy_process_group()
