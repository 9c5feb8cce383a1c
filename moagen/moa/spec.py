"""A kernel specification: named inputs, scalar parameters and outputs, each output a MoA
expression with the names of its index axes (which become loop variables)."""
from dataclasses import dataclass
from typing import Optional, Tuple

import sympy
from sympy.core.function import AppliedUndef

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
class Packed:
    """How an output of a packed batch is stored (moagen.kernels.attention_varlen): its value
    is lifted over the sequences, index name `var`, and its index name `rows` runs over
    sequence var's rows, stored at rows `offsets`(var) + rows of the array's first axis
    (extent offsets.offsets_into); the other axes follow in order, var's left out. The
    sequence's rows, its extent offsets(var + 1) - offsets(var), bound the loop that
    stores them: no row of another sequence is visited."""
    var: str
    rows: str
    offsets: E.Array

    def stored(self, index, shape):
        """The stored index and shape of a value of index names `index` (symbols) and
        `shape`."""
        names = [i.name for i in index]
        s, r = names.index(self.var), names.index(self.rows)
        rest = [k for k in range(len(index)) if k not in (s, r)]
        at = (E.element(self.offsets, index[s]) + index[r],) + tuple(index[k] for k in rest)
        return at, (self.offsets.offsets_into,) + tuple(shape[k] for k in rest)


    def read(self, array: E.Array, heads) -> E.Expr:
        """Sequence var's rows of head `heads` (index names) of a packed array laid out as
        `stored` lays an output, rows first and the heads next: the rows offsets(var) ..
        offsets(var + 1) - 1 of array[:, heads, ...]; the inverse of `stored`, by which a
        packed input is read and a packed output's saved value or cotangent read back."""
        first = E.element(self.offsets, self.var)
        extent = E.element(self.offsets, E.sym(self.var) + 1) - first
        rank = len(array.shape)
        heads_last = E.transpose(array, tuple(range(1, len(heads) + 1)) + (0,) +
                                 tuple(range(len(heads) + 1, rank)))
        return E.take(extent, E.drop(first, E.psi(heads, heads_last)))


@dataclass(frozen=True)
class PackedRead:
    """A node that is `Packed.read`: array's rows of sequence var (its first row
    offsets(var), offsets the name of the integer array) at head `heads`."""
    array: E.Array
    offsets: str
    var: str
    heads: Tuple[str, ...]


def packed_read(node: E.Expr) -> Optional[PackedRead]:
    """What `node` reads where it is a Packed.read, else None."""
    if not (isinstance(node, E.Take) and isinstance(node.array, E.Drop)
            and node.axis == 0 and node.array.axis == 0):
        return None
    first, psi = node.array.count, node.array.array
    if not (isinstance(first, AppliedUndef) and len(first.args) == 1
            and isinstance(first.args[0], sympy.Symbol)):
        return None
    var = first.args[0]
    if sympy.simplify(node.count - (first.func(var + 1) - first)) != 0:
        return None
    if not (isinstance(psi, E.Psi) and isinstance(psi.array, E.Transpose)
            and isinstance(psi.array.array, E.Array)
            and all(isinstance(i, sympy.Symbol) for i in psi.index)):
        return None
    h, rank = len(psi.index), len(psi.array.perm)
    if psi.array.perm != tuple(range(1, h + 1)) + (0,) + tuple(range(h + 1, rank)):
        return None
    return PackedRead(psi.array.array, first.func.__name__, var.name,
                      tuple(i.name for i in psi.index))


@dataclass(frozen=True)
class Output:
    name: str
    value: E.Expr
    index: Tuple[str, ...]
    packed: Optional[Packed] = None  # stored packed (a varlen batch's), else as indexed


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
            # a packed output's sequence index is free in its rows' extents (cu_q(s))
            bound = sizes | ({E.sym(o.packed.var)} if o.packed else set())
            if o.packed and not {o.packed.var, o.packed.rows} <= set(o.index):
                raise SpecError(f"{self.name}.{out}: packed over {o.packed.var} and "
                                f"{o.packed.rows}, not both of its index names {o.index}")
            if o.packed and o.packed.offsets not in self.inputs:
                raise SpecError(f"{self.name}.{out}: its offsets {o.packed.offsets.name} are "
                                "not an input")
            unknown = {s for d in shape for s in d.free_symbols} - bound
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
                if used - bound:
                    raise SpecError(f"{self.name}.{out}: {E.describe(node)} uses sizes "
                                    f"{sorted(map(str, used - bound))} that no input determines")
        return self

