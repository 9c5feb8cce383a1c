"""moagen.moa.grad and its rewrites: each adjoint rule against a central difference of the
forward (both evaluated by the DNF interpreter, so the check does not use the rules it
tests), the rewrites as equalities, the derived kernels' memory, `moagen grad`, and the
errors of what has no rule."""
import numpy as np
import pytest
import sympy

from moagen.cli import main
from moagen.cost import model
from moagen.errors import SpecError
from moagen.kernels import attention, get_kernel
from moagen.kernels.attention_bwd import VJP as ATTENTION_VJP
from moagen.moa import expr as E
from moagen.moa.dnf import psi_reduce
from moagen.moa.grad import derive, grad
from moagen.moa.rewrites import NAMES, quadratic_temporaries, recomputed_reductions
from moagen.moa.shape import shape_of
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.interpret import evaluate_dnf

A = E.array("a", "m", "k")
B = E.array("b", "k", "p")
R = E.array("r", "m")
W = E.array("w", "k")
SIZES = {"m": 3, "k": 4, "p": 2, "batch": 2}


def _positive(x):
    return x * x + 1.0


def _softmax(s):
    top = E.reduce("max", s, axis=1)
    w = E.exp(E.omega("-", s, top))
    return E.omega("/", w, E.reduce("+", w, axis=1))


# one forward per rule (or pair of rules); every output is (m, k) or (m, p) or (batch, m, k)
FORWARDS = {
    "exp, log, sqrt": E.log(_positive(A)) * E.sqrt(_positive(A)) + E.exp(A * 0.5),
    "rsqrt, silu, neg, /": E.rsqrt(_positive(A)) / _positive(A) - E.silu(-A),
    "scalar and shape () operands": E.Scalar("s") * A * E.reduce("+", W, axis=0) / E.dim("k"),
    "row sum, omega + - * /": E.omega("/", E.omega("*", E.omega("-", E.omega("+", A, R), R * R),
                                                  R),
                                      _positive(E.reduce("+", A * A, axis=1))),
    "inner, transpose": E.inner(A, B) + E.inner(E.inner(A, E.transpose(A)), E.inner(A, B)),
    "inner of vectors, outer": E.outer("*", E.inner(A, W), W),
    "sum along the first axis": E.outer("*", E.reduce("+", A * A, axis=0, var="i"), R),
    "causal where": E.where(E.outer(">=", E.iota("m"), E.iota("k")), A * A, E.exp(A)),
    "softmax": E.inner(E.named("probs", _softmax(E.inner(A, E.transpose(A))), ("i", "j")), A),
    "lift, psi, a weight shared by rows": E.lift(
        ("b",), ("batch",), E.inner(E.psi(("b",), E.array("x", "batch", "m", "k")), B) * 2.0),
    # a Lift inside the body summed over (the heads of a batch entry), a weight per head
    "an inner lift, summed": E.lift(("b",), ("batch",), E.reduce("+", E.lift(
        ("h",), ("p",), E.inner(E.psi(("b", "h"), E.array("x", "batch", "p", "m", "k")),
                                E.psi(("h",), E.array("wh", "p", "k", "m")))), axis=0, var="h")),
    # an input read through a transpose: a per-batch slice of t's second axis
    "psi of a transposed input": E.lift(("b",), ("batch",), E.inner(
        A, E.psi(("b",), E.transpose(E.array("t", "k", "batch", "p"), (1, 0, 2))))),
    # the output written (m, k, batch): its cotangent read through the inverse transpose
    "an output written transposed": E.transpose(E.lift(("b",), ("batch",), E.exp(E.psi(
        ("b",), E.array("x", "batch", "m", "k"))) * A), (1, 2, 0)),
}


def _spec(value):
    inputs = sorted({n for n in E.walk(value) if isinstance(n, E.Array)}, key=lambda a: a.name)
    scalars = tuple(sorted({n.name for n in E.walk(value) if isinstance(n, E.Scalar)}))
    index = ("u", "v", "w")[:len(shape_of(value))]
    return KernelSpec("f", tuple(inputs), scalars, (Output("y", value, index),))



def _random(spec, rng):
    return {a.name: rng.standard_normal(tuple(int(d.subs({E.sym(k): v for k, v in SIZES.items()}))
                                              for d in a.shape)) for a in spec.inputs}


def _run(spec, arrays, scalars):
    return evaluate_dnf(psi_reduce(spec), arrays, scalars)


@pytest.mark.parametrize("rule", FORWARDS)
def test_each_rule_matches_a_central_difference_of_the_forward(rule):
    """<dx, u> = <dy, (f(x + h u) - f(x - h u)) / 2h> for a random direction u of every
    input: the vector-Jacobian product, checked through the Jacobian-vector product."""
    forward = _spec(FORWARDS[rule])
    rng = np.random.default_rng(7)
    x, u = _random(forward, rng), _random(forward, rng)
    scalars = {"s": 0.7}
    y = _run(forward, x, scalars)["y"]
    dy = rng.standard_normal(y.shape)
    vjp = grad(forward)
    given = dict(x, y=y, dy=dy)  # the forward's output, where a rewrite reads it
    got = _run(vjp, {a.name: given[a.name] for a in vjp.inputs}, scalars)
    h = 1e-6
    plus = _run(forward, {n: x[n] + h * u[n] for n in x}, scalars)["y"]
    minus = _run(forward, {n: x[n] - h * u[n] for n in x}, scalars)["y"]
    expected = np.sum(dy * (plus - minus)) / (2 * h)
    ours = sum(np.sum(got["d" + n] * u[n]) for n in x)
    assert abs(ours - expected) <= 1e-7 * max(1.0, abs(expected)), (ours, expected)


def _attention_inputs(causal, rng, sizes=dict(batch=1, heads=1, n=4, d=3), scale=0.6):
    from moagen import reference
    shape = (sizes["batch"], sizes["heads"], sizes["n"], sizes["d"])
    Q, K, V, dO = (rng.standard_normal(shape) for _ in range(4))
    O, lse = reference.attention_fwd_numpy(Q, K, V, scale, causal)
    return dict(Q=Q, K=K, V=V, O=O, lse=lse, dO=dO), {"scale": scale}


@pytest.mark.parametrize("causal", [False, True])
def test_the_rewrites_are_equalities(causal):
    """The plain reverse-mode result (the softmax's max and sum recomputed, delta from dP)
    and the rewritten one give the same gradients; and both PyTorch's autograd."""
    from moagen import reference
    forward = attention.spec(causal)
    options = ATTENTION_VJP[forward.name]
    plain, rewritten = (derive(forward, **options, rewrites=r) for r in ((), None))
    assert dict(plain.rewrites) == {}
    # attention keeps no Named statistic; the mask is there only when causal
    assert set(dict(rewritten.rewrites)) == set(NAMES) - {"kept statistic"} - (
        set() if causal else {"masked zeros"})
    arrays, scalars = _attention_inputs(causal, np.random.default_rng(1))
    expected = reference.attention_bwd_torch(*(arrays[n] for n in "Q K V O dO lse".split()),
                                             causal=causal, **scalars)
    for derivation in (plain, rewritten):
        names = {a.name for a in derivation.spec.inputs}
        got = _run(derivation.spec, {n: a for n, a in arrays.items() if n in names}, scalars)
        for name, want in zip(("dQ", "dK", "dV"), expected):
            np.testing.assert_allclose(got[name], want, rtol=1e-12, atol=1e-12)
    assert {a.name for a in plain.spec.inputs} == {"Q", "K", "V", "dO"}  # O, lse unused


def test_a_transposed_output_is_read_in_its_layout():
    """Attention with O written as (n, batch, heads, d): the rewrites read the saved O
    and the given dO through the inverse of O's transpose (softmax from lse, delta from
    output), and the gradients are PyTorch's."""
    from moagen import reference
    heads = (E.psi(("b", "h"), a) for a in (attention.Q, attention.K, attention.V))
    o, lse = attention.one_head(*heads, causal=True)
    lifted = {"vars": ("b", "h"), "extents": ("batch", "heads")}
    forward = KernelSpec("rows", (attention.Q, attention.K, attention.V), ("scale",), (
        Output("O", E.transpose(E.lift(**lifted, body=o), (2, 0, 1, 3)), ("i", "b", "h", "c")),
        Output("lse", E.lift(**lifted, body=lse), ("b", "h", "i"))))
    derivation = derive(forward, wrt={"Q": ("b", "h", "i", "c"), "K": ("b", "h", "j", "c"),
                                      "V": ("b", "h", "j", "c")}, cotangents=("O",))
    assert {"softmax from lse", "delta from output"} <= set(dict(derivation.rewrites))
    arrays, scalars = _attention_inputs(True, np.random.default_rng(3),
                                        dict(batch=2, heads=3, n=5, d=4))
    written = {name: arrays[name].transpose(2, 0, 1, 3) for name in ("O", "dO")}
    got = _run(derivation.spec, {**arrays, **written}, scalars)
    expected = reference.attention_bwd_torch(*(arrays[n] for n in "Q K V O dO lse".split()),
                                             causal=True, **scalars)
    for name, want in zip(("dQ", "dK", "dV"), expected):
        np.testing.assert_allclose(got[name], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("alias, kernel", [("attention_fwd_vjp", "attention_bwd"),
                                           ("attention_fwd_causal_vjp", "attention_bwd_causal")])
def test_derived_attention_moves_no_n_squared_and_does_the_hand_written_work(alias, kernel):
    """Every variant's M is linear in n but naive's (which stores P and dS, as a framework
    does); F is what the backward written by hand cost (its DNF, P and dS named as there,
    is the one attention_bwd now is: tests/golden)."""
    assert get_kernel(alias).name == kernel
    n = sympy.Symbol("n", integer=True)
    for variant in get_kernel(kernel).variants:
        cost = model.predict(kernel, variant)
        assert sympy.Poly(cost.M, n).degree() == (2 if variant == "naive" else 1), variant
    d, batch, heads = (sympy.Symbol(s, integer=True) for s in ("d", "batch", "heads"))
    # the hand-written backward's count (`moagen cost attention_bwd` before it was derived)
    f = model.predict(kernel, "dnf").flops
    assert sympy.expand(f - 2 * batch * heads * n * (8 * d * n + d + 6 * n)) == 0


def test_quadratic_temporaries_and_recomputed_reductions_are_reported():
    spec = get_kernel("attention_fwd_vjp").spec
    assert quadratic_temporaries(psi_reduce(spec, {"delta"})) == []
    assert quadratic_temporaries(psi_reduce(spec, {"delta", "P", "dS"})) == ["P", "dS"]
    assert recomputed_reductions(psi_reduce(spec, {"delta"})) == []
    plain = derive(attention.spec(False), **ATTENTION_VJP["attention_fwd"], rewrites=()).spec
    # dQ's row max does not depend on the key it sums over: hoisted, not recomputed
    assert recomputed_reductions(psi_reduce(plain, {"delta"})) == ["dK", "dV"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_grad_command_prints_rewrites_dnf_and_the_check(capsys):
    code, out, _ = run(capsys, "grad", "attention_fwd_causal")
    assert code == 0
    assert "rewrites: softmax from lse (3), delta from output (2), masked zeros (2)" in out
    assert "temporary delta(batch, heads, n):" in out
    assert out.endswith("no n x n temporary, no reduction recomputed per term\n")
    code, out, err = run(capsys, "grad", "attention_fwd", "--materialize", "P")
    assert code == 1 and "FAIL: n x n temporaries P" in err
    # without the rewrites each probability recomputes its row's max and sum: dK sums over
    # the query rows, whose maxima depend on them
    code, out, err = run(capsys, "grad", "attention_fwd", "--no-rewrites")
    assert code == 1 and "FAIL: dK, dV recompute a reduction" in err
    # the registered MLP backward stores transposed operands this spec does not name
    code, out, _ = run(capsys, "grad", "mlp_fwd")
    assert code == 0 and "temporaries: dH(batch, n, dff), dU(batch, n, dff)" in out
    code, out, _ = run(capsys, "grad", "rmsnorm_fwd", "--wrt", "x", "--shape")
    assert code == 0 and "gradients dx\n" in out and "rewrites: kept statistic (1)" in out


@pytest.mark.parametrize("value, options, message", [
    (E.reduce("max", A, axis=1), {}, "argmax"),
    (E.psi(("i",), A * 2.0), {}, "of a computed array has no adjoint rule"),
    (E.psi(("i",), E.transpose(A)), {}, "only an index of the lift variables"),
    (E.BinOp("max", A, A), {}, "no adjoint rule for BinOp(max)"),
    (A * 2.0, {"wrt": ["z"]}, "wrt ['z'] are not inputs"),
    (A * 2.0, {"cotangents": ["z"]}, "cotangents for ['z']"),
    (A * 2.0, {"rewrites": ["fold"]}, "no rewrite ['fold']"),
    (E.take(2, A), {}, "no adjoint rule for Take"),
])
def test_what_has_no_rule_is_a_clear_error(value, options, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        grad(_spec(value), **options)


def test_a_vjp_name_verifies_the_kernel_it_names():
    from moagen import verify
    rows = list(verify.run(["rmsnorm_fwd_vjp"], langs=("c",), variants=["dnf"],
                           dtypes=("float64",)))
    assert rows and all(r.kernel == "rmsnorm_bwd" and r.status == "pass" for r in rows)

