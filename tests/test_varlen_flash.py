"""The packed varlen attention's flash variant (moagen.kernels.attention_varlen) and what the
flash steps learnt for it: OnlineSoftmax's floored max and clamped sum, scratch rows and
register tiles over a sequence's rows (extents read from the offsets), CausalBlocks' rows
that may see no key. The interpreter runs the floored form on plain arrays (it reads no
offsets); the compiled kernels run the packed one. Its agreement with the references at the
kernel's CHECK_SIZES is test_verify's."""
from dataclasses import replace

import numpy as np
import pytest
import sympy

from moagen import reference, runtime
from moagen.errors import ScheduleError, UnknownNameError
from moagen.kernels import attention_varlen as varlen
from moagen.kernels.attention import LOWEST, flash_tiles, one_head, row_pass
from moagen.moa import scalar as S
from moagen.moa.dnf import psi_reduce
from moagen.moa.expr import array, idiv, lift, psi, sym
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.interpret import run_onf
from moagen.onf.loops import (Let, Loop, Store, map_stmt_exprs, offsets_of, scratch_row,
                              stmt_exprs, walk)
from moagen.onf.names import Names
from moagen.onf.realize import realize
from moagen.pipeline import onf_of
from moagen.steps.algebra.causal import CausalBlocks
from moagen.steps.algebra.keytiles import KeyTiles
from moagen.steps.algebra.online import OnlineSoftmax
from moagen.steps.loop.reductions import LowerReductions
from moagen.steps.loop.unroll import rows_together

Q = array("Q", "batch", "n_q", "d")
K, V = array("K", "batch", "n", "d"), array("V", "batch", "n", "d")
ROWS = ("b", "i")


def _floored_dnf():
    """attention_varlen's head (its max floored at -1e30, its sum clamped at 1) over plain
    arrays, bottom-right causal: with n_q > n the first n_q - n queries see no key."""
    o, lse = one_head(*(psi(("b",), a) for a in (Q, K, V)), True,
                      mask=varlen._seen_mask(sym("n_q"), sym("n")), floored=True)
    lifted = lambda value: lift(("b",), ("batch",), value)
    return psi_reduce(KernelSpec(
        name="floored", inputs=(Q, K, V), scalars=("scale",),
        outputs=(Output("O", lifted(o), ROWS + ("c",)), Output("lse", lifted(lse), ROWS))))


def _arrays(n_q, n, d=5, seed=0):
    rng = np.random.default_rng(seed)
    return {"Q": rng.standard_normal((2, n_q, d)),
            **{a: rng.standard_normal((2, n, d)) for a in "KV"}}


def _agree(got, want, unseen):
    """Within rounding; the rows that see no key exactly O = 0 and lse = -inf."""
    np.testing.assert_allclose(got["O"], want["O"], rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(got["lse"], want["lse"], rtol=1e-13)
    assert (got["O"][:, :unseen] == 0).all() and (got["lse"][:, :unseen] == -np.inf).all()


# more queries than keys (rows that see none), as many, fewer; past a block of keys
@pytest.mark.parametrize("n_q, n", [(9, 5), (6, 6), (13, 70), (70, 13)])
@pytest.mark.parametrize("block", [1, 4])
def test_online_softmax_takes_the_floored_max_and_the_clamped_sum(n_q, n, block):
    """The running max starts at the floor and O is divided by max(l, 1) after the loop:
    the row form's values within rounding, a row that sees no key O = 0 and lse = -inf."""
    dnf = _floored_dnf()
    before = realize(dnf, "dnf", row_pass(ROWS))
    after = realize(dnf, "dnf", row_pass(ROWS) + (OnlineSoftmax("rows", block=block),))
    starts = [s.value for s in walk(after.nests[0].body) if isinstance(s, Let) and s.name == "t"]
    assert starts == [S.Num(LOWEST)]
    arrays, scalars = _arrays(n_q, n), {"scale": 0.5}
    _agree(run_onf(after, arrays, scalars), run_onf(before, arrays, scalars), max(n_q - n, 0))


@pytest.mark.parametrize("n_q, n", [(9, 5), (13, 70), (70, 13), (70, 70)])
def test_causal_blocks_skip_blocks_of_rows_that_may_see_no_key_when_floored(n_q, n):
    """FlashAttention's form of the floored kernel, causal bottom-right: a tile's rows may
    sit before every key (i + n - n_q < 0), which the floored running max makes harmless;
    its blocks stop at its last row's last key and start masked at 0 where a row sees none."""
    steps = row_pass(ROWS) + (OnlineSoftmax("rows", block=4), LowerReductions(),
                              *flash_tiles("rows", 3, 4, causal=True))
    dnf = _floored_dnf()
    onf = realize(dnf, "flash", steps)
    rows = next(n for n in onf.nests if n.label == "rows")
    below, diagonal = [s for s in walk(rows.body) if isinstance(s, Loop) and s.var.name == "j_blk"]
    last_row = 3 * sym("i_tile") + 2 + sym("n") - sym("n_q")
    first_row = 3 * sym("i_tile") + sym("n") - sym("n_q")
    assert below.stop == diagonal.start == sympy.Min(idiv(sym("n") + 3, 4),
                                                     idiv(sympy.Max(0, first_row + 1), 4))
    assert diagonal.stop == sympy.Min(idiv(sym("n") + 3, 4), idiv(sympy.Max(0, last_row + 4), 4))
    arrays, scalars = _arrays(n_q, n, d=9), {"scale": 0.5}
    _agree(run_onf(onf, arrays, scalars), run_onf(realize(dnf, "dnf", row_pass(ROWS)),
                                                  arrays, scalars), max(n_q - n, 0))


def _rewritten(onf, rewrite):
    """onf with rewrite applied to every statement of its nests."""
    def visit(s):
        return replace(s, body=tuple(visit(b) for b in s.body)) if isinstance(s, Loop) \
            else rewrite(s)
    return onf.with_nests([replace(n, body=tuple(visit(s) for s in n.body)) for n in onf.nests])


def test_online_softmax_refuses_what_it_cannot_fuse():
    """A floor that is not a number (the max could be -inf) is no floored max; a loop that
    reads the clamped sum otherwise than as the divisor cannot be rescaled."""
    hoisted = realize(_floored_dnf(), "dnf", row_pass(ROWS), upto=len(row_pass(ROWS)))
    unfloored = _rewritten(hoisted, lambda s: replace(s, value=S.Bin(
        "max", s.value.left, S.Param("scale"))) if isinstance(s, Let) and s.name == "t" else s)
    with pytest.raises(ScheduleError, match="no max, sum of exponentials and loop"):
        OnlineSoftmax("rows", block=4)(unfloored)
    adds_clamp = _rewritten(hoisted, lambda s: replace(s, value=S.Bin("*", s.value, S.Local(
        "t3"))) if isinstance(s, Store) and s.accumulate == "+" else s)
    with pytest.raises(ScheduleError, match="uses the row max or sum other than"):
        OnlineSoftmax("rows", block=4)(adds_clamp)


def test_causal_blocks_without_a_floor_still_refuse_rows_that_may_see_no_key():
    """The floored form's rows jammed, the running max started at -inf: refused."""
    steps = row_pass(ROWS) + (OnlineSoftmax("rows", block=4), LowerReductions(),
                              *rows_together("rows", "i", 3))
    onf = realize(_floored_dnf(), "flash", steps, upto=len(steps))
    unfloored = _rewritten(onf, lambda s: replace(s, value=S.Num(float("-inf")))
                           if isinstance(s, Let) and s.value == S.Num(LOWEST) else s)
    with pytest.raises(ScheduleError, match="not known to be >= 0: a row might see no key"):
        CausalBlocks("rows")(unfloored)


def test_scratch_rows_over_a_sequence_are_its_packed_rows():
    """A row per (sequence b, row i of b) is row cu(b) + i of the rows the offsets cut, its
    block of keys min(total_k, B): no extent read from the offsets; bounds that depend on
    another loop otherwise are refused."""
    b, i, j = (sym(v) for v in "bij")
    cu_q, cu_k = (sympy.Function(f"cu_{x}", integer=True) for x in "qk")
    sequence = Loop(b, sympy.Integer(0), sym("batch"), ())
    rows = Loop(i, sympy.Integer(0), cu_q(b + 1) - cu_q(b), ())
    keys = Loop(j, sympy.Integer(0), cu_k(b + 1) - cu_k(b), ())
    offsets = {"cu_q": sym("total_q"), "cu_k": sym("total_k")}
    temps = []
    name, row = scratch_row("test", "probs", (sequence, rows), keys, 64, Names(()), temps,
                            offsets)
    assert row == (cu_q(b) + i,)
    assert temps[0].shape == (sym("total_q"), sympy.Min(64, sym("total_k")))
    with pytest.raises(ScheduleError, match="not rectangular from 0"):
        scratch_row("test", "probs", (sequence, replace(rows, stop=b + 1)), keys, 64,
                    Names(()), [], offsets)


def test_the_flash_variant_over_packed_sequences():
    """Every loop over a sequence's rows or keys bounded by its offsets; K read from panels
    whose tiles start at each sequence's first key (tiles from 0 would not line up with it),
    tile t of sequence b at cu_k(b) // 8 + b + t, V in place; no temp sized by the offsets;
    CPU only."""
    onf = onf_of("attention_varlen_fwd_causal", "flash")
    assert offsets_of(onf) == {"cu_q": sym("total_q"), "cu_k": sym("total_k")}
    assert [n.label for n in onf.nests] == ["rows.pack_K", "rows", "rows.edge", "rows.edge.edge"]
    assert {b.name: b.shape for b in onf.temps} == {
        "probs": (sym("kv_heads"), sym("group"), sym("total_q"), sympy.Min(64, sym("total_k"))),
        "K_panel": (idiv(sym("total_k"), 8) + sym("batch"), sym("kv_heads"), sym("d"), 8)}
    cu_k, b = sympy.Function("cu_k", integer=True), sym("b")
    reads = [e.offset for n in onf.nests for s in walk(n.body) for x in stmt_exprs(s)
             for e in S.subexpressions(x) if isinstance(e, S.Load) and e.array == "K_panel"]
    assert reads and all(r.has(b + sym("j_tile") + idiv(cu_k(b), 8)) for r in reads)
    # the loops over a block's scores (their exponentials) vectorized: their rows' distance
    # is compared with the most keys a sequence has (MarkSimd)
    rows = next(n for n in onf.nests if n.label == "rows")
    scratch = [lp for lp in walk(rows.body) if isinstance(lp, Loop) and lp.var.name == "j"
               and all(isinstance(s, Store) and s.array == "probs" for s in lp.body)]
    assert scratch and all(lp.simd for lp in scratch)
    with pytest.raises(UnknownNameError, match="flash runs on cpu only, not on target kind "
                                               "cuda; its variants on it: dnf"):
        onf_of("attention_varlen_fwd", "flash", target="cuda")


def test_key_tiles_refuse_a_key_read_that_does_not_step_with_the_key():
    """K read at 2 j: its lanes are no consecutive entries of any copy."""
    j = sym("j")

    def doubled(e):
        if isinstance(e, S.Access) and e.array == "K":
            return replace(e, index=tuple(sympy.sympify(x).xreplace({j: 2 * j})
                                          for x in e.index))
        return S.map_children(e, doubled)
    onf = _rewritten(onf_of("attention_varlen_fwd", "flash", upto=6),
                     lambda s: map_stmt_exprs(s, doubled))
    with pytest.raises(ScheduleError, match="needs j alone at one position, or plus a "
                                              "sequence's first row"):
        KeyTiles("rows", "j", 8)(onf)


def _batch(q_lens, k_lens, d, seed=0):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((sum(q_lens), 2, 3, d))
    K, V = (rng.standard_normal((sum(k_lens), 2, d)) for _ in range(2))
    cu = varlen.packed_offsets(dict(q_lens=q_lens, k_lens=k_lens))
    return Q, K, V, cu["cu_q"], cu["cu_k"]


@pytest.mark.parametrize("lang", ["c", "fortran"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_is_the_dnf_within_rounding_with_whole_tiles(lang, causal):
    """d 80 (the check sizes' d 3 and 5 take no column tile): lengths 1, 7, 257, 0, more
    queries than keys (rows that see none: O = 0, lse = -inf exactly)."""
    kernel = varlen.name(causal)
    Q, K, V, cu_q, cu_k = _batch((1, 7, 257, 0, 70), (7, 1, 257, 0, 13), d=80)
    want = runtime.load(kernel, "dnf", lang, "float64")(Q, K, V, cu_q, cu_k, scale=0.1)
    got = runtime.load(kernel, "flash", lang, "float64")(Q, K, V, cu_q, cu_k, scale=0.1)
    for g, w in zip(got, want):
        assert np.array_equal(np.isinf(g), np.isinf(w))
        finite = np.isfinite(w)
        np.testing.assert_allclose(g[finite], w[finite], rtol=1e-13, atol=1e-14)
    numpy_o, _ = reference.attention_varlen_fwd_numpy(Q, K, V, cu_q, cu_k, scale=0.1,
                                                      causal=causal)
    np.testing.assert_allclose(got[0], numpy_o, rtol=1e-12, atol=1e-13)
