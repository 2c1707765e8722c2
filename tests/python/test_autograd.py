"""mxflash.autograd.mx_attention: a torch autograd function whose forward and backward are the MXFP8
attention; gradients against torch's own float64 attention on the unquantized inputs (CPU tensors:
the exact-MX references), and on CUDA the same call against the CPU one (fast forward kernel,
fast GPU backward). Skipped without torch (CI has none; the GPU machine has it)."""
import importlib.util
import math

import numpy as np
import pytest

import mxflash

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

H = 2
Q_LENGTHS = [40, 17, 70]
K_LENGTHS = [33, 1, 129]


def reference(q, k, v, q_lengths, k_lengths):
    """float64 attention per sequence, differentiable (torch autograd)."""
    import torch

    outs, q0, k0 = [], 0, 0
    for lq, lk in zip(q_lengths, k_lengths):
        qs, ks, vs = q[q0:q0 + lq], k[k0:k0 + lk], v[k0:k0 + lk]
        s = torch.einsum("ihd,jhd->hij", qs, ks) / math.sqrt(128)
        outs.append(torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vs))
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs)


def sqnr_db(ref, x):
    ref, x = np.asarray(ref, np.float64), np.asarray(x, np.float64)
    return 10 * np.log10(np.sum(ref ** 2) / np.sum((x - ref) ** 2))


def leaves(device, dtype, seed=0, q_lengths=Q_LENGTHS, k_lengths=K_LENGTHS):
    import torch

    g = torch.Generator().manual_seed(seed)
    make = lambda t: torch.randn(t, H, 128, generator=g).to(device=device, dtype=dtype).requires_grad_()  # noqa
    return make(sum(q_lengths)), make(sum(k_lengths)), make(sum(k_lengths))


def ring_case(ring, monkeypatch):
    """The lengths and metadata of a training-step test's case: None the module's jagged lengths;
    "square" uniform lengths and "rect" Q sequences of one length against K/V of two, each with the
    backward's ring forced (MXFLASH_BWD_RING=1: its square and rectangular forms)."""
    q_lengths, k_lengths = {
        None: (Q_LENGTHS, K_LENGTHS),
        "square": ([512, 512], [512, 512]),
        "rect": ([256, 256], [700, 129]),
    }[ring]
    if ring:
        monkeypatch.setenv("MXFLASH_BWD_RING", "1")
    return q_lengths, k_lengths, mxflash.JaggedMeta.from_lengths(q_lengths), mxflash.JaggedMeta.from_lengths(k_lengths)


def run(device, dtype, seed=0):
    import torch
    from mxflash.autograd import mx_attention

    qm, km = mxflash.JaggedMeta.from_lengths(Q_LENGTHS), mxflash.JaggedMeta.from_lengths(K_LENGTHS)
    q, k, v = leaves(device, dtype, seed)
    out = mx_attention(q, k, v, qm, km)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=g).to(device)
    (out.float() * dout).sum().backward()
    return (q, k, v), out, dout


def test_cpu_gradients_against_float64_torch():
    import torch

    (q, k, v), out, dout = run("cpu", torch.float32)
    assert out.dtype == torch.bfloat16
    rq, rk, rv = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = reference(rq, rk, rv, Q_LENGTHS, K_LENGTHS)
    (ref * dout.double()).sum().backward()
    assert sqnr_db(ref.detach(), out.float().detach()) > 20
    for name, got, want in (("dq", q.grad, rq.grad), ("dk", k.grad, rk.grad), ("dv", v.grad, rv.grad)):
        assert got.dtype == torch.float32, name
        assert sqnr_db(want, got) > 15, name
    assert (k.grad[33:34] == 0).all(), "one key: dK is exactly 0"


def test_cuda_matches_cpu(torch_cuda):
    torch = torch_cuda
    (qc, kc, vc), outc, _ = run("cpu", torch.bfloat16)
    (qg, kg, vg), outg, _ = run("cuda", torch.bfloat16)
    assert sqnr_db(outc.float().detach(), outg.float().cpu().detach()) > 35  # fast forward vs exact MX
    for name, a, b in (("dq", qc.grad, qg.grad), ("dk", kc.grad, kg.grad), ("dv", vc.grad, vg.grad)):
        assert sqnr_db(a.float(), b.float().cpu()) > 20, name  # fast backward vs exact MX
    assert (kg.grad[33:34] == 0).all(), "one key: dK is exactly 0 on the GPU too"


@pytest.mark.parametrize("ring", [None, "square", "rect"], ids=["jagged", "ring", "rect"])
def test_training_step_on_a_second_device(torch_cuda, ring, monkeypatch):
    """A training step whose tensors live on cuda:1 while cuda:0 is the current device (one process
    driving two GPUs): the outputs and gradients land on cuda:1, the current device stays cuda:0, and
    they are the step's on cuda:0 bit for bit (the same kernels, plans and work lists: the SM count,
    the ring's cooperative launch and the workspaces are taken from the tensors' device). ring: as
    in the graph-capture test (the square and rectangular ring forced)."""
    torch = torch_cuda
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from mxflash.autograd import mx_attention

    q_lengths, k_lengths, qm, km = ring_case(ring, monkeypatch)
    results = {}
    for dev in ("cuda:0", "cuda:1"):
        q, k, v = leaves(dev, torch.bfloat16, seed=5, q_lengths=q_lengths, k_lengths=k_lengths)
        dout = torch.randn(sum(q_lengths), H, 128, generator=torch.Generator().manual_seed(6)).to(dev)
        with torch.cuda.device(0):
            out = mx_attention(q, k, v, qm, km)
            (out.float() * dout).sum().backward()
            assert torch.cuda.current_device() == 0
        torch.cuda.synchronize(dev)
        for name, x in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            assert x.device == torch.device(dev), f"{name} on {x.device}, not {dev}"
        results[dev] = [x.detach().cpu() for x in (out, q.grad, k.grad, v.grad)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["cuda:0"], results["cuda:1"]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name + ": cuda:1 differs from cuda:0"
    assert results["cuda:1"][0].abs().sum() > 0 and results["cuda:1"][3].abs().sum() > 0


def test_activation_checkpointing_drops_the_operands(torch_cuda):
    """Under torch.utils.checkpoint (non-reentrant), a layer's FP8 operands and LSE go with the
    forward and come back by recomputation: after four checkpointed layers the memory held is their
    outputs' (the operands would be ~2.5x that more), and the gradients are the plain step's bit for
    bit."""
    torch = torch_cuda
    from torch.utils.checkpoint import checkpoint
    from mxflash.autograd import mx_attention

    lengths = [512, 384]
    qm, km = mxflash.JaggedMeta.from_lengths(lengths), mxflash.JaggedMeta.from_lengths(lengths)
    layers = 4
    ins = [leaves("cuda", torch.bfloat16, seed=20 + i, q_lengths=lengths, k_lengths=lengths) for i in range(layers)]
    dout = torch.randn(sum(lengths), H, 128, generator=torch.Generator().manual_seed(9)).cuda()
    results = []
    for ckpt in (False, True):
        for q, k, v in ins:
            for x in (q, k, v):
                x.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if ckpt:
            outs = [checkpoint(mx_attention, q, k, v, qm, km, use_reentrant=False) for q, k, v in ins]
        else:
            outs = [mx_attention(q, k, v, qm, km) for q, k, v in ins]
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        out_bytes = sum(o.numel() * o.element_size() for o in outs)
        if ckpt:
            assert held <= out_bytes + layers * 64 * 1024, f"checkpointed layers hold {held} bytes, outputs {out_bytes}"
        else:
            assert held > 2 * out_bytes, f"plain layers hold {held} bytes: the operands should be among them"
        sum((o.float() * dout).sum() for o in outs).backward()
        torch.cuda.synchronize()
        results.append([x.grad.clone() for q, k, v in ins for x in (q, k, v)])
        del outs
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"gradient {i}: checkpointed differs"


def test_double_backward_is_refused():
    """The backward is not differentiable (its kernels are not autograd ops): a second-order
    gradient (create_graph=True, then backward through the first gradient) raises instead of
    silently giving zeros."""
    import torch
    from mxflash.autograd import mx_attention

    qm, km = mxflash.JaggedMeta.from_lengths(Q_LENGTHS), mxflash.JaggedMeta.from_lengths(K_LENGTHS)
    q, k, v = leaves("cpu", torch.float32, seed=11)
    out = mx_attention(q, k, v, qm, km)
    (gq,) = torch.autograd.grad(out.float().pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gq.sum().backward()


def test_torch_compile_of_a_training_step(torch_cuda):
    """A step compiled with torch.compile (default mode: the autograd function runs eagerly at a
    graph break around it, the ops around it compiled) gives the eager step's gradients bit for bit
    and its loss to float32 rounding (the compiled sum may add in another order)."""
    torch = torch_cuda
    from mxflash.autograd import mx_attention

    qm, km = mxflash.JaggedMeta.from_lengths(Q_LENGTHS), mxflash.JaggedMeta.from_lengths(K_LENGTHS)
    dout = torch.randn(sum(Q_LENGTHS), H, 128, generator=torch.Generator().manual_seed(7)).cuda()

    def step(q, k, v):
        out = mx_attention(q * 2.0, k, v * 0.5, qm, km)  # (exact scalings around the call)
        return (out.float() * dout).sum()

    results = []
    for fn in (step, torch.compile(step)):
        q, k, v = leaves("cuda", torch.float32, seed=8)
        loss = fn(q, k, v)
        loss.backward()
        torch.cuda.synchronize()
        results.append([loss.detach(), q.grad, k.grad, v.grad])
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-5, atol=0), "loss"
    for name, a, b in zip(("dq", "dk", "dv"), results[0][1:], results[1][1:]):
        assert torch.equal(a, b), name + ": compiled differs from eager"
    assert results[1][1].abs().sum() > 0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_graph_keeps_operands_not_inputs(device, request):
    """The forward writes the backward's FP8 operands (quantize_attention_training) and the graph keeps
    them, not q, k, v: changing q, k, v in place after the forward changes no gradient (bit for bit
    against an untouched run), and a forward without grad mode gives the same out."""
    import torch
    from mxflash.autograd import mx_attention

    if device == "cuda":
        request.getfixturevalue("torch_cuda")
    qm, km = mxflash.JaggedMeta.from_lengths(Q_LENGTHS), mxflash.JaggedMeta.from_lengths(K_LENGTHS)
    dout = torch.randn(sum(Q_LENGTHS), H, 128, generator=torch.Generator().manual_seed(6)).to(device)
    grads = []
    for touch in (False, True):
        q, k, v = leaves(device, torch.bfloat16, seed=5)
        out = mx_attention(q, k, v, qm, km)
        if touch:
            with torch.no_grad():
                for x in (q, k, v):
                    x.mul_(-3)
        (out.float() * dout).sum().backward()
        grads.append((out.detach(), q.grad, k.grad, v.grad))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *grads):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    q, k, v = leaves(device, torch.bfloat16, seed=5)
    with torch.no_grad():
        out = mx_attention(q, k, v, qm, km)
    assert out.grad_fn is None
    assert torch.equal(out.view(torch.int16), grads[0][0].view(torch.int16))


@pytest.mark.parametrize("ring", [None, "square", "rect"], ids=["jagged", "ring", "rect"])
def test_cuda_graph_capture_of_a_training_step(torch_cuda, ring, monkeypatch):
    """A training step (quantize, forward, backward) captured with torch.cuda.graph and replayed on
    new values of its inputs gives bit for bit what the eager step gives on them: nothing in it
    syncs with the host or copies from host memory that is gone by replay time (the work lists go
    to the device inside kernel parameters). ring: uniform lengths with the backward's ring forced
    (MXFLASH_BWD_RING=1), whose kernel is a cooperative launch; rect: Q sequences of one length and
    K/V sequences of two, with the ring forced (its rectangular form, whose dK/dV list is uploaded
    with the work lists)."""
    torch = torch_cuda
    from mxflash.autograd import mx_attention

    q_lengths, k_lengths, qm, km = ring_case(ring, monkeypatch)
    qm.upload()
    km.upload()
    q, k, v = leaves("cuda", torch.bfloat16, seed=3, q_lengths=q_lengths, k_lengths=k_lengths)
    dout = torch.randn(sum(q_lengths), H, 128, generator=torch.Generator().manual_seed(4)).cuda()

    def step():
        for x in (q, k, v):
            x.grad = None
        out = mx_attention(q, k, v, qm, km)
        (out.float() * dout).sum().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch asks
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    static_grads = (q.grad, k.grad, v.grad)
    with torch.no_grad():
        for i, x in enumerate((q, k, v)):
            x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + i)).to(x))
    graph.replay()
    torch.cuda.synchronize()
    got = [static_out.clone()] + [g.clone() for g in static_grads]
    want_out = step()
    want = [want_out] + [q.grad, k.grad, v.grad]
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name + ": replay differs from the eager step"
    assert got[0].abs().sum() > 0, "the replayed step wrote no output"
    if ring:  # the ring ran: dK differs from the two kernels' in the last bits (docs/backward.md)
        monkeypatch.setenv("MXFLASH_BWD_RING", "0")
        step()
        torch.cuda.synchronize()
        assert not torch.equal(k.grad, want[2]), "dK the two kernels' bytes: did the ring run?"
        assert sqnr_db(want[2].float().cpu().numpy(), k.grad.float().cpu().numpy()) > 40


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("kv_heads,causal", [(H, False), (1, "bottom_right")], ids=["mha", "mqa-causal"])
def test_step_is_the_public_operand_calls(device, kv_heads, causal, request):
    """mx_attention's step (its operands in two buffers, one binding call each way: _attention_step_*)
    gives the bytes of the public calls it stands for: quantize_attention_training, then
    attention_forward_operands and attention_backward_operands on those operands."""
    import torch
    from mxflash.autograd import mx_attention

    if device == "cuda":
        request.getfixturevalue("torch_cuda")
    qm, km = mxflash.JaggedMeta.from_lengths(Q_LENGTHS), mxflash.JaggedMeta.from_lengths(K_LENGTHS)
    q, k, v = leaves(device, torch.bfloat16, seed=31)
    k, v = (x.detach()[:, :kv_heads].contiguous().requires_grad_() for x in (k, v))
    dout = torch.randn(sum(Q_LENGTHS), H, 128, generator=torch.Generator().manual_seed(32)).to(device, torch.bfloat16)
    out = mx_attention(q, k, v, qm, km, causal=causal)
    out.backward(dout)
    fops, bops = mxflash.quantize_attention_training(q.detach(), k.detach(), v.detach(), qm, km)
    want_out, lse = mxflash.attention_forward_operands(fops, qm, km, causal=causal)
    want = mxflash.attention_backward_operands(bops, want_out, dout, lse, qm, km, causal=causal)
    for name, a, b in (("out", out.detach(), want_out), ("dq", q.grad, want[0]), ("dk", k.grad, want[1]),
                       ("dv", v.grad, want[2])):
        assert a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16)), name


def test_float16_inputs_give_the_float32_results_in_float16():
    """float16 q, k, v (fp16 training): quantized through float32 (exact), so out and the gradients are
    the float32 inputs' results, returned in float16."""
    import torch
    from mxflash.autograd import mx_attention

    qm, km = mxflash.JaggedMeta.from_lengths(Q_LENGTHS), mxflash.JaggedMeta.from_lengths(K_LENGTHS)
    half = leaves("cpu", torch.float16, seed=5)
    full = [x.detach().float().requires_grad_() for x in half]
    # dout exactly representable in bf16 and fp16, so both runs' backward sees the same bf16 dout
    dout = torch.randn(sum(Q_LENGTHS), H, 128, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).float()
    dout[dout.abs() < 2.0 ** -14] = 0
    out16 = mx_attention(*half, qm, km)
    (out16.float() * dout).sum().backward()
    out32 = mx_attention(*full, qm, km)
    (out32.float() * dout).sum().backward()
    assert out16.dtype == torch.float16 and out32.dtype == torch.bfloat16
    assert torch.equal(out16, out32.to(torch.float16))
    for name, a, b in zip(("dq", "dk", "dv"), half, full):
        assert a.grad.dtype == torch.float16, name
        assert torch.equal(a.grad, b.grad.to(torch.float16)), name


def test_forward_is_the_operands_forward_and_mixed_dtypes_go_through_float32():
    """The forward is quantize_attention_forward + attention_forward_operands on the inputs; q, k, v
    of different dtypes are quantized from float32 (exact for bfloat16 and float16): the same out as
    all-float32 inputs."""
    import torch
    from mxflash.autograd import mx_attention

    qm, km = mxflash.JaggedMeta.from_lengths(Q_LENGTHS), mxflash.JaggedMeta.from_lengths(K_LENGTHS)
    q, k, v = (x.detach().to(torch.bfloat16).float() for x in leaves("cpu", torch.float32, seed=7))
    want, _ = mxflash.attention_forward_operands(mxflash.quantize_attention_forward(q, k, v, qm, km), qm, km)
    assert torch.equal(mx_attention(q, k, v, qm, km).view(torch.int16), want.view(torch.int16))
    mixed = mx_attention(q.to(torch.bfloat16), k, v.to(torch.float16), qm, km)
    assert mixed.dtype == torch.bfloat16 and torch.equal(mixed.view(torch.int16), want.view(torch.int16))
    bf16 = mx_attention(*(x.to(torch.bfloat16) for x in (q, k, v)), qm, km)
    assert torch.equal(bf16.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("case, match", [
    ("hdim64", r"^q: must be \(tokens, heads, 128\), got shape \(127, 2, 64\)"),
    ("k_heads", r"^k: has 3 heads, which must divide q's 2 \(the same count, or a grouped-query share of it\)$"),
    ("v_heads", r"^v: has 1 heads, k has 2$"),
    ("q_tokens", r"^q: has 128 tokens but q_meta holds 127"),
    ("v_tokens", r"^v: has 164 tokens but k_meta holds 163"),
    ("int_q", r"^q: dtype must be bfloat16, float16, float32 or float64, got torch.int32"),
    ("meta", r"^k_meta: expected mxflash.JaggedMeta"),
])
def test_bad_inputs_name_the_argument(case, match):
    """mx_attention rejects bad q, k, v or metadata before any work, naming the argument (not the
    quantizer's x)."""
    import torch
    from mxflash.autograd import mx_attention

    qm, km = mxflash.JaggedMeta.from_lengths(Q_LENGTHS), mxflash.JaggedMeta.from_lengths(K_LENGTHS)
    tq, tk = sum(Q_LENGTHS), sum(K_LENGTHS)
    q, k, v = torch.randn(tq, H, 128), torch.randn(tk, H, 128), torch.randn(tk, H, 128)
    if case == "hdim64":
        q = torch.randn(tq, H, 64)
    elif case == "k_heads":
        k = torch.randn(tk, 3, 128)
    elif case == "v_heads":
        v = torch.randn(tk, 1, 128)
    elif case == "q_tokens":
        q = torch.randn(tq + 1, H, 128)
    elif case == "v_tokens":
        v = torch.randn(tk + 1, H, 128)
    elif case == "int_q":
        q = torch.zeros(tq, H, 128, dtype=torch.int32)
    elif case == "meta":
        km = K_LENGTHS
    with pytest.raises((ValueError, TypeError), match=match):
        mx_attention(q, k, v, qm, km)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_query_attention(kv_heads, causal):
    """k and v with fewer heads than q (a divisor of them): q head h attends k/v head h // group.
    The same out and dq as the call on k, v repeated per group, bit for bit, and dk, dv that group's
    gradients summed in float32 and rounded once to bfloat16 (the kernels' dk, dv are bfloat16: the
    grouped backward sums its per-head gradients and returns the sums in bfloat16); against float64 torch attention on the repeated heads (the causal case: each
    row's first keys, Lq = Lk), SQNR above 20 dB."""
    import torch
    from mxflash.autograd import mx_attention

    hq, lengths = 4, [40, 17, 70]
    group = hq // kv_heads
    qm = km = mxflash.JaggedMeta.from_lengths(lengths)
    g = torch.Generator().manual_seed(23)
    t = sum(lengths)
    q = torch.randn(t, hq, 128, generator=g).requires_grad_()
    k = torch.randn(t, kv_heads, 128, generator=g).requires_grad_()
    v = torch.randn(t, kv_heads, 128, generator=g).requires_grad_()
    dout = torch.randn(t, hq, 128, generator=g)
    out = mx_attention(q, k, v, qm, km, causal=causal)
    (out.float() * dout).sum().backward()

    q2 = q.detach().clone().requires_grad_()
    k2 = k.detach().repeat_interleave(group, dim=1).requires_grad_()
    v2 = v.detach().repeat_interleave(group, dim=1).requires_grad_()
    out2 = mx_attention(q2, k2, v2, qm, km, causal=causal)
    (out2.float() * dout).sum().backward()
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16))
    assert torch.equal(q.grad, q2.grad)
    for got, full in ((k.grad, k2.grad), (v.grad, v2.grad)):
        want = full.view(t, kv_heads, group, 128).sum(dim=2).to(torch.bfloat16).float()
        assert torch.equal(got, want)

    rq = q.detach().double()
    rk = k.detach().double().repeat_interleave(group, dim=1)
    rv = v.detach().double().repeat_interleave(group, dim=1)
    if causal:
        outs, t0 = [], 0
        for n in lengths:
            s = torch.einsum("ihd,jhd->hij", rq[t0:t0 + n], rk[t0:t0 + n]) / math.sqrt(128)
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            outs.append(torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), rv[t0:t0 + n]))
            t0 += n
        ref = torch.cat(outs)
    else:
        ref = reference(rq, rk, rv, lengths, lengths)
    assert sqnr_db(ref.numpy(), out.detach().float().numpy()) > 20


def test_step_buffers_are_checked_before_any_work():
    """The step's bindings refuse a saved or scratch buffer that is too short, misaligned or not
    uint8, naming it, before writing anything (out keeps its poison)."""
    import torch

    qm, km = mxflash.JaggedMeta.from_lengths(Q_LENGTHS), mxflash.JaggedMeta.from_lengths(K_LENGTHS)
    q, k, v = (x.detach() for x in leaves("cpu", torch.bfloat16, seed=41))
    n_saved, n_scratch = mxflash._C.attention_step_layout(qm._host, km._host, H, H, True, False, 0, False)
    assert n_saved > 0 and n_scratch > 0
    tokens = sum(Q_LENGTHS)
    out = torch.full((tokens, H, 128), 7.0, dtype=torch.bfloat16)
    lse = torch.full((H, tokens), 7.0)
    view = mxflash._view

    def call(saved, scratch):
        mxflash._C.attention_step_forward(qm._host, km._host, view(q, "q"), view(k, "k"), view(v, "v"),
                                          view(saved, "saved", True), view(scratch, "scratch", True),
                                          view(out, "out", True), view(lse, "lse", True), float("nan"), False, 0,
                                          True, 0)

    good_saved, good_scratch = torch.empty(n_saved + 16, dtype=torch.uint8), torch.empty(n_scratch, dtype=torch.uint8)
    bad = [(torch.empty(n_saved - 1, dtype=torch.uint8), good_scratch, "saved"),
           (good_saved[1:], good_scratch, "saved"),
           (torch.empty(n_saved // 4 + 1, dtype=torch.float32), good_scratch, "saved"),
           (good_saved, torch.empty(n_scratch - 1, dtype=torch.uint8), "scratch")]
    for saved, scratch, name in bad:
        with pytest.raises(ValueError, match=f"^{name}: must be a 16-byte aligned uint8 buffer of at least "):
            call(saved, scratch)
        assert bool((out == 7.0).all()) and bool((lse == 7.0).all()), f"written although {name} was refused"
    call(good_saved, good_scratch)
    assert not bool((out == 7.0).all())
