"""FlashAttention's form (KeyTiles, ColumnTiles, CausalBlocks, CausalRows): the structure
each step promises, the values the flash variant and the fused owner keep (the ONF
interpreter against numpy, plain and causal, at sizes with and without leftover keys, rows
and columns), and what each refuses."""
from dataclasses import replace

import numpy as np
import pytest
import sympy

from moagen import reference
from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import idiv, sym
from moagen.kernels import get_kernel
from moagen.onf.interpret import run_onf
from moagen.onf.loops import ONF, Buffer, Let, Loop, Nest, Store, Update, map_stmt_exprs, walk
from moagen.steps.algebra.causal import CausalBlocks, nonnegative
from moagen.steps.algebra.causalrows import CausalRows
from moagen.steps.algebra.keytiles import ColumnTiles, KeyTiles
from moagen.pipeline import onf_of

I, J, C, N, D = sym("i"), sym("j"), sym("c"), sym("n"), sym("d")
B, H = sym("batch"), sym("heads")


def _attention(n, d, heads=1, seed=0):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((1, heads, n, d)) for name in "QKV"}


@pytest.mark.parametrize("causal", [False, True])
# one key; rows, keys and columns left over; past a block of 64 keys (70 = 64 + 6)
@pytest.mark.parametrize("n, d, rows, lanes", [(1, 3, 4, 8), (13, 5, 4, 8), (70, 10, 6, 8)])
def test_flash_keeps_the_value(causal, n, d, rows, lanes):
    kernel = "attention_fwd_causal" if causal else "attention_fwd"
    onf = onf_of(kernel, "flash", params={"rows": rows, "lanes": lanes})
    arrays = _attention(n, d)
    scale = 1 / np.sqrt(d)
    got = run_onf(onf, arrays, {"scale": scale})
    want_o, want_lse = reference.attention_fwd_numpy(arrays["Q"], arrays["K"], arrays["V"],
                                                     scale, causal=causal)
    np.testing.assert_allclose(got["O"], want_o, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got["lse"], want_lse, rtol=1e-12)


def test_flash_structure():
    onf = onf_of("attention_fwd", "flash", params={"rows": 4, "lanes": 8})
    # the rows past the 4-row tiles: by tiles of 2, then alone, from the same panels
    assert [n.label for n in onf.nests] == ["rows.pack_K", "rows.pack_V", "rows", "rows.edge",
                                            "rows.edge.edge"]
    assert [b.name for b in onf.temps] == ["probs", "K_panel", "V_panel"]
    for nest, rows in zip(onf.nests[2:], (4, 2, 1)):
        tiles = [s for s in walk(nest.body) if isinstance(s, Loop) and s.vector_tile]
        assert [len([u for u in t.body if isinstance(u, Update)]) for t in tiles] == \
            [rows * 8, rows * 8], nest.label
        reads = {e.array for t in tiles for u in t.body for e in S.subexpressions(u.value)
                 if isinstance(e, S.Load)}
        assert reads == {"Q", "K_panel", "probs", "V_panel"}, nest.label
    # V in panels of 8 columns, a panel's keys one after another (8 values a key)
    assert onf.temps[2].shape == (B, H, idiv(D, 8), N, 8)
    tiles = [s for s in walk(onf.nests[2].body) if isinstance(s, Loop) and s.vector_tile]
    # one tile of scores (a loop over the head's columns), one of outputs (over the keys)
    assert [t.var.name for t in tiles] == ["c", "j"]
    assert len([u for u in tiles[0].body if isinstance(u, Update)]) == 4 * 8
    assert len([u for u in tiles[1].body if isinstance(u, Update)]) == 4 * 8
    # lanes innermost: the compiler packs a row's consecutive lanes into one vector
    assert [u.name for u in tiles[0].body[:3]] == ["qk_0_0", "qk_0_1", "qk_0_2"]
    reads = {e.array for u in tiles[1].body for e in S.subexpressions(u.value)
             if isinstance(e, S.Load)}
    assert reads == {"probs", "V_panel"}


def test_the_nests_tiled_with_the_first_run_after_it_and_the_causal_edge_rows_are_known():
    """KeyTiles' `also`: the edges read the panels the first nest's copies fill, so they must
    run after it. CausalBlocks on an edge's tiles: their rows start at a multiple of a
    quotient (6 idiv(n, 6) + 2 i_tile), known >= 0."""
    jammed = onf_of("attention_fwd", "flash", params={"rows": 6}, upto=7)
    with pytest.raises(ScheduleError, match="must run after rows.edge, which fills"):
        KeyTiles("rows.edge", "j", 8, also=("rows",))(jammed)
    i, n = sym("i_tile"), sym("n")
    assert nonnegative(6 * idiv(n, 6) + 2 * i) and not nonnegative(n - 6 * idiv(n, 6))


@pytest.mark.parametrize("n", [1, 13, 70, 150])
def test_causal_blocks_split_at_the_diagonal_and_keep_the_value(n):
    """CausalBlocks on the causal flash's ONF with its rows jammed (the variant applies it
    so, before its key tiles)."""
    jammed = get_kernel("attention_fwd_causal").onf("flash", params={"rows": 4}, upto=6)
    onf = CausalBlocks("rows.edge")(CausalBlocks("rows")(jammed))
    blocks = [s for s in walk(onf.nests[0].body) if isinstance(s, Loop) and s.var.name == "j_blk"]
    assert len(blocks) == 2
    below, diagonal = blocks
    # the blocks every row of the tile sees whole end at (4 i_tile + 1) // 64, the blocks
    # seen at all at (4 i_tile + 3) // 64 + 1
    assert str(below.stop) == str(diagonal.start) == "idiv(4*i_tile + 1, 64)"
    assert "idiv(4*i_tile + 3, 64) + 1" in str(diagonal.stop)
    selects = lambda stmts: [e for s in stmts if isinstance(s, (Store, Update))
                             for e in S.subexpressions(s.value) if isinstance(e, S.Select)]
    assert not selects(walk(below.body))
    # the diagonal blocks store the scores unmasked (a register tile later) and mask them
    # where they are read: in the block max, and around the exponentials (exp(x - m) or 0)
    key_loops = [s for s in diagonal.body if isinstance(s, Loop) and s.var.name == "j"]
    scores, maxes, exps = key_loops[:3]
    assert not selects(walk(scores.body))
    assert len(selects(maxes.body)) == 4 and all(
        e.other == S.Num(float("-inf")) for e in selects(maxes.body))
    exp_selects = selects(exps.body)
    assert len(exp_selects) == 4 and all(
        e.other == S.Num(0.0) and isinstance(e.then, S.Un) and e.then.fn == "exp"
        for e in exp_selects)
    arrays = _attention(n, 4)
    got = run_onf(onf, arrays, {"scale": 0.5})
    want_o, want_lse = reference.attention_fwd_numpy(arrays["Q"], arrays["K"], arrays["V"],
                                                     0.5, causal=True)
    np.testing.assert_allclose(got["O"], want_o, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got["lse"], want_lse, rtol=1e-12)


# n_q queries against n keys, causal at offset: top-left, bottom-right, positions past the
# keys' last block (the unmasked blocks stop at the keys' end)
@pytest.mark.parametrize("n_q, n, offset", [(13, 70, 0), (13, 70, 57), (5, 7, 130),
                                            (70, 13, 0)])
def test_causal_blocks_bound_shifted_rows_by_the_tiles_last_position(n_q, n, offset):
    """attention_cross's mask i + offset >= j: the blocks a tile of 4 rows sees end at its
    last position's block, (4 i_tile + 3 + offset) // 64 + 1; those it sees whole at
    (4 i_tile + 1 + offset) // 64, or the loop's end."""
    jammed = get_kernel("attention_cross_fwd_causal").onf("flash", params={"rows": 4}, upto=6)
    onf = CausalBlocks("rows.edge")(CausalBlocks("rows")(jammed))
    below, diagonal = [s for s in walk(onf.nests[0].body)
                       if isinstance(s, Loop) and s.var.name == "j_blk"]
    tile, blocks = 4 * sym("i_tile") + sym("offset"), idiv(sym("n") + 63, 64)
    assert below.stop == diagonal.start == sympy.Min(blocks, idiv(tile + 1, 64))
    assert diagonal.stop == sympy.Min(blocks, idiv(tile + 3, 64) + 1)
    rng = np.random.default_rng(5)
    arrays = {"Q": rng.standard_normal((1, 1, 1, n_q, 4)),
              **{name: rng.standard_normal((1, 1, n, 4)) for name in "KV"}}
    got = run_onf(onf, arrays, {"scale": 0.5, "offset": offset})
    want_o, want_lse = reference.attention_gqa_fwd_numpy(*arrays.values(), 0.5, causal=True,
                                                         offset=offset)
    np.testing.assert_allclose(got["O"], want_o, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got["lse"], want_lse, rtol=1e-12)


def test_causal_blocks_refuse_rows_that_may_see_no_key():
    """Rows shifted back (i - offset >= j) may see no key, not even key 0: a skipped block
    would then not be a no-op (the running max would stay -inf)."""
    jammed = get_kernel("attention_cross_fwd_causal").onf("flash", params={"rows": 4}, upto=6)
    with pytest.raises(ScheduleError, match="not known to be >= 0: a row might see no key"):
        CausalBlocks("rows")(_offset_negated(jammed))


def _offset_negated(onf):
    """onf with each masked score's condition reading -offset for offset."""
    offset = sym("offset")

    def negate(e):
        if isinstance(e, S.Select):
            return S.Select(e.cond.xreplace({offset: -offset}), negate(e.then), negate(e.other))
        return S.map_children(e, negate)

    def rewrite(s):
        if isinstance(s, Loop):
            return replace(s, body=tuple(rewrite(b) for b in s.body))
        return map_stmt_exprs(s, negate)
    return onf.with_nests([replace(n, body=tuple(rewrite(b) for b in n.body)) for n in onf.nests])


OWNER = {"rows": 4, "keys": 2, "lanes": 8, "block": 16}  # small tiles: leftovers at small n


@pytest.mark.parametrize("causal", [False, True])
# one row; rows, keys and columns left over; past a block of 64 query rows (70 = 64 + 6)
@pytest.mark.parametrize("n, d", [(1, 3), (13, 5), (70, 4)])
def test_owner_in_the_flash_form_keeps_the_value(causal, n, d):
    kernel = "attention_fwdbwd_causal" if causal else "attention_fwdbwd"
    onf = onf_of(kernel, "owner", params=OWNER)
    rng = np.random.default_rng(3)
    arrays = {name: rng.standard_normal((1, 2, n, d)) for name in ("Q", "K", "V", "dO")}
    got = run_onf(onf, arrays, {"scale": 0.4})
    want = reference.attention_fwdbwd_numpy(*arrays.values(), 0.4, causal=causal)
    for name, value in zip(("O", "lse", "dQ", "dK", "dV"), want):
        np.testing.assert_allclose(got[name], value, rtol=1e-12, atol=1e-13, err_msg=name)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_owners_dk_and_dv_tiles_add_one_query_row_a_step(dtype):
    """At the CPU defaults the key rows' pass adds one query row at a time: each update of
    dK's and dV's register tiles is one product (one multiply-add), where with two rows a
    step gcc 12 made each pair a multiply, a multiply-add and an add."""
    keys = next(n for n in onf_of("attention_fwdbwd", "owner", dtype=dtype).nests
                if n.label == "keys")
    tiles = [s for s in walk(keys.body)
             if isinstance(s, Loop) and s.vector_tile and s.var.name == "i"]
    assert len(tiles) == 2  # dK's and dV's (the other tiles, the scores', run over c)
    products = [sum(isinstance(e, S.Bin) and e.op == "*" for e in S.subexpressions(u.value))
                for t in tiles for u in t.body]
    assert products and set(products) == {1}


def test_causal_rows_start_each_key_tile_at_its_first_query_rows():
    """The causal owner's key rows' pass (tiles of 4 key rows, blocks of 64 query rows):
    every loop over a block's query rows starts at the tile's first key rounded down to 8
    rows (k0 // 8 below), or at the block's start if later; KeyTiles, after, tiles the
    scores' loop by 8 rows from there."""
    onf = onf_of("attention_fwdbwd_causal", "owner", params=OWNER)
    keys = next(n for n in onf.nests if n.label == "keys")
    starts = {str(s.start) for s in walk(keys.body)
              if isinstance(s, Loop) and s.var.name in ("i", "i_tile")}
    k0 = "idiv(4*j_in_tile + j_part, 8)"
    assert starts == {
        f"Max(8*i_blk, {k0})",  # the score tiles (8 rows a step)
        "8*idiv(Min(n, 64*i_blk + 64), 8)",  # the rows after them: as KeyTiles leaves it
        f"8*Max(8*i_blk, {k0})",  # the probabilities (a row a step)
        f"4*Max(8*i_blk, {k0})",  # the additions (2 rows a step)
        f"Max(8*{k0}, 2*idiv(Min(n, 64*i_blk + 64), 2))"}  # and the row after them


def _scores():
    """p[i, j] = sum_c a[i, c] b[j, c]."""
    body = (Let("s", S.Num(0.0)),
            Loop(C, sympy.Integer(0), D, (Update("s", "+", S.Bin(
                "*", S.Access("a", (I, C)), S.Access("b", (J, C)))),)),
            Store("p", (I, J), S.Local("s")))
    nest = Nest("p", (Loop(I, sympy.Integer(0), N, (Loop(J, sympy.Integer(0), N, body),)),), "p")
    return ONF("scores", "test", (Buffer("a", (N, D)), Buffer("b", (N, D))),
               (Buffer("p", (N, N)),), (), (N, D), (), (nest,))


def _weighted_sum():
    """y[i, c] = 0, then y[i, c] += p[i, j] b[j, c] over j."""
    zero = Loop(C, sympy.Integer(0), D, (Store("y", (I, C), S.Num(0.0)),))
    add = Loop(J, sympy.Integer(0), N, (
        Let("t", S.Access("p", (I, J))),
        Loop(C, sympy.Integer(0), D,
             (Store("y", (I, C), S.Bin("*", S.Local("t"), S.Access("b", (J, C))), "+"),))))
    nest = Nest("y", (Loop(I, sympy.Integer(0), N, (zero, add)),), "y")
    return ONF("weighted_sum", "test", (Buffer("p", (N, N)), Buffer("b", (N, D))),
               (Buffer("y", (N, D)),), (), (N, D), (), (nest,))


@pytest.mark.parametrize("n", [3, 8, 19])
def test_key_tiles_keep_the_value(n):
    onf = KeyTiles("p", "j", 4)(_scores())
    assert [nest.label for nest in onf.nests] == ["p.pack_b", "p"]
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((n, 5)), rng.standard_normal((n, 5))
    np.testing.assert_allclose(run_onf(onf, {"a": a, "b": b}, {})["p"], a @ b.T, rtol=1e-13)


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("d", [3, 8, 13])
def test_column_tiles_keep_the_value_bit_for_bit(d, pack):
    """With pack, b read from a panel of its columns by tiles of 4, each tile's keys in a
    row: b_panel[c_tile, j, v] (the columns after the last tile from b)."""
    plain = _weighted_sum()
    tiled = ColumnTiles("y", "j", "c", 4, pack=pack)(plain)
    assert [n.label for n in tiled.nests] == ["y.pack_b"] * pack + ["y"]
    if pack:
        assert tiled.temps[0].shape == (idiv(D, 4), N, 4)
    tiles = [s for s in walk(tiled.nests[-1].body) if isinstance(s, Loop) and s.vector_tile]
    assert [t.var.name for t in tiles] == ["j"]
    rng = np.random.default_rng(2)
    arrays = {"p": rng.standard_normal((6, 6)), "b": rng.standard_normal((6, d))}
    want, got = run_onf(plain, arrays, {})["y"], run_onf(tiled, arrays, {})["y"]
    np.testing.assert_array_equal(got, want)  # each element adds the keys in the same order
    np.testing.assert_allclose(got, arrays["p"] @ arrays["b"], rtol=1e-13)


def _rescaled_weighted_sum(scaled=D):
    """y[i, c] = b[i, c]; y[i, c] *= w[i] for c < scaled (the online softmax's rescale);
    then y[i, c] += p[i, j] b[j, c] over j."""
    init = Loop(C, sympy.Integer(0), D, (Store("y", (I, C), S.Access("b", (I, C))),))
    scale = Loop(C, sympy.Integer(0), scaled, (
        Store("y", (I, C), S.Bin("*", S.Access("y", (I, C)), S.Local("w_i"))),))
    add = Loop(J, sympy.Integer(0), N, (
        Let("t", S.Access("p", (I, J))),
        Loop(C, sympy.Integer(0), D,
             (Store("y", (I, C), S.Bin("*", S.Local("t"), S.Access("b", (J, C))), "+"),))))
    row = (Let("w_i", S.Access("w", (I,))), init, scale, add)
    nest = Nest("y", (Loop(I, sympy.Integer(0), N, row),), "y")
    return ONF("rescaled_sum", "test", (Buffer("p", (N, N)), Buffer("b", (N, D)),
                                        Buffer("w", (N,))),
               (Buffer("y", (N, D)),), (), (N, D), (), (nest,))


@pytest.mark.parametrize("d", [3, 8, 13])
def test_column_tiles_fold_a_rescale_into_their_loads(d):
    """The rescale just before the tiles: its factor in the tile's loads, the loop left
    with the columns after the last tile; the same products (bit for bit). A rescale of
    fewer columns than the tiles load stays as it was."""
    plain = _rescaled_weighted_sum()
    tiled = ColumnTiles("y", "j", "c", 4)(plain)
    row = tiled.nests[0].body[0].body
    scale, tiles = row[2], row[3]
    assert scale.start == 4 * idiv(D, 4) and tiles.var.name == "c_tile"
    loads = [s for s in tiles.body if isinstance(s, Let)]
    assert len(loads) == 4 and all(s.value.op == "*" and s.value.right == S.Local("w_i")
                                   for s in loads)
    rng = np.random.default_rng(3)
    arrays = {"p": rng.standard_normal((6, 6)), "b": rng.standard_normal((6, d)),
              "w": rng.standard_normal(6)}
    want, got = run_onf(plain, arrays, {})["y"], run_onf(tiled, arrays, {})["y"]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(
        got, arrays["b"] * arrays["w"][:, None] + arrays["p"] @ arrays["b"], rtol=1e-13)
    partial = ColumnTiles("y", "j", "c", 4)(_rescaled_weighted_sum(scaled=D - 1))
    row = partial.nests[0].body[0].body
    assert row[2].start == 0 and not any(isinstance(s, Let) and isinstance(s.value, S.Bin)
                                         for s in row[3].body)


def test_refusals():
    # one panel per array: b read as b[j, c] and b[c, j] cannot share one
    both = S.Bin("+", S.Bin("*", S.Local("t"), S.Access("b", (J, C))),
                 S.Bin("*", S.Local("t"), S.Access("b", (C, J))))
    add = Loop(J, sympy.Integer(0), N, (Let("t", S.Access("p", (I, J))), Loop(
        C, sympy.Integer(0), N, (Store("y", (I, C), both, "+"),))))
    zero = Loop(C, sympy.Integer(0), N, (Store("y", (I, C), S.Num(0.0)),))
    two_orders = ONF("two_orders", "test", (Buffer("p", (N, N)), Buffer("b", (N, N))),
                     (Buffer("y", (N, N)),), (), (N,), (),
                     (Nest("y", (Loop(I, sympy.Integer(0), N, (zero, add)),), "y"),))
    with pytest.raises(ScheduleError, match="two orders"):
        ColumnTiles("y", "j", "c", 4, pack=True)(two_orders)
    with pytest.raises(ScheduleError, match="at least two lanes"):
        KeyTiles("p", "j", 1)(_scores())
    with pytest.raises(ScheduleError, match="no loop over the keys computing sums"):
        KeyTiles("p", "i", 4)(_scores())
    with pytest.raises(ScheduleError, match="no loop over the keys adding"):
        ColumnTiles("p", "j", "c", 4)(_scores())
    with pytest.raises(ScheduleError, match="one loop over i from 0"):
        ColumnTiles("y", "j", "i", 4)(_weighted_sum())
    with pytest.raises(ScheduleError, match="not a multiple of 24"):
        onf_of("attention_fwd", "flash", params={"rows": 4, "lanes": 24})
    with pytest.raises(ScheduleError, match="no loop over j_blk"):
        CausalBlocks("p")(_scores())
    # the plain owner's key rows: no score masked
    plain = get_kernel("attention_fwdbwd").onf("owner", params=OWNER, upto=18)
    with pytest.raises(ScheduleError, match="whose scores are masked"):
        CausalRows("keys", "j_in_tile", "i", 8)(plain)
    # 3 rows are not whole steps of the additions' two rows a step
    causal = get_kernel("attention_fwdbwd_causal").onf("owner", params=OWNER, upto=18)
    with pytest.raises(ScheduleError, match="not whole steps"):
        CausalRows("keys", "j_in_tile", "i", 3)(causal)
    with pytest.raises(ScheduleError, match="no score in the loop over j_blk is masked"):
        # the plain kernel's ONF where the causal one has its CausalBlocks: the rows jammed
        jammed = get_kernel("attention_fwd").onf("flash", params={"rows": 4}, upto=6)
        CausalBlocks("rows")(jammed)
    # a block max reading each row's scores one key over: the mask cannot follow the scores
    jammed = get_kernel("attention_fwd_causal").onf("flash", params={"rows": 4}, upto=6)
    with pytest.raises(ScheduleError, match="not where its masked scores are stored"):
        CausalBlocks("rows")(_block_max_shifted(jammed))


def _block_max_shifted(onf):
    """onf with every block max reading the scratch scores at the next key."""
    def shift(s):
        if isinstance(s, Loop):
            return replace(s, body=tuple(shift(b) for b in s.body))
        if isinstance(s, Update) and s.op == "max" and isinstance(s.value, S.Access):
            *outer, key = s.value.index
            return replace(s, value=S.Access(s.value.array, (*outer, key + 1)))
        return s
    return onf.with_nests([replace(n, body=tuple(shift(b) for b in n.body)) for n in onf.nests])
