"""BlockInterchange: blocks of a loop's iterations sweep an inner loop together (the owner's
key rows' blocks over the query rows' blocks)."""
from dataclasses import replace

import numpy as np
import pytest
import sympy

from moagen.pipeline import onf_of
from moagen.errors import ScheduleError
from moagen.kernels import get_kernel
from moagen.moa import scalar as S
from moagen.moa.expr import sym
from moagen.onf.interpret import run_onf
from moagen.onf.loops import ONF, Buffer, Let, Loop, Nest, Store, walk
from moagen.onf.realize import initial_onf
from moagen.steps.algebra.keyblocks import KeyBlocks
from moagen.steps.loop.interchange import BlockInterchange
from moagen.steps.loop.layout import ApplyLayout
from tests.test_schedule import PROBLEMS, _dnf

KERNEL = "attention_fwdbwd"


def _owner(kernel, params, key_block, rows_block):
    """The owner's ONF with its key blocks (KeyBlocks: the query rows' blocks of the key
    rows' pass) of key_block rows and the key rows' blocks of rows_block tiles; None: no
    BlockInterchange step."""
    onf = initial_onf(_dnf(kernel, "owner"), "owner")
    for step in get_kernel(kernel).variant("owner").steps(params):
        if isinstance(step, KeyBlocks):
            step = replace(step, block=key_block)
        if isinstance(step, BlockInterchange):
            if rows_block is None:
                continue
            step = replace(step, block=rows_block)
        onf = step(onf)
    return onf


def _loops(onf, nest):
    body = next(n for n in onf.nests if n.label == nest).body
    return [s for s in walk(body) if isinstance(s, Loop)]


def _loop(onf, nest, var):
    return next(s for s in _loops(onf, nest) if s.var.name == var)


@pytest.mark.parametrize("kernel", [KERNEL, "attention_fwdbwd_causal"])
@pytest.mark.parametrize("params", [{"parts": 1, "rows": 1, "keys": 2, "lanes": 0},
                                    {"parts": 2, "rows": 2, "keys": 2, "lanes": 0}])
def test_key_row_blocks_sweep_the_query_blocks_with_the_same_sums(kernel, params):
    """n = 5 keys and query rows, query blocks of 2 (three, the last of one row) and key
    row blocks of 2 iterations: the blocked pass adds the same terms in the same order into
    every element (dK's over query rows, dQ's parts' over key rows), so its values are the
    unblocked pass's bit for bit, and numpy's to rounding. The causal mask is a select in
    the values: its loops are the same rectangle. Without the register tiles (lanes 0),
    whose panels need query blocks of whole tiles."""
    arrays, scalars, reference = PROBLEMS[kernel]
    blocked, plain = (run_onf(_owner(kernel, params, 2, b), arrays, scalars)
                      for b in (2, None))
    for name, want in reference(*arrays.values(), *scalars.values()).items():
        np.testing.assert_array_equal(blocked[name], plain[name], err_msg=name)
        np.testing.assert_allclose(blocked[name], want, rtol=1e-12, atol=1e-14, err_msg=name)


def test_the_owner_with_parts_sweeps_query_blocks_by_blocks_of_64_key_rows():
    """rows 4: blocks of 16 tiles; dK and dV's rows are zeroed for the block before its
    sweep, inside it each query block walks the block's tiles."""
    onf = onf_of(KERNEL, "owner", params={"parts": 1, "rows": 4})
    block = _loop(onf, "keys", "j_in_tile_blk")
    zero, sweep = block.body
    assert zero.var.name == "j_in_tile" and sympy.Symbol("j_in_tile_blk", integer=True) * 16 \
        == zero.start
    assert sweep.var.name == "i_blk" and sweep.body[0].var.name == "j_in_tile"
    assert {s.array for s in zero.body[0].body} == {"dK", "dV"}
    # dQ in its own pass (parts 0): the key rows are the parallel loop, not blocked
    plain = onf_of(KERNEL, "owner", params={"parts": 0, "rows": 4})
    assert not any(s.var.name.endswith("_blk") and "j" in s.var.name
                   for s in _loops(plain, "keys"))


def test_the_loops_between_the_block_and_the_swept_loop_move_out_with_it():
    """for o: for r: for q: y[o] += A[o, q] (r: a group's query heads between a key tile and
    its query rows) becomes for o_blk: for r: for q: for o in the block: the same additions
    into each y[o] in the same order, so the same bits."""
    r = sym("r")
    z = sym("z")
    plain = _by_hand(_for(z, M, Store("y", (z,), S.Num(0.0))),
                     _for(O, M, _for(r, sympy.Integer(2), _for(Q, N, ADD_Y))))
    blocked = BlockInterchange("y", "o", "q", 4)(plain)
    block = blocked.nests[0].body[1]
    assert [lp.var.name for lp in walk((block,)) if isinstance(lp, Loop)] == ["o_blk", "r", "q",
                                                                             "o"]
    A = np.random.default_rng(3).standard_normal((7, 5))
    got, want = (run_onf(ApplyLayout()(onf), {"A": A}, {})["y"] for onf in (blocked, plain))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, 2 * A.sum(1), rtol=1e-13)


# ---- refusals --------------------------------------------------------------------------

O, Q = sym("o"), sym("q")
M, N = sym("m"), sym("n")


def _by_hand(*body):
    """A one-nest ONF over A(m, n), y(m) and z(n)."""
    return ONF("by_hand", "v", inputs=(Buffer("A", (M, N)),),
               outputs=(Buffer("y", (M,)), Buffer("z", (N,))), temps=(), sizes=(M, N),
               scalars=(), nests=(Nest("y", tuple(body), "by hand"),))


def _for(var, stop, *body):
    return Loop(var, sympy.Integer(0), stop, tuple(body))


A_OQ = S.Access("A", (O, Q))
ADD_Y = Store("y", (O,), A_OQ, accumulate="+")


@pytest.mark.parametrize("body, transform, words", [
    ((_for(O, M, _for(Q, N, ADD_Y)),), BlockInterchange("y", "o", "q", 1),
     "at least two iterations"),
    ((_for(O, M, _for(Q, N, ADD_Y)),), BlockInterchange("y", "p", "q", 4),
     "has no loop over p"),
    ((_for(O, M, ADD_Y),), BlockInterchange("y", "o", "q", 4), "hold one loop over q"),
    # z[q] is set by every o: the blocks would set it in another order
    ((_for(O, M, _for(Q, N, Store("z", (Q,), A_OQ))),), BlockInterchange("y", "o", "q", 4),
     "z is not indexed by o"),
    # y[2 o] and y[2 o + 2]: iteration o + 1 writes what o wrote
    ((_for(O, M, _for(Q, N, Store("y", (2 * O,), A_OQ), Store("y", (2 * O + 2,), A_OQ))),),
     BlockInterchange("y", "o", "q", 4), "y is not indexed by o"),
    # t is set before the loop over q and read in it
    ((_for(O, M, Let("t", S.Access("A", (O, 0))),
           _for(Q, N, Store("y", (O,), S.Local("t"), accumulate="+"))),),
     BlockInterchange("y", "o", "q", 4), "read t, set before it"),
    # the query rows of a key row start at it (a triangle)
    ((_for(O, M, Loop(Q, O, N, (ADD_Y,))),), BlockInterchange("y", "o", "q", 4),
     "the bounds of q depend on o"),
])
def test_block_interchange_refuses_what_it_cannot_reorder(body, transform, words):
    with pytest.raises(ScheduleError, match=words):
        transform(_by_hand(*body))

