"""DNF -> ONF: one loop nest per definition, then the variant's steps for a target (its
algorithm, loop schedule and mapping), then the closing steps every ONF ends with:
reductions become accumulator loops, gamma flattens indices, and innermost loops the
compiler may vectorize are marked simd; a tiled CUDA nest's shared memory is laid out
last, once its statements are final."""
from typing import Sequence

import sympy

from moagen.errors import ScheduleError
from moagen.moa.dnf import DNF, format_scalar
from moagen.onf.loops import Buffer, Loop, Nest, ONF, Store, walk
from moagen.steps.gpu.closing import close_tiled
from moagen.steps.loop.layout import ApplyLayout
from moagen.steps.loop.reductions import LowerReductions
from moagen.steps.loop.simd import MarkSimd


def initial_onf(dnf: DNF, variant: str, layout: str = "row") -> ONF:
    """The literal DNF: loops over every output index around one store."""
    spec = dnf.spec
    nests = []
    for d in dnf.definitions:
        body = (Store(d.target, d.store_index, d.body),)
        for var, extent in reversed(list(zip(d.index, d.shape))):
            body = (Loop(var, sympy.Integer(0), extent, body),)
        head = f"{d.target}[{', '.join(map(str, d.store_index))}] = "
        nests.append(Nest(d.target, body, head + format_scalar(d.body, indent=len(head))))
    buffers = lambda defs: tuple(Buffer(d.target, d.array_shape) for d in defs)
    order = [o.name for o in spec.outputs]  # the order a call returns them in
    return ONF(spec.name, variant,
               inputs=tuple(Buffer(a.name, a.shape, a.element, a.offsets_into)
                            for a in spec.inputs),
               outputs=buffers(sorted((d for d in dnf.definitions if not d.temp),
                                      key=lambda d: order.index(d.target))),
               temps=buffers(dnf.temps), sizes=spec.sizes, scalars=spec.scalars,
               nests=tuple(nests), layout=layout)


# what every schedule ends with: the reductions its steps left become accumulator loops,
# gamma flattens every index, and the loops the compiler may vectorize are marked
CLOSING = (LowerReductions(), ApplyLayout(), MarkSimd())


def realize(dnf: DNF, variant: str, steps: Sequence, layout: str = "row", upto=None,
            element_bytes=None) -> ONF:
    """The final ONF; upto = K: the ONF after the first K steps, as they left it;
    element_bytes: the element sizes its tiled CUDA nests are laid out and checked at (the
    dtypes it is printed for; None: every one)."""
    onf = initial_onf(dnf, variant, layout)
    for step in (tuple(steps) + CLOSING)[:upto]:
        onf = step(onf)
    if upto is None:
        _check_tails_mapped(onf)
        onf = close_tiled(onf, element_bytes)
    return onf


def _check_tails_mapped(onf: ONF):
    """A tail of a nest with parallel loops must have some too: left sequential, it would
    run on one thread (its parent's Parallel maps it where it starts with the same loops)."""
    parallel = {n.label for n in onf.nests
                if any(isinstance(s, Loop) and s.parallel for s in walk(n.body))}
    for n in onf.nests:
        if n.parent in parallel and n.label not in parallel:
            raise ScheduleError(f"{onf.name} {onf.variant}: nest {n.label} (a tail of "
                                f"{n.parent}) has no parallel loops; map it with a Parallel "
                                "of its own")
