#!/usr/bin/env python3
"""What a training loop sees when it swaps torch.nn.functional.scaled_dot_product_attention for
mxflash.autograd.scaled_dot_product_attention: the same dense bf16 (B, H, L, 128) tensors in and out,
quantization and every pass included. For each case, the forward alone (no grad) and a training step
(forward + backward through autograd), against torch's own SDPA in bf16 on its cuDNN and flash
backends, same process, same inputs. TFLOP/s count the unmasked (query, key) pairs: 4 HD per pair
forward, 14 HD per pair a step (forward 4 + backward 10, the issues' count). CUDA events around
samples of 5 calls, median of --samples after a warm-up; `host` is the host's time per call while
the GPU works behind (the call is host-bound where it nears the median); `cos` is out's cosine
against torch's (cuDNN) bf16 out on the same inputs. --profile adds torch.profiler's table of
mxflash's calls.

Cases: llm (B=8, H=16, L=2048), llm-long (B=2, H=16, L=8192), each without and with is_causal, and
gqa-8k (B=1, H=32 over 8 K/V heads, L=8192, causal: a Llama-3-8B layer's shape). Grouped-query
cases also run `mxflash-repeat`: k and v repeated per group (repeat_interleave) before the same call,
the path mx_attention took before its K/V operands stayed at their own heads. `kept MiB`: the memory
a training forward leaves allocated for its backward when its q, k, v come from an op just before
it and the caller drops them (as a layer's projections' outputs): saved tensors, inputs held, out;
`peak MiB`: a step's peak above what was allocated before it.

--compiled adds `mxflash-compiled`: the drop-in's step under torch.compile(fullgraph=True,
mode="reduce-overhead"), its graphs replayed as CUDA graphs (no host time per launch).

Usage (GPU machine, module built: scripts/gpu_check.sh's python section builds it):
  PYTHONPATH=python python3 scripts/sdpa_bench.py [--samples 10] [--cases llm,llm-long-causal] [--json F]
"""
import argparse

import torch
import torch.nn.functional as F

from mxflash.autograd import scaled_dot_product_attention as mx_sdpa
from rmsnorm_bench import write_json
from time_mx_attention_fwd import timed  # CUDA events around 5 calls, median of samples

CASES = {  # name: (B, H, Hkv, L, causal)
    "llm": (8, 16, 16, 2048, False),
    "llm-causal": (8, 16, 16, 2048, True),
    "llm-long": (2, 16, 16, 8192, False),
    "llm-long-causal": (2, 16, 16, 8192, True),
    "gqa-8k-causal": (1, 32, 8, 8192, True),
    "small-causal": (4, 8, 8, 512, True),  # (--cases small-causal: a host-bound shape)
}
DEFAULT_CASES = "llm,llm-causal,llm-long,llm-long-causal,gqa-8k-causal"


def host_ms(fn, calls=20):
    """Host time per call while the GPU works behind (no synchronization inside the calls): near the
    timed median, the call is bound by its host side."""
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / calls


def profile(fn, label):
    """torch.profiler's table of one call of fn (after a warm-up): CPU and CUDA time per op."""
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    print(f"-- profile: {label} (3 calls)")
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))


def memory_mib(fn, leaves, dout):
    """(kept, peak) MiB of a training call of fn as a layer inside a model sees it: q, k, v made by an
    op just before it (copies of the leaves, as a projection's outputs would be) and dropped by the
    caller after it, so that what stays allocated after the forward is what the attention keeps for
    its backward (saved tensors, inputs it holds on to, and out); and the step's peak above what was
    allocated before it."""
    for x in leaves:
        x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    inputs = [x * 1.0 for x in leaves]  # (MulBackward with a Python scalar keeps no tensor)
    out = fn(*inputs)
    del inputs
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    out.backward(dout)
    del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for x in leaves:
        x.grad = None
    return kept / 2**20, peak / 2**20


def torch_backend(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[name])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--compiled", action="store_true",
                    help="also the drop-in's step under torch.compile(fullgraph=True, mode='reduce-overhead')")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's table of mxflash's calls")
    ap.add_argument("--json", help="also write the rows (case, pass, impl, ms, host ms, TFLOP/s, cos) here")
    args = ap.parse_args()
    rows = []
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; ms (TFLOP/s); ratio = torch's time / ours")
    for name in args.cases.split(","):
        b, h, hkv, L, causal = CASES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        # (B, H, L, 128) views of (B, L, H, 128) memory: what x.view(B, L, H, D).transpose(1, 2) gives
        make = lambda heads: torch.randn((b, L, heads, 128), generator=g, device="cuda",  # noqa
                                         dtype=torch.bfloat16).transpose(1, 2)
        q, k, v = make(h), make(hkv), make(hkv)
        dout = make(h)
        pairs = b * h * (L * (L + 1) // 2 if causal else L * L)
        flops = {"fwd": 4 * 128 * pairs, "step": 14 * 128 * pairs}
        gqa = hkv != h
        impls = {"mxflash": lambda x, y, z: mx_sdpa(x, y, z, is_causal=causal, enable_gqa=gqa)}
        if gqa:
            impls["mxflash-repeat"] = lambda x, y, z: mx_sdpa(x, y.repeat_interleave(h // hkv, dim=1),
                                                              z.repeat_interleave(h // hkv, dim=1), is_causal=causal)
        if args.compiled:
            impls["mxflash-compiled"] = torch.compile(
                lambda x, y, z: mx_sdpa(x, y, z, is_causal=causal, enable_gqa=gqa), fullgraph=True,
                mode="reduce-overhead")
        for backend in ("cudnn", "flash"):
            def run(x, y, z, backend=backend):
                with torch_backend(backend):
                    return F.scaled_dot_product_attention(x, y, z, is_causal=causal, enable_gqa=gqa)
            impls[f"torch-{backend}"] = run

        with torch.no_grad():
            ref = None
            try:
                ref = impls["torch-cudnn"](q, k, v).float()
            except RuntimeError:
                pass
            mine = impls["mxflash"](q, k, v).float()
            cos = (F.cosine_similarity(ref.flatten(), mine.flatten(), dim=0).item() if ref is not None
                   else float("nan"))

        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        times, hosts, mem = {}, {}, {}
        for impl, fn in impls.items():
            def fwd(fn=fn):
                with torch.no_grad():
                    return fn(q, k, v)

            def step(fn=fn):
                for x in leaves:
                    x.grad = None
                fn(*leaves).backward(dout)

            try:
                if impl != "mxflash-compiled":  # (its CUDA graphs take their inputs' addresses as they are)
                    mem[impl] = memory_mib(fn, leaves, dout)
            except RuntimeError:
                pass
            for what, f in (("fwd", fwd), ("step", step)):
                if impl == "mxflash-compiled" and what == "fwd":  # (the step's graphs only)
                    times[impl, what] = None
                    continue
                try:
                    times[impl, what] = timed(f, args.samples)
                    hosts[impl, what] = host_ms(f)
                    if args.profile and impl == "mxflash":
                        profile(f, f"{name} {what} {impl}")
                except RuntimeError as e:  # a backend that does not take the case
                    times[impl, what] = None
                    print(f"  {name} {impl} {what}: not run ({str(e).splitlines()[0][:100]})")
        for what in ("fwd", "step"):
            ours = times["mxflash", what]
            cells = []
            for impl in impls:
                t = times[impl, what]
                if t is None:
                    cells.append(f"{impl} n/a")
                    continue
                cell = f"{impl} {t:.3f} ({flops[what] / t / 1e9:.0f}; host {hosts[impl, what]:.3f})"
                if what == "step" and impl in mem:
                    cell += " [kept {:.0f} MiB, peak {:.0f} MiB]".format(*mem[impl])
                if impl != "mxflash":
                    cell += f" {t / ours:.2f}x"
                cells.append(cell)
            print(f"{name:16s} {what:4s}  " + "  ".join(cells) + (f"  | cos {cos:.5f}" if what == "fwd" else ""),
                  flush=True)
            rows += [{"case": name, "pass": what, "impl": impl, "ms": times[impl, what],
                      "host_ms": hosts.get((impl, what)),
                      "kept_mib": mem.get(impl, (None, None))[0] if what == "step" else None,
                      "peak_mib": mem.get(impl, (None, None))[1] if what == "step" else None,
                      "tflops": None if times[impl, what] is None else flops[what] / times[impl, what] / 1e9,
                      "cos_vs_torch_cudnn": cos} for impl in impls]
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
