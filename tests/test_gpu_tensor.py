"""The MLP's and the projections' products on CUDA tensor cores (the `tensor` variants;
moagen.kernels.gemm.TENSOR, moagen.steps.gpu.mma.WarpMma): a block per output tile as in
the SIMT GEMMs, its 2 x 2
warps each a tile of fragments (float64: DMMA m8n8k4; float32: 3xTF32 on m16n16k8), the
operands' fragments loaded from the staged tiles, the accumulators stored into a shared
tile the block copies out; what WarpMma refuses; the barrier the copy out needs; the
emulated kernels (nvcuda::wmma on the host: templates/cuda/emulation/mma.h) against numpy
at sizes that cut every tile, float32 by 3xTF32 within its tolerance where one TF32
product is not; DMMA and HMMA in the SASS."""

import pytest

from moagen.cost import sass
from moagen.emit import emit
from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import Loop, Mma, Operand, Store, is_fragment_loop, walk
from moagen.pipeline import onf_of
from moagen.request import resolve
from moagen.steps.gpu.mma import WarpMma
from moagen.targets.cuda import emulated
from moagen.targets.cuda.build import build_cuda_emulated
from moagen.targets.cuda.loader import EmulationCheckError
from moagen.verify import check_case

KERNEL, VARIANT = "mlp_fwd", "tensor"
# each product: its columns' loop, its sum's, its operands' tiles (the row operand's laid
# out with the rows last: column major as a fragment's rows x k; the weight's row major)
# F summed in parts (split-K): its GEMM the nest F.partial
PRODUCTS = {"U": ("e", "c", "U_X_tile", "U_Wg_tile"), "V": ("e", "c", "V_X_tile", "V_Wu_tile"),
            "F.partial": ("c", "e", "F_partial_H_tile", "F_partial_Wd_tile")}


def _nest(onf, label):
    return next(n for n in onf.nests if n.label == label)


@pytest.mark.parametrize("label", PRODUCTS)
@pytest.mark.parametrize("dtype, precision, shape, warp", [
    ("float64", "f64", (8, 8, 4), (16, 32)), ("float32", "3xtf32", (16, 16, 8), (16, 32))])
def test_each_product_is_a_warp_tile_of_fragments_from_the_staged_tiles(label, dtype, precision,
                                                                       shape, warp):
    cols, summed, a, b = PRODUCTS[label]
    onf = onf_of(KERNEL, VARIANT, target="cuda", dtype=dtype)
    nest = _nest(onf, label)
    loops = [s for s in walk(nest.body) if isinstance(s, Loop)]
    assert {(lp.gpu.axis, lp.var.name, lp.gpu.threads, lp.gpu.tile, lp.gpu.fragment)
            for lp in loops if is_fragment_loop(lp)} == \
        {("y", "i", 2, warp[0], shape[0]), ("x", cols, 2, warp[1], shape[1])}
    [mma] = [lp.gpu for lp in loops if isinstance(lp.gpu, Mma)]
    assert mma == Mma(shape, ((Operand(a, "col", 36), Operand(b, "row", 68)),),
                      Operand(f"{label.replace('.', '_')}_out_tile", "row", 68), precision)
    assert [lp.var.name for lp in loops if isinstance(lp.gpu, Mma)] == [summed]


def test_dx_s_two_sums_are_two_terms_and_a_weight_gradient_a_total_of_fragments():
    """The backward: dX = dU Wg^T + dV Wu^T one sum of two products a step (MergeSums,
    AddTermwise), each term's fragments from its own tiles; dWg a sum a batch entry, zeroed
    and added to the entries' total, both accumulators fragments."""
    onf = onf_of("mlp_bwd", VARIANT, target="cuda", dtype="float64")
    [dx] = [lp.gpu for lp in walk(_nest(onf, "dX.partial").body) if isinstance(lp, Loop)
            and isinstance(lp.gpu, Mma)]
    assert [(a.array, b.array) for a, b in dx.terms] == [
        ("dX_partial_dU_tile", "dX_partial_WgT_tile"), ("dX_partial_dV_tile", "dX_partial_WuT_tile")]
    from moagen.targets.cuda.printer import CudaPrinter
    source = "\n".join(line for k in CudaPrinter(onf, "float64").kernels()
                       if k["name"].endswith("_dWg_partial") for line in k["prologue"] + k["body"])
    assert "wmma::fragment<wmma::accumulator, 8, 8, 4, double> over_b[2][4];" in source
    assert "over_b[s_c][s_e].x[t] += acc[s_c][s_e].x[t];" in source


def test_the_launch_is_2_by_2_warps_with_the_output_tile_in_shared_memory():
    from moagen.targets.cuda.printer import CudaPrinter
    onf = onf_of(KERNEL, VARIANT, target="cuda", dtype="float64")
    kernels = {k["name"].split("_f64_")[1]: k for k in CudaPrinter(onf, "float64").kernels()
               if k["tiled"]}
    assert set(kernels) == {"U", "V", "F_partial"}
    assert kernels["U"]["block"] == (64, 2, 1)  # two warps along x, two along y
    # the operands' tiles (16 x (32 + 4), 16 x (64 + 4)) and the output's, 32 x (64 + 4),
    # in the instance copying by 128-bit loads (<1>) and the scalar one (<0>) alike
    launches = kernels["F_partial"]["launches"]
    assert [arguments for _, arguments, _ in launches] == ["<1>", "<0>"]
    assert {int(shared) for _, _, shared in launches} == {8 * (16 * (36 + 68) + 32 * 68)}


def _upto_staged(label="U", dtype="float64"):
    """The forward's ONF after its CUDA mapping up to (not including) `label`'s WarpMma."""
    from moagen.kernels import get_kernel
    steps = get_kernel(KERNEL).variant(VARIANT).steps(None, "cuda", dtype)
    upto = next(k for k, step in enumerate(steps)
                if isinstance(step, WarpMma) and step.nest == label)
    return onf_of(KERNEL, VARIANT, target="cuda", dtype=dtype, upto=upto)


@pytest.mark.parametrize("step, message", [
    (WarpMma("c", "f16", nest="U"), "the precision is one of"),
    (WarpMma("d", "f64", nest="U"), "0 loops over d inside fragment loops"),
    (WarpMma("e", "f64", nest="U"), "is a warp.s fragment loop, not a sum"),  # columns
    (WarpMma("c", "3xtf32", nest="U"), "fragments of 16 x 16"),  # the warps' are 8 x 8
])
def test_warp_mma_refuses_what_it_cannot_do(step, message):
    with pytest.raises(ScheduleError, match=message):
        step(_upto_staged())


def test_warp_mma_refuses_a_tile_whose_fragments_would_not_start_aligned():
    """X's tile with rows of 37 doubles: a fragment's first element 8 bytes off 32."""
    from dataclasses import replace
    from moagen.onf.loops import Buffer
    onf = _upto_staged()
    shared = tuple(Buffer(b.name, (16, 37)) if b.name == "U_X_tile" else b for b in onf.shared)
    with pytest.raises(ScheduleError, match="U_X_tile's rows, 37 elements apart, keep no 32-byte"):
        WarpMma("c", "f64", nest="U")(replace(onf, shared=shared))


def test_the_emulation_refuses_a_misaligned_fragment():
    """What a GPU requires of a WMMA load, the emulation checks: a fragment from one
    element past an aligned one fails the launch."""
    source = emit(KERNEL, VARIANT, "cuda-emulated", ("float64",))
    broken = source.replace("U_X_tile + (", "U_X_tile + (1 + ", 1)
    with pytest.raises(EmulationCheckError, match="not 32-byte aligned"):
        _errors(broken, "tensor_misaligned", "float64")


def test_warp_tiles_refuse_blocks_of_no_whole_fragments():
    with pytest.raises(ScheduleError, match="no whole fragments of 16 x 16"):
        onf_of(KERNEL, VARIANT, target="cuda", dtype="float32", params={"block_rows": 24})


SIZES = dict(batch=2, n=37, dm=19, dff=70)  # a partial row tile, chunk and column tile


def _errors(source, stem, dtype, params=None, kernel=KERNEL):
    """The emulated kernel's error (moagen.verify's: normwise, its worst output) against
    numpy in float64 on the same inputs, under the race check."""
    def load(kernel, variant, lang, dtype):
        request = resolve(kernel, variant, lang, dtype, params, here=False)
        return emulated.bind(build_cuda_emulated(source, stem, racecheck=True),
                             request.signature())

    row = check_case(kernel, VARIANT, "cuda-emulated", dtype, SIZES, load, seed=5)
    if row.status.startswith("FAIL: "):
        raise EmulationCheckError(row.status[len("FAIL: "):])
    return row.errors["numpy"]


@pytest.mark.parametrize("kernel", ["mlp_fwd", "mlp_bwd"])
def test_the_emulated_float64_gemms_match_numpy_and_pass_the_race_check(kernel):
    source = emit(kernel, VARIANT, "cuda-emulated", ("float64",))
    assert _errors(source, f"{kernel}_tensor_f64", "float64", kernel=kernel) < 1e-12


def test_out_proj_adds_the_residual_once_after_its_parts():
    """Y = R + the heads' sums, split-K over the heads: the block's copy out stores a
    part's total fragment alone, the merge adds R to the parts' sum."""
    onf = onf_of("out_proj", VARIANT, target="cuda", dtype="float64")
    [copy] = [s for s in _nest(onf, "Y.partial").body[0].body[0].body[0].body
              if isinstance(s, Loop) and not is_fragment_loop(s)]
    [store] = [s for s in walk((copy,)) if not isinstance(s, Loop)]
    assert store.array == "Y_part"
    assert {x.array for x in S.subexpressions(store.value) if isinstance(x, S.Load)} == \
        {"Y_partial_out_tile"}
    [merge] = [s for s in walk(_nest(onf, "Y").body) if isinstance(s, Store)]
    assert merge.array == "Y"
    assert {x.array for x in S.subexpressions(merge.value) if isinstance(x, S.Load)} == {"R"}


@pytest.mark.parametrize("kernel", ["mlp_fwd", "mlp_bwd"])
def test_float32_by_3xtf32_is_within_float32_s_tolerance_where_one_tf32_product_is_not(kernel):
    """3xTF32 (the default) within 2e-5 (moagen.verify's float32 tolerance); one TF32
    product (tf32=1, the opt-in) about 2^-11 off, past it: so the kernel does split its
    operands."""
    three = _errors(emit(kernel, VARIANT, "cuda-emulated", ("float32",)),
                    f"{kernel}_tensor_3xtf32", "float32", kernel=kernel)
    assert three < 2e-5
    one = _errors(emit(kernel, VARIANT, "cuda-emulated", ("float32",), params={"tf32": 1}),
                  f"{kernel}_tensor_tf32", "float32", params={"tf32": 1}, kernel=kernel)
    assert 5e-5 < one < 5e-3


def test_the_copy_out_waits_for_every_warp_s_fragments():
    """The barrier between the warps' stores of their fragments and the block's copy of the
    output tile: without it, the race check sees a thread read an element another wrote."""
    source = emit(KERNEL, VARIANT, "cuda-emulated", ("float64",))
    start = source.index("__global__ void mlp_fwd_tensor_f64_U(")
    end = source.index("\n}\n", start)
    barrier = "__syncthreads();  // U_out_tile copied after U_out_tile written"
    cut = source.index(barrier, start, end)
    broken = source[:cut] + source[cut + len("__syncthreads();"):]
    with pytest.raises(EmulationCheckError, match=r"race on shared `U_out_tile`"):
        _errors(broken, "tensor_race_without_copy_barrier", "float64")



@pytest.mark.skipif(not sass.tools_available(), reason="nvcc or cuobjdump absent")
@pytest.mark.parametrize("kernel, products", [("mlp_fwd", ("U", "V", "F.partial")),
                                               ("mlp_bwd", ("dH", "dX.partial", "dWg.partial",
                                                            "dWu.partial", "dWd.partial")),
                                               ("qkv_proj", ("Q.partial", "K.partial",
                                                             "V.partial")),
                                               ("out_proj", ("Y.partial",))])
@pytest.mark.parametrize("dtype, instruction", [("float64", "DMMA"), ("float32", "HMMA")])
def test_the_sass_sums_on_tensor_cores(kernel, products, dtype, instruction):
    """Each product's innermost loop (the sum) issues tensor-core instructions and no
    FMA, on sm_80 and sm_90."""
    reports = [r for r in sass.inspect(kernel, VARIANT, dtype) if r.nest in products]
    # sm_80 and sm_90, each product's instance copying by 128-bit loads and its scalar one
    assert len(reports) == 2 * 2 * len(products)
    for r in reports:
        hot = max(r.loops, key=lambda lp: lp.counts[instruction])
        assert hot.counts[instruction] >= 8 and hot.fma == 0, (r.arch, r.name)
        assert r.spill_stores == r.spill_loads == 0


@pytest.mark.skipif(not sass.tools_available(), reason="nvcc or cuobjdump absent")
def test_the_cost_bound_of_a_tensor_core_kernel_is_at_the_tensor_cores_peak(capsys):
    """moagen cost --cuda: a product on tensor cores bounded by their peak (the H200's
    FP64 tensor 67 TFLOP/s), not the SIMT pipe's 34."""
    import json
    from moagen.cli import main
    assert main(["cost", KERNEL, "--variant", VARIANT, "--cuda", "--json", "--dtype",
                 "float64"]) == 0
    [call] = json.loads(capsys.readouterr()[0])["gpu"]
    u = next(k for k in call["kernels"] if k["nest"] == "U")
    assert u["bound_by"] == "compute (f64)"
    assert u["bound_s"] == pytest.approx(u["flops"] / 67e12)


# ---- attention's scores on tensor cores (attention_fwd `tensor`) ----------------------
ATTENTION_SIZES = dict(batch=1, heads=2, n=70, d=13)  # a partial query and key block, d odd


def _attention_errors(dtype, params=None, stem=None, source=None):
    """The emulated attention_fwd tensor's error against numpy under the race check."""
    source = source or emit("attention_fwd", VARIANT, "cuda-emulated", (dtype,), params=params)

    def load(kernel, variant, lang, dtype):
        request = resolve(kernel, variant, lang, dtype, params, here=False)
        return emulated.bind(build_cuda_emulated(source, stem or f"attention_tensor_{dtype}",
                                                 racecheck=True), request.signature())

    row = check_case("attention_fwd", VARIANT, "cuda-emulated", dtype, ATTENTION_SIZES, load,
                     seed=3)
    if row.status.startswith("FAIL: "):
        raise EmulationCheckError(row.status[len("FAIL: "):])
    return row.errors["numpy"]


@pytest.mark.parametrize("dtype, precision, shape, rows, ldq", [
    ("float64", "f64", (8, 8, 4), 8, 36), ("float32", "3xtf32", (16, 16, 8), 16, 68)])
def test_attention_s_two_products_are_the_warps_fragments_and_the_softmax_the_threads(
        dtype, precision, shape, rows, ldq):
    """S = Q K^T and a key block's P V each a phase of its own (ThreadPhases, WarpTiles):
    4 x 1 warps, each its block's rows x the key block (S) or 64 of O's columns a tile (P
    V, as many tiles as d's bound needs) as fragments from the staged tiles and the
    probabilities; the softmax and O's rescale and addition by the same 128 threads, 4
    along the rows and 32 lanes along the keys or columns."""
    onf = onf_of("attention_fwd", VARIANT, target="cuda", dtype=dtype)
    loops = [s for s in walk(_nest(onf, "rows").body) if isinstance(s, Loop)]
    assert {(lp.gpu.axis, lp.var.name, lp.gpu.threads, lp.gpu.tile, lp.gpu.fragment)
            for lp in loops if is_fragment_loop(lp)} == \
        {("y", "i", 4, rows, shape[0]), ("x", "j", 1, 64, shape[1]),
         ("x", "c", 1, 64, shape[1])}
    scores, pv = [(lp.var.name, lp.gpu) for lp in loops if isinstance(lp.gpu, Mma)]
    assert scores == ("c", Mma(shape, ((Operand("rows_Q_tile", "col", ldq),
                                        Operand("rows_K_tile", "row", 68)),),
                               Operand("rows_out_tile", "row", 68), precision))
    name, mark = pv
    (a, b), = mark.terms
    assert (name, a, b.array, b.major, str(b.ldm), mark.c.array, str(mark.c.ldm)) == \
        ("j", Operand("probs", "col", ldq), "rows_V_tile", "row", "MAX_d + 4",
         "block_out", "MAX_d + 4")
    from moagen.targets.cuda.printer import CudaPrinter
    [kernel] = [k for k in CudaPrinter(onf, dtype).kernels() if k["tiled"]]
    assert kernel["block"] == (32, 4, 1)


def test_attention_s_block_products_sum_a_key_block_apart_then_add_it_to_the_rescaled_o():
    """BlockProducts: O = O * rescale, then O += p V a key, become a block's sum of
    products into block_out, then O = O * rescale + block_out."""
    from moagen.onf.loops import Store as St
    onf = onf_of("attention_fwd", VARIANT, target="cuda", dtype="float64")
    stores = [s for s in walk(_nest(onf, "rows").body) if not isinstance(s, Loop)]
    assert any(isinstance(s, St) and s.array == "block_out" for s in stores)
    [added] = [s for s in stores if getattr(s, "name", None) == "O_reg"
               and isinstance(s.value, S.Bin) and s.value.op == "+"]
    assert {x.array for x in S.subexpressions(added.value) if isinstance(x, S.Load)} == \
        {"block_out"}


def test_attention_s_tensor_sum_over_d_needs_its_tiles_zero_to_whole_steps():
    """d is no constant: WarpMma takes the sum over it only where Q's and K's copies run
    on to whole steps of k, zero past d (Stage's steps); without them it refuses."""
    from dataclasses import replace as copy_of
    from moagen.kernels import get_kernel
    from moagen.steps.gpu.staging import Stage
    steps = get_kernel("attention_fwd").variant(VARIANT).steps(None, "cuda", "float64")
    first = next(k for k, s in enumerate(steps) if isinstance(s, Stage))
    last = next(k for k, s in enumerate(steps) if isinstance(s, WarpMma))
    onf = onf_of("attention_fwd", VARIANT, target="cuda", dtype="float64", upto=first)
    for step in steps[first:last]:
        onf = (copy_of(step, steps=0) if isinstance(step, Stage) else step)(onf)
    with pytest.raises(ScheduleError, match="not whole steps of 4"):
        steps[last](onf)
    onf = onf_of("attention_fwd", VARIANT, target="cuda", dtype="float64", upto=last + 1)
    assert any(isinstance(lp.gpu, Mma) for lp in walk(_nest(onf, "rows").body)
               if isinstance(lp, Loop))


def test_attention_float64_scores_on_dmma_match_numpy_and_pass_the_race_check():
    assert _attention_errors("float64") < 1e-12


def test_attention_float32_by_3xtf32_is_within_tolerance_where_one_tf32_product_is_not():
    assert _attention_errors("float32") < 2e-5
    one = _attention_errors("float32", params={"tf32": 1}, stem="attention_tensor_tf32")
    assert 5e-5 < one < 5e-3


def test_attention_s_copy_of_the_scores_waits_for_every_warp_s_fragments():
    source = emit("attention_fwd", VARIANT, "cuda-emulated", ("float64",))
    barrier = "__syncthreads();  // rows_out_tile copied after rows_out_tile written"
    assert source.count(barrier) == 1
    broken = source.replace(barrier, "//", 1)
    # it orders the scores' copy after the fragments' stores, and after the warps' reads of
    # K's tile, whose memory the scores take: the race check finds the first it meets
    with pytest.raises(EmulationCheckError,
                       match=r"race on shared `(rows_out_tile|rows_K_tile|probs)`"):
        _attention_errors("float64", stem="attention_tensor_race", source=broken)


@pytest.mark.skipif(not sass.tools_available(), reason="nvcc or cuobjdump absent")
@pytest.mark.parametrize("kernel", ["attention_fwd", "attention_gqa_fwd",
                                    "attention_fwd_causal", "attention_gqa_fwd_causal"])
@pytest.mark.parametrize("dtype, instruction", [("float64", "DMMA"), ("float32", "HMMA")])
def test_attention_s_two_products_loops_are_on_tensor_cores(kernel, dtype, instruction):
    """Both products' loops (S's sum over d, P V's over a key block) issue DMMA / HMMA,
    and no innermost loop of the kernel an FMA (every compiled head-dim bound, sm_80 and
    sm_90), no spills."""
    reports = sass.inspect(kernel, VARIANT, dtype)
    assert len(reports) == 4  # d <= 64, d <= 128; sm_80, sm_90
    for r in reports:
        # each product's loop (the causal kernels: in each of their two key-block loops)
        on_tensor_cores = [lp for lp in r.loops if lp.counts[instruction] >= 4]
        assert len(on_tensor_cores) >= (4 if "causal" in kernel else 2), (r.arch, r.name)
        assert all(lp.fma == 0 for lp in r.loops), (r.arch, r.name)
        assert r.spill_stores == r.spill_loads == 0


def test_attention_s_scores_copy_zeroes_the_keys_past_n_that_p_v_sums_over():
    """WarpMma's `whole` on the scores: their copy writes the whole 32 x 64 block (zero
    past n, as K's tile is), since P V sums the last key block on to whole steps of k. (Copied only up to n,
    the probabilities past n would be whatever shared memory held: in the emulation K's
    stale, finite values, which V's zero rows cancel, so only the copy's range shows it.)
    P V's output, the block's own shared scratch, is stored into from the fragments."""
    onf = onf_of("attention_fwd", VARIANT, target="cuda", dtype="float64")
    copies = {}
    for lp in walk(_nest(onf, "rows").body):
        if isinstance(lp, Loop) and lp.gpu is not None and str(lp.gpu).startswith("block-copy.y"):
            [store] = [x for x in walk(lp.body) if not isinstance(x, Loop)]
            inner = lp.body[0]
            copies[store.array] = (str(lp.stop), str(inner.stop))
    assert copies["probs"] == ("32", "64")
    # P V's accumulators go straight into block_out (the block's shared scratch): no copy
    assert "block_out" not in copies and {b.name for b in onf.shared} >= {"block_out"}
    assert not any(b.name.endswith("pv_tile") for b in onf.shared)
