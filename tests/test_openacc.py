"""OpenACC C and OpenACC Fortran: printed from the GPU mapping of the same ONF as the other
targets, built with gcc's nvptx offloading, verified here through OpenACC's host fallback."""
import shutil
import subprocess

import pytest

from moagen import verify
from moagen.codegen.emit import emit
from moagen.kernels import get_kernel
from moagen.kernels.layers import format_layers
from moagen.onf.schedule import GpuThreads
from moagen.pipeline import onf_of
from moagen.targets import LANGS, get_target


def _offload_compiler():
    """Whether gcc makes nvptx offload code here (.ci/run installs gcc-12-offload-nvptx)."""
    if shutil.which("gcc") is None:
        return False
    probe = subprocess.run(["gcc", "-print-file-name=accel/nvptx-none/mkoffload"],
                           capture_output=True, text=True).stdout.strip()
    return probe.startswith("/")


needs_offload = pytest.mark.skipif(not _offload_compiler(),
                                   reason="no nvptx offload compiler: apt-get install "
                                          "gcc-12-offload-nvptx")


def test_the_openacc_targets_are_variants_of_c_and_fortran_on_the_gpu_mapping():
    assert LANGS == ("c", "fortran", "cuda")  # not in generated/, not verified by default
    for lang, of in (("openacc-c", "c"), ("openacc-c-norestrict", "c"),
                     ("openacc-fortran", "fortran")):
        target = get_target(lang)
        assert (target.variant_of, target.kind) == (of, "openacc")
        assert target.bind is get_target(of).bind and target.load is get_target(of).load
    variant = get_kernel("attention_fwd").variant("online")
    assert variant.defaults_for("openacc") == variant.defaults_for("cuda")
    mapping = variant.layers(target="openacc").mapping_for("openacc")
    assert [type(s) for s in mapping] == [GpuThreads]  # derived from the CPU's Parallel
    assert "gpu_threads(b, h, i_tile, 128 a block, nest=rows)" in format_layers(
        variant.layers(target="openacc"), "openacc", {})


def test_c_prints_a_data_region_and_a_compute_construct_per_nest():
    source = emit("rmsnorm_bwd", "dnf", "openacc-c", ("float64",))
    assert "#pragma omp" not in source
    assert ("#pragma acc data copyin(x[0:batch*n*d], weight[0:d], inv_rms[0:batch*n], "
            "dz[0:batch*n*d]) \\\n        copyout(dx[0:batch*n*d], dweight[0:d]) \\\n"
            "        create(dweight_part[0:16*d])") in source
    onf = onf_of("rmsnorm_bwd", "dnf", target="openacc")
    assert [n.label for n in onf.nests] == ["dweight.partial", "dweight"]
    # the parts in parallel, a vector lane each; the sum over the parts in a serial region
    assert ("#pragma acc parallel loop gang vector collapse(1) vector_length(128) "
            "present(dweight_part, dz, weight, x, inv_rms, dx)") in source
    assert "#pragma acc serial present(dweight_part, dweight)" in source
    assert "double *restrict x" in source
    assert "*restrict" not in emit("rmsnorm_bwd", "dnf", "openacc-c-norestrict")


def test_fortran_prints_the_same_regions_with_its_private_scalars():
    source = emit("rmsnorm_bwd", "dnf", "openacc-fortran", ("float64",))
    assert "!$omp" not in source
    assert "!$acc data copyin(x, weight, inv_rms, dz) copyout(dx, dweight) create(dweight_part)" \
        in source
    assert ("!$acc parallel loop gang vector collapse(1) vector_length(128) present(dweight_part, "
            "dz, &\n      !$acc& weight, x, inv_rms, dx) private(c, b, i, dot, t2, t)") in source
    for end in ("!$acc end parallel loop", "!$acc serial present(dweight_part, dweight)",
                "!$acc end serial", "!$acc end data"):
        assert end in source


def test_atomic_sums_are_openacc_atomics_in_both_languages():
    assert "#pragma acc atomic update\n" in emit("attention_bwd", "atomic", "openacc-c")
    assert "!$acc atomic update\n" in emit("attention_bwd", "atomic", "openacc-fortran")


@needs_offload
@pytest.mark.parametrize("kernel, variant", [("rmsnorm_bwd", "dnf"), ("attention_bwd", "atomic")])
def test_both_languages_match_the_references_on_the_host_fallback(kernel, variant):
    rows = list(verify.run([kernel], ("openacc-c", "openacc-fortran"), [variant]))
    assert len(rows) == 2 * 2 * len(get_kernel(kernel).check.sizes)
    assert all(r.status == "pass" for r in rows), "\n".join(map(verify.format_row, rows))
