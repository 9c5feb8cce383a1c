"""The MoA DSL and shape analysis: the shape rule of every node kind, errors that name the
offending node's path and shapes, and KernelSpec validation."""
import re

import pytest
import sympy

from moagen.errors import ShapeError, SpecError
from moagen.moa import expr as E
from moagen.moa.expr import (Scalar, array, dim, drop, exp, inner, iota, lift, maximum, named,
                             omega, outer, psi, reduce, rsqrt, silu, sqrt, sym, take, transpose,
                             where)
from moagen.moa.shape import check, same_shape, shape_of
from moagen.moa.spec import KernelSpec, Output

b, m, n, p, k = map(sym, "bmnpk")
A = array("A", "m", "n", "p")
M = array("M", "m", "n")
N = array("N", "n", "p")
v = array("v", "n")


def test_dsl_builds_nodes_with_integer_size_symbols():
    assert A.shape == (m, n, p) and all(s.is_integer for s in A.shape)
    assert sym("n") == n  # one symbol per name, whoever makes it (equal, not cached-identical)
    expr = 2.0 * M - 1
    assert isinstance(expr, E.BinOp) and expr.op == "-"
    assert expr.left == E.BinOp("*", E.Const(2.0), M) and expr.right == E.Const(1.0)
    assert -M == E.Map("neg", M)


@pytest.mark.parametrize("node, shape", [
    (A, (m, n, p)),
    (Scalar("alpha"), ()),
    (E.Const(1.5), ()),
    (dim("n"), ()),
    (psi((0,), A), (n, p)),                      # partial index: a sub-array
    (psi((0, sym("i")), A), (p,)),
    (psi((0, 1, 2), A), ()),                     # full index: an element
    (take("k", A), (k, n, p)),
    (take(2, A, axis=2), (m, n, 2)),
    (drop(1, A, axis=1), (m, n - 1, p)),
    (drop("k", A, axis=-1), (m, n, p - k)),
    (E.Reverse(A, axis=1), (m, n, p)),
    (transpose(M), (n, m)),
    (transpose(A, (2, 0, 1)), (p, m, n)),
    (E.Cat(M, array("B", "k", "n")), (m + k, n)),
    (E.Cat(M, array("B", "m", "k"), axis=-1), (m, n + k)),
    (M + M, (m, n)),
    (M * 2.0, (m, n)),                           # scalar extension, either side
    (1.0 / M, (m, n)),
    (M - Scalar("alpha"), (m, n)),
    (maximum(reduce("+", v, 0), M), (m, n)),     # a shape-() node extends too
    (exp(A), (m, n, p)),
    (silu(rsqrt(sqrt(M))), (m, n)),
    (reduce("+", A, 0), (n, p)),
    (reduce("max", A, 1), (m, p)),
    (reduce("+", A, -1), (m, n)),
    (reduce("+", v, 0), ()),
    (inner(M, N), (m, p)),
    (inner(A, array("B", "p", "k"), add="max", mul="+"), (m, n, k)),
    (inner(v, N), (p,)),
    (outer("*", v, M), (n, m, n)),
    (omega("-", A, array("r", "m")), (m, n, p)),
    (omega("/", A, M), (m, n, p)),
    (omega("*", A, 2.0), (m, n, p)),             # a shape-() cell is a prefix too
    (lift(("b",), ("b",), psi(("b",), array("X", "b", "n"))), (b, n)),
    (lift(("b", "i"), ("b", "m"), inner(v, N)), (b, m, p)),
    (named("t", M * M), (m, n)),
    (iota("n"), (n,)),
    (where(outer(">=", iota("m"), iota("n")), M, 0.0), (m, n)),
])
def test_shape_of_every_node_kind(node, shape):
    assert same_shape(check(node), shape)
    assert same_shape(shape_of(node), shape)


def _error(exc, node, root="spec"):
    with pytest.raises(exc) as info:
        check(node, root)
    return str(info.value)


def test_shape_error_names_the_node_path_and_both_shapes():
    message = _error(ShapeError, lift(("b",), ("b",), (M + transpose(M)) * 2.0))
    assert message.startswith("spec.body.left: BinOp(+)")
    assert "(m, n)" in message and "(n, m)" in message


@pytest.mark.parametrize("node, path, shapes", [
    (E.Cat(M, N), "spec", ("(m, n)", "(n, p)")),
    (inner(M, M), "spec", ("(m, n)",)),
    (exp(inner(N, M)), "spec.arg", ("(n, p)", "(m, n)")),
    (omega("-", M, array("r", "n")), "spec", ("(m, n)", "(n)")),
    (reduce("+", named("t", M - v), 0), "spec.array.value", ("(m, n)", "(n)")),
    (outer("*", v, M + N), "spec.right", ("(m, n)", "(n, p)")),
    (lift(("b",), ("b",), where(outer("<", iota("m"), iota("n")), N, 0.0)), "spec.body",
     ("(m, n)", "(n, p)")),
])
def test_mismatches_name_path_and_shapes(node, path, shapes):
    message = _error(ShapeError, node)
    assert message.startswith(path + ": ")
    assert all(s in message for s in shapes)


@pytest.mark.parametrize("node, words", [
    (psi((0, 0, 0, 0), A), ["index of length 4", "(m, n, p)"]),
    (take(3, array("B", 2)), ["count exceeds", "(2)"]),
    (drop(1, M, axis=2), ["axis 2 out of range for rank 2"]),
    (E.Reverse(v, axis=-2), ["axis -2 out of range for rank 1"]),
    (transpose(A, (0, 0, 1)), ["not a permutation", "(m, n, p)"]),
    (reduce("+", E.Const(1.0), 0), ["cannot reduce a scalar"]),
])
def test_other_shape_errors(node, words):
    message = _error(ShapeError, node)
    assert message.startswith("spec: ") and all(w in message for w in words)


@pytest.mark.parametrize("build, word", [
    (lambda: E.BinOp("^", M, M), "'^'"),
    (lambda: E.Map("tanh", M), "'tanh'"),
    (lambda: reduce("*", M, 0), "'*'"),
    (lambda: inner(M, N, add="-"), "'-'"),
    (lambda: inner(M, N, mul="dot"), "'dot'"),
    (lambda: outer("pow", v, v), "'pow'"),
    (lambda: omega("%", M, v), "'%'"),
    (lambda: M + "x", "'x'"),
    (lambda: lift(("b", "h"), ("b",), M), "2 index names for 1 extents"),
])
def test_unknown_operators_and_bad_arguments_are_spec_errors(build, word):
    with pytest.raises(SpecError, match=re.escape(word)):
        build()


def _spec(outputs, inputs=(M, N), scalars=()):
    return KernelSpec("k", tuple(inputs), tuple(scalars), tuple(outputs))


def test_a_valid_spec_validates_and_knows_its_sizes():
    spec = _spec([Output("C", inner(M, N) * Scalar("s"), ("i", "c"))], scalars=("s",))
    assert spec.validate() is spec
    assert spec.sizes == (m, n, p)
    assert same_shape(spec.output_shapes()["C"], (m, p))


@pytest.mark.parametrize("spec, words", [
    (_spec([Output("C", inner(M, array("X", "n", "p")), ("i", "c"))]),
     ["array X is not an input"]),
    (_spec([Output("C", M + array("N", "m", "n"), ("i", "c"))]),
     ["array N used with shape (m, n)", "declared (n, p)"]),
    (_spec([Output("C", M * Scalar("alpha"), ("i", "c"))]),
     ["scalar alpha is not declared"]),
    (_spec([Output("M", M, ("i", "c"))]),
     ["names used twice: M"]),
    (_spec([Output("C", M, ("i", "c")), Output("D", M, ("i", "c"))], scalars=("C",)),
     ["names used twice: C"]),
    (_spec([Output("C", M, ("i",))]),
     ["1 index names for an output of shape (m, n)"]),
    (_spec([Output("C", reduce("+", M, 0), ("i", "j"))]),
     ["2 index names", "shape (n)"]),
    (_spec([Output("C", take("k", M), ("i", "j"))]),
     ["output shape (k, n) uses sizes ['k'] that no input determines"]),
    (_spec([Output("C", M / dim("q"), ("i", "j"))]),
     ["Dim q uses sizes ['q']"]),
    (_spec([Output("C", reduce("+", take("k", v), 0), ())]),
     ["Take k axis=0 uses sizes ['k']"]),
])
def test_validate_errors(spec, words):
    with pytest.raises(SpecError) as info:
        spec.validate()
    assert all(w in str(info.value) for w in words), str(info.value)


def test_validate_reports_shape_errors_with_the_output_path():
    spec = _spec([Output("C", M + N, ("i", "c"))])
    with pytest.raises(ShapeError, match=r"^k\.C: BinOp\(\+\).*\(m, n\).*\(n, p\)"):
        spec.validate()


def test_simplified_cancels_a_common_factor_of_a_ratio():
    """The generator's index simplification (a scratch row's gap over a loop's extent):
    the common factor cancels, which sympy's automatic evaluation does not do."""
    ratio = (2 * n + 2) / (n + 1)
    assert ratio != 2 and E.simplified(ratio) == 2
