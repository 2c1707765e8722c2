#!/usr/bin/env python3
"""Times a training step of attention from bf16 inputs on the GPU, quantization included:
  q-2pass   quantize_attention_forward + quantize_attention_backward(forward=): the operands of a
            step from two reads of q, k, v (mx_attention until 2026-11-30)
  q-train   quantize_attention_training: the same bytes from one read of q, k, v (mx_attention now)
  fwd       quantize_attention_training + attention_forward_operands (mx_attention's forward)
  bwd       attention_backward_operands on those operands (mx_attention's backward: dO's preprocess
            and the two kernels)
  2pass     fwd with quantize_attention_forward, then quantize_attention_backward(forward=) +
            attention_backward_operands: the previous step, outside autograd
  step      mxflash.autograd.mx_attention forward + backward through torch autograd (grads in bf16)
  sdpa      torch.nn.functional.scaled_dot_product_attention forward + backward, bf16, dense
            (B, H, L, 128), cuDNN backend where torch has it (else torch's default), equal lengths only
Shapes: llm (B=8, L=2048, H=16), llm-long (B=2, L=8192, H=16), cross (one shared Q of 512 against 64
K/V sequences of 16384, H=3; no sdpa: it has no broadcast Q). CUDA events around samples of 5
calls, median of --samples after a warm-up.

Usage (GPU machine, module built: scripts/gpu_check.sh's python section builds it):
  PYTHONPATH=python python3 scripts/time_mx_attention_step.py [--samples 10]
"""
import argparse

import torch

import mxflash
from mxflash.autograd import mx_attention
from time_mx_attention_fwd import SHAPES, inputs, timed  # the same shapes, inputs and sampling (this directory)


def sdpa_step(lq, heads, samples):
    """Dense bf16 SDPA forward + backward; (ms, backend name)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    b, L = len(lq), lq[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn((b, heads, L, 128), generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn((b, heads, L, 128), generator=g, device="cuda", dtype=torch.bfloat16)

    def step():
        out = sdpa(q, k, v)
        out.backward(dout)

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return timed(step, samples), "cudnn"
    except (ImportError, AttributeError, RuntimeError):
        return timed(step, samples), "default"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=10)
    args = ap.parse_args()
    for name, (lq, lk, heads, bcast) in SHAPES.items():
        qm, km, q, k, v, g = inputs(lq, lk, heads)
        To = len(lk) * sum(lq) if bcast else sum(lq)
        dout = torch.randn((To, heads, 128), generator=g, device="cuda").to(torch.bfloat16)
        fops, bops = mxflash.quantize_attention_training(q, k, v, qm, km)
        out, lse = mxflash.attention_forward_operands(fops, qm, km, broadcast_q=bcast)

        def q_2pass():
            f = mxflash.quantize_attention_forward(q, k, v, qm, km)
            return mxflash.quantize_attention_backward(q, k, v, qm, km, forward=f)

        def q_train():
            return mxflash.quantize_attention_training(q, k, v, qm, km)

        def fwd():
            ops, _ = mxflash.quantize_attention_training(q, k, v, qm, km)
            return mxflash.attention_forward_operands(ops, qm, km, broadcast_q=bcast)

        def bwd():
            return mxflash.attention_backward_operands(bops, out, dout, lse, qm, km, broadcast_q=bcast)

        def two_pass():
            f = mxflash.quantize_attention_forward(q, k, v, qm, km)
            o, l = mxflash.attention_forward_operands(f, qm, km, broadcast_q=bcast)
            ops = mxflash.quantize_attention_backward(q, k, v, qm, km, forward=f)
            return mxflash.attention_backward_operands(ops, o, dout, l, qm, km, broadcast_q=bcast)

        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

        def step():
            for x in leaves:
                x.grad = None
            o = mx_attention(*leaves, qm, km, broadcast_q=bcast)
            o.backward(dout)

        # the two routes give the same gradients to the bit (the same operand bytes)
        same = all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(bwd(), two_pass()))
        t = {n: timed(f, args.samples) for n, f in (("q-2pass", q_2pass), ("q-train", q_train), ("fwd", fwd),
                                                   ("bwd", bwd), ("2pass", two_pass), ("step", step))}
        line = (f"{name:9s} q-2pass {t['q-2pass']:.3f}  q-train {t['q-train']:.3f}  fwd {t['fwd']:.3f}  "
                f"bwd {t['bwd']:.3f}  2pass {t['2pass']:.3f}  mx_attention step {t['step']:.3f} ms")
        if not bcast and len(set(lq)) == 1 and lq == lk:
            ts, backend = sdpa_step(lq, heads, args.samples)
            line += f"  | sdpa bf16 ({backend}) step {ts:.3f} ms ({ts / t['step']:.2f}x ours)"
        print(line + f"  | grads of both routes bit-identical: {same}", flush=True)


if __name__ == "__main__":
    main()
