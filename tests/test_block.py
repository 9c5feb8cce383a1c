"""The block family: every schedule step of the new kernels keeps the value (run by the ONF
interpreter against numpy), the structure RegisterTile and PartialSums promise, the
block's composition and its retention list, and the errors a user meets."""
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import sympy

from moagen import reference_block, runtime
from moagen.emit import emit
from moagen.pipeline import onf_of
from moagen.errors import ScheduleError, SpecError
from moagen.kernels import get_kernel
from moagen.kernels.block import BACKWARD, FORWARD
from moagen.kernels.compose import Stage, compose
from moagen.kernels.mlp import TILE_DEFAULTS
from moagen.moa import scalar as S
from moagen.onf.interpret import run_onf
from moagen.onf.loops import Let, Loop, Store, Update, stmt_exprs, walk
from moagen.onf.realize import initial_onf
from moagen.steps.algebra.partials import PartialSums
from moagen.steps.loop.layout import ApplyLayout
from moagen.steps.loop.reductions import LowerReductions
from moagen.steps.loop.tiling import RegisterTile

rng = np.random.default_rng(5)
normal = lambda *shape: rng.standard_normal(shape)
# rows past one 4-row tile and not a multiple of it; columns past one 8-column tile
X, WG, WU, WD = normal(2, 5, 3), normal(3, 10), normal(3, 10), normal(10, 3)
U, V, DF = X @ WG, X @ WU, normal(2, 5, 3)
XR, WEIGHT, DZ = normal(2, 19, 3), normal(3), normal(2, 19, 3)  # 19 rows: uneven parts
INV_RMS = 1 / np.sqrt((XR * XR).mean(-1) + 0.1)
WQ, WK, WV, WO = normal(3, 2, 9), normal(3, 2, 9), normal(3, 2, 9), normal(2, 9, 3)
HEADS = [normal(2, 2, 5, 9) for _ in range(3)]

PROBLEMS = {  # inputs by name, the numpy result in the kernel's output order
    "mlp_fwd": ({"X": X, "Wg": WG, "Wu": WU, "Wd": WD}, reference_block.mlp_fwd_numpy),
    "mlp_bwd": ({"X": X, "Wg": WG, "Wu": WU, "Wd": WD, "U": U, "V": V, "dF": DF},
                reference_block.mlp_bwd_numpy),
    "rmsnorm_bwd": ({"x": XR, "weight": WEIGHT, "inv_rms": INV_RMS, "dz": DZ},
                    reference_block.rmsnorm_bwd_numpy),
    "qkv_proj": ({"X": X, "Wq": WQ, "Wk": WK, "Wv": WV}, reference_block.qkv_proj_numpy),
    "qkv_proj_bwd": ({"X": X, "Wq": WQ, "Wk": WK, "Wv": WV, "dQ": HEADS[0], "dK": HEADS[1],
                      "dV": HEADS[2]}, reference_block.qkv_proj_bwd_numpy),
    "out_proj": ({"O": HEADS[0], "Wo": WO, "R": X}, reference_block.out_proj_numpy),
    "out_proj_bwd": ({"O": HEADS[0], "Wo": WO, "dY": DF}, reference_block.out_proj_bwd_numpy),
}
STEPPED = [(k, v) for k in PROBLEMS for v in get_kernel(k).variants_on("cpu")]


def _expected(kernel):
    arrays, reference = PROBLEMS[kernel]
    result = reference(*arrays.values())
    result = result if isinstance(result, tuple) else (result,)
    return dict(zip([b.name for b in onf_of(kernel).outputs], result))


@pytest.mark.parametrize("kernel, variant", STEPPED)
def test_every_step_of_the_new_schedules_keeps_the_value(kernel, variant):
    k = get_kernel(kernel)
    onf = initial_onf(k.dnf(variant), variant)
    want = _expected(kernel)
    steps = [("initial", onf)]
    for transform in k.variant(variant).steps():
        onf = transform(onf)
        steps.append((str(transform), onf))
    steps.append(("lowered", ApplyLayout()(LowerReductions()(onf))))
    for name, stage in steps:
        got = run_onf(stage if stage.flat else ApplyLayout()(LowerReductions()(stage)),
                      PROBLEMS[kernel][0], {})
        for out in want:
            np.testing.assert_allclose(got[out], want[out], rtol=1e-12, atol=1e-13,
                                       err_msg=f"{out} after {name}")


# ---- register tiles -------------------------------------------------------------------

def test_register_tile_keeps_mr_by_nr_accumulators_and_an_edge_for_the_last_columns():
    onf = onf_of("mlp_fwd", "tiled")
    nests = {n.label: n for n in onf.nests}
    assert [n.label for n in onf.nests][:3] == ["U.pack_Wg", "U", "U.edge"]
    tile, edge, pack = nests["U"], nests["U.edge"], nests["U.pack_Wg"]
    accumulators = [s for s in walk(tile.body) if isinstance(s, Let) and s.name.startswith("acc_")]
    updates = [s for s in walk(tile.body) if isinstance(s, Update)]
    assert len(accumulators) == len(updates) == TILE_DEFAULTS["mr"] * TILE_DEFAULTS["nr"]
    sums = [s for s in walk(tile.body) if isinstance(s, Loop) and s.vector_tile]
    assert len(sums) == 1 and all(isinstance(s, Update) for s in sums[0].body)
    # row blocks, then column tiles, then the block's row tiles: the panel stays in L1
    # while a block of rows (in L2) passes over it
    assert [s.var.name for s in walk(tile.body) if isinstance(s, Loop)][:4] == \
        ["b", "i_blk", "e_tile", "i_tile"]
    # the tile reads the weight only from its panel, 8 consecutive numbers per step
    loads = {e.array for s in updates for e in S.subexpressions(s.value) if isinstance(e, S.Load)}
    assert loads == {"X", "Wg_panel"}
    assert ("Wg_panel", ("idiv(dff, 8)", "dm", "8")) in \
        [(b.name, tuple(map(str, b.shape))) for b in onf.temps]
    assert pack.body[0].parallel == 1
    edge_cols = next(s for s in walk(edge.body) if isinstance(s, Loop) and s.var.name == "e")
    assert str(edge_cols.start) == "8*idiv(dff, 8)"


def test_a_tile_of_merged_sums_runs_one_terms_loop_after_the_others():
    """dX = dU Wg^T + dV Wu^T: one set of accumulators, a loop over e for each product, so
    that the tile holds one product's operands at a time (both at once spilled on AVX2)."""
    nests = {n.label: n for n in onf_of("mlp_bwd", "tiled").nests}
    sums = [s for s in walk(nests["dX"].body) if isinstance(s, Loop) and s.vector_tile]
    operands = [{e.array for u in s.body for e in S.subexpressions(u.value)
                 if isinstance(e, S.Load)} for s in sums]
    assert operands == [{"dU", "WgT_panel"}, {"dV", "WuT_panel"}]
    assert [u.name for u in sums[0].body] == [u.name for u in sums[1].body]
    accumulators = [s for s in walk(nests["dX"].body) if isinstance(s, Let)]
    assert len(accumulators) == TILE_DEFAULTS["mr"] * TILE_DEFAULTS["nr"]


def test_a_tile_stores_its_sums_and_a_pointwise_nest_applies_the_rest():
    """Y = R + sum_h O[h] Wo[h]: the tile stores the sums (vector stores), a parallel nest over
    the tiled columns adds R (a vectorized loop); the edge columns compute the whole value."""
    nests = {n.label: n for n in onf_of("out_proj", "tiled").nests}
    assert list(nests) == ["Y.pack_Wo", "Y", "Y.pointwise", "Y.edge"]
    tile_stores = [s for s in walk(nests["Y"].body) if isinstance(s, Store)]
    assert all(isinstance(s.value, S.Local) for s in tile_stores)
    (apply,) = [s for s in walk(nests["Y.pointwise"].body) if isinstance(s, Store)]
    assert {e.array for e in S.subexpressions(apply.value) if isinstance(e, S.Load)} == \
        {"Y", "R"}
    cols = next(s for s in walk(nests["Y.pointwise"].body) if isinstance(s, Loop) and s.simd)
    assert str(cols.stop) == "8*idiv(dm, 8)" and nests["Y.pointwise"].body[0].parallel == 2
    # a plain sum: nothing to apply
    assert not any(label.endswith(".pointwise") for label in
                   (n.label for n in onf_of("mlp_fwd", "tiled").nests))


def test_weight_gradient_tiles_read_every_operand_along_contiguous_memory():
    """dWg = X^T dU sums over rows: X is copied transposed once (XT), H computed transposed
    (HT), so a tile's step along the rows moves one element in each operand's row (its
    packed panel: one panel row), not one row of X (dm elements) as X itself would."""
    nests = {n.label: n for n in onf_of("mlp_bwd", "tiled").nests}
    for label, rows_operand, panel in (("dWg", "XT", "dU_panel"), ("dWu", "XT", "dV_panel"),
                                       ("dWd", "HT", "dF_panel")):
        *_, k_loop = (s for s in walk(nests[label].body) if isinstance(s, Loop) and
                      s.vector_tile)  # the sum over the batch, then the one over its rows
        strides = {e.array: int(sympy.diff(e.offset, k_loop.var))
                   for s in walk(k_loop.body) if isinstance(s, Update)
                   for e in S.subexpressions(s.value) if isinstance(e, S.Load)}
        assert strides == {rows_operand: 1, panel: TILE_DEFAULTS["nr"]}, label
    assert "H" not in nests and "X" not in {b.name for b in onf_of("mlp_bwd", "tiled").temps}


def test_the_projections_weight_gradients_read_x_transposed():
    """dWq = X^T dQ per head, as the MLP's: X copied transposed once per batch entry (XT, not
    once per head), each tile's step along the rows one element of XT's row."""
    onf = onf_of("qkv_proj_bwd", "tiled")
    assert ("XT", ("batch", "dm", "n")) in [(b.name, tuple(map(str, b.shape))) for b in onf.temps]
    nests = {n.label: n for n in onf.nests}
    for label, panel in (("dWq", "dQ_panel"), ("dWk", "dK_panel"), ("dWv", "dV_panel")):
        *_, k_loop = (s for s in walk(nests[label].body) if isinstance(s, Loop) and
                      s.vector_tile)
        strides = {e.array: int(sympy.diff(e.offset, k_loop.var))
                   for s in walk(k_loop.body) if isinstance(s, Update)
                   for e in S.subexpressions(s.value) if isinstance(e, S.Load)}
        assert strides == {"XT": 1, panel: TILE_DEFAULTS["nr"]}, label


def test_a_tile_keeps_the_compiler_from_revectorizing_it():
    """A tile's loop runs its iterations one at a time (OpenMP `if(simd: 0)` in C,
    `!GCC$ novector` in Fortran): its statements are the vector code; the loops beside it
    stay vectorized."""
    c, fortran = emit("mlp_fwd", "tiled", "c"), emit("mlp_fwd", "tiled", "fortran")
    assert c.count("#pragma omp simd if(simd: 0)") == 2 * 3  # a tile per product, both dtypes
    assert fortran.count("!GCC$ novector") == 2 * 3
    assert "if(simd: 0)" not in emit("mlp_fwd", "naive", "c")


@pytest.mark.parametrize("transform, words", [
    (RegisterTile("inv_rms", "i", "c"), "perfectly nested loops ending in i, c"),
    (RegisterTile("z", "i", "c"), "exactly one sum"),
    (RegisterTile("z", "i", "c", mr=0), "at least 1"),
    (RegisterTile("z", "i", "c", mr=4, row_block=6), "multiple of 4 rows"),
    (RegisterTile("nope", "i", "c"), "has no nest 'nope'; it has inv_rms, z"),
])
def test_register_tile_refuses_what_is_not_a_contraction(transform, words):
    k = get_kernel("rmsnorm_fwd")
    with pytest.raises(ScheduleError, match=words):
        transform(initial_onf(k.dnf("naive"), "naive"))


def test_register_tile_refuses_a_sum_holding_sums_over_other_extents():
    """y[i, c] = sum_k A[i, k] sum_j C[k, j, c]: not one contraction (the inner sum is not
    merged into the outer one), so no panel could hold its operand."""
    from moagen.moa import expr as E
    from moagen.moa.dnf import psi_reduce
    from moagen.moa.spec import KernelSpec, Output
    a, c = E.array("A", "n", "k"), E.array("C", "k", "m", "p")
    spec = KernelSpec("nested", (a, c), (), (Output("y", E.inner(a, E.reduce("+", c, axis=1)),
                                                    ("i", "c")),))
    with pytest.raises(ScheduleError, match="holds sums of its own inside"):
        RegisterTile("y", "i", "c")(initial_onf(psi_reduce(spec), "nested"))


# ---- partial sums ---------------------------------------------------------------------

def test_dweight_is_summed_in_fixed_parts_without_atomics():
    onf = onf_of("rmsnorm_bwd")
    partial = next(n for n in onf.nests if n.label == "dweight.partial")
    assert partial.body[0].var.name == "i_part" and partial.body[0].parallel == 1
    assert str(partial.body[0].stop) == "16"
    assert not any(isinstance(s, Store) and s.atomic for n in onf.nests for s in walk(n.body))
    assert [(b.name, tuple(map(str, b.shape))) for b in onf.temps] == [("dweight_part", ("16", "d"))]


def test_partial_sums_refuses_a_nest_that_is_not_a_sum_over_its_axis():
    k = get_kernel("rmsnorm_bwd")
    onf = initial_onf(k.dnf("dnf"), "dnf")
    with pytest.raises(ScheduleError, match="not a sum over j"):
        PartialSums("dweight", "j", 4)(onf)
    with pytest.raises(ScheduleError, match="not loops around one store of a sum"):
        PartialSums("dx", "i", 4)(onf)


def test_partial_sums_run_a_row_nest_inside_the_parts():
    """dx's row loops are the parts' loops over b and i: one nest, dx's store inside it,
    x read once per row, and the values unchanged (the ONF interpreter at rows that leave
    the last part short)."""
    onf = onf_of("rmsnorm_bwd", "dnf")
    assert [n.label for n in onf.nests] == ["dweight.partial", "dweight"]
    stores = {s.array for s in walk(onf.nests[0].body) if isinstance(s, Store)}
    assert stores == {"dx", "dweight_part"}
    r = np.random.default_rng(5)
    x, dz = r.standard_normal((2, 2, 19, 6))
    w = r.standard_normal(6)
    inv_rms = 1 / np.sqrt((x * x).mean(-1) + 1e-5)
    arrays = dict(x=x, weight=w, inv_rms=inv_rms, dz=dz)
    got = run_onf(onf, arrays, {})
    want = reference_block.rmsnorm_bwd_numpy(x, w, inv_rms, dz)
    np.testing.assert_allclose(got["dx"], want[0], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(got["dweight"], want[1], rtol=1e-13, atol=1e-13)


def test_partial_sums_refuse_a_row_nest_over_other_rows():
    k = get_kernel("rmsnorm_bwd")
    onf = initial_onf(k.dnf("dnf"), "dnf")
    with pytest.raises(ScheduleError, match="does not start with loops over the rows"):
        PartialSums("dweight", "i", 4, rows="dweight")(onf)
    with pytest.raises(ScheduleError, match="has no nest 'dy'"):
        PartialSums("dweight", "i", 4, rows="dy")(onf)


def test_dweight_is_bitwise_the_same_on_one_and_two_threads():
    """Sixteen parts whatever the threads, each summed in one order, merged in order."""
    runtime.load("rmsnorm_bwd", "dnf", "c", "float64")  # built once, here
    script = ("import numpy as np, sys; from moagen import runtime; "
              "r = np.random.default_rng(1); x, dz = r.standard_normal((2, 2, 301, 64)); "
              "w = r.standard_normal(64); s = 1 / np.sqrt((x * x).mean(-1) + 1e-5); "
              "fn = runtime.load('rmsnorm_bwd', 'dnf', 'c', 'float64'); "
              "sys.stdout.write(fn(x, w, s, dz)[1].tobytes().hex())")
    outs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env=dict(os.environ, OMP_NUM_THREADS=str(t))).stdout for t in (1, 2)]
    assert outs[0] and outs[0] == outs[1]


# ---- the block ------------------------------------------------------------------------

def test_the_forward_keeps_per_row_statistics_and_the_mlps_two_products():
    assert FORWARD.kept() == ("inv_rms1", "Q", "K", "V", "attn", "lse", "resid", "inv_rms2", "U",
                              "Vu")
    onf = onf_of("block_fwd")
    shapes = {b.name: tuple(map(str, b.shape)) for b in onf.outputs}
    assert shapes["inv_rms1"] == shapes["inv_rms2"] == ("batch", "n")  # a number a row
    assert [b.name for b in onf.outputs] == ["y"] + list(FORWARD.kept())
    scratch = {b.name for b in onf.temps}
    assert {"xn1", "xn2", "mlp_H"} <= scratch  # x / r and the MLP's H are never returned
    # the backward recomputes x / r, and H (transposed) of the MLP, from what was kept
    backward = onf_of("block_bwd")
    assert {"xn1", "xn2", "mlp_H", "mlp_HT"} <= {b.name for b in backward.temps}
    assert not {"xn1", "xn2", "mlp_H", "mlp_HT", "H"} & {b.name for b in backward.inputs}
    assert {"U", "Vu"} <= {b.name for b in backward.inputs}


def test_the_block_is_its_stages_nests_in_order():
    onf = onf_of("block_fwd")
    stages = [n.label.split(".")[0] for n in onf.nests]
    assert list(dict.fromkeys(stages)) == [s.label for s in FORWARD.stages]
    attention = [n for n in onf.nests if n.label.startswith("attn.")]
    assert [n.label for n in attention] == ["attn." + n.label
                                           for n in onf_of("attention_fwd", "flash").nests]


def _broken(**changes):
    stages = list(BACKWARD.stages)
    index, stage = changes.pop("stage")
    stages[index] = stage
    return replace(BACKWARD, stages=tuple(stages), **changes)


@pytest.mark.parametrize("composite, words", [
    # the MLP's backward reads a U that nothing wrote and no input is
    (replace(BACKWARD, inputs=tuple(a for a in BACKWARD.inputs if a.name != "U")),
     "reads U, which is neither an input nor written"),
    # attention's heads bound to the model axis: the shapes disagree
    (_broken(stage=(5, replace(BACKWARD.stages[5], sizes={"d": "dm"}))), "has shape"),
    (_broken(stage=(3, Stage("add2", "residual_add", "dnf", {"x": "dy", "R": "x", "y": "x"}))),
     "writes x, an input"),
    (_broken(stage=(3, Stage("add2", "residual_add", "dnf", {"x": "dy", "y": "dresid"}))),
     "array R is not bound"),
    (_broken(stage=(3, Stage("add2", "residual_add", "dnf", {"x": "dy", "R": "dresid_norm",
                                                             "y": "dresid"}, {"n": "seq"}))),
     "size n maps to seq"),
])
def test_a_composition_that_does_not_fit_together_is_refused(composite, words):
    with pytest.raises(SpecError, match=words):
        compose(composite, lambda st: onf_of(st.kernel, st.variant))


def _block_arrays(dtype="float64", **shapes):
    sizes = dict(batch=1, n=3, dm=4, heads=2, dh=2, dff=6)
    onf = onf_of("block_fwd")
    env = {s: sizes[s.name] for s in onf.sizes}
    arrays = {b.name: np.ones(tuple(int(d.subs(env)) for d in b.shape), dtype) for b in onf.inputs}
    arrays.update({name: np.ones(shape, dtype) for name, shape in shapes.items()})
    return list(arrays.values())


def test_block_forward_rejects_bad_input_before_native_code():
    fn = runtime.load("block_fwd", "composed", "c", "float64")
    y = fn(*_block_arrays(), eps=1e-5, scale=0.5)[0]
    assert y.shape == (1, 3, 4) and np.isfinite(y).all()
    with pytest.raises(ValueError, match="Wg"):  # the gate's model axis is not x's
        fn(*_block_arrays(Wg=(5, 6)), eps=1e-5, scale=0.5)
    with pytest.raises(ValueError, match="Wo"):  # heads x d_head disagree with Wq's
        fn(*_block_arrays(Wo=(3, 2, 4)), eps=1e-5, scale=0.5)
    for eps in (0.0, -1e-5):
        with pytest.raises(ValueError, match="eps must be positive"):
            fn(*_block_arrays(), eps=eps, scale=0.5)
    with pytest.raises((TypeError, ValueError), match="float64"):
        fn(*_block_arrays("float32"), eps=1e-5, scale=0.5)


def test_rmsnorm_forward_rejects_a_non_positive_eps():
    fn = runtime.load("rmsnorm_fwd", "dnf", "c", "float64")
    with pytest.raises(ValueError, match="eps must be positive"):
        fn(np.ones((1, 2, 3)), np.ones(3), eps=0.0)


def test_a_composite_has_one_variant_and_lists_its_stages(capsys):
    from moagen.cli import main
    assert list(get_kernel("block_bwd").variants) == ["composed"]
    assert main(["show", "--stage", "dnf", "block_bwd"]) == 0
    out = capsys.readouterr().out
    assert "stage mlp: mlp_bwd tiled" in out and "kept for the backward: (none)" in out


def test_the_backward_takes_what_the_forward_returns_in_that_order():
    """y, *kept = block_fwd(...); block_bwd(..., *kept, dy): the user's chain, against
    PyTorch autograd of the whole block."""
    kept = FORWARD.kept()
    assert tuple(a.name for a in BACKWARD.inputs if a.name in kept) == kept
    r = np.random.default_rng(8)
    batch, n, dm, heads, dh, dff = 2, 5, 12, 3, 4, 20
    x, dy = r.standard_normal((batch, n, dm)), r.standard_normal((batch, n, dm))
    weights = [1 + 0.1 * r.standard_normal(dm)] + [
        r.standard_normal((dm, heads, dh)) / dm ** 0.5 for _ in range(3)] + [
        r.standard_normal((heads, dh, dm)) / (heads * dh) ** 0.5,
        1 + 0.1 * r.standard_normal(dm), r.standard_normal((dm, dff)) / dm ** 0.5,
        r.standard_normal((dm, dff)) / dm ** 0.5, r.standard_normal((dff, dm)) / dff ** 0.5]
    scale = dh ** -0.5
    for lang in ("c", "fortran"):
        y, *activations = runtime.load("block_fwd", lang=lang)(x, *weights, eps=1e-5, scale=scale)
        grads = runtime.load("block_bwd", lang=lang)(x, *weights, *activations, dy, scale=scale)
        want = reference_block.block_bwd_torch(x, *weights, *activations, dy, scale=scale,
                                               eps=1e-5)
        for got, ref in zip(grads, want):
            np.testing.assert_allclose(got, ref, rtol=1e-11, atol=1e-12)


def test_the_mlp_backward_takes_one_sigmoid_of_u_for_du_dv_and_h():
    """dU, dV and H in one elementwise nest (tiled): U, V and dH read once a row, and the
    sigmoid of U that all take (silu's value and its derivative) computed once; HT is H's
    copy, with no sigmoid of its own."""
    nests = {n.label: n for n in onf_of("mlp_bwd", "tiled").nests}
    assert not {"dU", "dV", "H"} & set(nests)
    stmts = list(walk(nests["dU_dV_H"].body))
    assert {s.array for s in stmts if isinstance(s, Store)} == {"dU", "dV", "H"}
    assert not [e for s in walk(nests["HT"].body) for x in stmt_exprs(s)
                for e in S.subexpressions(x) if isinstance(e, S.Un)]
    sigmoids = [e for s in stmts for x in stmt_exprs(s) for e in S.subexpressions(x)
                if isinstance(e, S.Un) and e.fn == "sigmoid"]
    assert len(sigmoids) == 1
