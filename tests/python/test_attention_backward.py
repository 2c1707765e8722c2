"""mxflash.attention_backward: the exact-MX CPU path against an FP64 numpy backward on the
unquantized inputs (written here), the exact rules (one key: dK = 0; no keys: dQ = 0), broadcast_q,
and bad arguments (the C++ message, gradients untouched). CUDA tensors: the fast kernel (close to the
CPU path, deterministic) and the exact-MX GPU path (exact_mx; bit-close to the CPU path)."""
import math

import ml_dtypes
import numpy as np
import pytest

import mxflash
from mxflash import _mxflash
from test_attention import cu, raises_exactly, sentinel, sqnr_db, untouched

BF16 = ml_dtypes.bfloat16
H = 2
SCALE = 1.0 / math.sqrt(128)


def backward_fp64(q, k, v, dout, q_lengths, k_lengths, scale=SCALE, broadcast_q=False):
    """Exact gradients (dq, dk, dv) of softmax(Q Kᵀ scale) V in float64 on packed (T, H, 128) arrays."""
    q, k, v, dout = (np.asarray(a, np.float64) for a in (q, k, v, dout))
    qc, kc = cu(q_lengths), cu(k_lengths)
    lq = q_lengths[0]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(len(k_lengths)):
        q0, q1 = (0, lq) if broadcast_q else (int(qc[b]), int(qc[b + 1]))
        o0 = b * lq if broadcast_q else q0
        k0, k1 = int(kc[b]), int(kc[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        qs, ks, vs, do = q[q0:q1], k[k0:k1], v[k0:k1], dout[o0:o0 + q1 - q0]
        s = np.einsum("ihd,jhd->hij", qs, ks) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        dp = np.einsum("ihd,jhd->hij", do, vs)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq[q0:q1] += np.einsum("hij,jhd->ihd", ds, ks) * scale
        dk[k0:k1] += np.einsum("hij,ihd->jhd", ds, qs) * scale
        dv[k0:k1] += np.einsum("hij,ihd->jhd", p, do)
    return dq, dk, dv


def run(q_lengths, k_lengths, broadcast_q=False, seed=3):
    rng = np.random.default_rng(seed)
    qm, km = mxflash.JaggedMeta.from_lengths(q_lengths), mxflash.JaggedMeta.from_lengths(k_lengths)
    tq, tk = sum(q_lengths), sum(k_lengths)
    xq, xk, xv = (rng.standard_normal((t, H, 128)).astype(np.float32) for t in (tq, tk, tk))
    ops = dict(q=mxflash.quantize_mx(xq, qm, "hdim"), q_seq=mxflash.quantize_mx(xq, qm, "seq"),
               k=mxflash.quantize_mx(xk, km, "hdim"), k_seq=mxflash.quantize_mx(xk, km, "seq"),
               v=mxflash.quantize_mx(xv, km, "hdim"))
    out, lse = mxflash.attention_forward(ops["q"], ops["k"], mxflash.quantize_mx(xv, km, "seq"), qm, km,
                                         broadcast_q=broadcast_q)
    dout = rng.standard_normal(out.shape).astype(BF16)
    grads = mxflash.attention_backward(ops["q"], ops["q_seq"], ops["k"], ops["k_seq"], ops["v"], out, dout, lse,
                                       qm, km, broadcast_q=broadcast_q)
    want = backward_fp64(xq, xk, xv, dout.astype(np.float32), q_lengths, k_lengths, broadcast_q=broadcast_q)
    return dict(qm=qm, km=km, ops=ops, out=out, lse=lse, dout=dout, grads=grads, want=want)


def test_cpu_backward_matches_fp64_with_exact_rules():
    r = run([40, 17, 70], [33, 1, 0])
    for name, g, w in zip(("dq", "dk", "dv"), r["grads"], r["want"]):
        assert g.dtype == BF16 and g.shape == w.shape
        assert sqnr_db(w, g.astype(np.float64)) > 15, name  # e4m3 operands, P and dS: ~20-25 dB
    dq, dk, _ = (g.astype(np.float32) for g in r["grads"])
    assert (dk[33:34] == 0).all(), "a sequence with one key has dS = 0: dK must be exactly 0"
    assert (dq[40:57] == 0).all() and (dq[57:] == 0).all(), "rows attending to one key or none get dQ = 0"


def test_broadcast_q_sums_dq_over_the_batch():
    r = run([24], [33, 1, 50], broadcast_q=True)
    for name, g, w in zip(("dq", "dk", "dv"), r["grads"], r["want"]):
        assert sqnr_db(w, g.astype(np.float64)) > 15, name


@pytest.fixture(scope="module")
def small():
    return run([40], [33])


def call_with(small, grads, **kw):
    o = small["ops"]
    args = dict(q=o["q"], q_seq=o["q_seq"], k=o["k"], k_seq=o["k_seq"], v=o["v"], out=small["out"],
                dout=small["dout"], lse=small["lse"], q_meta=small["qm"], k_meta=small["km"], grads=grads)
    args.update(kw)
    return mxflash.attention_backward(**args)


def test_bad_arguments_raise_the_library_message_and_write_nothing(small):
    g = [sentinel((40, H, 128), BF16), sentinel((33, H, 128), BF16), sentinel((33, H, 128), BF16)]
    with raises_exactly(ValueError, "q_seq.orientation: must be seq, got hdim"):
        call_with(small, g, q_seq=small["ops"]["q"])
    with raises_exactly(ValueError, "dq_accum: must be fp32 or fp16, got an unknown value -1"):
        call_with(small, g, dq_accum="fp64")
    with raises_exactly(ValueError, "p_scale: must be constant or dynamic, got an unknown value -1"):
        call_with(small, g, p_scale="per-row")
    with pytest.raises(ValueError, match="^dout: "):
        call_with(small, g, dout=small["dout"].astype(np.float32))
    with pytest.raises(ValueError, match="^dk: "):
        call_with(small, [g[0], sentinel((32, H, 128), BF16), g[2]])
    assert untouched(*g)


def test_fp16_dq_accumulation_is_modelled(small):
    """dq_accum="fp16": the CPU reference's fp16 accumulator (static scale 2^k): dK and dV unchanged,
    dQ close to the fp32 accumulation's; a scale too large for the values overflows to inf."""
    dq16, dk16, dv16 = call_with(small, None, dq_accum="fp16")
    assert (dk16.view(np.uint16) == small["grads"][1].view(np.uint16)).all()
    assert (dv16.view(np.uint16) == small["grads"][2].view(np.uint16)).all()
    assert sqnr_db(small["grads"][0].astype(np.float64), dq16.astype(np.float64)) > 30
    big = call_with(small, None, dq_accum="fp16", dq_fp16_scale_log2=15,
                    dout=(small["dout"].astype(np.float32) * 4096).astype(BF16))[0]
    assert np.isinf(big.astype(np.float32)).any()


def test_mxfp8_dk_dv_outputs(small):
    """output_mxfp8_dkv=True: dK, dV as float8_e4m3fn in 32x32 blocks with (Tk, H, 4) E8M0 scales per
    token row; dequantized, they track the bf16 gradients to e4m3 precision."""
    dq, dk8, dv8, sk, sv = call_with(small, None, output_mxfp8_dkv=True)
    assert dk8.dtype == ml_dtypes.float8_e4m3fn and sk.shape == (33, H, 4) and sk.dtype == np.uint8
    assert (dq.view(np.uint16) == small["grads"][0].view(np.uint16)).all()
    for pay, sc, want in ((dk8, sk, small["grads"][1]), (dv8, sv, small["grads"][2])):
        deq = pay.astype(np.float32) * np.exp2(np.repeat(sc.astype(np.float32) - 127, 32, axis=2))
        assert sqnr_db(want.astype(np.float64), deq.astype(np.float64)) > 25


def test_grads_argument_is_written_and_returned(small):
    g = [np.zeros((40, H, 128), BF16), np.zeros((33, H, 128), BF16), np.zeros((33, H, 128), BF16)]
    got = call_with(small, g)
    assert all(a is b for a, b in zip(got, g))
    for a, b in zip(got, small["grads"]):
        assert (a.view(np.uint16) == b.view(np.uint16)).all()


def test_cuda_fast_and_exact_paths_match_the_cpu(small, torch_cuda):
    torch = torch_cuda
    o = small["ops"]
    dev = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).cuda()  # noqa: E731
    cuda_ops = {n: mxflash.MxTensor(dev(t.payload), dev(t.scales), t.orientation, t.scale_layout, t.payload_layout)
                for n, t in o.items()}
    out = torch.from_numpy(small["out"].view(np.int16)).cuda().view(torch.bfloat16)
    dout = torch.from_numpy(small["dout"].view(np.int16)).cuda().view(torch.bfloat16)
    lse = torch.from_numpy(small["lse"]).cuda()
    args = (cuda_ops["q"], cuda_ops["q_seq"], cuda_ops["k"], cuda_ops["k_seq"], cuda_ops["v"], out, dout, lse,
            small["qm"], small["km"])
    # The fast kernel: the reference's quantization steps with coarser power-of-two scales.
    fast = mxflash.attention_backward(*args)
    again = mxflash.attention_backward(*args)
    torch.cuda.synchronize()
    for name, g, g2, want in zip(("dq", "dk", "dv"), fast, again, small["grads"]):
        assert torch.equal(g.view(torch.int16), g2.view(torch.int16)), name + ": not deterministic"
        g = g.cpu().view(torch.int16).numpy().view(BF16)
        assert sqnr_db(want.astype(np.float64), g.astype(np.float64)) > 20, name
    with pytest.raises(RuntimeError, match="^p_scale: .*not by the fast CUDA kernel"):
        mxflash.attention_backward(*args, p_scale="dynamic")
    # Its workspace comes from torch's caching allocator (torch accounts for it): the peak of a call
    # covers the workspace plus the three gradients it returns.
    n = _mxflash.attention_backward_workspace_size(small["qm"]._host, small["km"]._host, H, False, False)
    assert n > 0
    grad_bytes = sum(g.numel() * g.element_size() for g in fast)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    mxflash.attention_backward(*args)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base >= n + grad_bytes
    # The exact-MX GPU path: the CPU reference's arithmetic, FP64 sums associated differently.
    got = mxflash.attention_backward(*args, exact_mx=True)
    torch.cuda.synchronize()
    for name, g, want in zip(("dq", "dk", "dv"), got, small["grads"]):
        g = g.cpu().view(torch.int16).numpy().view(BF16)
        assert (g.view(np.uint16) != want.view(np.uint16)).mean() < 1e-3, name
        assert sqnr_db(want.astype(np.float64), g.astype(np.float64)) > 60, name
