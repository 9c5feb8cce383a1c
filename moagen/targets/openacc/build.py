"""The device code gcc's nvptx offloading makes for OpenACC regions, and ptxas' report on it."""
import ast
import re
from dataclasses import dataclass
from pathlib import Path

from moagen.errors import CompilerNotFound
from moagen.targets.toolchain import (ACC_LDFLAGS, INSTALL_C, INSTALL_CUDA, INSTALL_FORTRAN, INSTALL_OFFLOAD,
                                     PTX_ARCH, Toolchain, cached, require, run, write)


@dataclass(frozen=True)
class OffloadResult:
    ptx: Path  # the device code gcc made for a source's OpenACC regions
    cubin: Path  # ptxas' machine code of it for PTX_ARCH (relocatable: libm calls unlinked)
    ptxas_report: str  # ptxas -v on it: registers and spills per region


def offload_ptx(source, stem, extension, toolchain=None):
    """The PTX that gcc or gfortran (extension "c" or "f90") makes for the OpenACC regions
    of `source` with the OpenACC flags, as a built library embeds it (mkoffload keeps it as
    C strings in *.xnvptx-none.c under -save-temps), and ptxas' report on it."""
    tc = toolchain or Toolchain()
    compiler, flags = (tc.cc, tc.acc_cflags) if extension == "c" else (tc.fc, tc.acc_fflags)
    key = ("offload-ptx", extension, source, compiler, flags)

    def build(folder, name):
        require(compiler, "C or Fortran compiler", INSTALL_FORTRAN if extension == "f90" else INSTALL_C)
        ptxas = require("ptxas", "PTX assembler (CUDA toolkit)", INSTALL_CUDA)
        src = write(folder / f"{stem}.{extension}", source)
        run([compiler, *flags, "-save-temps", "-o", f"lib{stem}.so", src.name, *ACC_LDFLAGS],
             src, cwd=folder)
        embedded = folder / f"lib{stem}.so.xnvptx-none.c"
        if not embedded.is_file():
            raise CompilerNotFound(f"{compiler} made no nvptx offload code; install it with: "
                                   f"{INSTALL_OFFLOAD}")
        ptx = write(folder / f"{stem}.ptx", embedded_ptx(embedded.read_text()))
        # -c: the module alone, its calls into the device's libm left to the link
        write(folder / "ptxas.txt", run([ptxas, f"-arch={PTX_ARCH}", "-c", "-v", "-o",
                                           str(folder / f"{stem}.cubin"), str(ptx)], src))

    folder = cached(stem, key, build)
    return OffloadResult(folder / f"{stem}.ptx", folder / f"{stem}.cubin",
                         (folder / "ptxas.txt").read_text())


def embedded_ptx(text):
    """The source's own PTX in mkoffload's C source: of the modules there (string literals
    of its ptx_code_K arrays), the ones with entry points; the rest are the device's C and
    math libraries."""
    arrays = re.findall(r"static const char ptx_code_\d+\[\] =\n((?:\s*\".*\"\n)+)", text)
    modules = ["".join(ast.literal_eval(s) for s in re.findall(r'"(?:[^"\\]|\\.)*"', a))
               for a in arrays]
    return "".join(m for m in modules if re.search(r"^\.entry ", m, re.MULTILINE))
