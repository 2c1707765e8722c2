#!/usr/bin/env python3
"""SASS check of the attention forward kernel's schedule (runs on the CPU, on the compiled library).

The forward's intra-warpgroup overlap (docs/attention.md) computes the softmax of K/V tile j while
the P.V GEMM of tile j-1 is still in flight: in the SASS, every exponential of the tile
(MUFU.EX2) sits between the wait for S alone (`WARPGROUP.DEPBAR.LE gsb0, 0x1`) and the wait for
the P.V (`WARPGROUP.DEPBAR.LE gsb0, 0x0`). Nothing in the source can force ptxas to keep it so: when
register pressure rises, ptxas reuses registers of P(j-1), which the P.V in flight still reads, and
hoists the P.V wait above the softmax. The kernel stays correct and gets ~3% slower (H200,
2026-11-29), so no GPU test notices. This check does. It also checks the main loop (from its top to
its back-edge) for three other silent regressions of the same session: no R2UR on the GEMM issue
path (a warp-uniform value computed in vector registers and moved within 40 instructions before a
wgmma; the loop had 11, removing them gave +3.5%), no local-memory spill (STL/LDL) and no global
load (LDG) inside the loop.

The persistent two-consumer kernel (attention_fwd_kernel2p) runs the same consumers and gets the
same checks.

The three-consumer forward kernel (attention_fwd_kernel3, both its whole-item and its split-part
instantiation, and the persistent attention_fwd_kernel3p) runs each tile in series but for its P.V,
issued in two 64-channel halves whose first is promoted under the second: its main loop must show
that wait for one group behind both halves, and hold no spill, no global load and no R2UR before a
wgmma (160 registers a consumer).

The backward's dQ kernel (attention_bwd_dq_kernel, docs/backward.md) issues S of tile j + 1 right
behind dQ's GEMM of tile j and then waits for the dQ GEMM alone: each of its `WARPGROUP.DEPBAR.LE
gsb0, 0x1` must follow, since the previous wait, the 4 register-A wgmmas of dQ and the 4 SS wgmmas
of S (a wait between them would mean ptxas serialized the two; the issue order was worth 1-2%).

Every attention kernel's innermost loop around a wgmma (its tile loop) must hold no convergence
barrier (BSSY): a function with early returns inlined into the loop (e8m0_to_float in the backward's
dS scales, 2026-11-30) became two branches with their barriers in the math's latency tail and cost
the backward 3-5% (docs/backward.md), with every GPU test still passing.

Usage: check_fwd_schedule.py <libmxflash.a or object>   (needs cuobjdump and nvdisasm: PATH,
$CUOBJDUMP, or the PyPI packages nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm that scripts/setup.sh
installs). Exit 0: every checked kernel overlaps; 1: one does not (its counts are printed).
"""
import os
import re
import shutil
import subprocess
import sys

# Variant bit (src/cuda/attention/attention_fwd_sm90.cu): the overlapped schedule.
OVERLAP = 16
EXPS_PER_TILE = 64  # exponentials per thread and 128-key tile (64 rows x 128 keys / 128 threads)


def find_tool(name):
    env = os.environ.get(name.upper())
    if env and os.path.exists(env):
        return env
    path = shutil.which(name)
    if path:
        return path
    try:  # the PyPI wheels put the binaries under site-packages/nvidia/cu13/bin
        import nvidia  # noqa: F401

        for base in nvidia.__path__:
            cand = os.path.join(base, "cu13", "bin", name)
            if os.path.exists(cand):
                return cand
    except ImportError:
        pass
    return None


def kernels(sass, pattern=r"Function : \S*attention_fwd_kernelILi(\d+)E"):
    """{key: [(address, instruction text)]} of every kernel of a cuobjdump -sass dump whose Function line
    matches `pattern` (key: its first group; by default attention_fwd_kernel<variant>, keyed by variant)."""
    out, cur = {}, None
    for line in sass.splitlines():
        m = re.search(pattern, line)
        if m:
            cur = m.group(1) if not m.group(1).isdigit() else int(m.group(1))
            out[cur] = []
            continue
        if "Function :" in line:
            cur = None
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if cur is not None and m:
            out[cur].append((int(m.group(1), 16), m.group(2)))
    return out


def main_loop(ins, i):
    """Instructions of the innermost loop around instruction i: from the target of a backward branch
    after i (the loop top, at or before i) to that branch, the shortest such span. Branches after the
    function's last EXIT (ptxas's out-of-line mbarrier retry blocks, which jump back into the code)
    are not loops. [] when i is in no loop (e.g. the copy of the loop body that an unrolled-by-two
    loop leaves after it for an odd tile count)."""
    addr = [a for a, _ in ins]
    last_exit = max((j for j, (_, t) in enumerate(ins) if re.search(r"\bEXIT\b", t)), default=len(ins) - 1)
    best = None
    for j in range(i, last_exit):
        m = re.search(r"BRA (0x[0-9a-f]+)", ins[j][1])
        if m and int(m.group(1), 16) <= addr[i] and (best is None or addr[j] - int(m.group(1), 16) < best[1] - best[0]):
            best = (int(m.group(1), 16), addr[j])
    if best is None:
        return []
    return [t for a, t in ins if best[0] <= a <= best[1]]


def r2ur_before_gemm(loop, window=40):
    """R2UR instructions within `window` instructions before a wgmma (QGMMA) of the loop: a
    warp-uniform value (descriptor, barrier id) moved from vector registers on the GEMM issue path."""
    n = 0
    for k, u in enumerate(loop):
        if re.search(r"\bR2UR\b", u) and any("QGMMA" in w for w in loop[k + 1:k + 1 + window]):
            n += 1
    return n


# Spill instructions allowed in a main loop, by kernel, because they lie in a block the common path
# branches around: the staged three-consumer kernel (TMA-store epilogue) keeps one register in local
# memory around pow2i_exact's subnormal case in promote_vtile_apply's slow path (V's tile scale more
# than 64 binades under an earlier tile's, or no power of two; read from its SASS, 2026-11-30). The
# count is pinned: any other count is a problem.
# The same block in its grouped-query form (kVariantGqa, bit 29).
COLD_SPILLS = {"persistent 565329ELb1": 2, "persistent 537436241ELb1": 2}


def loop_problems(name, loop, cold_spills=0):
    """A main loop's R2UR before a wgmma, spills (STL/LDL) and global loads (LDG), one problem per kind
    (a spill count equal to `cold_spills`, COLD_SPILLS' pinned count for the kernel, is none)."""
    spills = sum(1 for u in loop if re.search(r"\b(STL|LDL)\b", u))
    counts = [("R2UR before a wgmma", r2ur_before_gemm(loop)),
              ("local memory (STL/LDL)", 0 if spills == cold_spills else spills),
              ("global load (LDG)", sum(1 for u in loop if re.search(r"\bLDG\b", u)))]
    return [f"{name}: {n} {what} in the main loop ({len(loop)} instructions)" for what, n in counts if n]


def check(variant, ins):
    """Problems of one kernel: each wait for S alone must be followed by a whole tile's
    exponentials before the next wait for everything; its loop must hold no R2UR, spill or
    global load. In a persistent kernel the copy of the loop body that the unrolled-by-two loop
    leaves for an odd tile count lies in the loop over items, not in the tile loop: a loop more
    than twice as long as the shortest one found is that outer loop and is not checked as a main
    loop."""
    problems, found, in_loop = [], 0, 0
    text = [t for _, t in ins]
    waits = [i for i, t in enumerate(text) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in t]
    loops = {i: main_loop(ins, i) for i in waits}
    shortest = min((len(l) for l in loops.values() if l), default=0)
    for i in waits:
        found += 1
        loop = loops[i] if len(loops[i]) <= 2 * shortest else []
        in_loop += bool(loop)
        problems += loop_problems(f"attention_fwd_kernel<{variant}>", loop)
        exps = 0
        for u in text[i + 1:]:
            if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in u:
                break
            exps += "MUFU.EX2" in u
        if exps < EXPS_PER_TILE:
            problems.append(f"attention_fwd_kernel<{variant}>: only {exps} MUFU.EX2 between the wait for S "
                            f"(DEPBAR 0x1, instruction {i}) and the wait for P.V (DEPBAR 0x0); "
                            f"the softmax no longer overlaps the P.V (need >= {EXPS_PER_TILE})")
    if found == 0:
        problems.append(f"attention_fwd_kernel<{variant}>: no wait for S alone (WARPGROUP.DEPBAR.LE gsb0, 0x1)")
    elif in_loop == 0:
        problems.append(f"attention_fwd_kernel<{variant}>: no wait for S alone inside a loop (main loop not found)")
    return problems


def check_dq(name, ins):
    """Problems of one dQ kernel: each wait for one pending group must have, since the previous such
    wait (or the kernel's start), >= 4 register-A wgmmas (dQ's GEMM) and >= 4 shared-memory-only ones
    (S of the next tile); and the wgmmas must not be serialized (a wait behind each: ptxas C7513)."""
    problems, found, last = [], 0, 0
    text = [t for _, t in ins]
    for i, t in enumerate(text):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" not in t:
            continue
        found += 1
        window = [u for u in text[last:i] if "QGMMA" in u]
        rs = sum(1 for u in window if re.search(r"QGMMA\S*\s+R\d+,\s*R\d+,\s*gdesc", u))
        ss = sum(1 for u in window if re.search(r"QGMMA\S*\s+R\d+,\s*gdesc", u))
        if rs < 4 or ss < 4:
            problems.append(f"{name[:60]}: {rs} dQ and {ss} S wgmmas before its wait for one group "
                            f"(instruction {i}); need >= 4 of each (S of the next tile under dQ's GEMM)")
        last = i + 1
    if found == 0:
        problems.append(f"{name[:60]}: no wait for one pending group (WARPGROUP.DEPBAR.LE gsb0, 0x1): "
                        f"S of the next tile no longer runs under dQ's GEMM")
    gemms = sum(1 for t in text if "QGMMA" in t)
    waits = sum(1 for t in text if "WARPGROUP.DEPBAR" in t)
    if waits * 2 > gemms:
        problems.append(f"{name[:60]}: {waits} wgmma waits for {gemms} wgmmas (serialized?)")
    return problems


def check_three(variant, ins):
    """Problems of one three-consumer kernel (attention_fwd_kernel3): its main loop (around the first
    wait for S) must hold no spill (STL/LDL; 160 registers a consumer leave little room), no global
    load, no R2UR before a wgmma, a whole tile's exponentials, and the P.V in two halves: a wait for
    one group preceded, since the previous wait, by the 8 register-A m64n64 wgmmas of both halves
    (the first half is promoted while the second runs; a wait between them would serialize them)."""
    problems = []
    text = [t for _, t in ins]
    waits = [i for i, t in enumerate(text) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in t]
    loop = main_loop(ins, waits[0]) if waits else []
    if not loop:
        return [f"attention_fwd_kernel3<{variant}>: main loop not found"]
    problems += loop_problems(f"attention_fwd_kernel3<{variant}>", loop, COLD_SPILLS.get(variant, 0))
    if sum(1 for u in loop if "MUFU.EX2" in u) < EXPS_PER_TILE:
        problems.append(f"attention_fwd_kernel3<{variant}>: fewer than {EXPS_PER_TILE} MUFU.EX2 in the main loop")
    halves, last = 0, 0
    for k, u in enumerate(loop):
        if "WARPGROUP.DEPBAR" not in u:
            continue
        rs = sum(1 for w in loop[last:k] if re.search(r"QGMMA\.64x64x32\S*\s+R\d+,\s*R\d+,\s*gdesc", w))
        halves += "gsb0, 0x1" in u and rs >= 8
        last = k + 1
    if halves == 0:
        problems.append(f"attention_fwd_kernel3<{variant}>: no wait for one group behind both P.V halves "
                        f"(8 register-A m64n64 wgmmas): the first half's promotion no longer overlaps the second")
    return problems


def convergence_barriers(name, ins):
    """Problems of one kernel: BSSY in the innermost loop around any of its wgmmas (its tile loop).
    Kernels without wgmma (the exact paths, the quantizers) have none to check."""
    if not any("QGMMA" in t for _, t in ins):
        return []
    loops = [loop for i, (_, t) in enumerate(ins) if "QGMMA" in t for loop in [main_loop(ins, i)] if loop]
    if not loops:
        return [f"{name[:70]}: no loop around a wgmma found"]
    tile_loop = min(loops, key=len)
    n = sum(1 for u in tile_loop if re.search(r"\bBSSY\b", u))
    return [f"{name[:70]}: {n} convergence barriers (BSSY) in its tile loop ({len(tile_loop)} instructions)"] if n else []


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if not cuobjdump or not nvdisasm:
        print("check_fwd_schedule: cuobjdump / nvdisasm not found (pip install nvidia-cuda-cuobjdump "
              "nvidia-cuda-nvdisasm, or set $CUOBJDUMP and put nvdisasm on PATH)")
        return 1
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    sass = subprocess.run([cuobjdump, "-sass", sys.argv[1]], capture_output=True, text=True, env=env, check=True).stdout
    ks = kernels(sass)
    checked = {v: ins for v, ins in ks.items() if v & OVERLAP}
    if not checked:
        print(f"check_fwd_schedule: no overlapped attention_fwd_kernel in {sys.argv[1]} (found {sorted(ks)})")
        return 1
    problems = [p for v, ins in sorted(checked.items()) for p in check(v, ins)]
    # The persistent two-consumer kernel (attention_fwd_kernel2p<variant>): the same consumers.
    two_p = {v: ins for v, ins in kernels(sass, r"Function : \S*attention_fwd_kernel2pILi(\d+)E").items() if v & OVERLAP}
    if not two_p:
        problems.append("attention_fwd_kernel2p: not found")
    problems += [p for v, ins in sorted(two_p.items()) for p in check(f"persistent {v}", ins)]
    # attention_fwd_kernel3<variant, parts>: keyed "<variant>ELb<0|1>" (whole items / split parts)
    three = kernels(sass, r"Function : \S*attention_fwd_kernel3ILi(\d+ELb[01])E")
    if not three:
        problems.append("attention_fwd_kernel3: not found")
    # attention_fwd_kernel3p<variant, staged>: keyed "<variant>ELb<0|1>" (direct / TMA-store epilogue)
    persistent = kernels(sass, r"Function : \S*attention_fwd_kernel3pILi(\d+ELb[01])E")
    if not persistent:
        problems.append("attention_fwd_kernel3p: not found")
    three.update({f"persistent {v}": ins for v, ins in persistent.items()})
    for v, ins in sorted(three.items()):
        problems += check_three(v, ins)
    dq = kernels(sass, r"Function : (\S*attention_bwd_dq_kernel\S*)")
    if not dq:
        problems.append("attention_bwd_dq_kernel: not found")
    for name, ins in sorted(dq.items()):
        problems += check_dq(name, ins)
    every = {n: ins for n, ins in kernels(sass, r"Function : (\S*attention_(?:fwd|bwd)_\w*kernel\w*)").items()
             if any("QGMMA" in t for _, t in ins)}
    for name, ins in sorted(every.items()):
        problems += convergence_barriers(name, ins)
    for p in problems:
        print(p)
    print(f"check_fwd_schedule: {len(checked)} forward kernels ({sorted(checked)}), {len(two_p)} persistent "
          f"two-consumer ones, {len(three)} three-consumer "
          f"kernels and {len(dq)} dQ kernels checked, {len(every)} attention kernels' tile loops for "
          f"convergence barriers, "
          f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
