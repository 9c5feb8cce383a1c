"""The variant a target kind runs where none is named (Kernel.default_variant): the CUDA
GEMMs' and attention forwards' tensor cores, chosen by the metrics
(moagen.kernels.gemm.TENSOR_CORES); every other kernel and kind its first variant."""
import importlib
import types

import pytest

import moagen
from moagen.cli import main
from moagen.commands.common import GENERATED
from moagen.errors import SpecError, UnknownNameError
from moagen.kernels import KERNELS, _kernel, get_kernel, stage_variant
from moagen.kernels.tunable import Tunable
from moagen.onf.signature import DTYPES
from moagen.pipeline import onf_of
from moagen.request import resolve

GEMMS = ("mlp_fwd", "mlp_bwd", "qkv_proj", "out_proj")
ATTENTION = ("attention_fwd", "attention_fwd_causal", "attention_gqa_fwd",
             "attention_gqa_fwd_causal")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", GEMMS + ATTENTION)
def test_cuda_runs_the_tensor_cores_where_no_variant_is_named(kernel, dtype):
    assert resolve(kernel, None, "cuda", dtype).variant == "tensor"
    assert onf_of(kernel, target="cuda", dtype=dtype).variant == "tensor"
    first = next(iter(get_kernel(kernel).variants))
    assert resolve(kernel, None, "c", dtype).variant == first != "tensor"
    assert resolve(kernel, first, "cuda", dtype).variant == first  # named: as named


def test_every_other_kernel_runs_its_first_variant_everywhere():
    for kernel in set(KERNELS) - set(GEMMS + ATTENTION):
        first = next(iter(KERNELS[kernel].variants))
        assert {KERNELS[kernel].default_variant(kind, dtype) for kind in ("cpu", "cuda")
                for dtype in DTYPES} == {first}, kernel


def test_list_shows_what_cuda_runs(capsys):
    assert main(["list"]) == 0
    lines = {line.split(":")[0].split(" ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert all(lines[k].endswith("; on cuda: tensor") for k in GEMMS + ATTENTION)
    assert all(", tensor (cuda only) " in lines[k] for k in GEMMS + ATTENTION)
    assert "; on cuda" not in lines["attention_bwd"]


@pytest.mark.parametrize("lang", ("c", "fortran", "openacc-c"))
def test_the_tensor_variants_are_refused_off_cuda(lang, capsys):
    """Tensor cores are CUDA's: elsewhere a clear error naming the variants that run
    there, from resolve (so moagen.load and emit) and the command line; none is emitted to
    generated/ but its CUDA; OpenACC, which takes CUDA's defaults, runs its first variant
    where none is named."""
    kind = "cpu" if lang in ("c", "fortran") else "openacc"
    refused = (f"attention_fwd tensor runs on cuda only, not on target kind {kind}; its "
               "variants on it: naive, dnf, online, flash")
    with pytest.raises(UnknownNameError, match=refused):
        resolve("attention_fwd", "tensor", lang)
    with pytest.raises(UnknownNameError, match=refused):
        moagen.load("attention_fwd", "tensor", lang)
    assert main(["emit", "attention_fwd", "--variant", "tensor", "--lang", lang]) == 2
    assert refused in capsys.readouterr().err
    for kernel in GEMMS + ATTENTION:
        assert "tensor" not in get_kernel(kernel).variants_on(kind)
        assert get_kernel(kernel).default_variant(kind) != "tensor"
        assert [p.name for p in GENERATED.glob(f"{kernel}_tensor.*")] == [f"{kernel}_tensor.cu"]


def test_a_default_that_is_no_variant_is_refused():
    spec, variants = KERNELS["rmsnorm_apply"].spec, KERNELS["rmsnorm_apply"].variants
    module = types.SimpleNamespace(
        __name__="moagen.kernels.new", CHECKS={spec.name: None}, BENCH={spec.name: None},
        DEVICE_DEFAULTS={spec.name: {"cuda": {"float64": "tensor"}}})
    with pytest.raises(SpecError, match="DEVICE_DEFAULTS.*names tensor, not a dtype and a "
                                        "variant of rmsnorm_apply"):
        _kernel(module, spec, variants)


def test_a_variant_of_an_unknown_kind_is_refused():
    with pytest.raises(UnknownNameError, match="unknown target kind 'tpu'"):
        Tunable(frozenset(), lambda: None, {}, {}, kinds=("tpu",))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_block_runs_its_gemm_stages_as_the_target_does(dtype):
    """The block's stages on CUDA run their kernels' CUDA defaults (tensor cores for the
    GEMMs; verified with the rest of the block: moagen verify block_fwd --lang cuda
    --emulate); on a CPU and OpenACC (CUDA's defaults, no tensor cores) the variants the
    composite names."""
    on_cuda = set(onf_of("block_fwd", target="cuda", dtype=dtype).schedule)
    assert {"qkv = qkv_proj tensor", "attn = attention_fwd tensor", "out = out_proj tensor",
            "mlp = mlp_fwd tensor"} <= on_cuda
    assert "mlp = mlp_bwd tensor" in onf_of("block_bwd", target="cuda", dtype=dtype).schedule
    on_cpu = set(onf_of("block_fwd", dtype=dtype).schedule)
    assert {"qkv = qkv_proj tiled", "attn = attention_fwd flash", "out = out_proj tiled",
            "mlp = mlp_fwd tiled"} <= on_cpu
    for stage in get_kernel("block_fwd").composite.stages:
        assert stage_variant(stage, "openacc", dtype) == stage.variant


@pytest.mark.parametrize("dtype", ("float64", "float32"))
def test_moagen_torch_runs_cudas_default_on_cuda_tensors(dtype):
    """moagen.torch's attention takes the kernel's default where the tensors are: on CUDA
    tensors the forward on tensor cores, the backward (no tensor variant) flash; on a CPU
    flash. A stand-in for a CUDA tensor (no GPU here): _kernel reads its shape, dtype and
    device flags only."""
    import torch
    chosen = importlib.import_module("moagen.torch_ops.attention")._kernel
    like = lambda cuda: types.SimpleNamespace(shape=(1, 4, 7, 5), dtype=getattr(torch, dtype),
                                              is_cuda=cuda, is_cpu=not cuda)
    for causal in (False, True):
        assert chosen("fwd", like(True), like(True), None, causal, 0, -1, "c")[:2] == \
            (("attention_gqa_fwd_causal" if causal else "attention_gqa_fwd"), "tensor")
        assert chosen("bwd", like(True), like(True), None, causal, 0, -1, "c")[1] == "flash"
        assert chosen("fwd", like(False), like(False), None, causal, 0, -1, "c")[1] == "flash"
