"""Unroll and jam: the structure it promises (copies sharing the inner loops, an edge nest
for the rows left over), the values it keeps (run by the ONF interpreter at sizes with and
without leftover rows), and the cases it refuses."""
from dataclasses import replace

import numpy as np
import pytest
import sympy

from moagen.cost.model import predict
from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import sym
from moagen.onf.interpret import run_onf
from moagen.onf.loops import ONF, Buffer, Let, Loop, Nest, Store, Update, walk
from moagen.pipeline import onf_of
from moagen.steps.loop.parallel import Parallel
from moagen.steps.loop.unroll import UnrollJam, UnrollSum, keys_summed, rows_together

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


@pytest.mark.parametrize("n", [1, 3, 4, 6, 7, 9, 11])
def test_an_edge_is_jammed_from_where_it_starts_and_its_tiles_run_in_parallel(n):
    """The rows left past 4-row tiles (from 4 (n // 4)) jammed 2 at a time, the last alone;
    Parallel over the first nest's loop reaches the edge's tiles (the edge's rename of i
    follows its loop to the tiles) and its own edge."""
    onf = UnrollJam("y.edge", "i", 2)(UnrollJam("y", "i", 4)(_row_sums()))
    assert [nest.label for nest in onf.nests] == ["y", "y.edge", "y.edge.edge"]
    edge_tiles = onf.nests[1].body[0]
    assert str(edge_tiles.stop) == "idiv(n - 4*idiv(n, 4), 2)"
    assert dict(onf.nests[1].renames) == {"i_tile": edge_tiles.var.name}
    onf = Parallel(("i_tile",), nest="y")(onf)
    assert all(nest.body[0].parallel for nest in onf.nests)
    x = np.random.default_rng(1).standard_normal((n, 5))
    np.testing.assert_allclose(run_onf(onf, {"x": x}, {})["y"], x.sum(1), rtol=1e-14)


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
        rows_together("y", "i", 0)
    assert rows_together("y", "i", 1) == ()
    assert rows_together("y", "i", 2) == (UnrollJam("y", "i", 2),)


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


J, C = sym("j"), sym("c")


def _weighted_sum(extra=()):
    """y[i, c] = sum_j p[i, j] v[j, c]: for each row, a loop over j adding into y's row."""
    zero = Loop(C, sympy.Integer(0), M, (Store("y", (I, C), S.Num(0.0)),))
    add = Loop(C, sympy.Integer(0), M, (Store("y", (I, C), S.Bin(
        "*", S.Local("t"), S.Access("v", (J, C))), accumulate="+"),))
    keys = Loop(J, sympy.Integer(0), K, (Let("t", S.Access("p", (I, J))), add) + extra)
    return ONF("weighted", "test", (Buffer("p", (N, K)), Buffer("v", (K, M))),
               (Buffer("y", (N, M)),), (), (N, K, M), (),
               (Nest("y", (Loop(I, sympy.Integer(0), N, (zero, keys)),), "y = p v"),))


@pytest.mark.parametrize("keys", [1, 3, 4, 10])
def test_summed_copies_add_into_the_element_once_and_keep_the_value(keys):
    onf = UnrollSum("y", "j", 4)(_weighted_sum())
    tiled, rest = (s for s in walk(onf.nests[0].body) if isinstance(s, Loop) and
                   s.var.name in ("j_tile", "j"))
    assert str(tiled.stop) == "idiv(k, 4)" and str(rest.start) == "4*idiv(k, 4)"
    (add,) = [s for s in walk(tiled.body) if isinstance(s, Store)]
    assert add.accumulate == "+" and _reads(add, "v") == 4
    rng = np.random.default_rng(1)
    p, v = rng.standard_normal((3, keys)), rng.standard_normal((keys, 5))
    got = run_onf(onf, {"p": p, "v": v}, {})["y"]
    np.testing.assert_allclose(got, p @ v, rtol=1e-13)


def test_summing_refuses_loops_whose_iterations_depend_on_each_other():
    with pytest.raises(ScheduleError, match="at least 2"):
        UnrollSum("y", "j", 1)(_weighted_sum())
    with pytest.raises(ScheduleError, match="reads y, which it sums into"):
        UnrollSum("y", "j", 2)(_weighted_sum((Let("u", S.Access("y", (I, sympy.Integer(0)))),)))
    with pytest.raises(ScheduleError, match="z is not indexed by j"):
        UnrollSum("y", "j", 2)(_weighted_sum((Store("z", (I,), S.Local("t")),)))
    with pytest.raises(ScheduleError, match="assigns a local"):
        UnrollSum("y", "j", 2)(_weighted_sum((Update("last", "=", S.Local("t")),)))
    with pytest.raises(ScheduleError, match="no loop over i that adds"):
        UnrollSum("y", "i", 2)(_weighted_sum())
    onf = _weighted_sum()
    outer = onf.nests[0].body[0]
    from_row = replace(outer, body=(outer.body[0], replace(outer.body[1], start=I)))
    with pytest.raises(ScheduleError, match="starts at i, not a multiple of 2"):
        UnrollSum("y", "j", 2)(onf.with_nests([replace(onf.nests[0], body=(from_row,))]))
    with pytest.raises(ScheduleError, match="0 keys summed"):
        keys_summed("y", 0)
    assert keys_summed("y", 1) == ()


def _keys_outside():
    """y[i, c] = sum_j p[i, j] v[j, c] with the keys outside (the owner's key rows adding dS K
    into dQ): every iteration of j adds into every row of y."""
    zero = Nest("y", (Loop(I, sympy.Integer(0), N, (Loop(C, sympy.Integer(0), M, (
        Store("y", (I, C), S.Num(0.0)),)),)),), "y = 0", "y.zero")
    add = Loop(C, sympy.Integer(0), M, (Store("y", (I, C), S.Bin(
        "*", S.Local("t"), S.Access("v", (J, C))), accumulate="+"),))
    rows = Loop(I, sympy.Integer(0), N, (Let("t", S.Access("p", (I, J))), add))
    return ONF("keys_outside", "test", (Buffer("p", (N, K)), Buffer("v", (K, M))),
               (Buffer("y", (N, M)),), (), (N, K, M), (),
               (zero, Nest("y", (Loop(J, sympy.Integer(0), K, (rows,)),), "y = p v", "sum")))


@pytest.mark.parametrize("keys", [1, 3, 4, 10])
def test_jammed_iterations_that_sum_into_one_array_add_into_each_element_once(keys):
    onf = UnrollJam("sum", "j", 4)(_keys_outside())
    tiled = onf.nests[1].body[0]
    (add,) = [s for s in walk(tiled.body) if isinstance(s, Store)]
    assert add.accumulate == "+" and _reads(add, "v") == 4
    rng = np.random.default_rng(2)
    p, v = rng.standard_normal((3, keys)), rng.standard_normal((keys, 5))
    np.testing.assert_allclose(run_onf(onf, {"p": p, "v": v}, {})["y"], p @ v, rtol=1e-13)


def test_jamming_refuses_iterations_that_read_what_they_sum_into():
    onf = _keys_outside()
    rows = onf.nests[1].body[0].body[0]
    reads_y = replace(rows, body=rows.body + (Let("u", S.Access("y", (I, sympy.Integer(0)))),))
    onf = onf.with_nests([onf.nests[0], replace(onf.nests[1], body=(
        replace(onf.nests[1].body[0], body=(reads_y,)),))])
    with pytest.raises(ScheduleError, match="reads y, which it sums into"):
        UnrollJam("sum", "j", 2)(onf)


def test_attention_adds_four_value_rows_at_a_time():
    onf = onf_of("attention_fwd", "online", params={"rows": 4, "keys": 4})
    tiled = next(s for s in walk(onf.nests[0].body) if isinstance(s, Loop) and
                 s.var.name == "j_tile")
    stores = [s for s in walk(tiled.body) if isinstance(s, Store)]
    assert len(stores) == 4  # one per query row, each with the terms of four keys
    assert all(_reads(s, "V") == 4 for s in stores)


def _reads(store, array):
    return sum(isinstance(e, (S.Access, S.Load)) and e.array == array
               for e in S.subexpressions(store.value))
