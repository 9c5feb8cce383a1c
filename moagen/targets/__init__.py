"""The targets, one per language, registered here: how a kernel is printed in the language,
built, loaded and bound (moagen.targets.target.Target). Emit, build, bind, verify, the
bench, cost and the command line look a language up here; a new language is a module of
this package and its line in TARGETS.

    target = get_target("fortran")
    kernel = target.bind(target.library(source, stem), signature, validate)
"""
from moagen.errors import UnknownNameError
from moagen.targets.c import target as c
from moagen.targets.cuda import target as cuda
from moagen.targets.fortran import target as fortran
from moagen.targets.openacc import target as openacc
from moagen.targets.target import Target

TARGETS = {t.name: t for t in (
    c.TARGET,
    fortran.TARGET,
    cuda.TARGET,
    c.NO_RESTRICT,
    cuda.EMULATED,
    openacc.C,
    openacc.C_NO_RESTRICT,
    openacc.FORTRAN,
)}
# the languages: every target but the variants of one (an experiment's, an emulation's)
LANGS = tuple(name for name, t in TARGETS.items() if t.variant_of is None)
# what runs a language's kernels on the host where its own hardware is missing
EMULATIONS = {"cuda": cuda.EMULATED.name}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise UnknownNameError(f"unknown language {name!r}; expected one of {', '.join(TARGETS)}")
    return TARGETS[name]


def emulated(lang: str) -> str:
    """The target that runs `lang` on the host: its emulation, or itself."""
    return EMULATIONS.get(lang, lang)


def of_kind(kind: str) -> tuple:
    """The languages printed from one mapping kind ("cpu": those that run on any machine)."""
    return tuple(name for name in LANGS if TARGETS[name].kind == kind)
