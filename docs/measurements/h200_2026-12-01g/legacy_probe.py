"""What the driver does with the legacy stream while a blocking stream captures: for each
capture mode, a fresh capture on a blocking stream, then one call (cuStreamQuery or
cuStreamSynchronize of CU_STREAM_LEGACY, cuCtxSynchronize, cuStreamGetCaptureInfo of the
legacy stream), printing the call's result and the capture's status after it and at its end.
Through ctypes on libcuda, no toolkit needed."""
import ctypes as C

cuda = C.CDLL("libcuda.so.1")
LEGACY = C.c_void_p(1)  # CU_STREAM_LEGACY


def check(r, what):
    if r != 0:
        raise SystemExit(f"{what}: {r}")


check(cuda.cuInit(0), "cuInit")
dev, ctx = C.c_int(), C.c_void_p()
check(cuda.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
check(cuda.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "retain")
check(cuda.cuCtxSetCurrent(ctx), "set current")
stream = C.c_void_p()
check(cuda.cuStreamCreate(C.byref(stream), 0), "cuStreamCreate (blocking)")
STATUS = {0: "none", 1: "active", 2: "invalidated"}


def status(s):
    st = C.c_int(-1)
    r = cuda.cuStreamIsCapturing(s, C.byref(st))
    return f"{STATUS.get(st.value, st.value)}" if r == 0 else f"error {r}"


def info_legacy():
    st, cid = C.c_int(-1), C.c_ulonglong(0)
    return cuda.cuStreamGetCaptureInfo_v2(LEGACY, C.byref(st), C.byref(cid), None, None, None)


calls = {
    "cuStreamQuery(legacy)": lambda: cuda.cuStreamQuery(LEGACY),
    "cuStreamSynchronize(legacy)": lambda: cuda.cuStreamSynchronize(LEGACY),
    "cuCtxSynchronize": lambda: cuda.cuCtxSynchronize(),
    "cuStreamGetCaptureInfo(legacy)": info_legacy,
}
for mode, name in ((0, "global"), (1, "thread_local"), (2, "relaxed")):
    for what, call in calls.items():
        check(cuda.cuStreamBeginCapture_v2(stream, mode), "begin")
        r = call()
        after = status(stream)
        graph = C.c_void_p()
        end = cuda.cuStreamEndCapture(stream, C.byref(graph))
        if graph.value:
            cuda.cuGraphDestroy(graph)
        print(f"{name:12} {what:32} -> {r:4}  capture then {after:11} end {end}", flush=True)
