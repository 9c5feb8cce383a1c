"""The gated (SwiGLU) MLP of a transformer block, per (batch, position) row:

    U = X Wg,  V = X Wu,  H = silu(U) * V,  F = H Wd

The forward keeps only U for the backward, which recomputes V and H from X and U:

    dH = dF Wd^T,  dV = dH * silu(U),  dU = dH * V * silu'(U)
    dWd = H^T dF,  dWg = X^T dU,  dWu = X^T dV,  dX = dU Wg^T + dV Wu^T

with silu'(u) = sigmoid(u) * (1 + u * (1 - sigmoid(u))). H is computed transposed (HT), and
X is copied transposed (XT), so that the weight gradients, sums over the rows, read their
row operand along contiguous memory. Every inner product is register tiled in the `tiled`
variants; the weight gradients are sums over all rows computed by
whole output tiles, so each thread owns the weights it writes: no atomics, and every sum
runs over the rows in one fixed order.
"""
from moagen import reference_block
from moagen.kernels.cases import Check, on_model, references
from moagen.kernels.layers import Layers, cpu
from moagen.kernels.tunable import Tunable
from moagen.moa.expr import array, exp, inner, lift, named, psi, reduce, silu, transpose
from moagen.moa.grad import grad
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.schedule import Hoist, Parallel
from moagen.onf.tiling import RegisterTile

X = array("X", "batch", "n", "dm")
WG = array("Wg", "dm", "dff")
WU = array("Wu", "dm", "dff")
WD = array("Wd", "dff", "dm")
U = array("U", "batch", "n", "dff")
DF = array("dF", "batch", "n", "dm")
B = ("b",)
ROW_E, ROW_C = ("i", "e"), ("i", "c")  # e: the hidden (d_ff) axis, c: the model axis


def sigmoid(u):
    return 1.0 / (1.0 + exp(-u))


def forward_parts(x):
    """U and H of one batch entry's rows."""
    u = named("U", inner(x, WG, var="c", name="xg"), index=ROW_E)
    # V named as well: the derived backward can then store it rather than recompute it
    h = named("H", silu(u) * named("V", inner(x, WU, var="c", name="xu"), index=ROW_E),
              index=ROW_E)
    return u, h


def forward_spec() -> KernelSpec:
    u, h = forward_parts(psi(B, X))
    return KernelSpec(
        name="mlp_fwd",
        inputs=(X, WG, WU, WD),
        scalars=(),
        outputs=(Output("F", lift(B, ("batch",), inner(h, WD, var="e", name="hw")),
                        ("b", "i", "c")),
                 Output("U", lift(B, ("batch",), u), ("b",) + ROW_E)),
    )


def _over_rows(per_batch, name):
    """A weight's gradient: the per-batch products a^T b summed over the batch."""
    return reduce("+", lift(B, ("batch",), per_batch), axis=0, var="b", name=name)


def _transposed(w, label):
    """A weight stored transposed once, so that every product runs along contiguous rows."""
    return named(label, transpose(w), index=("e", "c") if w is not WD else ("c", "e"))


def backward_spec() -> KernelSpec:
    x, u, df = (psi(B, a) for a in (X, U, DF))
    v = named("V", inner(x, WU, var="c", name="xu"), index=ROW_E)
    # the weight gradients' row operands, stored transposed (as the weights are for dX):
    # a register tile then reads them along contiguous rows, not one row apart per step
    xt = named("XT", transpose(x), index=("c", "i"))
    ht = named("HT", transpose(silu(u) * v), index=("e", "i"))
    dh = named("dH", inner(df, _transposed(WD, "WdT"), var="c", name="dfw"), index=ROW_E)
    sig = sigmoid(u)
    dv = named("dV", dh * silu(u), index=ROW_E)
    du = named("dU", dh * v * sig * (1.0 + u * (1.0 - sig)), index=ROW_E)
    dx = (inner(du, _transposed(WG, "WgT"), var="e", name="dug")
          + inner(dv, _transposed(WU, "WuT"), var="e", name="dvu"))
    return KernelSpec(
        name="mlp_bwd",
        inputs=(X, WG, WU, WD, U, DF),
        scalars=(),
        outputs=(
            Output("dX", lift(B, ("batch",), dx), ("b", "i", "c")),
            Output("dWg", _over_rows(inner(xt, du, var="i", name="xdu"), "batch_g"), ("c", "e")),
            Output("dWu", _over_rows(inner(xt, dv, var="i", name="xdv"), "batch_u"), ("c", "e")),
            Output("dWd", _over_rows(inner(ht, df, var="i", name="hdf"), "batch_d"), ("e", "c")),
        ),
    )


FORWARD_TEMPS = frozenset({"H"})
BACKWARD_TEMPS = frozenset({"V", "XT", "HT", "dH", "dV", "dU", "WdT", "WgT", "WuT"})
ROWS = ("b", "i")
# the nests of each kernel: row-wise products (tiled rows x cols), weight gradients (tiled
# weight rows x cols), elementwise row nests, the weights' transposes (weight rows) and the
# per-batch transposes of row operands (their rows)
FORWARD = {"rows": {"U": "e", "H": "e", "F": "c"}, "weights": {}, "elementwise": (),
           "transposes": {}, "row_transposes": {}}
BACKWARD = {"rows": {"dH": "e", "V": "e", "dX": "c"},
            "weights": {"dWg": ("c", "e"), "dWu": ("c", "e"), "dWd": ("e", "c")},
            "elementwise": ("dV", "dU"), "transposes": {"WdT": "c", "WgT": "e", "WuT": "e"},
            "row_transposes": {"XT": "c", "HT": "e"}}


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
    weight gradients over the weight's column tiles; the rest as in _plain."""
    schedule, mapping = [], []
    for label, cols in nests["rows"].items():
        tile = RegisterTile(label, "i", cols, mr, nr, row_block=row_block)
        schedule.append(tile)
        if row_block:  # the tail's rows run as the blocks do
            mapping.append(Parallel(("b", tile.row_blocks), nest=label))
        else:
            mapping += [Parallel(("b", tile.col_tiles), nest=label),
                        Parallel(ROWS, nest=tile.edge)]
    for label, (rows, cols) in nests["weights"].items():
        tile = RegisterTile(label, rows, cols, mr, nr)
        schedule.append(tile)
        mapping += [Parallel((tile.col_tiles,), nest=label), Parallel((rows,), nest=tile.edge)]
    mapping += [Parallel(ROWS, nest=n) for n in nests["elementwise"]]
    return Layers(schedule=(*schedule, Hoist()), mapping=cpu(*mapping, *_transposes(nests)))


# a 6 x 8 tile: 12 of the 16 vector registers hold accumulators (f64, AVX2); 96 rows of a
# 512-wide operand: 384 KiB, held in a 1 MiB L2. The tuner's choice between blocks of 96
# rows and none moved with the machine and the run (within 5% on both kinds seen), so the
# defaults stay as they were, on every target
TILE_DEFAULTS = {"mr": 6, "nr": 8, "row_block": 96}
TILE_SPACE = {"mr": (4, 6, 8), "nr": (8, 16), "row_block": (0, 96)}


def _tunable(temps, nests):
    return Tunable(temps, lambda **params: _tiled(nests, **params), TILE_DEFAULTS, TILE_SPACE)


FORWARD_VARIANTS = {
    # dot products along the model axis, as plain triple loops
    "naive": (FORWARD_TEMPS, _plain(FORWARD)),
    "tiled": _tunable(FORWARD_TEMPS, FORWARD),
}
BACKWARD_VARIANTS = {
    "naive": (BACKWARD_TEMPS, _plain(BACKWARD)),
    "tiled": _tunable(BACKWARD_TEMPS, BACKWARD),
}

# the backward derived from the forward (moagen.moa.grad; `moagen grad mlp_fwd`): dF given,
# U kept. It has V, H, and the cotangents dH, dV and dU, as Named intermediates, but not the
# transposed copies (XT, HT, WdT, ...) the tiled variant of mlp_bwd reads: it has the plain
# variant only, and the hand-written mlp_bwd stays (docs: /work/notes/issue-24.md)
VJP = {"mlp_fwd": dict(wrt={"X": ("b",) + ROW_C, "Wg": ("c", "e"), "Wu": ("c", "e"),
                            "Wd": ("e", "c")}, cotangents=("F",))}
DERIVED = {"rows": {"V": "e", "H": "e", "dH": "e", "dV": "e", "dU": "e", "dX": "c"},
           "weights": {"dWg": ("c", "e"), "dWu": ("c", "e"), "dWd": ("e", "c")},
           "elementwise": (), "transposes": {}, "row_transposes": {}}

KERNELS = [(forward_spec(), FORWARD_VARIANTS), (backward_spec(), BACKWARD_VARIANTS),
           (grad(forward_spec(), **VJP["mlp_fwd"]),
            {"naive": (frozenset({"V", "H", "dH", "dV", "dU"}), _plain(DERIVED))})]


def _forward_u(arrays, scalars):
    """The backward's U is the forward's X Wg."""
    return dict(arrays, U=arrays["X"] @ arrays["Wg"])


# What verification and the benchmarks run these kernels on (moagen.kernels.cases): one
# row, a partial row tile, widths below and past a tile (TILE_DEFAULTS).
CHECK_SIZES = (dict(batch=1, n=1, dm=3, dff=5), dict(batch=2, n=7, dm=13, dff=19),
               dict(batch=1, n=37, dm=80, dff=203))
CHECKS = {"mlp_fwd": Check(references(reference_block.mlp_fwd_numpy,
                                      reference_block.mlp_fwd_torch), CHECK_SIZES),
          "mlp_bwd": Check(references(reference_block.mlp_bwd_numpy,
                                      reference_block.mlp_bwd_torch), CHECK_SIZES,
                           inputs=_forward_u)}
BENCH = {"mlp_fwd": on_model("dm", "dff").measured_against(
             "mlp", "F and U by three matmuls and F.silu"),
         "mlp_bwd": on_model("dm", "dff").measured_against(
             "mlp_bwd", "dX, dWg, dWu, dWd by autograd, the forward recomputed (U unused)")}
CHECKS["mlp_fwd_vjp"] = CHECKS["mlp_bwd"]  # the same inputs, in the same order
BENCH["mlp_fwd_vjp"] = BENCH["mlp_bwd"]
