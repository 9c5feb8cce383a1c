"""Costs, measurements and CUDA resources as tables for people and as JSON for machines."""
import math
import textwrap
from typing import Optional

import sympy

from moagen.cost.model import CACHE_ASSUMPTION, Cost, value


def number(v) -> str:
    return f"{v:,}" if isinstance(v, int) else f"{v:,.4g}"


def _table(rows, indent=""):
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _notes(*paragraphs, indent="  "):
    return [textwrap.fill(p, 96, initial_indent=indent, subsequent_indent=indent + "  ")
            for p in paragraphs]


def format_cost(cost: Cost, env: Optional[dict] = None) -> str:
    """F, M (by array), M_min, scratch, atomics and the working set, with their values at
    env's sizes when given."""
    at = (lambda e: number(value(e, env))) if env else (lambda e: "")
    rows = [("F", str(cost.flops), at(cost.flops))]
    rows += [(op, str(n), at(n)) for op, n in sorted(cost.special.items())]
    rows.append(("M", f"{cost.M} bytes", at(cost.M)))
    rows += [(f"  {array} {what}", f"{n} elements", at(n)) for array, moved in cost.traffic.items()
             for what, n in (("read", moved.read), ("written", moved.written)) if n != 0]
    rows.append(("M_min", f"{cost.M_min} bytes", at(cost.M_min)))
    rows.append(("scratch", f"{cost.scratch_bytes} bytes", at(cost.scratch_bytes)))
    rows += [(f"  {array}", f"{n} elements", at(n)) for array, n in cost.scratch.items()]
    total = sum(cost.atomics.values(), sympy.Integer(0))
    rows.append(("atomics", str(total) if cost.atomics else "none", at(total) if cost.atomics else ""))
    rows += [(f"  {array}", str(n), at(n)) for array, n in cost.atomics.items()]
    working_set = cost.itemsize * cost.working_set
    rows.append(("working set", f"{working_set} bytes", at(working_set)))
    sizes = ", " + " ".join(f"{s}={v}" for s, v in env.items()) if env else ""
    head = f"{cost.kernel}, variant {cost.variant} ({cost.dtype}: {cost.itemsize}-byte elements{sizes})"
    notes = _notes(f"M: bytes between main memory and the cache: {CACHE_ASSUMPTION}.",
                   "M_min: every element moved once (an infinite cache): the series' count.",
                   *([f"The counts assume: {'; '.join(cost.assumptions)}."] if cost.assumptions else []))
    return "\n".join([head] + _table(rows, indent="  ") + notes) + "\n"


# the expressions' one function that is not sympy's (the sizes of tiled buffers use it)
NOTATION = "idiv(a, b): the integer quotient floor(a / b)"


def cost_json(cost: Cost, env: Optional[dict] = None) -> dict:
    q = lambda e: {"expr": str(e), "value": value(e, env) if env else None}
    return {"kernel": cost.kernel, "variant": cost.variant, "dtype": cost.dtype,
            "itemsize": cost.itemsize,
            "sizes": {s.name: v for s, v in env.items()} if env else None,
            "F": q(cost.flops), "special": {op: q(n) for op, n in cost.special.items()},
            "M": q(cost.M), "M_min": q(cost.M_min),
            "traffic": {a: {"read": q(m.read), "written": q(m.written)} for a, m in cost.traffic.items()},
            "scratch": q(cost.scratch_bytes), "atomics": {a: q(n) for a, n in cost.atomics.items()},
            "working_set": q(cost.itemsize * cost.working_set),
            "cache_assumption": CACHE_ASSUMPTION, "assumptions": list(cost.assumptions),
            "notation": NOTATION}


def measured_json(cost: Cost, env: dict, counts, line: int) -> dict:
    measured = dict(vars(counts), ll_bytes=counts.ll_bytes(line))
    return dict(cost_json(cost, env), measured=measured,
                ratio=measured["ll_bytes"] / value(cost.M, env))


def format_measured(records, cache) -> str:
    """One row per variant and sizes: the predicted M next to cachegrind's last-level bytes,
    and how those grew from the variant's previous row (an exponent of the one size that
    changed)."""
    rows = [("variant", "sizes", "F", "M predicted", "LL measured", "measured/M", "M_min",
             "growth", "working set", "Ir", "Dr", "Dw", "DLmr", "DLmw")]
    last = {}
    for r in records:
        m, sizes, ws = r["measured"], r["sizes"], r["working_set"]["value"]
        rows.append((r["variant"], " ".join(f"{k}={v}" for k, v in sizes.items()),
                     number(r["F"]["value"]), number(r["M"]["value"]), number(m["ll_bytes"]),
                     f"{r['ratio']:.3f}", number(r["M_min"]["value"]),
                     _growth(last.get(r["variant"]), (sizes, m["ll_bytes"])),
                     number(ws) + (" > LL" if ws > cache.ll_bytes else ""),
                     *(number(m[k]) for k in ("Ir", "Dr", "Dw", "DLmr", "DLmw"))))
        last[r["variant"]] = (sizes, m["ll_bytes"])
    notes = _notes(f"LL measured: cachegrind's last-level misses (reads and write-allocates; no "
                   f"write-backs) x {cache.line}-byte lines, a "
                   f"{number(cache.ll_bytes)}-byte last level, one thread. growth: the exponent k of "
                   f"LL measured ~ size^k from the row before. working set: what M's cache "
                   f"assumption needs the cache to hold.", indent="")
    return "\n".join(_table(rows) + notes) + "\n"


def _growth(before, now) -> str:
    if before is None:
        return ""
    (s0, b0), (s1, b1) = before, now
    changed = [k for k in s1 if s1[k] != s0[k]]
    if len(changed) != 1 or not b0 or not b1:
        return ""
    return f"{math.log(b1 / b0) / math.log(s1[changed[0]] / s0[changed[0]]):.2f}"


def format_cuda(reports) -> str:
    rows = [("arch", "__global__ kernel", "nest", "registers", "smem", "stack", "spill st/ld",
             "SASS atomics", "ONF atomic updates")]
    for r in reports:
        onf = ", ".join(f"{a}: {n}" for a, n in r.onf_atomics.items()) or "none"
        rows.append((r.arch, r.name, r.nest, str(r.registers), str(r.shared_bytes),
                     str(r.stack_bytes), f"{r.spill_stores}/{r.spill_loads}", str(r.sass_atomics), onf))
    return "\n".join(_table(rows)) + "\n"


def cuda_json(reports) -> list:
    return [dict(vars(r), onf_atomics={a: str(n) for a, n in r.onf_atomics.items()}) for r in reports]
