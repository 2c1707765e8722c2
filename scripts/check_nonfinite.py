"""How mx_attention passes inf and NaN through (a diagnostic, not a test): on CUDA, one non-finite
value in dout, q or v, and the count of non-finite elements in out and in each gradient. Run on a
Hopper GPU: PYTHONPATH=python python3 scripts/check_nonfinite.py (MXFLASH_BWD_RING=1 forces the
ring on the uniform case). docs/accuracy.md has what it printed."""
import torch, mxflash
from mxflash.autograd import mx_attention
H = 2
for L, label in (([300, 129], "jagged"), ([512, 512], "ring")):
    qm = mxflash.JaggedMeta.from_lengths(L); km = mxflash.JaggedMeta.from_lengths(L)
    T = sum(L)
    g = torch.Generator().manual_seed(0)
    mk = lambda: torch.randn(T, H, 128, generator=g).cuda().to(torch.bfloat16).requires_grad_()
    for case in ("dout_inf", "dout_nan", "q_inf", "v_nan"):
        q, k, v = mk(), mk(), mk()
        if case == "q_inf":
            with torch.no_grad(): q[5, 0, 3] = float("inf")
        if case == "v_nan":
            with torch.no_grad(): v[7, 1, 9] = float("nan")
        out = mx_attention(q, k, v, qm, km)
        dout = torch.randn(out.shape, generator=g).cuda()
        if case == "dout_inf": dout[3, 0, 1] = float("inf")
        if case == "dout_nan": dout[3, 0, 1] = float("nan")
        (out.float() * dout).sum().backward()
        torch.cuda.synchronize()
        nf = lambda x: int((~torch.isfinite(x.float())).sum())
        print(label, case, "out nonfinite", nf(out), "dq", nf(q.grad), "dk", nf(k.grad), "dv", nf(v.grad))
