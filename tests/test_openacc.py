"""OpenACC C and OpenACC Fortran: printed from the GPU mapping of the same ONF as the other
targets, built with gcc's nvptx offloading, verified here through OpenACC's host fallback;
the device code gcc makes read back as PTX, ptxas' report and SASS."""
import json
import shutil
import subprocess
from dataclasses import replace

import pytest

from moagen import verify
from moagen.bench import c_vs_fortran_plan, offload, sweep
from moagen.targets.openacc.build import embedded_ptx
from moagen.cli import main
from moagen.emit import emit
from moagen.targets.openacc.printer import OpenAccC, OpenAccFortran
from moagen.errors import DeviceUnavailable, ScheduleError
from moagen.kernels import get_kernel
from moagen.kernels.layers import format_layers
from moagen.moa import scalar as S
from moagen.onf.loops import Let
from moagen.pipeline import onf_of
from moagen.steps.loop.parallel import GpuThreads
from moagen.targets import LANGS, get_target
from moagen.targets.openacc.target import devices


def _offload_compiler():
    """Whether gcc makes nvptx offload code here (tools/system-packages.sh installs gcc-12-offload-nvptx)."""
    if shutil.which("gcc") is None:
        return False
    probe = subprocess.run(["gcc", "-print-file-name=accel/nvptx-none/mkoffload"],
                           capture_output=True, text=True).stdout.strip()
    return probe.startswith("/")


needs_offload = pytest.mark.skipif(not _offload_compiler(),
                                   reason="no nvptx offload compiler: apt-get install "
                                          "gcc-12-offload-nvptx")
needs_ptxas = pytest.mark.skipif(shutil.which("ptxas") is None, reason="no ptxas (CUDA toolkit)")


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
            "        create(dweight_part[0:528*d])") in source  # CUDA's parts
    onf = onf_of("rmsnorm_bwd", "dnf", target="openacc")
    assert [n.label for n in onf.nests] == ["dweight.partial", "dweight"]
    # the parts in parallel, a vector lane each; the sum over the parts a lane a feature
    assert ("#pragma acc parallel loop gang vector collapse(1) vector_length(128) "
            "present(dweight_part, dz, weight, x, inv_rms, dx)") in source
    assert ("#pragma acc parallel loop gang vector collapse(1) vector_length(32) "
            "present(dweight_part, dweight)") in source
    # a nest with no parallel loop: a serial region (naive's merge of its 16 parts)
    assert "#pragma acc serial present(dweight_part, dweight)" in emit(
        "rmsnorm_bwd", "naive", "openacc-c", ("float64",))
    assert "double *restrict x" in source
    assert "*restrict" not in emit("rmsnorm_bwd", "dnf", "openacc-c-norestrict")


def test_fortran_prints_the_same_regions_with_its_private_scalars():
    source = emit("rmsnorm_bwd", "dnf", "openacc-fortran", ("float64",))
    assert "!$omp" not in source
    assert "!$acc data copyin(x, weight, inv_rms, dz) copyout(dx, dweight) create(dweight_part)" \
        in source
    assert ("!$acc parallel loop gang vector collapse(1) vector_length(128) present(dweight_part, "
            "dz, &\n      !$acc& weight, x, inv_rms, dx) private( &\n      !$acc&   c, &\n"
            "      !$acc&   b, &") in source
    for end in ("!$acc end parallel loop", "!$acc end data"):
        assert end in source
    naive = emit("rmsnorm_bwd", "naive", "openacc-fortran", ("float64",))
    for end in ("!$acc serial present(dweight_part, dweight)", "!$acc end serial"):
        assert end in naive


def test_atomic_sums_are_openacc_atomics_in_both_languages():
    assert "#pragma acc atomic update\n" in emit("attention_bwd", "atomic", "openacc-c")
    assert "!$acc atomic update\n" in emit("attention_bwd", "atomic", "openacc-fortran")


@needs_offload
@pytest.mark.parametrize("kernel, variant", [("rmsnorm_bwd", "dnf"), ("attention_bwd", "atomic")])
def test_both_languages_match_the_references_on_the_host_fallback(kernel, variant):
    rows = list(verify.run([kernel], ("openacc-c", "openacc-fortran"), [variant]))
    assert len(rows) == 2 * 2 * len(get_kernel(kernel).check.sizes)
    assert all(r.status == "pass" for r in rows), "\n".join(map(verify.format_row, rows))


def test_ptx_memory_counts_by_state_space_and_type():
    ptx = "\n".join(["ld.param.u64 %ar0,[%in_ar0];", "ld.u64 %r1,[%ar0+8];",
                     "ld.f64 %r2,[%r1];", "@ ! %r9 ld.global.nc.f32 %r3,[%r1];",
                     "ld.global.v2.f64 {%r4,%r5},[%r1];", "st.f64 [%r1],%r2;",
                     "st.u64 [%r6],%r1;", "st.shared.u64 [%r7],%r1;", "ld.local.f64 %r8,[%r7];"])
    assert offload.ptx_memory(ptx) == dict(ld=3, ld_nc=1, st=1, ld_int=1, st_int=1, local=1)
    sass = "LD.E.64 R2, [R4.64] ;\nLDG.E.CONSTANT R6, [R2.64] ;\nSTG.E [R2.64], R6 ;\nLDS R1, [R0] ;"
    assert offload.sass_memory(sass) == dict(sass_ld=2, sass_ld_constant=1, sass_st=1)


def test_the_embedded_ptx_is_the_modules_with_entry_points():
    text = ('static const char ptx_code_0[] =\n\t"// BEGIN PREAMBLE\\n"\n\t".entry k (.param .u64 %in_ar0);\\n"\n;\n'
            'static const char ptx_code_1[] =\n\t".func exp;\\n"\n;\n')
    assert embedded_ptx(text) == "// BEGIN PREAMBLE\n.entry k (.param .u64 %in_ar0);\n"


@needs_offload
@needs_ptxas
def test_the_ptx_table_compares_the_three_per_kernel(tmp_path, capsys):
    out = tmp_path / "ptx.jsonl"
    assert main(["bench", "c-vs-fortran", "--target", "openacc", "--ptx", "--kernels",
                 "rmsnorm_fwd:naive", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rmsnorm_fwd:naive" in text and "Fortran" in text and "C norestrict" in text
    assert "restrict changes the PTX of" in text
    assert (tmp_path / "ptx.png").stat().st_size > 0
    records = [r for r in map(json.loads, out.read_text().splitlines())
               if r["record"] == "ptx"]
    assert [r["lang"] for r in records] == list(offload.LANGS)
    for r in records:  # two nests, each a region that loads x and stores what it writes
        assert r["regions"] == 2 and r["ld"] > 0 and r["st"] > 0 and r["registers"] > 0
        assert r["sass_ld"] > 0


def test_ptx_needs_the_openacc_target(capsys):
    assert main(["bench", "c-vs-fortran", "--ptx", "--kernels", "rmsnorm_fwd:naive"]) == 2
    assert "give --target openacc" in capsys.readouterr().err


@pytest.mark.skipif(devices() > 0, reason="an OpenACC device is here")
def test_timing_without_a_gpu_is_refused(tmp_path):
    args = type("Args", (), dict(ptx=False, kernels=["rmsnorm_fwd:naive"], n=None, repeats=1,
                                 out=tmp_path / "t.jsonl"))
    with pytest.raises(DeviceUnavailable, match="no OpenACC device"):
        offload.main(args)
    assert not (tmp_path / "t.jsonl").exists()  # refused before anything ran


def test_the_times_table_gives_the_papers_ratios():
    base = dict(record="result", kernel="mlp_bwd", variant="tiled", sizes=dict(n=256))
    times = {"openacc-c": 0.004, "openacc-c-norestrict": 0.004, "openacc-fortran": 0.002,
             "cuda": 0.001}
    records = [dict(base, lang=lang, median_s=s) for lang, s in times.items()]
    records.append(dict(base, lang="torch", median_s=1.0))  # a baseline: not a column
    line = offload.format_times(records).splitlines()[1].split()
    assert line[:3] == ["mlp_bwd", "tiled", "256"]
    assert line[3:] == ["4.000", "4.000", "2.000", "1.000", "0.50", "1.00", "4.00"]


@needs_offload
def test_the_bench_workers_run_the_three_as_the_gpu_timing_will(tmp_path):
    """The sweep the GPU timing runs, here through the host fallback (CUDA left out): each
    OpenACC language loads and runs in the bench's workers."""
    results = sweep.Results(tmp_path / "t.jsonl", ["test"])
    records = sweep.run(c_vs_fortran_plan.plan([("rmsnorm_fwd", "naive")], 64, 1, offload.LANGS), results)
    timed = {r["lang"]: r["median_s"] for r in records if r["record"] == "result"}
    assert set(offload.LANGS) <= set(timed) and all(timed[lang] > 0 for lang in offload.LANGS)


def test_a_nest_openacc_cannot_place_is_refused_by_name():
    onf = onf_of("rmsnorm_fwd", "naive", target="openacc")
    nest = onf.nests[0]
    (chain,) = nest.body
    inner = replace(chain.body[0], parallel=0)  # the chain's second loop, alone
    beside = replace(nest, body=(chain, Let("t", S.Num(1.0))))
    inside = replace(nest, body=(replace(chain, parallel=0, body=(replace(inner, parallel=1),)),))
    for bad, why in ((beside, "runs statements next to its parallel loops"),
                     (inside, "runs parallel loops inside sequential ones")):
        for printer in (OpenAccC, OpenAccFortran):
            with pytest.raises(ScheduleError, match=f"nest {nest.label} {why}"):
                printer(replace(onf, nests=(bad,)), "float64").nest_block(bad, 1)
