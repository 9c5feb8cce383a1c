"""The CUDA mapping steps of tiled kernels (moagen.steps.gpu) and their printer
(moagen.targets.cuda.tiled), on attention_fwd's flash variant in FlashAttention-2's form:
what the steps make of the ONF, what they refuse, the barriers the closing pass puts (each
one needed: the race check fails the kernel without it) and the bound on the head dim;
the causal twin's key blocks past a block's rows skipped, grouped-query attention's
query heads folded into one grid axis, the atomic kernels' passes on block tiles, the
causal backward's passes skipping the blocks no row of a tile sees (MaskedBlocks), and the
grouped-query backward's key tiles walking a group's query heads."""
from dataclasses import replace

import numpy as np
import pytest

from moagen import reference, runtime, verify
from moagen.emit import emit
from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import (Barrier, LaneReduce, Loop, Threads, is_grid, is_thread_loop,
                              perfect_chain, stmt_exprs, walk)
from moagen.pipeline import onf_of
from moagen.request import resolve
from moagen.steps.algebra.causal import mask_sides
from moagen.steps.algebra.maskedblocks import MaskedBlocks
from moagen.steps.gpu.blocks import BlockTiles, ThreadTiles, UnrollInner
from moagen.steps.gpu.staging import RegisterTile, SharedScratch, Stage
from moagen.targets.cuda import emulated
from moagen.targets.cuda.build import RACECHECK_ENV, build_cuda_emulated
from moagen.targets.cuda.loader import EmulationCheckError

KERNEL, VARIANT = "attention_fwd", "flash"


def _rows(onf):
    return next(n for n in onf.nests if n.label == "rows")


@pytest.mark.parametrize("dtype, rows", [("float32", 16), ("float64", 8)])
def test_the_flash_forward_on_cuda_is_a_block_per_row_tile_of_a_head(dtype, rows):
    """float32 a block per 64 rows, 16 x 16 threads; float64 per 32 rows, 8 x 16, its tiles'
    shared memory within an sm_80 block's (attention.FLASH_CUDA_DTYPES); both over key
    blocks of 64."""
    onf = onf_of(KERNEL, VARIANT, target="cuda", dtype=dtype)
    loops = [s for s in walk(_rows(onf).body) if isinstance(s, Loop) and s.gpu]
    grid = [lp.var.name for lp in loops if is_grid(lp)]
    assert grid == ["b", "h", "i_blk"]
    threads_of = {(lp.gpu.axis, lp.var.name, lp.gpu.threads, lp.gpu.tile) for lp in loops
                  if is_thread_loop(lp)}
    assert threads_of == {("y", "i", rows, 4), ("x", "j", 16, 4), ("x", "c", 16, 4)}
    # Q, K, V tiles and the score block in shared memory; no scratch in global memory, and
    # O only written, once, at the end (its tile in registers)
    assert [b.name for b in onf.shared] == ["rows_Q_tile", "rows_K_tile", "rows_V_tile",
                                            "probs"]
    assert onf.temps == ()
    o_reads = [s for s in walk(_rows(onf).body) if getattr(s, "array", None) == "O"]
    assert len(o_reads) == 1


def test_the_launch_is_a_3d_grid_of_16_by_16_threads_with_the_tiles_in_shared_memory():
    from moagen.targets.cuda.printer import CudaPrinter
    onf = onf_of(KERNEL, VARIANT, target="cuda", dtype="float32")
    (kernel,) = [k for k in CudaPrinter(onf, "float32").kernels() if k["tiled"]]
    assert kernel["block"] == (16, 16, 1)
    assert [str(g) for g in kernel["grid"]] == ["idiv(n + 63, 64)", "heads", "batch"]
    # per bound of d: Q and K tiles d x 68, V's on K's bytes (copied once the scores are
    # taken), the scores 64 x 68, 4 bytes each
    bytes_at = {int(c.split("<= ")[1]): int(b) for c, _, b in kernel["launches"]}
    assert bytes_at == {64: 4 * (2 * 64 * 68 + 64 * 68), 128: 4 * (2 * 128 * 68 + 64 * 68)}
    source = emit(KERNEL, VARIANT, "cuda")
    assert 'MOAGEN_SHARED_AT(float, rows_V_tile, 272*MAX_d, ' in source
    # a slot declares its row (const int i = ...) only where a statement reads it: an
    # unread one is nvcc's warning #177
    assert "++s_i) {\n        row_max[s_i] = -INFINITY;" in source


def _flash(dtype):
    return onf_of(KERNEL, VARIANT, target="cuda", dtype=dtype, upto=5)  # the algorithm's


@pytest.mark.parametrize("step, message", [
    (ThreadTiles("i", 4, "z", nest="rows"), "axis is x or y"),
    (ThreadTiles("i", 4, "y", nest="rows"), "no grid"),
    (Stage("O", at="j_blk", nest="rows"), "O is not an input of attention_fwd or an array"),
    (SharedScratch("Q", fastest="i", nest="rows"), "not a scratch array"),
    (RegisterTile("Q", nest="rows"), "is no output or scratch"),
    (UnrollInner("c", 1, nest="rows"), "a factor of at least 2"),
    (UnrollInner("c", 4, nest="rows"), "no loop over c a thread runs itself"),  # no threads yet
])
def test_a_step_refuses_what_it_cannot_do_and_says_why(step, message):
    with pytest.raises(ScheduleError, match=message):
        step(_flash("float64"))


def test_lanes_that_share_a_row_are_a_power_of_two_within_a_warp():
    onf = BlockTiles(("b", "h", "i"), rows=64, nest="rows")(_flash("float64"))
    ThreadTiles("j", 2, "x", nest="rows")(onf)  # 64 keys / 2: 32 lanes is fine, 12 is not
    with pytest.raises(ScheduleError, match="power of two up to 32; got 12"):
        ThreadTiles("c", 4, "x", threads=12, nest="rows")(onf)


def test_block_tiles_map_a_nest_once_at_bounds_for_one_size():
    onf = BlockTiles(("b", "h", "i"), rows=64, nest="rows")(_flash("float64"))
    with pytest.raises(ScheduleError, match="nest rows is mapped already"):
        BlockTiles(("b", "h", "i"), rows=64, nest="rows")(onf)
    with pytest.raises(ScheduleError, match="bounds for one size only.*not d, n"):
        BlockTiles(("b", "h", "i"), rows=64, bounds=(("d", (64,)), ("n", (64,))),
                   nest="rows")(_flash("float64"))


def test_thread_tiles_keep_one_count_of_threads_an_axis_and_a_compile_time_tile():
    onf = BlockTiles(("b", "h", "i"), rows=64, nest="rows")(_flash("float64"))
    onf = ThreadTiles("j", 4, "x", nest="rows")(onf)  # 16 lanes along x
    with pytest.raises(ScheduleError, match="threads along x would be 8 and 16"):
        ThreadTiles("c", 4, "x", threads=8, nest="rows")(onf)
    # c runs to d, which BlockTiles gave no bounds for: no register tile's count
    with pytest.raises(ScheduleError, match="over c has no compile-time most iterations; "
                                            "give BlockTiles a bound for d"):
        ThreadTiles("c", 4, "x", threads=16, nest="rows")(onf)


def test_a_finished_mapping_runs_every_statement_on_uniform_threads():
    """check_block_form, on the finished flash forward: a statement left outside the
    thread loops, and a loop whose bounds read a thread's row, are refused."""
    from moagen.steps.gpu.closing import check_block_form
    onf = onf_of(KERNEL, VARIANT, target="cuda", dtype="float32")
    check_block_form(onf)  # as realize did
    nest = _rows(onf)
    loops = [s for s in walk(nest.body) if isinstance(s, Loop) and s.gpu]
    rows = next(lp for lp in loops if lp.gpu == Threads("y", 16, 4))  # the block's rows, i
    unthreaded = replace(rows, gpu=None)
    key_blocks = next(s for s in walk(nest.body) if isinstance(s, Loop) and s.var.name == "j_blk")
    ragged = replace(key_blocks, stop=key_blocks.stop + rows.var)
    for old, new, message in ((rows, unthreaded, "outside every thread loop"),
                              (key_blocks, ragged, r"over j_blk has bounds that read the "
                                                   r"thread loops' \['i'\]")):
        broken = replace(nest, body=_with_stmt(nest.body, old, new))
        with pytest.raises(ScheduleError, match=message):
            check_block_form(replace(onf, nests=tuple(broken if n is nest else n
                                                      for n in onf.nests)))


def test_block_tiles_take_the_parallel_loops_legality():
    with pytest.raises(ScheduleError, match=r"block_tiles\(b, h, c, .*does not start with"):
        BlockTiles(("b", "h", "c"), rows=64, nest="rows")(_flash("float64"))


def test_the_causal_flash_on_cuda_skips_the_key_blocks_past_a_block_of_rows():
    onf = onf_of("attention_fwd_causal", VARIANT, target="cuda", dtype="float32")
    loops = [s for s in walk(_rows(onf).body) if isinstance(s, Loop)]
    assert [lp.var.name for lp in loops if is_grid(lp)] == ["b", "h", "i_blk"]
    # the unmasked key blocks, then the diagonal ones up to the block's last row (64 i_blk +
    # 63): bounds of the block, not of a thread's row, so every thread meets every barrier
    unmasked, diagonal = [lp for lp in loops if lp.var.name == "j_blk"]
    assert str(unmasked.stop) == str(diagonal.start) == "i_blk"
    assert str(diagonal.stop) == "Min(i_blk + 1, idiv(n + 63, 64))"
    # both stage their K and V tiles into the plain kernel's one set of shared tiles
    assert [b.name for b in onf.shared] == ["rows_Q_tile", "rows_K_tile", "rows_V_tile", "probs"]
    assert _masks(diagonal) == ["i >= j"] * 2 and _masks(unmasked) == []  # block max, exp


def _masks(loop):
    """The causal masks (r >= j) the loop's statements select by."""
    return [str(x.cond) for s in walk(loop.body) for e in stmt_exprs(s)
            for x in S.subexpressions(e) if isinstance(x, S.Select) and mask_sides(x.cond)]


def test_gqa_flash_on_cuda_folds_a_group_s_query_heads_into_one_grid_axis():
    from moagen.targets.cuda.printer import CudaPrinter
    onf = onf_of("attention_gqa_fwd", VARIANT, target="cuda", dtype="float32")
    (kernel,) = [k for k in CudaPrinter(onf, "float32").kernels() if k["tiled"]]
    assert [str(g) for g in kernel["grid"]] == ["idiv(n + 63, 64)", "group*kv_heads", "batch"]
    assert kernel["block"] == (16, 16, 1)


def test_block_tiles_fold_loops_that_start_past_0_from_their_start():
    """A folded loop over [start, stop) is recovered as start + its part of the grid loop
    (decode's edge: the query heads past a group's last whole tile, a block each)."""
    onf = onf_of("attention_gqa_fwd", VARIANT, target="cuda", dtype="float64", upto=5)
    nest = _rows(onf)
    r = perfect_chain(nest.body, 3)[-1]  # the loop over r, the group's query heads
    shifted = replace(nest, body=_with_stmt(nest.body, r, replace(r, start=r.start + 1)))
    onf = replace(onf, nests=tuple(shifted if n is nest else n for n in onf.nests))
    folded = BlockTiles(("b", "g", "r", "i"), rows=64, nest="rows")(onf)
    grid = [lp for lp in walk(_rows(folded).body) if is_grid(lp)]
    assert [str(lp.stop) for lp in grid[:2]] == ["batch", "kv_heads*(group - 1)"]
    # r, read in Q's index, is 1 + the remainder of g_r by group - 1
    q = {str(x.index) for s in walk(_rows(folded).body) for e in stmt_exprs(s)
         for x in S.subexpressions(e) if isinstance(x, S.Access) and x.array == "Q"}
    assert any("idiv(g_r, group - 1)" in i and "+ 1" in i for i in q), q


def _with_stmt(stmts, old, new):
    return tuple(new if s is old else replace(s, body=_with_stmt(s.body, old, new))
                 if isinstance(s, Loop) else s for s in stmts)


def test_a_head_dim_past_the_compiled_bounds_is_refused_before_the_launch():
    fn = emulated.bind(build_cuda_emulated(emit(KERNEL, VARIANT, "cuda-emulated"), "tiles_bound"),
                       resolve(KERNEL, VARIANT, "cuda-emulated", "float64", here=False).signature())
    q = np.zeros((1, 1, 3, 129))
    with pytest.raises(ValueError, match="compiled for d up to 128, got d=129"):
        fn(q, q, q, scale=0.1)


SIZES = dict(batch=1, heads=2, n=70, d=9)  # two key blocks, the second short


def _run(source, stem):
    request = resolve(KERNEL, VARIANT, "cuda-emulated", "float64", here=False)
    fn = emulated.bind(build_cuda_emulated(source, stem, racecheck=True), request.signature())
    rng = np.random.default_rng(3)
    shape = (SIZES["batch"], SIZES["heads"], SIZES["n"], SIZES["d"])
    q, k, v = (rng.standard_normal(shape) for _ in range(3))
    o, lse = fn(q, k, v, scale=0.3)
    want, want_lse = reference.attention_fwd_numpy(q, k, v, scale=0.3)
    assert np.abs(o - want).max() < 1e-12 and np.abs(lse - want_lse).max() < 1e-12


def _float64_kernel(source):
    """The float64 tiled kernel's text: where its barriers are."""
    start = source.index("__global__ void attention_fwd_flash_f64_rows(")
    return start, source.index("\n}\n", start)


def test_the_tiled_kernel_passes_the_race_check():
    _run(emit(KERNEL, VARIANT, "cuda-emulated"), "tiles_race")


def test_the_barriers_are_ir_statements_printed_with_what_they_order():
    """The pass's Barrier statements, in order: a key block's top (the last block's reads
    of K and V before the copy over them; Q's copy before its first read too, so none after
    that copy), after K's copy, before V's copy over K's bytes, after it; each printed once
    an instance, with its reason."""
    onf = onf_of(KERNEL, VARIANT, target="cuda", dtype="float64")
    whys = [s.why for s in walk(_rows(onf).body) if isinstance(s, Barrier)]
    assert whys == ["rows_K_tile copied after rows_K_tile copied and read, "
                    "rows_V_tile copied and read",
                    "rows_K_tile read after rows_K_tile copied",
                    "rows_V_tile copied after rows_K_tile read",
                    "rows_V_tile read after rows_V_tile copied"]
    source = emit(KERNEL, VARIANT, "cuda-emulated")
    start, end = _float64_kernel(source)
    assert [line.strip() for line in source[start:end].splitlines() if "__syncthreads" in line] == \
        [f"__syncthreads();  // {why}" for why in whys]


def test_the_warp_reductions_are_ir_statements_after_their_lanes_loops():
    """A block's row max and row sum, each accumulated by the 16 lanes along x that took a
    key block's columns: a LaneReduce right after the loop, printed as its shuffles."""
    onf = onf_of(KERNEL, VARIANT, target="cuda", dtype="float64")
    stmts = list(walk(_rows(onf).body))
    reductions = [(k, s) for k, s in enumerate(stmts) if isinstance(s, LaneReduce)]
    assert [(s.name, s.op, s.lanes) for _, s in reductions] == [("block_max", "max", 16),
                                                                ("block_sum", "+", 16)]
    for k, s in reductions:  # after the lanes' loop and what it holds
        loop = next(x for x in reversed(stmts[:k]) if is_thread_loop(x))
        assert loop.gpu == Threads("x", 16, 4) and stmts[k - 1] in loop.body
    source = emit(KERNEL, VARIANT, "cuda-emulated")
    start, end = _float64_kernel(source)
    assert source[start:end].count("for (int o = 8; o > 0; o /= 2) {") == 2


# which barrier, and the shared array the race check finds without it
@pytest.mark.parametrize("which, array", [(1, "rows_(K|V)_tile"), (2, "rows_K_tile"),
                                          (3, "rows_(K|V)_tile"), (4, "(rows_V_tile|probs)")])
def test_each_barrier_is_needed(which, array):
    source = emit(KERNEL, VARIANT, "cuda-emulated")
    start, end = _float64_kernel(source)
    kernel = source[start:end]
    barriers = [k for k in range(len(kernel)) if kernel.startswith("__syncthreads();", k)]
    assert len(barriers) == 4  # every one of them is deleted by a case here
    cut = start + barriers[which - 1]
    broken = source[:cut] + source[cut + len("__syncthreads();"):]
    with pytest.raises(EmulationCheckError, match=rf"race on shared `{array}`"):
        _run(broken, f"tiles_race_without_{which}")


@pytest.mark.parametrize("kernel, scattered", [("attention_bwd", {"dK"}),
                                               ("attention_fwdbwd", {"dK", "dV"})])
def test_the_atomic_kernels_add_from_a_block_per_query_tile(kernel, scattered, monkeypatch):
    """The paper's baseline on the owner's tiles: the atomic adds only in the query rows'
    pass, a block per 32 query rows with dQ in registers (stored once); what is not
    scattered (the separate backward's dV) a pass of its own, a block per key tile. The
    blocks' shared tiles pass the race check."""
    onf = onf_of(kernel, "atomic", target="cuda", dtype="float64")
    grid = _grids(onf)
    stores = {n.label: [(s.array, s.atomic) for s in walk(n.body)
                        if getattr(s, "array", None) in ("dQ", "dK", "dV")] for n in onf.nests}
    assert grid["rows"] == ["b", "h", "i_blk"]
    assert {a for label in stores for a, atomic in stores[label] if atomic} == scattered
    assert all(not atomic for label in stores if label != "rows" for _, atomic in stores[label])
    assert [a for a, _ in stores["rows"] if a == "dQ"] == ["dQ"]
    if "dV" not in scattered:
        assert grid["dV"] == ["b", "h", "j_blk"]
    _race_checked(monkeypatch, kernel, "atomic", dict(batch=1, heads=2, n=70, d=9))


@pytest.mark.parametrize("kernel", ["attention_bwd", "attention_bwd_causal"])
def test_the_dq_atomic_backward_adds_dq_from_the_key_tiles(kernel, monkeypatch):
    """FlashAttention-2's first backward: one pass, a block per 16 key rows at float64 (32
    at float32: attention_bwd.ATOMIC_CUDA_DTYPES) with dK and dV in registers (stored once
    each) adding dS K into dQ by atomics; causal, its query blocks before a tile's first
    key skipped. Race-checked (the causal kernel)."""
    onf = onf_of(kernel, "dq_atomic", target="cuda", dtype="float64")
    assert _grids(onf)["keys"] == ["b", "h", "j_blk"]
    (keys,) = [n for n in onf.nests if n.label == "keys"]
    stores = [(s.array, s.atomic) for s in walk(keys.body)
              if getattr(s, "array", None) in ("dQ", "dK", "dV")]
    assert sorted(stores) == [("dK", False), ("dQ", True), ("dV", False)]
    assert str(_blocks_loop(onf, "keys", "i_blk").start) == (
        "idiv(16*j_blk, 64)" if kernel.endswith("causal") else "0")
    if kernel.endswith("causal"):  # the plain kernel's pass is the same less the skips
        _race_checked(monkeypatch, kernel, "dq_atomic", dict(batch=1, heads=2, n=70, d=9))


def test_the_gqa_backward_walks_a_group_s_query_heads_inside_a_key_tile(monkeypatch):
    """dQ's pass folds a group's query heads into one grid axis, as the forward; the key
    rows' pass is a block per key tile of a KV head, which sums over the group's heads
    inside: each head's tiles staged in turn into one set (no tile has a group axis), its
    scratch a head at a time. Race-checked (the causal kernel: its skipped blocks too)."""
    onf = onf_of("attention_gqa_bwd", "flash", target="cuda", dtype="float64")
    grid = _grids(onf)
    assert grid["dQ"] == ["b", "g_r", "i_blk"] and grid["keys"] == ["b", "g", "j_blk"]
    assert all("group" not in str(b.shape) for b in onf.shared)
    _race_checked(monkeypatch, "attention_gqa_bwd_causal", "flash",
                  dict(batch=1, kv_heads=2, group=2, n=70, d=9))


def _grids(onf):
    """Each nest's grid loops, by their variables."""
    return {n.label: [lp.var.name for lp in walk(n.body)
                      if is_grid(lp)]
            for n in onf.nests}


def _race_checked(monkeypatch, kernel, variant, sizes):
    """The float64 kernel verified on the emulation with its race check on."""
    monkeypatch.setenv(RACECHECK_ENV, "1")
    row = verify.check_case(kernel, variant, "cuda-emulated", "float64", sizes,
                            load=runtime.load)
    assert row.status == "pass", verify.format_row(row)


def _blocks_loop(onf, nest, var):
    (loop,) = [s for n in onf.nests if n.label == nest for s in walk(n.body)
               if isinstance(s, Loop) and s.var.name == var]
    return loop


def test_the_causal_backward_on_cuda_skips_the_blocks_no_row_of_a_tile_sees(monkeypatch):
    """dQ's pass (a block per 32 query rows) stops at the key block of its last row; the
    key rows' pass (a block per 32 keys) starts at the query block of its first key. The
    bounds are the block's, so its threads all reach the barriers inside (at n 70 the
    first query tile skips the second key block, the last key tile the first query
    block)."""
    onf = onf_of("attention_bwd_causal", "flash", target="cuda", dtype="float64")
    key_blocks = _blocks_loop(onf, "dQ", "j_blk")
    assert (key_blocks.start, str(key_blocks.stop)) == (
        0, "Min(idiv(32*i_blk + 31, 64) + 1, idiv(n + 63, 64))")
    query_blocks = _blocks_loop(onf, "keys", "i_blk")
    assert (str(query_blocks.start), str(query_blocks.stop)) == (
        "idiv(32*j_blk, 64)", "idiv(n + 63, 64)")
    _race_checked(monkeypatch, "attention_bwd_causal", "flash",
                  dict(batch=1, heads=2, n=70, d=9))


def test_masked_blocks_refuse_a_loop_whose_blocks_are_not_no_ops_where_masked():
    # the causal forward: its running max takes the masked score itself, not exp(score - m)
    forward = BlockTiles(("b", "h", "i"), rows=64, nest="rows")(
        onf_of("attention_fwd_causal", VARIANT, target="cuda", dtype="float64", upto=5))
    with pytest.raises(ScheduleError, match="a masked score is used other than in exp"):
        MaskedBlocks("rows", "j_blk")(forward)
    # the backward without a mask: nothing to skip
    plain = onf_of("attention_bwd", "flash", target="cuda", dtype="float64", upto=11)
    with pytest.raises(ScheduleError, match="no score in the loop over j_blk is masked"):
        MaskedBlocks("dQ", "j_blk")(plain)


def test_masked_blocks_refuse_an_addition_not_zero_where_masked():
    onf = onf_of("attention_bwd_causal", "flash", target="cuda", dtype="float64", upto=11)
    dq = next(n for n in onf.nests if n.label == "dQ")
    (add,) = [s for s in walk(dq.body) if getattr(s, "array", None) == "dQ" and s.accumulate]
    bumped = replace(add, value=S.Bin("+", add.value, S.Num(1.0)))
    dq = replace(dq, body=_with_stmt(dq.body, add, bumped))
    onf = replace(onf, nests=tuple(dq if n.label == "dQ" else n for n in onf.nests))
    with pytest.raises(ScheduleError, match="dQ is added to by a value not zero where"):
        MaskedBlocks("dQ", "j_blk")(onf)
