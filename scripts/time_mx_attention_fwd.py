#!/usr/bin/env python3
"""Times what mx_attention's forward costs from bf16 inputs, quantization included, on the GPU:
  mx    three quantize_mx calls (Q, K along hdim, V along tokens) + attention_forward (prepare pass)
  exec  quantize_attention_forward + attention_forward_operands (what mx_attention runs)
Shapes: the llm and llm-long presets (H=16) and cross (B=64 K/V sequences of 16384, one shared Q of
512, H=3). CUDA events around samples of 5 calls, median of --samples after a warm-up.

Usage (GPU machine, module built: scripts/gpu_check.sh's python section builds it):
  PYTHONPATH=python python3 scripts/time_mx_attention_fwd.py [--samples 20]
"""
import argparse
import statistics

import torch

import mxflash

SHAPES = {
    "llm": ([2048] * 8, [2048] * 8, 16, False),
    "llm-long": ([8192] * 2, [8192] * 2, 16, False),
    "cross": ([512], [16384] * 64, 3, True),
}


def inputs(lq, lk, heads):
    """Uploaded metadata for lq, lk and bf16 q, k, v drawn on the GPU, with the generator (to draw more)."""
    qm, km = mxflash.JaggedMeta.from_lengths(lq), mxflash.JaggedMeta.from_lengths(lk)
    qm.upload()
    km.upload()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((sum(n), heads, 128), generator=g, device="cuda").to(torch.bfloat16) for n in (lq, lk, lk))
    return qm, km, q, k, v, g


def timed(fn, samples):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    out = []
    for _ in range(samples):
        start.record()
        for _ in range(5):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 5)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20)
    args = ap.parse_args()
    for name, (lq, lk, heads, bcast) in SHAPES.items():
        qm, km, q, k, v, _ = inputs(lq, lk, heads)

        def mx():
            mq, mk = mxflash.quantize_mx(q, qm, "hdim"), mxflash.quantize_mx(k, km, "hdim")
            mv = mxflash.quantize_mx(v, km, "seq")
            return mxflash.attention_forward(mq, mk, mv, qm, km, broadcast_q=bcast)

        def ex():
            ops = mxflash.quantize_attention_forward(q, k, v, qm, km)
            return mxflash.attention_forward_operands(ops, qm, km, broadcast_q=bcast)

        o1, _ = mx()
        o2, _ = ex()
        diff = (o1.float() - o2.float()).norm() / o1.float().norm()
        t_mx, t_ex = timed(mx, args.samples), timed(ex, args.samples)
        print(f"{name:9s} mx {t_mx:.3f} ms  exec {t_ex:.3f} ms  ({t_mx / t_ex:.2f}x)  out rel-diff {diff:.2e}")


if __name__ == "__main__":
    main()
