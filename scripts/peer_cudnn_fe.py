#!/usr/bin/env python3
"""Independent cuDNN SDPA peer through the cuDNN frontend Python API (`import cudnn`), on the GPU machine.

What it measures, for the four presets of mxflash-bench (lengths from scripts/peer_check.py, or from
--bench-json, so the jagged lengths are the binary's):
  cudnn-fe-fp8   pygraph.sdpa_fp8 / sdpa_fp8_backward: E4M3 Q, K, V (and O, dO for the backward) with
                 per-tensor descale/scale tensors as cuDNN's FP8 SDPA samples set them (scale =
                 128 / next_pow2(amax) * 0.25, descale = 1 / scale; S: amax 1). amax of Q, K, V, dO from
                 the generated data; amax of O, dP, dQ, dK, dV from calibration executions of the graphs
                 themselves (their Amax outputs), dP first. O, dQ, dK, dV are E4M3 (BF16 outputs of FP8 SDPA
                 need Blackwell).
  cudnn-fe-bf16  pygraph.sdpa / sdpa_backward, BF16.
Both: BSHD storage declared as (B, H, S, D) with strides (S*H*D, D, H*D, 1), attn_scale 1/sqrt(128),
forward with Stats (training forward, as mxflash-bench times it), heuristics mode A, and a cuDNN
*backend* plan (the frontend's own Python "FROST" engines are skipped unless --any-engine).
Broadcast Q (cross, jagged) is materialized B times, outside timing. Jagged: K/V padded to max(Lk)
with per-sequence seq_len_q / seq_len_kv tensors and use_padding_mask=True (cuDNN FP8 rejects ragged
on Hopper); padded rows are zero.

FLOPs count the REAL lengths: fwd 4*H*D*sum(Lq*Lk), bwd 10*H*D*sum(Lq*Lk) (a padded kernel may do
more work than that; its TFLOP/s are then "useful" TFLOP/s, as in mxflash-bench).

Timing: peer_check.torch_time (CUDA events on torch's current stream, which the cuDNN handle is set
to; --launches launches per event pair, warm-up by time, --window-s window, median). Inputs rotate
among enough sets to exceed 2x L2 where memory allows (the set count is capped at what fits in 60% of
free memory; the big padded cases use one set, each far larger than L2: a jagged padded FP8 K or V
alone is 768*16384*3*128 B = 4.8 GB). The host time per execute call is reported too: a value close
to the GPU time means the measurement is host-bound.

Sanity check (outside timing): for two sequences (the first, and the shortest when jagged), head 0,
the first 128 queries, O and dQ are compared (cosine) with a float32 torch reference computed from
the same (dequantized) inputs and the real K/V length.

Usage (the GPU machine has no registry; the wheel travels in .whl/):
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site python3 scripts/peer_cudnn_fe.py [--preset all] [--json out.json]
      [--bench-json bench.json] [--warmup-s 0.3] [--window-s 1.0] [--launches 5] [--no-bwd]
      [--dtypes fp8,bf16] [--any-engine]
"""
import argparse
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_check import (  # noqa: E402  (the binary's presets, lengths, FLOPs and timing protocol)
    HEAD_DIM,
    ORDER,
    PRESETS,
    bench_lookup,
    case_lengths,
    flops,
    n_sets_for,
    stats,
    torch_time,
)

PEER = {"fp8": "cudnn-fe-fp8", "bf16": "cudnn-fe-bf16"}
BENCH_IMPL = {"fp8": "cudnn-fp8", "bf16": "cudnn-bf16"}
CHECK_ROWS = 128


def log(msg):
    print("[peer_cudnn_fe] " + msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- pure helpers (CPU-tested)
def geometry(name, lq, lk):
    """Problem geometry of a preset for given per-sequence lengths; padded when any length differs."""
    p = PRESETS[name]
    if len(lq) != p["batch"] or len(lk) != p["batch"]:
        raise ValueError("%s: %d Q / %d K lengths for batch %d" % (name, len(lq), len(lk), p["batch"]))
    return dict(name=name, B=p["batch"], H=p["heads"], D=HEAD_DIM, Sq=max(lq), Skv=max(lk),
                padded=len(set(lq)) != 1 or len(set(lk)) != 1, broadcast=p["broadcast"],
                lq=list(lq), lk=list(lk))


def bshd(B, H, S, D):
    """(dims, strides) of a contiguous (B, S, H, D) buffer declared to cuDNN as (B, H, S, D)."""
    return (B, H, S, D), (S * H * D, D, H * D, 1)


def stats_layout(B, H, S):
    """(dims, strides) of the float32 softmax stats (B, H, S, 1), contiguous in that order."""
    return (B, H, S, 1), (H * S, S, 1, 1)


def sample_fp8_scale(amax, fudge=0.25, eps=0.0625):
    """Scale factor of cuDNN's FP8 SDPA samples for an E4M3 tensor of the given amax:
    128 (E4M3's largest power of two) / next_pow2(max(amax, eps)) * fudge. Its descale is 1/scale.
    A non-finite or non-positive amax counts as 1."""
    if not isinstance(amax, (int, float)) or not math.isfinite(amax) or amax <= 0:
        amax = 1.0
    return 128.0 / (2.0 ** math.ceil(math.log2(max(amax, eps)))) * fudge


def set_bytes(g, fp8, backward):
    """Bytes one launch reads from its input set, as allocated (padded length when padded)."""
    e, hd = (1 if fp8 else 2), g["H"] * g["D"]
    q, k = g["B"] * g["Sq"] * hd * e, g["B"] * g["Skv"] * hd * e
    if not backward:
        return q + 2 * k
    return 3 * q + 2 * k + g["B"] * g["H"] * g["Sq"] * 4  # Q, O, dO, K, V, Stats


def resident_bytes(g, fp8, backward):
    """(bytes per input set, bytes shared by all sets): per set Q, K, V, O, Stats (+ dO); shared dQ, dK, dV."""
    e, hd = (1 if fp8 else 2), g["H"] * g["D"]
    q, k = g["B"] * g["Sq"] * hd * e, g["B"] * g["Skv"] * hd * e
    per = 2 * q + 2 * k + g["B"] * g["H"] * g["Sq"] * 4 + (q if backward else 0)
    return per, (q + 2 * k if backward else 0)


def choose_n_sets(g, fp8, backward, l2_bytes, free_bytes, frac=0.6):
    """Input sets to rotate: peer_check's rule (> 2x L2), capped by what fits in frac of free memory."""
    want = n_sets_for(set_bytes(g, fp8, backward), l2_bytes)
    per, shared = resident_bytes(g, fp8, backward)
    fit = int((frac * free_bytes - shared) // per) if per > 0 else want
    return max(1, min(want, fit))


def case_flops(g, backward, padded_work=False):
    """FLOPs of the real lengths (padded_work: of the padded rectangle, what a padded kernel may do)."""
    if padded_work:
        return flops([g["Sq"]] * g["B"], [g["Skv"]] * g["B"], g["H"], backward)
    return flops(g["lq"], g["lk"], g["H"], backward)


def check_sequences(lk):
    """Sequences the sanity check looks at: the first, and the shortest when lengths differ."""
    out = [0]
    if len(set(lk)) > 1:
        s = min(range(len(lk)), key=lambda b: lk[b])
        if s != 0:
            out.append(s)
    return out


def bench_layout(bench, case, impl, direction):
    """The cuDNN layout mxflash-bench used for that result (dense, padded or ragged), or ''."""
    for c in (bench or {}).get("cases", []):
        if c.get("name") == case:
            for r in c.get("results", []):
                if r.get("impl") == impl and r.get("direction") == direction:
                    return str((r.get("notes") or {}).get("layout", ""))
    return ""


def table(results, bench):
    """The printed table: one row per (preset, direction, dtype); ratio = our TFLOP/s / the bench's."""
    rows = [("preset", "dir", "dtype", "median ms", "TFLOP/s", "bench TFLOP/s", "peer/bench", "bench layout",
             "host us/call", "check", "plan / status")]
    for r in results:
        dtype = r.get("dtype", "?")
        if r.get("status") != "ok":
            rows.append((r.get("case", "-"), r.get("direction", "-"), dtype, "", "", "", "", "", "", "",
                         "%s: %s" % (r.get("status"), r.get("message", ""))))
            continue
        b = bench_lookup(bench, r["case"], BENCH_IMPL.get(dtype), r["direction"])
        chk = " ".join("%s=%.4f" % kv for kv in sorted(r.get("check", {}).items()))
        rows.append((r["case"], r["direction"], dtype, "%.4f" % r["stats_ms"]["median"], "%.1f" % r["tflops"],
                     "%.1f" % b if b else "", "%.3f" % (r["tflops"] / b) if b else "",
                     bench_layout(bench, r["case"], BENCH_IMPL.get(dtype), r["direction"]) if b else "",
                     "%.0f" % r["host_us_per_call"] if "host_us_per_call" in r else "", chk,
                     r.get("plan", "") + (" HOST-BOUND?" if r.get("host_bound") else "")))
    w = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    left = (0, 1, 2, 7, 9, 10)
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(str(c).ljust(w[i]) if i in left else str(c).rjust(w[i])
                               for i, c in enumerate(row)).rstrip())
        if k == 0:
            lines.append("-" * (sum(w) + 2 * (len(w) - 1)))
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="all", help="comma list of llm, llm-long, cross, jagged, or all")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--bench-json", help="mxflash-bench JSON: jagged lengths from it, and a side-by-side column "
                                         "against its cudnn-fp8 / cudnn-bf16 medians")
    ap.add_argument("--warmup-s", type=float, default=0.3)
    ap.add_argument("--window-s", type=float, default=1.0)
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--dtypes", default="fp8,bf16", help="comma list of fp8, bf16")
    ap.add_argument("--any-engine", action="store_true",
                    help="let the frontend's ranking pick any plan, its Python engines included (default: cuDNN "
                         "backend plans only, what mxflash-bench's C++ graphs run)")
    args = ap.parse_args(argv)
    names = ORDER if args.preset == "all" else args.preset.split(",")
    for n in names:
        if n not in PRESETS:
            ap.error("--preset: unknown preset '%s' (expected %s or all)" % (n, ", ".join(ORDER)))
    args.preset = names
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in args.dtypes:
        if d not in PEER:
            ap.error("--dtypes: unknown dtype '%s' (expected fp8, bf16)" % d)
    if args.warmup_s < 0 or args.window_s <= 0 or args.launches < 1:
        ap.error("--warmup-s >= 0, --window-s > 0 and --launches >= 1 are required")
    return args


# ---------------------------------------------------------------- library loading
def _loaded(fragment):
    out = []
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if fragment in os.path.basename(path) and path not in out:
                    out.append(path)
    except OSError:
        pass
    return out


def import_torch_then_cudnn():
    """torch first (it loads its bundled libcudnn), then the frontend pointed at that same library."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("peer_cudnn_fe: no CUDA device visible to torch")
    torch_cudnn = torch.backends.cudnn.version()  # forces torch's libcudnn to load
    libs = _loaded("libcudnn.so")
    if libs:
        # The frontend dlopens the first libcudnn.so.9 it finds on LD_LIBRARY_PATH (it reads os.environ);
        # name torch's so that exactly one cuDNN lives in the process.
        os.environ["LD_LIBRARY_PATH"] = os.path.dirname(libs[0]) + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")
    if torch.version.cuda and "CUDNN_FRONTEND_CUDART_LIB_NAME" not in os.environ:
        # The frontend dlopens libcudart.so.12 or .13 by itself; take torch's (already loaded, found by soname).
        os.environ["CUDNN_FRONTEND_CUDART_LIB_NAME"] = "libcudart.so.%s" % torch.version.cuda.split(".")[0]
    import cudnn

    fe_version = getattr(cudnn, "__version__", "?")
    backend = cudnn.backend_version()
    log("torch %s (CUDA %s, cuDNN %s); cudnn-frontend %s at %s; cudnn.backend_version() = %s (%s)"
        % (torch.__version__, torch.version.cuda, torch_cudnn, fe_version, os.path.dirname(cudnn.__file__), backend,
           cudnn.backend_version_string()))
    after = _loaded("libcudnn.so")
    log("libcudnn loaded: %s; CUDNN_FRONTEND_CUDART_LIB_NAME=%s; libcudart loaded: %s" % (
        ", ".join(after), os.environ.get("CUDNN_FRONTEND_CUDART_LIB_NAME", ""), ", ".join(_loaded("libcudart.so"))))
    if torch_cudnn and backend != torch_cudnn:
        log("WARNING: the frontend's cuDNN (%s) is not torch's (%s)" % (backend, torch_cudnn))
    return torch, cudnn, dict(torch=torch.__version__, cuda=torch.version.cuda, torch_cudnn=torch_cudnn,
                              cudnn_frontend=fe_version, cudnn_backend=backend,
                              cudnn_backend_string=cudnn.backend_version_string(), libcudnn=after)


# ---------------------------------------------------------------- graphs
class U:
    """Tensor uids (variant-pack keys)."""
    Q, K, V, O, STATS, DO, DQ, DK, DV, SEQ_Q, SEQ_KV = range(1, 12)


FWD_IN = ["descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"]
FWD_OUT = ["amax_s", "amax_o"]
BWD_IN = ["descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP", "scale_s",
          "scale_dQ", "scale_dK", "scale_dV", "scale_dP"]
BWD_OUT = ["amax_dQ", "amax_dK", "amax_dV", "amax_dP"]
SCALARS = sorted(set(FWD_IN + FWD_OUT + BWD_IN + BWD_OUT))
SUID = {n: 100 + i for i, n in enumerate(SCALARS)}  # scalar uids


def _scalar(gr, cudnn, name):
    return gr.tensor(name=name, uid=SUID[name], dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT)


def _set_scalar_out(t, cudnn, name):
    t.set_output(True).set_uid(SUID[name]).set_name(name).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)) \
        .set_data_type(cudnn.data_type.FLOAT)


def _common(gr, cudnn, g, dt, backward):
    qd, qs = bshd(g["B"], g["H"], g["Sq"], g["D"])
    kd, ks = bshd(g["B"], g["H"], g["Skv"], g["D"])
    t = dict(q=gr.tensor(name="Q", uid=U.Q, dim=qd, stride=qs, data_type=dt),
             k=gr.tensor(name="K", uid=U.K, dim=kd, stride=ks, data_type=dt),
             v=gr.tensor(name="V", uid=U.V, dim=kd, stride=ks, data_type=dt))
    if backward:
        sd, ss = stats_layout(g["B"], g["H"], g["Sq"])
        t["o"] = gr.tensor(name="O", uid=U.O, dim=qd, stride=qs, data_type=dt)
        t["dO"] = gr.tensor(name="dO", uid=U.DO, dim=qd, stride=qs, data_type=dt)
        t["stats"] = gr.tensor(name="Stats", uid=U.STATS, dim=sd, stride=ss, data_type=cudnn.data_type.FLOAT)
    kw = dict(attn_scale=1.0 / math.sqrt(g["D"]))
    if g["padded"]:
        mk = lambda n, u: gr.tensor(name=n, uid=u, dim=(g["B"], 1, 1, 1), stride=(1, 1, 1, 1),  # noqa: E731
                                    data_type=cudnn.data_type.INT32)
        kw.update(use_padding_mask=True, seq_len_q=mk("seq_len_q", U.SEQ_Q), seq_len_kv=mk("seq_len_kv", U.SEQ_KV))
    return t, kw, (qd, qs), (kd, ks)


def build_fwd_graph(cudnn, handle, g, fp8, declare_amax_s=False):
    dt = cudnn.data_type.FP8_E4M3 if fp8 else cudnn.data_type.BFLOAT16
    gr = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                       compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    t, kw, (qd, qs), _ = _common(gr, cudnn, g, dt, False)
    kw["generate_stats"] = True
    if fp8:
        sc = {n: _scalar(gr, cudnn, n) for n in FWD_IN}
        o, st, amax_s, amax_o = gr.sdpa_fp8(q=t["q"], k=t["k"], v=t["v"], name="sdpa_fp8_fwd", **sc, **kw)
        _set_scalar_out(amax_o, cudnn, "amax_o")
        if declare_amax_s:  # deprecated output; only when the backend wants it (see build_plan's retry)
            _set_scalar_out(amax_s, cudnn, "amax_s")
    else:
        o, st = gr.sdpa(q=t["q"], k=t["k"], v=t["v"], name="sdpa_fwd", **kw)
    o.set_output(True).set_uid(U.O).set_name("O").set_dim(qd).set_stride(qs).set_data_type(dt)
    sd, ss = stats_layout(g["B"], g["H"], g["Sq"])
    st.set_output(True).set_uid(U.STATS).set_name("Stats").set_dim(sd).set_stride(ss) \
        .set_data_type(cudnn.data_type.FLOAT)
    return gr


def build_bwd_graph(cudnn, handle, g, fp8):
    dt = cudnn.data_type.FP8_E4M3 if fp8 else cudnn.data_type.BFLOAT16
    gr = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                       compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    t, kw, (qd, qs), (kd, ks) = _common(gr, cudnn, g, dt, True)
    if fp8:
        sc = {n: _scalar(gr, cudnn, n) for n in BWD_IN}
        dq, dk, dv, a_dq, a_dk, a_dv, a_dp = gr.sdpa_fp8_backward(
            q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=t["stats"], name="sdpa_fp8_bwd", **sc, **kw)
        for tt, n in ((a_dq, "amax_dQ"), (a_dk, "amax_dK"), (a_dv, "amax_dV"), (a_dp, "amax_dP")):
            _set_scalar_out(tt, cudnn, n)
    else:
        dq, dk, dv = gr.sdpa_backward(q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=t["stats"],
                                      name="sdpa_bwd", **kw)
    dq.set_output(True).set_uid(U.DQ).set_name("dQ").set_dim(qd).set_stride(qs).set_data_type(dt)
    dk.set_output(True).set_uid(U.DK).set_name("dK").set_dim(kd).set_stride(ks).set_data_type(dt)
    dv.set_output(True).set_uid(U.DV).set_name("dV").set_dim(kd).set_stride(ks).set_data_type(dt)
    return gr


def build_plan(cudnn, gr, any_engine):
    """validate -> operation graph -> heuristics (mode A) -> the first plan that builds, among the cuDNN
    backend's plans unless any_engine. Returns (plan index, plan name, workspace bytes)."""
    from cudnn.engines.engine_ids import is_python_engine

    gr.validate()
    gr.build_operation_graph()
    gr.create_execution_plans([cudnn.heur_mode.A])
    plans = list(gr.plans)
    names = []
    for i in range(len(plans)):
        try:
            names.append(gr.get_plan_name_at_index(i))
        except Exception as e:  # noqa: BLE001
            names.append("?(%s)" % str(e).splitlines()[0][:80] if str(e) else "?")
    if any_engine:
        gr.check_support()
        gr.build_plans()
        i = getattr(gr, "_plan_index", 0)
        return i, names[i] if i < len(names) else "?", int(gr.get_workspace_size())
    backend = [i for i, c in enumerate(plans) if not is_python_engine(c.engine_id)]
    skipped = [names[i] for i in range(len(plans)) if i not in backend]
    if skipped:
        log("  skipping frontend Python-engine plans: " + ", ".join(skipped))
    if not backend:
        raise RuntimeError("no cuDNN backend plan in the ranked list (only Python engines: %s); --any-engine "
                           "would run those" % ", ".join(names))
    errors = []
    for i in backend:
        try:
            gr.select_plan(i)
            gr.check_support()
            gr.build_plans()
            return i, names[i], int(gr.get_workspace_size())
        except Exception as e:  # noqa: BLE001 - a decline: try the next backend plan
            errors.append("[%d] %s: %s" % (i, names[i], (str(e).strip().splitlines() or [repr(e)])[0][:200]))
    raise RuntimeError("no backend plan built: " + " | ".join(errors))


# ---------------------------------------------------------------- data
class Case:
    """Input sets, outputs and variant packs of one (preset, dtype)."""

    def __init__(self, torch, g, fp8, backward, n_sets, seed, amax_s=False):
        self.torch, self.g, self.fp8, self.backward, self.amax_s = torch, g, fp8, backward, amax_s
        dev = torch.device("cuda")
        self.dev = dev
        self.gen = torch.Generator(device=dev).manual_seed(seed)
        self.dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
        B, H, D, Sq, Skv = g["B"], g["H"], g["D"], g["Sq"], g["Skv"]
        if g["padded"]:
            self.seq_q = torch.tensor(g["lq"], dtype=torch.int32, device=dev).view(B, 1, 1, 1)
            self.seq_kv = torch.tensor(g["lk"], dtype=torch.int32, device=dev).view(B, 1, 1, 1)
        self.sets = []
        for _ in range(n_sets):
            st = dict(sc={n: torch.ones((1, 1, 1, 1), dtype=torch.float32, device=dev) for n in SCALARS})
            st["q"] = self._tensor(st, "descale_q", (B, Sq, H, D), g["lq"], shared=g["broadcast"])
            st["k"] = self._tensor(st, "descale_k", (B, Skv, H, D), g["lk"])
            st["v"] = self._tensor(st, "descale_v", (B, Skv, H, D), g["lk"])
            if backward:
                st["dO"] = self._tensor(st, "descale_dO", (B, Sq, H, D), g["lq"])
            st["o"] = torch.zeros((B, Sq, H, D), dtype=self.dt, device=dev)
            st["stats"] = torch.zeros((B, H, Sq, 1), dtype=torch.float32, device=dev)
            if fp8:
                s_scale = sample_fp8_scale(1.0)  # S = softmax probabilities: amax 1, as in the samples
                st["sc"]["scale_s"].fill_(s_scale)
                st["sc"]["descale_s"].fill_(1.0 / s_scale)
            self.sets.append(st)
        if backward:
            self.dq = torch.zeros((B, Sq, H, D), dtype=self.dt, device=dev)
            self.dk = torch.zeros((B, Skv, H, D), dtype=self.dt, device=dev)
            self.dv = torch.zeros((B, Skv, H, D), dtype=self.dt, device=dev)

    def _tensor(self, st, descale_name, shape, lengths, shared=False):
        """normal(0, 1) data, rows past each sequence's length zero; FP8: quantized with the sample scale of
        its amax (descale stored in the set's scalar)."""
        torch = self.torch
        B, S = shape[0], shape[1]
        step = max(1, (1 << 28) // max(1, math.prod(shape[1:])))  # sequences per chunk: ~1 GiB of float32
        if shared:  # one Q sequence for all B (broadcast), materialized
            x = torch.randn((1,) + tuple(shape[1:]), dtype=torch.bfloat16, device=self.dev, generator=self.gen)
            x = x.expand(shape).contiguous()
        else:
            x = torch.empty(shape, dtype=torch.bfloat16, device=self.dev)
            for i in range(0, B, step):  # chunks: no single > 2^32-element random fill
                x[i:i + step].normal_(generator=self.gen)
        for b, n in enumerate(lengths):
            if n < S:
                x[b, n:].zero_()
        if not self.fp8:
            return x
        amax = torch.stack([x[i:i + step].abs().amax() for i in range(0, B, step)]).max().float().item()
        scale = sample_fp8_scale(amax)
        out = torch.empty(shape, dtype=self.dt, device=self.dev)
        for i in range(0, B, step):
            out[i:i + step] = (x[i:i + step].float() * scale).to(self.dt)
        del x
        st["sc"][descale_name].fill_(1.0 / scale)
        return out

    def _view(self, t):  # (B, S, H, D) buffer as the declared (B, H, S, D)
        return t.permute(0, 2, 1, 3)

    def fwd_pack(self, i):
        st = self.sets[i]
        p = {U.Q: self._view(st["q"]), U.K: self._view(st["k"]), U.V: self._view(st["v"]), U.O: self._view(st["o"]),
             U.STATS: st["stats"]}
        if self.g["padded"]:
            p[U.SEQ_Q], p[U.SEQ_KV] = self.seq_q, self.seq_kv
        if self.fp8:
            p.update({SUID[n]: st["sc"][n] for n in FWD_IN + ["amax_o"] + (["amax_s"] if self.amax_s else [])})
        return p

    def bwd_pack(self, i):
        st = self.sets[i]
        p = {U.Q: self._view(st["q"]), U.K: self._view(st["k"]), U.V: self._view(st["v"]), U.O: self._view(st["o"]),
             U.DO: self._view(st["dO"]), U.STATS: st["stats"], U.DQ: self._view(self.dq), U.DK: self._view(self.dk),
             U.DV: self._view(self.dv)}
        if self.g["padded"]:
            p[U.SEQ_Q], p[U.SEQ_KV] = self.seq_q, self.seq_kv
        if self.fp8:
            p.update({SUID[n]: st["sc"][n] for n in BWD_IN + BWD_OUT})
        return p

    def scalar(self, i, name):
        return float(self.sets[i]["sc"][name].item())

    def set_scalar(self, i, name, v):
        self.sets[i]["sc"][name].fill_(v)

    def deq(self, t, descale):
        return t.float() * descale if self.fp8 else t.float()

    def check(self, i, rows=CHECK_ROWS, with_dq=False):
        """cosine of O (and dQ) against a float32 reference on head 0, the first `rows` queries."""
        torch = self.torch
        st, g = self.sets[i], self.g
        sc = (lambda n: self.scalar(i, n)) if self.fp8 else (lambda n: 1.0)
        out = {}
        for b in check_sequences(g["lk"]):
            r, n = min(rows, g["lq"][b]), g["lk"][b]
            q = self.deq(st["q"][b, :r, 0], sc("descale_q")).requires_grad_(with_dq)
            k = self.deq(st["k"][b, :n, 0], sc("descale_k"))
            v = self.deq(st["v"][b, :n, 0], sc("descale_v"))
            p = torch.softmax((q @ k.t()) / math.sqrt(g["D"]), dim=-1)
            o = p @ v
            got = self.deq(st["o"][b, :r, 0], 1.0 / sc("scale_o") if self.fp8 else 1.0)
            out["cos_O_b%d" % b] = _cos(torch, got, o.detach())
            if with_dq:
                do = self.deq(st["dO"][b, :r, 0], sc("descale_dO"))
                (dq_ref,) = torch.autograd.grad(o, q, do)
                got_dq = self.deq(self.dq[b, :r, 0], 1.0 / sc("scale_dQ") if self.fp8 else 1.0)
                out["cos_dQ_b%d" % b] = _cos(torch, got_dq, dq_ref)
        return out


def _cos(torch, a, b):
    a, b = a.double().flatten(), b.double().flatten()
    d = float(torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b))
    return float(torch.dot(a, b)) / d if d > 0 else float("nan")


# ---------------------------------------------------------------- measurement

def _calibrate(torch, case, i, name, amax_key, run):
    """Sets scale_<name> / descale_<name> of input set i from the graph's own amax output, then runs again."""
    torch.cuda.synchronize()
    s = sample_fp8_scale(case.scalar(i, amax_key))
    case.set_scalar(i, "scale_" + name, s)
    case.set_scalar(i, "descale_" + name, 1.0 / s)
    run(i)

def _time(torch, fn, n_sets, args):
    """peer_check.torch_time, plus the median host time of one execute call (warm-up calls included)."""
    host = []

    def timed(i):
        t = time.perf_counter()
        fn(i)
        host.append(time.perf_counter() - t)

    samples = torch_time(timed, n_sets, args.warmup_s, args.window_s, args.launches)
    return samples, 1e6 * stats(host)["median"]


def _first_line(e):
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return (lines[0] if lines else repr(e))[:400]


def run_case(torch, cudnn, handle, name, dtype, args, env):
    fp8 = dtype == "fp8"
    peer = PEER[dtype]
    lq, lk = case_lengths(name, args.bench)
    g = geometry(name, lq, lk)
    backward = not args.no_bwd
    dirs = ["fwd"] + (["bwd"] if backward else [])
    results = []
    base = dict(peer=peer, case=name, dtype=dtype)

    def fail(direction, status, msg):
        results.append(dict(base, direction=direction, status=status, message=msg))

    t0 = time.perf_counter()
    method = "cudnn-frontend pygraph.%s, BSHD (B,H,S,D) strides (S*H*D,D,H*D,1), generate_stats" % (
        "sdpa_fp8" if fp8 else "sdpa")
    if g["padded"]:
        method += ("; padded K/V to max Lk=%d + use_padding_mask with seq_len_q/seq_len_kv (padded work may be "
                   "computed; FLOPs count real lengths)" % g["Skv"])
    if g["broadcast"]:
        method += "; broadcast Q materialized B times"
    # Graphs first: a refusal costs no allocation.
    try:
        fwd_g, info, amax_s = None, None, False
        for declare in ([False, True] if fp8 else [False]):
            try:
                fwd_g = build_fwd_graph(cudnn, handle, g, fp8, declare_amax_s=declare)
                info = build_plan(cudnn, fwd_g, args.any_engine)
                amax_s = declare
                if declare:
                    method += "; Amax_S declared as an output (the backend refused the graph without it)"
                break
            except Exception as e:  # noqa: BLE001
                if declare or not fp8:
                    raise
                log("%s %s fwd: graph without Amax_S output refused (%s); retrying with it declared"
                    % (name, peer, _first_line(e)))
        fwd_plan, fwd_ws = info[1], info[2]
    except Exception as e:  # noqa: BLE001
        log("%s %s: forward graph unavailable: %s" % (name, peer, _first_line(e)))
        traceback.print_exc(file=sys.stderr)
        for d in dirs:
            fail(d, "unavailable", "forward graph: " + _first_line(e))
        return results
    bwd_g = bwd_err = None
    bwd_plan, bwd_ws = "", 0
    if backward:
        try:
            bwd_g = build_bwd_graph(cudnn, handle, g, fp8)
            _, bwd_plan, bwd_ws = build_plan(cudnn, bwd_g, args.any_engine)
        except Exception as e:  # noqa: BLE001
            bwd_g, bwd_err = None, _first_line(e)
            log("%s %s: backward graph unavailable: %s" % (name, peer, bwd_err))
            traceback.print_exc(file=sys.stderr)
    log("%s %s: plans fwd '%s' (workspace %d B)%s; graphs built in %.1f s"
        % (name, peer, fwd_plan, fwd_ws, (", bwd '%s' (workspace %d B)" % (bwd_plan, bwd_ws)) if bwd_g else "",
           time.perf_counter() - t0))

    case = None
    try:
        free, _ = torch.cuda.mem_get_info()
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        n_sets = choose_n_sets(g, fp8, bwd_g is not None, l2, free)
        want = n_sets_for(set_bytes(g, fp8, bwd_g is not None), l2)
        t1 = time.perf_counter()
        case = Case(torch, g, fp8, bwd_g is not None, n_sets, PRESETS[name].get("seed", 1234), amax_s=amax_s)
        ws = torch.empty(max(1, fwd_ws, bwd_ws), dtype=torch.uint8, device="cuda")
        log("%s %s: %d input set(s) of %.2f GB read per launch (L2 %d MB; %d wanted for > 2x L2)%s; data in %.1f s"
            % (name, peer, n_sets, set_bytes(g, fp8, bwd_g is not None) / 1e9, l2 >> 20, want,
               "" if n_sets >= want else " -- capped by memory", time.perf_counter() - t1))
        sets_note = "%d input set(s)%s" % (n_sets, "" if n_sets >= want else " (fewer than > 2x L2 wants: memory; "
                                                                               "each set is far larger than L2)")
        fpacks = [case.fwd_pack(i) for i in range(n_sets)]

        def fwd(i):
            fwd_g.execute(fpacks[i], ws, handle=handle)

        # Forward: FP8 calibration of scale_o from the graph's own Amax_O (scale_o = 1 first).
        for i in range(n_sets):
            fwd(i)
            if fp8:
                _calibrate(torch, case, i, "o", "amax_o", fwd)
        torch.cuda.synchronize()
        chk = case.check(0)
        scales = {n: case.scalar(0, n) for n in SCALARS} if fp8 else {}
        log("%s %s fwd check: %s" % (name, peer, json.dumps(chk)))
        samples, host_us = _time(torch, fwd, n_sets, args)
        results.append(_result(base, "fwd", g, samples, host_us, fwd_plan, method + "; " + sets_note, n_sets, chk,
                               scales))
        log("%s fwd %s: median %.4f ms, %.1f TFLOP/s, host %.0f us/call"
            % (name, peer, results[-1]["stats_ms"]["median"], results[-1]["tflops"], host_us))

        if backward and bwd_g is None:
            fail("bwd", "unavailable", "backward graph: " + (bwd_err or "?"))
        elif backward:
            bpacks = [case.bwd_pack(i) for i in range(n_sets)]

            def bwd(i):
                bwd_g.execute(bpacks[i], ws, handle=handle)

            for i in range(n_sets):
                bwd(i)
                if fp8:  # dP's scale first (dQ, dK come from the quantized dS), then dQ, dK, dV's
                    _calibrate(torch, case, i, "dP", "amax_dP", bwd)
                    torch.cuda.synchronize()
                    for n in ("dQ", "dK", "dV"):
                        case.set_scalar(i, "scale_" + n, sample_fp8_scale(case.scalar(i, "amax_" + n)))
            bwd(0)  # set 0 last, with its final scales, for the check
            torch.cuda.synchronize()
            chk = case.check(0, with_dq=True)
            scales = {n: case.scalar(0, n) for n in SCALARS} if fp8 else {}
            log("%s %s bwd check: %s" % (name, peer, json.dumps(chk)))
            samples, host_us = _time(torch, bwd, n_sets, args)
            results.append(_result(base, "bwd", g, samples, host_us, bwd_plan, method + "; " + sets_note, n_sets,
                                   chk, scales))
            log("%s bwd %s: median %.4f ms, %.1f TFLOP/s, host %.0f us/call"
                % (name, peer, results[-1]["stats_ms"]["median"], results[-1]["tflops"], host_us))
    except Exception as e:  # noqa: BLE001 - report and go on with the next case
        log("%s %s: error: %s" % (name, peer, _first_line(e)))
        traceback.print_exc(file=sys.stderr)
        for d in dirs:
            if not any(r["direction"] == d for r in results):
                fail(d, "error", _first_line(e))
    finally:
        case = fpacks = bpacks = ws = None  # noqa: F841
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - a sticky CUDA error: the next cases will say so too
            log("after %s %s: %s" % (name, peer, _first_line(e)))
    return results


def _result(base, direction, g, samples, host_us, plan, method, n_sets, check, scales):
    st = stats(samples)
    fl = case_flops(g, direction == "bwd")
    r = dict(base, direction=direction, status="ok", plan=plan, method=method, samples_ms=samples, stats_ms=st,
             flops=fl, tflops=fl / (st["median"] * 1e-3) / 1e12, n_input_sets=n_sets, host_us_per_call=host_us,
             host_bound=host_us * 1e-3 >= 0.8 * st["median"], check=check)
    if g["padded"]:
        pf = case_flops(g, direction == "bwd", padded_work=True)
        r["padded_rect_flops"] = pf
        r["padded_rect_tflops"] = pf / (st["median"] * 1e-3) / 1e12
    if scales:
        r["fp8_scales_set0"] = scales
    return r


def main(argv=None):
    args = parse_args(argv)
    args.bench = None
    if args.bench_json:
        with open(args.bench_json) as fh:
            args.bench = json.load(fh)
    t0 = time.perf_counter()
    torch, cudnn, env = import_torch_then_cudnn()
    props = torch.cuda.get_device_properties(0)
    env.update(gpu=props.name, sm_count=props.multi_processor_count, l2_bytes=props.L2_cache_size)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)  # the stream torch_time's events are on
    report = dict(command=" ".join([sys.executable] + sys.argv), environment=env, results=[])
    for name in args.preset:
        for dtype in args.dtypes:
            report["results"] += run_case(torch, cudnn, handle, name, dtype, args, env)
    report["wall_s"] = time.perf_counter() - t0
    log("done in %.0f s" % report["wall_s"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        log("wrote " + args.json)
    print(table(report["results"], args.bench))
    # Refusals are results (reported above), not failures; only a run that measured nothing fails.
    return 0 if any(r.get("status") == "ok" for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
