"""A kernel specification: named inputs, scalar parameters and outputs, each output a MoA
expression with the names of its index axes (which become loop variables)."""
from dataclasses import dataclass
from typing import Tuple

import sympy

from moagen.errors import SpecError
from moagen.moa import expr as E
from moagen.moa.shape import check, fmt_shape, same_shape, shape_of


def sizes_of(arrays) -> Tuple[sympy.Symbol, ...]:
    """The size symbols of the arrays' shapes in order of first appearance."""
    seen = []
    for a in arrays:
        for dim in a.shape:
            seen += [s for s in sorted(dim.free_symbols, key=lambda s: s.name) if s not in seen]
    return tuple(seen)


@dataclass(frozen=True)
class Output:
    name: str
    value: E.Expr
    index: Tuple[str, ...]


@dataclass(frozen=True)
class KernelSpec:
    name: str
    inputs: Tuple[E.Array, ...]
    scalars: Tuple[str, ...]
    outputs: Tuple[Output, ...]
    given: Tuple[str, ...] = ()  # sizes passed at call time, e.g. a KV cache's valid rows

    @property
    def sizes(self) -> Tuple[sympy.Symbol, ...]:
        """The size symbols of the inputs' shapes, then the given ones: the order of the
        integer arguments in every language."""
        seen = sizes_of(self.inputs)
        return seen + tuple(E.sym(g) for g in self.given if E.sym(g) not in seen)

    def output_shapes(self):
        return {o.name: check(o.value, f"{self.name}.{o.name}") for o in self.outputs}

    def validate(self):
        """Check the whole spec: shapes, names, and that every array and scalar the outputs
        use is declared. Raises SpecError / ShapeError."""
        names = [a.name for a in self.inputs] + list(self.scalars) + [o.name for o in self.outputs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise SpecError(f"{self.name}: names used twice: {', '.join(dupes)}")
        declared = {a.name: a for a in self.inputs}
        sizes = set(self.sizes)
        for out, shape in self.output_shapes().items():
            o = next(o for o in self.outputs if o.name == out)
            if len(o.index) != len(shape):
                raise SpecError(f"{self.name}.{out}: {len(o.index)} index names for an output "
                                f"of shape {fmt_shape(shape)}")
            unknown = {s for d in shape for s in d.free_symbols} - sizes
            if unknown:
                raise SpecError(f"{self.name}.{out}: output shape {fmt_shape(shape)} uses sizes "
                                f"{sorted(map(str, unknown))} that no input determines")
            for node in E.walk(o.value):
                if isinstance(node, E.Array):
                    ref = declared.get(node.name)
                    if ref is None:
                        raise SpecError(f"{self.name}.{out}: array {node.name} is not an input")
                    if not same_shape(ref.shape, node.shape):
                        raise SpecError(f"{self.name}.{out}: array {node.name} used with shape "
                                        f"{fmt_shape(node.shape)}, declared {fmt_shape(ref.shape)}")
                if isinstance(node, E.Scalar) and node.name not in self.scalars:
                    raise SpecError(f"{self.name}.{out}: scalar {node.name} is not declared")
                # a size inside the expression (a Dim, a reduced take) must be an argument too
                used = {s for d in shape_of(node) for s in d.free_symbols}
                if isinstance(node, E.Dim):
                    used |= node.value.free_symbols
                if isinstance(node, E.Dropout):
                    used |= node.seed.free_symbols
                if used - sizes:
                    raise SpecError(f"{self.name}.{out}: {E.describe(node)} uses sizes "
                                    f"{sorted(map(str, used - sizes))} that no input determines")
        return self

