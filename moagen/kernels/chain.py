"""The chain rule over a composite: a forward composite's backward, derived from its stages
(reverse mode at the level of kernels, as moagen.moa.grad is at the level of a spec).

Each stage kernel declares its backward (`backward(...)`, in its module's CHAIN table):
the kernel computing its vector-Jacobian product, which reads the stage's arrays by the
forward kernel's own names, the cotangent of an output Y as dY, and writes the gradient of
an input X as dX; an input whose gradient is an output's cotangent as it is (a residual,
Y = R + ...) is declared as passing it through instead; and what of its outputs a kernel
recomputes cheaply from what it keeps (RMSNorm's z from x and the kept statistic).

`vjp` walks the forward's stages in reverse. A stage's output cotangents are complete when
it is reached (everything that read the output came after it): their terms are summed by
`sum_<array>` stages of the adder (`summing`), one per extra term. Each array the backward reads of the forward is an
input of the forward, recomputed where its kernel can, or else kept: the derived backward's
inputs are the forward's, the kept arrays (in the order the forward makes them) and the
cotangents of the forward's outputs; it returns the gradient of every forward input.
"""
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

import sympy

from moagen.errors import SpecError
from moagen.kernels.compose import Composite, Stage
from moagen.moa import expr as E
from moagen.moa.spec import KernelSpec

SUM, RECOMPUTE = "sum_", "_recompute"  # how the stages that are not a backward are labelled


def role(stage: Stage) -> str:
    """What a stage of a derived backward does: 'sum' (adds a cotangent's terms),
    'recompute' (remakes a forward array) or 'backward' (a stage's backward)."""
    if stage.label.startswith(SUM):
        return "sum"
    return "recompute" if stage.label.endswith(RECOMPUTE) else "backward"


@dataclass(frozen=True)
class Recompute:
    """A kernel that remakes some of a forward kernel's outputs from its other arrays."""
    kernel: str
    variant: str
    reads: Tuple[str, ...]
    writes: Tuple[str, ...]
    scalars: Tuple[str, ...]


@dataclass(frozen=True)
class Backward:
    """How a forward kernel's stage is differentiated (made by `backward`)."""
    inputs: Tuple[str, ...]  # the forward kernel's arrays, by role
    outputs: Tuple[str, ...]
    shapes: Mapping[str, Tuple]  # role -> shape in the forward kernel's sizes
    kernel: Optional[str]  # the vector-Jacobian product's kernel (None: only pass-throughs)
    variant: Optional[str]
    primals: Tuple[str, ...]  # forward arrays it reads
    cotangents: Mapping[str, str]  # its argument dY -> the forward output Y
    gradients: Mapping[str, str]  # its result dX -> the forward input X
    passes: Mapping[str, str] = field(default_factory=dict)  # input X -> output Y: dX = dY
    scalars: Tuple[str, ...] = ()
    recompute: Optional[Recompute] = None


def backward(forward: KernelSpec, by: Optional[KernelSpec] = None, variant: Optional[str] = None,
             passes: Optional[Mapping[str, str]] = None, recompute=None) -> Backward:
    """forward's backward: the kernel `by` (its `variant`), the inputs passed through
    (`passes`: input -> output), and `recompute` = (spec, variant) of a kernel remaking some
    outputs. Checks that every name is one of forward's, by the naming rule above."""
    inputs = tuple(a.name for a in forward.inputs)
    outputs = tuple(o.name for o in forward.outputs)
    where = f"backward of {forward.name}"
    passes = dict(passes or {})
    bad = {x: y for x, y in passes.items() if x not in inputs or y not in outputs}
    if bad:
        raise SpecError(f"{where}: passes {bad} do not map inputs to outputs")
    primals, cotangents, gradients = (), {}, {}
    if by is not None:
        primals = tuple(a.name for a in by.inputs if a.name in inputs + outputs)
        cotangents = {a.name: a.name[1:] for a in by.inputs if a.name not in primals}
        gradients = {o.name: o.name[1:] for o in by.outputs}
        unknown = ([d for d, y in cotangents.items() if not d.startswith("d") or y not in outputs]
                   + [d for d, x in gradients.items() if not d.startswith("d") or x not in inputs])
        if unknown:
            raise SpecError(f"{where}: {by.name} has arrays {unknown} that are neither the "
                            f"forward's nor dY (Y an output) nor dX (X an input)")
        twice = set(gradients.values()) & set(passes)
        if twice:
            raise SpecError(f"{where}: {sorted(twice)} both computed by {by.name} and passed")
    remade = None
    if recompute is not None:
        spec, remade_variant = recompute
        reads, writes = tuple(a.name for a in spec.inputs), tuple(o.name for o in spec.outputs)
        if set(reads) - set(inputs + outputs) or set(writes) - set(outputs):
            raise SpecError(f"{where}: {spec.name} reads {reads} and writes {writes}, not the "
                            f"forward's arrays")
        remade = Recompute(spec.name, remade_variant, reads, writes, spec.scalars)
    shapes = {a.name: a.shape for a in forward.inputs}
    shapes.update(forward.output_shapes())
    return Backward(inputs, outputs, shapes, by and by.name, variant, primals, cotangents,
                    gradients, passes, by.scalars if by else (), remade)


@dataclass(frozen=True)
class Sum:
    """The kernel that adds two cotangent terms, y = x + r, by its arrays' names (made by
    `summing`)."""
    kernel: str
    variant: str
    x: str
    r: str
    y: str
    shape: Tuple  # y's, in the kernel's sizes


def summing(spec: KernelSpec, variant: str, x: str, r: str) -> Sum:
    """spec (y = x + r, one output, each axis a size of its own) as the adder of cotangent
    terms."""
    (y, shape), = spec.output_shapes().items()
    if not all(isinstance(d, sympy.Symbol) for d in shape):
        raise SpecError(f"{spec.name} adds arrays of shape {shape}: an adder's axes are sizes "
                        "of their own")
    return Sum(spec.name, variant, x, r, y, shape)


def vjp(forward: Composite, rules: Mapping[str, Backward], add: Sum, name: str) -> Composite:
    """The backward composite of `forward` (see the module's docstring)."""
    return _Derivation(forward, rules, add).composite(name)


class _Derivation:
    def __init__(self, forward: Composite, rules: Mapping[str, Backward], add: Sum):
        self.forward, self.rules, self.add = forward, rules, add
        self.made = {}  # array -> (the stage that makes it, its role there)
        self.uses = Counter(forward.outputs)  # array -> how many terms its cotangent has
        for st in forward.stages:
            rule = self.rule(st)
            self.uses.update(st.arrays[role] for role in rule.inputs)
            self.made.update((st.arrays[role], (st, role)) for role in rule.outputs)
        self.terms = defaultdict(list, {y: [f"d{y}"] for y in forward.outputs})
        self.ready = {a.name for a in forward.inputs}  # forward arrays the backward can read
        self.kept, self.stages, self.scalars = [], [], set()

    def rule(self, st: Stage) -> Backward:
        if st.kernel not in self.rules:
            raise SpecError(f"{self.forward.name}, stage {st.label}: {st.kernel} declares no "
                            f"backward (moagen.kernels.chain)")
        return self.rules[st.kernel]

    def composite(self, name: str) -> Composite:
        for st in reversed(self.forward.stages):
            self.differentiate(st)
        gradients = []
        for a in self.forward.inputs:
            total = self.total(a.name, f"{self.forward.name} input {a.name}")
            if total != f"d{a.name}":
                raise SpecError(f"{self.forward.name}: the gradient of {a.name} is {total} as "
                                f"it is; a copy would be needed to return it as d{a.name}")
            gradients.append(total)
        produced = self.forward.produced()
        kept = sorted(self.kept, key=produced.index)
        seeds = tuple(E.Array(f"d{y}", self.shape(y)) for y in self.forward.outputs)
        return Composite(
            name=name,
            inputs=self.forward.inputs + tuple(E.Array(a, self.shape(a)) for a in kept) + seeds,
            scalars=tuple(s for s in self.forward.scalars if s in self.scalars),
            stages=tuple(self.stages), outputs=tuple(gradients))

    def differentiate(self, st: Stage):
        rule = self.rule(st)
        wanted = set(rule.cotangents.values()) | set(rule.passes.values())
        cotangent = {}
        for role in rule.outputs:
            array = st.arrays[role]
            if role in wanted:
                cotangent[role] = self.total(array, f"stage {st.label}'s {role}")
            elif array in self.terms:
                raise SpecError(f"{self.forward.name}: {array} is read after stage {st.label}, "
                                f"whose backward takes no cotangent for its {role}")
        for x, y in rule.passes.items():
            self.terms[st.arrays[x]].append(cotangent[y])
        if rule.kernel is None:
            return
        arrays = {}
        for role in rule.primals:
            self.readable(st.arrays[role])
            arrays[role] = st.arrays[role]
        arrays.update((d, cotangent[y]) for d, y in rule.cotangents.items())
        for d, x in rule.gradients.items():
            array = st.arrays[x]
            term = f"d{array}" if self.uses[array] == 1 else f"d{array}_{st.label}"
            self.terms[array].append(term)
            arrays[d] = term
        self.append(Stage(st.label, rule.kernel, rule.variant, arrays, st.sizes), rule.scalars)

    def append(self, stage: Stage, scalars=()):
        self.stages.append(stage)
        self.scalars.update(scalars)

    def total(self, array: str, what: str) -> str:
        """The name of array's cotangent: its one term, or the sum of its terms (add stages
        appended, the last writing d<array>)."""
        terms = self.terms.pop(array, [])
        if not terms:
            raise SpecError(f"{self.forward.name}: no cotangent reaches {array} ({what})")
        total = terms[0]
        for k, term in enumerate(terms[1:], 1):
            last = k == len(terms) - 1
            out = f"d{array}" if last else f"d{array}_{k}"
            label = f"{SUM}{array}" + ("" if len(terms) == 2 else str(k))
            self.append(Stage(label, self.add.kernel, self.add.variant,
                              {self.add.x: total, self.add.r: term, self.add.y: out},
                              self.sum_sizes(array)))
            total = out
        return total

    def sum_sizes(self, array: str) -> Dict[str, str]:
        """The adder's sizes as the array's dimensions."""
        shape = self.shape(array)
        if len(shape) != len(self.add.shape):
            raise SpecError(f"{self.forward.name}: {array}'s cotangent has terms to add, of "
                            f"shape {shape}, which {self.add.kernel} does not add")
        return {d.name: str(s) for d, s in zip(self.add.shape, shape) if d.name != str(s)}

    def readable(self, array: str):
        """Make a forward array readable by the backward: recomputed by its kernel's
        Recompute (what that reads made readable first), or else kept."""
        if array in self.ready:
            return
        st, role = self.made[array]
        remade = self.rule(st).recompute
        if remade is not None and role in remade.writes:
            for r in remade.reads:
                self.readable(st.arrays[r])
            self.append(Stage(f"{st.label}{RECOMPUTE}", remade.kernel, remade.variant,
                              {r: st.arrays[r] for r in remade.reads + remade.writes}, st.sizes),
                        remade.scalars)
            self.ready.update(st.arrays[w] for w in remade.writes)
        else:
            self.kept.append(array)
            self.ready.add(array)

    def shape(self, array: str) -> Tuple:
        """A forward array's shape in the composite's sizes."""
        if array not in self.made:
            return next(a.shape for a in self.forward.inputs if a.name == array)
        st, role = self.made[array]
        shape = tuple(map(sympy.sympify, self.rule(st).shapes[role]))
        return tuple(d.xreplace(st.size_map(d.free_symbols)) for d in shape)
