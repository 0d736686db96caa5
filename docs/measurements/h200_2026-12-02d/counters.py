"""Hardware counters of the allocator's churn on this host, where `perf` is not installed:
the kernel's perf_event_open, called through ctypes, as `perf stat` calls it (the events
opened on a forked child before it executes the program, enabled at its exec, inherited by
its threads, user-space only).

The steady churn's cost per operation is a difference, as `cargo xtask churn-profile`
takes it under callgrind: the same program with one and with three timed rounds after the
same warm-up, the difference of the counts over the 2 x STEPS operations between them.
Start-up, the driver's initialisation and the warm-up cancel out.

usage:
  counters.py churn CHURN CORE STEPS [CONF ...]  our churn example (crates/alloc/examples/
      churn.rs, over the real driver), for each configuration ("" is PyTorch's defaults)
  counters.py anchor CORE STEPS     PyTorch's churn: torch_anchor.py's own C++ loop
      (`mixed_ns`, read from that file by xtask/anchors/torch_table.py), raw_alloc and raw_delete
  counters.py run CORE -- CMD ...   the totals of one command

Each line gives cycles, instructions, instructions per cycle, branch mispredictions, and
first-level data-cache read misses and last-level cache misses per operation. An event
the processor or the kernel refuses is reported as such (with errno), not guessed."""
import ctypes
import json
import os
import sys
import tempfile

SYS_PERF_EVENT_OPEN = 298  # x86_64
PERF_TYPE_HARDWARE, PERF_TYPE_HW_CACHE = 0, 3
HW_CACHE_L1D, HW_CACHE_OP_READ, HW_CACHE_RESULT_MISS = 0, 0, 1
# perf_event_attr.flags bits
DISABLED, INHERIT, EXCLUDE_KERNEL, EXCLUDE_HV, ENABLE_ON_EXEC = 1, 1 << 1, 1 << 5, 1 << 6, 1 << 12
READ_TIMES = 1 | 2  # PERF_FORMAT_TOTAL_TIME_ENABLED | PERF_FORMAT_TOTAL_TIME_RUNNING
ATTR_SIZE = 112  # PERF_ATTR_SIZE_VER5

EVENTS = {
    "cycles": (PERF_TYPE_HARDWARE, 0),
    "instructions": (PERF_TYPE_HARDWARE, 1),
    "branch_misses": (PERF_TYPE_HARDWARE, 5),
    "l1d_read_misses": (PERF_TYPE_HW_CACHE,
                        HW_CACHE_L1D | HW_CACHE_OP_READ << 8 | HW_CACHE_RESULT_MISS << 16),
    "llc_misses": (PERF_TYPE_HARDWARE, 3),
}

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def open_event(kind, config, pid):
    """An fd counting `config` of `kind` in `pid` and its later threads from its exec, or
    the errno the kernel refused it with (as a negative number)."""
    attr = bytearray(ATTR_SIZE)
    flags = DISABLED | INHERIT | EXCLUDE_KERNEL | EXCLUDE_HV | ENABLE_ON_EXEC
    for offset, fmt_size, value in ((0, 4, kind), (4, 4, ATTR_SIZE), (8, 8, config),
                                    (32, 8, READ_TIMES), (40, 8, flags)):
        attr[offset:offset + fmt_size] = value.to_bytes(fmt_size, "little")
    buf = (ctypes.c_char * ATTR_SIZE).from_buffer(attr)
    fd = libc.syscall(SYS_PERF_EVENT_OPEN, buf, pid, -1, -1, 0)
    return fd if fd >= 0 else -ctypes.get_errno()


def read_event(fd):
    """The count, scaled by the time it ran (the kernel shares counters when there are too
    few), or None when it never ran."""
    data = os.read(fd, 24)
    value, enabled, running = (int.from_bytes(data[i:i + 8], "little") for i in (0, 8, 16))
    return value * enabled / running if running else None


def count(cmd, core):
    """Runs `cmd` on `core` under every event; returns (counts, its standard output).
    A count is a number, or a string saying why there is none."""
    ready_r, ready_w = os.pipe()
    out = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.close(ready_w)
        os.sched_setaffinity(0, {core})
        os.dup2(out.fileno(), 1)
        os.read(ready_r, 1)
        try:
            os.execvp(cmd[0], cmd)
        finally:
            os._exit(127)
    os.close(ready_r)
    fds = {name: open_event(kind, config, pid) for name, (kind, config) in EVENTS.items()}
    os.write(ready_w, b"x")
    os.close(ready_w)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{cmd} failed: {os.waitstatus_to_exitcode(status)}")
    counts = {}
    for name, fd in fds.items():
        if fd < 0:
            counts[name] = f"refused: {os.strerror(-fd)}"
        else:
            value = read_event(fd)
            counts[name] = value if value is not None else "never ran"
            os.close(fd)
    out.seek(0)
    return counts, out.read().decode()


def per_operation(one, three, ops):
    """The difference of two runs' counts over the `ops` operations between them."""
    return {name: (three[name] - one[name]) / ops
            if isinstance(one[name], float) and isinstance(three[name], float) else one[name]
            for name in EVENTS}


def report(label, per_op, ns):
    ipc = (per_op["instructions"] / per_op["cycles"]
           if all(isinstance(per_op[k], float) for k in ("instructions", "cycles")) else None)
    print(json.dumps({"run": label, "ns_per_op": ns, "ipc": ipc, **per_op}), flush=True)


def churn(binary, core, steps, confs):
    """Our churn example, for each configuration."""
    for conf in confs:
        runs = [count([binary, conf, str(steps), str(rounds), "mixed"], core)
                for rounds in (1, 3)]
        per_op = per_operation(runs[0][0], runs[1][0], 2 * steps)
        # The example prints "... ns per operation A B C" for its timed rounds.
        line = next(l for l in runs[1][1].splitlines() if "ns per operation" in l)
        ns = [float(x) for x in line.split("ns per operation")[1].split()]
        report(f"ours [{conf}]", per_op, sorted(ns)[len(ns) // 2])


ANCHOR = """
import sys, torch, torch_table
torch.zeros(1, device="cuda")
ext = torch_table.allocator_extension()
steps, rounds = int(sys.argv[1]), int(sys.argv[2])
ext.mixed_ns(1024, steps)
print(ext.mixed_ns(1024, rounds * steps))
"""


def anchor(core, steps):
    """PyTorch's churn: a warm-up of `steps`, then one or three times `steps` more."""
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = lambda rounds: [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r})\n"
                          + ANCHOR, str(steps), str(rounds)]
    count(cmd(1), core)  # builds (or finds) the extension, so that neither run below does
    runs = [count(cmd(rounds), core) for rounds in (1, 3)]
    per_op = per_operation(runs[0][0], runs[1][0], 2 * steps)
    report("PyTorch", per_op, float(runs[1][1].split()[-1]))


def main(args):
    if args[:1] == ["churn"] and len(args) >= 5:
        churn(args[1], int(args[2]), int(args[3]), args[4:])
    elif args[:1] == ["anchor"] and len(args) == 3:
        anchor(int(args[1]), int(args[2]))
    elif args[:1] == ["run"] and len(args) >= 4 and args[2] == "--":
        counts, out = count(args[3:], int(args[1]))
        sys.stdout.write(out)
        print(json.dumps(counts))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
