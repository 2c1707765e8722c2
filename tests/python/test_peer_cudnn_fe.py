"""Pure helpers of scripts/peer_cudnn_fe.py (the cuDNN-frontend Python peer benchmark), on the CPU.

The helpers need neither torch nor a GPU. One test also builds every graph the script times and runs
the frontend's validate() on it; it is skipped where the `cudnn` module (PyPI nvidia-cudnn-frontend)
is not installed, as in CI. The measurement itself runs only on the GPU machine."""
import importlib.util
import math
import os
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))

import peer_check  # noqa: E402
import peer_cudnn_fe as fe  # noqa: E402


def geom(name):
    return fe.geometry(name, *peer_check.case_lengths(name))


def test_peer_jagged_geometry_uses_the_binarys_lengths():
    lq, lk = peer_check.case_lengths("jagged")
    g = geom("jagged")
    assert g["lk"] == peer_check.jagged_lengths(768, 0.5, 16384, 1234 ^ peer_check.K_SEED_XOR)
    assert g["B"] == 768 and g["H"] == 3 and g["D"] == 128 and g["broadcast"] and g["padded"]
    assert g["Sq"] == 512 and g["Skv"] == max(lk) <= 16384
    assert sum(lk) == round(0.5 * 16384 * 768) and min(lk) >= 1


@pytest.mark.parametrize("name,b,h,lq,lk,bcast", [("llm", 8, 16, 2048, 2048, False),
                                                  ("llm-long", 2, 16, 8192, 8192, False),
                                                  ("cross", 64, 3, 512, 16384, True)])
def test_peer_dense_geometry(name, b, h, lq, lk, bcast):
    g = geom(name)
    assert (g["B"], g["H"], g["Sq"], g["Skv"], g["broadcast"], g["padded"]) == (b, h, lq, lk, bcast, False)


def test_peer_geometry_rejects_wrong_batch():
    with pytest.raises(ValueError):
        fe.geometry("llm", [2048] * 7, [2048] * 8)


def test_peer_flops_count_real_lengths():
    g = geom("jagged")
    real = 512 * sum(g["lk"])
    assert fe.case_flops(g, False) == 4 * 3 * 128 * real
    assert fe.case_flops(g, True) == 10 * 3 * 128 * real
    assert fe.case_flops(g, False, padded_work=True) == 4 * 3 * 128 * 768 * 512 * g["Skv"]
    assert fe.case_flops(g, False, padded_work=True) > fe.case_flops(g, False)
    d = geom("llm")
    assert fe.case_flops(d, False) == fe.case_flops(d, False, padded_work=True) == 4 * 16 * 128 * 8 * 2048 * 2048


def test_peer_bshd_layout():
    dims, strides = fe.bshd(2, 3, 5, 128)
    assert dims == (2, 3, 5, 128) and strides == (5 * 3 * 128, 128, 3 * 128, 1)
    assert fe.stats_layout(2, 3, 5) == ((2, 3, 5, 1), (15, 5, 1, 1))


@pytest.mark.parametrize("amax,scale", [(1.0, 32.0), (5.0, 4.0), (8.0, 4.0), (0.01, 512.0), (448.0, 0.0625),
                                        (float("nan"), 32.0), (0.0, 32.0), (float("inf"), 32.0)])
def test_peer_sample_fp8_scale(amax, scale):
    s = fe.sample_fp8_scale(amax)
    assert s == scale
    if math.isfinite(amax) and amax > 0:
        assert amax * s <= 448.0  # the scaled amax fits E4M3


def test_peer_set_bytes_and_set_count():
    l2 = 60 << 20
    j = geom("jagged")
    k = 768 * j["Skv"] * 3 * 128
    assert fe.set_bytes(j, True, False) == 768 * 512 * 384 + 2 * k
    assert fe.set_bytes(j, False, False) == 2 * (768 * 512 * 384 + 2 * k)
    assert fe.choose_n_sets(j, True, True, l2, 140e9) == 1  # one set, each far beyond L2
    llm = geom("llm")
    assert fe.set_bytes(llm, True, False) == 3 * 8 * 2048 * 16 * 128
    assert fe.choose_n_sets(llm, True, False, l2, 140e9) == peer_check.n_sets_for(fe.set_bytes(llm, True, False), l2)
    assert fe.choose_n_sets(llm, True, False, l2, 140e9) >= 2
    per, shared = fe.resident_bytes(llm, False, True)
    assert fe.choose_n_sets(llm, False, True, l2, (shared + 1.5 * per) / 0.6) == 1  # capped by memory


def test_peer_check_sequences():
    assert fe.check_sequences([5, 5, 5]) == [0]
    assert fe.check_sequences([5, 3, 9, 3]) == [0, 1]
    assert fe.check_sequences([2, 3]) == [0]


def test_peer_table_ratio_and_failures():
    bench = {"cases": [{"name": "llm", "results": [
        {"impl": "cudnn-fp8", "direction": "fwd", "status": "ok", "throughput_median": 800.0,
         "notes": {"layout": "dense"}}]}]}
    res = [dict(peer="cudnn-fe-fp8", dtype="fp8", case="llm", direction="fwd", status="ok", plan="eng0",
                stats_ms=dict(median=0.5), tflops=400.0, host_us_per_call=20.0, check={"cos_O_b0": 0.999}),
           dict(peer="cudnn-fe-fp8", dtype="fp8", case="jagged", direction="bwd", status="unavailable",
                message="no plan")]
    out = fe.table(res, bench)
    assert "0.500" in out and "800.0" in out and "cos_O_b0=0.9990" in out and "dense" in out
    assert fe.bench_layout(bench, "llm", "cudnn-fp8", "fwd") == "dense"
    assert fe.bench_layout(bench, "llm", "cudnn-bf16", "fwd") == "" and fe.bench_layout(None, "x", "y", "z") == ""
    assert "unavailable: no plan" in out


def test_peer_parse_args():
    a = fe.parse_args(["--preset", "jagged,llm", "--no-bwd", "--dtypes", "fp8"])
    assert a.preset == ["jagged", "llm"] and a.no_bwd and a.dtypes == ["fp8"]
    assert fe.parse_args([]).preset == peer_check.ORDER
    with pytest.raises(SystemExit):
        fe.parse_args(["--preset", "nope"])


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is None, reason="cudnn (nvidia-cudnn-frontend) not installed")
@pytest.mark.parametrize("name", peer_check.ORDER)
def test_peer_graphs_validate(name):
    import cudnn

    g = geom(name)
    for fp8 in (True, False):
        for build in (fe.build_fwd_graph, fe.build_bwd_graph):
            gr = build(cudnn, None, g, fp8)
            gr.validate()
            uids = {t.uid for t in gr.get_inputs()}
            assert {fe.U.Q, fe.U.K, fe.U.V} <= uids
            assert ({fe.U.SEQ_Q, fe.U.SEQ_KV} <= uids) == g["padded"]
