"""Composite kernels: a sequence of registered kernels (stages) emitted as one kernel.

A stage names a kernel and variant and binds each of its arrays to an array of the
composite (an input, or what an earlier stage wrote); its sizes map to the composite's.
The generator takes each stage's ONF, renames its arrays and sizes, checks that every
bound array has the same shape on both sides, and runs the nests one after the other.
Arrays the stages write that the caller does not get are scratch (allocated by the Python
caller like any kernel's temporaries); a stage's own temporaries become `<stage>_<name>`.

A forward composite names its backward (`keep_for`): what the backward reads of the
forward's intermediates is returned to the caller as well. That list is the block's
retention, derived here, not written down.
"""
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Dict, Optional, Tuple

import sympy

from moagen.errors import SpecError
from moagen.moa import expr as E
from moagen.moa import scalar as S
from moagen.moa.shape import fmt_shape, same_shape
from moagen.moa.spec import sizes_of
from moagen.onf.loops import (ONF, Barrier, Buffer, Grid, LaneReduce, Let, Loop, Mma, Nest,
                              SharedArray, Store, Update, bound_symbol)


@dataclass(frozen=True)
class Stage:
    label: str  # names the stage's nests and temporaries
    kernel: str
    variant: str
    arrays: Dict[str, str]  # the stage kernel's array -> the composite's
    sizes: Dict[str, str] = field(default_factory=dict)  # the stage's size -> the composite's

    def size_map(self, symbols) -> Dict[sympy.Symbol, sympy.Expr]:
        """Each of the stage kernel's size symbols -> the composite's size it stands for."""
        return {s: E.as_dim(self.sizes.get(s.name, s.name)) for s in symbols}


@dataclass(frozen=True)
class Composite:
    name: str
    inputs: Tuple[E.Array, ...]
    scalars: Tuple[str, ...]
    stages: Tuple[Stage, ...]
    outputs: Tuple[str, ...]  # what the caller gets (before the kept activations)
    keep_for: Optional["Composite"] = None  # the backward whose inputs decide what is kept

    def produced(self) -> Tuple[str, ...]:
        """Every composite array a stage writes, in order."""
        out = []
        for st in self.stages:
            out += [dst for src, dst in st.arrays.items() if dst not in out
                    and dst not in {a.name for a in self.inputs}]
        return tuple(out)

    def kept(self) -> Tuple[str, ...]:
        """The intermediates the backward reads: returned to the caller for it."""
        if self.keep_for is None:
            return ()
        wanted = {a.name for a in self.keep_for.inputs}
        return tuple(a for a in self.produced() if a in wanted and a not in self.outputs)

    @property
    def sizes(self) -> Tuple[sympy.Symbol, ...]:
        return sizes_of(self.inputs)


def compose(composite: Composite, stage_onf) -> ONF:
    """The composite's ONF; stage_onf(stage) gives a stage kernel's ONF."""
    shapes = {a.name: a.shape for a in composite.inputs}
    known_sizes = set(composite.sizes)
    nests, temps, schedule, shared = [], [], [], []
    for st in composite.stages:
        onf = stage_onf(st)
        where = f"{composite.name}, stage {st.label} ({st.kernel})"
        sizes = st.size_map(onf.sizes)
        for s, value in sizes.items():
            if value.free_symbols - known_sizes:
                raise SpecError(f"{where}: size {s} maps to {value}, which no input determines")
        if set(onf.scalars) - set(composite.scalars):
            raise SpecError(f"{where}: scalars {sorted(set(onf.scalars) - set(composite.scalars))} "
                            f"are not scalars of {composite.name}")
        names = {}
        for buf in onf.inputs + onf.outputs:
            if buf.name not in st.arrays:
                raise SpecError(f"{where}: array {buf.name} is not bound")
            names[buf.name] = st.arrays[buf.name]
        unknown = set(st.arrays) - set(names)
        if unknown:
            raise SpecError(f"{where}: binds {sorted(unknown)}, which the kernel does not have")
        for buf in onf.temps + onf.shared:
            names[buf.name] = f"{st.label}_{buf.name}"
        # a tiled CUDA stage's shared tiles, and the compile-time bounds (MAX_d) of its
        # sizes, in the composite's names
        bounds = {x.name: v.name for x, v in sizes.items() if isinstance(v, sympy.Symbol)}
        sizes = {**sizes, **{bound_symbol(x.name): bound_symbol(bounds[x.name])
                             for x in sizes if x.name in bounds}}
        shared += [Buffer(names[b.name], tuple(sympy.sympify(e).xreplace(sizes) for e in b.shape))
                   for b in onf.shared]
        for buf in onf.inputs + onf.outputs + onf.temps:
            shape = tuple(sympy.sympify(d).xreplace(sizes) for d in buf.shape)
            target = names[buf.name]
            if buf in onf.inputs and target not in shapes:
                raise SpecError(f"{where}: reads {target}, which is neither an input nor written "
                                f"by an earlier stage")
            if buf in onf.outputs and target in {a.name for a in composite.inputs}:
                raise SpecError(f"{where}: writes {target}, an input of {composite.name}")
            if target in shapes and not same_shape(shapes[target], shape):
                raise SpecError(f"{where}: {buf.name} has shape {fmt_shape(shape)} but "
                                f"{target} has shape {fmt_shape(shapes[target])}")
            shapes[target] = shape
            if buf in onf.temps:
                temps.append(Buffer(target, shape))
        rename = _Renamer(names, sizes, bounds)
        nests += [Nest(names.get(n.target, n.target),
                       tuple(rename.stmt(s) for s in n.body),
                       f"stage {st.label}: {st.kernel} {onf.variant}\n{n.origin}",
                       f"{st.label}.{n.label}",
                       shared_layouts=tuple(map(rename.layout, n.shared_layouts)))
                  for n in onf.nests]
        schedule.append(f"{st.label} = {st.kernel} {onf.variant}")
    returned = composite.outputs + composite.kept()
    missing = [a for a in returned if a not in shapes]
    if missing:
        raise SpecError(f"{composite.name}: no stage writes {', '.join(missing)}")
    scratch = [a for a in composite.produced() if a not in returned]
    return ONF(composite.name, "composed",
               inputs=tuple(Buffer(a.name, a.shape) for a in composite.inputs),
               outputs=tuple(Buffer(a, shapes[a]) for a in returned),
               temps=tuple(Buffer(a, shapes[a]) for a in scratch) + tuple(temps),
               sizes=composite.sizes, scalars=composite.scalars, nests=tuple(nests),
               schedule=tuple(schedule), flat=True, shared=tuple(shared))


def format_stages(composite: Composite, stage: str, get_kernel) -> str:
    """The `shape` and `dnf` dumps of a composite: its stages, their bindings, and (dnf)
    each stage's own DNF."""
    from moagen.moa.dnf import format_dnf
    lines = [f"composite {composite.name}: {len(composite.stages)} stages",
             f"  returns: {', '.join(composite.outputs)}",
             f"  kept for the backward: {', '.join(composite.kept()) or '(none)'}"]
    for st in composite.stages:
        binds = ", ".join(f"{src} -> {dst}" for src, dst in st.arrays.items())
        sizes = ", ".join(f"{src} -> {dst}" for src, dst in st.sizes.items())
        lines += ["", f"stage {st.label}: {st.kernel} {st.variant}", f"  arrays: {binds}"]
        lines += [f"  sizes: {sizes}"] if sizes else []
        if stage == "dnf":
            kernel = get_kernel(st.kernel)
            lines += ["  " + line for line in format_dnf(kernel.dnf(st.variant)).splitlines()]
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=65536)
def _renamed(e, sizes):
    """e with the sizes (pairs) substituted; remembered: xreplace rebuilds each Min and Max,
    which sympy then compares term by term, and a stage's statements, the block's dtypes and
    its backward repeat the same index expressions."""
    return sympy.sympify(e).xreplace(dict(sizes))


class _Renamer:
    """A stage's statements in the composite's names: arrays renamed, sizes substituted."""

    def __init__(self, arrays, sizes, bounds):
        # a size the composite calls as the stage does (n, batch) left out: xreplace would
        # rebuild every expression holding it, each Min and Max compared again
        self.arrays, self.bounds = arrays, bounds
        self.sizes = tuple((x, v) for x, v in sizes.items() if x != v)

    def index(self, e):
        return _renamed(e, self.sizes)

    def stmt(self, s):
        if isinstance(s, Loop):
            gpu = s.gpu
            if isinstance(gpu, Mma):
                gpu = replace(gpu, terms=tuple(tuple(map(self.operand, t)) for t in gpu.terms),
                              c=self.operand(gpu.c))
            if isinstance(gpu, Grid) and gpu.bounds:
                if any(name not in self.bounds for name, _ in gpu.bounds):
                    raise SpecError(f"a tiled stage's bounded size is no size of the composite: "
                                    f"{', '.join(name for name, _ in gpu.bounds)}")
                gpu = replace(gpu, bounds=tuple((self.bounds[n], v) for n, v in gpu.bounds))
            return replace(s, start=self.index(s.start), stop=self.index(s.stop), gpu=gpu,
                           body=tuple(self.stmt(b) for b in s.body))
        if isinstance(s, Store):
            return replace(s, array=self.arrays[s.array],
                           index=tuple(self.index(i) for i in s.index), value=self.expr(s.value))
        if isinstance(s, (Let, Update)):
            return replace(s, value=self.expr(s.value))
        if isinstance(s, LaneReduce):
            return s
        if isinstance(s, Barrier):
            return replace(s, hazards=tuple(replace(h, array=self.arrays[h.array],
                                                    then_array=self.arrays[h.then_array])
                                            for h in s.hazards))
        raise SpecError(f"cannot rename statement {s!r}")

    def operand(self, operand):
        """A tensor-core product's shared tile in the composite's names: its array, and its
        leading dimension where that is of a compile-time bound (MAX_d + 4)."""
        ldm = operand.ldm if isinstance(operand.ldm, int) else self.index(operand.ldm)
        return replace(operand, array=self.arrays[operand.array], ldm=ldm)

    def layout(self, layout):
        """A tiled stage's shared layout in the composite's array and bound names."""
        return replace(layout, total=self.index(layout.total),
                       arrays=tuple(SharedArray(self.arrays[a.name], self.index(a.offset),
                                                self.index(a.count)) for a in layout.arrays),
                       meets=tuple((self.arrays[a], tuple(self.arrays[b] for b in on))
                                   for a, on in layout.meets))

    def expr(self, e):
        if isinstance(e, S.Access):
            return replace(e, array=self.arrays[e.array], index=tuple(map(self.index, e.index)))
        if isinstance(e, S.Load):
            return replace(e, array=self.arrays[e.array], offset=self.index(e.offset))
        if isinstance(e, S.Dim):
            return replace(e, value=self.index(e.value))
        if isinstance(e, S.Select):
            e = replace(e, cond=self.index(e.cond))
        if isinstance(e, S.Reduction):
            e = replace(e, extent=self.index(e.extent))
        return S.map_children(e, self.expr)
