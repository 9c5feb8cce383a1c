"""The Step contract (moagen.steps.step): how a step finds its nests, what it raises, and
its printed form, derived from its fields."""
import pytest
import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import idiv
from moagen.onf.loops import Buffer, Loop, Nest, ONF, Store
from moagen.steps.algebra.online import OnlineSoftmax
from moagen.steps.algebra.partials import PartialSums
from moagen.steps.loop.fusion import FuseNests
from moagen.steps.loop.gpu_blocks import GpuBlocks
from moagen.steps.loop.parallel import GpuThreads, Parallel
from moagen.steps.loop.split import Split, SplitLoop
from moagen.steps.loop.tiling import RegisterTile
from moagen.steps.step import NotApplicable

n, m = sympy.symbols("n m", integer=True)
i, k = (sympy.Symbol(v, integer=True) for v in "ik")


def _onf():
    """Nest y, a loop over i; nest z, a loop over k."""
    store = lambda array, var: Store(array, (var,), S.Access("x", (var,)))
    nests = (Nest("y", (Loop(i, sympy.Integer(0), n, (store("y", i),)),), "y"),
             Nest("z", (Loop(k, sympy.Integer(0), n, (store("z", k),)),), "z"))
    return ONF("f", "v", (Buffer("x", (n,)),), (Buffer("y", (n,)), Buffer("z", (n,))), (),
               (n,), (), nests)


@pytest.mark.parametrize("step,printed", [
    (Split("i", 64), "split(i, 64)"),
    (Split("i", 64, nest="y"), "split(i, 64, nest=y)"),
    (Parallel(("b", "h"), nest="rows", interleave=True), "parallel(b, h, interleaved, nest=rows)"),
    (GpuThreads(("b",)), "gpu_threads(b, 128 a block)"),
    (GpuBlocks(("b",), nest="rows", block=256), "gpu_blocks(b, 256 threads sharing c, nest=rows)"),
    (RegisterTile("U", "m", "e"), "register_tile(U, m x e, 4 x 8, packed)"),
    (RegisterTile("U", "m", "e", 2, 4, pack=False, row_block=8),
     "register_tile(U, m x e, 2 x 4, 8 rows a block)"),
    (OnlineSoftmax("rows"), "online_softmax(rows)"),
    (OnlineSoftmax("rows", 64), "online_softmax(rows, block=64)"),
    (PartialSums("dw", "i", 4, rows="dx"), "partial_sums(dw, i, 4, rows=dx)"),
    (FuseNests(("O", "lse"), over=("b", "h"), name="rows"), "fuse(O, lse, over=(b, h))"),
    (SplitLoop("heads", "h", outer="kv", inner=idiv(m, n)),
     "split_loop(heads, h = idiv(m, n)*g + r)"),
])
def test_a_step_prints_from_its_fields(step, printed):
    assert str(step) == printed


def test_a_step_without_a_nest_rewrites_every_nest_it_applies_to():
    onf = Split("i", 4)(_onf())
    assert onf.nests[0].body[0].var.name == "i_blk"
    assert onf.nests[1] == _onf().nests[1]  # no loop over i: left as it was
    assert onf.schedule == ("split(i, 4)",)


def test_a_step_that_applies_nowhere_or_to_a_nest_there_is_not_raises():
    with pytest.raises(NotApplicable, match="no loop j"):
        Split("j", 4)(_onf())
    with pytest.raises(NotApplicable, match="nest z has no loop i"):
        Split("i", 4, nest="z")(_onf())
    with pytest.raises(ScheduleError, match="has no nest 'w'; it has y, z"):
        Split("i", 4, nest="w")(_onf())
