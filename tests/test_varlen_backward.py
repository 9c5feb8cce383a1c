"""The packed varlen attention's backward (attention_varlen_bwd, `_causal`), derived by
moagen.moa.grad from the forward: gradients packed by the offsets the inputs are read by,
and the guarded softmax (a row that sees no key) differentiated without a NaN. Its agreement
with the references on odd lengths is test_verify's (C, Fortran) and test_cuda_emulation's."""
import numpy as np
import pytest

from moagen import reference, runtime
from moagen.errors import SpecError
from moagen.kernels import attention_varlen as varlen
from moagen.moa.expr import Const, array, exp, lift, maximum, omega, reduce
from moagen.moa.grad import grad
from moagen.moa.rewrites import stable_softmax
from moagen.moa.spec import KernelSpec, Output, Packed

FORWARD, BACKWARD = "attention_varlen_fwd_causal", "attention_varlen_bwd_causal"


def _batch(q_lens, k_lens, kv_heads=2, group=2, d=3, seed=0):
    """Q, K, V, cu_q, cu_k, dO of a packed batch of these lengths."""
    rng = np.random.default_rng(seed)
    Q, dO = (rng.standard_normal((sum(q_lens), kv_heads, group, d)) for _ in range(2))
    K, V = (rng.standard_normal((sum(k_lens), kv_heads, d)) for _ in range(2))
    cu = varlen.packed_offsets(dict(q_lens=q_lens, k_lens=k_lens))
    return Q, K, V, cu["cu_q"], cu["cu_k"], dO


def test_gradients_are_packed_as_their_inputs():
    """dQ by cu_q over the query rows i, dK and dV by cu_k over the key rows j (summed over
    the group's query heads: no r in their index); O and lse read back packed."""
    spec = varlen.backward_spec(causal=True)
    assert [a.name for a in spec.inputs] == ["Q", "K", "V", "cu_q", "cu_k", "O", "dO", "lse"]
    assert {o.name: (o.index, o.packed) for o in spec.outputs} == {
        "dQ": (("b", "g", "r", "i", "c"), Packed("b", "i", varlen.CU_Q)),
        "dK": (("b", "g", "j", "c"), Packed("b", "j", varlen.CU_K)),
        "dV": (("b", "g", "j", "c"), Packed("b", "j", varlen.CU_K))}
    shapes = {a.name: tuple(map(str, a.shape)) for a in spec.inputs}
    assert shapes["lse"] == ("total_q", "kv_heads", "group")


def _softmax(floor=None, clamp=None):
    scores = array("s", "n", "m")
    top = reduce("max", scores, axis=1)
    weights = exp(omega("-", scores, top if floor is None else maximum(top, floor)))
    total = reduce("+", weights, axis=1)
    return omega("/", weights, total if clamp is None else maximum(total, clamp))


def test_the_guarded_softmax_is_a_softmax_with_its_floor():
    """The forward's floored max and clamped sum: the same softmax for a row with a finite
    score, its floor kept for the lse it is recomputed from; the floor or the clamp alone,
    or a clamp other than 1, is not recognised."""
    assert stable_softmax(_softmax()).floor is None
    assert stable_softmax(_softmax(-1e30, 1.0)).floor == Const(-1e30)
    for floor, clamp in ((-1e30, None), (None, 1.0), (-1e30, 2.0)):
        assert stable_softmax(_softmax(floor, clamp)) is None


def test_a_packed_output_must_have_its_rows_after_the_lift():
    x, cu = array("x", "total", "d"), varlen.CU_Q
    spec = KernelSpec("k", (x, cu), (), (Output(
        "y", lift(("b",), ("batch",), Packed("b", "i", cu).read(x, ())), ("b", "i", "c"),
        Packed("b", "c", cu)),))
    with pytest.raises(SpecError, match="its rows c the axis after them"):
        grad(spec)


def _backward(lang, Q, K, V, cu_q, cu_k, dO):
    O, lse = runtime.load(FORWARD, "dnf", lang, "float64")(Q, K, V, cu_q, cu_k, scale=0.5)
    grads = runtime.load(BACKWARD, "dnf", lang, "float64")(Q, K, V, cu_q, cu_k, O, dO, lse,
                                                           scale=0.5)
    return O, lse, grads


@pytest.mark.parametrize("lang", ["c", "fortran"])
def test_rows_that_see_no_key_get_zero_gradients(lang):
    """Causal bottom-right, 3 queries against 1 key, then 2 queries and no key: the rows
    that see none (lse -inf) get dQ = 0 exactly and no NaN anywhere; the rest the
    reference's."""
    batch = _batch((3, 2), (1, 0))
    O, lse, (dQ, dK, dV) = _backward(lang, *batch)
    unseen = [0, 1, 3, 4]
    assert (lse[unseen] == -np.inf).all() and (dQ[unseen] == 0).all()
    want = reference.attention_varlen_bwd_numpy(*batch[:5], O, batch[5], lse, scale=0.5,
                                                causal=True)
    for got, expected in zip((dQ, dK, dV), want):
        assert np.isfinite(got).all()
        assert np.allclose(got, expected, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("lang", ["c", "fortran"])
def test_no_other_sequence_is_read(lang):
    """NaN in every row but one sequence's, of every input: its gradients are those of the
    sequence alone (a kernel that visited the others' rows and masked them would give
    0 * NaN)."""
    Q, K, V, cu_q, cu_k, dO = _batch((3, 4, 2), (5, 4, 6))
    q, k = slice(cu_q[1], cu_q[2]), slice(cu_k[1], cu_k[2])
    one = [np.array([0, 4])] * 2
    O, lse, alone = _backward(lang, Q[q], K[k], V[k], *one, dO[q])
    poisoned = {name: np.full(shape, np.nan) for name, shape in
                (("Q", Q.shape), ("K", K.shape), ("V", V.shape), ("O", Q.shape),
                 ("dO", Q.shape), ("lse", Q.shape[:-1]))}
    for name, rows, value in (("Q", q, Q[q]), ("K", k, K[k]), ("V", k, V[k]), ("O", q, O),
                              ("dO", q, dO[q]), ("lse", q, lse)):
        poisoned[name][rows] = value
    p = poisoned
    grads = runtime.load(BACKWARD, "dnf", lang, "float64")(
        p["Q"], p["K"], p["V"], cu_q, cu_k, p["O"], p["dO"], p["lse"], scale=0.5)
    for got, rows, expected in zip(grads, (q, k, k), alone):
        assert np.array_equal(got[rows], expected)
