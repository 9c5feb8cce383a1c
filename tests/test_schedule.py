"""Schedule transformations keep the value: every stage of every variant is executed by the
reference interpreter and compared with the untransformed ONF and with numpy. Also the
structure the schedules promise, and the errors they raise when they cannot apply."""
from dataclasses import replace
from functools import lru_cache

import numpy as np
import pytest
import sympy

from moagen import reference
from moagen.errors import ScheduleError
from moagen.kernels import get_kernel
from moagen.moa import scalar as S
from moagen.moa.dnf import psi_reduce
from moagen.moa.expr import array, inner, sym
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.interpret import run_onf
from moagen.onf.loops import ONF, Buffer, Let, Loop, Nest, Store, Update, walk
from moagen.onf.names import base_name
from moagen.onf.realize import initial_onf, realize
from moagen.steps.loop.accumulate import Accumulate
from moagen.steps.loop.hoist import Hoist
from moagen.steps.loop.interchange import Reorder
from moagen.steps.loop.layout import ApplyLayout
from moagen.steps.loop.parallel import Parallel
from moagen.steps.loop.reductions import LowerReductions
from moagen.steps.loop.split import Split


def _attention_reference(Q, K, V, scale, causal=False):
    scores = scale * np.einsum("bhic,bhjc->bhij", Q, K)
    if causal:  # query i sees keys j <= i
        n = scores.shape[-1]
        scores = np.where(np.tri(n, n, dtype=bool), scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    e = np.exp(scores - top)
    total = e.sum(-1, keepdims=True)
    return {"O": np.einsum("bhij,bhjc->bhic", e / total, V), "lse": (top + np.log(total))[..., 0]}


def _attention_bwd_reference(Q, K, V, O, dO, lse, scale, causal=False):
    """The gradients from the forward's O and lse; delta = rowsum(dO * O)."""
    scores = scale * np.einsum("bhic,bhjc->bhij", Q, K)
    if causal:
        n = scores.shape[-1]
        scores = np.where(np.tri(n, n, dtype=bool), scores, -np.inf)
    P = np.exp(scores - lse[..., None])
    dP = np.einsum("bhic,bhjc->bhij", dO, V)
    dS = P * (dP - (dO * O).sum(-1, keepdims=True))
    return {"dQ": scale * np.einsum("bhij,bhjc->bhic", dS, K),
            "dK": scale * np.einsum("bhij,bhic->bhjc", dS, Q),
            "dV": np.einsum("bhij,bhic->bhjc", P, dO)}


def _attention_fwdbwd_reference(Q, K, V, dO, scale, causal=False):
    forward = _attention_reference(Q, K, V, scale, causal)
    return {**forward, **_attention_bwd_reference(Q, K, V, forward["O"], dO, forward["lse"],
                                                  scale, causal)}


def _rmsnorm_reference(x, weight, eps):
    inv_rms = 1 / np.sqrt((x * x).mean(-1) + eps)
    return {"z": weight * x * inv_rms[..., None], "inv_rms": inv_rms}


def _gqa_bwd_reference(*args, causal=False):
    """Grouped queries (batch, kv_heads, group, n, d): moagen.reference's (each KV head
    repeated for its group, its gradients summed over the group), by name."""
    return dict(zip(("dQ", "dK", "dV"), reference.attention_gqa_bwd_numpy(*args, causal)))


_rng = np.random.default_rng(11)
_QKV = {n: _rng.standard_normal((1, 3, 5, 3)) for n in "QKV"}
_DO = _rng.standard_normal((1, 3, 5, 3))


def _backward_inputs(causal):
    """Q, K, V, the forward's own O and lse (the backward assumes them consistent), dO."""
    forward = _attention_reference(*_QKV.values(), 0.45, causal)
    return {**_QKV, "O": forward["O"], "dO": _DO, "lse": forward["lse"]}


def _gqa_backward_inputs():
    """Grouped queries (batch 1, 2 KV heads, groups of 2, n 5, d 3), K and V, the
    forward's own O and lse, dO."""
    Q = _rng.standard_normal((1, 2, 2, 5, 3))
    K, V = (_rng.standard_normal((1, 2, 5, 3)) for _ in range(2))
    O, lse = reference.attention_gqa_fwd_numpy(Q, K, V, 0.45, True)
    return {"Q": Q, "K": K, "V": V, "O": O, "dO": _rng.standard_normal(Q.shape), "lse": lse}


PROBLEMS = {  # inputs at tiny odd sizes, scalars, the numpy result
    "attention_fwd": (_QKV, {"scale": 0.45}, _attention_reference),
    "attention_fwd_causal": (_QKV, {"scale": 0.45},
                             lambda *args: _attention_reference(*args, causal=True)),
    "attention_bwd": (_backward_inputs(False), {"scale": 0.45}, _attention_bwd_reference),
    "attention_bwd_causal": (_backward_inputs(True), {"scale": 0.45},
                             lambda *args: _attention_bwd_reference(*args, causal=True)),
    "attention_fwdbwd": ({**_QKV, "dO": _DO}, {"scale": 0.45}, _attention_fwdbwd_reference),
    "attention_fwdbwd_causal": ({**_QKV, "dO": _DO}, {"scale": 0.45},
                                lambda *args: _attention_fwdbwd_reference(*args, causal=True)),
    "rmsnorm_fwd": ({"x": _rng.standard_normal((3, 5, 7)), "weight": _rng.standard_normal(7)},
                    {"eps": 0.1}, _rmsnorm_reference),
    # grouped-query attention's backward: dK and dV summed over a group and its rows
    "attention_gqa_bwd_causal": (_gqa_backward_inputs(), {"scale": 0.45},
                                 lambda *args: _gqa_bwd_reference(*args, causal=True)),
}
VARIANTS = [(k, v) for k in PROBLEMS for v in get_kernel(k).variants_on("cpu")]
# and schedules the defaults do not take: the owner's dQ added from the key rows' pass, in
# two parts and in four (n = 5: parts of two keys and of one), rows and keys cutting them
SCHEDULES = [(k, v, None) for k, v in VARIANTS] + [
    ("attention_fwdbwd", "owner", {"parts": 2}),
    ("attention_fwdbwd", "owner", {"parts": 4, "rows": 2, "keys": 2}),
    ("attention_fwdbwd_causal", "owner", {"parts": 2})]


@lru_cache(maxsize=None)
def _dnf(kernel, variant):
    return psi_reduce(get_kernel(kernel).spec, get_kernel(kernel).variant(variant).materialize)


def _run(kernel, onf):
    arrays, scalars, _ = PROBLEMS[kernel]
    return run_onf(onf, arrays, scalars)


@lru_cache(maxsize=None)
def _expected(kernel):
    arrays, scalars, reference = PROBLEMS[kernel]
    return reference(*arrays.values(), *scalars.values())


def _assert_same(got, want, rtol=1e-13):
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=1e-14, err_msg=name)


def _scheduled(kernel, variant):
    """The variant's ONF after its schedule, before lowering."""
    onf = initial_onf(_dnf(kernel, variant), variant)
    for transform in get_kernel(kernel).variant(variant).steps():
        onf = transform(onf)
    return onf


# ---- every stage of every variant ------------------------------------------------------

@pytest.mark.parametrize("kernel, variant, params", SCHEDULES)
def test_every_stage_keeps_the_value(kernel, variant, params):
    onf = initial_onf(_dnf(kernel, variant), variant)
    base = _run(kernel, onf)
    _assert_same(base, _expected(kernel), rtol=1e-12)
    stages = []
    schedule = get_kernel(kernel).variant(variant).steps(params)
    for transform in schedule:
        onf = transform(onf)
        stages.append((str(transform), onf))
    onf = LowerReductions()(onf)
    stages.append(("lower_reductions", onf))
    stages.append(("apply_layout", ApplyLayout()(onf)))
    for layout in ("row", "col"):
        stages.append((f"realize {layout}", realize(_dnf(kernel, variant), variant, schedule,
                                                    layout)))
    assert stages[-1][1].flat and stages[-1][1].layout == "col"
    for name, stage in stages:
        try:
            _assert_same(_run(kernel, stage), base)
        except AssertionError as error:
            raise AssertionError(f"after {name}: {error}") from None


# ---- split, reorder, parallel ----------------------------------------------------------

SPLITS = [("attention_fwd", v, var) for v in ("naive", "dnf") for var in ("i", "j", "c")]
SPLITS += [("rmsnorm_fwd", v, var) for v in ("naive", "dnf") for var in ("i", "c")]


def _split_everywhere(onf, var, tile):
    """Split var in each nest that has such a loop (a nest-less Split wants it in all)."""
    for nest in onf.nests:
        if any(isinstance(s, Loop) and s.var.name == var for s in walk(nest.body)):
            onf = Split(var, tile, nest.label)(onf)
    return onf


@pytest.mark.parametrize("tile", [1, 2, 3, 8])
@pytest.mark.parametrize("kernel, variant, var", SPLITS)
def test_split_keeps_the_value(kernel, variant, var, tile):
    scheduled = _scheduled(kernel, variant)
    before = _split_everywhere(scheduled, var, tile)
    after = _split_everywhere(LowerReductions()(scheduled), var, tile)
    for split in (before, after):
        # every loop over var now runs alone inside a block loop of its own
        nested = [around for n in split.nests for s, around in _with_loops(n.body)
                  if isinstance(s, Loop) and s.var.name == var]
        assert nested and all(base_name(around[-1]) == f"{var}_blk" for around in nested)
    for onf in (LowerReductions()(before), after):
        for layout in ("row", "col"):
            _assert_same(_run(kernel, ApplyLayout()(replace(onf, layout=layout))),
                         _expected(kernel), rtol=1e-12)


def _with_loops(stmts, around=()):
    """(statement, the variables of the loops around it) for every statement."""
    for s in stmts:
        yield s, around
        if isinstance(s, Loop):
            yield from _with_loops(s.body, around + (s.var.name,))


def _chain(stmts):
    """The variables of the perfectly nested loops a nest starts with."""
    names = []
    while len(stmts) == 1 and isinstance(stmts[0], Loop):
        names.append(stmts[0].var.name)
        stmts = stmts[0].body
    return names


@pytest.mark.parametrize("kernel, variant, lowered, nest, order", [
    ("attention_fwd", "naive", False, "O", ("c", "i", "b", "h")),
    ("attention_fwd", "naive", False, "scores", ("j", "b", "i", "h")),
    ("attention_fwd", "naive", True, "scores", ("j", "i", "h", "b")),
    ("attention_fwd", "dnf", False, "O", ("i", "c", "h", "b")),
    ("rmsnorm_fwd", "naive", False, "z", ("c", "i", "b")),
    ("rmsnorm_fwd", "naive", True, "inv_rms", ("i", "b")),
])
def test_reorder_keeps_the_value(kernel, variant, lowered, nest, order):
    onf = initial_onf(_dnf(kernel, variant), variant)
    onf = Reorder(order, nest)(LowerReductions()(onf) if lowered else onf)
    reordered = next(n for n in onf.nests if n.target == nest)
    assert _chain(reordered.body)[:len(order)] == list(order)
    _assert_same(_run(kernel, ApplyLayout()(LowerReductions()(onf))), _expected(kernel), rtol=1e-12)


@pytest.mark.parametrize("kernel, variant", VARIANTS)
def test_reorder_of_the_parallel_rows_after_the_schedule(kernel, variant):
    onf = _scheduled(kernel, variant)
    rows = _chain(onf.nests[-1].body)[:2]
    # every nest over the rows (a panel's copy, flash's K_panel and V_panel, runs over loops of
    # its own)
    over_rows = [n.label for n in onf.nests if _chain(n.body)[:2] == rows]
    for label in over_rows:
        onf = Reorder(tuple(reversed(rows)), label)(onf)
    assert all(_chain(n.body)[:2] == rows[::-1] for n in onf.nests if n.label in over_rows)
    _assert_same(_run(kernel, ApplyLayout()(LowerReductions()(onf))), _expected(kernel), rtol=1e-12)


@pytest.mark.parametrize("kernel, loops, nest", [
    ("attention_fwd", ("b",), None),
    ("attention_fwd", ("b", "h", "i"), None),
    ("attention_fwd", ("b", "h", "i", "c"), "O"),  # lse has no loop over c
    ("rmsnorm_fwd", ("b", "i", "c"), "z"),  # inv_rms has no loop over c
])
def test_parallel_marks_the_nest_and_keeps_the_value(kernel, loops, nest):
    onf = Parallel(loops, nest)(initial_onf(_dnf(kernel, "dnf"), "dnf"))
    marked = [len(loops) if nest in (None, n.label) else 0 for n in onf.nests]
    assert [n.body[0].parallel for n in onf.nests] == marked
    _assert_same(_run(kernel, ApplyLayout()(LowerReductions()(onf))), _expected(kernel), rtol=1e-12)


# ---- the structure the schedules promise -----------------------------------------------

def test_fused_attention_computes_each_row_max_once_outside_the_output_loops():
    onf = realize(_dnf("attention_fwd", "dnf"), "dnf",
                  get_kernel("attention_fwd").variant("dnf").steps())
    for nest in onf.nests:
        maxes = [(s, around) for s, around in _with_loops(nest.body)
                 if isinstance(s, Update) and s.op == "max"]
        assert len(maxes) == 1
        (update, around), = maxes
        assert not any(base_name(v) == "c" for v in around), around
        # its accumulator is declared once, outside the loop over keys
        lets = [a for s, a in _with_loops(nest.body)
                if isinstance(s, Let) and s.name == update.name]
        assert len(lets) == 1 and len(lets[0]) == len(around) - 1


def _square_buffers(onf, n=sym("n")):
    return {b.name for b in onf.inputs + onf.outputs + onf.temps
            if list(b.shape).count(n) >= 2}


def _arrays_touched(onf):
    touched = set()
    for nest in onf.nests:
        for s in walk(nest.body):
            if isinstance(s, Store):
                touched.add(s.array)
            for e in ((s.value,) if isinstance(s, (Let, Update, Store)) else ()):
                touched |= {x[1:] for x in S.free_names(e) if x.startswith("@")}
    return touched


@pytest.mark.parametrize("variant", get_kernel("attention_fwd").variants_on("cpu"))
def test_only_naive_attention_has_n_by_n_temporaries(variant):
    onf = realize(_dnf("attention_fwd", variant), variant,
                  get_kernel("attention_fwd").variant(variant).steps())
    square = _square_buffers(onf)
    temps = {t.name for t in onf.temps}
    if variant == "naive":
        assert square == {"scores", "probs"} == temps
    else:  # online: one block of keys' scores per query row; flash: and K and V in panels
        scratch = {"online": {"probs"}, "flash": {"probs", "K_panel", "V_panel"}}
        assert square == set() and temps == scratch.get(variant, set())
    assert _arrays_touched(onf) == {"Q", "K", "V", "O", "lse"} | temps


# ---- accumulate ------------------------------------------------------------------------

def test_accumulate_moves_a_sum_of_sums_loop_by_loop():
    """y[c] = sum_r sum_i A[r, i, c] (a KV head's gradient: over its group's query heads,
    then over their rows): the first Accumulate starts y at zero and adds each r's sum; the
    second adds its terms one by one into the same y, with no second zeroing."""
    C, r2, i2 = sym("c"), sym("r2"), sym("i2")
    inner_sum = S.Reduction("+", i2, sym("n"), S.Access("A", (r2, i2, C)), "acc")
    body = (Loop(C, sympy.Integer(0), sym("d"), (
        Store("y", (C,), S.Reduction("+", r2, sym("group"), inner_sum, "over_r")),)),)
    onf = ONF("sums", "v", (Buffer("A", (sym("group"), sym("n"), sym("d"))),),
              (Buffer("y", (sym("d"),)),), (), (sym("group"), sym("n"), sym("d")), (),
              (Nest("y", body, "by hand"),))
    onf = Accumulate("c", over="i")(Accumulate("c", over="r")(onf))
    zero, (sweep,) = onf.nests[0].body[0], onf.nests[0].body[1:]
    assert zero.body[0].value == S.Num(0.0)
    assert [lp.var.name for lp in walk((sweep,)) if isinstance(lp, Loop)] == ["r", "i", "c"]
    assert [st.accumulate for st in walk((sweep,)) if isinstance(st, Store)] == ["+"]
    a = _rng.standard_normal((2, 3, 4))
    np.testing.assert_allclose(run_onf(ApplyLayout()(LowerReductions()(onf)), {"A": a}, {})["y"],
                               a.sum((0, 1)), rtol=1e-13)


def test_accumulate_over_the_role_of_the_output_loop_keeps_the_value():
    # C[i, c] = sum_c2 A[i, c2] B[c2, c]: the new reduction loop must not reuse c
    A, B = array("A", "m", "k"), array("B", "k", "p")
    spec = KernelSpec("mm", (A, B), (), (Output("C", inner(A, B, var="c"), ("i", "c")),))
    onf = Accumulate("c", over="c")(initial_onf(psi_reduce(spec), "v"))
    loops = [s.var.name for s in walk(onf.nests[0].body) if isinstance(s, Loop)]
    assert sorted(loops) == ["c", "c", "c2", "i"]
    a, b = _rng.standard_normal((3, 5)), _rng.standard_normal((5, 7))
    np.testing.assert_allclose(run_onf(ApplyLayout()(LowerReductions()(onf)), {"A": a, "B": b},
                                       {})["C"], a @ b, rtol=1e-13)


# ---- errors ----------------------------------------------------------------------------

def _attention(variant="dnf"):
    return initial_onf(_dnf("attention_fwd", variant), variant)


@pytest.mark.parametrize("onf, transform, words", [
    (_attention(), Accumulate("x", over="j"), "has no loop x whose body is a single store"),
    (_attention(), Accumulate("c", over="k"), "of a reduction over k"),
    (_attention(), Split("i", 0), "at least 1"),
    (_attention(), Split("x", 2), "nest O has no loop x"),
    (Split("i", 2)(_attention()), Split("i", 3), "loop i does not start at 0"),
    (_scheduled("attention_fwd", "dnf"), Split("h", 2), "parallel iteration space"),
    (Accumulate("c", over="j")(_attention()), Reorder(("b", "h", "i", "c")),
     "the outermost perfectly nested loops of nest O are not b, c, h, i"),
    (Split("i", 2)(_attention()), Reorder(("b", "h", "i", "i_blk")),
     "the bounds of i depend on a loop that would be inside it"),
    (_attention(), Parallel(("h", "i")), "does not start with the perfectly nested loops h, i"),
    (_attention(), Parallel(("b", "i")), "does not start"),
    (Accumulate("c", over="j")(_attention()), Parallel(("b", "h", "i", "c")), "does not start"),
    (_attention(), Hoist(nest="scores"), "has no nest 'scores'; it has O"),
    (_attention("naive"), Split("j", 2, nest="P"), "has no nest 'P'; it has scores, probs, O"),
])
def test_transformations_that_cannot_apply_raise(onf, transform, words):
    with pytest.raises(ScheduleError) as info:
        transform(onf)
    assert words in str(info.value)


def _by_hand(*body):
    """A one-nest ONF computing y(m) from A(m, n)."""
    m, n = sym("m"), sym("n")
    return ONF("by_hand", "v", inputs=(Buffer("A", (m, n)),), outputs=(Buffer("y", (m,)),),
               temps=(), sizes=(m, n), scalars=(), nests=(Nest("y", tuple(body), "by hand"),))


I, J = sym("i"), sym("j")
A_IJ = S.Access("A", (I, J))


def _loop(var, stop, *body):
    return Loop(var, sympy.Integer(0), stop, tuple(body))


def test_a_row_sum_by_hand_runs_in_parallel():
    onf = Parallel(("i",))(_by_hand(_loop(I, sym("m"), Let("s", S.Num(0.0)),
                                          _loop(J, sym("n"), Update("s", "+", A_IJ)),
                                          Store("y", (I,), S.Local("s")))))
    a = _rng.standard_normal((3, 5))
    for layout in ("row", "col"):
        got = run_onf(ApplyLayout()(replace(onf, layout=layout)), {"A": a}, {})
        np.testing.assert_allclose(got["y"], a.sum(1), rtol=1e-13)


@pytest.mark.parametrize("onf, transform, words", [
    # every j would write the same y[i]
    (_by_hand(_loop(I, sym("m"), _loop(J, sym("n"), Store("y", (I,), A_IJ)))),
     Parallel(("i", "j")), "store to y is not indexed by j: parallel iterations would race"),
    # s is not declared inside the parallel loop, so every i would update the same s
    (_by_hand(_loop(I, sym("m"), Update("s", "+", S.Access("A", (I, 0))),
                    Store("y", (I,), S.Local("s")))),
     Parallel(("i",)), "s is shared by parallel iterations"),
    # y[i] = sum over j < i + 1: the reduction loop cannot move outside the loop over i
    (_by_hand(_loop(I, sym("m"), Store("y", (I,), S.Reduction("+", J, I + 1, A_IJ, "s")))),
     Accumulate("i", over="j"), "the extent i + 1 of j depends on i"),
])
def test_transformations_on_hand_built_nests_that_cannot_apply_raise(onf, transform, words):
    with pytest.raises(ScheduleError) as info:
        transform(onf)
    assert words in str(info.value)


# ---- sibling fusion --------------------------------------------------------------------

def _loop_to_n(var, *body):
    return Loop(sym(var), sympy.Integer(0), sym("n"), tuple(body))


def _add_at_k(array, value):
    return Store(array, (sym("k"),), value, accumulate="+")


def test_sibling_fusion_moves_the_earlier_loop_down_when_the_later_cannot_move_up():
    """[for k: y += x;  for c: z = 0;  for k: z += x]: the second k loop reads z, zeroed
    between them, so it cannot move up; the first touches nothing the zeroing does, so it
    moves down: one k loop after the zeroing. Had the first read z, nothing fuses."""
    from moagen.steps.loop.fusion import fuse_siblings
    x = S.Access("x", (sym("k"),))
    first = _loop_to_n("k", _add_at_k("y", x))
    zero = _loop_to_n("c", Store("z", (sym("c"),), S.Num(0.0)))
    second = _loop_to_n("k", _add_at_k("z", x))
    fused = _loop_to_n("k", first.body[0], second.body[0])
    assert fuse_siblings((first, zero, second)) == (zero, fused)
    reads_z = _loop_to_n("k", _add_at_k("y", S.Access("z", (sym("k"),))))
    assert fuse_siblings((reads_z, zero, second)) == (reads_z, zero, second)


def test_nest_fusion_runs_where_the_first_member_ran_when_the_others_can_move_up():
    """[a = x;  b = a + 1;  c = 2 x] fusing a and c: a cannot move down past b (b reads
    it), c can move up past it (they share nothing): one nest [a, c] before b, values
    unchanged (the interpreter). When c reads b, neither can move: refused."""
    from moagen.steps.loop.fusion import FuseNests
    i, n = sym("i"), sym("n")
    x = S.Access("x", (i,))

    def nest(array, value):
        return Nest(array, (Loop(i, sympy.Integer(0), n, (Store(array, (i,), value),)),), array)

    a, c = nest("a", x), nest("c", S.Bin("*", S.Num(2.0), x))
    b = nest("b", S.Bin("+", S.Access("a", (i,)), S.Num(1.0)))
    onf = ONF("three", "test", (Buffer("x", (n,)),), (Buffer("b", (n,)), Buffer("c", (n,))),
              (Buffer("a", (n,)),), (n,), (), (a, b, c))
    fused = FuseNests(("a", "c"), over=("i",), name="ac")(onf)
    assert [n.name or n.target for n in fused.nests] == ["ac", "b"]
    xs = np.linspace(1, 2, 5)
    got = run_onf(fused, {"x": xs}, {})
    np.testing.assert_array_equal(got["b"], xs + 1)
    np.testing.assert_array_equal(got["c"], 2 * xs)
    reads_b = nest("c", S.Access("b", (i,)))
    with pytest.raises(ScheduleError, match="nest a cannot move past nest b"):
        FuseNests(("a", "c"), over=("i",), name="ac")(onf.with_nests([a, b, reads_b]))


# ---- loop distribution -----------------------------------------------------------------

def test_distribution_gives_each_array_its_loop_and_keeps_the_value():
    """for k: y += x; z += 2 x; y += z0  ->  for k: y += x; y += z0;  for k: z += 2 x,
    each array's additions in their order; run by the interpreter against numpy. Additions
    that read another's array are refused."""
    from moagen.steps.loop.distribute import Distribute
    k, n = sym("k"), sym("n")
    x = S.Access("x", (k,))
    adds = (Store("y", (k,), x, accumulate="+"),
            Store("z", (k,), S.Bin("*", S.Num(2.0), x), accumulate="+"),
            Store("y", (k,), S.Access("w", (k,)), accumulate="+"))
    zero = Loop(k, sympy.Integer(0), n, (Store("y", (k,), S.Num(0.0)),
                                         Store("z", (k,), S.Num(0.0))))
    nest = lambda body: Nest("y", (zero, Loop(k, sympy.Integer(0), n, body)), "y, z")
    onf = ONF("two_sums", "test", (Buffer("x", (n,)), Buffer("w", (n,))),
              (Buffer("y", (n,)), Buffer("z", (n,))), (), (n,), (), (nest(adds),))
    split = Distribute("k")(onf)
    loops = split.nests[0].body
    # the zeroing stores are not additions: their loop stays whole
    assert [[s.array for s in lp.body] for lp in loops] == [["y", "z"], ["y", "y"], ["z"]]
    xs, ws = np.arange(5.0), np.linspace(1, 2, 5)
    got = run_onf(split, {"x": xs, "w": ws}, {})
    np.testing.assert_array_equal(got["y"], xs + ws)
    np.testing.assert_array_equal(got["z"], 2 * xs)
    reads_z = adds[:2] + (Store("y", (k,), S.Access("z", (k,)), accumulate="+"),)
    with pytest.raises(ScheduleError, match="read each other's arrays"):
        Distribute("k")(onf.with_nests([nest(reads_z)]))
    with pytest.raises(ScheduleError, match="no loop over c"):
        Distribute("c")(onf)


def test_distribution_takes_each_loop_the_locals_it_reads():
    """for i: let a = x[i]; let b = 2 a; let u = w[i]; for c: y[c] += a v[c]; for c: z[c] +=
    b u  ->  one loop over i for y (with a) and one for z (with a, b, u), values unchanged;
    a local reading an array the loop adds into is refused."""
    from moagen.steps.loop.distribute import Distribute
    i, c, n, m = sym("i"), sym("c"), sym("n"), sym("m")
    lets = (Let("a", S.Access("x", (i,))), Let("b", S.Bin("*", S.Num(2.0), S.Local("a"))),
            Let("u", S.Access("w", (i,))))
    adds = (Loop(c, sympy.Integer(0), m, (Store("y", (c,), S.Bin("*", S.Local("a"),
                                                                   S.Access("v", (c,))),
                                                accumulate="+"),)),
            Loop(c, sympy.Integer(0), m, (Store("z", (c,), S.Bin("*", S.Local("b"),
                                                                   S.Local("u")),
                                                accumulate="+"),)))
    zero = Loop(c, sympy.Integer(0), m, (Store("y", (c,), S.Num(0.0)),
                                         Store("z", (c,), S.Num(0.0))))
    nest = lambda body: Nest("y", (zero, Loop(i, sympy.Integer(0), n, body)), "y, z")
    onf = ONF("rows_summed", "test", (Buffer("x", (n,)), Buffer("w", (n,)), Buffer("v", (m,))),
              (Buffer("y", (m,)), Buffer("z", (m,))), (), (n, m), (), (nest(lets + adds),))
    split = Distribute("i")(onf)
    loops = split.nests[0].body[1:]
    assert [[s.name for s in lp.body if isinstance(s, Let)] for lp in loops] == [["a"],
                                                                                 ["a", "b", "u"]]
    xs, ws, vs = np.arange(4.0), np.linspace(1, 2, 4), np.array([1.0, -2.0, 0.5])
    got = run_onf(split, {"x": xs, "w": ws, "v": vs}, {})
    np.testing.assert_allclose(got["y"], xs.sum() * vs, rtol=1e-15)
    np.testing.assert_allclose(got["z"], np.full(3, (2 * xs * ws).sum()), rtol=1e-15)
    reads_y = (Let("a", S.Access("y", (sympy.Integer(0),))),) + lets[1:]
    with pytest.raises(ScheduleError, match="reads an array the loop adds into"):
        Distribute("i")(onf.with_nests([nest(reads_y + adds)]))


def test_fission_splits_a_loop_into_the_chains_no_value_flows_between():
    """for j: let a = x[j]; let b = w[j]; y[j] = 2 a; let t = a + 1; z[j] = b t  ->  the
    chains {b} and {a, y, t, z} are joined by z (it reads b and t): one loop; without z's
    read of b, two loops, {a, y, t} then {b, z}, in the order of their first statements,
    values unchanged (the interpreter against numpy); a loop with one chain is left alone."""
    from moagen.steps.loop.fission import Fission
    from moagen.steps.step import NotApplicable
    j, n = sym("j"), sym("n")
    a, b, t = S.Local("a"), S.Local("b"), S.Local("t")

    def onf(z_value):
        body = (Let("a", S.Access("x", (j,))), Let("b", S.Access("w", (j,))),
                Store("y", (j,), S.Bin("*", S.Num(2.0), a)),
                Let("t", S.Bin("+", a, S.Num(1.0))), Store("z", (j,), z_value))
        return ONF("chains", "test", (Buffer("x", (n,)), Buffer("w", (n,))),
                   (Buffer("y", (n,)), Buffer("z", (n,))), (), (n,), (),
                   (Nest("y", (Loop(j, sympy.Integer(0), n, body),), "y, z"),))

    with pytest.raises(NotApplicable, match="no loop over j whose body is independent"):
        Fission("j")(onf(S.Bin("*", b, t)))
    split = Fission("j")(onf(S.Bin("*", b, b)))
    loops = split.nests[0].body
    assert [[getattr(s, "name", None) or s.array for s in lp.body] for lp in loops] == \
        [["a", "y", "t"], ["b", "z"]]
    xs, ws = np.arange(5.0), np.linspace(1, 2, 5)
    got = run_onf(split, {"x": xs, "w": ws}, {})
    np.testing.assert_array_equal(got["y"], 2 * xs)
    np.testing.assert_array_equal(got["z"], ws * ws)
