#!/usr/bin/env python3
"""Independent peer measurement for mxflash-bench, on the GPU machine.

Measures the same four presets as mxflash-bench through frameworks instead of our own cuDNN graphs:
  torch-cudnn-bf16  torch.nn.functional.scaled_dot_product_attention under
                    sdpa_kernel(SDPBackend.CUDNN_ATTENTION) (no fallback), BF16. Forward alone, and
                    backward alone as torch.autograd.grad(..., retain_graph=True) on a retained forward
                    graph (so only the backward kernels are timed).
  jax-cudnn-bf16    jax.nn.dot_product_attention(implementation="cudnn"), BF16 (dense presets).
  jax-cudnn-fp8     jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(use_fp8=True):
                    cuDNN's per-tensor FP8 SDPA through XLA (dense presets); bwd = (fwd+bwd) - fwd.
JAX runs in a subprocess after torch released its memory; if a JAX path fails (for example cuDNN
creating no execution plan under CUDA 13), the failure is reported and that peer is skipped.

Jagged preset (B=768, shared Lq=512, Lk jagged): the lengths are the binary's (same seeded
generator, or read from --bench-json). torch is measured two ways, each reported under its own name
when it runs: nested jagged tensors (torch-cudnn-bf16-njt) and padded K/V with a boolean
key-padding mask (torch-cudnn-bf16-padded). JAX: padded K/V with sequence lengths (cuDNN padding
mask), BF16 and FP8. FLOPs always count the real lengths: fwd 4*H*D*sum(Lq*Lk), bwd 10*H*D*sum(Lq*Lk).

Timing: CUDA events (torch) around samples of --launches launches, warm-up by time, a time window,
median; inputs rotated among enough sets to exceed 2x L2. JAX: wall clock around samples of
launches ended by block_until_ready; each launch is one jitted program that runs the attention on
every input set in turn, and the time is divided by the number of sets, so host dispatch of a short
kernel is not what is measured (--jax-per-call: one call per set, host gap included; the suspected
reason, not yet verified, why the 0.33 ms llm FP8 forward read 13% slow that way).

Usage:
  python3 scripts/peer_check.py [--preset all] [--json peer.json] [--bench-json bench.json]
          [--warmup-s 0.5] [--window-s 2] [--launches 5] [--no-jax] [--no-torch]
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HEAD_DIM = 128
PRESETS = {
    "llm": dict(batch=8, heads=16, lq=2048, lk=2048, broadcast=False),
    "llm-long": dict(batch=2, heads=16, lq=8192, lk=8192, broadcast=False),
    "cross": dict(batch=64, heads=3, lq=512, lk=16384, broadcast=True),
    "jagged": dict(batch=768, heads=3, lq=512, lk=("jagged", 0.5, 16384), broadcast=True, seed=1234),
}
ORDER = ["llm", "llm-long", "cross", "jagged"]

# ---------------------------------------------------------------- lengths (same generator as the binary)
M64 = (1 << 64) - 1


class SplitMix64:
    def __init__(self, state):
        self.state = state & M64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    def below(self, n):
        while True:
            m = self.next() * n
            low = m & M64
            if low >= n or low >= ((-n) & M64) % n:
                return m >> 64


def _llround(x):
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


def jagged_lengths(batch, fill, max_len, seed, min_len=1):
    """Port of mxflash::bench::jagged_lengths (tools/bench/bench_options.cpp): identical output."""
    min_len = max(0, min(min_len, max_len))
    twice_mean = _llround(2.0 * fill * max_len)
    lo, hi = min_len, max_len
    if twice_mean <= max_len + min_len:
        hi = max(min_len, min(max_len, twice_mean - min_len))
    else:
        lo = max(min_len, min(max_len, twice_mean - max_len))
    rng = SplitMix64(seed ^ 0x6A09E667F3BCC908)
    lens = [lo + rng.below(hi - lo + 1) for _ in range(batch)]
    target = max(min_len * batch, min(max_len * batch, _llround(fill * max_len * batch)))
    diff = target - sum(lens)
    while diff != 0:
        per = int(diff / batch)
        if per == 0:
            per = 1 if diff > 0 else -1
        moved = False
        for i in range(batch):
            if diff == 0:
                break
            want = diff if abs(per) > abs(diff) else per
            nl = max(min_len, min(max_len, lens[i] + want))
            diff -= nl - lens[i]
            moved |= nl != lens[i]
            lens[i] = nl
        if not moved:
            break
    return lens


K_SEED_XOR = 0xA5A5A5A55A5A5A5A  # the binary draws K lengths with seed ^ this


def case_lengths(name, bench_json=None):
    p = PRESETS[name]
    if bench_json:
        for c in bench_json.get("cases", []):
            if c.get("name") == name and isinstance(c["shape"]["lengths_k"].get("values"), list):
                return [p["lq"]] * p["batch"], list(c["shape"]["lengths_k"]["values"])
    lq = [p["lq"]] * p["batch"]
    if isinstance(p["lk"], tuple):
        _, fill, mx = p["lk"]
        lk = jagged_lengths(p["batch"], fill, mx, p["seed"] ^ K_SEED_XOR)
    else:
        lk = [p["lk"]] * p["batch"]
    return lq, lk


def flops(lq, lk, heads, backward):
    return (10.0 if backward else 4.0) * heads * HEAD_DIM * sum(a * b for a, b in zip(lq, lk))


def stats(samples):
    s = sorted(samples)
    n = len(s)
    if n == 0:
        return dict(n=0)
    med = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
    mean = sum(s) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in s) / (n - 1)) if n > 1 else 0.0
    return dict(n=n, median=med, mean=mean, min=s[0], max=s[-1], stdev=sd)


def n_sets_for(set_bytes, l2_bytes):
    n = max(1, -(-2 * l2_bytes // max(set_bytes, 1)))
    if n == 1 and set_bytes < 4 * l2_bytes:
        n = 2
    return int(n)


def log(msg):
    print("[peer_check] " + msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- torch
def torch_time(fn, n_sets, warmup_s, window_s, launches):
    import torch

    counter = [0]

    def nxt():
        i = counter[0] % n_sets
        counter[0] += 1
        return i

    t0 = time.perf_counter()
    warm = 0
    while warm < 2 or time.perf_counter() - t0 < warmup_s:
        fn(nxt())
        warm += 1
        if warm % 4 == 0 or warm < 4:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    samples = []
    m0 = time.perf_counter()
    while True:
        fn(nxt())  # lead launch: the first event lands on a busy stream
        ev = []
        for _ in range(8):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(launches):
                fn(nxt())
            b.record()
            ev.append((a, b))
        ev[-1][1].synchronize()
        samples += [a.elapsed_time(b) / launches for a, b in ev]
        if time.perf_counter() - m0 >= window_s and len(samples) >= 3:
            break
    return samples


def torch_case(name, lq, lk, args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = PRESETS[name]
    B, H, D = p["batch"], p["heads"], HEAD_DIM
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    uniform = len(set(lk)) == 1 and len(set(lq)) == 1
    scale = 1.0 / math.sqrt(D)
    gen = torch.Generator(device=dev).manual_seed(p.get("seed", 1234))
    n_sets = n_sets_for(2 * H * D * (sum(lq) + 2 * sum(lk)), l2)

    def randn(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen)

    def q_leaf():
        if p["broadcast"]:  # what a user does without a broadcast kernel: materialize the shared Q
            return randn(1, lq[0], H, D).expand(B, lq[0], H, D).contiguous().requires_grad_()
        return randn(B, lq[0], H, D).requires_grad_()

    # Each builder returns (method, input sets); a set holds autograd leaves, the SDPA arguments and dO.
    def dense():
        sets = []
        for _ in range(n_sets):
            q0, k0, v0 = q_leaf(), randn(B, lk[0], H, D).requires_grad_(), randn(B, lk[0], H, D).requires_grad_()
            sets.append(dict(leaves=(q0, k0, v0), q=q0.transpose(1, 2), k=k0.transpose(1, 2), v=v0.transpose(1, 2),
                             do=randn(B, lq[0], H, D).transpose(1, 2), mask=None))
        m = "dense BSHD tensors (B,S,H,D).transpose(1,2)"
        return m + ("; broadcast Q materialized B times" if p["broadcast"] else ""), sets

    def njt():
        offs_k = torch.tensor([0] + list(_cumsum(lk)), device=dev, dtype=torch.int64)
        offs_q = torch.tensor([0] + list(_cumsum(lq)), device=dev, dtype=torch.int64)
        sets = []
        for _ in range(n_sets):
            qv = q_leaf().detach().reshape(sum(lq), H, D).requires_grad_()
            kv = randn(sum(lk), H, D).requires_grad_()
            vv = randn(sum(lk), H, D).requires_grad_()
            nt = torch.nested.nested_tensor_from_jagged
            sets.append(dict(leaves=(qv, kv, vv), q=nt(qv, offs_q).transpose(1, 2), k=nt(kv, offs_k).transpose(1, 2),
                             v=nt(vv, offs_k).transpose(1, 2), do=nt(randn(sum(lq), H, D), offs_q).transpose(1, 2),
                             mask=None))
        return "nested jagged tensors (nested_tensor_from_jagged), cuDNN backend", sets

    def padded_mask():
        S = max(lk)
        keep = torch.zeros(B, S, dtype=torch.bool, device=dev)
        for b, n in enumerate(lk):
            keep[b, :n] = True
        mask = keep[:, None, None, :]
        sets = []
        for _ in range(max(1, n_sets_for(2 * H * D * (sum(lq) + 2 * B * S), l2))):
            q0, k0, v0 = q_leaf(), randn(B, S, H, D).requires_grad_(), randn(B, S, H, D).requires_grad_()
            sets.append(dict(leaves=(q0, k0, v0), q=q0.transpose(1, 2), k=k0.transpose(1, 2), v=v0.transpose(1, 2),
                             do=randn(B, lq[0], H, D).transpose(1, 2), mask=mask))
        return ("padded K/V to max Lk=%d + boolean key-padding attn_mask, cuDNN backend (padded work may be "
                "computed; FLOPs count real lengths)" % S, sets)

    out = []
    builders = ([("torch-cudnn-bf16", dense)] if uniform else
                [("torch-cudnn-bf16-njt", njt), ("torch-cudnn-bf16-padded", padded_mask)])
    for peer, build in builders:
        sets = None
        try:
            method, sets = build()

            def fwd(i, sets=sets):
                st = sets[i]
                return F.scaled_dot_product_attention(st["q"], st["k"], st["v"], attn_mask=st["mask"], scale=scale)

            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # cuDNN only: no silent fallback
                torch.autograd.grad(fwd(0), sets[0]["leaves"], sets[0]["do"])
                torch.cuda.synchronize()
                log("%s %s: %s, %d input set(s)" % (name, peer, method, len(sets)))
                for d in ("fwd", "bwd"):
                    if d == "fwd":
                        with torch.no_grad():
                            samples = torch_time(fwd, len(sets), args.warmup_s, args.window_s, args.launches)
                    else:
                        outs = [fwd(i) for i in range(len(sets))]
                        samples = torch_time(
                            lambda i: torch.autograd.grad(outs[i], sets[i]["leaves"], sets[i]["do"],
                                                          retain_graph=True),
                            len(sets), args.warmup_s, args.window_s, args.launches)
                        del outs
                    st = stats(samples)
                    fl = flops(lq, lk, H, d == "bwd")
                    out.append(dict(peer=peer, case=name, direction=d, status="ok", method=method, samples_ms=samples,
                                    stats_ms=st, flops=fl, tflops=fl / (st["median"] * 1e-3) / 1e12,
                                    n_input_sets=len(sets)))
                    log("%s %s %s: median %.4f ms, %.1f TFLOP/s" % (name, d, peer, st["median"], out[-1]["tflops"]))
        except Exception as e:  # noqa: BLE001 - report and go on with the next method
            msg = str(e).strip().splitlines()
            msg = (msg[0] if msg else repr(e))[:300]
            log("%s %s: unavailable: %s" % (name, peer, msg))
            for d in ("fwd", "bwd"):
                if not any(r["peer"] == peer and r["direction"] == d for r in out):
                    out.append(dict(peer=peer, case=name, direction=d, status="unavailable", message=msg))
        sets = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return out


def _cumsum(v):
    s = 0
    for x in v:
        s += x
        yield s


# ---------------------------------------------------------------- JAX (subprocess)
FP8_META_NAMES = ["amax_dQ", "amax_dK", "amax_dV", "amax_dP", "descale_q", "descale_k", "descale_v", "descale_s",
                  "scale_s", "scale_o", "descale_o", "descale_dO", "descale_dP", "scale_dQ", "scale_dK", "scale_dV",
                  "scale_dP"]


def jax_time(fn, n_sets, warmup_s, window_s, launches):
    t0 = time.perf_counter()
    i = 0
    r = None
    while i < 2 or time.perf_counter() - t0 < warmup_s:
        r = fn(i % n_sets)
        i += 1
        if i % 4 == 0:
            _block(r)
    _block(r)
    samples = []
    m0 = time.perf_counter()
    while time.perf_counter() - m0 < window_s or len(samples) < 3:
        a = time.perf_counter()
        for _ in range(launches):
            r = fn(i % n_sets)
            i += 1
        _block(r)
        samples.append((time.perf_counter() - a) * 1e3 / launches)
    return samples


def _block(r):
    import jax

    jax.block_until_ready(r)


def jax_worker(args):
    import jax
    import jax.numpy as jnp

    results = []
    fp8_import_error = ""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType
        from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dpa
    except Exception as e:  # noqa: BLE001
        cudnn_dpa = None
        fp8_import_error = str(e)
    dev = jax.devices()[0]
    l2 = 60 * 1024 * 1024
    for name in args.preset:
        p = PRESETS[name]
        lq, lk = case_lengths(name, args.bench)
        jagged = len(set(lk)) != 1
        B, H, D, Lq, S = p["batch"], p["heads"], HEAD_DIM, lq[0], max(lk)
        scale = 1.0 / math.sqrt(D)
        key = jax.random.key(p.get("seed", 1234))
        # Jagged: padded K/V (B, max Lk, H, D) with per-sequence lengths (cuDNN padding mask).
        qlen = jnp.asarray(lq, jnp.int32)
        klen = jnp.asarray(lk, jnp.int32)
        for peer in ("jax-cudnn-bf16", "jax-cudnn-fp8"):
            fp8 = peer.endswith("fp8")
            ebytes = 1 if fp8 else 2
            n_sets = n_sets_for(ebytes * H * D * (B * Lq + 2 * B * S), l2)
            try:
                if fp8 and cudnn_dpa is None:
                    raise RuntimeError("import: " + fp8_import_error)
                dt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
                sets = []
                for _ in range(n_sets):
                    key, k1, k2, k3, k4 = jax.random.split(key, 5)
                    qs = jax.random.normal(k1, (1 if p["broadcast"] else B, Lq, H, D), jnp.bfloat16)
                    q = jnp.broadcast_to(qs, (B, Lq, H, D)).astype(dt)
                    k = jax.random.normal(k2, (B, S, H, D), jnp.bfloat16).astype(dt)
                    v = jax.random.normal(k3, (B, S, H, D), jnp.bfloat16).astype(dt)
                    do = jax.random.normal(k4, (B, Lq, H, D), jnp.bfloat16).astype(dt)
                    sets.append(tuple(jax.device_put(x, dev) for x in (q, k, v, do)))
                seq_kw = dict(key_value_seq_lengths=klen, query_seq_lengths=qlen) if jagged else {}

                def bf16_attn(q, k, v):
                    return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn", **seq_kw)

                if fp8:
                    metas = {n: jnp.ones((1, 1, 1, 1), jnp.float32) for n in FP8_META_NAMES}
                    fp8_kw = dict(q_seqlen=qlen, kv_seqlen=klen, mask_type=MaskType.PADDING) if jagged else dict(
                        mask_type=MaskType.NO_MASK)

                    def attn(q, k, v):
                        return cudnn_dpa(q, k, v, fp8_params=metas, scale=scale, use_fp8=True, **fp8_kw)

                    def fwd_fn(q, k, v):
                        return attn(q, k, v)[0]

                    def fb_fn(q, k, v, do):
                        out, vjp = jax.vjp(attn, q, k, v)
                        ones = jnp.ones((1, 1, 1, 1), jnp.float32)
                        return vjp((do, ones, ones))
                else:
                    fwd_fn = bf16_attn

                    def fb_fn(q, k, v, do):
                        out, vjp = jax.vjp(bf16_attn, q, k, v)
                        return vjp(do)
                f = jax.jit(fwd_fn)
                fb = jax.jit(fb_fn)
                o = f(*sets[0][:3])
                _block(o)
                method = "jit, BTNH"
                if jagged:
                    method += ", padded K/V to max Lk=%d + cuDNN padding mask from seq lengths" % S
                if p["broadcast"]:
                    method += "; broadcast Q materialized B times"
                check = {}
                if fp8:
                    # Sanity: cosine against JAX's BF16 cuDNN output on the same (FP8-representable) data.
                    qb, kb, vb = (x.astype(jnp.bfloat16) for x in sets[0][:3])
                    ref = jax.jit(bf16_attn)(qb, kb, vb)
                    a = o.astype(jnp.float32).ravel()
                    b = ref.astype(jnp.float32).ravel()
                    check["cos_O_vs_jax_bf16"] = float(jnp.dot(a, b) / jnp.sqrt(jnp.dot(a, a) * jnp.dot(b, b)))
                    method += "; fp8_params all 1.0 (unit scales; inputs normal(0,1) cast to e4m3)"
                    del ref, qb, kb, vb
                if args.jax_per_call:
                    t_f = jax_time(lambda i: f(*sets[i][:3]), n_sets, args.warmup_s, args.window_s, args.launches)
                    t_fb = jax_time(lambda i: fb(*sets[i]), n_sets, args.warmup_s, args.window_s, args.launches)
                else:
                    # One jitted program runs the attention on every input set in turn: one host dispatch
                    # per n_sets kernels, so a short kernel (llm FP8 fwd, ~0.33 ms) is not timed at the
                    # rate the host can dispatch a call with ~20 arguments.
                    f_all = jax.jit(lambda all_sets: [fwd_fn(*x[:3]) for x in all_sets])
                    fb_all = jax.jit(lambda all_sets: [fb_fn(*x) for x in all_sets])
                    _block(f_all(sets))
                    _block(fb_all(sets))
                    t_f = [t / n_sets for t in jax_time(lambda i: f_all(sets), 1, args.warmup_s, args.window_s,
                                                        args.launches)]
                    t_fb = [t / n_sets for t in jax_time(lambda i: fb_all(sets), 1, args.warmup_s, args.window_s,
                                                         args.launches)]
                    method += "; %d input sets per jitted call" % n_sets
                sf, sfb = stats(t_f), stats(t_fb)
                for d, med, smp in (("fwd", sf["median"], t_f), ("bwd", sfb["median"] - sf["median"], t_fb)):
                    fl = flops(lq, lk, H, d == "bwd")
                    r = dict(peer=peer, case=name, direction=d, status="ok", method=method, n_input_sets=n_sets,
                             stats_ms=dict(median=med), flops=fl, tflops=fl / (med * 1e-3) / 1e12 if med > 0 else 0,
                             check=check)
                    if d == "fwd":
                        r["samples_ms"] = smp
                        r["stats_ms"] = sf
                    else:
                        r["fwd_plus_bwd_samples_ms"] = smp
                        r["fwd_plus_bwd_stats_ms"] = sfb
                        r["note"] = "bwd median = median(fwd+bwd) - median(fwd)"
                    results.append(r)
                    log("%s %s %s: median %.4f ms, %.1f TFLOP/s %s" % (name, d, peer, med, r["tflops"],
                                                                       json.dumps(check) if check else ""))
                del sets, o
            except Exception as e:  # noqa: BLE001
                msg = str(e).strip().splitlines()
                msg = (msg[0] if msg else repr(e))[:300]
                log("%s %s: unavailable: %s" % (name, peer, msg))
                for d in ("fwd", "bwd"):
                    results.append(dict(peer=peer, case=name, direction=d, status="unavailable", message=msg))
    with open(args.json_out, "w") as fh:
        json.dump(dict(results=results, jax_version=jax.__version__, device=str(dev)), fh)


# ---------------------------------------------------------------- report
def bench_lookup(bench, case, impl, direction):
    if not bench:
        return None
    for c in bench.get("cases", []):
        if c.get("name") != case:
            continue
        for r in c.get("results", []):
            if r.get("impl") == impl and r.get("direction") == direction and r.get("status") == "ok":
                return r.get("throughput_median")
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="all", help="comma list of llm, llm-long, cross, jagged, or all")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--bench-json", help="mxflash-bench JSON: jagged lengths from it, and a side-by-side column")
    ap.add_argument("--warmup-s", type=float, default=0.5)
    ap.add_argument("--window-s", type=float, default=2.0)
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--jax-per-call", action="store_true",
                    help="time JAX one jitted call per launch (host dispatch included) instead of one call per "
                         "round of input sets")
    ap.add_argument("--no-jax", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--jax-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = ORDER if args.preset == "all" else args.preset.split(",")
    for n in names:
        if n not in PRESETS:
            ap.error("--preset: unknown preset '%s' (expected %s or all)" % (n, ", ".join(ORDER)))
    args.preset = names
    if args.warmup_s < 0 or args.window_s <= 0 or args.launches < 1:
        ap.error("--warmup-s >= 0, --window-s > 0 and --launches >= 1 are required")
    bench = None
    if args.bench_json:
        with open(args.bench_json) as fh:
            bench = json.load(fh)
    args.bench = bench
    if args.jax_worker:
        jax_worker(args)
        return 0

    report = dict(command=" ".join([sys.executable] + sys.argv), results=[], environment={})
    if not args.no_torch:
        import torch

        props = torch.cuda.get_device_properties(0)
        report["environment"].update(
            gpu=props.name, sm_count=props.multi_processor_count, l2_bytes=props.L2_cache_size,
            torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
        log("torch %s, CUDA %s, cuDNN %s on %s" % (torch.__version__, torch.version.cuda,
                                                  torch.backends.cudnn.version(), props.name))
        for n in names:
            lq, lk = case_lengths(n, bench)
            report["results"] += torch_case(n, lq, lk, args)
        del torch
    if not args.no_jax:
        with tempfile.TemporaryDirectory() as td:
            out = os.path.join(td, "jax.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--jax-worker", "--json-out", out,
                   "--preset", ",".join(names), "--warmup-s", str(args.warmup_s), "--window-s", str(args.window_s),
                   "--launches", str(args.launches)]
            if args.bench_json:
                cmd += ["--bench-json", os.path.abspath(args.bench_json)]
            if args.jax_per_call:
                cmd += ["--jax-per-call"]
            env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
            log("JAX worker: " + " ".join(cmd))
            rc = subprocess.call(cmd, env=env)
            if rc == 0 and os.path.exists(out):
                with open(out) as fh:
                    j = json.load(fh)
                report["results"] += j["results"]
                report["environment"]["jax"] = j.get("jax_version")
            else:
                report["results"].append(dict(peer="jax", status="error", message="JAX worker exited with %d" % rc))

    # Table, printed last.
    rows = [("case", "dir", "peer", "median ms", "TFLOP/s", "bench same impl", "status/method")]
    same = {"torch-cudnn-bf16": "cudnn-bf16", "torch-cudnn-bf16-njt": "cudnn-bf16",
            "torch-cudnn-bf16-padded": "cudnn-bf16", "jax-cudnn-bf16": "cudnn-bf16", "jax-cudnn-fp8": "cudnn-fp8"}
    for r in report["results"]:
        if "case" not in r:
            rows.append(("-", "-", r.get("peer", "?"), "", "", "", r.get("status", "") + ": " + r.get("message", "")))
            continue
        if r["status"] != "ok":
            rows.append((r["case"], r["direction"], r["peer"], "", "", "", r["status"] + ": " + r.get("message", "")))
            continue
        b = bench_lookup(bench, r["case"], same.get(r["peer"]), r["direction"])
        ratio = "%.1f (peer/bench %.2fx)" % (b, r["tflops"] / b) if b else ""
        extra = " ".join("%s=%.5f" % kv for kv in r.get("check", {}).items())
        rows.append((r["case"], r["direction"], r["peer"], "%.4f" % r["stats_ms"]["median"], "%.1f" % r["tflops"],
                     ratio, (r.get("method", "")[:60] + (" " + extra if extra else ""))))
    w = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(str(c).ljust(w[i]) if i in (0, 1, 2, 6) else str(c).rjust(w[i])
                               for i, c in enumerate(row)).rstrip())
        if k == 0:
            lines.append("-" * (sum(w) + 2 * (len(w) - 1)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        log("wrote " + args.json)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
