"""Every kernel, variant, language and dtype agrees with numpy and PyTorch on odd sizes:
float64 to 1e-12 relative, float32 to the bound stated in moagen.verify.

At generated/'s parameters, the same on every machine (both dtypes one library). What this
machine loads over them (its AVX-512 tiles) is verified by tests/test_avx512_defaults.py for
the tiled and flash forms, by the moagen.torch tests at the tiles moagen.torch fits, and in
full by `make verify`. Built at the AVX-512 tiles, four kernels' C and Fortran took 4x the
compilers' time of generated/'s (docs/journal/2026-12-07-suite-verify-tiles.md)."""
import types

import numpy as np
import pytest

from moagen import runtime, verify
from moagen.targets.cuda import loader as cuda
from moagen.errors import SpecError
from moagen.kernels import KERNELS, MODULES, _kernel
from moagen.onf.signature import DTYPES
from moagen.pipeline import onf_of
from moagen.targets import of_kind

CASES = [(k.name, v, lang, dtype, sizes)
         for k in KERNELS.values() for v in k.variants_on("cpu") for lang in of_kind("cpu")
         for dtype in DTYPES for sizes in k.check.sizes]


def _id(case):
    kernel, variant, lang, dtype, sizes = case
    return f"{kernel}-{variant}-{lang}-{dtype}-" + "-".join(map(str, sizes.values()))


def as_generated(kernel, variant, lang, dtype):
    return runtime.load(kernel, variant, lang, dtype, params={})


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kernel_matches_references(case):
    row = verify.check_case(*case, load=as_generated)
    assert row.status == "pass", verify.format_row(row)
    assert set(row.errors) == {"numpy", "torch"}
    assert max(row.errors.values()) <= verify.TOLERANCE[case[3]]


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=lambda k: k.name)
def test_every_kernel_declares_its_check_and_bench_sizes(kernel):
    """Each kernel's module says what it is verified and measured on, with every size the
    kernel takes."""
    takes = {s.name for s in onf_of(kernel.name).sizes} | set(kernel.given)
    assert set(kernel.check.references) == {"numpy", "torch"}
    assert kernel.check.sizes and all(takes <= set(sizes) for sizes in kernel.check.sizes)
    assert takes <= set(kernel.bench.sizes(7)) and kernel.bench.sizes(7)["n"] == 7
    assert kernel.bench.lengths(quick=True) and kernel.bench.lengths(quick=False)


def test_every_declaration_is_of_a_kernel_its_module_lists():
    for module in MODULES:
        listed = {entry[0].name for entry in module.KERNELS}
        assert set(module.CHECKS) == set(module.BENCH) == listed, module.__name__


def test_a_kernel_without_declarations_is_refused():
    module = types.SimpleNamespace(__name__="moagen.kernels.new", CHECKS={}, BENCH={})
    spec = KERNELS["rmsnorm_apply"].spec
    with pytest.raises(SpecError, match="moagen.kernels.new lists kernel rmsnorm_apply but has "
                                        "no CHECKS entry"):
        _kernel(module, spec, {})


@pytest.mark.parametrize("kernel, sizes, wrong", [
    ("attention_fwd", dict(batch=1, heads=1, n=5, d=3), "O"),
    ("attention_fwd", dict(batch=1, heads=1, n=5, d=3), "lse"),  # not only the first output
    ("rmsnorm_fwd", dict(batch=1, n=5, d=3), "z"),  # a kernel returning one array, not a tuple
])
def test_a_wrong_kernel_fails_verification(kernel, sizes, wrong):
    """The check can fail: one output off by a relative 1e-9 is far outside float64's bound."""
    def perturbed(*args, **kwargs):
        fn = runtime.load(*args, **kwargs)
        names = [p.name for p in fn.signature.outputs]

        def call(*a, **k):
            outputs = fn(*a, **k)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            outputs = tuple(o * (1 + 1e-9) if name == wrong else o
                            for name, o in zip(names, outputs))
            return outputs if len(outputs) > 1 else outputs[0]
        return call

    row = verify.check_case(kernel, "dnf", "c", "float64", sizes, load=perturbed)
    assert row.status == "FAIL" and row.failed


def test_cuda_kernels_run_where_a_gpu_is():
    if not cuda.available():
        pytest.skip("no cuda-python or no GPU here: CUDA kernels are compiled (test_codegen), not run")
    rows = list(verify.run(langs=("cuda",)))
    assert rows and all(r.status == "pass" for r in rows), [verify.format_row(r) for r in rows]


def test_loaded_kernel_refuses_bad_calls_before_native_code():
    attention = runtime.load("attention_fwd", "dnf", "c", "float64")
    Q = np.zeros((1, 2, 5, 3))
    with pytest.raises(ValueError, match=r"argument 'K'.*\(batch, heads, n, d\)"):
        attention(Q, np.zeros((1, 2, 4, 3)), Q, scale=0.5)
    with pytest.raises(ValueError, match="dtype float64, got float32"):
        attention(Q, Q.astype(np.float32), Q, scale=0.5)
    with pytest.raises(ValueError, match="C-contiguous"):
        attention(Q, np.asfortranarray(Q), Q, scale=0.5)
    with pytest.raises(ValueError, match="missing argument"):
        attention(Q, Q, Q)
