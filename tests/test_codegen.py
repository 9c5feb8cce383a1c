"""The emitted sources: committed copies current, CUDA compiling for the GPUs we target,
and the properties a reader relies on visible in the text."""
import re

import pytest

from moagen import build
from moagen.codegen.emit import emit, filename, stem
from moagen.pipeline import onf_of
from moagen.codegen.fortran import FortranPrinter
from moagen.build import CUDA_ARCHS
from moagen.cli import GENERATED
from moagen.errors import SpecError, UnknownNameError
from moagen.kernels import KERNELS
from moagen.moa.dnf import psi_reduce
from moagen.moa.expr import array, inner, transpose
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.loops import format_onf
from moagen.onf.realize import realize
from moagen.targets import LANGS

VARIANTS = [(k.name, v) for k in KERNELS.values() for v in k.variants]


@pytest.mark.parametrize("kernel,variant", VARIANTS)
@pytest.mark.parametrize("lang", LANGS)
def test_generated_sources_match_the_generator(kernel, variant, lang):
    committed = GENERATED / filename(kernel, variant, lang)
    assert committed.is_file(), f"{committed} is missing: run `make generated`"
    assert committed.read_text() == emit(kernel, variant, lang), \
        f"{committed} differs from what the generator emits: run `make generated` and commit"


@pytest.mark.parametrize("kernel,variant", VARIANTS)
@pytest.mark.parametrize("arch", CUDA_ARCHS)
def test_cuda_compiles(kernel, variant, arch, tmp_path, monkeypatch):
    monkeypatch.setenv("MOAGEN_BUILD_DIR", str(tmp_path))
    source = emit(kernel, variant, "cuda")
    result = build.compile_cuda(source, stem(kernel, variant), arch)
    assert result.cubin.stat().st_size > 0
    # ptxas compiled every __global__ kernel (one per nest and dtype), without spills
    compiled = re.findall(r"Compiling entry function '(\w+)'", result.ptxas_report)
    assert len(compiled) == source.count("__global__ void") > 0
    spills = re.findall(r"(\d+) bytes spill", result.ptxas_report)
    assert spills and set(spills) == {"0"}


def test_memory_optimal_sources_name_no_temporary():
    naive = emit("attention_fwd", "naive", "c")
    dnf = emit("attention_fwd", "dnf", "c")
    assert "*restrict scores" in naive and "*restrict probs" in naive
    assert "scores" not in dnf.split("*/", 2)[-1] and "probs" not in dnf


def test_each_nest_carries_its_dnf_line_and_parallel_loop():
    for lang, pragma in (("c", "#pragma omp parallel for collapse(3)"),
                         ("fortran", "!$omp parallel do collapse(3)")):
        text = emit("attention_fwd", "dnf", lang)
        assert text.count(pragma) == 2  # one per dtype
        assert "O[b, h, i, c] = sum[j < n](" in text


def test_interleaved_parallel_loops_deal_iterations_in_turn():
    """Online attention's row groups go to the threads one at a time (they share a head's
    keys in cache), its edge nest as its parent (the mapping it inherits); other kernels
    keep a block per thread."""
    for lang, pragma in (("c", "#pragma omp parallel for collapse(3) schedule("),
                         ("fortran", "!$omp parallel do collapse(3) schedule(")):
        text = emit("attention_fwd", "online", lang)
        schedules = re.findall(re.escape(pragma) + r"([^)]*)\)", text)
        assert schedules == ["static, 1", "static, 1"] * 2  # rows, rows.edge; per dtype
        assert "static, 1" not in emit("attention_fwd", "dnf", lang)
    dump = format_onf(onf_of("attention_fwd", "online"))
    assert "parallel(b, h, i_tile, interleaved, nest=rows)" in dump
    assert dump.count("parallel(3, interleaved) for b") == 2


def test_c_max_is_an_inline_comparison_and_cuda_keeps_fmax():
    # fmax is a library call on x86: a block's max would not vectorize (it is one per score)
    c = emit("attention_fwd", "online", "c")
    assert "fmax(" not in c
    for real in ("double", "float"):
        helper = f"static inline {real} max_{real}({real} a, {real} b) {{ return a > b ? a : b; }}"
        assert c.count(helper) == 1
        assert re.search(rf"block_max_0 = max_{real}\(block_max_0, probs\[", c)
    assert "fmax(" in emit("attention_fwd", "online", "cuda")
    assert "max_double" not in emit("rmsnorm_fwd", "dnf", "c")


def test_single_dtype_emission():
    text = emit("rmsnorm_fwd", "dnf", "c", ("float32",))
    assert "rmsnorm_fwd_dnf_f32" in text and "_f64" not in text


def test_fortran_rejects_names_equal_but_for_case():
    A, a = array("A", "n", "n"), array("a", "n", "n")
    spec = KernelSpec("clash", (A, a), (), (Output("C", inner(A, transpose(a)), ("i", "j")),))
    onf = realize(psi_reduce(spec), "dnf", ())
    with pytest.raises(SpecError, match="A and a are the same name in Fortran"):
        FortranPrinter(onf, "float64")


def test_unknown_language_and_dtype():
    with pytest.raises(UnknownNameError, match="unknown language 'rust'"):
        emit("attention_fwd", "dnf", "rust")
    with pytest.raises(UnknownNameError, match="unknown dtype 'float16'"):
        emit("attention_fwd", "dnf", "c", ("float16",))


def test_long_fortran_lines_wrap_at_one_indent():
    """A declaration of a thousand characters (eight rows unrolled declare many locals)."""
    from moagen.codegen.fortran import LINE, _wrap
    line = "    real(c_double) :: " + ", ".join(f"row_max_{k}" for k in range(100))
    out = _wrap(line)
    assert len(out) > 10 and all(len(piece) <= LINE for piece in out)
    assert all(piece.startswith("        & ") for piece in out[1:])
    assert [w for piece in out for w in piece.split() if w != "&"] == line.split()
