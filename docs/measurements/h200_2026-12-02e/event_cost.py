"""What one reclaim mark costs the host on a GPU: `cuEventRecord` (and the `cuEventQuery`
that settles it) on an idle stream and on a stream busy with queued work, through ctypes
on the driver, beside a no-op driver call (`cuCtxGetDevice`) for the ctypes overhead.

python3 event_cost.py [CALLS]   (prints ns per call, median of 7 runs of CALLS each)
"""
import ctypes
import statistics
import sys
import time

import torch

CALLS = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
RUNS = 7

torch.cuda.init()
torch.zeros(1, device="cuda")  # the primary context, current on this thread
cuda = ctypes.CDLL("libcuda.so.1")
stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
events = []
for _ in range(64):
    ev = ctypes.c_void_p()
    assert cuda.cuEventCreate(ctypes.byref(ev), 2) == 0  # CU_EVENT_DISABLE_TIMING
    events.append(ev)
device = ctypes.c_int()


def per_call(fn, calls=CALLS, before=None):
    times = []
    for _ in range(RUNS):
        if before:
            before()
        start = time.perf_counter_ns()
        for i in range(calls):
            fn(i)
        times.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(times)


# Records on a busy stream stay queued: few per run, so that the stream's queue never
# fills (a full queue would block the call until the device drains it).
BUSY_CALLS = 500


def busy():
    # A fresh stretch of queued work (about 0.3 s) before each run, longer than the run.
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)


def busy_and_record():
    busy()
    for ev in events:
        cuda.cuEventRecord(ev, stream)


noop = per_call(lambda i: cuda.cuCtxGetDevice(ctypes.byref(device)))
torch.cuda.synchronize()
idle_record = per_call(lambda i: cuda.cuEventRecord(events[i % 64], stream))
torch.cuda.synchronize()
idle_query = per_call(lambda i: cuda.cuEventQuery(events[i % 64]))
busy_record = per_call(lambda i: cuda.cuEventRecord(events[i % 64], stream), BUSY_CALLS, busy)
busy_query = per_call(lambda i: cuda.cuEventQuery(events[i % 64]), BUSY_CALLS, busy_and_record)
stream_query = per_call(lambda i: cuda.cuStreamQuery(stream), BUSY_CALLS, busy)
torch.cuda.synchronize()
print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {CALLS} calls x {RUNS} ({BUSY_CALLS} on a busy stream)")
for name, ns in [
    ("no-op driver call (ctypes overhead)", noop),
    ("cuEventRecord, idle stream", idle_record),
    ("cuEventQuery, completed event", idle_query),
    ("cuEventRecord, busy stream", busy_record),
    ("cuEventQuery, pending event", busy_query),
    ("cuStreamQuery, busy stream", stream_query),
]:
    print(f"{name:40s} {ns:8.1f} ns  ({ns - noop:7.1f} ns over the no-op)")
