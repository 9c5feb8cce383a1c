"""Valgrind as the cost model's cachegrind (moagen.cost.measure) and the C-vs-Fortran
experiment's callgrind (moagen.bench.languages) run it: the flags of code it can decode,
where it is, and the totals its tools write."""
import re
import shutil

from moagen.errors import CompilerNotFound

FLAGS = ("-O3", "-march=x86-64-v3", "-fopenmp", "-fPIC")  # valgrind 3.19 decodes no AVX-512
INSTALL_VALGRIND = "apt-get install valgrind"


def valgrind() -> str:
    path = shutil.which("valgrind")
    if path is None:
        raise CompilerNotFound(f"valgrind not found on PATH; install it with: {INSTALL_VALGRIND}")
    return path


def event_totals(text: str) -> dict:
    """Event -> count of a cachegrind or callgrind output file: its `events:` line and its
    `summary:` (callgrind: `totals:`) line."""
    events = re.search(r"^events:\s*(.+)$", text, re.MULTILINE).group(1).split()
    totals = re.search(r"^(?:summary|totals):\s*(.+)$", text, re.MULTILINE).group(1).split()
    return dict(zip(events, map(int, totals)))
