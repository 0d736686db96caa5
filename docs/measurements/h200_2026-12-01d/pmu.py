"""Hardware counters (cycles, instructions, branch misses, L1d and LLC misses) of the churn
example through perf_event_open, for a machine without the perf tool.
usage: pmu.py STEPS CHURN_BINARY CORE REPEATS: per shape and configuration, counts of runs with
one and with five timed rounds, differenced, per operation (median of REPEATS).
On the H200 machine every counter opened with ENOENT (its VM exposes no hardware events)."""
import ctypes, struct, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
# (type, config): PERF_TYPE_HARDWARE (0) cycles 0, instructions 1, cache-misses 3,
# branch-instructions 4, branch-misses 5; PERF_TYPE_HW_CACHE (3) L1D read miss.
EVENTS = [("cycles", 0, 0), ("instructions", 0, 1), ("branches", 0, 4), ("branch-misses", 0, 5),
          ("L1d-read-miss", 3, 0 | (0 << 8) | (1 << 16)), ("LLC-miss", 0, 3)]
def open_counter(typ, config):
    attr = bytearray(128)
    flags = (1 << 0) | (1 << 1) | (1 << 5) | (1 << 6)  # disabled, inherit, exclude_kernel, exclude_hv
    struct.pack_into("IIQQQQQ", attr, 0, typ, 128, config, 0, 0, 0, flags)
    buf = ctypes.create_string_buffer(bytes(attr), 128)
    fd = libc.syscall(298, buf, 0, -1, -1, 0)
    if fd < 0:
        return None, os.strerror(ctypes.get_errno())
    return fd, None
def measure(cmd):
    fds = []
    for name, t, c in EVENTS:
        fd, err = open_counter(t, c)
        fds.append((name, fd, err))
    for _, fd, _ in fds:
        if fd is not None: libc.ioctl(fd, 0x2400, 0)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    out = {}
    for name, fd, err in fds:
        if fd is None:
            out[name] = None; continue
        libc.ioctl(fd, 0x2401, 0)
        out[name] = struct.unpack("Q", os.read(fd, 8))[0]
        os.close(fd)
    return out, {n: e for n, _, e in fds if e}
if __name__ == "__main__":
    steps = int(sys.argv[1]); binary = sys.argv[2]; core = sys.argv[3]; reps = int(sys.argv[4])
    for shape in ["mixed", "pairs"]:
        for conf in ["", "ferrocuda_recommended:True"]:
            rows = []
            for rep in range(reps):
                a, errs = measure(["taskset", "-c", core, binary, conf, str(steps), "1", shape])
                b, _ = measure(["taskset", "-c", core, binary, conf, str(steps), "5", shape])
                if errs and rep == 0: print("errors:", errs)
                # Rounds 5 - 1: four rounds of `steps` operations.
                rows.append({k: (b[k] - a[k]) / (4 * steps) if a[k] is not None else None for k in a})
            med = {k: sorted(r[k] for r in rows)[len(rows)//2] if rows[0][k] is not None else None for k in rows[0]}
            print(f"{shape:6s} {conf or 'default':28s} " + " ".join(f"{k}={v:.2f}" if v is not None else f"{k}=NA" for k, v in med.items()), flush=True)
