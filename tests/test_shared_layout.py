"""Where a tiled nest's shared arrays lie (moagen.steps.gpu.closing), on bodies
written by hand: live ranges by the statements' order, one from each copy of a tile, a
loop's whole range for what is live into it or read there before it is written, the
lowest offset that meets no live array at any compiled bound; and the layouts realize
records on a tiled nest, which the printer declares and the dump shows."""
import pytest
import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.dump import format_onf
from moagen.onf.loops import BlockCopy, Buffer, Loop, Store, bound_symbol
from moagen.pipeline import onf_of
from moagen.steps.gpu.closing import live_ranges, place

e, k, kb = sympy.symbols("e k kb", integer=True)
MAX_D = bound_symbol("d")
ZERO = sympy.Integer(0)


def _copy(tile, count):
    """A block's copy into `tile`: one statement (a write) for the live ranges."""
    return Loop(e, ZERO, count, (Store(tile, (e,), S.Num(1.0)),), gpu=BlockCopy("xy"))


def _read(*tiles):
    return Store("out", (k,), S.Bin("+", *(S.Load(t, k) for t in tiles)) if len(tiles) == 2
                 else S.Load(tiles[0], k))


# before the loop over key blocks: Q's copy (0); in each block: K's copy (1), the scores
# from Q and K (2), V's copy (3), the output from Q and V (4); after it, Q read again (5)
BODY = (_copy("Q", 8),
        Loop(kb, ZERO, sympy.Integer(4), (_copy("K", 8), _read("Q", "K"), _copy("V", 8),
                                          _read("Q", "V"))),
        _read("Q"))


def test_a_tile_staged_before_a_loop_is_live_over_all_of_it():
    assert live_ranges(BODY, {"Q", "K", "V"}) == {"Q": ((0, 5),), "K": ((1, 2),),
                                                   "V": ((3, 4),)}


def test_each_copy_of_a_tile_starts_a_live_range_of_its_own():
    """A causal kernel's unmasked then diagonal key blocks, each copying K and V: K's ranges
    are apart (1-2, 5-6), so V (3-4, 7-8) may take its bytes in both loops."""
    block = (_copy("K", 8), _read("Q", "K"), _copy("V", 8), _read("Q", "V"))
    body = (_copy("Q", 8), Loop(kb, ZERO, sympy.Integer(2), block),
            Loop(kb, sympy.Integer(2), sympy.Integer(4), block))
    assert live_ranges(body, {"Q", "K", "V"}) == {"Q": ((0, 8),), "K": ((1, 2), (5, 6)),
                                                  "V": ((3, 4), (7, 8))}
    shared = [Buffer("Q", (4 * MAX_D,)), Buffer("K", (8 * MAX_D,)), Buffer("V", (8 * MAX_D,))]
    layout = place(shared, body, 8, [{MAX_D: 64}])
    assert _offsets(layout) == {"Q": 0, "K": 32 * MAX_D, "V": 32 * MAX_D}


def test_a_tile_read_in_a_loop_before_it_is_written_there_is_live_over_all_of_it():
    """acc read at the top of each block, written at its end: the next block reads it."""
    body = (Loop(kb, ZERO, sympy.Integer(4), (_read("acc"), _copy("K", 8), _copy("acc", 8))),)
    assert live_ranges(body, {"acc", "K"}) == {"acc": ((0, 2),), "K": ((1, 1),)}


def test_tiles_never_live_together_share_bytes_at_every_bound():
    """Q (4 MAX_d doubles) stays; K (8 MAX_d) and V (6 MAX_d + 2) follow one another: V on
    K's bytes, after Q's, 16-byte aligned; the barriers see which arrays' bytes meet."""
    shared = [Buffer("Q", (4 * MAX_D,)), Buffer("K", (8 * MAX_D,)),
              Buffer("V", (6 * MAX_D + 2,))]
    bounds = [{MAX_D: 64}, {MAX_D: 128}]
    layout = place(shared, BODY, 8, bounds)
    assert _offsets(layout) == {"Q": 0, "K": 32 * MAX_D, "V": 32 * MAX_D}
    assert [layout.total.xreplace(v) for v in bounds] == [96 * 64, 96 * 128]
    assert layout.meets == (("Q", ("Q",)), ("K", ("K", "V")), ("V", ("K", "V")))


def test_an_offset_must_fit_at_every_bound():
    """A (4 MAX_d doubles) and B (256) live together, then B with C: C may take A's bytes,
    below B's at 32 MAX_d, where it fits there at every bound. 200 doubles (1600 bytes) fit
    below 2048 (MAX_d 64) and 4096 (128); 300 (2400 bytes) only below 4096: after B."""
    body = (_copy("A", 1), _copy("B", 1), _read("A", "B"), _copy("C", 1), _read("B", "C"))
    bounds = [{MAX_D: 64}, {MAX_D: 128}]
    for c, offset in ((200, 0), (300, 32 * MAX_D + 2048)):
        shared = [Buffer("A", (4 * MAX_D,)), Buffer("B", (256,)), Buffer("C", (c,))]
        assert _offsets(place(shared, body, 8, bounds)) == {"A": 0, "B": 32 * MAX_D, "C": offset}


def _offsets(layout):
    return {a.name: a.offset for a in layout.arrays}


@pytest.mark.parametrize("dtype, size, rows", [("float32", 4, 64), ("float64", 8, 32)])
def test_realize_records_the_flash_forward_s_layout_at_its_element_size(dtype, size, rows):
    """Q, K and the scores apart, V on K's bytes (copied once the scores are taken), at the
    dtype's element size only: float64's thread blocks of 32 query rows (moagen.kernels.
    attention's FLASH_CUDA_DTYPES), float32's of 64, both over key blocks of 64; the dump
    shows them."""
    onf = onf_of("attention_fwd", "flash", target="cuda", dtype=dtype)
    (rows_nest,) = [n for n in onf.nests if n.label == "rows"]
    (layout,) = rows_nest.shared_layouts
    q_tile, k_tile = ((n + 4) * size * MAX_D for n in (rows, 64))  # d rows padded by 4
    assert layout.element_bytes == size
    assert _offsets(layout) == {"rows_Q_tile": 0, "rows_K_tile": q_tile, "rows_V_tile": q_tile,
                                "probs": q_tile + k_tile}
    assert dict(layout.meets)["rows_V_tile"] == ("rows_K_tile", "rows_V_tile")
    assert (f"    rows_V_tile: 64*MAX_d + 256 elements at byte {q_tile}, "
            "meets rows_K_tile\n") in format_onf(onf)


def test_an_instance_over_the_tightest_built_arch_is_refused_by_the_step():
    """float64's flash forward at 64 query rows a block, d <= 128: 174,080 bytes, over the
    166,912 an sm_80 block may have; float32's at the same tiles (87,040 bytes) fits."""
    with pytest.raises(ScheduleError, match=r"attention_fwd flash, nest rows: 8-byte elements "
                                            r"at MAX_d = 128 take 174080 bytes .* over the "
                                            r"166912 sm_80 allows"):
        onf_of("attention_fwd", "flash", params={"queries": 64}, target="cuda", dtype="float64")
    onf_of("attention_fwd", "flash", params={"queries": 64}, target="cuda", dtype="float32")
