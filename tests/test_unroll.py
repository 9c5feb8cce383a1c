"""Unroll and jam: the structure it promises (copies sharing the inner loops, an edge nest
for the rows left over), the values it keeps (run by the ONF interpreter at sizes with and
without leftover rows), and the cases it refuses."""
import numpy as np
import pytest
import sympy

from moagen.codegen.emit import onf_of
from moagen.cost.model import predict
from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import sym
from moagen.onf.interpret import run_onf
from moagen.onf.loops import ONF, Buffer, Let, Loop, Nest, Store, Update, walk
from moagen.onf.schedule import Parallel
from moagen.onf.unroll import UnrollJam, rows_together

I, K, N, M = sym("i"), sym("k"), sym("n"), sym("m")


def _row_sums(index=(I,)):
    """y[i] = sum_k x[i, k], as a nest with a local accumulator."""
    body = (Let("s", S.Num(0.0)),
            Loop(K, sympy.Integer(0), M, (Update("s", "+", S.Access("x", (I, K))),)),
            Store("y", index, S.Local("s")))
    return ONF("row_sums", "test", (Buffer("x", (N, M)),), (Buffer("y", (N,)),), (), (N, M), (),
               (Nest("y", (Loop(I, sympy.Integer(0), N, body),), "y[i] = sum_k x[i, k]"),))


@pytest.mark.parametrize("n", [1, 3, 4, 9])
def test_copies_share_the_inner_loop_and_keep_the_value(n):
    onf = UnrollJam("y", "i", 4)(_row_sums())
    assert [nest.label for nest in onf.nests] == ["y", "y.edge"]
    inner = [s for s in walk(onf.nests[0].body) if isinstance(s, Loop) and s.var == K]
    assert len(inner) == 1 and [u.name for u in inner[0].body] == ["s_0", "s_1", "s_2", "s_3"]
    x = np.random.default_rng(0).standard_normal((n, 5))
    got = run_onf(onf, {"x": x}, {})["y"]
    np.testing.assert_allclose(got, x.sum(1), rtol=1e-14)


def test_refuses_what_would_change_the_value():
    with pytest.raises(ScheduleError, match="at least 2"):
        UnrollJam("y", "i", 1)(_row_sums())
    with pytest.raises(ScheduleError, match="not indexed by i"):  # every row writes y[0]
        UnrollJam("y", "i", 2)(_row_sums(index=(sympy.Integer(0),)))
    with pytest.raises(ScheduleError, match="loops down to one over k"):  # not in the chain
        UnrollJam("y", "k", 2)(_row_sums())
    with pytest.raises(ScheduleError, match="no nest"):
        UnrollJam("z", "i", 2)(_row_sums())
    with pytest.raises(ScheduleError, match="0 rows together"):
        rows_together("y", ("i",), 0)
    assert rows_together("y", ("i",), 1) == (Parallel(("i",), nest="y"),)


def test_bounds_that_depend_on_the_row_cannot_be_shared():
    onf = _row_sums()
    loop = onf.nests[0].body[0]
    triangle = Loop(K, sympy.Integer(0), I + 1, loop.body[1].body)  # k <= i
    onf = onf.with_nests([Nest("y", (Loop(I, sympy.Integer(0), N, (loop.body[0], triangle,
                                                                   loop.body[2])),), "tri")])
    with pytest.raises(ScheduleError, match="depend on i"):
        UnrollJam("y", "i", 2)(onf)


def test_attention_rows_and_decode_heads_are_unrolled():
    """Online attention walks the keys four query rows at a time; decode reads a group's
    KV rows once for four query heads, and the cost model counts them once."""
    rows = onf_of("attention_fwd", "online")
    assert [n.label for n in rows.nests] == ["rows", "rows.edge"]
    assert rows.nests[0].body[0].parallel == 3
    heads = onf_of("attention_decode", "online")
    assert [n.label for n in heads.nests] == ["heads", "heads.edge"]
    b, kv, n, d = (sym(s) for s in ("batch", "kv_heads", "n", "d"))
    for variant in ("online", "split"):
        assert sympy.expand(predict("attention_decode", variant).traffic["K"].read
                            - b * kv * n * d) == 0
