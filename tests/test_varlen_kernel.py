"""The packed variable-length attention kernels (moagen.kernels.attention_varlen) and what
they brought: integer (offsets) inputs in the ABI, checked by every loader before native
code; packed outputs; loop bounds read from the offsets. Their agreement with the
references on odd lengths is test_verify's (C, Fortran) and test_cuda_emulation's."""
from dataclasses import replace

import numpy as np
import pytest
import sympy

from moagen import reference, runtime, verify
from moagen.errors import SpecError
from moagen.kernels import attention_cross as cross
from moagen.kernels import attention_varlen as varlen
from moagen.kernels import get_kernel
from moagen.moa import scalar as S
from moagen.moa.dnf import psi_reduce
from moagen.moa.expr import array, element, lift, offsets
from moagen.moa.spec import KernelSpec, Output, Packed
from moagen.onf.interpret import evaluate_dnf, run_onf
from moagen.onf.loops import Loop, Store, stmt_exprs, walk
from moagen.onf.realize import realize
from moagen.pipeline import onf_of
from moagen.steps.algebra.maskedkeys import MaskedKeys
from moagen.steps.step import NotApplicable

KERNEL = "attention_varlen_fwd_causal"


def _batch(q_lens, k_lens, kv_heads=1, group=2, d=3, seed=0):
    """Q, K, V, cu_q, cu_k of a packed batch of these lengths."""
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((sum(q_lens), kv_heads, group, d))
    K, V = (rng.standard_normal((sum(k_lens), kv_heads, d)) for _ in range(2))
    cu = varlen.packed_offsets(dict(q_lens=q_lens, k_lens=k_lens))
    return Q, K, V, cu["cu_q"], cu["cu_k"]


def test_offsets_are_int64_inputs_of_every_dtype():
    for dtype in ("float64", "float32"):
        sig = runtime.load(KERNEL, "dnf", "c", dtype).signature
        elements = {a.name: a.dtype(dtype) for a in sig.inputs}
        assert elements == {"Q": dtype, "K": dtype, "V": dtype, "cu_q": "int64", "cu_k": "int64"}


@pytest.mark.parametrize("lang", ["c", "fortran", "cuda-emulated"])
@pytest.mark.parametrize("change, message", [
    (lambda cu_q, cu_k: (cu_q.astype(np.float64), cu_k),
     "'cu_q': expected dtype int64, got float64"),
    (lambda cu_q, cu_k: (cu_q.astype(np.int32), cu_k), "'cu_q': expected dtype int64, got int32"),
    (lambda cu_q, cu_k: (cu_q, cu_k[:-1]), r"'cu_k': expected shape \(batch \+ 1,\) = \(4,\)"),
    (lambda cu_q, cu_k: (cu_q + 1, cu_k), "'cu_q': offsets must start at 0, got 1"),
    (lambda cu_q, cu_k: (cu_q, np.array([0, 5, 3, 8])),
     "'cu_k': offsets must not decrease, got 5 then 3 at entries 1 and 2"),
    (lambda cu_q, cu_k: (np.array([0, 2, 4, 5]), cu_k),
     "'cu_q': offsets must end at total_q = 6, the rows they cut, got 5"),
])
def test_bad_offsets_are_refused_before_native_code(lang, change, message):
    fn = runtime.load(KERNEL, "dnf", lang, "float64")
    Q, K, V, cu_q, cu_k = _batch((2, 3, 1), (1, 3, 4))
    with pytest.raises(ValueError, match=message):
        fn(Q, K, V, *change(cu_q, cu_k), scale=0.5)


QUERIES, KEYS = "-cu_q(b) + cu_q(b + 1)", "-cu_k(b) + cu_k(b + 1)"
# causal: a query row's keys up to its last seen, i + n_k - n_q; a key row's queries from
# the first that sees it, j - (n_k - n_q) (MaskedKeys)
SEEN_KEYS = f"Min({KEYS}, i - cu_k(b) + cu_k(b + 1) + cu_q(b) - cu_q(b + 1) + 1)"
SEEING_QUERIES = f"{QUERIES} - Max(0, j + cu_k(b) - cu_k(b + 1) - cu_q(b) + cu_q(b + 1))"


@pytest.mark.parametrize("kernel, extents", [
    ("attention_varlen_fwd", {("i", QUERIES), ("j", KEYS)}),
    ("attention_varlen_bwd", {("i", QUERIES), ("j", KEYS)}),
    (KERNEL, {("i", QUERIES), ("j", SEEN_KEYS)}),
    ("attention_varlen_bwd_causal", {("i", QUERIES), ("j", SEEN_KEYS), ("j", KEYS),
                                     ("i", SEEING_QUERIES)})])
def test_every_loop_over_a_sequence_is_bounded_by_its_offsets(kernel, extents):
    """A sequence's query and key loops run over its own rows: no loop over total_q or
    total_k rows that a mask would discard."""
    onf = onf_of(kernel, "dnf")
    assert extents == {(str(lp.var), str(lp.stop - lp.start)) for n in onf.nests
                       for lp in walk(n.body) if isinstance(lp, Loop)
                       and str(lp.var) in ("i", "j")}


def test_masked_keys_cuts_only_what_adds_nothing():
    """attention_cross's causal row form (its max not floored): the max's pass stops at the
    row's last key, bit for bit the same ONF results; the sum's exp(-inf - m) would be NaN
    where m is -inf, so its pass keeps the mask. A nest with no mask: refused."""
    kernel = get_kernel("attention_cross_fwd_causal")
    steps = kernel.variant("dnf").steps()
    before = realize(kernel.dnf("dnf"), "dnf", steps)
    after = realize(kernel.dnf("dnf"), "dnf", steps[:3] + (MaskedKeys(),) + steps[3:])
    selects = lambda onf: sum(isinstance(x, S.Select) for n in onf.nests for s in walk(n.body)
                              for e in stmt_exprs(s) for x in S.subexpressions(e))
    cut = [lp for n in after.nests for lp in walk(n.body)
           if isinstance(lp, Loop) and isinstance(lp.stop, sympy.Min)]
    assert len(cut) == 1 and selects(after) == selects(before) - 1
    rng = np.random.default_rng(0)
    arrays = {"Q": rng.standard_normal((1, 1, 2, 5, 3)),
              **{a: rng.standard_normal((1, 1, 7, 3)) for a in "KV"}}
    scalars = {"scale": 0.5, "offset": 1}
    for name, value in run_onf(before, arrays, scalars).items():
        assert np.array_equal(value, run_onf(after, arrays, scalars)[name])
    with pytest.raises(NotApplicable, match="no pass a causal mask cuts"):
        realize(psi_reduce(varlen.spec(causal=False)), "dnf", (MaskedKeys(),))


def _floored_causal_backward(monkeypatch):
    """attention_cross's causal backward with the varlen's floored softmax: the varlen
    backward's row form over one sequence (its mask i + offset >= j) without the offsets,
    which the interpreter does not evaluate."""
    monkeypatch.setattr(cross, "FLOORED", ("causal",))
    return psi_reduce(cross.backward_spec("causal"))


BACKWARD_STEPS = varlen._backward(causal=False).algorithm


@pytest.mark.parametrize("offset", [0, 2])
def test_masked_keys_cuts_the_backward_passes_bit_for_bit(monkeypatch, offset):
    """dQ's pass over a row's keys stops at its last key seen, dK's and dV's over a key's
    queries start at the first that sees it (offset 0 with more keys than queries: the
    last keys are seen by none, their loops empty): the ONF's results bit for bit the
    unskipped ones, as the skipped terms are exact zeros. (A row that sees no key, lse
    -inf: test_varlen_backward's, in C and Fortran.)"""
    dnf = _floored_causal_backward(monkeypatch)
    before = realize(dnf, "dnf", BACKWARD_STEPS)
    after = realize(dnf, "dnf", BACKWARD_STEPS + (MaskedKeys(),))
    cut = sorted((n.label, str(lp.var), str(lp.start), str(lp.stop)) for n in after.nests
                 for lp in walk(n.body) if isinstance(lp, Loop)
                 and (isinstance(lp.stop, sympy.Min) or isinstance(lp.start, sympy.Max)))
    assert cut == [("dK", "i", "Max(0, j - offset)", "n_q"),
                   ("dQ", "j", "0", "Min(n, i + offset + 1)"),
                   ("dV", "i", "Max(0, j - offset)", "n_q")]
    rng = np.random.default_rng(offset)
    n_q, n = 5, 8
    arrays = {a: rng.standard_normal((1, 1, 2, n_q, 3)) for a in ("Q", "O", "dO")}
    arrays.update({a: rng.standard_normal((1, 1, n, 3)) for a in "KV"},
                  lse=rng.standard_normal((1, 1, 2, n_q)))
    scalars = {"scale": 0.5, "offset": offset}
    expected, got = run_onf(before, arrays, scalars), run_onf(after, arrays, scalars)
    for name, value in expected.items():
        assert not np.isnan(value).any() and np.array_equal(got[name], value)


def _weight_squared(stmts, p):
    """Each sum's term p * g made p * g * p."""
    return tuple(replace(s, body=_weight_squared(s.body, p)) if isinstance(s, Loop) else
                 replace(s, value=S.Bin("*", s.value, S.Local(p))) if isinstance(s, Store)
                 else s for s in stmts)


def test_masked_keys_refuses_what_it_cannot_cut_by_name(monkeypatch):
    """A pass whose exponential subtracts an lse not floored (attention_cross's: a row that
    sees no key would give exp(-inf + inf)), or whose weight is read other than as a term
    of a sum, is not cut: a nest with nothing else to cut is refused, saying why."""
    unfloored = psi_reduce(cross.backward_spec("causal"))
    with pytest.raises(NotApplicable, match="loop j: t's exp subtracts a value, not floored"):
        realize(unfloored, "dnf", BACKWARD_STEPS + (MaskedKeys(nest="dQ"),))
    onf = realize(_floored_causal_backward(monkeypatch), "dnf", BACKWARD_STEPS,
                  upto=len(BACKWARD_STEPS))
    onf = onf.with_nests([replace(n, body=_weight_squared(n.body, "t4")) if n.label == "dV"
                          else n for n in onf.nests], "dV's weight squared")
    with pytest.raises(NotApplicable, match="loop i: t4 is read other than as a term"):
        MaskedKeys(nest="dV")(onf)


@pytest.mark.parametrize("lang", ["c", "fortran"])
def test_no_other_sequence_is_read(lang):
    """NaN in every row but one sequence's: a kernel that visited them and masked them out
    would still give NaN (0 * NaN); this one gives the sequence's own attention."""
    fn = runtime.load(KERNEL, "dnf", lang, "float64")
    Q, K, V, cu_q, cu_k = _batch((3, 4, 2), (5, 4, 6))
    mine_q, mine_k = slice(cu_q[1], cu_q[2]), slice(cu_k[1], cu_k[2])
    poisoned = [np.full_like(a, np.nan) for a in (Q, K, V)]
    for a, kept, rows in zip(poisoned, (Q, K, V), (mine_q, mine_k, mine_k)):
        a[rows] = kept[rows]
    O, lse = fn(*poisoned, cu_q, cu_k, scale=0.5)
    one = [np.array([0, n]) for n in (4, 4)]
    expected = reference.attention_varlen_fwd_numpy(Q[mine_q], K[mine_k], V[mine_k], *one,
                                                    scale=0.5, causal=True)
    assert np.allclose(O[mine_q], expected[0], rtol=1e-13, atol=0)
    assert np.allclose(lse[mine_q], expected[1], rtol=1e-13, atol=0)


@pytest.mark.parametrize("lang", ["c", "fortran"])
def test_queries_that_see_no_key_get_zeros_and_minus_inf(lang):
    """Causal bottom-right, 3 queries against 1 key: the first two see none, the last sees
    the key (its O that key's V row, its lse its score); a sequence with no keys: none."""
    fn = runtime.load(KERNEL, "dnf", lang, "float64")
    Q, K, V, cu_q, cu_k = _batch((3, 2), (1, 0))
    O, lse = fn(Q, K, V, cu_q, cu_k, scale=0.5)
    unseen = [0, 1, 3, 4]
    assert (O[unseen] == 0).all() and (lse[unseen] == -np.inf).all()
    assert np.allclose(O[2], V[0][:, None, :], rtol=1e-15, atol=0)
    assert np.allclose(lse[2], 0.5 * np.einsum("grc,gc->gr", Q[2], K[0]), rtol=1e-14, atol=0)


def test_normwise_error_takes_equal_infinities_as_agreeing():
    ref = np.array([1.0, -np.inf])
    assert verify.normwise_error(ref.copy(), ref) == 0.0
    assert verify.normwise_error(np.array([1.0, 0.0]), ref) == np.inf
    assert verify.normwise_error(np.array([np.nan, -np.inf]), ref) == np.inf
    assert verify.normwise_error(np.array([1.5, -np.inf]), ref) == 0.5


def test_only_integer_arrays_index_and_packed_outputs_name_their_offsets():
    with pytest.raises(SpecError, match="only an integer array's entries are indices"):
        element(array("x", "n"), 0)
    cu, other = offsets("cu", "batch", "total"), offsets("cu2", "batch", "total")
    x = array("x", "total")
    spec = KernelSpec("k", (x, cu), (), (Output("y", lift(("s",), ("batch",), x), ("s", "i"),
                                                Packed("s", "i", other)),))
    with pytest.raises(SpecError, match="its offsets cu2 are not an input"):
        spec.validate()


def test_what_cannot_take_offsets_refuses_them_by_name():
    """An intermediate whose shape reads the offsets cannot be scratch (sized before the
    call); the interpreter evaluates no offsets."""
    spec = varlen.spec(causal=True)
    with pytest.raises(SpecError, match=r"cannot materialize probs: its shape .* reads the "
                                        "values of cu_k, cu_q"):
        psi_reduce(spec, materialize={"probs"})
    Q, K, V, cu_q, cu_k = _batch((2,), (3,))
    arrays = dict(Q=Q, K=K, V=V, cu_q=cu_q, cu_k=cu_k)
    with pytest.raises(SpecError, match="float and bool inputs only, not cu_q, cu_k"):
        run_onf(onf_of(KERNEL, "dnf"), arrays, {"scale": 0.5})
    with pytest.raises(SpecError, match="float and bool inputs only, not cu_q, cu_k"):
        evaluate_dnf(psi_reduce(spec), arrays, {"scale": 0.5})
