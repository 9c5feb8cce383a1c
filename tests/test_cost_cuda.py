"""`moagen cost --cuda`'s GPU metrics: the SASS loop analysis on a hand-written listing, the
occupancy and wave arithmetic on hand-computed cases, the measured times read from a
bench summary, and one real kernel compiled with nvcc end to end."""
import json
import math

import pytest

from moagen.cli import main
from moagen.cost import gpu_measured, sass
from moagen.cost.gpu import H200, occupancy, waves
from moagen.cost.sass_loops import innermost_loops, loops, summarize

# an outer loop (0x0040-0x0150) around an inner one (0x0070-0x0110), a forward branch out
# of the inner one, and the trap after EXIT (a BRA to itself), as cuobjdump prints them
SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x00000a00ff017b82 */
                                                                                /* 0x000fe20000000800 */
        /*0010*/                   S2R R2, SR_TID.X ;                           /* 0x0000000000027919 */
        /*0020*/                   LDG.E R4, desc[UR4][R2.64] ;                 /* 0x0000000402047981 */
        /*0030*/                   IMAD.MOV.U32 R0, RZ, RZ, RZ ;                /* 0x000000ffff007224 */
        /*0040*/                   LDG.E.128 R8, desc[UR4][R2.64+0x10] ;         /* 0x0000100402087981 */
        /*0050*/                   STS.128 [R5], R8 ;                           /* 0x0000000805007388 */
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                /* 0x0000000000007b1d */
        /*0070*/                   LDS.128 R12, [R6] ;                          /* 0x000000000606c984 */
        /*0080*/                   LDS R16, [R6+0x10] ;                         /* 0x000010000610c984 */
        /*0090*/                   FFMA R20, R12, R16, R20 ;                    /* 0x000000100c147223 */
        /*00a0*/                   FFMA R21, R13, R16, R21 ;                    /* 0x000000100d157223 */
        /*00b0*/                   FFMA R22, R14, R16, R22 ;                    /* 0x000000100e167223 */
        /*00c0*/                   FMUL R23, R15, R16 ;                         /* 0x000000100f177220 */
        /*00d0*/                   FADD R24, R23, R24 ;                         /* 0x0000001817187221 */
        /*00e0*/                   LDG.E R25, desc[UR4][R2.64+0x20] ;           /* 0x0000200402197981 */
        /*00f0*/                   SHFL.BFLY PT, R26, R24, 0x1, 0x1f ;          /* 0x0c201f0018 */
        /*0100*/              @!P1 BRA 0x130 ;                                  /* 0x0000000000209947 */
        /*0110*/               @P0 BRA 0x70 ;                                   /* 0xffffffff00d40947 */
        /*0120*/                   IADD3 R6, R6, 0x20, RZ ;                     /* 0x0000002006067810 */
        /*0130*/                   STG.E desc[UR4][R2.64], R20 ;                /* 0x0000001402007986 */
        /*0140*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R2.64], R21 ; /* 0x0 */
        /*0150*/               @P2 BRA 0x40 ;                                   /* 0xfffffffc00b82947 */
        /*0160*/                   EXIT ;                                       /* 0x000000000000794d */
        /*0170*/                   BRA 0x170;                                   /* 0xfffffffc00fc7947 */
"""


def test_loops_are_backward_branches_and_the_innermost_contains_none():
    assert loops(SASS) == [(0x40, 0x150), (0x70, 0x110)]
    [inner] = innermost_loops(SASS)
    assert (inner.start, inner.end, inner.instructions) == (0x70, 0x110, 11)
    c = inner.counts
    assert (c["FFMA"], c["FMUL"], c["FADD"], c["DFMA"]) == (3, 1, 1, 0)
    assert (c["LDG"], c["STG"], c["LDS"], c["STS"], c["SHFL"], c["BAR"], c["atomics"]) == \
        (1, 0, 2, 0, 1, 0, 0)
    assert (inner.ldg_128, inner.lds_128) == (0, 1)
    assert inner.fma == 3 and inner.fma_per_global_load == 3.0 and inner.fma_per_shared_load == 1.5
    assert (inner.global_loads, inner.global_stores) == (1, 0)


def test_the_outer_loop_counts_what_is_around_the_inner_one():
    """With the inner loop's branch gone the outer loop is the innermost: its vector load,
    barrier, shared store, global store and atomic are counted."""
    [outer] = innermost_loops(SASS.replace("@P0 BRA 0x70", "NOP"))
    c = outer.counts
    assert (outer.start, outer.end, outer.instructions) == (0x40, 0x150, 18)
    assert (c["LDG"], c["STG"], c["STS"], c["BAR"], c["atomics"], c["integer"]) == (2, 1, 1, 1, 1, 1)
    assert (outer.ldg_128, outer.lds_128) == (1, 1)


def test_summary_is_the_loop_with_the_most_fma_and_the_totals():
    second = SASS.replace("/*0160*/                   EXIT", "/*0160*/  @P3 BRA 0x130")
    mixes = innermost_loops(second)
    assert [(m.start, m.end) for m in mixes] == [(0x70, 0x110), (0x130, 0x160)]
    s = summarize(mixes)
    assert s.hot is mixes[0]
    assert s.total.counts["FFMA"] == 3 and s.total.counts["STG"] == 1 and s.total.instructions == 15
    assert summarize([]).hot is None


@pytest.mark.parametrize("threads,registers,shared,blocks,warps,limiter", [
    # 128 registers x 32 lanes = 4096 a warp: 16 warps an SM, 2 blocks of 8 warps
    (256, 128, 0, 2, 16, "registers"),
    # 33 registers: 1056 a warp, allocated 1280: 51 warps, 12 blocks of 4 warps
    (128, 33, 0, 12, 48, "registers"),
    # 100 KB + 1 KB reserved: 2 blocks in 228 KB
    (128, 32, 100 * 1024, 2, 8, "shared"),
    # 1024 threads (32 warps), 16 registers (128 warps' worth): the 64 warp slots hold 2
    (1024, 16, 0, 2, 64, "warps"),
    # a warp a block, few registers: the 32 block slots
    (32, 16, 0, 32, 32, "blocks"),
    # 32 registers, 128 threads: registers and warps both allow 16
    (128, 32, 0, 16, 64, "registers, warps"),
    # more shared memory than a block may have: none
    (128, 32, 228 * 1024, 0, 0, "shared"),
])
def test_occupancy_is_the_least_of_the_limits(threads, registers, shared, blocks, warps, limiter):
    occ = occupancy(threads, registers, shared, H200)
    assert (occ.blocks, occ.warps, occ.limiter) == (blocks, warps, limiter)
    assert occ.fraction == warps / 64


def test_waves_are_blocks_over_the_gpus_resident_blocks():
    assert waves(528, 2) == 2.0
    assert waves(66, 1) == 0.5
    assert math.isinf(waves(10, 0))


SUMMARY = """# Benchmark run 20261204T000000-1

Command: `moagen bench --lang cuda --kernels attention_fwd:online --dtype float32 --size d=64 --n 1024`

| kernel | impl | n | threads | median ms | IQR % |
| --- | --- | --- | --- | --- | --- |
| attention_fwd | online cuda (rows=4 keys=4) | 1024 | 16 | 32.669 | 0 |
| attention_fwd | torch | 1024 | 16 | 0.109 | 1 |

## What each baseline computes

- attention_fwd, torch: O by F.scaled_dot_product_attention; no lse (SDPA returns none)
"""


def test_measured_times_match_kernel_dtype_and_every_size(tmp_path):
    (tmp_path / "bench-summary.md").write_text(SUMMARY)
    sizes = dict(batch=1, heads=4, n=1024, d=64)  # the bench's heads, the run's d
    m = gpu_measured.torch_time("attention_fwd", "float32", sizes, tmp_path)
    assert m.ms == 0.109 and "scaled_dot_product_attention" in m.computes
    assert gpu_measured.torch_time("attention_fwd", "float64", sizes, tmp_path) is None
    assert gpu_measured.torch_time("attention_fwd", "float32", dict(sizes, heads=8), tmp_path) is None
    assert gpu_measured.torch_times(tmp_path / "none") == []



@pytest.mark.skipif(not sass.tools_available(), reason="nvcc or cuobjdump (pip install "
                                               "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm) absent")
def test_cost_cuda_reports_launch_occupancy_loops_and_bound(capsys):
    code = main(["cost", "rmsnorm_fwd", "--variant", "naive", "--cuda", "--json", "--dtype", "float32",
                 "-D", "batch=1", "-D", "n=1000", "-D", "d=64"])
    out, _ = capsys.readouterr()
    assert code == 0
    [call] = json.loads(out)["gpu"]
    assert call["sizes"] == dict(batch=1, n=1000, d=64) and call["gpu"]["sms"] == 132
    assert [k["nest"] for k in call["kernels"]] == ["inv_rms", "z"]
    for k in call["kernels"]:
        assert k["grid"] == [8, 1, 1] and k["blocks"] == 8  # ceil(1000 rows / 128 threads)
        assert k["block"] == [128, 1, 1] and 0 < k["registers"] <= 255
        occ = k["occupancy"]
        assert occ["blocks"] == min(occ["limits"].values()) and occ["warps"] == 4 * occ["blocks"]
        assert k["waves"] == pytest.approx(8 / (132 * occ["blocks"]))
        assert k["loops"] and k["hot_loop"]["global_loads"] > 0
        assert k["bytes"] > 0 and k["bound_s"] >= k["bytes"] / 4.8e12
    inv_rms = call["kernels"][0]
    assert inv_rms["hot_loop"]["fma"] > 0  # the sum of squares
    assert inv_rms["bytes"] == 4 * (1000 * 64 + 1000)  # x read, one number a row written
    assert call["measured"] is None
    code = main(["cost", "rmsnorm_fwd", "--variant", "naive", "--cuda", "--dtype", "float32",
                 "-D", "batch=1", "-D", "n=1000"])  # d from the bench: 1024
    out, _ = capsys.readouterr()
    assert code == 0
    table = out[out.index("CUDA kernels on an H200"):]
    assert "n=1000 d=1024" in table.splitlines()[0]
    assert "blocks/SM" in table and "innermost loops" in table and "no measurement" in table
    row = next(line.split() for line in table.splitlines()
               if line.split()[:1] == ["rmsnorm_fwd_naive_f32_inv_rms"])
    assert row[1:5] == ["inv_rms", "8x1x1", "8", "128x1x1"]
