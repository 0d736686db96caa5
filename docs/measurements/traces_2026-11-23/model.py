"""Models of the caching allocator's segment policy, used for docs/measurements/traces_2026-11-23.md.

Two pure-Python models, each checked against `ferrocuda replay` on the traces in tests/data:

* `run_default(trace, mode)`: the default configuration (fixed segments, best fit by
  (stream, size, address)). mode "bump" places the k-th segment at increasing addresses as
  ferrocuda's fake device does; mode "recorded" places it at the address of the recording's
  k-th `segment_alloc` (where PyTorch's real driver put it). "bump" gives ferrocuda's peak
  reserved bytes and segment count, "recorded" gives PyTorch's, on all 8 traces.
* `Sim(large_page, reclaim)`: expandable segments (PyTorch's policy) and ferrocuda's
  `expandable_segments_reclaim`, with the large pool's page size a parameter (today's key
  `large_segment_size_mb`, which must be > 10). `check` compares its peak reserved bytes
  and page-mapping count with the CLI's for 8 traces x 6 page sizes x reclaim off/on.

usage:  model.py default | check [FERROCUDA_BIN] | grid | cost     (from the repository root)
One device, one stream per trace as recorded, no out-of-memory path, no events."""
import bisect, json, lzma, os, pickle, subprocess, sys

TRACES = ("gpt2_train resnet50_train bert_train_varlen vit_train_fixed bert_serve "
          "llama_decode llama_serve_random llama_serve_fixed").split()
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests", "data")

SMALL = 1 << 20
MIB = 1 << 20
SEGSTEP = (2 << 20) * 720720 * 64   # a multiple of every page size k*2MiB, k<=16, and > VA
VA = (80 << 30) + (80 << 30) // 8          # 9/8 of the 80 GiB fake device


def rnd(n):
    return 512 if n < 512 else (n + 511) // 512 * 512


class B:
    __slots__ = ("ptr", "size", "kind", "mapped", "alloc", "busy", "prev", "next", "inpool")

    def __init__(s, ptr, size, kind, mapped):
        s.ptr, s.size, s.kind, s.mapped = ptr, size, kind, mapped
        s.alloc = s.busy = s.inpool = False
        s.prev = s.next = None


class Sim:
    def __init__(s, large_page=20 * MIB, reclaim=False, policy=None):
        s.page = {True: 2 * MIB, False: large_page}
        s.reclaim = reclaim
        s.policy = policy or {}
        s.free = {True: [], False: []}       # sorted (size, ptr, id(b)) -> blocks
        s.byid = {}
        s.unmapped = {True: [], False: []}   # sorted ptr
        s.ublk = {}                          # ptr -> unmapped block
        s.spare = {True: 0, False: 0}        # spare pages (count)
        s.reserved = s.peak = 0
        s.segbase = SEGSTEP
        s.maps = 0
        s.created_pages = 0; s.reused_pages = 0; s.reclaims = 0; s.unmapped_pages = 0
        s.shared = s.policy.get('shared_spare', False) and s.page[True] == s.page[False]
        s.peak_at = -1
        s.now = 0

    # pools
    def pin(s, b):
        b.inpool = True
        bisect.insort(s.free[b.kind], (b.size, b.ptr, id(b))); s.byid[id(b)] = b

    def pout(s, b):
        b.inpool = False
        L = s.free[b.kind]; i = bisect.bisect_left(L, (b.size, b.ptr, id(b)))
        assert L[i][2] == id(b); L.pop(i)

    def uin(s, b):
        bisect.insort(s.unmapped[b.kind], b.ptr); s.ublk[b.ptr] = b

    def uout(s, b):
        L = s.unmapped[b.kind]; i = bisect.bisect_left(L, b.ptr); assert L[i] == b.ptr; L.pop(i)
        del s.ublk[b.ptr]

    def growable(s, b):
        return b is not None and (b.inpool or (not b.mapped and not b.busy))

    def expsize(s, b):
        return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

    def best_fit(s, kind, size):
        L = s.free[kind]
        i = bisect.bisect_left(L, (size, -1, -1))
        if i == len(L):
            return None
        it = i
        while it + 1 < len(L) and s.expsize(s.byid[L[it + 1][2]]) < s.expsize(s.byid[L[it][2]]):
            it += 1
        return s.byid[L[it][2]]

    def split_front(s, b, n):
        f = B(b.ptr, n, b.kind, b.mapped)
        f.prev = b.prev; f.next = b
        if b.prev is not None: b.prev.next = f
        b.prev = f; b.ptr += n; b.size -= n
        return f

    def absorb_next(s, b, n):
        b.size += n.size; b.next = n.next
        if n.next is not None: n.next.prev = b

    def find_expandable(s, kind, size):
        for p in s.unmapped[kind]:
            u = s.ublk[p]
            start = u.prev if (u.prev is not None and u.prev.inpool) else u
            cov, cur = 0, start
            while cur is not None and s.growable(cur):
                cov += cur.size
                if cov >= size:
                    return start
                cur = cur.next
        return None

    def new_segment(s, kind):
        pg = s.page[kind]
        b = B(s.segbase, VA // pg * pg, kind, False)
        s.segbase += SEGSTEP
        s.uin(b)

    def alloc_expandable(s, kind, size):
        pg = s.page[kind]
        start = s.find_expandable(kind, size)
        if start is None:
            s.new_segment(kind); start = s.find_expandable(kind, size)
        plan = []; cov = 0; cur = start
        while cov < size:
            assert s.growable(cur)
            if cur.inpool:
                plan.append(("take", cur)); cov += cur.size
            else:
                n = min(-(-(size - cov) // pg) * pg, cur.size)
                plan.append(("map", cur, n)); cov += n
            cur = cur.next
        for g in plan:
            b = g[1]
            if g[0] == "take": s.pout(b)
            else: s.uout(b)
            b.busy = True
        to_map = sum(g[2] for g in plan if g[0] == "map")
        pages = to_map // pg
        if s.reclaim and pages > s.spare[kind]:
            got = s.do_reclaim(kind, pages - s.spare[kind])
            s.reclaims += got > 0
            if s.shared and pages > s.spare[kind] and (kind or not s.policy.get('small_from_large_only')):
                s.do_reclaim(not kind, pages - s.spare[kind])
        reuse = min(pages, s.spare[kind]); s.spare[kind] -= reuse
        if s.shared:
            s.spare[not kind] = s.spare[kind]
        created = to_map - reuse * pg
        s.created_pages += created // pg; s.reused_pages += reuse
        s.reserved += created
        if s.reserved > s.peak: s.peak = s.reserved; s.peak_at = s.now
        pieces = []
        for g in plan:
            if g[0] == "take":
                pieces.append(g[1])
            else:
                b, n = g[1], g[2]
                if n < b.size:
                    f = s.split_front(b, n); b.busy = False; s.uin(b); piece = f
                else:
                    piece = b
                piece.mapped = True; s.maps += 1
                pieces.append(piece)
        first = pieces[0]
        for n in pieces[1:]:
            s.absorb_next(first, n)
        first.busy = False
        return first

    def do_reclaim(s, kind, wanted):
        pg = s.page[kind]
        got = 0
        order = list(s.free[kind])  # (size, ptr) ascending
        if s.policy.get("reclaim_order") == "largest":
            order = order[::-1]
        for (_, _, bid) in order:
            if wanted == 0: break
            b = s.byid[bid]
            if not b.inpool: continue
            first = -(-b.ptr // pg) * pg
            last = (b.ptr + b.size) // pg * pg
            if last <= first: continue
            last = min(last, first + wanted * pg)
            wanted -= (last - first) // pg
            end = b.ptr + b.size
            s.pout(b)
            mid = b
            if first > b.ptr:
                head = s.split_front(b, first - b.ptr); s.pin(head)
            if last < end:
                mid = s.split_front(b, last - first); s.pin(b)
            s.spare[kind] += (last - first) // pg
            if s.shared:
                s.spare[not kind] = s.spare[kind]
            s.unmapped_pages += (last - first) // pg
            got += (last - first) // pg
            s.settle_unmapped(mid)
        return got

    def settle_unmapped(s, b):
        b.mapped = False; b.busy = False
        p = b.prev
        if p is not None and not p.mapped and not p.busy:
            s.uout(p); s.absorb_next(p, b); b = p
        n = b.next
        if n is not None and not n.mapped and not n.busy:
            s.uout(n); s.absorb_next(b, n)
        s.uin(b)

    def malloc(s, req):
        size = rnd(req); kind = size <= SMALL
        b = s.best_fit(kind, size)
        if b is not None:
            s.pout(b)
        else:
            b = s.alloc_expandable(kind, size)
        if b.size - size >= 512:
            f = s.split_front(b, size)
            s.pin(b)
            b = f
        b.alloc = True
        return b

    def freeb(s, b):
        b.alloc = False
        p = b.prev
        if p is not None and p.inpool:
            s.pout(p); s.absorb_next(p, b); b = p
        n = b.next
        if n is not None and n.inpool:
            s.pout(n); s.absorb_next(b, n)
        s.pin(b)

    def run(s, trace):
        live = {}; req = peakreq = 0
        for i, e in enumerate(trace):
            s.now = i
            a = e["action"]
            if a == "alloc":
                live[e["addr"]] = (s.malloc(e["size"]), e["size"])
                req += e["size"]; peakreq = max(peakreq, req)
            elif a == "free_completed" and e["addr"] in live:
                b, n = live.pop(e["addr"]); req -= n
                s.freeb(b)
        return s.peak, peakreq, s.maps


SMALL_D = 1 << 20; MINB = 512; SMALLBUF = 2 << 20; LARGEBUF = 20 << 20; MINLARGE = 10 << 20; ROUNDL = 2 << 20


def alloc_size(n):
    if n <= SMALL_D: return SMALLBUF
    if n < MINLARGE: return LARGEBUF
    return (n + ROUNDL - 1) // ROUNDL * ROUNDL


def run_default(trace, mode):
    segaddrs = [(e['addr'], e['size']) for e in trace if e['action'] == 'segment_alloc']
    nseg = 0; bump = 1 << 40
    free = {True: [], False: []}  # small?: sorted (stream, size, addr)
    blocks = {}  # addr -> [size, stream, small, allocated, segstart, segend]
    live = {}
    reserved = peak = 0; mism = 0
    for e in trace:
        a = e['action']
        if a == 'alloc':
            size = rnd(e['size']); st = e.get('stream', 0); small = size <= SMALL
            L = free[small]
            i = bisect.bisect_left(L, (st, size, -1))
            if i < len(L) and L[i][0] == st:
                _, bsize, addr = L.pop(i)
            else:
                seg = alloc_size(size)
                if mode == 'recorded':
                    addr, ssz = segaddrs[nseg]
                    if ssz != seg: mism += 1
                else:
                    addr = bump; bump += (seg + (2 << 20) - 1) // (2 << 20) * (2 << 20) + (2 << 20)
                nseg += 1
                reserved += seg; peak = max(peak, reserved)
                blocks[addr] = [seg, st, small, False, addr, addr + seg]
                bsize = seg
            b = blocks[addr]
            rem = bsize - size
            if (small and rem >= MINB) or (not small and rem > SMALL):
                blocks[addr + size] = [rem, st, small, False, b[4], b[5]]
                bisect.insort(L, (st, rem, addr + size))
                b[0] = size
            b[3] = True
            live[e['addr']] = addr
        elif a == 'free_completed' and e['addr'] in live:
            addr = live.pop(e['addr']); b = blocks[addr]; b[3] = False
            L = free[b[2]]; st = b[1]
            # merge with next
            nxt = addr + b[0]
            if nxt < b[5] and nxt in blocks and not blocks[nxt][3]:
                nb = blocks.pop(nxt); L.remove((st, nb[0], nxt)); b[0] += nb[0]
            # merge with prev: find block ending at addr
            if addr > b[4]:
                # find previous block start: scan (blocks in a segment are contiguous)
                p = prev_of(blocks, addr, b[4])
                pb = blocks[p]
                if not pb[3]:
                    L.remove((st, pb[0], p)); pb[0] += b[0]; del blocks[addr]; addr = p; b = pb
            bisect.insort(L, (st, b[0], addr))
    return peak, nseg, mism


def prev_of(blocks, addr, segstart):
    # walk from segment start
    p = segstart
    while True:
        n = p + blocks[p][0]
        if n == addr: return p
        p = n


def load(m):
    with lzma.open(os.path.join(DATA, f"{m}.pickle.xz")) as f:
        return max(pickle.load(f)["device_traces"], key=len)


def pytorch_expandable():
    rows = json.load(open(os.path.join(DATA, "pytorch-figures.json")))
    return {r["model"]: r["peak_reserved"] / r["peak_requested"] for r in rows
            if r["conf"] == "expandable_segments:True"}


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "grid"
    traces = {m: load(m) for m in TRACES}
    if what == "default":
        for m, t in traces.items():
            print(m, "bump (peak reserved, segments):", run_default(t, "bump")[:2],
                  "recorded:", run_default(t, "recorded")[:2])
    elif what == "check":
        binary = sys.argv[2] if len(sys.argv) > 2 else "target/release/ferrocuda"
        grid = [(lp, rc) for lp in (20, 12, 14, 16, 24, 32) for rc in (False, True)]
        bad = 0
        for m, t in traces.items():
            args = [binary, "replay", os.path.join(DATA, f"{m}.pickle.xz"), "--json"]
            for lp, rc in grid:
                args += ["--conf", f"expandable_segments:True,large_segment_size_mb:{lp}"
                         + (",expandable_segments_reclaim:True" if rc else "")]
            figs = json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)
            for (lp, rc), f in zip(grid, figs):
                s = Sim(lp * MIB, rc); peak, _, maps = s.run(t)
                if (peak, maps) != (f["peak_reserved"], f["num_device_alloc"]):
                    bad += 1; print("MISMATCH", m, lp, rc, peak, maps, f["peak_reserved"], f["num_device_alloc"])
        print(f"{bad} mismatches in {len(traces) * len(grid)} runs")
    elif what in ("grid", "cost"):
        pt = pytorch_expandable()
        print(f"{'large page, reclaim':22s} " + " ".join(f"{m[:10]:>10s}" for m in TRACES))
        print(f"{'PyTorch expandable':22s} " + " ".join(f"{pt[m]:10.4f}" for m in TRACES))
        for lp in (20, 12, 8, 4, 2):
            for rc in (False, True):
                vals, cost = [], []
                for m, t in traces.items():
                    s = Sim(lp * MIB, rc); peak, req, _ = s.run(t)
                    vals.append(peak / req); cost.append(f"{s.created_pages + s.reused_pages}/{s.reclaims}")
                cells = cost if what == "cost" else [f"{v:.4f}" for v in vals]
                print(f"{lp:3d} MiB, {'reclaim' if rc else 'plain':8s}      " + " ".join(f"{c:>10s}" for c in cells))
        if what == "cost":
            print("cells: pages mapped (created + remapped from spare) / reclaims that unmapped something (each a stream sync)")


if __name__ == "__main__":
    main()
