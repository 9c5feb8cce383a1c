"""psi-reduction, checked numerically: each MoA operation, written as the output of a tiny
kernel, is reduced to its DNF, evaluated by brute force, and compared with numpy."""
import numpy as np
import pytest

from moagen.errors import SpecError
from moagen.kernels import get_kernel
from moagen.moa import expr as E
from moagen.moa import scalar as S
from moagen.moa.dnf import psi_reduce
from moagen.moa.expr import (Scalar, array, dim, drop, exp, inner, iota, lift, named, omega,
                             outer, psi, reduce, rsqrt, silu, sqrt, sym, take, transpose, where)
from moagen.moa.shape import check, same_shape
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.interpret import evaluate_dnf

SIZES = {"m": 3, "n": 5, "p": 7, "q": 4}
A = array("A", "m", "n", "p")
C = array("C", "q", "n", "p")
M = array("M", "m", "n")
M2 = array("M2", "m", "n")
Mq = array("Mq", "m", "q")
N = array("N", "n", "p")
P = array("P", "p", "q")
v = array("v", "n")
w = array("w", "m")
ARRAYS = (A, C, M, M2, Mq, N, P, v, w)

_rng = np.random.default_rng(7)
DATA = {x.name: _rng.standard_normal(tuple(SIZES[str(s)] for s in x.shape)) for x in ARRAYS}
ALPHA = 0.75
NP_BINARY = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.divide,
             "max": np.maximum, "min": np.minimum}


def _spec(value):
    """A kernel with one output, `out`, declaring exactly the arrays and scalars it uses."""
    nodes = list(_walk(value))
    inputs = tuple(x for x in ARRAYS if x in nodes)
    scalars = tuple(sorted({x.name for x in nodes if isinstance(x, E.Scalar)}))
    rank = len(check(value))
    return KernelSpec("t", inputs, scalars, (Output("out", value, ("x", "y", "z", "u")[:rank]),))


def _walk(node):
    yield node
    for _, child in node.children():
        yield from _walk(child)


def _evaluate(value, materialize=()):
    return evaluate_dnf(psi_reduce(_spec(value), frozenset(materialize)), DATA, {"alpha": ALPHA})


def _case(id, value, reference):
    return pytest.param(value, reference, id=id)


d = DATA
CASES = [
    _case("psi-partial", psi((1,), A), lambda: d["A"][1]),
    _case("psi-partial-2", psi((2, 1), A), lambda: d["A"][2, 1]),
    _case("psi-full", psi((0, 3, 6), A), lambda: d["A"][0, 3, 6]),
    _case("transpose-201", transpose(A, (2, 0, 1)), lambda: d["A"].transpose(2, 0, 1)),
    _case("transpose-120", transpose(A, (1, 2, 0)), lambda: d["A"].transpose(1, 2, 0)),
    _case("transpose-2d", transpose(M), lambda: d["M"].T),
    _case("take-0", take(2, A), lambda: d["A"][:2]),
    _case("take-2", take(3, A, axis=2), lambda: d["A"][:, :, :3]),
    _case("take-neg", take(4, A, axis=-2), lambda: d["A"][:, :4]),
    _case("drop-0", drop(1, A), lambda: d["A"][1:]),
    _case("drop-1", drop(2, A, axis=1), lambda: d["A"][:, 2:]),
    _case("drop-neg", drop(5, A, axis=-1), lambda: d["A"][..., 5:]),
    _case("take-of-drop", take(2, drop(1, M, axis=1), axis=1), lambda: d["M"][:, 1:3]),
    _case("reverse-0", E.Reverse(A, 0), lambda: np.flip(d["A"], 0)),
    _case("reverse-1", E.Reverse(A, 1), lambda: np.flip(d["A"], 1)),
    _case("reverse-neg", E.Reverse(A, -1), lambda: np.flip(d["A"], -1)),
    _case("cat-0", E.Cat(A, C), lambda: np.concatenate([d["A"], d["C"]], 0)),
    _case("cat-neg", E.Cat(M, Mq, axis=-1), lambda: np.concatenate([d["M"], d["Mq"]], 1)),
    _case("cat-of-views", E.Cat(E.Reverse(M, 1), take(2, M)),
          lambda: np.concatenate([np.flip(d["M"], 1), d["M"][:2]], 0)),
    _case("reduce-of-cat", reduce("+", E.Cat(A, C), 0),
          lambda: np.concatenate([d["A"], d["C"]]).sum(0)),
]
for op, fn in NP_BINARY.items():
    CASES += [
        _case(f"bin{op}-arrays", E.BinOp(op, M, M2), lambda fn=fn: fn(d["M"], d["M2"])),
        _case(f"bin{op}-const-right", E.BinOp(op, M, E.Const(1.5)),
              lambda fn=fn: fn(d["M"], 1.5)),
        _case(f"bin{op}-const-left", E.BinOp(op, E.Const(-0.5), A),
              lambda fn=fn: fn(-0.5, d["A"])),
        _case(f"bin{op}-param", E.BinOp(op, Scalar("alpha"), M), lambda fn=fn: fn(ALPHA, d["M"])),
        _case(f"bin{op}-reduced-scalar", E.BinOp(op, M, reduce("+", v, 0)),
              lambda fn=fn: fn(d["M"], d["v"].sum())),
    ]
CASES += [
    _case("exp", exp(A), lambda: np.exp(d["A"])),
    _case("sqrt", sqrt(M * M + 0.5), lambda: np.sqrt(d["M"] ** 2 + 0.5)),
    _case("rsqrt", rsqrt(M * M + 0.5), lambda: 1 / np.sqrt(d["M"] ** 2 + 0.5)),
    _case("silu", silu(A), lambda: d["A"] / (1 + np.exp(-d["A"]))),
    _case("neg", -A, lambda: -d["A"]),
    _case("dim", M / dim("n") + dim(sym("m") + 1), lambda: d["M"] / 5 + 4),
    _case("iota", iota("n") * v, lambda: np.arange(5) * d["v"]),
    _case("where-lower-triangle", where(outer(">=", iota("m"), iota("n")), M, -1.0),
          lambda: np.where(np.tri(3, 5, dtype=bool), d["M"], -1.0)),
    _case("where-upper-triangle", where(outer("<", iota("n"), iota("p")), 0.5, N),
          lambda: np.where(np.tri(5, 7, dtype=bool), d["N"], 0.5)),
    _case("nested-reduce", reduce("max", reduce("+", A, 2), 0), lambda: d["A"].sum(2).max(0)),
    _case("inner", inner(M, N), lambda: d["M"] @ d["N"]),
    _case("inner-3d", inner(A, P), lambda: np.tensordot(d["A"], d["P"], 1)),
    _case("inner-vector", inner(v, N), lambda: d["v"] @ d["N"]),
    _case("inner-max-plus", inner(M, N, add="max", mul="+"),
          lambda: (d["M"][:, :, None] + d["N"][None]).max(1)),
    _case("inner-of-transpose", inner(transpose(N), transpose(M)), lambda: (d["M"] @ d["N"]).T),
    _case("outer-mul", outer("*", v, M), lambda: np.multiply.outer(d["v"], d["M"])),
    _case("outer-sub", outer("-", N, w), lambda: np.subtract.outer(d["N"], d["w"])),
    _case("omega-row", omega("-", A, w), lambda: d["A"] - d["w"][:, None, None]),
    _case("omega-2d-cell", omega("/", A, M), lambda: d["A"] / d["M"][:, :, None]),
    _case("omega-row-max", omega("-", M, reduce("max", M, 1)),
          lambda: d["M"] - d["M"].max(1, keepdims=True)),
    _case("lift-batch", lift(("b",), ("m",), inner(psi(("b",), A), P)),
          lambda: np.einsum("bnp,pq->bnq", d["A"], d["P"])),
    _case("lift-two-axes", lift(("b", "i"), ("m", "n"),
                                reduce("+", psi(("b", "i"), A), 0) * psi(("b", "i"), M)),
          lambda: d["A"].sum(2) * d["M"]),
    _case("lift-nested", lift(("b",), ("m",), lift(("i",), ("n",), psi(("b", "i"), A) * 2.0)),
          lambda: 2 * d["A"]),
    _case("lift-transposed", lift(("c",), ("p",), psi(("c",), transpose(A, (2, 0, 1)))),
          lambda: d["A"].transpose(2, 0, 1)),
]
for op in ("+", "max"):
    np_reduce = np.sum if op == "+" else np.max
    for axis in (0, 1, 2, -1):
        CASES.append(_case(f"reduce{op}-axis{axis}", reduce(op, A, axis),
                           lambda f=np_reduce, a=axis: f(d["A"], axis=a)))


@pytest.mark.parametrize("value, reference", CASES)
def test_psi_reduction_matches_numpy(value, reference):
    np.testing.assert_allclose(_evaluate(value)["out"], reference(), rtol=1e-13, atol=1e-13)


# a softmax over rows of an intermediate, to be materialized or not
SCORES = named("s", inner(M, N) * Scalar("alpha"), index=("i", "j"))
NAMED_CASES = {
    "softmax": (omega("/", exp(omega("-", SCORES, reduce("max", SCORES, 1))),
                    reduce("+", exp(omega("-", SCORES, reduce("max", SCORES, 1))), 1)),
                lambda: ALPHA * d["M"] @ d["N"]),
    # the temporary's index name j is also the name its body's reduction asks for
    "index-reused": (named("s", reduce("+", M, 1, var="j"), index=("j",)) * 2.0,
                     lambda: d["M"].sum(1)),
    # likewise the batch index of a lifted temporary
    "lift-index-reused": (lift(("j",), ("m",), named("s", reduce("+", psi(("j",), M), 0,
                                                                var="j"))),
                          lambda: d["M"].sum(1)),
}


@pytest.mark.parametrize("case", NAMED_CASES)
def test_named_intermediate_materialized_or_not_gives_the_same_values(case):
    value, temp_reference = NAMED_CASES[case]
    fused = _evaluate(value)
    stored = _evaluate(value, {"s"})
    assert set(fused) == {"out"} and set(stored) == {"s", "out"}
    np.testing.assert_allclose(stored["s"], temp_reference(), rtol=1e-13)
    np.testing.assert_allclose(stored["out"], fused["out"], rtol=1e-13)


def test_named_softmax_matches_numpy():
    value, _ = NAMED_CASES["softmax"]
    s = ALPHA * d["M"] @ d["N"]
    e = np.exp(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(_evaluate(value)["out"], e / e.sum(1, keepdims=True), rtol=1e-13)


# ---- attention -----------------------------------------------------------------------

ATTENTION = get_kernel("attention_fwd").spec

def _scalar_nodes(e):
    yield e
    for c in S.children(e):
        yield from _scalar_nodes(c)


def _attention_inputs(batch=1, heads=3, n=5, d=3):
    rng = np.random.default_rng(3)
    return {name: rng.standard_normal((batch, heads, n, d)) for name in "QKV"}


def _numpy_attention(Q, K, V, scale):
    scores = scale * np.einsum("bhic,bhjc->bhij", Q, K)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    probs = e / e.sum(-1, keepdims=True)
    return scores, probs, np.einsum("bhij,bhjc->bhic", probs, V)


def test_fused_attention_reads_only_its_inputs():
    dnf = psi_reduce(ATTENTION)
    assert dnf.temps == () and [x.target for x in dnf.definitions] == ["O", "lse"]
    for definition in dnf.definitions:
        nodes = list(_scalar_nodes(definition.body))
        reads = {x.array for x in nodes if isinstance(x, S.Access)}
        assert reads == ({"Q", "K", "V"} if definition.target == "O" else {"Q", "K"})
        assert not any(isinstance(x, S.Load) for x in nodes)


def test_naive_attention_materializes_scores_and_probs():
    dnf = psi_reduce(ATTENTION, {"scores", "probs"})
    assert [t.target for t in dnf.temps] == ["scores", "probs"]
    batch, heads, n = map(sym, ("batch", "heads", "n"))
    for t in dnf.temps:
        assert same_shape(t.shape, (batch, heads, n, n))
    reads = {x.array for dfn in dnf.definitions for x in _scalar_nodes(dfn.body)
             if isinstance(x, S.Access)}
    assert reads == {"Q", "K", "V", "scores", "probs"}


def test_attention_dnfs_match_numpy():
    arrays = _attention_inputs()
    scores, probs, out = _numpy_attention(*arrays.values(), 0.4)
    naive = evaluate_dnf(psi_reduce(ATTENTION, {"scores", "probs"}), arrays, {"scale": 0.4})
    fused = evaluate_dnf(psi_reduce(ATTENTION), arrays, {"scale": 0.4})
    for got, want in ((naive["scores"], scores), (naive["probs"], probs), (naive["O"], out),
                      (fused["O"], out)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_materializing_an_unknown_label_is_a_spec_error():
    with pytest.raises(SpecError, match="cannot materialize.*'nope'.*probs.*scores"):
        psi_reduce(ATTENTION, {"scores", "nope"})
