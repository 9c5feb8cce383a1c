"""BlockPartials (moagen.steps.gpu.partials): a block's atomic additions summed over its own
rows first, on a nest of a few lines written by hand (the dumped IR before and after, and
what the step refuses), then on the passes that use it: dq_atomic's key tiles adding their
share of dQ (FlashAttention-2's dQ), the atomic kernels' query tiles theirs of dK (and the
fused kernel's of dV); one
atomic addition per element of a tile a block, the cost model's count divided by the rows
a block holds."""
from dataclasses import replace

import pytest
import sympy

from moagen.cost.view import counting_view
from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.count import atomic_updates
from moagen.onf.dump import format_onf
from moagen.onf.loops import (ONF, Buffer, Grid, Let, Loop, Nest, Store, Threads, Update,
                              ancestors, is_thread_loop, max_extent, walk)
from moagen.pipeline import onf_of
from moagen.steps.gpu.blocks import ThreadTiles
from moagen.steps.gpu.partials import BlockPartials
from moagen.steps.step import NotApplicable

N, M = sympy.symbols("n m", integer=True, positive=True)
i, j, c, i_blk, j_blk = sympy.symbols("i j c i_blk j_blk", integer=True)
ZERO = sympy.Integer(0)


def _scattered(value=S.Bin("*", S.Local("t"), S.Access("b", (j, c))), index=(i, c), extra=()):
    """y[i, c] += s[i, j] b[j, c] by atomics from a block per 4 rows j (2 threads of 2
    along y), over blocks of 8 rows i (a sequential loop), 2 columns c (threads along x):
    the form of dq_atomic's key tiles adding dS K into dQ."""
    add = Store("y", index, value, accumulate="+", atomic=True)
    rows_of_i = Loop(i, 8 * i_blk, sympy.Min(N, 8 * i_blk + 8), (
        Let("t", S.Access("s", (i, j))), *extra,
        Loop(c, ZERO, sympy.Integer(2), (add,), gpu=Threads("x", 2, 1))))
    body = Loop(j_blk, ZERO, sympy.ceiling(M / 4), (
        Loop(j, 4 * j_blk, sympy.Min(M, 4 * j_blk + 4), (
            Loop(i_blk, ZERO, sympy.ceiling(N / 8), (rows_of_i,)),), gpu=Threads("y", 2, 2)),),
        gpu=Grid())
    return ONF("scattered", "atomic", inputs=(Buffer("s", (N, M)), Buffer("b", (M, 2))),
               outputs=(Buffer("y", (N, 2)),), temps=(), sizes=(N, M), scalars=(),
               nests=(Nest("y", (body,), "y"),))


def _nest_text(onf):
    return format_onf(onf).split("nest y: from y", 1)[1].rstrip()


def test_the_additions_are_summed_over_the_block_s_rows_then_added_once():
    """After the loop over a block of i: a loop over its rows and the columns, each
    element a local summed over the block's rows j (a plain loop), added once; the thread
    loop over j around each statement it held, the new loop outside it."""
    onf = BlockPartials("y", "j")(_scattered())
    assert _nest_text(onf) == """
  grid for j_blk in [0, ceiling(m/4)):
    for i_blk in [0, ceiling(n/8)):
      for i in [8*i_blk, Min(n, 8*i_blk + 8)):
        for c in [0, 2):
          let y_part = 0.0
          for j in [4*j_blk, Min(m, 4*j_blk + 4)):
            y_part += (<i j> psi s) * (<j c> psi b)
          atomic y[i, c] += y_part"""
    # the block's threads over the tile: its rows along y, as j was, the columns along x
    onf = ThreadTiles("c", 1, "x", threads=2)(ThreadTiles("i", 2, "y", threads=2)(onf))
    threads = {(lp.var.name, lp.gpu.axis) for lp in walk(onf.nests[0].body)
               if isinstance(lp, Loop) and isinstance(lp.gpu, Threads)}
    assert threads == {("i", "y"), ("c", "x")}


def test_what_the_loop_of_the_additions_does_besides_stays_in_the_thread_loop():
    kept = Store("z", (i, j), S.Local("t"))
    onf = _scattered(extra=(kept,))
    onf = replace(onf, outputs=onf.outputs + (Buffer("z", (N, M)),))
    text = _nest_text(BlockPartials("y", "j")(onf))
    assert """
    for i_blk in [0, ceiling(n/8)):
      thread.y(2 x 2) for j in [4*j_blk, Min(m, 4*j_blk + 4)):
        for i in [8*i_blk, Min(n, 8*i_blk + 8)):
          let t = (<i j> psi s)
          z[i, j] = t
      for i in [8*i_blk, Min(n, 8*i_blk + 8)):""" in text


def test_pieces_of_the_tile_are_summed_in_turn():
    """Pieces of 4 of a block's 8 rows i: a loop over the two pieces around the tile, each
    ending where the rows do, not also at the block's end (the counting view's closed
    form)."""
    text = _nest_text(BlockPartials("y", "j", pieces=(4,))(_scattered()))
    assert """
      for i_piece in [0, 2):
        for i in [8*i_blk + 4*i_piece, Min(n, 8*i_blk + 4*i_piece + 4)):
          for c in [0, 2):""" in text


@pytest.mark.parametrize("onf, step, why", [
    (_scattered(index=(j, c)), BlockPartials("y", "j"), "indexed by the rows j"),
    (_scattered(value=S.Local("u")), BlockPartials("y", "j"), "reads the local u"),
    (_scattered(value=S.Access("y", (i, c))), BlockPartials("y", "j"), "y, which the loop"),
    (_scattered(), BlockPartials("y", "j", pieces=(4, 1, 1)), "pieces of 3 loops"),
])
def test_refuses_what_it_cannot_sum_first(onf, step, why):
    with pytest.raises(ScheduleError, match=why):
        step(onf)


def test_a_nest_with_no_such_addition_is_not_its_business():
    with pytest.raises(NotApplicable, match="inside no thread loop over i"):
        BlockPartials("y", "i", nest="y")(_scattered())


# (kernel, variant, the pass that adds atomically, the array, the rows a block sums over,
# the thread loops of the tile it adds)
ADDED = [("attention_bwd", "dq_atomic", "keys", "dQ", "j", ["i", "c"]),
         ("attention_bwd_causal", "dq_atomic", "keys", "dQ", "j", ["i", "c"]),
         ("attention_bwd", "atomic", "rows", "dK", "i", ["j", "c"]),
         ("attention_bwd_causal", "atomic", "rows", "dK", "i", ["j", "c"]),
         ("attention_fwdbwd", "atomic", "rows", "dK", "i", ["j", "c"]),
         ("attention_fwdbwd", "atomic", "rows", "dV", "i", ["j", "c"]),
         ("attention_fwdbwd_causal", "atomic", "rows", "dV", "i", ["j", "c"])]


@pytest.mark.parametrize("kernel, variant, label, array, rows, tile",
                         [a for a in ADDED if not a[0].endswith("causal")])
def test_the_gpu_adds_a_block_s_share_once_per_element(kernel, variant, label, array, rows, tile):
    """On the GPU the atomic additions are the CPU's (one per product) divided by the rows a
    block holds: each block adds its tile's share once."""
    counts = {target: atomic_updates(counting_view(
        onf_of(kernel, variant, target=target, dtype="float64")).nests)[array]
              for target in ("cpu", "cuda")}
    nest = _nest(kernel, variant, label)
    (held,) = {max_extent(lp) for lp in walk(nest.body)
               if isinstance(lp, Loop) and lp.var.name == rows and is_thread_loop(lp)}
    assert sympy.simplify(counts["cpu"] / counts["cuda"] - held) == 0


@pytest.mark.parametrize("kernel, variant, label, array, rows, tile", ADDED)
def test_the_gpu_adds_a_local_summed_over_the_block_s_rows(kernel, variant, label, array, rows,
                                                          tile):
    """The one atomic addition adds a thread's local, summed over the block's rows in a
    loop of its own, outside every thread loop over them."""
    nest = _nest(kernel, variant, label)
    (add,) = [s for s in walk(nest.body) if isinstance(s, Store) and s.atomic
              and s.array == array]
    around = ancestors(nest.body, add)
    assert isinstance(add.value, S.Local) and add.value.name.startswith(f"{array}_part")
    assert [lp.var.name for lp in around if is_thread_loop(lp)] == tile
    (summed,) = [lp for lp in walk(nest.body) if isinstance(lp, Loop) and lp.var.name == rows
                 and not is_thread_loop(lp)
                 and getattr(lp.body[0], "name", None) == add.value.name]
    assert [type(s) for s in summed.body] == [Update]


def _nest(kernel, variant, label):
    onf = onf_of(kernel, variant, target="cuda", dtype="float64")
    return next(n for n in onf.nests if n.label == label)
