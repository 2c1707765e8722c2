#!/usr/bin/env python3
"""Prints the consumer timelines recorded by the attention kernels' clock traces
(src/cuda/attention/trace.cuh; experiments builds only, docs/attention.md and docs/backward.md).

The file holds, for 4 CTAs x 3 consumer warpgroups (a kernel of two leaves the third zero) x 128 slots, 8 SM clock readings taken by lane
0 of the warpgroup's first warp.
  --kind fwd (MXFLASH_FWD_VARIANT with bit 18, MXFLASH_FWD_TRACE): slot = K/V tile; 0 before the
    GEMM turn, 1 S(j) and P.V(j-1) issued, 2 S(j) done, 3 row maxima (unmasked tiles), 4
    exponentials done, 5 P.V(j-1) done, 6 promoted.
  --kind bwd (MXFLASH_BWD_VARIANT with bit 10, MXFLASH_BWD_TRACE; the dK/dV kernel, first item of
    CTAs 0, 40, 80, 120): slot = 2 x Q tile + half; 0 before S and dP, 1 S, dP done, 2 P and dS
    computed, 3 dK GEMM done, 4 dK promoted, 5 dV GEMM done and 6 dV promoted (second half only),
    7 P and dS values done, before their row scales and packing (not printed: read the file).
Prints the median cycles of each phase per warpgroup, and a few slots of both warpgroups on one
clock.

Usage: attn_trace.py TRACE_FILE [--kind fwd|bwd] [--slots 10:13]
"""
import argparse
import statistics
import sys

CTAS, SLOTS, EVENTS = 4, 128, 8
WARPGROUPS = 3  # table rows per CTA and slot (trace.cuh kTraceGroups); a kernel of two leaves the third zero
PHASES = {
    "fwd": ["turn+issue", "S wait", "row max", "exps", "P.V wait", "promote", "to next"],
    "bwd": ["S,dP", "P,dS", "dK GEMM", "dK promote", "dV GEMM", "dV promote", "to next"],
}


def load(path):
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append([int(x) for x in line.split()])
    if not rows or len(rows) != CTAS * WARPGROUPS * SLOTS or any(len(r) != EVENTS for r in rows):
        sys.exit(f"attn_trace: {path}: expected {CTAS} x {WARPGROUPS} x {SLOTS} rows of {EVENTS} clocks")
    slots = SLOTS
    return [[[rows[(c * WARPGROUPS + w) * slots + j] for j in range(slots)] for w in range(WARPGROUPS)]
            for c in range(CTAS)]


def spans_of(e, nxt, kind, slot):
    """The phase lengths of one slot (None: a slot the trace does not cover whole)."""
    d = lambda a, b: (b - a) % 2**32  # noqa: E731
    if kind == "fwd":
        if 0 in e[:7] or nxt == 0:
            return None  # masked last tile (no row-max stamp) or past the item's tiles
        return [d(e[k], e[k + 1]) for k in range(6)] + [d(e[6], nxt)]
    last = 6 if slot % 2 else 4  # dV on the second half only
    if 0 in e[:last + 1] or nxt == 0:
        return None
    spans = [d(e[k], e[k + 1]) for k in range(4)]
    spans += [d(e[4], e[5]), d(e[5], e[6])] if slot % 2 else [None, None]
    return spans + [d(e[last], nxt)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--kind", choices=["fwd", "bwd"], default="fwd")
    ap.add_argument("--slots", "--tiles", default="10:13", help="slots to print on one clock, first:last")
    a = ap.parse_args()
    t = load(a.trace)
    n = len(t[0][0])
    first, last = (int(x) for x in a.slots.split(":"))
    for c in range(CTAS):
        if all(t[c][w][1][0] == 0 for w in range(WARPGROUPS)):
            continue  # a CTA the launch did not have
        groups = [w for w in range(WARPGROUPS) if t[c][w][1][0] != 0]
        print(f"CTA slot {c}")
        for w in range(WARPGROUPS):
            spans = [s for j in range(1, n - 1) if (s := spans_of(t[c][w][j], t[c][w][j + 1][0], a.kind, j))]
            if not spans:
                continue
            med = []
            for k in range(7):
                vals = [s[k] for s in spans if s[k] is not None]
                med.append(statistics.median(vals) if vals else float("nan"))
            step = 2 if a.kind == "bwd" else 1  # a Q tile is two slots
            periods = [(t[c][w][j + step][0] - t[c][w][j][0]) % 2**32 for j in range(1, n - step)
                       if t[c][w][j][0] and t[c][w][j + step][0]]
            unit = "Q tile" if a.kind == "bwd" else "K/V tile"
            print(f"  warpgroup {w}: {len(spans)} slots, {statistics.median(periods):.0f} cycles per {unit}: " +
                  ", ".join(f"{p} {m:.0f}" for p, m in zip(PHASES[a.kind], med)))
        base = min(t[c][w][first][0] for w in groups)
        for j in range(first, min(last, n - 1) + 1):
            for w in groups:
                print(f"    slot {j:3d} wg {w}: " + " ".join(f"{(x - base) % 2**32:6d}" for x in t[c][w][j][:7]))


if __name__ == "__main__":
    main()
