"""Each GPU mapping step (moagen.steps.gpu) on a nest of ten lines written by hand, by the
IR it leaves (the dumped ONF, before and after), and the finished mapping run: printed as
CUDA, built for the host emulation with its race check and compared with numpy. Unlike
moagen.onf.interpret, which ignores the GPU marks, the emulation runs a block's threads
as the marks map them, so a mapping step that breaks the kernel fails here.

The nest: y[i, j] = sum over k of a[i, k] b[j, k], k in blocks of 8 (a tiled GEMM's form,
attention's scores)."""
import numpy as np
import sympy

from moagen.moa import scalar as S
from moagen.onf.dump import format_onf
from moagen.onf.loops import ONF, Buffer, Let, Loop, Nest, Store, Update
from moagen.onf.realize import CLOSING
from moagen.onf.signature import signature
from moagen.steps.gpu.closing import close_tiled
from moagen.steps.gpu.blocks import BlockTiles, ThreadTiles
from moagen.steps.gpu.staging import Stage
from moagen.targets.cuda import emulated
from moagen.targets.cuda.build import build_cuda_emulated
from moagen.targets.cuda.printer import emit_cuda

N, M, D = sympy.symbols("n m d", integer=True, positive=True)
i, j, k, k_blk = sympy.symbols("i j k k_blk", integer=True)
ZERO = sympy.Integer(0)
PRODUCT = Update("acc", "+", S.Bin("*", S.Access("a", (i, k)), S.Access("b", (j, k))))
GEMM = ONF("gemm", "tiled", inputs=(Buffer("a", (N, D)), Buffer("b", (M, D))),
           outputs=(Buffer("y", (N, M)),), temps=(), sizes=(N, M, D), scalars=(),
           nests=(Nest("y", (Loop(i, ZERO, N, (Loop(j, ZERO, M, (
               Let("acc", S.Num(0.0)),
               Loop(k_blk, ZERO, sympy.ceiling(D / 8), (
                   Loop(k, 8 * k_blk, sympy.Min(D, 8 * k_blk + 8), (PRODUCT,)),)),
               Store("y", (i, j), S.Local("acc")))),)),), "y"),))

# each step, and the nest as it leaves it
STEPS = [
    (BlockTiles(("i",), rows=16, bounds=(("m", (16,)),)), """
  grid for i_blk in [0, idiv(n + 15, 16)):
    for i in [16*i_blk, Min(n, 16*i_blk + 16)):
      for j in [0, m):
        let acc = 0.0
        for k_blk in [0, ceiling(d/8)):
          for k in [8*k_blk, Min(d, 8*k_blk + 8)):
            acc += (<i k> psi a) * (<j k> psi b)
        y[i, j] = acc"""),
    (ThreadTiles("i", 4, "y"), """
  grid for i_blk in [0, idiv(n + 15, 16)):
    thread.y(4 x 4) for i in [16*i_blk, Min(n, 16*i_blk + 16)):
      for j in [0, m):
        let acc = 0.0
        for k_blk in [0, ceiling(d/8)):
          for k in [8*k_blk, Min(d, 8*k_blk + 8)):
            acc += (<i k> psi a) * (<j k> psi b)
        y[i, j] = acc"""),
    (ThreadTiles("j", 4, "x", threads=4), """
  grid for i_blk in [0, idiv(n + 15, 16)):
    thread.y(4 x 4) for i in [16*i_blk, Min(n, 16*i_blk + 16)):
      thread.x(4 x 4) for j in [0, m):
        let acc = 0.0
        for k_blk in [0, ceiling(d/8)):
          for k in [8*k_blk, Min(d, 8*k_blk + 8)):
            acc += (<i k> psi a) * (<j k> psi b)
        y[i, j] = acc"""),
    (Stage("a", at="k_blk", nest="y"), """
  grid for i_blk in [0, idiv(n + 15, 16)):
    thread.y(4 x 4) for i in [16*i_blk, Min(n, 16*i_blk + 16)):
      thread.x(4 x 4) for j in [0, m):
        let acc = 0.0
        for k_blk in [0, ceiling(d/8)):
          block-copy.y for e in [0, 16):
            block-copy.x for e2 in [0, 8):
              y_a_tile[e2, e] = ((<e + 16*i_blk e2 + 8*k_blk> psi a) if (e + 16*i_blk < Min(n, 16*i_blk + 16)) & (e2 + 8*k_blk < Min(d, 8*k_blk + 8)) else 0.0)
          for k in [8*k_blk, Min(d, 8*k_blk + 8)):
            acc += (<k - 8*k_blk i - 16*i_blk> psi y_a_tile) * (<j k> psi b)
        y[i, j] = acc"""),
]


def _nest_text(onf):
    return format_onf(onf).split("nest y: from y", 1)[1].rstrip()


def test_each_step_leaves_the_nest_it_says():
    onf = GEMM
    for step, after in STEPS:
        onf = step(onf)
        assert _nest_text(onf) == after, str(step)
    # the tile Stage made: a key block's 8 columns of a by the block's 16 rows, laid out
    # with the rows (the axis a thread's register tile walks) last, padded by 4
    assert [(b.name, tuple(map(str, b.shape))) for b in onf.shared] == [("y_a_tile", ("8", "20"))]


def test_the_mapped_nest_runs_as_numpy_on_the_emulation():
    """Every step of STEPS and b staged too, at sizes that leave a short last block of rows
    and of k: the kernel under the race check against a @ b.T."""
    onf = GEMM
    for step, _ in STEPS:
        onf = step(onf)
    onf = Stage("b", at="k_blk", nest="y")(onf)
    for step in CLOSING:  # as realize ends every schedule
        onf = step(onf)
    onf = close_tiled(onf)
    source = emit_cuda([("float64", onf)], ["a hand-built GEMM (tests/test_gpu_steps_ir.py)"])
    fn = emulated.bind(build_cuda_emulated(source, "gemm_steps", racecheck=True),
                       signature(onf, "float64"))
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((37, 13)), rng.standard_normal((11, 13))
    y = fn(a, b)
    np.testing.assert_allclose(y, a @ b.T, rtol=1e-13, atol=1e-13)
