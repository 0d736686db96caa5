"""What cuCtxSynchronize does to a capture underway on a blocking stream when another thread
calls it: for each capture mode of the capturing thread, a fresh capture on the main thread,
then cuCtxSynchronize on a second thread whose own capture mode is global (the default) or
relaxed (cuThreadExchangeStreamCaptureMode), printing the call's result and the capture's
status after it and at its end. The same-thread case was probed on 2026-12-01
(h200_2026-12-01g/legacy_probe.txt: 900, capture invalidated, in every mode). Through ctypes
on libcuda, no toolkit needed."""
import ctypes as C
import threading

cuda = C.CDLL("libcuda.so.1")


def check(r, what):
    if r != 0:
        raise SystemExit(f"{what}: {r}")


check(cuda.cuInit(0), "cuInit")
dev, ctx = C.c_int(), C.c_void_p()
check(cuda.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
check(cuda.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "retain")
check(cuda.cuCtxSetCurrent(ctx), "set current")
MODES = ((0, "global"), (1, "thread_local"), (2, "relaxed"))
STATUS = {0: "none", 1: "active", 2: "invalidated"}


def status(s):
    st = C.c_int(-1)
    r = cuda.cuStreamIsCapturing(s, C.byref(st))
    return f"{STATUS.get(st.value, st.value)}" if r == 0 else f"error {r}"


def other_thread(caller_mode):
    result = {}

    def body():
        check(cuda.cuCtxSetCurrent(ctx), "set current (other thread)")
        mode = C.c_int(caller_mode)
        if caller_mode != 0:
            check(cuda.cuThreadExchangeStreamCaptureMode(C.byref(mode)), "exchange")
        result["r"] = cuda.cuCtxSynchronize()
        if caller_mode != 0:
            check(cuda.cuThreadExchangeStreamCaptureMode(C.byref(mode)), "exchange back")

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return result["r"]


for blocking_flag, kind in ((0, "blocking"), (1, "non-blocking")):
    stream = C.c_void_p()
    check(cuda.cuStreamCreate(C.byref(stream), blocking_flag), "cuStreamCreate")
    for mode, name in MODES:
        for caller_mode, caller in ((0, "global"), (2, "relaxed")):
            check(cuda.cuStreamBeginCapture_v2(stream, mode), "begin")
            r = other_thread(caller_mode)
            after = status(stream)
            graph = C.c_void_p()
            end = cuda.cuStreamEndCapture(stream, C.byref(graph))
            if graph.value:
                cuda.cuGraphDestroy(graph)
            print(
                f"{kind:12} capture {name:12} other thread ({caller:7}) cuCtxSynchronize"
                f" -> {r:4}  capture then {after:11} end {end}",
                flush=True,
            )
