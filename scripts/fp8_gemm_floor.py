#!/usr/bin/env python3
"""The card's FP8 tensor-core floor in energy per FLOP: a large e4m3 GEMM (cuBLASLt through
torch._scaled_mm, bf16 out) run for a few seconds at the power cap, with board power and SM clock
sampled by nvidia-smi every 50 ms (medians of the middle half). Prints TFLOP/s, W, MHz and pJ/FLOP,
the numbers docs/performance.md sets against the attention kernels' (mxflash-bench's pJ/FLOP column).
Usage (on the GPU machine): python3 scripts/fp8_gemm_floor.py [--seconds 3]"""
import argparse
import subprocess
import threading
import time

import torch


def sample(stop, out):
    while not stop.is_set():
        r = subprocess.run(["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
        try:
            p, c = r.stdout.strip().split(",")
            out.append((float(p), float(c)))
        except ValueError:
            pass
        time.sleep(0.05)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    one = torch.tensor(1.0, device="cuda")
    for m, n, k in [(8192, 8192, 8192), (16384, 16384, 8192), (8192, 8192, 16384)]:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
        def f():
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        t0 = time.time()
        while time.time() - t0 < 1.0:  # warm up to the cap
            f()
        torch.cuda.synchronize()
        stop, s = threading.Event(), []
        th = threading.Thread(target=sample, args=(stop, s))
        th.start()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        iters = 0
        e0.record()
        t0 = time.time()
        while time.time() - t0 < args.seconds:
            for _ in range(20):
                f()
            iters += 20
        e1.record()
        torch.cuda.synchronize()
        stop.set()
        th.join()
        tflops = 2.0 * m * n * k / (e0.elapsed_time(e1) / iters) / 1e9
        mid = s[len(s) // 4: 3 * len(s) // 4] or s
        w = sorted(x[0] for x in mid)[len(mid) // 2]
        mhz = sorted(x[1] for x in mid)[len(mid) // 2]
        print(f"fp8 gemm {m}x{n}x{k}: {tflops:.0f} TFLOP/s, {w:.0f} W, {mhz:.0f} MHz, {w / tflops:.3f} pJ/FLOP")


if __name__ == "__main__":
    main()
