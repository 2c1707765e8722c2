#!/usr/bin/env python3
"""Where a training step's host time goes: wraps mxflash's Python entry points and its bindings' calls
with timers (all threads: the autograd backward runs on torch's device thread), runs the SDPA drop-in's
step 5 x 50 times without synchronizing inside a batch, and prints the host time per step and each
wrapped call's inclusive host time per step (the timers add ~1 us a call).

Usage (GPU machine, module built): PYTHONPATH=python python3 scripts/host_breakdown.py B H L causal
  e.g. 8 16 2048 1 (llm causal) or 1 2 128 0 (one sequence of 128)."""
import collections
import functools
import sys
import time

import torch
import mxflash
import mxflash.autograd as A
from mxflash.autograd import scaled_dot_product_attention as mx_sdpa

B, H, L, causal = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1")
acc = collections.defaultdict(float)
cnt = collections.defaultdict(int)
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t
            cnt[label] += 1
    setattr(obj, name, g)
for n in ("_attention_step_forward", "_attention_step_backward"):
    wrap(mxflash, n, "py." + n)
for n in ("mx_attention", "_dense_attention", "_quantizable_all", "_check_inputs", "_uniform_meta"):
    wrap(A, n, "ag." + n)
for n in dir(mxflash._C):
    if n.startswith(("quantize_attention", "attention_")):
        wrap(mxflash._C, n, "C." + n)
for n in ("_view", "_empty", "_torch_workspace", "_stream", "_as_array", "_operand_arrays", "_operand_views",
          "_backward_outputs", "_forward_outputs", "_check_meta", "_causal_code", "_heads_of_input"):
    if hasattr(mxflash, n):
        wrap(mxflash, n, "m." + n)
fn_cls = A._make_function() if A._function is None else A._function
A._function = fn_cls
wrap(fn_cls, "forward", "Fn.forward")
wrap(fn_cls, "backward", "Fn.backward")

g = torch.Generator(device="cuda").manual_seed(0)
mk = lambda: torch.randn((B, L, H, 128), generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
q, k, v, dout = mk(), mk(), mk(), mk()
leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
def step():
    for x in leaves:
        x.grad = None
    mx_sdpa(*leaves, is_causal=causal).backward(dout)
for _ in range(20):
    step()
torch.cuda.synchronize()
for d in (acc, cnt):
    d.clear()
N = 50
best = 1e9
for r in range(5):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(N):
        step()
    host = (time.perf_counter() - t) / N
    torch.cuda.synchronize()
    gpu = (time.perf_counter() - t) / N
    best = min(best, host)
    print(f"round {r}: host {host*1e6:.0f} us/step, wall incl. drain {gpu*1e6:.0f} us/step")
steps = 5 * N
print(f"B={B} H={H} L={L} causal={causal}: best host {best*1e6:.0f} us per step")
for k_, v_ in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"  {k_:48s} {v_ / steps * 1e6:8.1f} us/step  ({cnt[k_] / steps:.1f} calls/step)")
