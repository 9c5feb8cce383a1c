"""The logsumexp merge of partial attention results, as a MoA spec: parts (key blocks
another rank or step computed) each give rows O_s and their lse_s; the whole's rows are

    lse = log sum_s exp(lse_s)        O = sum_s exp(lse_s - lse) O_s

which is a softmax over the parts whose scores are the parts' lse: the same expression as
decode's (moagen.kernels.attention_decode.softmax_weighted), so it is written with it, and
the rule SplitKeys prints for its slices. A part with no keys (lse = -inf, O = 0) weighs
nothing. The parts are the leading axis: what MPI_Allgather lays out, rank by rank."""
from functools import lru_cache

from moagen.kernels.attention_decode import softmax_weighted
from moagen.kernels.layers import Layers, cpu
from moagen.moa.dnf import psi_reduce
from moagen.moa.expr import array, lift, psi, sym, transpose
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.realize import realize
from moagen.steps.loop.accumulate import Accumulate
from moagen.steps.loop.fusion import FuseNests
from moagen.steps.loop.hoist import Hoist
from moagen.steps.loop.parallel import Parallel

O_PART = array("O_part", "parts", "batch", "heads", "n", "d")
LSE_PART = array("lse_part", "parts", "batch", "heads", "n")
ROWS = ("b", "h", "i")
EXTENTS = ("batch", "heads", "n")


def _one_row():
    index = tuple(sym(v) for v in ROWS)
    scores = psi(index, transpose(LSE_PART, (1, 2, 3, 0)))  # lse_part[s, b, h, i] over s
    values = psi(index, transpose(O_PART, (1, 2, 3, 0, 4)))  # O_part[s, b, h, i, :] over s
    return softmax_weighted(scores, values, var="s")


_O, _LSE = _one_row()
SPEC = KernelSpec(name="lse_merge", inputs=(O_PART, LSE_PART), scalars=(),
                  outputs=(Output("O", lift(ROWS, EXTENTS, _O), ROWS + ("c",)),
                           Output("lse", lift(ROWS, EXTENTS, _LSE), ROWS)))
VARIANT = "rows"
# one pass per row: the parts' max, their sum, then each part's rows added in, rows in parallel
LAYERS = Layers(algorithm=(Accumulate("c", over="s", nest="O"),
                           FuseNests(("O", "lse"), over=ROWS, name="rows"), Hoist()),
                mapping=cpu(Parallel(ROWS)))


@lru_cache(maxsize=None)
def merge_onf():
    """The merge's final ONF for the CPU (each rank's OpenMP threads take its rows)."""
    return realize(psi_reduce(SPEC, frozenset()), VARIANT, LAYERS.steps("cpu"), "row", None)
