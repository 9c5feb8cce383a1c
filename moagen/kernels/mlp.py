"""The gated (SwiGLU) MLP of a transformer block, per (batch, position) row:

    U = X Wg,  V = X Wu,  H = silu(U) * V,  F = H Wd

The forward keeps U and V for the backward (as PyTorch's autograd keeps both products), which
computes H again from them (derived from the forward's spec by moagen.moa.grad, not written
by hand):

    dH = dF Wd^T,  dV = dH * silu(U),  dU = dH * V * silu'(U)
    dWd = H^T dF,  dWg = X^T dU,  dWu = X^T dV,  dX = dU Wg^T + dV Wu^T

with silu'(u) = sigmoid(u) * (1 + u * (1 - sigmoid(u))): six products, where keeping U
alone would cost a seventh (V again). H is stored by the pass that computes dU and dV (the
three share one sigmoid of U) and copied transposed (HT), as X is (XT), so that the weight
gradients, sums over the rows, read their row operand along contiguous memory. Every inner
product is register tiled in the `tiled` variants; the weight gradients are sums over all
rows computed by whole output tiles, so each thread owns the weights it writes: no atomics,
and every sum runs over the rows in one fixed order.
"""
from moagen import reference_block
from moagen.kernels.cases import Check, on_model, references
from moagen.kernels.chain import backward
from moagen.kernels.gemm import (GEMM_SPLIT, TENSOR_CORES, TENSOR_DTYPES, TENSOR_KINDS,
                                  TENSOR_SPLIT, on_gemms)
from moagen.kernels.layers import Layers, cpu, threads_per_tile
from moagen.kernels.tunable import Tunable
from moagen.kinds import KINDS
from moagen.moa.expr import Named, Transpose, array, inner, lift, named, psi, silu, transpose
from moagen.moa.grad import grad
from moagen.moa.rewrites import transform_outputs
from moagen.moa.spec import KernelSpec, Output
from moagen.steps.loop.fusion import FuseNests
from moagen.steps.loop.hoist import Hoist
from moagen.steps.loop.parallel import Parallel
from moagen.steps.loop.tiling import RegisterTile

X = array("X", "batch", "n", "dm")
WG = array("Wg", "dm", "dff")
WU = array("Wu", "dm", "dff")
WD = array("Wd", "dff", "dm")
B = ("b",)
ROW_E, ROW_C = ("i", "e"), ("i", "c")  # e: the hidden (d_ff) axis, c: the model axis


def forward_parts(x):
    """U, V and H of one batch entry's rows."""
    u = named("U", inner(x, WG, var="c", name="xg"), index=ROW_E)
    v = named("V", inner(x, WU, var="c", name="xu"), index=ROW_E)
    return u, v, named("H", silu(u) * v, index=ROW_E)


def forward_spec() -> KernelSpec:
    u, v, h = forward_parts(psi(B, X))
    return KernelSpec(
        name="mlp_fwd",
        inputs=(X, WG, WU, WD),
        scalars=(),
        outputs=(Output("F", lift(B, ("batch",), inner(h, WD, var="e", name="hw")),
                        ("b", "i", "c")),
                 Output("U", lift(B, ("batch",), u), ("b",) + ROW_E),
                 Output("V", lift(B, ("batch",), v), ("b",) + ROW_E)),
    )


def _transposed(w, label):
    """A weight stored transposed once, so that every product runs along contiguous rows."""
    return named(label, transpose(w), index=("e", "c") if w is not WD else ("c", "e"))


# how the backward is derived (moagen.moa.grad; `moagen grad mlp_fwd`): dF given for F, U
# and V kept; H, dH, dV and dU are Named
VJP = {"mlp_fwd": dict(wrt={"X": ("b",) + ROW_C, "Wg": ("c", "e"), "Wu": ("c", "e"),
                            "Wd": ("e", "c")}, cotangents=("F",))}


def backward_spec() -> KernelSpec:
    """The derived backward with its transposed operands Named, so that a variant can store
    them: the weights for dX and dH, and per batch entry X and H (XT, HT), so that the
    weight gradients, sums over the rows, read their row operand along contiguous memory.
    HT is the transpose of the Named H: a variant that stores H copies it rather than
    computing H (and its sigmoid) again."""
    derived = grad(forward_spec(), name="mlp_bwd", **VJP["mlp_fwd"])
    stored = {transpose(WD): _transposed(WD, "WdT"), transpose(WG): _transposed(WG, "WgT"),
              transpose(WU): _transposed(WU, "WuT"),
              transpose(psi(B, X)): named("XT", transpose(psi(B, X)), index=("c", "i"))}

    def transposed(node):
        if isinstance(node, Transpose) and isinstance(node.array, Named) and \
                node.array.label == "H":
            return named("HT", transpose(node.array), index=("e", "i"))
        return stored.get(node)

    return transform_outputs(derived, transposed)


FORWARD_TEMPS = frozenset({"H"})
BACKWARD_TEMPS = frozenset({"H", "XT", "HT", "dH", "dV", "dU", "WdT", "WgT", "WuT"})
ROWS = ("b", "i")
ELEMENTWISE = "dU_dV_H"  # the tiled backward's fused elementwise nest
# the nests of each kernel: row-wise products (tiled rows x cols), weight gradients (tiled
# weight rows x cols), elementwise row nests, the weights' transposes (weight rows) and the
# per-batch transposes of row operands (their rows)
# split: the products whose sums a GPU cuts into parts (moagen.kernels.gemm.on_gemms):
# their output tiles too few for a wave at the bench's sizes (F: 2048 x 512, sums over
# dff; the weight gradients: sums over every row)
FORWARD = {"rows": {"U": "e", "V": "e", "F": "c"}, "weights": {}, "elementwise": ("H",),
           "transposes": {}, "row_transposes": {}, "split": ("F",)}
# a product's operands on a GPU, each chunk's tiles of them staged in shared memory
# (moagen.kernels.gemm); the axis a row product sums over, given its columns'
GEMM_OPERANDS = {"U": ("X", "Wg"), "V": ("X", "Wu"), "F": ("H", "Wd"), "dH": ("dF", "WdT"),
                 "dX": ("dU", "WgT", "dV", "WuT"), "dWg": ("XT", "dU"), "dWu": ("XT", "dV"),
                 "dWd": ("HT", "dF")}
SUMMED = {"e": "c", "c": "e"}
BACKWARD = {"rows": {"dH": "e", "dX": "c"},
            "weights": {"dWg": ("c", "e"), "dWu": ("c", "e"), "dWd": ("e", "c")},
            "elementwise": ("dV", "dU", "H"), "transposes": {"WdT": "c", "WgT": "e", "WuT": "e"},
            "row_transposes": {"XT": "c", "HT": "e"}, "split": ("dX", "dWg", "dWu", "dWd")}


def _plain(nests):
    """Each nest as the DNF gives it, parallel over the rows it writes."""
    mapping = [Parallel(ROWS, nest=n) for n in list(nests["rows"]) + list(nests["elementwise"])]
    mapping += [Parallel((rows,), nest=n) for n, (rows, _) in nests["weights"].items()]
    return Layers(algorithm=(Hoist(),), mapping=cpu(*mapping, *_transposes(nests)))


def _transposes(nests):
    """The weights' transposes parallel over their rows, the row operands' over (batch, rows)."""
    return tuple([Parallel((rows,), nest=n) for n, rows in nests["transposes"].items()] +
                 [Parallel(("b", rows), nest=n) for n, rows in nests["row_transposes"].items()])


def _tiled(nests, mr, nr, row_block):
    """Every contraction register tiled, row products parallel over (batch, row block),
    weight gradients over the weight's column tiles; the rest as in _plain. Without row
    blocks, a GPU runs a thread per tile (threads_per_tile)."""
    schedule, mapping, tiles = [], [], {}
    for label, cols in nests["rows"].items():
        tile = RegisterTile(label, "i", cols, mr, nr, row_block=row_block)
        schedule.append(tile)
        if row_block:  # the tail's rows run as the blocks do
            mapping.append(Parallel(("b", tile.row_blocks), nest=label))
        else:
            mapping += [Parallel(("b", tile.col_tiles), nest=label),
                        Parallel(ROWS, nest=tile.edge)]
            tiles[label] = ("b",) + tile.tiles
    for label, (rows, cols) in nests["weights"].items():
        tile = RegisterTile(label, rows, cols, mr, nr)
        schedule.append(tile)
        mapping += [Parallel((tile.col_tiles,), nest=label), Parallel((rows,), nest=tile.edge)]
        tiles[label] = tile.tiles
    elementwise = nests["elementwise"]
    if len(elementwise) == 1:  # a GPU thread an element: a thread a row leaves too few
        tiles[elementwise[0]] = B + ROW_E
    else:
        # one pass over the rows for all of them: the operands they share (dH, U, V) read
        # once, and the sigmoid of U they all take computed once (Hoist shares it)
        schedule.append(FuseNests(elementwise, over=ROWS, name=ELEMENTWISE))
        elementwise = (ELEMENTWISE,)
    mapping += [Parallel(ROWS, nest=n) for n in elementwise]
    return Layers(schedule=(*schedule, Hoist()),
                  mapping=threads_per_tile((*mapping, *_transposes(nests)), tiles))


def _gemms(nests, mr, nr, row_block, **gemm):
    """_tiled's layers, but on a GPU each product (row products, weight gradients) a
    tiled SIMT GEMM (moagen.kernels.gemm); the rest as _tiled runs it there (a thread per
    element of the forward's H, per row of the backward's fused elementwise nest, per row
    of a transpose)."""
    # (the loops outside the output tiles, the tiles' rows and columns, the axis summed,
    # the operands): a weight gradient sums over the batch too, its chunks the rows' within
    # an entry
    products = {**{label: (("b",), "i", cols, SUMMED[cols], GEMM_OPERANDS[label])
                   for label, cols in nests["rows"].items()},
                **{label: ((), rows, cols, "i", GEMM_OPERANDS[label])
                   for label, (rows, cols) in nests["weights"].items()}}
    return on_gemms(_tiled(nests, mr, nr, row_block),
                    _tiled(dict(nests, rows={}, weights={}, split=()), mr, nr, row_block=0),
                    products,
                    split={label: products[label][3] for label in nests["split"]}, **gemm)


# a 6 x 8 tile: 12 of the 16 vector registers hold accumulators (f64, AVX2); 96 rows of a
# 512-wide operand: 384 KiB, held in a 1 MiB L2. The tuner's choice between blocks of 96
# rows and none moved with the machine and the run, so the defaults stay as they were, on
# every target (docs/PERFORMANCE.md, "The MLP and the projections: register tiles")
TILE_DEFAULTS = {"mr": 6, "nr": 8, "row_block": 96}
TILE_SPACE = {"mr": (4, 6, 8), "nr": (8, 16, 32), "row_block": (0, 64, 96)}
# float32: a row of the tile in as many vector registers as float64's 8 columns take, so
# 16 columns (docs/PERFORMANCE.md, "The MLP and the projections: register tiles")
TILE_DTYPE_DEFAULTS = {"float32": {"nr": 16}}
# AVX-512's 32 vector registers hold 8 x 2 of a row's registers as accumulators (16); on
# AVX2 they would spill. Blocks of 64 rows (8 tiles of 8) split a power of two of rows into
# blocks the threads share evenly (1024 rows: 16 blocks; in 96's 11, one thread took 6)
# (docs/PERFORMANCE.md, "The MLP and the projections: register tiles")
TILE_AVX512 = {"float64": {"mr": 8, "nr": 16, "row_block": 64},
               "float32": {"mr": 8, "nr": 32, "row_block": 64}}


def _whole_tiles(mr, nr, row_block, **gemm):
    """A row block holds whole tiles of mr rows."""
    return row_block % mr == 0


# a GPU: a thread per 2 x 4 tile and no row blocks (the CPU's cache blocking), so that
# even the tiny LM's 1024 x 160 products run 20480 threads; not yet timed on a GPU
TILE_CUDA = {"mr": 2, "nr": 4, "row_block": 0}
# mr x nr stay TILE_CUDA's on a GPU: OpenACC's tiles (a vector lane each); CUDA's products
# are GEMMs (moagen.kernels.gemm.GEMM)


def _tunable(temps, nests, gemm=GEMM_SPLIT, cuda_dtypes=None, kinds=tuple(KINDS)):
    """The CPU takes no GEMM blocks: the GPU's defaults stand there (unused). gemm: CUDA's
    GEMMs' parameters (moagen.kernels.gemm: GEMM_SPLIT's SIMT, TENSOR's on tensor cores)."""
    return Tunable(temps, lambda **params: _gemms(nests, **{**gemm, **params}), TILE_DEFAULTS,
                   TILE_SPACE, cuda={**TILE_CUDA, **gemm}, dtypes=TILE_DTYPE_DEFAULTS,
                   cuda_dtypes=cuda_dtypes or {}, avx512=TILE_AVX512, accepts=_whole_tiles,
                   kinds=kinds)


FORWARD_VARIANTS = {
    # dot products along the model axis, as plain triple loops
    "naive": (FORWARD_TEMPS, _plain(FORWARD)),
    "tiled": _tunable(FORWARD_TEMPS, FORWARD),
    # tiled, CUDA's products on tensor cores; CUDA only
    "tensor": _tunable(FORWARD_TEMPS, FORWARD, TENSOR_SPLIT, TENSOR_DTYPES, TENSOR_KINDS),
}
BACKWARD_VARIANTS = {
    "naive": (BACKWARD_TEMPS, _plain(BACKWARD)),
    "tiled": _tunable(BACKWARD_TEMPS, BACKWARD),
    "tensor": _tunable(BACKWARD_TEMPS, BACKWARD, TENSOR_SPLIT, TENSOR_DTYPES, TENSOR_KINDS),
}

SPECS = (forward_spec(), backward_spec())
KERNELS = [(SPECS[0], FORWARD_VARIANTS), (SPECS[1], BACKWARD_VARIANTS)]
# the variant CUDA runs where none is named (moagen.kernels.Kernel.default_variant)
DEVICE_DEFAULTS = {name: TENSOR_CORES for name in ("mlp_fwd", "mlp_bwd")}
# the name a derived backward has (moagen.kernels.ALIASES)
ALIASES = {"mlp_fwd_vjp": "mlp_bwd"}
# a stage's backward in a composite (moagen.kernels.chain)
CHAIN = {"mlp_fwd": backward(*SPECS, "tiled")}


def _forward_products(arrays, scalars):
    """The backward's U and V are the forward's X Wg and X Wu."""
    return dict(arrays, U=arrays["X"] @ arrays["Wg"], V=arrays["X"] @ arrays["Wu"])


# What verification and the benchmarks run these kernels on (moagen.kernels.cases): one
# row, a partial row tile, widths below and past a tile (TILE_DEFAULTS).
CHECK_SIZES = (dict(batch=1, n=1, dm=3, dff=5), dict(batch=2, n=7, dm=13, dff=19),
               dict(batch=1, n=37, dm=80, dff=203))
CHECKS = {"mlp_fwd": Check(references(reference_block.mlp_fwd_numpy,
                                      reference_block.mlp_fwd_torch), CHECK_SIZES),
          "mlp_bwd": Check(references(reference_block.mlp_bwd_numpy,
                                      reference_block.mlp_bwd_torch), CHECK_SIZES,
                           inputs=_forward_products)}
BENCH = {"mlp_fwd": on_model("dm", "dff").measured_against(
             "mlp", "F, U and V by three matmuls and F.silu"),
         "mlp_bwd": on_model("dm", "dff").measured_against(
             "mlp_bwd", "dX, dWg, dWu, dWd by autograd, the forward recomputed (U, V unused)")}
