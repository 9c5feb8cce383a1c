"""Dropout's random numbers (moagen.philox, #54 item 3): the numpy Philox4x32-10 against
Random123's known answers, its keep mask's statistics (keep rate, rows and heads
independent), the generated files' moagen_keep in C and Fortran against it at rows, keys
and seeds past 32 bits, the Dropout node through shape, DNF, interpretation and grad. The
generated kernels themselves are verified against moagen.reference's numpy dropout in every
language by tests/test_verify.py (C, Fortran) and tests/test_cuda_emulation.py (CUDA)."""
import ctypes
import subprocess

import numpy as np
import pytest
import sympy

from moagen.bench import calls
from moagen.errors import ScheduleError, ShapeError, SpecError
from moagen.kernels import attention_dropout
from moagen.moa import scalar as S
from moagen.moa.dnf import psi_reduce
from moagen.moa.expr import Scalar, array, dropout, idiv, psi, sym
from moagen.moa.rewrites import quadratic_temporaries
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.interpret import evaluate_dnf
from moagen.onf.loops import ONF, Buffer, Loop, Nest, Store, stmt_exprs, walk
from moagen.pipeline import onf_of
from moagen.philox import keep_mask, keep_pieces, philox4x32
from moagen.steps.loop.unroll import UnrollDraws
from moagen import reference
from moagen.targets.toolchain import Toolchain
from moagen.templates import render

# Random123's kat_vectors for philox4x32_10: counter, key, the four output words
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, words", KNOWN_ANSWERS)
def test_philox_gives_random123s_known_answers(counter, key, words):
    assert tuple(int(w) for w in philox4x32(counter, key)) == words


def test_a_groups_eight_keys_are_the_16_bit_halves_of_one_runs_four_words():
    row, group, seed = 2 ** 40 + 17, 2 ** 33 + 5, 2 ** 35 + 9
    words = philox4x32((group & 0xFFFFFFFF, group >> 32, row & 0xFFFFFFFF, row >> 32),
                       (seed & 0xFFFFFFFF, seed >> 32))
    halves = [int(w) >> shift & 0xFFFF for w in words for shift in (0, 16)]
    keys = 8 * group + np.arange(8, dtype=np.uint64)
    assert [int(x) for x in keep_pieces(row, keys, seed)] == halves


P = 0.3
MASK = keep_mask((2, 3, 64, 64), seed=12345, p=P)  # (batch, heads, n_q, n_k)


def test_keep_rate_is_one_minus_p_within_five_standard_deviations():
    deviation = np.sqrt(P * (1 - P) / MASK.size)
    assert abs(MASK.mean() - (1 - P)) < 5 * deviation


def _agreement_is_chance(a, b):
    """a and b (boolean arrays) agree as often as independent draws would: p^2 + (1-p)^2
    of the time, within five standard deviations."""
    chance = P * P + (1 - P) * (1 - P)
    deviation = np.sqrt(chance * (1 - chance) / a.size)
    return abs(np.mean(a == b) - chance) < 5 * deviation


def test_rows_and_heads_draw_independent_masks():
    rows = MASK.reshape(-1, 64)
    assert len({row.tobytes() for row in rows}) == len(rows)  # no two rows alike
    assert _agreement_is_chance(MASK[..., 1:, :], MASK[..., :-1, :])  # neighbouring rows
    assert _agreement_is_chance(MASK[:, 1:], MASK[:, :-1])  # neighbouring heads
    assert _agreement_is_chance(MASK[1], MASK[0])  # batch entries
    assert _agreement_is_chance(MASK[..., 1:], MASK[..., :-1])  # neighbouring keys


def test_the_seed_decides_the_mask():
    assert np.array_equal(keep_mask((3, 50), 7, P), keep_mask((3, 50), 7, P))
    other = keep_mask((3, 50), 8, P)
    assert _agreement_is_chance(keep_mask((3, 50), 7, P), other)
    assert keep_mask((4, 9), 7, 0.0).all()


def test_a_seed_outside_63_bits_is_refused():
    for seed in (-1, 2 ** 63):
        with pytest.raises(ValueError, match="seed"):
            keep_pieces(0, 0, seed)


# ---- moagen_keep, the generated files' helper ------------------------------------------

# keep_many(rows, keys, p, count, seed, kept): moagen_keep of each (row, key) at its own p
C_DRIVER = """
#include <math.h>
#include <stdint.h>
{helper}
void keep_many(const int64_t *rows, const int64_t *keys, const double *p, int64_t count,
               int64_t seed, int32_t *kept)
{{
    for (int64_t k = 0; k < count; ++k)
        kept[k] = moagen_keep(rows[k], keys[k] / 8, keys[k] % 8, seed, p[k]);
}}
"""
FORTRAN_DRIVER = """
module keep_driver
  use, intrinsic :: iso_c_binding, only: c_double, c_int32_t, c_int64_t
  implicit none
contains
{helper}
  subroutine keep_many(rows, keys, p, count, seed, kept) bind(C, name="keep_many")
    integer(c_int64_t), value, intent(in) :: count, seed
    integer(c_int64_t), intent(in) :: rows(count), keys(count)
    real(c_double), intent(in) :: p(count)
    integer(c_int32_t), intent(out) :: kept(count)
    integer(c_int64_t) :: k

    do k = 1, count
      kept(k) = merge(1_c_int32_t, 0_c_int32_t, &
                      moagen_keep(rows(k), keys(k) / 8, mod(keys(k), 8_c_int64_t), seed, p(k)))
    end do
  end subroutine keep_many
end module keep_driver
"""


def _built(lang, tmp_path):
    tools = Toolchain()
    if lang == "c":
        source = C_DRIVER.format(helper=render("c/keep.c.j2", qualifier="static inline ",
                                               helper_directive=""))
        command = [tools.cc, *tools.cflags, *tools.cldflags]
    else:
        source = FORTRAN_DRIVER.format(helper=render("fortran/keep.f90.j2"))
        command = [tools.fc, *tools.fflags, "-shared", "-J", str(tmp_path)]
    path = tmp_path / f"keep.{'c' if lang == 'c' else 'f90'}"
    path.write_text(source)
    library = tmp_path / f"keep_{lang}.so"
    subprocess.run([*command, str(path), "-o", str(library)], check=True)
    return ctypes.CDLL(str(library)).keep_many


@pytest.mark.parametrize("lang", ["c", "fortran"])
def test_moagen_keep_compares_philoxs_piece_at_any_row_key_and_seed(lang, tmp_path):
    """For rows, keys and seeds with both 32-bit words set (up to 2**63 - 1), the helper
    keeps at p = piece / 2**16 and drops at p just above: its piece is numpy's, bit for bit
    (Fortran's 32-bit words held in 64-bit integers included)."""
    keep_many = _built(lang, tmp_path)
    rng = np.random.default_rng(2)
    edges = np.arange(16).tolist() + [2 ** 32 - 1, 2 ** 32, 2 ** 35 + 3, 2 ** 63 - 1]
    rows, keys = (np.concatenate([edges, rng.integers(0, 2 ** 63 - 1, 500)]).astype(np.int64)
                  for _ in range(2))
    keys = np.roll(keys, 3)  # a key with another row
    for seed in (0, 2 ** 32 + 5, 2 ** 63 - 1, int(rng.integers(2 ** 62, 2 ** 63 - 1))):
        pieces = keep_pieces(rows.astype(np.uint64), keys.astype(np.uint64),
                             seed).astype(np.float64)
        for p, kept in ((pieces * 2.0 ** -16, 1), ((pieces + 1) * 2.0 ** -16, 0)):
            got = np.empty(len(rows), dtype=np.int32)
            keep_many(rows.ctypes.data_as(ctypes.c_void_p), keys.ctypes.data_as(ctypes.c_void_p),
                      np.ascontiguousarray(p).ctypes.data_as(ctypes.c_void_p),
                      ctypes.c_int64(len(rows)), ctypes.c_int64(seed),
                      got.ctypes.data_as(ctypes.c_void_p))
            assert (got == kept).all(), (seed, np.flatnonzero(got != kept)[:5])


# ---- the Dropout node ---------------------------------------------------------------

A = array("A", "m", "n")


def _dropped(p=Scalar("p")):
    return KernelSpec("dropped", (A,), ("p",), (Output("Z", A * dropout(("m", "n"), "seed", p),
                                                       ("i", "j")),), given=("seed",))


def test_the_dnf_of_a_dropout_is_the_numpy_mask_times_one_over_one_minus_p():
    data = np.random.default_rng(0).standard_normal((5, 7))
    got = evaluate_dnf(psi_reduce(_dropped()), {"A": data}, {"p": P, "seed": 99})["Z"]
    np.testing.assert_allclose(got, data * keep_mask((5, 7), 99, P) / (1 - P), rtol=1e-15)


def test_dropout_needs_a_scalar_p_and_a_seed_the_kernel_takes():
    with pytest.raises(ShapeError, match="Dropout needs a scalar"):
        KernelSpec("bad", (A,), (), (Output("Z", A * dropout(("m", "n"), "seed", psi((0,), A)),
                                            ("i", "j")),), given=("seed",)).validate()
    spec = _dropped()
    with pytest.raises(SpecError, match="seed"):
        KernelSpec(spec.name, spec.inputs, spec.scalars, spec.outputs).validate()


def test_the_derived_backward_regenerates_the_mask_and_reads_delta_from_o():
    """No n x n temporary (no stored mask); delta is rowsum(dO * O), O the dropped
    forward's output, one row of d (the rewrite `delta from output`, through the factor)."""
    backward = attention_dropout.backward_spec(causal=False)
    assert [a.name for a in backward.inputs] == ["Q", "K", "V", "O", "dO", "lse"]
    assert backward.given == ("seed",) and backward.scalars == ("scale", "dropout_p")
    dnf = psi_reduce(backward, {"delta"})
    assert not quadratic_temporaries(dnf)
    delta = next(d for d in dnf.definitions if d.target == "delta")
    assert {e.array for e in S.subexpressions(delta.body) if isinstance(e, S.Access)} == \
        {"dO", "O"}


def test_the_numpy_references_drop_what_the_mask_says():
    """At p near 1 nearly everything is dropped: O is then nearly all zeros, and where the
    mask keeps nothing of a row, that row of O is exactly 0."""
    rng = np.random.default_rng(1)
    Q, K, V = (rng.standard_normal(s) for s in ((1, 1, 2, 5, 3), (1, 1, 5, 3), (1, 1, 5, 3)))
    O, lse = reference.attention_dropout_fwd_numpy(Q, K, V, 0.5, 0.9, 3)
    empty = ~keep_mask((1, 2, 5, 5), 3, 0.9).reshape(1, 1, 2, 5, 5).any(axis=-1)
    assert empty.any() and not empty.all()
    assert not O[empty].any() and O[~empty].all()
    np.testing.assert_allclose(lse, reference.attention_gqa_fwd_numpy(Q, K, V, 0.5)[1])


def test_a_key_8g_plus_v_draws_group_g_piece_v():
    """UnrollDraws' copies read one (row, group): key 8 j_tile + 3 is group j_tile, piece 3;
    a key not of that form divides."""
    j, t, row = (sym(n) for n in ("j", "j_tile", "row"))
    assert S.Dropout(row, 8 * t + 3, sym("seed"), S.Num(P)).draw() == (t, 3)
    group, piece = S.Dropout(row, j, sym("seed"), S.Num(P)).draw()
    assert group == idiv(j, 8) and piece == j - 8 * idiv(j, 8)


def test_the_flash_forward_draws_once_per_key_8_keys_a_step():
    """The forward's products read the block's row alone; its draws are in the loop that
    applies them, unrolled by 8: per row, one (row, group) for pieces 0 to 7."""
    onf = onf_of("attention_dropout_fwd", "flash")
    rows = next(n for n in onf.nests if n.label == "rows")
    draws = [e for s in walk(rows.body) for x in stmt_exprs(s) for e in S.subexpressions(x)
             if isinstance(e, S.Dropout)]
    unrolled = [d.draw() for d in draws if d.draw()[1].is_Integer]
    assert len(unrolled) == 6 * 8  # 6 rows jammed, 8 keys each
    assert sorted(int(piece) for _, piece in unrolled) == sorted(list(range(8)) * 6)
    assert {group for group, _ in unrolled} == {sym("j_tile")}


def test_the_flash_forwards_groups_of_keys_are_vector_lanes():
    """UnrollDraws marks its loop over groups simd (its stores 8 apart, which MarkSimd does
    not take): the compiler runs several groups' Philox rounds in one vector, plain or
    causal. Its edge (under 8 keys a row, a key at a time) stays MarkSimd's to judge."""
    for kernel in ("attention_dropout_fwd", "attention_dropout_fwd_causal"):
        rows = next(n for n in onf_of(kernel, "flash").nests if n.label == "rows")
        drawing = [s for s in walk(rows.body) if isinstance(s, Loop) and any(
            isinstance(e, S.Dropout) for b in s.body for x in stmt_exprs(b)
            for e in S.subexpressions(x))]
        assert {loop.var.name for loop in drawing} == {"j_tile", "j"}
        assert all(loop.simd for loop in drawing if loop.var.name == "j_tile"), kernel


def _draws(body):
    return [e for s in walk(body) for x in stmt_exprs(s) for e in S.subexpressions(x)
            if isinstance(e, S.Dropout)]


@pytest.mark.parametrize("kernel", ["attention_dropout_bwd", "attention_dropout_bwd_causal"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_flash_backwards_key_tiles_are_groups_a_run_each(kernel, dtype):
    """The owner's tiles of key rows are 8 on every CPU, each one Philox group: its draws
    (a query row a vector lane) name one (row, group), j_in_tile, for pieces 0 to 7, where
    keys 6 j_in_tile + j_part + u made a run each. The keys past the last tile (the edge
    nest) draw a key at a time."""
    onf = onf_of(kernel, "flash", dtype=dtype)
    keys = next(n for n in onf.nests if n.label == "keys")
    draws = [d.draw() for d in _draws(keys.body)]
    assert sorted(int(piece) for _, piece in draws) == list(range(8))
    assert {group for group, _ in draws} == {sym("j_in_tile")}
    edge = [n for n in onf.nests if n.label != "keys" and _draws(n.body)]
    assert edge and all(not d.draw()[1].is_Integer for n in edge for d in _draws(n.body))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_flash_backward_widens_only_its_columns_on_avx512(monkeypatch, dtype):
    """Where the compiler targets AVX-512 the dropout backward's tiles take the plain
    backward's lanes (a row in two 512-bit registers) and keep 8 rows, Philox's groups."""
    monkeypatch.setattr(Toolchain, "targets_avx512", lambda self, record: True)
    schedule = lambda kernel: calls.schedule(kernel, "flash", "c", dtype)["params"]
    assert schedule("attention_dropout_bwd") == {
        "rows": 8, "keys": 1, "parts": 1, "lanes": {"float64": 16, "float32": 32}[dtype]}
    assert schedule("attention_gqa_bwd")["lanes"] == {"float64": 16, "float32": 32}[dtype]


def test_unroll_draws_refuses_key_tiles_that_are_not_groups():
    """6 key rows a tile (the AVX2 owner's): a run of 8 keys would straddle two groups."""
    with pytest.raises(ScheduleError, match="steps its draws' keys by 6, not 1 or 8"):
        onf_of("attention_dropout_bwd", "flash", params={"rows": 6})


def _jammed_draws(parts, offset=0):
    """y[r, 8 t + u + q + offset] = the draw of that key, for q over `parts` values: tiles
    of 8 keys jammed as UnrollJam leaves the owner's (q its j_part)."""
    r, t, q, n, keys = (sym(name) for name in ("r", "t", "q", "n", "k"))
    stores = tuple(Store("y", (r, 8 * t + u + q + offset), S.Dropout(
        r, 8 * t + u + q + offset, sym("seed"), S.Num(P))) for u in range(8))
    zero = sympy.Integer(0)
    body = Loop(q, zero, sympy.Integer(parts), (Loop(r, zero, n, (
        Loop(t, zero, idiv(keys, 8), stores),)),))
    return ONF("draws", "test", (), (Buffer("y", (n, keys)),), (), (n, keys), (),
               (Nest("y", (body,), "y = dropout"),))


def test_unroll_draws_reads_a_loop_of_one_value_at_its_value():
    """A loop around the tiles that takes one value (q in [0, 1): the owner's j_part, of one
    part) is 0 in the draws' keys, which then name their group; of two values, or keys 3
    past a group's start, a tile's 8 keys straddle two groups: refused."""
    onf = UnrollDraws("t")(_jammed_draws(parts=1))
    assert {d.draw() for d in _draws(onf.nests[0].body)} == {(sym("t"), v) for v in range(8)}
    for parts, offset in ((2, 0), (1, 3)):
        with pytest.raises(ScheduleError, match="not 8 times a group plus a piece"):
            UnrollDraws("t")(_jammed_draws(parts, offset))
