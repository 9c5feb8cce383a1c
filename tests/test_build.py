import subprocess
import sys
import textwrap
from pathlib import Path

import numpy
import pytest

from moagen.targets import toolchain
from moagen.targets.c.build import build_c
from moagen.targets.cuda.build import build_cuda, compile_cuda
from moagen.targets.fortran import build as fortran_build
from moagen.targets.fortran.build import build_fortran
from moagen.targets.toolchain import Toolchain
from moagen.errors import CompileError, CompilerNotFound
from moagen.targets.fortran.target import MODULE


@pytest.fixture
def build_dir(tmp_path, monkeypatch):
    """A fresh, empty build directory for one test."""
    monkeypatch.setenv("MOAGEN_BUILD_DIR", str(tmp_path))
    return tmp_path


def _no_compiler(*args, **kwargs):
    raise AssertionError(f"a cache hit ran {args[0]}")


def test_c_build_is_cached_with_its_source(build_dir, scale_rows, monkeypatch):
    library = build_c(scale_rows.sources["c"], "scale_rows")
    assert library.is_file() and library.parent.parent == build_dir
    assert (library.parent / "scale_rows.c").read_text() == scale_rows.sources["c"]
    mtime = library.stat().st_mtime_ns

    monkeypatch.setattr(subprocess, "run", _no_compiler)
    assert build_c(scale_rows.sources["c"], "scale_rows") == library
    assert library.stat().st_mtime_ns == mtime


def test_cache_key_covers_source_and_flags(build_dir, scale_rows):
    source = scale_rows.sources["c"]
    first = build_c(source, "scale_rows")
    assert build_c(source + "\n", "scale_rows") != first
    assert build_c(source, "scale_rows", Toolchain(cflags=("-O1", "-fPIC", "-std=c99"))) != first
    assert len(list(build_dir.iterdir())) == 3


def test_concurrent_builds_share_one_artifact(build_dir, scale_rows):
    script = textwrap.dedent(f"""
        from moagen.targets.c.build import build_c
        print(build_c({scale_rows.sources["c"]!r}, "scale_rows"))
    """)
    processes = [subprocess.Popen([sys.executable, "-c", script], cwd=toolchain.PROJECT_ROOT,
                                  stdout=subprocess.PIPE, text=True) for _ in range(4)]
    paths = {Path(p.communicate()[0].strip()) for p in processes}
    assert all(p.returncode == 0 for p in processes)
    assert len(paths) == 1
    library = paths.pop()
    assert library.is_file()
    assert list(build_dir.iterdir()) == [library.parent]  # no private folders left behind


@pytest.mark.parametrize("lang, field, package", [
    ("c", "cc", "apt-get install gcc"),
    ("fortran", "fc", "apt-get install gfortran"),
    ("cuda", "nvcc", "nvidia-cuda-toolkit"),
])
def test_missing_compiler_names_the_package(build_dir, scale_rows, lang, field, package):
    toolchain = Toolchain(**{field: "moagen-no-such-compiler"})
    with pytest.raises(CompilerNotFound, match=package) as error:
        if lang == "fortran":
            build_fortran(scale_rows.sources[lang], "scale_rows", MODULE, toolchain)
        elif lang == "c":
            build_c(scale_rows.sources[lang], "scale_rows", toolchain)
        else:
            compile_cuda(scale_rows.sources[lang], "scale_rows", "sm_90", toolchain)
    assert "moagen-no-such-compiler" in str(error.value)


def test_missing_f90wrap_names_the_pip_package(build_dir, scale_rows, monkeypatch):
    monkeypatch.setitem(sys.modules, "f90wrap", None)  # not importable
    with pytest.raises(CompilerNotFound, match=r"pip install f90wrap==0\.3\.0"):
        build_fortran(scale_rows.sources["fortran"], "scale_rows", MODULE)


@pytest.mark.parametrize("lang, source, compile", [
    ("c", "void broken(int x { }\n", lambda s: build_c(s, "broken")),
    ("fortran", "module moagen_broken\ncontains\n  subroutine f(\nend module moagen_broken\n",
     lambda s: build_fortran(s, "broken", "moagen_broken")),
    ("cuda", "__global__ void broken(int x { }\n", lambda s: compile_cuda(s, "broken", "sm_80")),
])
def test_compile_error_shows_command_source_and_output(build_dir, lang, source, compile):
    with pytest.raises(CompileError) as error:
        compile(source)
    message = str(error.value)
    command = next(line for line in message.splitlines() if line.startswith("command: "))
    assert {"gcc", "gfortran", "nvcc"} & set(command.split())
    source_path = next(line for line in message.splitlines() if line.startswith("source: "))[len("source: "):]
    assert Path(source_path).read_text() == source  # kept for inspection
    assert "error" in message.split("output:", 1)[1].lower()


def test_fortran_source_must_define_the_module(build_dir, scale_rows):
    with pytest.raises(ValueError, match="moagen_other"):
        build_fortran(scale_rows.sources["fortran"], "scale_rows", "moagen_other")


def test_fortran_extension_is_named_for_its_build(scale_rows):
    extension = build_fortran(scale_rows.sources["fortran"], "scale_rows", MODULE)
    assert extension.is_file()
    assert extension.name.startswith("_" + extension.parent.name.replace("-", "_") + ".")


def _runtimes(build_dir):
    return sorted(build_dir.glob("fortranobject-*/fortranobject.o"))


def test_fortran_extensions_link_one_f2py_runtime(build_dir, scale_rows):
    first = build_fortran(scale_rows.sources["fortran"], "scale_rows", MODULE)
    second = build_fortran(scale_rows.sources["fortran"] + "\n", "scale_rows", MODULE)
    assert first.parent != second.parent
    assert len(_runtimes(build_dir)) == 1  # numpy's fortranobject.c compiled once
    assert not list(first.parent.glob("fortranobject*")) and not list(second.parent.glob("fortranobject*"))


@pytest.fixture
def fresh_runtime_key():
    fortran_build._runtime_key.cache_clear()
    yield
    fortran_build._runtime_key.cache_clear()


def test_new_numpy_rebuilds_the_runtime_and_the_extension(build_dir, scale_rows, monkeypatch,
                                                          fresh_runtime_key):
    first = build_fortran(scale_rows.sources["fortran"], "scale_rows", MODULE)
    monkeypatch.setattr(numpy, "__version__", "0.0.0")
    fortran_build._runtime_key.cache_clear()
    second = build_fortran(scale_rows.sources["fortran"], "scale_rows", MODULE)
    assert second != first and second.is_file()
    assert len(_runtimes(build_dir)) == 2


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_cuda_reports_registers(build_dir, scale_rows, arch):
    result = compile_cuda(scale_rows.sources["cuda"], "scale_rows", arch)
    assert result.cubin.read_bytes()[:4] == b"\x7fELF"
    assert f"for '{arch}'" in result.ptxas_report
    assert "registers" in result.ptxas_report


def test_build_cuda_makes_a_shared_library(scale_rows):
    library = build_cuda(scale_rows.sources["cuda"], "scale_rows")
    assert library.read_bytes()[:4] == b"\x7fELF"


def test_toolchain_reads_the_environment(monkeypatch):
    monkeypatch.setenv("CC", "clang")
    monkeypatch.setenv("MOAGEN_CFLAGS", "-O2 -fPIC")
    monkeypatch.setenv("MOAGEN_NVCCFLAGS", "-O2 -lineinfo")
    toolchain = Toolchain()
    assert (toolchain.cc, toolchain.cflags, toolchain.nvccflags) == ("clang", ("-O2", "-fPIC"), ("-O2", "-lineinfo"))
    assert Toolchain(cc="gcc").cc == "gcc"


def test_describe_gives_versions_and_flags():
    toolchain = Toolchain()
    described = toolchain.describe()
    assert described["c"]["flags"] == list(toolchain.cflags)
    assert described["cuda"]["link"] == list(toolchain.nvccldflags)
    assert all(described[lang]["version"] != "not found" for lang in ("c", "fortran", "cuda"))
    assert Toolchain(fc="moagen-no-such-compiler").describe()["fortran"]["version"] == "not found"


def test_default_build_dir_is_under_the_project(monkeypatch):
    monkeypatch.delenv("MOAGEN_BUILD_DIR", raising=False)
    assert toolchain.build_dir() == toolchain.PROJECT_ROOT / "build"
