"""CUDA IPC between PyTorch and ferrocuda, both ways, on one GPU (run by the bundle's run.sh).

    python3 ipc_torch.py ./example_ipc_peer            # every direction, both segment kinds
    python3 ipc_torch.py produce CONF                   # PyTorch as producer (for the example)
    python3 ipc_torch.py consume CONF PRODUCER...       # PyTorch as consumer of PRODUCER

For each allocator configuration ("" and "expandable_segments:True"):
  ours -> ours    example_ipc_peer consume CONF -- example_ipc_peer produce CONF
  torch -> ours   example_ipc_peer consume CONF -- python3 ipc_torch.py produce CONF
  ours -> torch   this script consumes what example_ipc_peer produce CONF sends
The consumer always starts the producer: a block of an expandable segment travels as the
producer's page descriptors, which the consumer fetches with pidfd_getfd, and a process
may do that to its children (Yama's default ptrace scope).

The data: two blocks of one segment, 1 MiB of counting bytes (i % 251) and 4 KiB of 0x5A.
The producer frees the first before sending (the limbo keeps it); the consumer checks both,
writes 0xC3 over the second and closes them; the producer then sees the writes and gets both blocks back
(PyTorch: memory_allocated() is 0 after del and torch.cuda.ipc_collect()).
"""
import faulthandler
import gc
import json
import os
import subprocess
import sys

FIRST, SECOND = 1 << 20, 4096
CONFS = ["", "expandable_segments:True"]


def counting(torch, n):
    return (torch.arange(n, dtype=torch.int64) % 251).to(torch.uint8)


def message(storage):
    (device, handle, size, offset, ref_name, ref_offset, event, sync) = storage._share_cuda_()
    return {
        "device": device, "handle": list(handle), "size_bytes": size,
        "offset_bytes": offset, "ref_counter_handle": ref_name.decode(),
        "ref_counter_offset": ref_offset, "event_handle": list(event),
        "event_sync_required": bool(sync),
    }


def produce(conf):
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    import torch
    first = counting(torch, FIRST).cuda()
    second = torch.full((SECOND,), 0x5A, dtype=torch.uint8, device="cuda")
    messages = [message(t.untyped_storage()) for t in (first, second)]
    # Freed before the consumer has the message: it must wait in the limbo.
    held = torch.cuda.memory_allocated()
    del first
    gc.collect()
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() == held, "the freed block left the limbo early"
    for m in messages:
        print(json.dumps(m), flush=True)
    line = sys.stdin.readline().strip()
    assert line == "closed", line
    torch.cuda.synchronize()
    assert bool((second == 0xC3).all()), "the consumer's writes did not arrive"
    del second
    gc.collect()
    torch.cuda.ipc_collect()
    left = torch.cuda.memory_allocated()
    assert left == 0, f"{left} bytes still held: a counter was not decremented"
    print(f"torch producer ok ({conf!r}): writes arrived, both blocks returned", file=sys.stderr)


def consume_in_torch(conf, producer):
    import torch
    torch.cuda.init()  # as torch.multiprocessing's rebuild_cuda_tensor does first
    child = subprocess.Popen(producer, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    messages = [json.loads(child.stdout.readline()) for _ in range(2)]
    ok = False
    try:
        storages = [
            torch.UntypedStorage._new_shared_cuda(
                m["device"], bytes(m["handle"]), m["size_bytes"], m["offset_bytes"],
                m["ref_counter_handle"].encode(), m["ref_counter_offset"],
                bytes(m["event_handle"]), m["event_sync_required"])
            for m in messages
        ]
        views = [torch.empty(0, dtype=torch.uint8, device="cuda").set_(s) for s in storages]
        assert torch.equal(views[0].cpu(), counting(torch, FIRST)), "first block differs"
        assert bool((views[1] == 0x5A).all()), "second block differs"
        views[1].fill_(0xC3)
        torch.cuda.synchronize()
        del views, storages
        gc.collect()
        ok = True
    finally:
        child.stdin.write("closed\n" if ok else "failed\n")
        child.stdin.close()
        code = child.wait()
    assert code == 0, f"the ferrocuda producer exited with {code}"
    print(f"torch consumer ok ({conf!r}, handle kind {chr(messages[0]['handle'][1])})")


def main(example):
    example = os.path.abspath(example)
    me = [sys.executable, os.path.abspath(__file__)]
    failed = 0
    for conf in CONFS:
        for name, run in [
            ("ours -> ours", lambda: subprocess.run(
                [example, "consume", conf, "--", example, "produce", conf], check=True)),
            ("torch -> ours", lambda: subprocess.run(
                [example, "consume", conf, "--", *me, "produce", conf], check=True)),
            ("ours -> torch", lambda: subprocess.run(
                [*me, "consume", conf, example, "produce", conf], check=True)),
        ]:
            try:
                run()
                print(f"PASS {name} {conf!r}", flush=True)
            except Exception as e:  # noqa: BLE001 - every failure is reported and counted
                failed += 1
                print(f"FAIL {name} {conf!r}: {e}", flush=True)
    print(f"ipc_torch: {6 - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    faulthandler.enable()
    if len(sys.argv) >= 2 and sys.argv[1] == "produce":
        produce(sys.argv[2] if len(sys.argv) > 2 else "")
    elif len(sys.argv) >= 4 and sys.argv[1] == "consume":
        consume_in_torch(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(main(sys.argv[1]))
