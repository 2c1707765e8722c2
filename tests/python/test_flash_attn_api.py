"""mxflash.autograd.flash_attn_func and flash_attn_varlen_func: FlashAttention 2's calls run as
MXFP8 attention. CPU tensors: against torch's scaled_dot_product_attention in float64 with
FlashAttention's bottom-right causal mask written out (Lq < Lk, Lq > Lk: rows facing no key give 0),
GQA; bit for bit against the SDPA drop-in (layout "bshd") where the masks agree, and the varlen call
against flash_attn_func sequence by sequence; metadata made once per cu_seqlens; unsupported options
and bad metadata named. CUDA: the varlen call against the CPU one. Skipped without torch."""
import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


def sqnr_db(ref, x):
    ref, x = np.asarray(ref, np.float64), np.asarray(x, np.float64)
    return 10 * np.log10(np.sum(ref ** 2) / np.sum((x - ref) ** 2))


def leaf(shape, seed, dtype=None, device="cpu"):
    import torch

    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return x.to(device=device, dtype=dtype or torch.float32).requires_grad_()


def bottom_right_reference(q, k, v, causal, dout):
    """torch's SDPA in float64 on (B, L, H, 128) copies, FlashAttention's masks written out (keys
    j <= i + Lk - Lq; rows facing no key give 0, as FlashAttention's); returns out and the grads."""
    import torch

    b, lq, h, _ = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    rq, rk, rv = (x.detach().double().requires_grad_() for x in (q, k, v))
    qt = rq.transpose(1, 2)
    kt = rk.transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    vt = rv.transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    scores = qt @ kt.transpose(-1, -2) / np.sqrt(128)
    if causal:
        i = torch.arange(lq).view(-1, 1)
        j = torch.arange(lk).view(1, -1)
        scores = scores.masked_fill(j > i + lk - lq, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # (rows with no key: all -inf -> 0)
    out = (p @ vt).transpose(1, 2)
    (out * dout).sum().backward()
    return out.detach(), rq.grad, rk.grad, rv.grad


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lq, lk", [(64, 64), (40, 129), (130, 33)], ids=["square", "short_q", "long_q"])
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa"])
def test_flash_attn_func_against_float64(causal, lq, lk, kv_heads):
    import torch
    from mxflash.autograd import flash_attn_func

    b, h = 2, 4
    q, k, v = leaf((b, lq, h, 128), 1), leaf((b, lk, kv_heads, 128), 2), leaf((b, lk, kv_heads, 128), 3)
    dout = torch.randn(b, lq, h, 128, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = flash_attn_func(q, k, v, causal=causal)
    (out.double() * dout).sum().backward()
    ref, dq, dk, dv = bottom_right_reference(q, k, v, causal, dout)
    assert out.shape == (b, lq, h, 128) and out.dtype == torch.float32
    if causal and lq > lk:  # rows facing no key: exactly 0, and their dq too
        assert (out[:, : lq - lk] == 0).all() and (q.grad[:, : lq - lk] == 0).all()
    assert sqnr_db(ref, out.detach()) > 20
    for name, got, want in (("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
        assert got.shape == want.shape, name
        assert sqnr_db(want, got) > 15, name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_func_is_the_sdpa_drop_in_where_masks_agree(causal):
    """Lq = Lk (the two alignments are one mask), or no mask: the same bits as
    scaled_dot_product_attention(layout="bshd"), out and gradients."""
    import torch
    from mxflash.autograd import flash_attn_func, scaled_dot_product_attention as sdpa

    lk = 50 if causal else 77
    results = []
    for fn in (lambda q, k, v: flash_attn_func(q, k, v, causal=causal),
               lambda q, k, v: sdpa(q, k, v, is_causal=causal, enable_gqa=True, layout="bshd")):
        q, k, v = leaf((2, 50, 4, 128), 5, torch.bfloat16), leaf((2, lk, 2, 128), 6, torch.bfloat16), \
            leaf((2, lk, 2, 128), 7, torch.bfloat16)
        out = fn(q, k, v)
        out.float().square().sum().backward()
        results.append([x.view(torch.int16) for x in (out.detach(), q.grad, k.grad, v.grad)])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_is_flash_attn_func_per_sequence(causal):
    """Packed sequences of different lengths (an empty K/V one and Lq > Lk included): each
    sequence's out and gradients are flash_attn_func's on it alone, bit for bit; cu_seqlens as int32
    tensors, int64 tensors or lists alike."""
    import torch
    from mxflash.autograd import flash_attn_func, flash_attn_varlen_func

    lq, lk = [33, 70, 5, 128], [90, 40, 0, 129]
    h, hkv = 4, 2
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    q, k, v = leaf((cq[-1], h, 128), 8), leaf((ck[-1], hkv, 128), 9), leaf((ck[-1], hkv, 128), 10)
    dout = torch.randn(cq[-1], h, 128, generator=torch.Generator().manual_seed(11))
    for cu_q, cu_k in ((torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32)),
                       (torch.tensor(cq), list(ck))):
        for x in (q, k, v):
            x.grad = None
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal)
        (out * dout).sum().backward()
        assert out.shape == (cq[-1], h, 128) and out.dtype == torch.float32
        for b in range(len(lq)):
            rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            sq, sk, sv = (x.detach()[s].unsqueeze(0).clone().requires_grad_() for x, s in ((q, rows), (k, keys), (v, keys)))
            if lk[b] == 0:  # (the dense call's empty case: zeros)
                assert (out[rows] == 0).all() and (q.grad[rows] == 0).all()
                continue
            o = flash_attn_func(sq, sk, sv, causal=causal)
            (o * dout[rows].unsqueeze(0)).sum().backward()
            assert torch.equal(out[rows].detach(), o[0].detach()), b
            for name, got, want in (("dq", q.grad[rows], sq.grad[0]), ("dk", k.grad[keys], sk.grad[0]),
                                    ("dv", v.grad[keys], sv.grad[0])):
                assert torch.equal(got, want), (b, name)


def test_varlen_metadata_is_made_once_per_cu_seqlens():
    import torch
    from mxflash import autograd

    a = autograd._varlen_meta(torch.tensor([0, 3, 10], dtype=torch.int32), "cu_seqlens_q")
    assert autograd._varlen_meta([0, 3, 10], "cu_seqlens_q") is a
    assert autograd._varlen_meta([0, 3, 11], "cu_seqlens_q") is not a
    assert list(a.lengths) == [3, 7]


@pytest.mark.parametrize("case, match", [
    ("dropout", r"^dropout_p: must be 0"),
    ("window", r"^window_size: not supported \(mxflash runs window_size=\(-1, -1\)\), got \(128, 0\)"),
    ("softcap", r"^softcap: not supported"),
    ("alibi", r"^alibi_slopes: not supported"),
    ("probs", r"^return_attn_probs: not supported"),
    ("unknown", r"unexpected keyword argument 'window'"),
    ("causal", r"^causal: must be a bool, got 'yes'"),
    ("layout", r"^key: must be \(batch, tokens, heads, 128\) \(layout='bshd'\), got shape \(2, 40, 128\)"),
])
def test_flash_attn_func_refuses_by_name(case, match):
    import torch
    from mxflash.autograd import flash_attn_func

    q, k, v = torch.randn(2, 30, 2, 128), torch.randn(2, 40, 2, 128), torch.randn(2, 40, 2, 128)
    kw = {"dropout": {"dropout_p": 0.1}, "window": {"window_size": (128, 0)}, "softcap": {"softcap": 30.0},
          "alibi": {"alibi_slopes": torch.ones(2)}, "probs": {"return_attn_probs": True},
          "unknown": {"window": 3}, "causal": {"causal": "yes"}}.get(case, {})
    if case == "layout":
        k = torch.randn(2, 40, 128)
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attn_func(q, k, v, **kw)
    # accepted as FlashAttention's defaults
    k = torch.randn(2, 40, 2, 128)
    flash_attn_func(q, k, v, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=True,
                    return_attn_probs=False)


@pytest.mark.parametrize("case, match", [
    ("batches", r"^cu_seqlens_k: holds 1 sequences, cu_seqlens_q 2"),
    ("max_q", r"^max_seqlen_q: 20 is less than the longest sequence \(30\)"),
    ("max_k", r"^max_seqlen_k: 39 is less than the longest sequence \(40\)"),
    ("not_monotone", r"^cu_seqlens_q: "),
    ("float_tensor", r"^cu_seqlens_q: must be a 1-D int32 or int64 tensor"),
    ("tokens", r"^q: has 61 tokens but q_meta holds 60"),
])
def test_varlen_refuses_by_name(case, match):
    import torch
    from mxflash.autograd import flash_attn_varlen_func

    q, k, v = torch.randn(60, 2, 128), torch.randn(80, 2, 128), torch.randn(80, 2, 128)
    cq, ck, mq, mk = [0, 30, 60], [0, 40, 80], 30, 40
    if case == "batches":
        ck = [0, 80]
        mk = 80
    elif case == "max_q":
        mq = 20
    elif case == "max_k":
        mk = 39
    elif case == "not_monotone":
        cq = [0, 40, 30]
    elif case == "float_tensor":
        cq = torch.tensor([0.0, 30.0, 60.0])
    elif case == "tokens":
        q = torch.randn(61, 2, 128)
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(q, k, v, cq, ck, mq, mk)


def test_cuda_varlen_matches_cpu(torch_cuda):
    """The fast kernels against the exact-MX CPU references through flash_attn_varlen_func (GQA,
    bottom-right causal, lengths around the 128-row tiles, cu_seqlens as CUDA int32 tensors)."""
    torch = torch_cuda
    from mxflash.autograd import flash_attn_varlen_func

    lq, lk = [200, 64, 129], [300, 1, 100]
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    dout = torch.randn(cq[-1], 4, 128, generator=torch.Generator().manual_seed(40))
    results = {}
    for dev in ("cpu", "cuda"):
        q = leaf((cq[-1], 4, 128), 41, torch.bfloat16, dev)
        k, v = leaf((ck[-1], 2, 128), 42, torch.bfloat16, dev), leaf((ck[-1], 2, 128), 43, torch.bfloat16, dev)
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=dev) for c in (cq, ck))
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)
        (out.float() * dout.to(dev)).sum().backward()
        results[dev] = [x.detach().float().cpu() for x in (out, q.grad, k.grad, v.grad)]
    assert sqnr_db(results["cpu"][0], results["cuda"][0]) > 35, "out"
    for name, a, b in zip(("dq", "dk", "dv"), results["cpu"][1:], results["cuda"][1:]):
        assert sqnr_db(a, b) > 20, name
