"""The `onf` stage dump: an ONF as text, its buffers, schedule and atomic updates above
its nests (`moagen show --stage onf`, the golden files in tests/golden)."""
import sympy

from moagen.moa.dnf import format_scalar
from moagen.moa.shape import fmt_shape
from moagen.onf.count import atomic_updates
from moagen.onf.loops import Barrier, LaneReduce, Let, Loop, ONF, Store, Update


def format_onf(onf: ONF) -> str:
    buffers = lambda bs: ", ".join(f"{b.name}{fmt_shape(b.shape)}" for b in bs) or "(none)"
    lines = [f"kernel {onf.name}, variant {onf.variant}, layout {onf.layout}-major",
             f"  inputs:   {buffers(onf.inputs)}",
             f"  outputs:  {buffers(onf.outputs)}",
             f"  in place: {', '.join(onf.inout) or '(none)'}",
             f"  temps:    {buffers(onf.temps)}",
             *([f"  shared:   {buffers(onf.shared)}"] if onf.shared else []),
             f"  scalars:  {', '.join(onf.scalars) or '(none)'}",
             f"  schedule: {'; '.join(onf.schedule) or '(none)'}",
             f"  atomics:  {_format_atomics(onf)}"]
    for nest in onf.nests:
        lines += ["", f"nest {nest.label}: from {nest.origin}"]
        for layout in nest.shared_layouts:
            lines += _format_shared_layout(layout)
        lines += _format_block(nest.body, 1)
    return "\n".join(lines) + "\n"


def _format_atomics(onf):
    counts = atomic_updates(onf.nests)
    if not counts:
        return "none"
    total = sympy.factor(sum(counts.values()))
    return f"{total} ({', '.join(f'{a}: {c}' for a, c in counts.items())})"


def _format_shared_layout(layout):
    """A tiled nest's shared memory at one element size: each array's place, and the arrays
    its bytes meet."""
    meets = dict(layout.meets)
    lines = [f"  shared memory, {layout.element_bytes}-byte elements: {layout.total} bytes"]
    for a in layout.arrays:
        on = [b for b in meets[a.name] if b != a.name]
        lines.append(f"    {a.name}: {a.count} elements at byte {a.offset}"
                     + (f", meets {', '.join(on)}" if on else ""))
    return lines


def _format_block(stmts, depth):
    pad = "  " * depth
    out = []
    for s in stmts:
        if isinstance(s, Loop):
            gpu = (f", a block of {s.threads} GPU threads an iteration" if s.per_block else
                   f", {s.threads} GPU threads a block" if s.threads else "")
            mark = (f"parallel({s.parallel}{', interleaved' if s.interleave else ''}{gpu}) "
                    if s.parallel else "") + \
                ("vector-tile " if s.vector_tile else "") + ("simd " if s.simd else "") + \
                ("across-threads " if s.across_threads else "") + \
                (f"{s.gpu} " if s.gpu else "")
            out.append(f"{pad}{mark}for {s.var} in [{s.start}, {s.stop}):")
            out += _format_block(s.body, depth + 1)
        elif isinstance(s, Barrier):
            out.append(f"{pad}barrier: {s.why}")
        elif isinstance(s, LaneReduce):
            total = {"+": "sum"}.get(s.op, s.op)
            out.append(f"{pad}{s.name} = {total} of {s.name} over {s.lanes} lanes (shuffles)")
        elif isinstance(s, Let):
            out.append(f"{pad}let {s.name} = {format_scalar(s.value, indent=len(pad))}")
        elif isinstance(s, Update):
            op = {"+": "+=", "=": "="}.get(s.op, f"{s.op}=")
            out.append(f"{pad}{s.name} {op} {format_scalar(s.value, indent=len(pad))}")
        elif isinstance(s, Store):
            op = {None: "=", "+": "+="}.get(s.accumulate, f"{s.accumulate}=")
            atomic = "atomic " if s.atomic else ""
            out.append(f"{pad}{atomic}{s.array}[{', '.join(map(str, s.index))}] {op} "
                       f"{format_scalar(s.value, indent=len(pad))}")
    return out
