"""The block's glue: the Q, K, V projections into heads, the output projection with the
residual, their backwards, and the residual sum.

Weights are stored as PyTorch's (d_model, heads * d_head) matrices viewed per head:
Wq, Wk, Wv (dm, heads, dh) and Wo (heads, dh, dm). Per (batch, head):

    Q = X Wq[:, h, :]                      Y = R + sum_h O[h] Wo[h]
    dX = sum_h (dQ Wq^T + dK Wk^T + dV Wv^T)[h],  dWq[:, h, :] = sum_b X^T dQ[h]
    dO[h] = dY Wo[h]^T,                     dWo[h] = sum_b O[h]^T dY

The backwards are derived from the forwards (moagen.moa.grad). Every product is register
tiled (moagen.steps.loop.tiling), mr x nr as the MLP's tiles and with their per-dtype defaults (in
float32 16 columns: a row of the tile in as many vector registers as float64's 8 take); a
weight that would be read across its rows is first stored transposed, once, and so is X for
the weight gradients (XT, once per batch entry, as the MLP's backward stores it), so that
every tile reads contiguous rows.
"""
from moagen import reference_block
from moagen.kernels.cases import Check, on_model, references
from moagen.kernels.chain import backward, summing
from moagen.kernels.gemm import (GEMM, GEMM_SPLIT, TENSOR, TENSOR_CORES, TENSOR_DTYPES,
                                  TENSOR_KINDS, TENSOR_SPLIT, on_gemms)
from moagen.kernels.layers import Layers, cpu, threads_per_tile
from moagen.kernels.mlp import TILE_CUDA, TILE_DEFAULTS, TILE_DTYPE_DEFAULTS, TILE_SPACE
from moagen.kernels.tunable import Tunable
from moagen.kinds import KINDS
from moagen.moa.expr import array, inner, lift, named, psi, reduce, transpose
from moagen.moa.grad import grad
from moagen.moa.rewrites import transform_outputs
from moagen.moa.spec import KernelSpec, Output
from moagen.steps.loop.interchange import Reorder
from moagen.steps.loop.parallel import Parallel
from moagen.steps.loop.tiling import RegisterTile

X = array("X", "batch", "n", "dm")
R = array("R", "batch", "n", "dm")
WQ, WK, WV = (array(w, "dm", "heads", "dh") for w in ("Wq", "Wk", "Wv"))
WO = array("Wo", "heads", "dh", "dm")
O = array("O", "batch", "heads", "n", "dh")
BH, BH_EXTENTS = ("b", "h"), ("batch", "heads")
HEAD_ROWS = ("b", "h", "i", "c")  # an array of per-head rows


def _per_head(w):
    """W[:, h, :] for every head: (dm, heads, dh) -> (heads, dm, dh)."""
    return transpose(w, (1, 0, 2))


def _sum_heads(per_head):
    """sum_h of a per-head (n, dm) product, inside a batch entry."""
    return reduce("+", lift(("h",), ("heads",), per_head), axis=0, var="h", name="heads_sum")


def _row_tiles(nest, cols, mr, nr):
    """A product over rows i of a (b[, h]) slice: tiled, parallel over b[, h] and column
    tiles (its tail over b[, h] and rows)."""
    outer = ("b", "h") if cols == "c" else ("b",)
    return _tiles(RegisterTile(nest, "i", cols, mr, nr), outer)


def _tiles(tile, outer):
    """(the tile, its mapping, the outer loops): parallel over the outer loops and column
    tiles, the tail over the outer loops and rows."""
    return tile, (Parallel(outer + (tile.col_tiles,), nest=tile.nest),
                  Parallel(outer + (tile.rows,), nest=tile.edge)), outer


def _layers(*tiled, reorder=(), mapping=()):
    """The layers of a variant made of register tiles (triples from _tiles), after the loop
    reorderings they need; a GPU runs a thread per tile (threads_per_tile)."""
    return Layers(schedule=tuple(reorder) + tuple(t for t, _, _ in tiled),
                  mapping=threads_per_tile((*(m for _, ms, _ in tiled for m in ms), *mapping),
                                           {t.nest: outer + t.tiles for t, _, outer in tiled}))


# the MLP's tile parameters except its row blocks (these products' rows are a head's or a
# batch entry's, not blocked); AVX-512's wider tiles are the MLP's alone so far (not
# measured on these products)
TILE_PARAMS = ("mr", "nr")


def _tunable(temps, layers, gemms=None, gemm=GEMM, cuda_dtypes=None, split=None, rest=(),
             reorder=(), kinds=tuple(KINDS)):
    """A variant whose tiles are mr x nr: layers(mr, nr) gives its Layers. gemms (label ->
    moagen.kernels.gemm.on_gemms' product): on CUDA, those products tiled GEMMs of the
    parameters `gemm` (GEMM's SIMT, TENSOR's on tensor cores), the variant having no other
    nest but those `rest` maps (CPU steps, the GPU's derived: a weight's transpose), after
    the CPU's loop orders `reorder` (a product's loops as on_gemms takes them); split:
    on_gemms' (the products whose sums are cut into gemm's parts)."""
    pick = lambda params: {k: params[k] for k in TILE_PARAMS if k in params}
    if gemms:
        tiled, defaults = layers, gemm
        others = Layers(schedule=tuple(reorder), mapping=cpu(*rest))
        layers = lambda mr, nr, **gemm: on_gemms(tiled(mr, nr), others, gemms, split=split,
                                                 **{**defaults, **gemm})
    return Tunable(temps, layers, pick(TILE_DEFAULTS), pick(TILE_SPACE),
                   cuda={**pick(TILE_CUDA), **(gemm if gemms else {})},
                   dtypes={d: pick(p) for d, p in TILE_DTYPE_DEFAULTS.items()},
                   cuda_dtypes=cuda_dtypes or {}, kinds=kinds)


QKV = KernelSpec(
    name="qkv_proj",
    inputs=(X, WQ, WK, WV),
    scalars=(),
    outputs=tuple(Output(name, lift(BH, BH_EXTENTS, inner(psi(("b",), X),
                                                          psi(("h",), _per_head(w)), var="m",
                                                          name="xw")), HEAD_ROWS)
                  for name, w in (("Q", WQ), ("K", WK), ("V", WV))),
)
# on CUDA a block per (batch entry, head) and 32 x 64 tile of a head's rows, summing over m
QKV_GEMMS = {o: (BH, "i", "c", "m", ("X", f"W{o.lower()}")) for o in ("Q", "K", "V")}
QKV_TILES = lambda mr, nr: _layers(*(_row_tiles(o, "c", mr, nr) for o in ("Q", "K", "V")))
# tensor: tiled, CUDA's products on tensor cores (float64 DMMA, float32 3xTF32); CUDA only
# split-K: a head's 2048 x 64 outputs are 64 tiles, 512 blocks at the bench's sizes (0.43
# of a wave, float32); each sum over m in parts (moagen.kernels.gemm.GEMM_SPLIT)
QKV_VARIANTS = {"tiled": _tunable(frozenset(), QKV_TILES, gemms=QKV_GEMMS, gemm=GEMM_SPLIT,
                                  split={o: "m" for o in QKV_GEMMS}),
                "tensor": _tunable(frozenset(), QKV_TILES, QKV_GEMMS, TENSOR_SPLIT, TENSOR_DTYPES,
                                   split={o: "m" for o in QKV_GEMMS}, kinds=TENSOR_KINDS)}


# how the backwards are derived (moagen.moa.grad; `moagen grad qkv_proj`): dX and each
# weight's gradient, the residual R passed through (its gradient is dY itself)
WEIGHT_INDEX = ("m", "h", "c")
VJP = {"qkv_proj": dict(wrt={"X": ("b", "i", "m"), "Wq": WEIGHT_INDEX, "Wk": WEIGHT_INDEX,
                             "Wv": WEIGHT_INDEX}),
       "out_proj": dict(wrt={"O": HEAD_ROWS, "Wo": ("h", "c", "m")}, cotangents=("Y",))}


def _derived(forward, weights, head, perm, index):
    """forward's backward, derived, with the weights' per-head slices W[h] (as `head(W)`
    reads them) that it reads transposed stored so once, Named `<W>T` (`perm` of W, `index`
    its names), and a batch entry's X read transposed (qkv_proj's weight gradients) Named
    XT: every tile of a product then reads contiguous rows."""
    stored = {transpose(head(w)): psi(("h",), named(f"{w.name}T", transpose(w, perm), index=index))
              for w in weights}
    x_rows = psi(("b",), X)
    stored[transpose(x_rows)] = named("XT", transpose(x_rows), index=("m", "i"))
    derived = grad(forward, name=f"{forward.name}_bwd", **VJP[forward.name])
    return transform_outputs(derived, stored.get)


QKV_BWD = _derived(QKV, (WQ, WK, WV), lambda w: psi(("h",), _per_head(w)), (1, 2, 0),
                   ("h", "c", "m"))
WEIGHT_ORDER = ("h", "m", "c")  # a weight gradient's loops: head outermost, then its rows
QKV_BWD_STORED = frozenset({"WqT", "WkT", "WvT", "XT"})  # what its variant stores
WEIGHT_REORDER = tuple(Reorder(WEIGHT_ORDER, nest=f"d{w}") for w in ("Wq", "Wk", "Wv"))
TRANSPOSES = tuple(Parallel(("h",), nest=f"{w}T") for w in ("Wq", "Wk", "Wv")) + \
    (Parallel(("b", "m"), nest="XT"),)
# on CUDA a thread an element of a transpose (the CPU's thread a head is 8 GPU threads
# copying 32768 elements each at the bench's sizes), consecutive threads writing along a row
GPU_TRANSPOSES = tuple(Parallel(("h", "c", "m"), nest=f"{w}T") for w in ("Wq", "Wk", "Wv")) + \
    (Parallel(("b", "m", "i"), nest="XT"),)
# on CUDA dX a block per (part of the heads x batch entry, 32 x 64 tile of its rows), its
# three sums over c merged into one (MergeSums) staging six operands' chunks; each
# weight's gradient a block per (part of the rows x head, 32 x 64 tile of the head's
# dm x dh weight), summed over every row: a weight's 8 x 16 x 1 tiles are 128 blocks
# whole at the bench's sizes, so both cut into 8 parts
QKV_BWD_GEMMS = {"dX": (("b",), "i", "m", "c", ("dQ", "WqT", "dK", "WkT", "dV", "WvT")),
                 **{f"d{w}": (("h",), "m", "c", "i", ("XT", f"d{w[1].upper()}"))
                    for w in ("Wq", "Wk", "Wv")}}
QKV_BWD_VARIANTS = {"tiled": _tunable(QKV_BWD_STORED, lambda mr, nr: _layers(
    _row_tiles("dX", "m", mr, nr),
    *(_tiles(RegisterTile(f"d{w}", "m", "c", mr, nr), ("h",)) for w in ("Wq", "Wk", "Wv")),
    reorder=WEIGHT_REORDER, mapping=TRANSPOSES), gemms=QKV_BWD_GEMMS,
    gemm={**GEMM_SPLIT, "parts": 8}, split={"dX": "h", "dWq": "i", "dWk": "i", "dWv": "i"},
    rest=GPU_TRANSPOSES, reorder=WEIGHT_REORDER)}


OUT = KernelSpec(
    name="out_proj",
    inputs=(O, WO, R),
    scalars=(),
    outputs=(Output("Y", lift(("b",), ("batch",), psi(("b",), R) + _sum_heads(
        inner(psi(("b", "h"), O), psi(("h",), WO), var="c", name="ow"))), ("b", "i", "m")),),
)
# on CUDA a block per (part of the heads, batch entry, 32 x 64 tile of Y), each head's sum
# over c in chunks: Y's 2048 x 512 are 512 tiles at the bench's sizes (0.55 of a wave
# whole, float32), so the sum over the heads is cut into parts, the residual R added once
# with the parts (SplitK's term)
OUT_GEMMS = {"Y": (("b",), "i", "m", "c", ("O", "Wo"))}
OUT_TILES = lambda mr, nr: _layers(_row_tiles("Y", "m", mr, nr))
OUT_VARIANTS = {"tiled": _tunable(frozenset(), OUT_TILES, gemms=OUT_GEMMS, gemm=GEMM_SPLIT,
                                  split={"Y": "h"}),
                "tensor": _tunable(frozenset(), OUT_TILES, OUT_GEMMS, TENSOR_SPLIT, TENSOR_DTYPES,
                                   split={"Y": "h"}, kinds=TENSOR_KINDS)}


OUT_BWD = _derived(OUT, (WO,), lambda w: psi(("h",), w), (0, 2, 1), ("h", "m", "c"))


# on CUDA dO a block per (part of the sum over m x batch entry x head, 32 x 64 tile of a
# head's rows), dWo a block per (part of the rows, head, 32 x 64 tile of its weight):
# both have few output tiles (a weight's 8 x 512 x 64: 128 blocks whole at the bench's
# sizes), their sums cut into 8 parts; the transpose WoT a thread an element (as
# GPU_TRANSPOSES)
OUT_BWD_GEMMS = {"dO": (BH, "i", "c", "m", ("dY", "WoT")),
                 "dWo": (("h",), "c", "m", "i", ("O", "dY"))}
OUT_BWD_VARIANTS = {"tiled": _tunable(frozenset({"WoT"}), lambda mr, nr: _layers(
    _row_tiles("dO", "c", mr, nr), _tiles(RegisterTile("dWo", "c", "m", mr, nr), ("h",)),
    mapping=(Parallel(("h",), nest="WoT"),)), gemms=OUT_BWD_GEMMS,
    gemm={**GEMM_SPLIT, "parts": 8}, split={"dO": "m", "dWo": "i"},
    rest=(Parallel(("h", "m", "c"), nest="WoT"),))}


RESIDUAL = array("x", "batch", "n", "dm")
ADD = KernelSpec(name="residual_add", inputs=(RESIDUAL, R), scalars=(),
                 outputs=(Output("y", RESIDUAL + R, ("b", "i", "m")),))
ROWS = Layers(mapping=cpu(Parallel(("b", "i"))))

KERNELS = [(QKV, QKV_VARIANTS), (QKV_BWD, QKV_BWD_VARIANTS), (OUT, OUT_VARIANTS),
           (OUT_BWD, OUT_BWD_VARIANTS), (ADD, {"dnf": (frozenset(), ROWS)})]
# the variant CUDA runs where none is named (moagen.kernels.Kernel.default_variant)
DEVICE_DEFAULTS = {name: TENSOR_CORES for name in ("qkv_proj", "out_proj")}
# the names a derived backward has (moagen.kernels.ALIASES)
ALIASES = {"qkv_proj_vjp": "qkv_proj_bwd", "out_proj_vjp": "out_proj_bwd"}
# a stage's backward in a composite (moagen.kernels.chain); a residual's gradient is the
# cotangent of the sum it is in
CHAIN = {"qkv_proj": backward(QKV, QKV_BWD, "tiled"),
         "out_proj": backward(OUT, OUT_BWD, "tiled", passes={"R": "Y"}),
         "residual_add": backward(ADD, passes={"x": "y", "R": "y"})}
# what adds two terms of a cotangent
SUM = summing(ADD, "dnf", x="x", r="R")

# What verification and the benchmarks run these kernels on (moagen.kernels.cases).
CHECK_SIZES = (dict(batch=1, n=1, dm=3, heads=1, dh=2), dict(batch=2, n=7, dm=13, heads=3, dh=5),
               dict(batch=1, n=37, dm=80, heads=2, dh=19))
CHECKS = {
    "qkv_proj": Check(references(reference_block.qkv_proj_numpy,
                                 reference_block.qkv_proj_torch), CHECK_SIZES),
    "qkv_proj_bwd": Check(references(reference_block.qkv_proj_bwd_numpy,
                                     reference_block.qkv_proj_bwd_torch), CHECK_SIZES),
    "out_proj": Check(references(reference_block.out_proj_numpy,
                                 reference_block.out_proj_torch), CHECK_SIZES),
    "out_proj_bwd": Check(references(reference_block.out_proj_bwd_numpy,
                                     reference_block.out_proj_bwd_torch), CHECK_SIZES),
    "residual_add": Check(references(reference_block.residual_add_numpy,
                                     reference_block.residual_add_torch),
                          tuple({k: s[k] for k in ("batch", "n", "dm")} for s in CHECK_SIZES)),
}
_ON_HEADS = on_model("dm", "heads", "dh")
BENCH = {"qkv_proj": _ON_HEADS.measured_against(
             "qkv_proj", "Q, K, V by a matmul each, as (batch, heads, n, dh) views"),
         "qkv_proj_bwd": _ON_HEADS.measured_against(
             "qkv_proj_bwd", "dX, dWq, dWk, dWv by the matmuls autograd runs, without a "
                             "forward"),
         "out_proj": _ON_HEADS.measured_against("out_proj", "R + O Wo by one addmm"),
         "out_proj_bwd": _ON_HEADS.measured_against(
             "out_proj_bwd", "dO, dWo by the matmuls autograd runs, without a forward"),
         "residual_add": on_model("dm").measured_against("residual_add", "x + r")}
