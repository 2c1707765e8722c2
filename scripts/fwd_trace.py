#!/usr/bin/env python3
"""Prints the attention forward's consumer timeline recorded by the trace variant (bit 18 of
MXFLASH_FWD_VARIANT in an experiments build; MXFLASH_FWD_TRACE names the file, docs/attention.md).

The file holds, for 4 CTAs x 2 consumer warpgroups x 64 K/V tiles, 8 SM clock readings taken by
lane 0 of the warpgroup's first warp: 0 before the GEMM turn, 1 after S(j) and P.V(j-1) are issued,
2 after the wait for S(j), 3 after the row maxima (unmasked tiles), 4 after the exponentials, 5
after the wait for P.V(j-1), 6 after its promotion (7 unused). Prints the median cycles of each
phase per warpgroup, and a few tiles of both warpgroups on one clock.

Usage: fwd_trace.py TRACE_FILE [--tiles 10:14]
"""
import argparse
import statistics
import sys

CTAS, WARPGROUPS, TILES, EVENTS = 4, 2, 64, 8
PHASES = ["turn+issue", "S wait", "row max", "exps", "P.V wait", "promote", "to next"]


def load(path):
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append([int(x) for x in line.split()])
    if len(rows) != CTAS * WARPGROUPS * TILES or any(len(r) != EVENTS for r in rows):
        sys.exit(f"fwd_trace: {path}: expected {CTAS * WARPGROUPS * TILES} rows of {EVENTS} clocks")
    return [[[rows[(c * WARPGROUPS + w) * TILES + j] for j in range(TILES)] for w in range(WARPGROUPS)]
            for c in range(CTAS)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--tiles", default="10:14", help="tiles to print on one clock, first:last")
    a = ap.parse_args()
    t = load(a.trace)
    first, last = (int(x) for x in a.tiles.split(":"))
    for c in range(CTAS):
        if all(t[c][w][1][0] == 0 for w in range(WARPGROUPS)):
            continue  # a CTA the launch did not have
        print(f"CTA slot {c}")
        for w in range(WARPGROUPS):
            spans, periods = [], []
            for j in range(1, TILES - 1):
                e, nxt = t[c][w][j][:7], t[c][w][j + 1][0]
                if 0 in e or nxt == 0:
                    continue  # masked last tile (no row-max stamp) or past the item's tiles
                spans.append([(e[k + 1] - e[k]) % 2**32 for k in range(6)] + [(nxt - e[6]) % 2**32])
                periods.append((nxt - e[0]) % 2**32)
            if not spans:
                continue
            med = [statistics.median(s[k] for s in spans) for k in range(7)]
            print(f"  warpgroup {w}: {len(spans)} tiles, period {statistics.median(periods):.0f} cycles: " +
                  ", ".join(f"{n} {m:.0f}" for n, m in zip(PHASES, med)))
        base = min(t[c][w][first][0] for w in range(WARPGROUPS))
        for j in range(first, min(last, TILES - 1) + 1):
            for w in range(WARPGROUPS):
                print(f"    tile {j:2d} wg {w}: " + " ".join(f"{(x - base) % 2**32:6d}" for x in t[c][w][j][:7]))


if __name__ == "__main__":
    main()
