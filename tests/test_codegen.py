"""The emitted sources: committed copies current, CUDA compiling for the GPUs we target,
and the properties a reader relies on visible in the text."""
import re

import pytest

from moagen.cost.sass import ptxas_resources
from moagen.targets.cuda.build import CUDA_ARCHS, compile_cuda
from moagen.commands.common import GENERATED
from moagen.emit import emit, filename, stem
from moagen.targets.c.printer import CPrinter
from moagen.targets.cuda.printer import CudaPrinter
from moagen.targets.fortran.printer import FortranPrinter
from moagen.errors import SpecError, UnknownNameError
from moagen.kernels import KERNELS, CompositeKernel
from moagen.moa.dnf import psi_reduce
from moagen.moa.expr import array, inner, rsqrt, sigmoid, transpose
from moagen.moa.spec import KernelSpec, Output
from moagen.onf.dump import format_onf
from moagen.onf.loops import Store, walk
from moagen.onf.realize import realize
from moagen.pipeline import onf_of
from moagen.targets import LANGS, TARGETS

# each language's variants: those of its kind (CUDA's tensor cores in CUDA alone)
SOURCES = [(k.name, v, lang) for k in KERNELS.values() for lang in LANGS
           for v in k.variants_on(TARGETS[lang].kind)]


@pytest.mark.parametrize("kernel,variant,lang", SOURCES)
def test_generated_sources_match_the_generator(kernel, variant, lang):
    committed = GENERATED / filename(kernel, variant, lang)
    assert committed.is_file(), f"{committed} is missing: run `make generated`"
    assert committed.read_text() == emit(kernel, variant, lang), \
        f"{committed} differs from what the generator emits: run `make generated` and commit"


# a composite's CUDA is its stages' kernels, each compiled for every arch as a kernel of its
# own: the composite for the newest arch only
CUDA_BUILDS = [(kernel, variant, arch) for kernel, variant, lang in SOURCES if lang == "cuda"
               for arch in CUDA_ARCHS
               if arch == CUDA_ARCHS[-1] or not isinstance(KERNELS[kernel], CompositeKernel)]


@pytest.mark.parametrize("kernel,variant,arch", CUDA_BUILDS)
def test_cuda_compiles(kernel, variant, arch):
    """Without a warning (#66), every kernel compiled by ptxas, none spilling. The cubin is
    the one moagen cost and the SASS tests read (moagen's flags, the run's build folder):
    one compile a kernel and arch."""
    source = emit(kernel, variant, "cuda")
    result = compile_cuda(source, stem(kernel, variant), arch)
    assert result.warnings() == []
    assert result.cubin.stat().st_size > 0
    # ptxas compiled every __global__ kernel (one per nest and dtype; a tiled one once per
    # bound it is compiled at), without spills
    compiled = set(ptxas_resources(result.ptxas_report))  # by name, a template's with <bound>
    assert compiled == _kernel_instances(source) and compiled
    spills = re.findall(r"(\d+) bytes spill", result.ptxas_report)
    assert spills and set(spills) == {"0"}


def test_a_warning_is_found(tmp_path, monkeypatch):
    """The check above can fail: a local never referenced (#177) is a warning it reports;
    ptxas' resource lines are none."""
    monkeypatch.setenv("MOAGEN_BUILD_DIR", str(tmp_path))
    unused = "__global__ void k(float *x) { const int i = 0; x[0] = 1.0f; }\n"
    result = compile_cuda(unused, "unused", CUDA_ARCHS[0])
    assert len(result.warnings()) == 1 and "#177" in result.warnings()[0]
    used = "__global__ void k(float *x) { x[0] = 1.0f; }\n"
    assert compile_cuda(used, "used", CUDA_ARCHS[0]).warnings() == []


def _kernel_instances(source):
    """Each __global__ function of a .cu source, a template one as each instance its
    launchers launch (rows<64>, rows<128>; partial<64, 1> with VectorLoads' flag)."""
    out = set()
    for name in re.findall(r"__global__ void (\w+)\(", source):
        bounds = set(re.findall(rf"\b{name}<(\d+(?:, \d+)*)>", source))
        out |= {f"{name}<{b}>" for b in bounds} or {name}
    return out


def test_memory_optimal_sources_name_no_temporary():
    naive = emit("attention_fwd", "naive", "c")
    dnf = emit("attention_fwd", "dnf", "c")
    assert "*restrict scores" in naive and "*restrict probs" in naive
    assert "scores" not in dnf.split("*/", 2)[-1] and "probs" not in dnf


def test_each_nest_carries_a_summary_and_its_parallel_loop():
    for lang, pragma, mark in (("c", "#pragma omp parallel for collapse(3)", "/* "),
                               ("fortran", "!$omp parallel do collapse(3)", "! ")):
        text = emit("attention_fwd", "dnf", lang)
        assert text.count(pragma) == 2  # one per dtype
        assert text.count("O[b, h, i, c] = sum[j < n](") == 1  # the DNF, once per file
        online = emit("attention_fwd", "online", lang)
        assert online.count(mark + "rows: writes O, lse; reads Q, K, V; scratch probs\n") == 2
        assert online.count(mark + "rows.edge: writes O, lse; reads Q, K, V; scratch probs\n") == 2
        assert online.count("for b, h, i_tile (parallel, interleaved) / c (simd), j_blk / ") == 2
        # the tail maps as its parent does
        assert online.count("for b, h, i (parallel, interleaved) / c (simd), j_blk / ") == 2


@pytest.mark.parametrize("name", sorted(p.name for p in GENERATED.iterdir()))
def test_generated_files_print_each_definition_once_and_no_run_on_names(name):
    """The DNF of every output once per file (the nests carry summaries), and no name a
    collision made unreadable (t_0 taken: t_0b, not t_02; an index never starts with 0, so
    a tile's lane 10 of row 0, qk_0_10, is a name of its own)."""
    text = (GENERATED / name).read_text()
    comment = r"^(?: \*|!) "
    stem_ = name.rsplit(".", 1)[0]
    kernel = next(k for k in KERNELS.values() if stem_.startswith(k.name + "_")
                  and stem_[len(k.name) + 1:] in k.variants)
    kind = next(t.kind for t in TARGETS.values() if t.extension == name.rsplit(".", 1)[1])
    onf = onf_of(kernel.name, stem_[len(kernel.name) + 1:], target=kind)
    firsts = {line for n in onf.nests for line in n.origin.splitlines() if line[:1] != " "}
    for b in onf.outputs:
        assert any(line.startswith(b.name + "[") for line in firsts) or \
            kernel.name.startswith("block_"), (name, b.name)  # a composed block's parts
    for line in firsts:  # every definition, once
        assert len(re.findall(comment + re.escape(line) + "$", text, re.M)) == 1, (name, line)
    code = "\n".join(line for line in text.splitlines()
                     if not re.match(r"\s*(/\*|\*|!(?!\$omp))", line))
    assert re.findall(r"\b[A-Za-z]\w*_0\d+\b", code) == []


def test_row_offsets_are_named_once_outside_the_vectorized_loops():
    c = emit("attention_fwd", "online", "c", ("float64",), params={"rows": 4, "keys": 4})
    assert "const int64_t K_row = d*(j + n*(b*heads + h));" in c
    assert "qk_1 += Q[c + d*(4*i_tile + n*(b*heads + h) + 1)] * K[K_row + c];" in c
    assert "const int64_t V_row2 = d*(4*j_tile + n*(b*heads + h) + 2);" in c
    assert "t_2_0 * V[V_row2 + c]" in c
    # the vectorized loops keep plain bodies: no declaration inside an `omp simd` loop
    lines = c.splitlines()
    for k, line in enumerate(lines):
        if line.strip().startswith("#pragma omp simd"):
            depth, body = 0, []
            for inner in lines[k + 1:]:
                depth += inner.count("{") - inner.count("}")
                body.append(inner)
                if depth == 0:
                    break
            assert not any("const " in b or "int64_t " in b for b in body[1:]), body
    # named only where gcc computes them anyway: O's rows, which the key blocks do not
    # change, stay in the accesses (named, they stayed live across them: 2.5% slower)
    assert "O_row" not in c
    f90 = emit("attention_fwd", "online", "fortran", ("float64",), params={"rows": 4, "keys": 4})
    assert "              K_row = d*(j + n*(b*heads + h))" in f90
    assert "qk_0 = qk_0 + Q(c + d*(4*i_tile + n*(b*heads + h))) * K(K_row + c)" in f90
    assert re.search(r"integer\(c_int64_t\) :: [^\n]*K_row", f90)
    private = re.findall(r"!\$omp parallel do [^\n]*(?:\n\s*!\$omp&[^\n]*)*", f90)
    assert len(private) == 2 and all("K_row" in p for p in private)
    cuda = emit("attention_fwd", "online", "cuda", ("float64",))
    assert "const int64_t K_row = d*(j + n*(b*heads + h));" in cuda
    # a quotient hoisted out of the loops (decode's KV head) stays hoisted; a row uses it
    decode = emit("attention_decode", "dnf", "c", ("float64",))
    assert "const int64_t quot = ((h) / (((q_heads) / kv_heads)));" in decode
    assert "const int64_t K_row = d*(cap*(b*kv_heads + quot) + j);" in decode


def test_a_taken_name_ending_in_a_digit_takes_a_letter():
    from moagen.onf.names import Names
    names = Names({"t", "t_0", "t_0b", "qk"})
    assert names.new("t") == "t2" and names.new("t_0") == "t_0c"
    assert names.new("qk_0") == "qk_0" and names.new("qk") == "qk2"


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
    from moagen.targets.fortran.printer import LINE, wrap_statement
    line = "    real(c_double) :: " + ", ".join(f"row_max_{k}" for k in range(100))
    out = wrap_statement(line)
    assert len(out) > 10 and all(len(piece) <= LINE for piece in out)
    assert all(piece.startswith("        & ") for piece in out[1:])
    assert [w for piece in out for w in piece.split() if w != "&"] == line.split()


def test_a_function_printed_as_a_quotient_is_parenthesized_as_one():
    """rsqrt and sigmoid print as 1 / (...): as a divisor they need parentheses, else
    a / 1 / sqrt(b) would divide by sqrt(b) instead of multiplying."""
    A, B = array("A", "n"), array("B", "n")
    divided = Output("C", A / sigmoid(B) - A / rsqrt(B), ("i",))
    spec = KernelSpec("quotients", (A, B), (), (divided,))
    onf = realize(psi_reduce(spec), "dnf", ())
    (store,) = [s for n in onf.nests for s in walk(n.body) if isinstance(s, Store)]
    for printer, one in ((CPrinter, "1.0"), (CudaPrinter, "1.0"), (FortranPrinter, "1.0_c_double")):
        text = printer(onf, "float64").expr(store.value)
        assert f"/ ({one} / ({one} + exp(-" in text, text
        # CUDA prints rsqrt as its own function, a call
        divisor = "/ rsqrt(" if printer is CudaPrinter else f"/ ({one} / sqrt("
        assert divisor in text, text
