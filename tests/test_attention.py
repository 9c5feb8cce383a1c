"""The attention family's invariants, read off the IR: memory O(n d) outside the naive
variants, the atomic updates each variant performs, the owner variant's run-to-run
reproducibility, and the errors of the multi-nest transforms when they cannot apply."""
import numpy as np
import pytest
import sympy

from moagen import runtime
from moagen.cost.model import value
from moagen.cost.view import counting_view
from moagen.errors import ScheduleError
from moagen.kernels import KERNELS, get_kernel
from moagen.moa import scalar as S
from moagen.moa.dnf import psi_reduce
from moagen.moa.expr import idiv
from moagen.onf.count import atomic_updates
from moagen.onf.interpret import index_fn
from moagen.onf.loops import Let, Loop, Store, Update, walk
from moagen.onf.realize import initial_onf
from moagen.pipeline import onf_of
from moagen.steps.algebra.online import OnlineSoftmax
from moagen.steps.algebra.partials import PartBuffers
from moagen.steps.algebra.scatter import Scatter
from moagen.steps.loop.accumulate import Accumulate
from moagen.steps.loop.fusion import FuseNests
from moagen.steps.loop.hoist import Hoist

# attention_fwd*, attention_bwd* and attention_fwdbwd*, plain and causal
ATTENTION = [(k.name, v) for k in KERNELS.values()
             if k.name.startswith(("attention_fwd", "attention_bwd"))
             for v in k.variants_on("cpu")]


def _sizes(onf):
    return {s.name: s for s in onf.sizes}


def _elements(buffer):
    """The buffer's element count, whole divisions as divisions (a panel of n // 16 tiles),
    a minimum with a number as that number, which it never exceeds (a block's score row of
    min(n, 64))."""
    bounded = lambda m: min(a for a in m.args if a.is_Number)
    return sympy.Mul(*buffer.shape).replace(idiv, lambda a, b: a / b).replace(
        lambda e: isinstance(e, sympy.Min) and any(a.is_Number for a in e.args), bounded)


# ---- memory ----------------------------------------------------------------------------

@pytest.mark.parametrize("kernel, variant", ATTENTION)
def test_only_naive_variants_hold_temporaries_quadratic_in_n(kernel, variant):
    onf = onf_of(kernel, variant)
    n = _sizes(onf)["n"]
    degrees = {t.name: sympy.degree(_elements(t), n) for t in onf.temps}
    if variant == "naive":
        assert 2 in degrees.values(), degrees
    else:
        assert variant in ("dnf", "online", "flash", "atomic", "dq_atomic", "owner")
        assert all(deg <= 1 for deg in degrees.values()), degrees


@pytest.mark.parametrize("kernel, variant", ATTENTION)
def test_every_local_is_a_scalar(kernel, variant):
    """The IR has no local arrays: every array a statement touches is a declared buffer,
    so the temps bounded above are all the memory; per thread the rest is O(1) scalars."""
    onf = onf_of(kernel, variant)
    buffers = {b.name for b in onf.inputs + onf.outputs + onf.temps}
    written = {b.name for b in onf.outputs + onf.temps}
    for nest in onf.nests:
        for s in walk(nest.body):
            assert isinstance(s, (Loop, Let, Update, Store)), s
            if isinstance(s, Loop):
                continue
            assert isinstance(s.value, S.ScalarExpr)
            if isinstance(s, Store):
                assert s.array in written
            else:
                assert s.name not in buffers
            assert {x.array for x in _subexprs(s.value)
                    if isinstance(x, (S.Access, S.Load))} <= buffers


def _subexprs(e):
    yield e
    for c in S.children(e):
        yield from _subexprs(c)


# ---- atomic updates --------------------------------------------------------------------

def _atomic_executions(stmts, ints, counts):
    """Run the loop structure at concrete sizes, counting each atomic store executed."""
    for s in stmts:
        if isinstance(s, Loop):
            for k in range(index_fn(s.start)(ints), index_fn(s.stop)(ints)):
                _atomic_executions(s.body, {**ints, s.var.name: k}, counts)
        elif isinstance(s, Store) and s.atomic:
            counts[s.array] = counts.get(s.array, 0) + 1
    return counts


@pytest.mark.parametrize("causal", ["", "_causal"])
def test_atomic_update_counts(causal):
    fused = onf_of("attention_fwdbwd" + causal, "atomic")
    bwd = onf_of("attention_bwd" + causal, "atomic")
    dq = onf_of("attention_bwd" + causal, "dq_atomic")  # dQ's from the key rows' pass
    batch, heads, n, d = (_sizes(fused)[s] for s in ("batch", "heads", "n", "d"))
    per_gradient = batch * heads * n**2 * d
    # in closed form where the key blocks are full (the counting view: 64 divides n)
    fused_counts = atomic_updates(counting_view(fused).nests)
    bwd_counts = atomic_updates(counting_view(bwd).nests)
    assert set(fused_counts) == {"dK", "dV"} and set(bwd_counts) == {"dK"}
    assert sympy.simplify(sum(fused_counts.values()) - 2 * per_gradient) == 0
    assert sympy.simplify(fused_counts["dK"] - fused_counts["dV"]) == 0
    assert sympy.simplify(bwd_counts["dK"] - per_gradient) == 0
    assert sympy.simplify(sum(fused_counts.values()) / bwd_counts["dK"]) == 2
    assert atomic_updates(dq.nests) == {"dQ": per_gradient}
    # the exact counts agree with the statements actually executed at small sizes, a
    # partial key block's included
    for at in (dict(batch=1, heads=2, n=5, d=3), dict(batch=1, heads=1, n=67, d=2)):
        for onf in (fused, bwd, dq):
            executed = {}
            for nest in onf.nests:
                _atomic_executions(nest.body, dict(at), executed)
            env = {_sizes(onf)[k]: v for k, v in at.items()}
            assert executed == {a: value(c, env) for a, c in atomic_updates(onf.nests).items()}


@pytest.mark.parametrize("kernel, variant",
                         [kv for kv in ATTENTION if kv[1] not in ("atomic", "dq_atomic")])
def test_no_other_variant_has_atomic_updates(kernel, variant):
    onf = onf_of(kernel, variant)
    assert atomic_updates(onf.nests) == {}
    assert not any(isinstance(s, Store) and s.atomic for n in onf.nests for s in walk(n.body))


# ---- reproducibility -------------------------------------------------------------------

@pytest.mark.parametrize("lang", ["c", "fortran"])
@pytest.mark.parametrize("kernel, params", [("attention_fwdbwd", None),
                                            ("attention_fwdbwd_causal", None),
                                            ("attention_fwdbwd", {"parts": 2, "lanes": 0})])
def test_owner_variant_is_bitwise_reproducible(kernel, params, lang):
    """Each output element of the owner variant is accumulated by one thread, in a fixed
    loop order, with no atomics: with the same thread count (OpenMP's default here) and
    the same inputs, every run performs the same floating-point operations in the same
    order, so the results are identical bit for bit. With parts, dQ's parts are each one
    thread's and are summed in a fixed order."""
    fn = runtime.load(kernel, "owner", lang, "float64", params)
    rng = np.random.default_rng(3)
    Q, K, V, dO = (rng.standard_normal((1, 2, 67, 16)) for _ in range(4))
    first, *others = [fn(Q, K, V, dO, scale=0.25) for _ in range(3)]
    assert len(first) == 5
    for outputs in others:
        assert all(np.array_equal(a, b) for a, b in zip(first, outputs))


# ---- the owner's dQ from the key rows' pass (parts) -------------------------------------

def test_owner_parts_take_dq_from_the_key_rows_pass():
    """With parts there is no pass over query rows for dQ: the key rows' pass adds dS K into
    dQ's parts from the dS that dK uses, so the backward takes one exponential per score
    where it took two (the dQ pass's and the key rows'), and the merge sums the parts."""
    from moagen.cost.flops import count_ops
    from moagen.cost.view import counting_view
    plain, parts = (onf_of("attention_fwdbwd", "owner", params={"parts": p, "lanes": 0})
                    for p in (0, 2))
    assert [n.label for n in parts.nests] == ["forward", "forward.edge", "dQ.zero", "keys",
                                              "keys.edge", "dQ.merge"]
    assert "dQ" in [n.label for n in plain.nests]
    stored = {s.array for n in parts.nests if n.label.startswith("keys")
              for s in walk(n.body) if isinstance(s, Store)}
    assert {"dK", "dV", "dQ_part"} <= stored and "dQ" not in stored
    exps = [count_ops(counting_view(onf).nests)["exp"] for onf in (plain, parts)]
    size = _sizes(parts)
    for n in (64, 1000):  # the parts' lengths are Min of sizes: counted at numbers
        at = {size["batch"]: 2, size["heads"]: 3, size["n"]: n}
        assert (exps[0] - exps[1]).subs(at).doit() == 2 * 3 * n * n


# the register tiles' builds take seconds each: those in C only (Fortran's tiled owner is
# verified with its defaults by moagen verify's tests)
@pytest.mark.parametrize("lang, params", [("c", {"parts": 4, "rows": 4, "keys": 2}),
                                          *((lang, {"parts": 2, "rows": 1, "keys": 2, "lanes": 0})
                                            for lang in ("c", "fortran"))])
@pytest.mark.parametrize("kernel", ["attention_fwdbwd", "attention_fwdbwd_causal"])
def test_owner_parts_match_the_references(kernel, lang, params):
    """At the verification sizes: n = 1 leaves parts empty, n = 7 and 257 cut the parts,
    rows and keys unevenly; at 257 two parts of one row each have 129 and 128 key rows, in
    blocks of 64 (BlockInterchange), the last of one row. lanes 0: the GPU's form (a row of
    the other side at a time), on the CPU."""
    from moagen.bench.tune import verify
    for dtype in ("float64", "float32"):
        verify(kernel, "owner", lang, dtype, params)


# ---- the multi-nest transforms refuse what they cannot do ------------------------------

def _initial(kernel, variant):
    k = get_kernel(kernel)
    return initial_onf(psi_reduce(k.spec, k.variant(variant).materialize), variant)


ROWS = ("b", "h", "i")


@pytest.mark.parametrize("kernel, variant, schedule, words", [
    # lse is max + log(sum): no sum at the top to scatter
    ("attention_fwd", "dnf", [Scatter("lse", over="j", outer=("b", "h"))],
     "nest lse is not a store of a sum over j inside its output loops"),
    # dK sums over query rows i, not over keys
    ("attention_bwd", "dnf", [Scatter("dK", over="j", outer=("b", "h"))],
     "nest dK is not a store of a sum over j inside its output loops"),
    # without the scatter dK's rows are keys: its outer loops are b, h, j
    ("attention_bwd", "dnf", [FuseNests(("dQ", "dK"), over=ROWS, name="rows")],
     "nest dK does not start with the loops b, h, i"),
    # a probability needs its whole row of scores, later keys j included
    ("attention_fwd", "naive", [FuseNests(("scores", "probs"), over=ROWS + ("j",), name="x")],
     "nest probs reads scores at another iteration of b, h, i, j than the one writing it"),
    # before Hoist the row max and sum are inside expressions, not statements
    ("attention_fwd", "dnf", [Accumulate("c", over="j", nest="O"),
                              FuseNests(("O", "lse"), over=ROWS, name="rows"),
                              OnlineSoftmax("rows")],
     "nest rows has no max, sum of exponentials and loop over the same index to fuse"),
    # the backward has the forward's lse, no max to run online
    ("attention_bwd", "dnf", [Hoist(), OnlineSoftmax("dQ")],
     "nest dQ has no max, sum of exponentials and loop over the same index to fuse"),
    # the pattern is there, but the loop stores probabilities instead of accumulating
    ("attention_fwd", "naive", [Hoist(), OnlineSoftmax("probs")],
     "a store in the fused loop does not accumulate a sum"),
    # parts of a sum need the zero nest Scatter leaves
    ("attention_fwdbwd", "owner", [PartBuffers("dQ", "i", "dQ", 2)], "has no nest 'dQ.zero'"),
    ("attention_fwdbwd", "owner", [Scatter("dQ", over="j", outer=("b", "h")),
                                   PartBuffers("dQ", "j", "dQ", 0)],
     "the number of parts must be at least 1"),
    # dK's loop over its rows j adds nothing into dQ
    ("attention_fwdbwd", "owner", [Scatter("dQ", over="j", outer=("b", "h")),
                                   PartBuffers("dK", "j", "dQ", 2)],
     "nest dK does not only add into dQ in its loop over j"),
])
def test_multi_nest_transforms_that_cannot_apply_raise(kernel, variant, schedule, words):
    onf = _initial(kernel, variant)
    *before, failing = schedule
    for transform in before:
        onf = transform(onf)
    with pytest.raises(ScheduleError) as info:
        failing(onf)
    assert words in str(info.value)


def test_part_buffers_refuse_a_nest_that_reads_the_sum_between_its_zeroing_and_it():
    """out = 0; y = out; out[k] += A[k, j] over j: with parts, the zero nest zeroes the
    parts and out is only set by the merge after the sum, so y would read what is no longer
    written there. Without the nest between, the parts sum to A's rows (the interpreter)."""
    from moagen.moa.expr import sym
    from moagen.onf.interpret import run_onf
    from moagen.onf.loops import ONF, Buffer, Nest
    k, j, n, m = sym("k"), sym("j"), sym("n"), sym("m")
    loop = lambda var, stop, *body: Loop(var, sympy.Integer(0), stop, tuple(body))
    zero = Nest("out", (loop(k, n, Store("out", (k,), S.Num(0.0))),), "out = 0", "out.zero")
    peek = Nest("y", (loop(k, n, Store("y", (k,), S.Access("out", (k,)))),), "y = out")
    add = Nest("out", (loop(j, m, loop(k, n, Store("out", (k,), S.Access("A", (k, j)),
                                                    accumulate="+"))),), "out += A")
    onf = lambda *nests: ONF("sums", "v", (Buffer("A", (n, m)),),
                             (Buffer("out", (n,)), Buffer("y", (n,))), (), (n, m), (), nests)
    with pytest.raises(ScheduleError, match="nest y touches out between its zero nest"):
        PartBuffers("out", "j", "out", 2)(onf(zero, peek, add))
    a = np.arange(15.0).reshape(3, 5)
    got = run_onf(PartBuffers("out", "j", "out", 2)(onf(zero, add)), {"A": a}, {})
    np.testing.assert_array_equal(got["out"], a.sum(1))


# ---- the online softmax's arithmetic ---------------------------------------------------

@pytest.mark.parametrize("kernel, variant, per_score, per_block", [
    ("attention_fwd", "online", 1, 1), ("attention_decode", "online", 1, 1),
    ("attention_fwd", "dnf", 2, 0),  # exp(s - max) in the sum and again in the probability
])
def test_the_online_softmax_takes_one_exponential_per_score(kernel, variant, per_score,
                                                            per_block):
    """Key by key, of exp(m - max(m, s)) and exp(s - max(m, s)) one is exp(0) = 1: the online
    form computes the other only; by blocks, one per score and the rescale once per block of
    64 keys (the cost model counts the exponentials the code computes)."""
    from moagen.cost import model
    from moagen.kernels.attention import KEY_BLOCK
    onf = onf_of(kernel, variant)
    size = _sizes(onf)
    scores = size["n"] * size["batch"] * size.get("heads", size.get("q_heads"))
    scores *= size["n"] if kernel == "attention_fwd" else 1
    expected = scores * (per_score + sympy.Rational(per_block, KEY_BLOCK))
    assert sympy.expand(model.predict(kernel, variant).ops["exp"] - expected) == 0
