"""GpuBlocks, a thread block per iteration (moagen.steps.loop.gpu_blocks): what it marks, what it
refuses, and what the CUDA printer makes of it. That the printed kernels compute the same
values with a block's threads running at once is checked by the emulation
(tests/test_cuda_emulation.py runs rmsnorm_fwd dnf and the block that calls it)."""
from dataclasses import replace

import numpy as np
import pytest
import sympy

from moagen import reference, reference_block
from moagen.targets.cuda.printer import emit_cuda
from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.interpret import run_onf
from moagen.onf.loops import ONF, Buffer, Let, Loop, Nest, Store, Update, walk
from moagen.steps.loop.gpu_blocks import GpuBlocks
from moagen.pipeline import onf_of


def test_a_row_per_block_keeps_the_value_and_marks_the_loops():
    onf = onf_of("rmsnorm_fwd", "dnf", target="cuda")
    rng = np.random.default_rng(0)
    x, weight = rng.standard_normal((2, 3, 37)), rng.standard_normal(37)
    got = run_onf(onf, {"x": x, "weight": weight}, {"eps": 1e-5})  # sequentially: one thread
    z, inv_rms = reference_block.rmsnorm_fwd_numpy(x, weight, eps=1e-5)
    np.testing.assert_allclose(got["z"], z, rtol=1e-13)
    np.testing.assert_allclose(got["inv_rms"], inv_rms, rtol=1e-13)
    loops = [s for s in walk(onf.nests[0].body) if isinstance(s, Loop)]
    assert loops[0].per_block and loops[0].parallel == 2 and loops[0].threads == 256
    assert [lp.var.name for lp in loops if lp.across_threads] == ["c", "c"]


def test_flash_decoding_a_block_per_slice_keeps_the_value():
    onf = onf_of("attention_decode", "split", target="cuda")
    heads = [n.body[0] for n in onf.nests]
    assert [lp.per_block for lp in heads] == [True, True] and [lp.parallel for lp in heads] == [3, 2]
    rng = np.random.default_rng(1)
    q, K, V = rng.standard_normal((1, 6, 5)), *rng.standard_normal((2, 1, 2, 40, 5))
    scalars = {"scale": 0.3, "n": 37}
    got = run_onf(onf, {"q": q, "K": K, "V": V}, scalars)
    O, lse = reference.attention_decode_numpy(q, K, V, **scalars)
    np.testing.assert_allclose(got["O"], O, rtol=1e-13)
    np.testing.assert_allclose(got["lse"], lse, rtol=1e-13)


def test_the_printer_reduces_across_the_block_and_orders_thread_0s_store():
    source = emit_cuda([("float64", onf_of("rmsnorm_fwd", "dnf", target="cuda"))], ["test"])
    body = source[source.index("const int64_t blk = blockIdx.x;"):]
    body = body[:body.index("\n}\n")]
    order = ["for (int64_t c = threadIdx.x; c < d; c += blockDim.x)",
             "sum_sq = moagen_block_reduce(sum_sq, moagen_sum());",
             "if (threadIdx.x == 0) {", "inv_rms[b*n + i] =",
             "__syncthreads();",  # before the other threads read inv_rms
             "z[c + d*(b*n + i)] ="]
    positions = [body.index(text) for text in order]
    assert positions == sorted(positions)
    assert body.count("__syncthreads();") == 1  # the reduction brings its own
    reduction = source[source.index("__device__ T moagen_block_reduce"):]
    # a warp's lanes by shuffles, then a value a warp through shared memory: two barriers
    assert "__shfl_xor_sync(0xffffffffu, value, lane_mask)" in reduction
    assert reduction[:reduction.index("\n}\n")].count("__syncthreads();") == 2
    assert ("MOAGEN_LAUNCH(rmsnorm_fwd_dnf_f64_rows, dim3((unsigned int)count), "
            "dim3((unsigned int)threads), 0, stream") in source
    assert "__device__ T moagen_block_reduce(T value, Combine combine)" in source


# A nest written by hand: for b: y[b, ...] from a loop over c, one rule broken per case.
B, C = sympy.symbols("batch width", integer=True, positive=True)
b, c = sympy.symbols("b c", integer=True)
X = S.Access("x", (b, c))


def _nest(*inner):
    body = (Loop(b, sympy.Integer(0), B, (Let("s", S.Num(0.0)), *inner)),)
    return ONF("k", "v", inputs=(Buffer("x", (B, C)),), outputs=(Buffer("y", (B, C)),),
               temps=(), sizes=(B, C), scalars=(), nests=(Nest("y", body, "y"),))


GOOD = Loop(c, sympy.Integer(0), C, (Update("s", "+", X),))
SCALE = Loop(c, sympy.Integer(0), C, (Store("y", (b, c), S.Bin("*", X, S.Local("s"))),))


@pytest.mark.parametrize("inner, message", [
    ((Loop(c, sympy.Integer(0), C, (Store("y", (b, 0), X),)),),
     "store to y inside the loop over c is not indexed by it"),
    ((Loop(c, sympy.Integer(0), C, (Update("s", "=", X),)),), "s = ... inside the loop over c"),
    ((Loop(c, sympy.Integer(0), C, (Update("s", "+", X), Store("y", (b, c), S.Local("s")))),),
     "s is read inside the loop over c that accumulates it"),
    ((Store("y", (b, 0), X),), "no loop over c inside its parallel loops"),
])
def test_what_a_block_cannot_share_is_refused(inner, message):
    with pytest.raises(ScheduleError, match=message):
        GpuBlocks(("b",), across="c")(_nest(*inner))


@pytest.mark.parametrize("threads", [96, 16, 2048])
def test_a_block_is_whole_warps_a_power_of_two_threads(threads):
    with pytest.raises(ScheduleError, match="power of two from 32 to 1024"):
        GpuBlocks(("b",), across="c", block=threads)(_nest(GOOD, SCALE))
    marked = GpuBlocks(("b",), across="c", block=64)(_nest(GOOD, SCALE))
    assert marked.nests[0].body[0].per_block


def test_an_array_each_element_of_which_one_thread_touches_needs_no_barrier():
    from moagen.targets.cuda.printer import thread_owned
    partial = onf_of("rmsnorm_bwd", "dnf", target="cuda").nests[0]
    # dx, the part's dweight partials: offset c + d*(...) in the loops over c; inv_rms a row's
    assert thread_owned(partial.body) == {"dx", "dweight_part", "dz", "weight", "x"}
    source = emit_cuda([("float64", onf_of("rmsnorm_bwd", "dnf", target="cuda"))], ["test"])
    body = source[source.index("const int64_t i_part = blk;"):]
    assert "__syncthreads();" not in body[:body.index("\n}\n")]  # the reductions' own only
    forward = onf_of("rmsnorm_fwd", "dnf", target="cuda").nests[0]
    assert "inv_rms" not in thread_owned(forward.body)  # thread 0's, read by all
    shared = Loop(c, sympy.Integer(0), C, (), across_threads=True)
    for offset, owned in ((c + C * b, True), (c + 1 + C * b, False), (c + C * b / 2, False)):
        store = Store("y", (offset,), S.Num(0.0))
        assert thread_owned((Loop(b, sympy.Integer(0), B, (replace(shared, body=(store,)),)),)) \
            == ({"y"} if owned else set())
    assert thread_owned((Store("y", (c + C * b,), S.Num(0.0)),)) == set()  # not in a shared loop
