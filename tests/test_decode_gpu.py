"""Decode on a GPU, a block a group (attention_decode's grouped variant): a thread block per
(batch, KV head, 4 slices of the cache) computing 4 query heads of the group, each K and V
row read once for them; a warp a slice, its lanes across d, each dot product summed by warp
shuffles with no barrier and no shared memory; what the steps refuse; the emulated kernel
against numpy where the warps of a block walk different numbers of keys."""
from dataclasses import replace

import numpy as np
import pytest
import sympy

from moagen import reference
from moagen.cost import sass
from moagen.cost.gpu import H200
from moagen.bench import calls, rates
from moagen.cost.model import SizeError, predict, value
from moagen.emit import emit
from moagen.errors import ScheduleError
from moagen.kernels.attention_decode import (RESIDENT_BLOCKS, SLICE_WARPS, WARP_KEYS, WAVES,
                                             keys_a_warp)
from moagen.moa import scalar as S
from moagen.moa.expr import idiv, sym
from moagen.onf.loops import Barrier, LaneReduce, Loop, is_grid, is_thread_loop, stmt_exprs, walk
from moagen.pipeline import onf_of
from moagen.request import resolve
from moagen.steps.algebra.given import GivenSize
from moagen.steps.algebra.splitkeys import SplitKeys
from moagen.steps.gpu.closing import check_block_form
from moagen.steps.gpu.staging import RegisterTile
from moagen.steps.gpu.vector import VECTOR_TILE, VectorLoads
from moagen.targets.cuda import emulated
from moagen.targets.cuda.arrays import to_device
from moagen.targets.cuda.build import build_cuda_emulated
from moagen.targets.cuda.loader import EmulationCheckError

KERNEL, VARIANT = "attention_decode", "grouped"


def _nest(onf, label="heads.partial"):
    return next(n for n in onf.nests if n.label == label)


def _reads(nest, array):
    return [x for s in walk(nest.body) for e in stmt_exprs(s) for x in S.subexpressions(e)
            if isinstance(x, S.Load) and x.array == array]


def test_a_block_is_a_group_s_heads_over_slices_a_warp_each():
    onf = onf_of(KERNEL, VARIANT, target="cuda", dtype="float32")
    partial = _nest(onf)
    loops = [lp for lp in walk(partial.body) if isinstance(lp, Loop) and lp.gpu]
    assert [lp.var.name for lp in loops if is_grid(lp)] == ["b", "g_r_tile", "j_split_blk"]
    assert {(lp.gpu.axis, lp.var.name, lp.gpu.threads, lp.gpu.tile)
            for lp in loops if is_thread_loop(lp)} == {("y", "j_split", 4, 1), ("x", "c", 32, 4)}
    # the slices' count from the cache's valid rows: 32 w keys a warp, w given at call time
    assert str(dict((b.name, b.shape) for b in onf.temps)["O_part"][2]) == \
        "4*idiv(n + 128*w - 1, 128*w)"
    # dot products by shuffles, no barrier, no shared memory
    assert not any(isinstance(s, Barrier) for s in walk(partial.body)) and onf.shared == ()
    assert {s.name for s in walk(partial.body) if isinstance(s, LaneReduce)} == \
        {"qk_0", "qk_1", "qk_2", "qk_3"}


def test_each_k_and_v_row_is_read_once_for_the_group_s_four_heads():
    """The 4 heads' dot products read K's row, their output rows V's, from a lane's
    registers, loaded once a key by a loop of vector loads (VectorLoads); O_part stored once
    a slice."""
    partial = _nest(onf_of(KERNEL, VARIANT, target="cuda", dtype="float32"))
    for array in ("K", "V"):
        [read] = _reads(partial, array)
        [loop] = [lp for lp in walk(partial.body) if is_thread_loop(lp) and lp.gpu.vector
                  and lp.body[0].value == read]
        assert loop.gpu.vector and loop.gpu.tile == VECTOR_TILE
        local = loop.body[0].name
        assert sum(isinstance(x, S.Local) and x.name == local for s in walk(partial.body)
                   for e in stmt_exprs(s) for x in S.subexpressions(e)) == 4
    keys = next(lp for lp in walk(partial.body) if isinstance(lp, Loop) and lp.var.name == "j")
    assert not [s for s in walk(keys.body) if getattr(s, "array", None) == "O_part"]
    assert not _reads(partial, "O_part")


@pytest.mark.parametrize("step, message", [
    (VectorLoads(("O_part",), "c", nest="heads.partial"), "O_part is not one"),
    (VectorLoads(("K",), "j", nest="heads.partial"), "no thread loop over j reading K")])
def test_vector_loads_refuse_what_they_cannot_load_aligned(step, message):
    onf = onf_of(KERNEL, VARIANT, target="cuda", dtype="float32", upto=13)
    with pytest.raises(ScheduleError, match=message):
        step(onf)


def _lanes(onf, **mark):
    """onf with the partial nest's thread loops across d (axis x) marked otherwise."""
    partial = _nest(onf)

    def marked(stmts):
        return tuple(replace(s, body=marked(s.body),
                             gpu=replace(s.gpu, **mark) if is_thread_loop(s)
                             and s.gpu.axis == "x" else s.gpu)
                     if isinstance(s, Loop) else s for s in stmts)
    return replace(onf, nests=tuple(replace(n, body=marked(n.body)) if n is partial else n
                                    for n in onf.nests))


def test_vector_loads_refuse_a_tile_that_is_not_a_vector():
    """A lane's 2 features of d: its tile's first element need not be 16-byte aligned."""
    onf = _lanes(onf_of(KERNEL, VARIANT, target="cuda", dtype="float32", upto=13), tile=2)
    with pytest.raises(ScheduleError, match=r"tiles of 2; vector loads of K need \[0, d\)"):
        VectorLoads(("K",), "c", nest="heads.partial")(onf)


def test_the_launch_takes_the_vector_loads_only_where_they_are_aligned():
    """The vector instance where d is a multiple of 4 and K and V start 16-byte aligned; the
    scalar one otherwise (a cache that is a view at an odd offset)."""
    source = emit(KERNEL, VARIANT, "cuda")
    assert "if (d <= 128 && d % 4 == 0 && (((uintptr_t)K | (uintptr_t)V) % 16) == 0) {" \
        in source
    assert "else if (d <= 128) {" in source


def test_a_loop_reading_a_warp_s_row_needs_whole_warps_across_d():
    """The keys' loop reads the warp's slice: uniform across a warp only where its lanes
    are a whole warp; with 16 threads across d two slices would share a warp."""
    onf = _lanes(onf_of(KERNEL, VARIANT, target="cuda", dtype="float32"), threads=16)
    with pytest.raises(ScheduleError, match="loop over j has bounds that read the thread loops"):
        check_block_form(onf)


def test_split_keys_refuses_a_count_of_slices_from_no_size():
    onf = onf_of(KERNEL, "dnf", upto=4)
    with pytest.raises(ScheduleError, match="an expression of the kernel's sizes"):
        SplitKeys("heads", over=("b", "h"), var="j", splits=sympy.Symbol("slices"))(onf)


def test_a_size_given_by_a_step_is_a_new_name_and_split_keys_rows_are_of_the_sizes():
    onf = onf_of(KERNEL, "split", upto=4)  # after OnlineSoftmax
    with pytest.raises(ScheduleError, match="already has a size, array, scalar or loop called n"):
        GivenSize("n", keys_a_warp)(onf)
    n, w = sym("n"), sym("w")
    split = SplitKeys("heads", over=("b", "h"), var="j", splits=4 * idiv(n + 128 * w - 1, 128 * w),
                      rows=32 * w)
    with pytest.raises(ScheduleError, match="an expression of the kernel's sizes"):
        split(onf)  # no w yet
    given = GivenSize("w", keys_a_warp)(onf)
    assert given.sizes[-1] == w and dict(given.chosen)["w"] is keys_a_warp
    assert str(split(given).temps[0].shape[-1]) == "4*idiv(n + 128*w - 1, 128*w)"


def test_a_register_tile_is_of_an_output_or_a_scratch_array():
    onf = onf_of(KERNEL, VARIANT, target="cuda", dtype="float32", upto=12)
    with pytest.raises(ScheduleError, match="K is no output or scratch"):
        RegisterTile("K", nest="heads.partial")(onf)


def _emulated(dtype="float64", stem="decode_grouped"):
    request = resolve(KERNEL, VARIANT, "cuda-emulated", dtype, here=False)
    return emulated.bind(build_cuda_emulated(emit(KERNEL, VARIANT, "cuda-emulated", (dtype,)),
                                             f"{stem}_{dtype}"), request.signature())


@pytest.mark.parametrize("sizes", [dict(batch=1, q_heads=8, kv_heads=2, cap=700, d=128, n=601),
                                   dict(batch=2, q_heads=6, kv_heads=2, cap=40, d=64, n=33)])
@pytest.mark.parametrize("w", [None, 3])
def test_the_emulated_kernel_is_numpy_s_where_warps_walk_different_key_counts(sizes, w):
    """n = 601: a block's last warps have fewer keys or none (32 w a warp: at w = 3, 96, so
    601 keys are 7 slices in 2 blocks, the last slice 25 keys, the 8th none); 3 heads a group
    run on the edge's blocks, one head each. w left out: the kernel's choice (1 at these
    sizes on the emulation's 132 SMs)."""
    rng = np.random.default_rng(3)
    b, qh, kvh, cap, d, n = (sizes[k] for k in ("batch", "q_heads", "kv_heads", "cap", "d", "n"))
    q = rng.standard_normal((b, qh, d))
    K, V = rng.standard_normal((2, b, kvh, cap, d))
    O, lse = _emulated()(q, K, V, scale=0.3, n=n, **({} if w is None else {"w": w}))
    want_O, want_lse = reference.attention_decode_numpy(q, K, V, 0.3, n)
    np.testing.assert_allclose(O, want_O, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


@pytest.mark.parametrize("w", [0, -1])
def test_a_warp_s_keys_below_32_are_refused_before_the_launch(w):
    rng = np.random.default_rng(4)
    q, K, V = rng.standard_normal((1, 4, 8)), *rng.standard_normal((2, 1, 1, 50, 8))
    with pytest.raises(ValueError, match=f"size w = {w} must be >= 1"):
        _emulated()(q, K, V, scale=0.3, n=50, w=w)


@pytest.mark.parametrize("n, sms, w", [
    (1024, 132, 1), (8192, 132, 1), (32768, 132, 1), (131072, 132, 4), (131072, 16, 36),
    (32768, 16, 9), (1, 132, 1)])
def test_the_chosen_keys_a_warp_fill_the_gpu_about_twice_with_fewer_slices_at_long_caches(
        n, sms, w):
    """At 32 / 8 heads: w = 1 (32 keys a warp) while the grid is at most WAVES waves of
    RESIDENT_BLOCKS blocks an SM; past that as few slices as keep it at least WAVES waves
    (a wave where the cache is only that long)."""
    sizes = dict(batch=1, q_heads=32, kv_heads=8, cap=n, d=128, n=n)
    assert keys_a_warp(sizes, sms) == w
    blocks = 8 * -(-n // (SLICE_WARPS * WARP_KEYS * w))
    wave = sms * RESIDENT_BLOCKS
    assert blocks >= min(WAVES * wave, 8 * -(-n // (SLICE_WARPS * WARP_KEYS)))
    assert w == 1 or blocks < 2 * WAVES * wave  # not more slices than that


def test_the_cost_model_chooses_w_as_a_call_on_the_modelled_gpu_would():
    cost = predict(KERNEL, VARIANT, "float32")
    sizes = dict(batch=1, q_heads=32, kv_heads=8, cap=131072, d=128, n=131072)
    assert cost.sizes_from(sizes, sms=H200.sms)[sym("w")] == 4
    assert cost.sizes_from(dict(sizes, w=2), sms=H200.sms)[sym("w")] == 2
    with pytest.raises(SizeError, match="size w = 0 must be >= 1"):
        cost.sizes_from(dict(sizes, w=0))


def test_the_bench_counts_a_call_at_the_w_its_device_chooses():
    """The bench's M of a grouped call on the emulation: at its 132 SMs w = 1 at n 1024,
    as the kernel itself chooses, whatever this CPU's cores would choose."""
    sizes = calls.sizes(KERNEL, 1024)
    gpu = rates.predicted(KERNEL, VARIANT, sizes, "float32", lang="cuda-emulated")
    want = predict(KERNEL, VARIANT, "float32").sizes_from(dict(sizes, w=1))
    assert gpu[1] == value(predict(KERNEL, VARIANT, "float32").M, want)


def test_on_a_cpu_the_keys_a_warp_are_chosen_for_its_cores(monkeypatch):
    sizes = dict(batch=1, q_heads=32, kv_heads=8, cap=32768, d=128, n=32768)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert keys_a_warp(sizes) == 512  # 2048 blocks at w = 1 over 2 waves of 2 cores


class _Offset:
    """A device array's elements from `first` on, as `shape`: a view another library hands
    over (its __cuda_array_interface__ only)."""

    def __init__(self, base, first, shape):
        self.base = base  # keeps the memory
        self.__cuda_array_interface__ = dict(
            base.__cuda_array_interface__, shape=shape,
            data=(base.ptr + first * base.dtype.itemsize, False))


def _odd_offset_call(dtype, source, stem):
    """The emulated kernel (`source`) on a cache whose K and V are device views one element
    past a 16-byte boundary (run where they are, no copy), and numpy's result."""
    rng = np.random.default_rng(5)
    b, qh, kvh, cap, d, n = 1, 8, 2, 80, 64, 75
    q = rng.standard_normal((b, qh, d)).astype(dtype)
    size = b * kvh * cap * d
    flat = rng.standard_normal(2 * size + 1).astype(dtype)
    gpu = emulated.device()
    on_device = to_device(gpu, flat)
    K, V = (_Offset(on_device, 1 + k * size, (b, kvh, cap, d)) for k in (0, 1))
    assert all(x.__cuda_array_interface__["data"][0] % 16 for x in (K, V))
    request = resolve(KERNEL, VARIANT, "cuda-emulated", dtype, here=False)
    fn = emulated.bind(build_cuda_emulated(source, stem), request.signature())
    O, lse = fn(to_device(gpu, q), K, V, scale=0.3, n=n)
    host = (flat[1 + k * size:1 + (k + 1) * size].reshape(b, kvh, cap, d) for k in (0, 1))
    return (O.get(), lse.get()), reference.attention_decode_numpy(q, *host, 0.3, n)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_cache_at_an_odd_offset_runs_the_scalar_loads(dtype):
    """K and V misaligned for a vector load: the launch takes the scalar instance."""
    (O, lse), (want_O, want_lse) = _odd_offset_call(
        dtype, emit(KERNEL, VARIANT, "cuda-emulated", (dtype,)), f"decode_grouped_odd_{dtype}")
    tol = 1e-12 if dtype == "float64" else 2e-5
    np.testing.assert_allclose(O, want_O, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=tol)


def test_the_emulation_fails_a_misaligned_vector_load():
    """Without the launcher's alignment test the vector instance runs on the odd views, and
    the emulation fails it, as a GPU would fault."""
    source = emit(KERNEL, VARIANT, "cuda-emulated", ("float64",))
    test = " && (((uintptr_t)K | (uintptr_t)V) % 16) == 0"
    assert test in source
    with pytest.raises(EmulationCheckError, match="not 16-byte aligned"):
        _odd_offset_call("float64", source.replace(test, ""), "decode_grouped_misaligned")


@pytest.mark.skipif(not sass.tools_available(), reason="nvcc or cuobjdump absent")
@pytest.mark.parametrize("dtype, vectors", [("float32", 2), ("float64", 4)])
def test_the_key_loop_loads_k_and_v_rows_by_128_bit_loads(dtype, vectors):
    """The key loop (the partial kernel's loop with the most FMA) of the vector instance,
    on sm_80 and sm_90: a K and a V row a key as LDG.E.128 (a float4 each in float32, two
    double2 in float64), no scalar load of them (those left: the 4 heads' q)."""
    reports = [r for r in sass.inspect(KERNEL, VARIANT, dtype)
               if r.nest == "heads.partial" and r.name.endswith(", 1>")]
    assert len(reports) == 2 * 2  # d <= 64 and <= 128, on sm_80 and sm_90
    for r in reports:
        keys = max(r.loops, key=lambda lp: lp.fma)
        assert keys.ldg_128 == vectors, (r.arch, r.name)
        assert keys.counts["LDG"] - keys.ldg_128 <= 4 * 4, (r.arch, r.name)  # q's
        assert r.spill_stores == r.spill_loads == 0


def test_split_keys_refuses_slices_of_rows_that_do_not_cover_the_keys():
    """32 rows a slice over n rows needs k ceil(n / 32k) slices; 4 ceil(n / 64) would leave
    half of them unread."""
    onf = onf_of(KERNEL, "split", upto=4)  # after OnlineSoftmax
    n = sym("n")
    with pytest.raises(ScheduleError, match="32 rows a slice the slices must be"):
        SplitKeys("heads", over=("b", "h"), var="j", splits=4 * idiv(n + 63, 64), rows=32)(onf)
