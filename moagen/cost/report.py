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
    return [dict(vars(r), onf_atomics={a: str(n) for a, n in r.onf_atomics.items()},
                 loops=[m.as_dict() for m in r.loops]) for r in reports]


LOOP_COLUMNS = ("FFMA", "DFMA", "FMUL", "FADD", "DMUL", "DADD", "HMMA", "DMMA", "LDG", "LD", "STG",
                "ST", "LDS", "STS", "LDL", "STL", "SHFL", "BAR", "atomics", "integer")


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _maybe(v, scale=1.0, digits=4) -> str:
    return "?" if v is None else f"{v * scale:,.{digits}g}"


def format_gpu(m) -> str:
    """A call's CUDA kernels on a GPU model (moagen.cost.gpu_metrics.CallMetrics): launch,
    resources and occupancy; the innermost loops' instructions; bytes, flops and bounds."""
    from moagen.cost.gpu import OCCUPANCY_ROUNDING
    from moagen.cost.gpu_metrics import GPU_TRAFFIC

    g = m.gpu
    sizes = " ".join(f"{k}={v}" for k, v in m.sizes.items())
    lines = [f"{m.kernel}, variant {m.variant}: CUDA kernels on an {g.name} ({g.arch}, {g.sms} SMs), "
             f"{m.dtype}, {sizes}"]
    rows = [("__global__ kernel", "nest", "grid", "blocks", "block", "waves", "regs", "spill st/ld B",
             "smem static+dyn B", "blocks/SM", "warps/SM", "limited by", "MB moved", "GFLOP",
             "bound us", "bound by")]
    for k in m.kernels:
        rows.append((k.name, k.nest, "x".join(map(str, k.grid)), str(k.blocks),
                     "x".join(map(str, k.block)),
                     f"{k.waves:.3g}", str(k.registers), f"{k.spill_stores}/{k.spill_loads}",
                     f"{k.static_shared}+{k.dynamic_shared}", str(k.occupancy.blocks),
                     f"{k.occupancy.warps} ({k.occupancy.fraction:.0%})", k.occupancy.limiter,
                     _maybe(k.bytes, 1e-6), _maybe(k.flops, 1e-9), _maybe(k.bound_s, 1e6),
                     k.bound_by))
    lines += _table(rows, indent="  ")
    measured = (f"PyTorch measured {m.measured.ms:g} ms ({m.measured.source}: "
                f"{m.measured.computes})" if m.measured else
                "no measurement (no PyTorch time at this kernel, dtype and sizes)")
    lines.append(f"  call: {_maybe(m.bytes, 1e-6)} MB, {_maybe(m.flops, 1e-9)} GFLOP; roofline "
                 f"bound {_maybe(m.bound_s, 1e3)} ms (the launches' max(bytes / "
                 f"{g.hbm_bytes_per_s / 1e12:g} TB/s, flops / {g.peak_flops[m.dtype] / 1e12:g} "
                 f"TFLOP/s{_tensor_peaks(m)}) added); {measured}")
    lines.append("  innermost loops (SASS; * the one with the most FMA, the kernel's summary; "
                 "total: all its innermost loops)")
    mixes_of = {k.name: list(k.loops.loops) + ([k.loops.total] if len(k.loops.loops) > 1 else [])
                for k in m.kernels}
    every = [mix for mixes in mixes_of.values() for mix in mixes]
    # a class no loop of the call has is left out (--json has every one)
    shown = [c for c in LOOP_COLUMNS if c in ("FFMA" if m.dtype == "float32" else "DFMA", "LDG")
             or any(mix.counts[c] for mix in every)]
    vectors = [("LDG.128", "ldg_128"), ("LDS.128", "lds_128")]
    vectors = [(head, key) for head, key in vectors if any(getattr(x, key) for x in every)]
    rows = [("__global__ kernel", "loop", "instr", *shown, *(head for head, _ in vectors),
             "FMA/gld", "FMA/LDS", "gld+gst")]
    for k in m.kernels:
        if not mixes_of[k.name]:
            rows.append((k.name, "no loop", *[""] * (len(rows[0]) - 2)))
        for mix in mixes_of[k.name]:
            mark = "*" if mix is k.loops.hot else ""
            where = "total" if mix is k.loops.total else f"{mix.start:#x}-{mix.end:#x}{mark}"
            rows.append((k.name, where, str(mix.instructions),
                         *(str(mix.counts[c]) for c in shown),
                         *(str(getattr(mix, key)) for _, key in vectors),
                         _ratio(mix.fma_per_global_load), _ratio(mix.fma_per_shared_load),
                         str(mix.global_loads + mix.global_stores)))
    lines += _table(rows, indent="  ")
    lines += _notes(f"Occupancy: {OCCUPANCY_ROUNDING}. waves: blocks / ({g.sms} SMs x blocks "
                    f"an SM). MB moved: {GPU_TRAFFIC}; flops: moagen.cost.flops (exp, div "
                    "apart, not in the bound).",
                    "Loops: a backward BRA spans [its target, itself]; innermost: containing no "
                    "other; static counts (an unrolled body counts each copy). Columns no loop "
                    "has are left out (--json has all). FMA: FFMA + DFMA (HMMA, DMMA apart); "
                    "gld: LDG + LD (generic), gst: STG + ST; integer: IMAD, IADD3, LEA, SHF, LOP3.",
                    "Trust: registers, spills, shared memory and the loops' instructions are "
                    "the compiler's; occupancy and waves follow from them exactly; the bound is "
                    "a floor (perhaps within 30-50% for a well-tiled kernel, far below the time "
                    "of an untiled one); bank conflicts, scheduling, latency and L2 hit rates "
                    "need the device.")
    return "\n".join(lines) + "\n"


def gpu_json(m) -> dict:
    from dataclasses import asdict
    kernels = []
    for k in m.kernels:
        kernels.append(dict(
            name=k.name, nest=k.nest, grid=list(k.grid), block=list(k.block), blocks=k.blocks,
            threads=k.threads, waves=k.waves, registers=k.registers,
            spill_stores=k.spill_stores, spill_loads=k.spill_loads,
            static_shared=k.static_shared, dynamic_shared=k.dynamic_shared,
            occupancy=dict(blocks=k.occupancy.blocks, warps=k.occupancy.warps,
                           fraction=k.occupancy.fraction, limiter=k.occupancy.limiter,
                           limits=dict(k.occupancy.limits)),
            loops=[mix.as_dict() for mix in k.loops.loops],
            hot_loop=k.loops.hot.as_dict() if k.loops.hot else None,
            loops_total=k.loops.total.as_dict() if k.loops.total else None,
            bytes=k.bytes, flops=k.flops, bound_s=k.bound_s, bound_by=k.bound_by))
    return dict(kernel=m.kernel, variant=m.variant, dtype=m.dtype, sizes=m.sizes,
                gpu=asdict(m.gpu), kernels=kernels, bytes=m.bytes, flops=m.flops,
                bound_s=m.bound_s, measured=asdict(m.measured) if m.measured else None)


def _tensor_peaks(m) -> str:
    """The tensor cores' peaks the call's kernels on them are bounded by, as the call's
    line names them ("" where none is)."""
    used = sorted({k.bound_by[len("compute ("):-1] for k in m.kernels
                   if k.bound_by.startswith("compute (")})
    return "".join(f"; {p} on tensor cores {m.gpu.tensor_flops[p] / 1e12:g}" for p in used)
