"""The padded flash backward (attention_cross_bwd_padded, #54 item 1) skips its padded keys:
the key rows' pass walks no query row for its tiles of keys past last (CausalRows on a mask
free of the rows), their dK and dV rows written as zeros; the dQ pass (parts 0) stops at
last's key block (MaskedBlocks, rows free of the loops; the GPU's dQ pass too). Before, both
passes walked every key and masked the padded ones."""
import numpy as np
import pytest
import sympy

from moagen import reference
from moagen.errors import ScheduleError
from moagen.kernels.attention_cross import padding_mask
from moagen.moa import scalar as S
from moagen.moa.expr import idiv, sym
from moagen.onf.loops import Loop, Nest, ONF, Store, walk
from moagen.pipeline import onf_of
from moagen.runtime import load
from moagen.steps.algebra.causal import MASKED
from moagen.steps.algebra.causalrows import CausalRows
from moagen.steps.algebra.maskedblocks import MaskedBlocks

KERNEL = "attention_cross_bwd_padded"
LAST, N_Q, N = sym("last"), sym("n_q"), sym("n")


def _loops(onf, nest, var):
    return [s for n in onf.nests if n.label == nest for s in walk(n.body)
            if isinstance(s, Loop) and s.var.name == var]


def test_the_key_tiles_past_last_walk_no_query_row():
    """Each loop over the query rows (or their tiles) inside a tile of 6 key rows starts past
    its end where the tile's first key 6 j_in_tile + j_part is past last."""
    onf = onf_of(KERNEL, "flash", params={"parts": 1, "rows": 6, "lanes": 8})
    unseen = sympy.Min(1, sympy.Max(0, 6 * sym("j_in_tile") + sym("j_part") - LAST))
    tiles = _loops(onf, "keys", "i_tile")
    assert tiles and all(unseen in loop.start.atoms(sympy.Min) for loop in tiles)
    for loop in tiles:  # past the end where unseen, the block's first tile where seen
        stop = loop.stop.subs({sym("i_blk"): 1, N_Q: 100})
        assert loop.start.subs({sym("i_blk"): 1, N_Q: 100, sym("j_in_tile"): 3,
                                sym("j_part"): 0, LAST: 10}) >= stop
        assert loop.start.subs({sym("i_blk"): 1, N_Q: 100, sym("j_in_tile"): 1,
                                sym("j_part"): 0, LAST: 10}) == 8


@pytest.mark.parametrize("target, nests", [("cpu", ("dQ", "dQ.edge")), ("cuda", ("dQ",))])
def test_the_dq_pass_stops_at_lasts_key_block(target, nests):
    """The CPU's at parts 0 (its rows' tile and edge), the GPU's (a thread block's rows)."""
    onf = onf_of(KERNEL, "flash", params={"parts": 0}, target=target)
    for nest in nests:
        blocks = _loops(onf, nest, "j_blk")
        assert [loop.stop for loop in blocks] == [sympy.Min(idiv(LAST, 64) + 1,
                                                             idiv(N + 63, 64))]


def test_causal_rows_refuses_padded_masks_mixed_with_masks_of_the_rows():
    """A tile whose scores are masked by last >= j and by i >= j: neither cut alone is
    right."""
    i, j = sym("i"), sym("j")
    p = [S.Un("exp", S.Bin("-", S.Select(cond, S.Access("Q", (i,)), MASKED), S.Num(0.0)))
         for cond in (LAST >= j, i >= j)]
    add = Store("dK", (j,), S.Bin("*", *p), accumulate="+")
    keys = Loop(j, 0, N, (Loop(i, 0, N_Q, (add,)),))
    onf = ONF("tile", "flash", (), (), (), (), (), (Nest("dK", (keys,), "", name="keys"),))
    with pytest.raises(ScheduleError, match="not built"):
        CausalRows("keys", "j", "i")(onf)


def test_masked_blocks_without_rows_refuses_rows_that_vary_with_the_loops():
    """rows="": every mask's row must be free of the loops (the query row i is not)."""
    onf = onf_of("attention_cross_bwd_causal", "flash", params={"parts": 0}, upto=12)
    with pytest.raises(ScheduleError):
        MaskedBlocks("dQ", "j_blk", rows="")(onf)


def _arrays(n_q, n, last, rng):
    Q = rng.standard_normal((1, 2, 2, n_q, 5))
    K, V = (rng.standard_normal((1, 2, n, 5)) for _ in "KV")
    mask = padding_mask(Q, K, last)
    O, lse = reference.attention_gqa_fwd_numpy(Q, K, V, 0.5, mask=mask)
    dO = rng.standard_normal(O.shape)
    return (Q, K, V, O, dO, lse), mask


# lengths 1, 63, 64, 65 and all (last = length - 1; no key is the caller's, SDPA's zeros);
# query rows a tile of 8 and an edge, keys past two blocks
@pytest.mark.parametrize("parts", [0, 1])
@pytest.mark.parametrize("last", [0, 62, 63, 64, 129])
def test_the_skipped_keys_gradients_are_the_references(parts, last):
    """The built C kernel (outputs started as NaN: each dK and dV row past last is written)
    against numpy's; dK and dV past last exactly zero."""
    n_q, n = 70, 130
    arrays, mask = _arrays(n_q, n, last, np.random.default_rng(last))
    kernel = load(KERNEL, "flash", "c", "float64", params={"parts": parts})
    out = tuple(np.full(a.shape, np.nan) for a in arrays[:3])
    got = kernel(*arrays, scale=0.5, last=last, out=out)
    want = reference.attention_gqa_bwd_numpy(*arrays, 0.5, mask=mask)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13)
    for g in got[1:]:
        assert not g[:, :, last + 1:].any()
