"""Key blocks: a loop's dot products, scalars and additions run as three steps per block of
keys (the structure), with the same values (the ONF interpreter at sizes that leave a
partial block), the exponentials of the attention backward in vector loops, and the cases
it refuses."""
import numpy as np
import pytest
import sympy

from moagen.pipeline import onf_of
from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import sym
from moagen.onf.interpret import run_onf
from moagen.onf.loops import ONF, Buffer, Let, Loop, Nest, Store, Update, walk
from moagen.steps.algebra.keyblocks import KeyBlocks

I, J, K, C, N, M, D = (sym(s) for s in ("i", "j", "k", "c", "n", "m", "d"))
ZERO = sympy.Integer(0)


def _attention_like(dot_reads_weight=False):
    """y[i, :] = sum_j exp(a[i] . b[j]) v[j, :]: per key a dot product, its exponential and
    an addition into y's row."""
    dot = S.Bin("*", S.Access("a", (I, K)), S.Access("b", (J, K)))
    if dot_reads_weight:
        dot = S.Bin("*", dot, S.Local("w"))
    per_key = (Let("w", S.Num(1.0)) if dot_reads_weight else Let("unused", S.Num(0.0)),
               Let("s", S.Num(0.0)), Loop(K, ZERO, D, (Update("s", "+", dot),)),
               Let("w" if not dot_reads_weight else "w2", S.Un("exp", S.Local("s"))),
               Loop(C, ZERO, M, (Store("y", (I, C), S.Bin(
                   "*", S.Local("w" if not dot_reads_weight else "w2"),
                   S.Access("v", (J, C))), accumulate="+"),)))
    if not dot_reads_weight:
        per_key = per_key[1:]
    zero = Loop(C, ZERO, M, (Store("y", (I, C), S.Num(0.0)),))
    body = (Loop(I, ZERO, N, (zero, Loop(J, ZERO, K, per_key))),)
    return ONF("attn", "test", (Buffer("a", (N, D)), Buffer("b", (K, D)), Buffer("v", (K, M))),
               (Buffer("y", (N, M)),), (), (N, K, M, D), (), (Nest("y", body, "y = ..."),))


@pytest.mark.parametrize("keys", [1, 4, 9])
def test_three_steps_per_block_keep_the_value(keys):
    onf = KeyBlocks("y", "j", 4)(_attention_like())
    (blocks,) = [s for s in walk(onf.nests[0].body) if isinstance(s, Loop) and s.var.name == "j_blk"]
    dots, scalars, adds = blocks.body
    assert all(isinstance(step, Loop) and step.var.name == "j" for step in blocks.body)
    assert [s.name for s in scalars.body if isinstance(s, Let)] == ["s", "w"]  # s read back
    assert not any(isinstance(s, Loop) for s in scalars.body)  # scalar code: vectorizable
    # a row of min(k, 4) values a query row: a stride the C compiler does not know
    assert {b.name: tuple(map(str, b.shape)) for b in onf.temps} == \
        {"s_block": ("n", "Min(4, k)"), "w_block": ("n", "Min(4, k)")}
    rng = np.random.default_rng(2)
    a, b, v = rng.standard_normal((3, 5)), rng.standard_normal((keys, 5)), rng.standard_normal((keys, 2))
    got = run_onf(onf, {"a": a, "b": b, "v": v}, {})["y"]
    np.testing.assert_allclose(got, np.exp(a @ b.T) @ v, rtol=1e-13)


def test_refuses_what_it_cannot_reorder():
    with pytest.raises(ScheduleError, match="at least two keys"):
        KeyBlocks("y", "j", 1)(_attention_like())
    with pytest.raises(ScheduleError, match="reads a scalar computed before it"):
        KeyBlocks("y", "j", 4)(_attention_like(dot_reads_weight=True))
    with pytest.raises(ScheduleError, match="no loop over i that adds"):
        KeyBlocks("y", "i", 4)(_attention_like())


def test_the_owner_backward_takes_its_exponentials_in_vector_loops():
    onf = onf_of("attention_fwdbwd", "owner", params={"parts": 0})  # dQ in a pass of its own
    for label in ("dQ", "keys"):
        nest = next(n for n in onf.nests if n.label == label)
        with_exp = [s for s in walk(nest.body) if isinstance(s, Loop) and any(
            isinstance(e, S.Un) and e.fn == "exp"
            for x in s.body if isinstance(x, (Let, Store)) for e in S.subexpressions(x.value))]
        assert with_exp and all(lp.simd for lp in with_exp), label
