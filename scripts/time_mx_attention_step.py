#!/usr/bin/env python3
"""Times a training step of attention from bf16 inputs on the GPU, quantization included:
  fwd       quantize_attention_forward + attention_forward_operands (mx_attention's forward)
  bwd       quantize_attention_backward(forward=) + attention_backward_operands (its backward now)
  bwd-mx    quantize_hdim_seq (Q, K) + quantize_mx (V) + attention_backward on MX tensors (its
            backward before 2026-11-29 late night)
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
        fops = mxflash.quantize_attention_forward(q, k, v, qm, km)
        out, lse = mxflash.attention_forward_operands(fops, qm, km, broadcast_q=bcast)

        def fwd():
            ops = mxflash.quantize_attention_forward(q, k, v, qm, km)
            return mxflash.attention_forward_operands(ops, qm, km, broadcast_q=bcast)

        def bwd():
            ops = mxflash.quantize_attention_backward(q, k, v, qm, km, forward=fops)
            return mxflash.attention_backward_operands(ops, out, dout, lse, qm, km, broadcast_q=bcast)

        def bwd_mx():
            ops = []
            for x, m in ((q, qm), (k, km)):
                ph, sh, ps, ss = mxflash.quantize_hdim_seq(x, m)
                ops += [mxflash.MxTensor(ph, sh, "hdim"), mxflash.MxTensor(ps, ss, "seq")]
            ops.append(mxflash.quantize_mx(v, km, "hdim"))
            return mxflash.attention_backward(*ops, out, dout, lse, qm, km, broadcast_q=bcast)

        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

        def step():
            for x in leaves:
                x.grad = None
            o = mx_attention(*leaves, qm, km, broadcast_q=bcast)
            o.backward(dout)

        a, b = bwd(), bwd_mx()
        diff = max(float((x.float() - y.float()).norm() / y.float().norm()) for x, y in zip(a, b))
        t = {n: timed(f, args.samples) for n, f in (("fwd", fwd), ("bwd", bwd), ("bwd-mx", bwd_mx), ("step", step))}
        line = (f"{name:9s} fwd {t['fwd']:.3f}  bwd {t['bwd']:.3f}  bwd-mx {t['bwd-mx']:.3f} "
                f"({t['bwd-mx'] / t['bwd']:.2f}x)  mx_attention step {t['step']:.3f} ms")
        if not bcast and len(set(lq)) == 1 and lq == lk:
            ts, backend = sdpa_step(lq, heads, args.samples)
            line += f"  | sdpa bf16 ({backend}) step {ts:.3f} ms ({ts / t['step']:.2f}x ours)"
        print(line + f"  | grads bwd vs bwd-mx rel-diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
