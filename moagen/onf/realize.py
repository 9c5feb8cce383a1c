"""DNF -> ONF: one loop nest per definition, then the variant's schedule, then the three
steps every ONF ends with (reductions become accumulator loops; gamma flattens indices;
innermost loops the compiler may vectorize are marked simd)."""
from typing import Sequence

import sympy

from moagen.moa.dnf import DNF, format_scalar
from moagen.onf.layout import apply_layout
from moagen.onf.loops import Buffer, Loop, Nest, ONF, Store
from moagen.onf.reductions import lower_reductions
from moagen.onf.simd import mark_simd


def initial_onf(dnf: DNF, variant: str, layout: str = "row") -> ONF:
    """The literal DNF: loops over every output index around one store."""
    spec = dnf.spec
    nests = []
    for d in dnf.definitions:
        body = (Store(d.target, d.index, d.body),)
        for var, extent in reversed(list(zip(d.index, d.shape))):
            body = (Loop(var, sympy.Integer(0), extent, body),)
        head = f"{d.target}[{', '.join(map(str, d.index))}] = "
        nests.append(Nest(d.target, body, head + format_scalar(d.body, indent=len(head))))
    buffers = lambda defs: tuple(Buffer(d.target, d.shape) for d in defs)
    order = [o.name for o in spec.outputs]  # the order a call returns them in
    return ONF(spec.name, variant,
               inputs=tuple(Buffer(a.name, a.shape) for a in spec.inputs),
               outputs=buffers(sorted((d for d in dnf.definitions if not d.temp),
                                      key=lambda d: order.index(d.target))),
               temps=buffers(dnf.temps), sizes=spec.sizes, scalars=spec.scalars,
               nests=tuple(nests), layout=layout)


def realize(dnf: DNF, variant: str, schedule: Sequence, layout: str = "row") -> ONF:
    onf = initial_onf(dnf, variant, layout)
    for transform in schedule:
        onf = transform(onf)
    return mark_simd(apply_layout(lower_reductions(onf)))
