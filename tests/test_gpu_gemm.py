"""The MLP's row products on CUDA as tiled SIMT GEMMs (moagen.kernels.gemm): a block per
output tile of rows x columns (BlockTiles with cols), the sum cut into chunks whose operand
tiles the block stages in shared memory (Split, Stage), each thread a 4 x 4 register tile
held over the whole sum (the weight gradients' over a batch entry's rows), and the forward
projections alike; the backward's dX, two sums, as one adding a term at a time
(MergeSums, AddTermwise); what the steps refuse; the barriers each needed; the emulated
kernel against numpy at sizes that cut every tile."""
from dataclasses import replace
import json
import re

import numpy as np
import pytest

from moagen.cost import sass
from moagen import reference_block
from moagen.emit import emit
from moagen.errors import ScheduleError
from moagen.onf.interpret import run_onf
from moagen.moa import scalar as S
from moagen.onf.loops import Barrier, Let, Loop, Store, Update, enclose, is_block_copy, \
    is_grid, is_thread_loop, loop_nest, stmt_exprs, walk
from moagen.pipeline import onf_of
from moagen.request import resolve
from moagen.steps.algebra.partials import SplitK
from moagen.steps.gpu.blocks import BlockTiles
from moagen.steps.gpu.staging import Stage
from moagen.steps.loop.merge_sums import AddTermwise, MergeSums
from moagen.steps.loop.reductions import LowerReductions
from moagen.steps.loop.split import Split
from moagen.targets.cuda import emulated
from moagen.targets.cuda.build import build_cuda_emulated
from moagen.targets.cuda.loader import EmulationCheckError

KERNEL, VARIANT = "mlp_fwd", "tiled"
# each product: (its kernel, its columns' loop, the loop over its sum's chunks, its
# operands' tiles); F and dX (too few output tiles for a wave) summed in parts (split-K),
# their GEMMs the nests F.partial, dX.partial, the parts' grid axis folded with the batch's
PRODUCTS = {"U": ("mlp_fwd", "e", "c_blk", {"U_X_tile", "U_Wg_tile"}),
            "V": ("mlp_fwd", "e", "c_blk", {"V_X_tile", "V_Wu_tile"}),
            "F.partial": ("mlp_fwd", "c", "e_blk", {"F_partial_H_tile", "F_partial_Wd_tile"}),
            "dH": ("mlp_bwd", "e", "c_blk", {"dH_dF_tile", "dH_WdT_tile"}),
            "dX.partial": ("mlp_bwd", "c", "e_blk", {"dX_partial_dU_tile", "dX_partial_WgT_tile",
                                                      "dX_partial_dV_tile", "dX_partial_WuT_tile"})}


def _nest(onf, label):
    return next(n for n in onf.nests if n.label == label)


def _reads(stmt):
    return {x.array for e in stmt_exprs(stmt) for x in S.subexpressions(e)
            if isinstance(x, (S.Access, S.Load))}  # Load: after the layout (flat offsets)


@pytest.mark.parametrize("label", PRODUCTS)
def test_each_product_is_a_block_per_output_tile_summing_staged_chunks(label):
    kernel, cols, chunks, tiles = PRODUCTS[label]
    onf = onf_of(kernel, VARIANT, target="cuda", dtype="float32")
    nest = _nest(onf, label)
    loops = [s for s in walk(nest.body) if isinstance(s, Loop)]
    outer = "e_part_b" if label.endswith(".partial") else "b"
    assert [lp.var.name for lp in loops if is_grid(lp)] == [outer, "i_blk", f"{cols}_blk"]
    assert {(lp.gpu.axis, lp.var.name, lp.gpu.threads, lp.gpu.tile)
            for lp in loops if is_thread_loop(lp)} == {("y", "i", 8, 4), ("x", cols, 16, 4)}
    # the accumulator (a thread's 4 x 4 registers) defined before the chunks, stored after
    threads = next(lp for lp in loops if is_thread_loop(lp) and lp.gpu.axis == "x")
    first, loop, store = threads.body
    assert isinstance(first, Let) and isinstance(store, Store) and loop.var.name == chunks
    # each chunk: both operands' tiles copied by the block, a barrier, then the product,
    # which reads shared memory only (no global load in the innermost loop)
    copies = [s for s in loop.body if is_block_copy(s)]
    assert {c.body[0].body[0].array for c in copies} == tiles
    product = loop.body[-1]
    assert isinstance(loop.body[-2], Barrier)
    assert set().union(*map(_reads, product.body)) == tiles
    # a step of the sum an FMA an operand pair: dX's two products added one at a time
    assert [type(s) for s in product.body] == [Update] * (len(tiles) // 2)
    assert {b.name for b in onf.shared} >= tiles
    # no panels; a split product's one temp: its parts
    assert [b.name for b in onf.temps if b.name.startswith(label.split(".")[0] + "_")] == \
        ([label.split(".")[0] + "_part"] if label.endswith(".partial") else [])


@pytest.mark.parametrize("label, rows, cols, tiles", [
    ("dWg", "c", "e", {"dWg_partial_XT_tile", "dWg_partial_dU_tile"}),
    ("dWu", "c", "e", {"dWu_partial_XT_tile", "dWu_partial_dV_tile"}),
    ("dWd", "e", "c", {"dWd_partial_HT_tile", "dWd_partial_dF_tile"})])
def test_a_weight_gradient_sums_a_batch_entry_s_rows_in_staged_chunks(label, rows, cols, tiles):
    """A block per (part of the rows, tile of the weight); its threads' sums over the rows
    of each batch entry in the part in chunks of 16 rows, both operands staged, then added
    across the entries into the part's partial; the parts then added in order, a thread a
    weight."""
    onf = onf_of("mlp_bwd", VARIANT, target="cuda", dtype="float64")
    loops = [s for s in walk(_nest(onf, f"{label}.partial").body) if isinstance(s, Loop)]
    assert [lp.var.name for lp in loops if is_grid(lp)] == ["i_part", f"{rows}_blk",
                                                            f"{cols}_blk"]
    merge = [s for s in walk(_nest(onf, label).body) if isinstance(s, Loop)]
    assert [lp.var.name for lp in merge] == [rows, cols, "i_part"]
    assert merge[0].parallel == 2 and merge[-1].stop == 3 and not any(map(is_grid, merge))
    assert {(lp.gpu.axis, lp.var.name) for lp in loops if is_thread_loop(lp)} == \
        {("y", rows), ("x", cols)}
    batch = next(lp for lp in loops if lp.var.name == "b")
    chunks = next(lp for lp in walk(batch.body) if isinstance(lp, Loop) and lp.var.name == "i_blk")
    assert {c.body[0].body[0].array for c in chunks.body if is_block_copy(c)} == tiles
    assert set().union(*map(_reads, chunks.body[-1].body)) == tiles


def test_the_projections_fold_batch_and_head_into_one_grid_axis_and_sum_heads_in_chunks():
    """qkv_proj's Q: a block per (part of the sum x batch entry x head, row tile, column
    tile), BlockTiles folding the part, b and h into one axis; out_proj's Y: a block per
    (part of the heads x batch entry, row tile, column tile), each head's sum over c in
    staged chunks, a part's heads' sums added in registers, the residual R added by the
    merge alone."""
    q = _nest(onf_of("qkv_proj", VARIANT, target="cuda", dtype="float32"), "Q.partial")
    assert [lp.var.name for lp in walk(q.body) if isinstance(lp, Loop) and is_grid(lp)] == \
        ["m_part_b_h", "i_blk", "c_blk"]  # split-K: the parts of the sum over m folded too
    out = onf_of("out_proj", VARIANT, target="cuda", dtype="float32")
    y = _nest(out, "Y.partial")
    loops = [lp for lp in walk(y.body) if isinstance(lp, Loop)]
    assert [lp.var.name for lp in loops if is_grid(lp)] == ["h_part_b", "i_blk", "m_blk"]
    heads = next(lp for lp in loops if lp.var.name == "h")
    chunks = next(lp for lp in walk(heads.body) if isinstance(lp, Loop) and lp.var.name == "c_blk")
    assert set().union(*map(_reads, chunks.body[-1].body)) == {"Y_partial_O_tile",
                                                               "Y_partial_Wo_tile"}
    assert "R" not in set().union(*map(_reads, walk(y.body)))
    assert "R" in set().union(*map(_reads, walk(_nest(out, "Y").body)))


def test_the_launch_is_a_grid_of_column_tiles_by_row_tiles_of_16_by_8_threads():
    from moagen.targets.cuda.printer import CudaPrinter
    onf = onf_of(KERNEL, VARIANT, target="cuda", dtype="float32")
    kernels = {k["name"].split("_f32_")[1]: k for k in CudaPrinter(onf, "float32").kernels()
               if k["tiled"]}
    assert set(kernels) == {"U", "V", "F_partial"}
    assert kernels["U"]["block"] == (16, 8, 1)
    assert [str(g) for g in kernels["U"]["grid"]] == ["idiv(dff + 63, 64)", "idiv(n + 31, 32)",
                                                      "batch"]
    # two tiles of 16 steps of the sum, the rows' 32 and the columns' 64, each padded by 4;
    # the instance copying by vectors and the scalar one
    (_, vector, shared), (_, scalar, same) = kernels["F_partial"]["launches"]
    assert (vector, scalar) == ("<1>", "<0>")
    assert int(shared) == int(same) == 4 * 16 * (36 + 68)


def _upto_schedule():
    """The forward's ONF after its CUDA schedule (the sums lowered and cut into chunks)."""
    return onf_of(KERNEL, VARIANT, target="cuda", dtype="float64", upto=4)


@pytest.mark.parametrize("step, message", [
    (BlockTiles(("b", "i", "e"), rows=32, cols=-1, nest="U"), "a block hold at least one"),
    (Stage("X", at="e_blk", nest="U"), "nest U has no loop over e_blk"),
    (Stage("U", at="c_blk", nest="U"), "U is not an input of mlp_fwd"),
    # no block tiles yet: Wg's rows span [0, dff), no constant extent of whole vectors
    (Stage("Wg", at="c_blk", vector=True, nest="U"), "vector loads .* Wg's tile is not one"),
])
def test_the_gemm_steps_refuse_what_they_cannot_do(step, message):
    with pytest.raises(ScheduleError, match=message):
        step(_upto_schedule())


def test_merge_sums_and_add_termwise_refuse_a_nest_with_nothing_to_do():
    backward = onf_of("mlp_bwd", VARIANT, target="cuda", dtype="float64", upto=0)
    with pytest.raises(ScheduleError, match="nest dH adds no sums over one extent"):
        MergeSums(nest="dH")(backward)
    with pytest.raises(ScheduleError, match="nest dX adds no sum of terms into a local"):
        AddTermwise(nest="dX")(backward)  # its sums not yet merged nor lowered


def test_merged_sums_keep_dx_s_value():
    """dX = dU Wg^T + dV Wu^T, merged into one sum, lowered and added a term at a time,
    interpreted against the two sums as the spec states them."""
    backward = onf_of("mlp_bwd", "naive", target="cpu", dtype="float64", upto=0)
    steps = (MergeSums(nest="dX"), LowerReductions(), AddTermwise(nest="dX"))
    merged = backward
    for step in steps:
        merged = step(merged)
    rng = np.random.default_rng(7)
    sizes = dict(batch=2, n=5, dm=3, dff=7)
    shapes = dict(X=("batch", "n", "dm"), Wg=("dm", "dff"), Wu=("dm", "dff"), Wd=("dff", "dm"),
                  U=("batch", "n", "dff"), V=("batch", "n", "dff"), dF=("batch", "n", "dm"))
    arrays = {k: rng.standard_normal(tuple(sizes[d] for d in v)) for k, v in shapes.items()}
    want, got = (run_onf(onf, arrays, {}) for onf in (backward, merged))
    assert np.allclose(got["dX"], want["dX"], rtol=1e-13, atol=1e-13)


def test_block_tiles_over_rows_and_columns_need_both_loops_from_0():
    onf = _upto_schedule()
    nest = _nest(onf, "U")
    batch = nest.body[0]
    rows = batch.body[0]  # the loop over i, started at 1
    shifted = replace(nest, body=(replace(batch, body=(replace(rows, start=rows.start + 1),)),))
    with pytest.raises(ScheduleError, match="over i, e must start at 0"):
        BlockTiles(("b", "i", "e"), rows=32, cols=64, nest="U")(
            onf.with_nests([shifted if n is nest else n for n in onf.nests], "shifted"))


SIZES = dict(batch=2, n=37, dm=19, dff=70)  # a partial row tile, chunk and column tile


def _run(source, stem, sizes=SIZES):
    request = resolve(KERNEL, VARIANT, "cuda-emulated", "float64", here=False)
    fn = emulated.bind(build_cuda_emulated(source, stem, racecheck=True), request.signature())
    rng = np.random.default_rng(5)
    shapes = dict(X=(sizes["batch"], sizes["n"], sizes["dm"]), Wg=(sizes["dm"], sizes["dff"]),
                  Wu=(sizes["dm"], sizes["dff"]), Wd=(sizes["dff"], sizes["dm"]))
    arrays = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    got = fn(*arrays.values())
    for value, want in zip(got, reference_block.mlp_fwd_numpy(*arrays.values())):
        assert np.abs(value - want).max() < 1e-12 * max(1.0, np.abs(want).max())


def _float64_kernel(source, label):
    start = source.index(f"__global__ void mlp_fwd_tiled_f64_{label}(")
    return start, source.index("\n}\n", start)


def test_the_emulated_gemms_match_numpy_and_pass_the_race_check():
    _run(emit(KERNEL, VARIANT, "cuda-emulated"), "gemm_race")


# the staging copies by 16-byte loads (Stage's vector option): every instance a launch may
# pick forced to the vector one (VECTOR_LOADS 1)
def _vector_only(source):
    return re.sub(r"(mlp_fwd_tiled_f64_\w+)<0>", r"\1<1>", source)


def test_the_staging_copies_load_by_vectors_where_the_rows_allow():
    """Every operand's copy has a vector form; the launch takes it where the rows' lengths
    are multiples of 4 and the operands 16-byte aligned."""
    source = emit(KERNEL, VARIANT, "cuda")
    loads = re.findall(r"moagen_load4\(\w+_v, &(\w+)\[", source)
    assert sorted(loads) == sorted(["X", "Wg", "X", "Wu", "H", "Wd"] * 2)  # U, V, F; 2 dtypes
    assert "if (dff % 4 == 0 && dm % 4 == 0 && (((uintptr_t)Wg | (uintptr_t)X) % 16) == 0) {" \
        in source


def test_the_vector_copies_match_numpy_at_sizes_of_whole_vectors():
    """Only the vector instances, at sizes of whole vectors that still cut a row tile, a
    chunk (20 = 16 + 4) and a column tile (72 = 64 + 8): the edge tiles' groups all in or
    all zero."""
    _run(_vector_only(emit(KERNEL, VARIANT, "cuda-emulated")), "gemm_vector",
         dict(batch=2, n=37, dm=20, dff=72))


def test_the_vector_copies_fail_on_rows_of_no_whole_vectors():
    """At SIZES (dm 19) the vector instance's loads are misaligned (the emulation fails
    them, as a GPU would fault): the launch's check is what keeps them off."""
    with pytest.raises(EmulationCheckError, match="not 16-byte aligned"):
        _run(_vector_only(emit(KERNEL, VARIANT, "cuda-emulated")), "gemm_vector_odd")


@pytest.mark.skipif(not sass.tools_available(), reason="nvcc or cuobjdump absent")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_staging_copies_are_128_bit_loads(dtype):
    """U's vector instance on sm_80 and sm_90: every global load of its copies a 128-bit one
    (a float4, two double2), none scalar; the hottest loop still no global load, no spill."""
    reports = [r for r in sass.inspect(KERNEL, VARIANT, dtype)
               if r.nest == "U" and r.name.endswith("<1>")]
    assert len(reports) == 2
    for r in reports:
        hottest = max(r.loops, key=lambda lp: lp.fma)
        copies = [lp for lp in r.loops if lp is not hottest and lp.counts["LDG"]]
        assert copies and all(lp.ldg_128 == lp.counts["LDG"] for lp in copies), (r.arch, r.name)
        assert hottest.counts["LDG"] == 0 and r.spill_stores == r.spill_loads == 0


@pytest.mark.parametrize("which", [1, 2])
def test_each_barrier_of_a_chunk_is_needed(which):
    """1: a chunk's copies wait for the last chunk's reads; 2: its reads for its copies."""
    source = emit(KERNEL, VARIANT, "cuda-emulated")
    start, end = _float64_kernel(source, "U")
    kernel = source[start:end]
    barriers = [k for k in range(len(kernel)) if kernel.startswith("__syncthreads();", k)]
    assert len(barriers) == 2
    cut = start + barriers[which - 1]
    broken = source[:cut] + source[cut + len("__syncthreads();"):]
    with pytest.raises(EmulationCheckError, match=r"race on shared `U_(X|Wg)_tile`"):
        _run(broken, f"gemm_race_without_{which}")


# split-K (SplitK): a product with too few output tiles for a wave summed in parts


@pytest.mark.parametrize("label, summed, loop", [("dX", "e", "e_blk"), ("dWd", "i", "i_blk")])
def test_split_k_keeps_the_value_of_a_sum_and_of_a_sum_of_batch_entries(label, summed, loop):
    """dX (two sums merged, a term at a time) and dWd (each batch entry's rows summed, the
    entries added after) in 3 parts of their chunks of 2, interpreted against the spec's
    sums: n 7 and dff 7 are 4 chunks, parts of 2, 2 and none."""
    backward = onf_of("mlp_bwd", "naive", target="cpu", dtype="float64", upto=0)
    steps = (MergeSums(nest="dX"), LowerReductions(), AddTermwise(nest="dX"),
             Split(summed, 2, nest=label), SplitK(label, loop, 3))
    split = backward
    for step in steps:
        split = step(split)
    assert [n.label for n in split.nests].index(f"{label}.partial") == \
        [n.label for n in split.nests].index(label) - 1
    assert f"{label}_part" in {b.name for b in split.temps}
    rng = np.random.default_rng(7)
    sizes = dict(batch=2, n=7, dm=3, dff=7)
    shapes = dict(X=("batch", "n", "dm"), Wg=("dm", "dff"), Wu=("dm", "dff"), Wd=("dff", "dm"),
                  U=("batch", "n", "dff"), V=("batch", "n", "dff"), dF=("batch", "n", "dm"))
    arrays = {k: rng.standard_normal(tuple(sizes[d] for d in v)) for k, v in shapes.items()}
    want, got = (run_onf(onf, arrays, {}) for onf in (backward, split))
    assert np.allclose(got[label], want[label], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("step, message", [
    (SplitK("U", "c_blk", 0), "parts must be at least 1"),
    (SplitK("U", "e_blk", 3), "has not one loop e_blk"),
    (SplitK("H", "e", 3), "not loops around a sum into a local"),
])
def test_split_k_refuses_what_it_cannot_split(step, message):
    with pytest.raises(ScheduleError, match=message):
        step(_upto_schedule())


def _out_proj_lowered():
    """out_proj's Y = R + sum_h sum_c O W, its sums as loops into locals."""
    return LowerReductions()(onf_of("out_proj", "tiled", target="cpu", dtype="float64", upto=0))


def test_split_k_adds_a_stored_term_once_with_the_parts():
    """Y = R + heads_sum: the parts store their heads' sums alone, the merge R + their sum
    (heads 3 in parts of 1), interpreted against the unsplit nest."""
    lowered = _out_proj_lowered()
    split = SplitK("Y", "h", 3)(lowered)
    partial, merge = (_nest(split, label) for label in ("Y.partial", "Y"))
    assert "R" not in set().union(*map(_reads, walk(partial.body)))
    assert "R" in set().union(*map(_reads, walk(merge.body)))
    rng = np.random.default_rng(5)
    sizes = dict(batch=2, n=5, dm=7, heads=3, dh=4)
    shapes = dict(O=("batch", "heads", "n", "dh"), Wo=("heads", "dh", "dm"), R=("batch", "n", "dm"))
    arrays = {k: rng.standard_normal(tuple(sizes[d] for d in v)) for k, v in shapes.items()}
    want, got = (run_onf(onf, arrays, {}) for onf in (lowered, split))
    assert np.allclose(got["Y"], want["Y"], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("value", [
    lambda term, acc: S.Bin("+", acc, acc),  # the term reads a local of the sum
    lambda term, acc: S.Bin("*", term, acc),  # not a term plus the sum
])
def test_split_k_refuses_a_stored_value_other_than_a_term_plus_the_sum(value):
    lowered = _out_proj_lowered()
    [nest] = lowered.nests
    loops, stmts = loop_nest(nest.body)
    store = stmts[-1]  # Y[b, i, m] = R[b, i, m] + heads_sum
    changed = replace(store, value=value(store.value.left, store.value.right))
    body = enclose(loops, stmts[:-1] + (changed,))
    with pytest.raises(ScheduleError, match="not loops around a sum into a local"):
        SplitK("Y", "h", 3)(lowered.with_nests((replace(nest, body=body),), "changed"))


def test_split_k_refuses_a_loop_whose_range_moves_with_the_loops_around_it():
    """A chunk's rows (i in [2 i_blk, ..)) are no parts of the sum: each chunk's would be."""
    backward = onf_of("mlp_bwd", "naive", target="cpu", dtype="float64", upto=0)
    chunked = Split("i", 2, nest="dWd")(LowerReductions()(backward))
    with pytest.raises(ScheduleError, match="range of loop i depends on the loops around it"):
        SplitK("dWd", "i", 3)(chunked)


def test_two_emulated_runs_give_the_same_bits():
    """The parts are added in one order, whatever order the blocks run in: no atomics."""
    source = emit("mlp_bwd", VARIANT, "cuda-emulated")
    request = resolve("mlp_bwd", VARIANT, "cuda-emulated", "float32", here=False)
    fn = emulated.bind(build_cuda_emulated(source, "gemm_bits"), request.signature())
    sizes = dict(batch=2, n=37, dm=19, dff=70)
    rng = np.random.default_rng(3)
    shapes = dict(X=("batch", "n", "dm"), Wg=("dm", "dff"), Wu=("dm", "dff"), Wd=("dff", "dm"),
                  U=("batch", "n", "dff"), V=("batch", "n", "dff"), dF=("batch", "n", "dm"))
    arrays = [rng.standard_normal(tuple(sizes[d] for d in shapes[name])).astype(np.float32)
              for name in (p.name for p in request.signature().inputs)]
    first, second = fn(*arrays), fn(*arrays)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))



SPLIT = {"mlp_fwd": {"F.partial"},
         "mlp_bwd": {"dX.partial", "dWg.partial", "dWu.partial", "dWd.partial"},
         "qkv_proj": {"Q.partial", "K.partial", "V.partial"},
         "out_proj": {"Y.partial"}, "out_proj_bwd": {"dO.partial", "dWo.partial"},
         "qkv_proj_bwd": {"dX.partial", "dWq.partial", "dWk.partial", "dWv.partial"}}
UNSPLIT = {"mlp_fwd": {"U", "V"}, "mlp_bwd": {"dH"}, "qkv_proj": set(), "out_proj": set(),
           "out_proj_bwd": set(), "qkv_proj_bwd": set()}


@pytest.mark.skipif(not sass.tools_available(), reason="nvcc or cuobjdump absent")
@pytest.mark.parametrize("kernel, variant", [("mlp_bwd", "tiled"), ("qkv_proj", "tiled"),
                                             ("out_proj", "tiled"), ("out_proj", "tensor"),
                                             ("out_proj_bwd", "tiled"), ("qkv_proj_bwd", "tiled"),
                                             ("mlp_fwd", "tensor")])
def test_every_gemm_fills_a_wave_at_the_bench_sizes(kernel, variant, capsys):
    """moagen cost --cuda at the bench's sizes (n 2048, dm 512, dff 1408, 8 heads of 64),
    float32 (the fewer waves: more blocks an SM): each GEMM at least a wave on the H200,
    no spills, and in SIMT no global load in its hottest loop, FMA per shared load 8
    (unsplit, F, dX, the weight gradients and Q, K, V were 0.33-0.43 of a wave, out_proj's
    Y 0.55; qkv_proj_bwd's dWq, dWk, dWv 0.16 as a thread per 2 x 4 tile)."""
    from moagen.cli import main
    assert main(["cost", kernel, "--variant", variant, "--cuda", "--json",
                 "--dtype", "float32"]) == 0
    [call] = json.loads(capsys.readouterr()[0])["gpu"]
    gemms = [k for k in call["kernels"] if k["nest"] in SPLIT[kernel] | UNSPLIT[kernel]]
    assert len(gemms) == len(SPLIT[kernel] | UNSPLIT[kernel])
    for k in gemms:
        assert k["waves"] >= 1.0, (k["nest"], k["waves"])
        assert k["spill_stores"] == 0
        if variant == "tiled":  # (on tensor cores the loop with the most FMA is a copy's)
            assert k["hot_loop"]["global_loads"] == 0
            assert k["hot_loop"]["fma_per_shared_load"] >= 8


# the projections' backwards on CUDA, each product a split GEMM: its partial nest's grid,
# the loop over its chunks, the tiles staged
BACKWARDS = {
    "out_proj_bwd": {"dO.partial": (["m_part_b_h", "i_blk", "c_blk"], "m_blk",
                                    {"dO_partial_dY_tile", "dO_partial_WoT_tile"}),
                     "dWo.partial": (["i_part_h", "c_blk", "m_blk"], "i_blk",
                                     {"dWo_partial_O_tile", "dWo_partial_dY_tile"})},
    "qkv_proj_bwd": {"dX.partial": (["h_part_b", "i_blk", "m_blk"], "c_blk",
                                    {f"dX_partial_{a}_tile" for a in ("dQ", "WqT", "dK", "WkT",
                                                                      "dV", "WvT")}),
                     **{f"{w}.partial": (["i_part_h", "m_blk", "c_blk"], "i_blk",
                                         {f"{w}_partial_XT_tile", f"{w}_partial_{d}_tile"})
                        for w, d in (("dWq", "dQ"), ("dWk", "dK"), ("dWv", "dV"))}}}


@pytest.mark.parametrize("kernel", BACKWARDS)
def test_the_projections_backwards_are_split_gemms(kernel):
    """out_proj_bwd: dO a block per (part of the sum over m, batch entry x head folded, 32 x
    64 tile of a head's rows), dWo per (part of the rows x head, 32 x 64 tile of a head's
    weight). qkv_proj_bwd: dX per (part of the heads x batch entry, 32 x 64 tile of its
    rows), its three sums over c one (six operands staged), dWq, dWk, dWv per (part of the
    rows x head, 32 x 64 tile of a head's dm x dh weight: the CPU's loop order h, m, c).
    Both operands staged in chunks of 16; each merged over its 8 parts a thread an element.
    Before: a thread per 2 x 4 tile from global memory."""
    onf = onf_of(kernel, VARIANT, target="cuda", dtype="float32")
    for label, (grid, chunks, tiles) in BACKWARDS[kernel].items():
        loops = [s for s in walk(_nest(onf, label).body) if isinstance(s, Loop)]
        assert [lp.var.name for lp in loops if is_grid(lp)] == grid
        chunk = next(lp for lp in loops if lp.var.name == chunks)
        assert {c.body[0].body[0].array for c in chunk.body if is_block_copy(c)} == tiles
        assert set().union(*map(_reads, chunk.body[-1].body)) == tiles


@pytest.mark.parametrize("kernel, transposes", [("out_proj_bwd", ("WoT",)),
                                                ("qkv_proj_bwd", ("WqT", "WkT", "WvT", "XT"))])
def test_the_backwards_transposes_run_a_gpu_thread_an_element(kernel, transposes):
    """Each transpose's three loops as GPU threads (before: a thread a head, 8 threads at
    the bench's sizes, as the CPU's)."""
    onf = onf_of(kernel, VARIANT, target="cuda", dtype="float32")
    for label in transposes:
        [loop] = _nest(onf, label).body
        assert loop.parallel == 3, label
