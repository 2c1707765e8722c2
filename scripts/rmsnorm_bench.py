#!/usr/bin/env python3
"""RMSNorm+Quantize (mxflash.rmsnorm_quantize) against what a PyTorch user runs today, same process,
same inputs (docs/performance.md, "Fused producers"):
  fused        mxflash.rmsnorm_quantize: bf16 x -> MXFP8 y (payload, scales) + fp32 rstd, one pass
  torch        torch.nn.functional.rms_norm, bf16 in and out (no quantization)
  unfused      torch's rms_norm (bf16 y), then mxflash.quantize of y along the row: two passes
  copy         x.clone(): the card's read+write bandwidth on the same bytes
Times: median of CUDA-event samples (each sample 5 launches), after a warm-up; inputs of ~1 GB,
far above L2. TB/s counts the bytes each form reads and writes itself (fused: 2 + 1 + 1/32 bytes an
element + 4 a row; torch: 2 + 2 (+ weight); unfused: both steps'). Also prints the fused output's
SQNR against an fp64 RMSNorm of the same bf16 x.
Usage (on the GPU machine, python/ on PYTHONPATH): python3 scripts/rmsnorm_bench.py [--json out.json]"""
import argparse
import json
import statistics

import torch

import mxflash


def median_ms(fn, samples=30, launches=5, warmup=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(launches):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / launches)
    return statistics.median(times)


def sqnr(ref, got):
    """SQNR in dB of got against ref (fp64)."""
    return 10 * torch.log10(ref.pow(2).sum() / (got.double() - ref).pow(2).sum()).item()


def deq(payload, scales):
    """(R, C) MX payload with plain (R, C / 32) scales, blocks along C, as fp64."""
    R, C = payload.shape
    return (payload.double().view(R, C // 32, 32) * torch.exp2(scales.double() - 127)[..., None]).view(R, C)


def write_json(path, rows):
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--elements", type=float, default=5.4e8, help="x elements per shape (bf16: 2 bytes each)")
    ap.add_argument("--cols", default="384,512,1024,4096,8192", help="row lengths C, comma-separated")
    args = ap.parse_args()
    rows_out = []
    print(f"{'C':>6} {'T':>9} {'impl':>8} {'ms':>8} {'TB/s':>6} {'vs unfused':>10} {'vs torch':>8}")
    for C in [int(c) for c in args.cols.split(",")]:
        T = int(args.elements // C)
        g = torch.Generator(device="cuda").manual_seed(C)
        x = torch.randn(T, C, device="cuda", generator=g).to(torch.bfloat16)
        w32 = 1 + 0.3 * torch.randn(C, device="cuda", generator=g)
        w16 = w32.to(torch.bfloat16)
        payload = torch.empty(T, C, dtype=torch.float8_e4m3fn, device="cuda")
        scales = torch.empty(T, C // 32, dtype=torch.uint8, device="cuda")
        rstd = torch.empty(T, dtype=torch.float32, device="cuda")
        meta = mxflash.JaggedMeta.from_lengths([T])
        meta.upload()
        y16 = torch.empty(T, C, dtype=torch.bfloat16, device="cuda")
        up, us = torch.empty_like(payload), torch.empty_like(scales)

        def fused():
            mxflash.rmsnorm_quantize(x, w32, eps=1e-6, out=(payload, scales, rstd))

        def torch_norm():
            return torch.nn.functional.rms_norm(x, (C,), w16, eps=1e-6)

        def unfused():
            y = torch.nn.functional.rms_norm(x, (C,), w16, eps=1e-6)
            mxflash.quantize(y.view(T, C // 128, 128), meta, "hdim", out=(up.view(T, C // 128, 128), us.view(T, C // 128, 4)))

        def copy():
            y16.copy_(x)

        n = T * C
        bytes_ = {
            "fused": n * (2 + 1 + 1 / 32) + 4 * T + 4 * C,
            "torch": n * 4 + 2 * C,
            "unfused": n * 4 + 2 * C + n * (2 + 1 + 1 / 32),
            "copy": n * 4,
        }
        ms = {name: median_ms(fn) for name, fn in
              [("fused", fused), ("torch", torch_norm), ("unfused", unfused), ("copy", copy)]}
        for name in ["fused", "torch", "unfused", "copy"]:
            tbs = bytes_[name] / (ms[name] * 1e-3) / 1e12
            vs_u = ms["unfused"] / ms[name]
            vs_t = ms["torch"] / ms[name]
            print(f"{C:>6} {T:>9} {name:>8} {ms[name]:8.3f} {tbs:6.2f} {vs_u:9.2f}x {vs_t:7.2f}x")
            rows_out.append(dict(C=C, T=T, impl=name, ms=ms[name], tbps=tbs))
        # accuracy of the fused output on these rows (first 4096 rows), against fp64
        k = min(T, 4096)
        ref = x[:k].double()
        ref = ref * torch.rsqrt(ref.pow(2).mean(1, keepdim=True) + 1e-6) * w32.double()
        db = sqnr(ref, deq(payload[:k], scales[:k]))
        print(f"{C:>6} {T:>9} fused y SQNR vs fp64: {db:.2f} dB")
        rows_out.append(dict(C=C, T=T, impl="fused", sqnr_db=db))
        del x, payload, scales, rstd, y16, up, us
        torch.cuda.empty_cache()
    write_json(args.json, rows_out)


if __name__ == "__main__":
    main()
