"""Measured counterparts of F and M on the CPU, deterministic: one call of the C kernel under
cachegrind, on one thread.

The kernel is built with -march=x86-64-v3 (valgrind 3.19 decodes no AVX-512) and called by
a generated driver (templates/c/driver.c.j2) that writes every array and then streams
through twice the last-level cache, so that the call starts with its arrays in main memory.
The driver runs twice, calling the kernel and not, and the second run's counts are taken
from the first's: what is left is the call's own. Cachegrind simulates the caches given by
CacheConfig (the same on every machine); its last-level misses, reads and write-allocates
alike, times the line size are the bytes brought from memory. It counts no write-backs.
"""
import os
import subprocess
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

import sympy

from moagen.targets.c.build import build_c
from moagen.targets.toolchain import Toolchain, build_program
from moagen.targets.c.printer import CPrinter
from moagen.emit import emit, stem
from moagen.pipeline import onf_of
from moagen.templates import render
from moagen.cost.model import predict
from moagen.cost.valgrind import FLAGS, event_totals, valgrind
from moagen.errors import MoagenError

CFLAGS = FLAGS + ("-std=c99",)


@dataclass(frozen=True)
class CacheConfig:
    """The simulated caches: a core's L1s, and a last level of one core's share (the
    default is 2 MiB, this machine's L2; sizes in bytes, associativity, line size)."""
    ll_bytes: int = 2 * 1024 * 1024
    ll_ways: int = 16
    line: int = 64
    d1: str = "49152,12,64"
    i1: str = "32768,8,64"

    def args(self):
        return [f"--I1={self.i1}", f"--D1={self.d1}", f"--LL={self.ll_bytes},{self.ll_ways},{self.line}"]


@dataclass(frozen=True)
class Counts:
    """Cachegrind's events of one call."""
    Ir: int  # instructions
    Dr: int  # data reads
    Dw: int  # data writes
    D1mr: int
    D1mw: int
    DLmr: int  # last-level read misses
    DLmw: int  # last-level write misses

    def __sub__(self, other):
        return Counts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def ll_bytes(self, line: int) -> int:
        return (self.DLmr + self.DLmw) * line


def measure(kernel: str, variant: str, sizes: dict, dtype: str = "float64",
            cache: CacheConfig = CacheConfig()) -> Counts:
    """The counts of one call of the C kernel at these sizes (every size, by name)."""
    from moagen.kernels import get_kernel  # the scalars its check uses (a softmax's scale)

    found = valgrind()
    # every size, and sizes the kernel accepts; a chosen one as a call here chooses it
    sizes = {s.name: v for s, v in predict(kernel, variant).sizes_from(sizes).items()}
    onf = onf_of(kernel, variant, dtype=dtype)
    printer = CPrinter(onf, dtype)
    sig = printer.sig
    scalars = get_kernel(kernel).check.scalars(sizes)
    library = build_c(emit(kernel, onf.variant, "c"), stem(kernel, onf.variant),
                            Toolchain(cflags=CFLAGS))
    argv = [str(sizes[s.name]) for s in sig.sizes] + [repr(float(scalars[s])) for s in sig.scalars]
    with tempfile.TemporaryDirectory(prefix="moagen-cost-") as tmp:
        driver = _build_driver(printer, library, Path(tmp), cache)
        counts = {mode: _cachegrind(found, driver, [mode] + argv, cache, Path(tmp))
                  for mode in ("call", "skip")}
    return counts["call"] - counts["skip"]


def _build_driver(printer, library: Path, folder: Path, cache: CacheConfig) -> Path:
    sig = printer.sig
    arrays = [{"name": a.name, "count": printer.index(sympy.Mul(*a.shape)),
               "seed": k + 1 if a.intent in ("in", "inout") else 0}
              for k, a in enumerate(sig.arrays)]
    source = render("c/driver.c.j2", name=sig.name, params=printer.params(), real=printer.real,
                    sizes=[s.name for s in sig.sizes], scalars=list(sig.scalars), arrays=arrays,
                    args=[a.name for a in sig.arrays] + [s.name for s in sig.sizes] + list(sig.scalars),
                    flush_bytes=2 * cache.ll_bytes)
    src = folder / "driver.c"
    src.write_text(source)
    return build_program(src, library, folder / "driver")


def _cachegrind(valgrind, driver: Path, argv, cache: CacheConfig, folder: Path) -> Counts:
    out = folder / f"cachegrind.{argv[0]}"
    command = [valgrind, "--tool=cachegrind", "--cache-sim=yes", *cache.args(),
               f"--cachegrind-out-file={out}", str(driver), *argv]
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise MoagenError(f"cachegrind run failed (exit status {done.returncode})\n"
                          f"command: {' '.join(command)}\noutput:\n{done.stdout}")
    return parse(out.read_text())


def parse(text: str) -> Counts:
    """The totals of a cachegrind output file (its `events:` and `summary:` lines)."""
    by_name = event_totals(text)
    return Counts(**{f.name: by_name[f.name] for f in fields(Counts)})
