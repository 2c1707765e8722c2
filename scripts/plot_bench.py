#!/usr/bin/env python3
"""Plot an mxflash-bench JSON (--json FILE) as a PNG: median throughput per case and direction, one
bar per implementation (attention: TFLOP/s; quantize: GB/s next to the device copy), with the
min..max sample range as error bars. Needs matplotlib; without it, says so and exits 0.

Usage: python3 scripts/plot_bench.py bench.json [-o bench.png]
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("-o", "--out", help="PNG file (default: JSON name with .png)")
    args = ap.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_bench: matplotlib is not importable; no plot written", file=sys.stderr)
        return 0
    with open(args.json) as fh:
        doc = json.load(fh)
    out = args.out or (args.json[:-5] if args.json.endswith(".json") else args.json) + ".png"

    groups = []  # (label, unit, [(impl, median, lo, hi)])
    for c in doc.get("cases", []):
        by_dir = {}
        for r in c.get("results", []):
            if r.get("status") != "ok":
                continue
            work = r["work"]
            scale = 1e12 if r["unit"] == "TFLOP/s" else 1e9
            st = r["stats_ms"]
            med = work / (st["median"] * 1e-3) / scale
            lo = work / (st["max"] * 1e-3) / scale
            hi = work / (st["min"] * 1e-3) / scale
            key = "quantize" if c["workload"] == "quantize" else r["direction"]
            label = r["direction"] if c["workload"] == "quantize" else r["impl"]
            by_dir.setdefault(key, []).append((label, med, lo, hi, r["unit"]))
        for d, bars in by_dir.items():
            groups.append(("%s %s" % (c["name"], d) if d != "quantize" else c["name"], bars))
    if not groups:
        print("plot_bench: no successful results in %s" % args.json, file=sys.stderr)
        return 1

    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 4.2), squeeze=False)
    env = doc.get("environment", {})
    fig.suptitle("mxflash-bench on %s (cuDNN %s): median, min..max" % (env.get("gpu", "?"),
                                                                     env.get("cudnn_version_runtime", "?")))
    for ax, (title, bars) in zip(axes[0], groups):
        names = [b[0] for b in bars]
        med = [b[1] for b in bars]
        err = [[b[1] - b[2] for b in bars], [b[3] - b[1] for b in bars]]
        ax.bar(range(len(bars)), med, yerr=err, capsize=3, color=["C%d" % i for i in range(len(bars))])
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(bars[0][4])
        for i, m in enumerate(med):
            ax.text(i, m, "%.0f" % m, ha="center", va="bottom", fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print("plot_bench: wrote " + out, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
