#!/usr/bin/env python3
"""The SDPA drop-in's training step under torch.compile(fullgraph=True, mode="reduce-overhead") at a
small causal shape (B=4, H=8, L=512): host and wall time per step (3 rounds of 50), then the no-grad
forward's. Run with TORCH_LOGS=cudagraphs to see the CUDA graphs recorded and replayed.

Usage (GPU machine, module built): TORCH_LOGS=cudagraphs PYTHONPATH=python python3 scripts/compiled_step_host.py
"""
import time, torch
from mxflash.autograd import scaled_dot_product_attention as mx_sdpa
B, H, L = 4, 8, 512
g = torch.Generator(device="cuda").manual_seed(0)
mk = lambda: torch.randn((B, L, H, 128), generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
leaves = [mk().requires_grad_() for _ in range(3)]
dout = mk()
f = torch.compile(lambda x, y, z: mx_sdpa(x, y, z, is_causal=True), fullgraph=True, mode="reduce-overhead")
def step():
    for x in leaves:
        x.grad = None
    f(*leaves).backward(dout)
for i in range(6):
    step()
torch.cuda.synchronize()
for r in range(3):
    t = time.perf_counter()
    for _ in range(50):
        step()
    h = time.perf_counter() - t
    torch.cuda.synchronize()
    w = time.perf_counter() - t
    print(f"host {h/50*1e6:.0f} us/step, wall {w/50*1e6:.0f} us/step", flush=True)
# forward only, no grad
with torch.no_grad():
    for i in range(5): f(*leaves)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(50): f(*leaves)
    h = time.perf_counter() - t; torch.cuda.synchronize(); w = time.perf_counter() - t
    print(f"fwd no-grad: host {h/50*1e6:.0f} us, wall {w/50*1e6:.0f} us", flush=True)
