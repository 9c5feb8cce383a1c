"""SplitLoop: a loop over h as groups and their members (h = inner g + r), the group's
quotient idiv(h, inner) becoming g; the values it keeps (ONF interpreter), jamming members
of a group afterwards, and decode's query heads reading their group's KV row through one
index expression."""
import numpy as np
import pytest
import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import idiv, sym
from moagen.onf.interpret import run_onf
from moagen.onf.loops import ONF, Buffer, Loop, Nest, Store, walk
from moagen.pipeline import onf_of
from moagen.steps.loop.split import SplitLoop
from moagen.steps.loop.unroll import UnrollJam

H, GROUPS, h = sym("H"), sym("P"), sym("h")
MEMBERS = idiv(H, GROUPS)


def _grouped(read_index=None):
    """y[h] = x[h // (H / P)] * w[h]: each of P groups of H / P members reads its group's x."""
    value = S.Bin("*", S.Access("x", (idiv(h, MEMBERS),)), S.Access("w", (read_index or h,)))
    body = (Store("y", (h,), value),)
    return ONF("grouped", "test", (Buffer("x", (GROUPS,)), Buffer("w", (H,))), (Buffer("y", (H,)),),
               (), (H, GROUPS), (), (Nest("y", (Loop(h, sympy.Integer(0), H, body),), "y"),))


def _accesses(onf, array):
    return [e.index for s in walk(onf.nests[0].body) if isinstance(s, Store)
            for e in S.subexpressions(s.value) if isinstance(e, S.Access) and e.array == array]


def _expected(x, w, groups):
    members = len(w) // groups
    return x[np.arange(len(w)) // members] * w


@pytest.mark.parametrize("heads, groups", [(6, 2), (4, 4), (5, 1)])
def test_the_group_quotient_becomes_the_outer_variable(heads, groups):
    onf = SplitLoop("y", "h", outer="P", inner=MEMBERS)(_grouped())
    outer = onf.nests[0].body[0]
    assert (outer.var.name, outer.stop, outer.body[0].var.name) == ("g", GROUPS, "r")
    g, r = outer.var, outer.body[0].var
    assert _accesses(onf, "x") == [(g,)] and _accesses(onf, "w") == [(MEMBERS * g + r,)]
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal(groups), rng.standard_normal(heads)
    np.testing.assert_array_equal(run_onf(onf, {"x": x, "w": w}, {})["y"], _expected(x, w, groups))


@pytest.mark.parametrize("heads, groups", [(6, 2), (8, 2), (3, 3)])
def test_members_of_a_group_jam_and_share_its_read(heads, groups):
    """After the split, UnrollJam over the members: y's index inner g + r steps with r."""
    onf = UnrollJam("y", "r", 2)(SplitLoop("y", "h", outer="P", inner=MEMBERS)(_grouped()))
    assert len({index for index in _accesses(onf, "x")}) == 1  # one x[g] for both copies
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal(groups), rng.standard_normal(heads)
    np.testing.assert_array_equal(run_onf(onf, {"x": x, "w": w}, {})["y"], _expected(x, w, groups))


def test_jamming_refuses_an_array_read_at_another_members_element():
    """y read at h + 1 beside its store at h: jammed copies would not own their elements, so
    UnrollJam refuses; SplitLoop refuses a loop the nest's loops do not lead down to."""
    grouped = _grouped()
    value = S.Bin("+", grouped.nests[0].body[0].body[0].value, S.Access("y", (h + 1,)))
    nest = Nest("y", (Loop(h, sympy.Integer(0), H - 1, (Store("y", (h,), value),)),), "y")
    with pytest.raises(ScheduleError, match="y is not indexed by h at one position"):
        UnrollJam("y", "h", 2)(grouped.with_nests([nest]))
    with pytest.raises(ScheduleError, match="loops down to one over q"):
        SplitLoop("y", "q", outer="P", inner=MEMBERS)(grouped)


def test_decode_heads_of_a_group_read_one_kv_row():
    """Every copy of the jammed query heads reads K and V at the group g: one expression."""
    onf = onf_of("attention_decode", "online")
    heads = next(n for n in onf.nests if n.label == "heads")
    g = heads.body[0].body[0].var
    assert g.name == "g"
    for s in walk(heads.body):
        for x in (s.value,) if isinstance(s, Store) else ():
            for e in S.subexpressions(x):
                if isinstance(e, S.Load) and e.array in ("K", "V"):
                    assert "idiv" not in str(e.offset) and g in e.offset.free_symbols
