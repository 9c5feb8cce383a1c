"""Bool inputs (moagen.moa.expr.flags): a mask of one byte an element, as numpy and torch
store it, read only as a Where's condition; attention_cross's `_bool2d` kernels (#54), whose
agreement with the references on odd sizes is moagen verify's (C, Fortran, the CUDA
emulation). Here: the element type through the DNF, the printers, the loaders' checks, the
interpreter and the cost model."""
import re
from pathlib import Path

import numpy as np
import pytest

from moagen import runtime
from moagen.cost import model
from moagen.errors import SpecError
from moagen.kernels import attention_cross
from moagen.moa import scalar as S
from moagen.moa.dnf import psi_reduce
from moagen.moa.expr import array, flags, where
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.interpret import evaluate_dnf, run_onf
from moagen.onf.loops import Loop, Store, walk
from moagen.pipeline import onf_of

KERNEL = "attention_cross_fwd_bool2d"
GENERATED = Path(__file__).resolve().parents[1] / "generated"
X, M = array("X", "n"), flags("M", "n")


def _spec(value):
    return KernelSpec(name="kept", inputs=(X, M), scalars=(),
                      outputs=(Output("Y", value, ("i",)),))


def test_a_bool_array_is_a_condition_only():
    """where(M, X, 0) reads M's byte as M > 0; M as a number is refused by name."""
    (body,) = (d.body for d in psi_reduce(_spec(where(M, X, 0.0))).definitions)
    assert isinstance(body, S.IfGreater) and body.left.array == "M" and body.right == S.Num(0.0)
    with pytest.raises(SpecError, match="M: a bool array can only be a Where's condition"):
        psi_reduce(_spec(X + M))


def test_the_interpreters_read_a_mask_as_zero_or_one():
    spec = _spec(where(M, X, -1.0))
    arrays = {"X": np.arange(4.0), "M": np.array([True, False, False, True])}
    want = np.array([0.0, -1.0, -1.0, 3.0])
    np.testing.assert_array_equal(evaluate_dnf(psi_reduce(spec), arrays, {})["Y"], want)
    mask = (np.arange(7) % 3 == 0)[None, :].repeat(5, 0)
    rng = np.random.default_rng(0)
    Q, K, V = rng.standard_normal((1, 1, 2, 5, 3)), *rng.standard_normal((2, 1, 1, 7, 3))
    got = run_onf(onf_of(KERNEL, "dnf"), dict(Q=Q, K=K, V=V, M=mask), {"scale": 0.5})
    bias = np.where(mask, 0.0, -np.inf)
    want = runtime.load("attention_cross_fwd_masked2d", "dnf", "c", "float64")(
        Q, K, V, bias, scale=0.5)
    np.testing.assert_allclose(got["O"], want[0], rtol=1e-13, atol=0)


@pytest.mark.parametrize("suffix, declared", [
    ("c", "const uint8_t *restrict M"), ("cu", "const uint8_t *__restrict__ M"),
    ("f90", "integer(c_int8_t), intent(in) :: M(0:n_q * n - 1)")])
def test_the_mask_is_declared_a_byte_an_element(suffix, declared):
    """In the generated sources (moagen generate --check: what the generator emits)."""
    assert declared in (GENERATED / f"{KERNEL}_flash.{suffix}").read_text()


@pytest.mark.parametrize("lang", ["c", "fortran", "cuda-emulated"])
@pytest.mark.parametrize("change, message", [
    (lambda M: M.astype(np.float64), "'M': expected dtype bool, got float64"),
    (lambda M: M.view(np.uint8), "'M': expected dtype bool, got uint8"),
    (lambda M: M[:, :-1].copy(), r"'M': expected shape \(n_q, n\) = \(5, 7\)"),
    (lambda M: M.T.copy().T, "'M': expected a C-contiguous array"),
])
def test_a_bad_mask_is_refused_before_native_code(lang, change, message):
    fn = runtime.load(KERNEL, "flash", lang, "float64")
    rng = np.random.default_rng(1)
    Q, K, V = rng.standard_normal((1, 1, 2, 5, 3)), *rng.standard_normal((2, 1, 1, 7, 3))
    with pytest.raises(ValueError, match=message):
        fn(Q, K, V, change(np.ones((5, 7), dtype=bool)), scale=0.5)


def test_the_cost_model_counts_a_byte_a_mask_element():
    """The bool mask moves n_q n bytes where the float one moves 8 n_q n (float64)."""
    bools, floats = (model.predict(attention_cross.name(mask), "dnf")
                     for mask in ("bool2d", "masked2d"))
    assert bools.traffic == floats.traffic
    n, n_q = (next(s for s in floats.sizes if s.name == name) for name in ("n", "n_q"))
    assert (floats.M - bools.M).expand() == (7 * n * n_q).expand()


def test_the_flash_forward_applies_the_mask_after_its_tile_stores():
    """KeyTiles stores the score tile from the accumulators alone, then keeps or hides each
    score by the mask (P = P where M, else -inf): with the mask's select in the stores,
    gcc kept the accumulators scalar (3.5x the float mask's time, float32). (The keys past
    the last whole tile keep their loop as it was.)"""
    def reads(store):
        return {e.array if hasattr(e, "array") else e.name for e in S.subexpressions(store.value)
                if isinstance(e, (S.Access, S.Load, S.Local))}

    # a tile's stores: those beside its loop of accumulations (a vector tile), each row's
    # and lane's, in every nest (the row tiles, the edge's tiles, the rows left alone)
    tiled = {}
    for nest in onf_of(KERNEL, "flash").nests:
        for lp in walk(nest.body):
            if isinstance(lp, Loop) and any(isinstance(s, Loop) and s.vector_tile
                                            for s in lp.body):
                tiled.setdefault(nest.label, []).append(lp)
    loops = [lp for nest in tiled.values() for lp in nest]
    tile = [reads(s) for lp in loops for s in lp.body  # P = scale * an accumulator
            if isinstance(s, Store) and s.array == "probs" and "probs" not in reads(s)]
    applied = [reads(s) for lp in loops for s in walk(lp.body)
               if isinstance(s, Store) and s.array == "probs" and reads(s) == {"probs", "M"}]
    assert set(tiled) == {"rows", "rows.edge", "rows.edge.edge"}
    assert tile and all("M" not in names for names in tile) and len(applied) == len(tile)


@pytest.mark.parametrize("lang", ["c", "fortran"])
@pytest.mark.parametrize("variant", ["dnf", "flash"])
def test_a_row_the_mask_hides_wholly_gets_zeros_and_no_gradient(lang, variant):
    """SDPA's zeros from the kernels themselves (their softmax floored): O = 0 and lse = -inf
    at such a row, every other row the same as with a float mask; the backward gives it dQ =
    0 and no NaN anywhere (before, 0 / 0 made the row NaN, moagen.torch showing it every key
    and zeroing it after)."""
    rng = np.random.default_rng(5)
    Q, dO = rng.standard_normal((2, 1, 2, 3, 9, 5))
    K, V = rng.standard_normal((2, 1, 2, 11, 5))
    mask = rng.random((9, 11)) < 0.6
    mask[[0, 4]] = False
    O, lse = runtime.load(KERNEL, variant, lang, "float64", params={})(Q, K, V, mask, scale=0.4)
    assert (O[..., [0, 4], :] == 0).all() and np.isneginf(lse[..., [0, 4]]).all()
    seen = [i for i in range(9) if i not in (0, 4)]
    want = runtime.load("attention_cross_fwd_masked2d", "dnf", "c", "float64")(
        Q, K, V, np.where(mask, 0.0, -np.inf), scale=0.4)
    np.testing.assert_allclose(O[..., seen, :], want[0][..., seen, :], rtol=1e-13, atol=1e-15)
    dQ, dK, dV = runtime.load("attention_cross_bwd_bool2d", variant, lang, "float64",
                              params={})(Q, K, V, mask, O, dO, lse, scale=0.4)
    assert (dQ[..., [0, 4], :] == 0).all()
    assert all(np.isfinite(g).all() for g in (dQ, dK, dV))
