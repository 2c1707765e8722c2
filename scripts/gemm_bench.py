#!/usr/bin/env python3
"""GEMM+Quantize (mxflash.gemm_quantize) against what a PyTorch user runs today, same process, same
inputs (docs/performance.md, "Fused producers"). A = RMSNorm(x) as MXFP8 (mxflash.rmsnorm_quantize),
W (N, K) random / sqrt(K) quantized along K; y = A W^T.
  fused      mxflash.gemm_quantize(path="coarse"): MX A, MX W -> MX y (payload + scales), one pass
  fp8-row    torch._scaled_mm, e4m3 A and W with fp32 row / column scales, bf16 y (cuBLAS; no
             quantization of y)
  fp8-tensor torch._scaled_mm with one scale per tensor, use_fast_accum=True, bf16 y (cuBLAS)
  unfused    fp8-row, then mxflash.quantize of y along N: the GEMM and a quantize pass
  bf16       torch.matmul on bf16 A and W, bf16 y
Times: median of CUDA-event samples (each sample 5 launches) after a warm-up (rmsnorm_bench's
median_ms). TFLOP/s = 2 M N K / time. Also prints each form's y SQNR against an fp64 product of the
unquantized normalized x and W (first 8192 rows), and the exact MX path's.
Usage (on the GPU machine, python/ on PYTHONPATH): python3 scripts/gemm_bench.py [--json out.json]"""
import argparse

import torch

import mxflash
from rmsnorm_bench import deq, median_ms, sqnr, write_json

SHAPES = "4194304x384x384,4194304x384x768,1048576x1024x1024,16384x8192x8192"


def per_row_e4m3(t):
    """t (R, C) -> e4m3 values and fp32 scales (R, 1) with each row's amax at 448."""
    s = (t.abs().amax(dim=1, keepdim=True).float() / 448).clamp(min=1e-30)
    return (t.float() / s).to(torch.float8_e4m3fn), s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", default=SHAPES, help="MxKxN, comma-separated")
    ap.add_argument("--impls", default="fused,fp8-row,fp8-tensor,unfused,bf16", help="forms to time, comma-separated")
    args = ap.parse_args()
    rows_out = []
    print(f"{'M':>8} {'K':>5} {'N':>5} {'impl':>10} {'ms':>8} {'TFLOP/s':>8} {'vs unfused':>10} {'SQNR dB':>8}")
    for shape in args.shapes.split(","):
        M, K, N = (int(v) for v in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(M + K + N)
        x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
        W = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
        a, a_s, _ = mxflash.rmsnorm_quantize(x, None, rstd=False)
        wmeta = mxflash.JaggedMeta.from_lengths([N])
        wmeta.upload()
        wp, ws = mxflash.quantize(W.view(N, K // 128, 128), wmeta, "hdim")
        wp, ws = wp.view(N, K), ws.view(N, K // 32)
        yp = torch.empty(M, N, dtype=torch.float8_e4m3fn, device="cuda")
        ys = torch.empty(M, N // 32, dtype=torch.uint8, device="cuda")
        # Peers' operands: the same normalized rows, cast per row / per tensor.
        xn = torch.nn.functional.rms_norm(x, (K,), eps=1e-6)
        a8r, sa_r = per_row_e4m3(xn)
        w8r, sw_r = per_row_e4m3(W)
        st_a = (xn.abs().amax().float() / 448)
        st_w = (W.abs().amax().float() / 448)
        a8t, w8t = (xn.float() / st_a).to(torch.float8_e4m3fn), (W / st_w).to(torch.float8_e4m3fn)
        xb, Wb = xn, W.to(torch.bfloat16)
        meta = mxflash.JaggedMeta.from_lengths([M])
        meta.upload()
        up, us = torch.empty_like(yp), torch.empty_like(ys)

        def fused():
            mxflash.gemm_quantize(a, a_s, wp, ws, path="coarse", out=(yp, ys))

        def fp8_row():
            return torch._scaled_mm(a8r, w8r.t(), scale_a=sa_r, scale_b=sw_r.t(), out_dtype=torch.bfloat16)

        def fp8_tensor():
            return torch._scaled_mm(a8t, w8t.t(), scale_a=st_a, scale_b=st_w, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)

        def unfused():
            y = fp8_row()
            mxflash.quantize(y.view(M, N // 128, 128), meta, "hdim",
                             out=(up.view(M, N // 128, 128), us.view(M, N // 128, 4)))

        def bf16():
            return xb @ Wb.t()

        impls = [("fused", fused), ("fp8-row", fp8_row), ("fp8-tensor", fp8_tensor), ("unfused", unfused), ("bf16", bf16)]
        impls = [(n, f) for n, f in impls if n in args.impls.split(",")]
        ms = {name: median_ms(fn) for name, fn in impls}
        # Accuracy on the first rows against fp64 of the unquantized operands (few enough rows that
        # the exact path, one fp64 warp per output block, takes seconds).
        k = min(M, 8192, max(64, int(4e9 // (N * K))))
        xd = x[:k].double()
        ref = (xd * torch.rsqrt(xd.pow(2).mean(1, keepdim=True) + 1e-6)) @ W.double().t()
        fused()
        ep, es = mxflash.gemm_quantize(a[:k], a_s[:k], wp, ws, path="exact")
        acc = {
            "fused": sqnr(ref, deq(yp[:k], ys[:k])),
            "fp8-row": sqnr(ref, fp8_row()[:k]),
            "fp8-tensor": sqnr(ref, fp8_tensor()[:k]),
            "unfused": None,
            "bf16": sqnr(ref, bf16()[:k]),
        }
        flops = 2.0 * M * N * K
        for name, _ in impls:
            tf = flops / (ms[name] * 1e-3) / 1e12
            q = "" if acc[name] is None else f"{acc[name]:8.2f}"
            vs = f"{ms['unfused'] / ms[name]:9.2f}x" if "unfused" in ms else f"{'':>10}"
            print(f"{M:>8} {K:>5} {N:>5} {name:>10} {ms[name]:8.3f} {tf:8.1f} {vs} {q}")
            rows_out.append(dict(M=M, K=K, N=N, impl=name, ms=ms[name], tflops=tf, sqnr_db=acc[name]))
        ex = sqnr(ref, deq(ep, es))
        print(f"{M:>8} {K:>5} {N:>5} {'exact MX':>10} {'':>8} {'':>8} {'':>10} {ex:8.2f}")
        rows_out.append(dict(M=M, K=K, N=N, impl="exact", sqnr_db=ex))
        del x, W, a, a_s, yp, ys, xn, a8r, a8t, xb, up, us
        torch.cuda.empty_cache()
    write_json(args.json, rows_out)


if __name__ == "__main__":
    main()
