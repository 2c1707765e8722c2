#!/usr/bin/env python3
"""The jagged cross-attention module (mxflash.module) against its BF16 twin, same process, same
parameters and inputs: REFERENCE.md section 7's module peer (B = 768 sequences of uniform KV length,
512 shared seed queries, model dim 384, 3 heads; eager PyTorch BF16 with cuDNN SDPA) and section
1's module latency protocol (median of forward + backward steps after a warm-up).

Per KV length, for the MXFP8 module (`mx`) and the twin (`bf16`, scaled_dot_product_attention with
the cuDNN backend forced when torch has it): the training forward alone (grad mode on, the graph
kept, then dropped), the forward + backward step (dy of ones-scale random values), the peak memory
of the step, and the step's speed-up. Then the accuracy of one jagged batch (--acc-batch sequences
of lengths up to --acc-max-kv, mean fill 0.5) per tensor: y, dx and every parameter's gradient,
SQNR against the same module's math in float64 on unquantized values, for both modules.

Usage (GPU machine, python/ on PYTHONPATH): python3 scripts/module_bench.py [--kv 4096,8192]
[--batch 768] [--json out.json]"""
import argparse
import contextlib
import torch

import mxflash
from mxflash.module import JaggedCrossAttention, JaggedCrossAttentionBf16, reference_forward
from rmsnorm_bench import median_ms, sqnr, write_json


def sdpa_backend():
    """The cuDNN SDPA backend forced where this torch has it (the reference's peer), else default."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), "cudnn"
    except (ImportError, AttributeError):
        return contextlib.nullcontext, "default"


def make_modules(args):
    torch.manual_seed(0)
    mx = JaggedCrossAttention(model_dim=args.model_dim, heads=args.heads, num_queries=args.queries).cuda()
    with torch.no_grad():  # a softmax that is not flat: logits of std ~1.3
        mx.wq.mul_(2)
        mx.wk.mul_(2)
    twin = JaggedCrossAttentionBf16(model_dim=args.model_dim, heads=args.heads, num_queries=args.queries).cuda()
    twin.load_state_dict(mx.state_dict())
    return mx, twin


def timing(args, mx, twin, ctx, kv):
    meta = mxflash.JaggedMeta.from_lengths([kv] * args.batch).upload()
    x = (torch.randn(args.batch * kv, args.model_dim, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(args.batch, args.queries, args.model_dim, device="cuda", dtype=torch.bfloat16)
    rows = {}
    for name, mod in (("mx", mx), ("bf16", twin)):
        def forward():
            with ctx():
                mod(x, meta)

        def step():
            with ctx():
                mod(x, meta).backward(dy)
            mod.zero_grad(set_to_none=True)
            x.grad = None

        fwd = median_ms(forward, samples=args.samples, launches=1, warmup=args.warmup)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30
        both = median_ms(step, samples=args.samples, launches=1, warmup=args.warmup)
        rows[name] = dict(fwd_ms=round(fwd, 3), step_ms=round(both, 3), peak_gib=round(peak, 2))
    rows["speedup_step"] = round(rows["bf16"]["step_ms"] / rows["mx"]["step_ms"], 3)
    rows["speedup_fwd"] = round(rows["bf16"]["fwd_ms"] / rows["mx"]["fwd_ms"], 3)
    del x, dy
    torch.cuda.empty_cache()
    return rows


def profile(args, mx, twin, ctx, kv):
    """One forward and one training step of each module under torch.profiler: the CUDA time of
    every kernel (summed over its launches), largest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    meta = mxflash.JaggedMeta.from_lengths([kv] * args.batch).upload()
    x = (torch.randn(args.batch * kv, args.model_dim, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(args.batch, args.queries, args.model_dim, device="cuda", dtype=torch.bfloat16)
    for name, mod in (("mx", mx), ("bf16", twin)):
        for what in ("forward", "step"):
            for _ in range(2):  # warm
                with ctx():
                    y = mod(x, meta)
                    if what == "step":
                        y.backward(dy)
                mod.zero_grad(set_to_none=True)
                x.grad = None
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                with ctx():
                    y = mod(x, meta)
                    if what == "step":
                        y.backward(dy)
                torch.cuda.synchronize()
            mod.zero_grad(set_to_none=True)
            x.grad = None
            del y
            events = [e for e in prof.key_averages() if e.device_time_total > 0]
            events.sort(key=lambda e: -e.device_time_total)
            total = sum(e.device_time_total for e in events) / 1000
            print(f"\nprofile {name} {what}, KV {kv}: {total:.2f} ms of kernels")
            for e in events[:args.profile_top]:
                print(f"  {e.device_time_total / 1000:8.3f} ms  x{e.count:<3d} {e.key[:110]}")


def timeline(args, mx, twin, ctx, kv):
    """One training step of each module under torch.profiler with CPU activities: where the GPU
    idles between kernels (the step's wall time against its kernels'), the largest gaps, and the
    host calls that ran during them."""
    import json
    import tempfile
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    meta = mxflash.JaggedMeta.from_lengths([kv] * args.batch).upload()
    x = (torch.randn(args.batch * kv, args.model_dim, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(args.batch, args.queries, args.model_dim, device="cuda", dtype=torch.bfloat16)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):  # the profiler's own start-up
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    for name, mod in (("mx", mx), ("bf16", twin)):
        for _ in range(3):  # warm
            with ctx():
                mod(x, meta).backward(dy)
            mod.zero_grad(set_to_none=True)
            x.grad = None
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with ctx():
                mod(x, meta).backward(dy)
            torch.cuda.synchronize()
        mod.zero_grad(set_to_none=True)
        x.grad = None
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            with open(f.name) as g:
                trace = json.load(g)
        ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
        host = [e for e in ev if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "python_function")]
        t0 = min(e["ts"] for e in host if e.get("cat") == "cpu_op")
        busy, gaps, end = 0.0, [], t0
        prev = "(step start)"
        for e in gpu:
            if e["ts"] > end:
                gaps.append((e["ts"] - end, end, e["ts"], prev, e["name"]))
            busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
            if e["ts"] + e["dur"] > end:
                end, prev = e["ts"] + e["dur"], e["name"]
        span = end - t0
        print(f"\ntimeline {name} step, KV {kv}: {span / 1000:.2f} ms from the first host op to the last kernel, "
              f"kernels busy {busy / 1000:.2f} ms, idle {(span - busy) / 1000:.2f} ms in {len(gaps)} gaps")
        gaps.sort(reverse=True)
        for d, a, b, before, after in gaps[:args.profile_top]:
            during = {}
            for h in host:
                lo, hi = max(a, h["ts"]), min(b, h["ts"] + h["dur"])
                if hi > lo and h.get("cat") != "python_function":
                    during[h["name"]] = during.get(h["name"], 0.0) + hi - lo
            top = sorted(during.items(), key=lambda kv_: -kv_[1])[:4]
            print(f"  {d / 1000:7.3f} ms after {before[:48]!r} before {after[:48]!r}")
            print("      host: " + "; ".join(f"{n[:40]} {t / 1000:.3f}" for n, t in top))


def grads_of(mod, x, meta, dy, forward):
    mod.zero_grad(set_to_none=True)
    x.grad = None
    y = forward(x)
    y.backward(dy.to(y.dtype))
    g = {n: p.grad.detach().clone() for n, p in mod.named_parameters()}
    g["x"] = x.grad.detach().clone()
    g["y"] = y.detach()
    return g


def accuracy(args, mx, twin):
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, args.acc_max_kv + 1, (args.acc_batch,), generator=gen).tolist()
    meta = mxflash.JaggedMeta.from_lengths(lengths).upload()
    x = (torch.randn(sum(lengths), args.model_dim, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(len(lengths), args.queries, args.model_dim, device="cuda")
    ref = grads_of(mx, x, meta, dy, lambda xx: reference_forward(mx, xx, meta, torch.float64))
    # (the twin's jagged batch is padded and masked: torch's default SDPA backend)
    got = {"mx": grads_of(mx, x, meta, dy, lambda xx: mx(xx, meta)),
           "bf16": grads_of(twin, x, meta, dy, lambda xx: twin(xx, meta))}
    table = {n: {k: round(sqnr(ref[n].double(), got[k][n]), 2) for k in got} for n in ref}
    return dict(lengths_total=sum(lengths), batch=len(lengths), max_kv=args.acc_max_kv, sqnr_db=table)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", default="4096,8192", help="uniform KV lengths, comma-separated")
    ap.add_argument("--batch", type=int, default=768)
    ap.add_argument("--model-dim", type=int, default=384)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--queries", type=int, default=512)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--acc-batch", type=int, default=32)
    ap.add_argument("--acc-max-kv", type=int, default=4096)
    ap.add_argument("--profile", type=int, default=0, metavar="KV",
                    help="only profile one forward and one step of each module at this KV length")
    ap.add_argument("--profile-top", type=int, default=14)
    ap.add_argument("--timeline", type=int, default=0, metavar="KV",
                    help="only trace one step of each module at this KV length: the GPU's idle gaps")
    ap.add_argument("--json")
    args = ap.parse_args()
    ctx, backend = sdpa_backend()
    mx, twin = make_modules(args)
    try:  # the forced backend on a small uniform batch first; torch's default where it refuses
        meta = mxflash.JaggedMeta.from_lengths([256] * 2)
        with ctx():
            twin(torch.randn(512, args.model_dim, device="cuda", dtype=torch.bfloat16), meta)
    except RuntimeError as e:
        print(f"cuDNN SDPA refused the twin's attention ({str(e).splitlines()[0]}); torch's default backend")
        ctx, backend = contextlib.nullcontext, "default"
    if args.profile:
        profile(args, mx, twin, ctx, args.profile)
        return
    if args.timeline:
        timeline(args, mx, twin, ctx, args.timeline)
        return
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, twin_sdpa=backend,
               batch=args.batch, model_dim=args.model_dim, heads=args.heads, queries=args.queries, timing={})
    print(f"module: B={args.batch}, {args.queries} seed queries, model dim {args.model_dim}, {args.heads} heads; "
          f"twin SDPA backend: {backend}; medians of {args.samples} steps after {args.warmup}")
    print("| KV | fwd mx / bf16 (ms) | fwd+bwd mx / bf16 (ms) | step speed-up | peak GiB mx / bf16 |")
    print("|---|---|---|---|---|")
    for kv in (int(v) for v in args.kv.split(",")):
        r = timing(args, mx, twin, ctx, kv)
        out["timing"][kv] = r
        print(f"| {kv} | {r['mx']['fwd_ms']:.2f} / {r['bf16']['fwd_ms']:.2f} | {r['mx']['step_ms']:.2f} / "
              f"{r['bf16']['step_ms']:.2f} | {r['speedup_step']:.2f}x | {r['mx']['peak_gib']:.1f} / "
              f"{r['bf16']['peak_gib']:.1f} |", flush=True)
    acc = accuracy(args, mx, twin)
    out["accuracy"] = acc
    print(f"\naccuracy: {acc['batch']} sequences, {acc['lengths_total']} tokens (lengths 0..{acc['max_kv']}), "
          "SQNR (dB) against float64 on unquantized values")
    print("| tensor | mx | bf16 |")
    print("|---|---|---|")
    for n, v in acc["sqnr_db"].items():
        print(f"| {n} | {v['mx']:.2f} | {v['bf16']:.2f} |")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
