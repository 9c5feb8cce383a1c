"""PyTorch's measured times on a GPU, read from a results folder's bench-summary.md (the
tables `moagen bench` writes), to set beside a kernel's roofline bound.

Each "# Benchmark run" section names its command (`--kernels K[:V] --dtype T [--size
k=v ...]`) and has one row per implementation and length n; the `torch` rows are the
PyTorch baseline (for attention, F.scaled_dot_product_attention, as the section's "What
each baseline computes" says). A row's sizes are the kernel's bench sizes at that n with
the command's --size overrides (moagen.bench.calls.sizes: those of the code read now,
which the results folder's README dates)."""
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

# the first GPU run (docs/results/h200-2026-12-04/README.md)
H200_RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "h200-2026-12-04"


@dataclass(frozen=True)
class Measured:
    kernel: str
    dtype: str
    sizes: Dict[str, int]
    ms: float  # median time of one call
    computes: str  # what the baseline computes, as the section says
    source: str  # the file and the run


def torch_times(folder: Path = H200_RESULTS) -> List[Measured]:
    """Every torch row of the folder's bench-summary.md ([] where there is none)."""
    from moagen.bench import calls

    path = Path(folder) / "bench-summary.md"
    if not path.exists():
        return []
    out = []
    for run, text in _sections(path.read_text()):
        command = re.search(r"^Command: `([^`]*)`", text, re.M)
        if not command:
            continue
        words = shlex.split(command.group(1))
        dtype = _option(words, "--dtype") or ["float64"]
        overrides = dict(_assignment(w) for w in _option(words, "--size") or [])
        computes = re.search(r"^- \S+, torch: (.*)$", text, re.M)
        header, rows = _table(text)
        for row in rows:
            cells = dict(zip(header, row))
            if cells.get("impl") != "torch":
                continue
            try:
                sizes = calls.sizes(cells["kernel"], int(cells["n"]), overrides)
                ms = float(cells["median ms"])
            except (KeyError, ValueError):
                continue
            out.append(Measured(cells["kernel"], dtype[0], sizes, ms,
                                computes.group(1) if computes else "",
                                f"{_shown(path)}, run {run}"))
    return out


def torch_time(kernel: str, dtype: str, sizes: Dict[str, int],
               folder: Path = H200_RESULTS) -> Optional[Measured]:
    """The torch row for this kernel, dtype and exactly these sizes, or None."""
    return next((m for m in torch_times(folder)
                 if m.kernel == kernel and m.dtype == dtype and m.sizes == dict(sizes)), None)


def _shown(path: Path) -> str:
    root = H200_RESULTS.parents[2]
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _sections(text):
    parts = re.split(r"^# Benchmark run (\S+)\s*$", text, flags=re.M)[1:]
    return zip(parts[::2], parts[1::2])


def _option(words, name):
    """The values after `name` up to the next option, or None."""
    if name not in words:
        return None
    values = []
    for w in words[words.index(name) + 1:]:
        if w.startswith("--"):
            break
        values.append(w)
    return values


def _assignment(word):
    key, _, v = word.partition("=")
    return key, int(v)


def _table(text):
    """The section's first markdown table: (header cells, rows of cells)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    if len(lines) < 2:
        return [], []
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
    return cells(lines[0]), [cells(line) for line in lines[2:]]
