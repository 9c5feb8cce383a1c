"""C99 with OpenMP, built into a shared library, loaded with cffi; and the same C printed
without `restrict`, the bench's ablation (Fortran dummy arrays may not alias; C pointers
may, unless declared restrict)."""
from dataclasses import replace
from functools import partial

from moagen.targets.c import loader
from moagen.targets.c.build import build_c
from moagen.targets.c.printer import CPrinter, emit_c
from moagen.targets.target import Target

TARGET = Target("c", extension="c", kind="cpu", emit=emit_c, build=build_c,
                load=loader.load, bind=loader.bind, toolchain="c")


class _PlainPointers(CPrinter):
    restrict = ""  # the compiler must assume that any two arrays may alias


NO_RESTRICT = replace(TARGET, name="c-norestrict", emit=partial(emit_c, printer=_PlainPointers),
                      variant_of="c")
