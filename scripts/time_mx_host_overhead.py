#!/usr/bin/env python3
"""Host-side cost of mxflash's Python calls at a tiny shape (one sequence of 128, H = 2: the GPU work
is negligible): wall time per call (the least of 10 batches of 50 calls, the GPU drained after each batch), torch's
SDPA step beside it, then a cProfile of the mx_attention training step (top 25 by own time; not with
--no-profile). --batch B --length L --heads H set another shape, --causal the mask; at shapes whose
GPU work is not negligible, --host-only times the host alone (each batch's calls issued, timed
before the GPU is drained). "step's forward call" / "step's backward call": the two calls an
mx_attention step makes (mxflash._attention_step_forward / _backward: quantize into two buffers and
attend; the backward on the saved buffer). "mx_attention step, stubbed": the step with those two
answering from one earlier call (no work): the autograd machinery's and the glue's own host cost.

Usage (GPU machine, module built: scripts/gpu_check.sh's python section builds it):
  PYTHONPATH=python python3 scripts/time_mx_host_overhead.py [--no-profile] [--causal]
      [--batch 8 --length 2048 --heads 16 --host-only]
"""
import argparse
import cProfile
import pstats
import sys
import time

import torch
import mxflash
from mxflash.autograd import mx_attention
from torch.nn.functional import scaled_dot_product_attention as sdpa

ap = argparse.ArgumentParser()
ap.add_argument("--no-profile", action="store_true")
ap.add_argument("--causal", action="store_true")
ap.add_argument("--host-only", action="store_true")
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--length", type=int, default=128)
ap.add_argument("--heads", type=int, default=2)
args = ap.parse_args()
B, L, H, C = args.batch, args.length, args.heads, args.causal
qm, km = mxflash.JaggedMeta.from_lengths([L] * B), mxflash.JaggedMeta.from_lengths([L] * B)
qm.upload(); km.upload()
q, k, v = (torch.randn(B * L, H, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
dout = torch.randn(B * L, H, 128, device="cuda", dtype=torch.bfloat16)
fops, bops = mxflash.quantize_attention_training(q, k, v, qm, km)
out, lse = mxflash.attention_forward_operands(fops, qm, km, causal=C)
leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
sq, sk, sv = (torch.randn(B, H, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
sd = torch.randn(B, H, L, 128, device="cuda", dtype=torch.bfloat16)

def step():
    for x in leaves:
        x.grad = None
    mx_attention(*leaves, qm, km, causal=C).backward(dout)

def sdpa_step():
    for x in (sq, sk, sv):
        x.grad = None
    sdpa(sq, sk, sv, is_causal=C).backward(sd)

calls = {
    "quantize_attention_forward": lambda: mxflash.quantize_attention_forward(q, k, v, qm, km),
    "quantize_attention_training": lambda: mxflash.quantize_attention_training(q, k, v, qm, km),
    "attention_forward_operands": lambda: mxflash.attention_forward_operands(fops, qm, km, causal=C),
    "attention_backward_operands": lambda: mxflash.attention_backward_operands(bops, out, dout, lse, qm, km,
                                                                              causal=C),
    "mx_attention fwd (no grad)": lambda: mx_attention(q, k, v, qm, km, causal=C),
    "mx_attention step": step,
    "step's forward call": lambda: mxflash._attention_step_forward(q, k, v, qm, km, None, False, C_CODE, True),
    "step's backward call": lambda: mxflash._attention_step_backward(_step_out[2], _step_out[0], dout, _step_out[1],
                                                                     qm, km, H, H, None, False, C_CODE),
    "torch sdpa step (bf16)": sdpa_step,
    "torch.empty x12": lambda: [torch.empty(1000, device="cuda") for _ in range(12)],
    "mx_attention step, stubbed": "stubbed",
}
# The step with the two calls it makes (mxflash._attention_step_forward / _backward: the operands
# in two buffers, one binding call each way) replaced by stubs that return one real call's results:
# what the autograd machinery and mx_attention's own glue cost (the rest is the two calls').
_real = (mxflash._attention_step_forward, mxflash._attention_step_backward)
C_CODE = mxflash._causal_code(C)  # (the step's calls take the mask's code)
_step_out = mxflash._attention_step_forward(q, k, v, qm, km, None, False, C_CODE, True)
_grads = mxflash._attention_step_backward(_step_out[2], _step_out[0], dout, _step_out[1], qm, km, H, H, None, False,
                                          C_CODE)


def stubbed():
    mxflash._attention_step_forward = lambda *a, **kw: _step_out
    mxflash._attention_step_backward = lambda *a, **kw: _grads
    try:
        step()
    finally:
        mxflash._attention_step_forward, mxflash._attention_step_backward = _real


calls["mx_attention step, stubbed"] = stubbed
for name, fn in calls.items():
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")  # the least of 10 batches of 50 calls: host timing is noisy
    for _ in range(10):
        t = time.perf_counter()
        for _ in range(50):
            fn()
        if not args.host_only:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / 50)
        torch.cuda.synchronize()
    print(f"{name:32s} {1e6 * best:8.1f} us per call")
if args.no_profile:
    sys.exit(0)
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    step()
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
