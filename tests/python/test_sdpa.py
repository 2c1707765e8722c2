"""mxflash.autograd.scaled_dot_product_attention: torch's SDPA call on dense (B, H, L, 128) batches
(or (B, L, H, 128) with layout="bshd") run as MXFP8 attention. CPU tensors: against torch's own
scaled_dot_product_attention in float64 on the unquantized inputs (is_causal, scale, enable_gqa,
L != S), bit for bit against mx_attention on the packed tensors, both layouts alike, the inputs'
dtype back, empty batches, bad arguments named. CUDA: the same call against the CPU one, and a
GQA causal case against float64 SDPA on the GPU. Skipped without torch (CI has none; the GPU
machine has it)."""
import importlib.util
import math

import numpy as np
import pytest

import mxflash

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


def sqnr_db(ref, x):
    ref, x = np.asarray(ref, np.float64), np.asarray(x, np.float64)
    return 10 * np.log10(np.sum(ref ** 2) / np.sum((x - ref) ** 2))


def dense(shape, dtype=None, device="cpu", seed=0, layout="bhsd"):
    """A (B, H, L, 128) leaf, or with layout "bshd" a (B, L, H, 128) one; shape is (B, H, L) either way."""
    import torch

    b, h, n = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((b, n, h, 128) if layout == "bshd" else (b, h, n, 128), generator=g)
    return x.to(device=device, dtype=dtype or torch.float32).requires_grad_()


def step(fn, q, k, v, dout, **kw):
    """out = fn(q, k, v, **kw), backward with dout; returns out (detached) and the three gradients."""
    out = fn(q, k, v, **kw)
    (out.double() * dout.to(out.device, torch_double())).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def torch_double():
    import torch

    return torch.float64


def torch_reference(q, k, v, **kw):
    """torch's SDPA in float64 on copies of the leaves (its math backend on CPU)."""
    import torch

    rq, rk, rv = (x.detach().double().requires_grad_() for x in (q, k, v))
    return (rq, rk, rv), torch.nn.functional.scaled_dot_product_attention(rq, rk, rv, **kw)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("lq, lk", [(70, 70), (40, 129), (130, 33)], ids=["square", "short_q", "long_q"])
def test_cpu_against_torch_sdpa_float64(causal, kv_heads, lq, lk):
    """Out and the gradients against torch's SDPA (float64, unquantized inputs) with the same
    is_causal (top-left when L != S: rows past the last key attend every key) and enable_gqa."""
    import torch
    from mxflash.autograd import scaled_dot_product_attention as sdpa

    b, h = 2, 4
    q, k, v = dense((b, h, lq), seed=1), dense((b, kv_heads, lk), seed=2), dense((b, kv_heads, lk), seed=3)
    dout = torch.randn(b, h, lq, 128, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    kw = dict(is_causal=causal, enable_gqa=kv_heads != h)
    out, dq, dk, dv = step(sdpa, q, k, v, dout, **kw)
    (rq, rk, rv), ref = torch_reference(q, k, v, **kw)
    (ref * dout).sum().backward()
    assert out.shape == (b, h, lq, 128) and out.dtype == torch.float32
    assert sqnr_db(ref.detach(), out) > 20
    for name, got, want in (("dq", dq, rq.grad), ("dk", dk, rk.grad), ("dv", dv, rv.grad)):
        assert got.shape == want.shape and got.dtype == torch.float32, name
        assert sqnr_db(want, got) > 15, name


def test_scale_is_torch_scale():
    """scale= is the softmax scale (torch's meaning); None is 1/sqrt(128)."""
    import torch
    from mxflash.autograd import scaled_dot_product_attention as sdpa

    q, k, v = dense((1, 2, 50), seed=5), dense((1, 2, 60), seed=6), dense((1, 2, 60), seed=7)
    for scale in (None, 0.03, 1.0 / math.sqrt(128)):
        out = sdpa(q, k, v, scale=scale)
        _, ref = torch_reference(q, k, v, scale=scale)
        assert sqnr_db(ref.detach(), out.detach()) > 20, scale
    assert torch.equal(sdpa(q, k, v), sdpa(q, k, v, scale=1.0 / math.sqrt(128)))
    assert not torch.equal(sdpa(q, k, v), sdpa(q, k, v, scale=0.03))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_is_mx_attention_on_the_packed_tensors(causal):
    """The same bits as mx_attention on the (B * L, H, 128) packing with equal-length metadata:
    out and all three gradients; and layout "bshd" on the same memory gives the same bits again."""
    import torch
    from mxflash.autograd import mx_attention, scaled_dot_product_attention as sdpa

    b, h, hkv, lq, lk = 3, 4, 2, 45, 77
    qs, ks, vs = dense((b, h, lq), torch.bfloat16, seed=8), dense((b, hkv, lk), torch.bfloat16, seed=9), \
        dense((b, hkv, lk), torch.bfloat16, seed=10)
    dout = torch.randn(b, h, lq, 128, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    out, dq, dk, dv = step(sdpa, qs, ks, vs, dout, is_causal=causal, enable_gqa=True)
    assert out.dtype == torch.bfloat16 and dq.dtype == torch.bfloat16

    pack = lambda x: x.detach().transpose(1, 2).reshape(-1, x.shape[1], 128).clone().requires_grad_()  # noqa
    qp, kp, vp = pack(qs), pack(ks), pack(vs)
    qm, km = mxflash.JaggedMeta.from_lengths([lq] * b), mxflash.JaggedMeta.from_lengths([lk] * b)
    ref_out = mx_attention(qp, kp, vp, qm, km, causal=causal)
    (ref_out.double() * dout.transpose(1, 2).reshape(-1, h, 128)).sum().backward()
    unpack = lambda x, n: x.view(b, n, -1, 128).transpose(1, 2)  # noqa
    assert torch.equal(out.view(torch.int16), unpack(ref_out.detach(), lq).view(torch.int16))
    for name, got, want, n in (("dq", dq, qp.grad, lq), ("dk", dk, kp.grad, lk), ("dv", dv, vp.grad, lk)):
        assert torch.equal(got.view(torch.int16), unpack(want, n).view(torch.int16)), name

    # layout "bshd": the same memory seen as (B, L, H, 128)
    ql, kl, vl = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (qs, ks, vs))
    out_l, dq_l, dk_l, dv_l = step(sdpa, ql, kl, vl, dout.transpose(1, 2), is_causal=causal, enable_gqa=True,
                                   layout="bshd")
    assert out_l.shape == (b, lq, h, 128)
    for name, got, want in (("out", out_l, out), ("dq", dq_l, dq), ("dk", dk_l, dk), ("dv", dv_l, dv)):
        assert torch.equal(got.transpose(1, 2).view(torch.int16), want.view(torch.int16)), name


def test_transposed_inputs_are_read_in_place_and_out_is_their_transpose():
    """(B, H, L, 128) views of (B, L, H, 128) memory (x.view(B, L, H, 128).transpose(1, 2)) give the
    same result as contiguous copies, and out.transpose(1, 2) is contiguous (FlashAttention's form)."""
    import torch
    from mxflash.autograd import scaled_dot_product_attention as sdpa

    base = [dense((2, 3, 20), seed=s, layout="bshd").detach() for s in (12, 13, 14)]
    views = [x.transpose(1, 2) for x in base]
    copies = [x.contiguous() for x in views]
    assert not views[0].is_contiguous() and copies[0].is_contiguous()
    a, b = sdpa(*views), sdpa(*copies)
    assert torch.equal(a, b)
    assert a.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_out_and_gradients_in_the_inputs_dtype(dtype):
    import torch
    from mxflash.autograd import scaled_dot_product_attention as sdpa

    dt = getattr(torch, dtype)
    q, k, v = (dense((1, 2, 30), dt, seed=s) for s in (15, 16, 17))
    out = sdpa(q, k, v)
    out.sum().backward()
    assert out.dtype == dt
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == dt
    assert torch.isfinite(out).all() and q.grad.abs().sum() > 0


@pytest.mark.parametrize("b, lq, lk", [(0, 10, 10), (2, 0, 10), (2, 10, 0)], ids=["no_batch", "no_queries", "no_keys"])
def test_empty_inputs_give_zeros_and_zero_gradients(b, lq, lk):
    """Nothing to attend: out of the right shape, 0 where rows exist (rows without keys give 0 as in
    mx_attention), and zero gradients of the inputs' shapes."""
    import torch
    from mxflash.autograd import scaled_dot_product_attention as sdpa

    q, k, v = dense((b, 2, lq), seed=18), dense((b, 2, lk), seed=19), dense((b, 2, lk), seed=20)
    out = sdpa(q, k, v, is_causal=True)
    assert out.shape == (b, 2, lq, 128) and out.dtype == torch.float32
    assert (out == 0).all()
    out.sum().backward()
    for x in (q, k, v):
        assert x.grad.shape == x.shape and (x.grad == 0).all()


@pytest.mark.parametrize("case, match", [
    ("attn_mask", r"^attn_mask: not supported"),
    ("dropout", r"^dropout_p: must be 0"),
    ("layout", r"^layout: must be 'bhsd' or 'bshd', got 'bhds'"),
    ("is_causal", r"^is_causal: must be a bool, got 'yes'"),
    ("three_dims", r"^query: must be \(batch, heads, tokens, 128\) \(layout='bhsd'\), got shape \(2, 30, 128\)"),
    ("hdim64", r"^key: must be \(batch, heads, tokens, 128\) \(layout='bhsd'\), got shape \(2, 2, 40, 64\)"),
    ("dtype", r"^value: dtype torch.float64 differs from query's torch.float32"),
    ("v_shape", r"^value: shape \(2, 2, 41, 128\) must equal key's \(2, 2, 40, 128\)"),
    ("batch", r"^key: batch 3 differs from query's 2"),
    ("heads", r"^key: has 1 heads, query 2: different head counts need enable_gqa=True"),
    ("gqa_divide", r"^key: has 3 heads, which must divide query's 2"),
    ("not_tensor", r"^query: expected a torch tensor, got list"),
])
def test_bad_arguments_are_named(case, match):
    import torch
    from mxflash.autograd import scaled_dot_product_attention as sdpa

    q, k, v = torch.randn(2, 2, 30, 128), torch.randn(2, 2, 40, 128), torch.randn(2, 2, 40, 128)
    kw = {}
    if case == "attn_mask":
        kw["attn_mask"] = torch.ones(30, 40, dtype=torch.bool)
    elif case == "dropout":
        kw["dropout_p"] = 0.1
    elif case == "layout":
        kw["layout"] = "bhds"
    elif case == "is_causal":
        kw["is_causal"] = "yes"
    elif case == "three_dims":
        q = torch.randn(2, 30, 128)
    elif case == "hdim64":
        k = torch.randn(2, 2, 40, 64)
    elif case == "dtype":
        v = v.double()
    elif case == "v_shape":
        v = torch.randn(2, 2, 41, 128)
    elif case == "batch":
        k, v = torch.randn(3, 2, 40, 128), torch.randn(3, 2, 40, 128)
    elif case == "heads":
        k, v = torch.randn(2, 1, 40, 128), torch.randn(2, 1, 40, 128)
    elif case == "gqa_divide":
        k, v = torch.randn(2, 3, 40, 128), torch.randn(2, 3, 40, 128)
        kw["enable_gqa"] = True
    elif case == "not_tensor":
        q = [[0.0]]
    with pytest.raises((ValueError, TypeError), match=match):
        sdpa(q, k, v, **kw)


def test_metadata_is_made_once_per_shape():
    """Repeated calls of one (B, L) reuse one JaggedMeta (so its device copy is uploaded once)."""
    from mxflash import autograd

    a = autograd._uniform_meta(3, 77)
    assert autograd._uniform_meta(3, 77) is a
    assert autograd._uniform_meta(3, 78) is not a
    assert list(a.lengths) == [77, 77, 77]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_cuda_matches_cpu(torch_cuda, layout):
    """The fast kernels (forward and backward) against the exact-MX CPU references on the same
    inputs, GQA and the causal mask on."""
    torch = torch_cuda
    from mxflash.autograd import scaled_dot_product_attention as sdpa

    shapes = ((2, 4, 200), (2, 2, 300), (2, 2, 300))
    dout = torch.randn(2, 4, 200, 128, generator=torch.Generator().manual_seed(21), dtype=torch.float64)
    if layout == "bshd":
        dout = dout.transpose(1, 2)
    results = {}
    for dev in ("cpu", "cuda"):
        q, k, v = (dense(s, torch.bfloat16, dev, seed=22 + i, layout=layout) for i, s in enumerate(shapes))
        results[dev] = [x.float().cpu() for x in step(sdpa, q, k, v, dout, is_causal=True, enable_gqa=True,
                                                       layout=layout)]
    assert results["cuda"][0].device.type == "cpu"
    assert sqnr_db(results["cpu"][0], results["cuda"][0]) > 35, "out"
    for name, a, b in zip(("dq", "dk", "dv"), results["cpu"][1:], results["cuda"][1:]):
        assert sqnr_db(a, b) > 20, name


def test_cuda_against_torch_sdpa_float64(torch_cuda):
    """A training-size case on the GPU (B=2, H=8 over Hkv=2, L=S=1000, causal) against torch's SDPA
    in float64 on the same device: out above 25 dB, gradients above 20 dB."""
    torch = torch_cuda
    from mxflash.autograd import scaled_dot_product_attention as sdpa

    q = dense((2, 8, 1000), torch.bfloat16, "cuda", seed=30)
    k, v = dense((2, 2, 1000), torch.bfloat16, "cuda", seed=31), dense((2, 2, 1000), torch.bfloat16, "cuda", seed=32)
    dout = torch.randn(2, 8, 1000, 128, generator=torch.Generator().manual_seed(33), dtype=torch.float64).cuda()
    out, dq, dk, dv = step(sdpa, q, k, v, dout, is_causal=True, enable_gqa=True)
    (rq, rk, rv), ref = torch_reference(q, k, v, is_causal=True, enable_gqa=True)
    (ref * dout).sum().backward()
    assert sqnr_db(ref.detach().cpu(), out.float().cpu()) > 25
    for name, got, want in (("dq", dq, rq.grad), ("dk", dk, rk.grad), ("dv", dv, rv.grad)):
        assert sqnr_db(want.cpu(), got.float().cpu()) > 20, name


def compiled_against_eager(device, compile_kw, dtype_name="bfloat16"):
    """A step through the drop-ins (SDPA with GQA and is_causal, flash_attn_func with FlashAttention's
    causal) compiled with torch.compile(fullgraph=True, **compile_kw) against the eager step: out and
    every gradient bit for bit (the compiled graph runs the custom ops mxflash::dense_step_fwd / _bwd,
    the eager step the autograd Function: the same binding calls)."""
    import torch
    from mxflash.autograd import flash_attn_func, scaled_dot_product_attention as sdpa

    dtype = getattr(torch, dtype_name)
    dout = dense((2, 4, 70), dtype, device, seed=9).detach()

    def fn(q, k, v):
        a = sdpa(q * 2.0, k, v, is_causal=True, enable_gqa=True)
        b = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)
        out = a + b
        return (out.float() * dout.float()).sum(), out

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, **compile_kw)):
        for _ in range(3 if compile_kw.get("mode") == "reduce-overhead" else 1):  # (CUDA graphs: warm-up, record, replay)
            q, k, v = dense((2, 4, 70), dtype, device, seed=1), dense((2, 2, 70), dtype, device, 2), dense((2, 2, 70), dtype, device, 3)
            loss, out = f(q, k, v)
            loss.backward()
        results.append([out.detach().clone(), q.grad, k.grad, v.grad])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert a.dtype == b.dtype and torch.equal(a, b), name + ": compiled differs from eager"
    assert results[0][1].abs().sum() > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_torch_compile_fullgraph_cpu(dtype):
    """fullgraph=True: the drop-ins trace into the graph (no graph break); aot_eager (dynamo and AOT
    autograd without inductor's code generation)."""
    compiled_against_eager("cpu", {"backend": "aot_eager"}, dtype)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_fullgraph_cuda(torch_cuda, mode):
    """On CUDA with inductor, and with its CUDA graphs (mode="reduce-overhead": the step's launches
    recorded once and replayed)."""
    compiled_against_eager("cuda", {} if mode == "default" else {"mode": mode})


def test_torch_compile_new_shapes_are_specialized():
    """A compiled step called on a second and a third (batch, length): torch.compile's automatic
    dynamic shapes hand the custom ops symbolic sizes, which they specialize (the metadata and the
    saved buffer are per shape); every call gives the eager bytes."""
    import torch
    from mxflash.autograd import scaled_dot_product_attention as sdpa

    def fn(q, k, v):
        out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
        return out.float().sum(), out

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for b, n in ((2, 100), (3, 130), (1, 77)):
        results = []
        for f in (fn, compiled):
            q, k, v = dense((b, 4, n), torch.bfloat16, seed=n), dense((b, 2, n), torch.bfloat16, seed=n + 1), \
                dense((b, 2, n), torch.bfloat16, seed=n + 2)
            loss, out = f(q, k, v)
            loss.backward()
            results.append([out.detach(), q.grad, k.grad, v.grad])
        for name, a, c in zip(("out", "dq", "dk", "dv"), *results):
            assert torch.equal(a, c), f"{name} at batch {b}, length {n}: compiled differs from eager"
