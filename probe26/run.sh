cd probe26
python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())"
python3 keys.py lazy 2>&1 | grep -v Warning | head -30
python3 keys.py eager 2>&1 | grep -v Warning | head -30
D=$(python3 -c "import torch.distributed, os; print(os.path.dirname(torch.distributed.__file__))")
grep -n "PrefixStore(" $D/rendezvous.py $D/distributed_c10d.py | head -20
grep -n "def _process_group_name\|_world.group_count\|group_name = " $D/distributed_c10d.py | head -20
