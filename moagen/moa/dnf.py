"""psi-reduction to the Denotational Normal Form.

For each output, apply psi with a generic full index (the output's index names) and push it
inward rule by rule until psi is applied only to named inputs:

    <i j> psi transpose(A)        ->  <j i> psi A
    <i c> psi (A +.x B)           ->  sum_k (<i k> psi A) * (<k c> psi B)
    <i> psi (A + B)               ->  (<i> psi A) + (<i> psi B)
    <p q> psi omega(-, A, r)      ->  (<p q> psi A) - (<p> psi r)

The result is one scalar expression per output with no intermediate arrays. A variant that
materializes a Named intermediate (the standard attention writes its score matrix) gets an
extra definition for it, and the outputs read it like an input.
"""
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import sympy

from moagen.errors import SpecError
from moagen.moa import expr as E
from moagen.moa import scalar as S
from moagen.moa.shape import fmt_shape, shape_of
from moagen.moa.spec import KernelSpec

REDUCE_WORD = {"+": "sum", "max": "max"}


@dataclass(frozen=True)
class Definition:
    """target[index] = body for every index in shape."""
    target: str
    index: Tuple[sympy.Symbol, ...]
    shape: E.Shape
    body: S.ScalarExpr
    temp: bool  # a materialized intermediate, not an output
    # a packed output's (spec.Packed): where target[index] is stored, and the array's shape
    stored: Optional[Tuple[Tuple[sympy.Expr, ...], E.Shape]] = None

    @property
    def store_index(self):
        return self.stored[0] if self.stored else self.index

    @property
    def array_shape(self):
        return self.stored[1] if self.stored else self.shape


@dataclass(frozen=True)
class DNF:
    spec: KernelSpec
    definitions: Tuple[Definition, ...]  # in the order they are needed

    @property
    def temps(self):
        return tuple(d for d in self.definitions if d.temp)


def psi_reduce(spec: KernelSpec, materialize=frozenset()) -> DNF:
    spec.validate()
    labels = {n.label for o in spec.outputs for n in _named(o.value)}
    unknown = set(materialize) - labels
    if unknown:
        raise SpecError(f"{spec.name}: cannot materialize {sorted(unknown)}: the spec names "
                        f"only {sorted(labels) or 'no intermediates'}")
    reducer = _Reducer(spec, frozenset(materialize))
    for o in spec.outputs:
        index = tuple(E.sym(n) for n in o.index)
        body = reducer.psi(index, o.value, ())
        shape = shape_of(o.value)
        if o.packed:
            if o.name in labels:
                raise SpecError(f"{spec.name}.{o.name}: a packed output cannot be Named")
            reducer.define(Definition(o.name, index, shape, body, temp=False,
                                      stored=o.packed.stored(index, shape)))
        elif body != S.Access(o.name, index):  # else the output was defined where it is Named
            reducer.define(Definition(o.name, index, shape, body, temp=False))
    for d in reducer.definitions.values():
        read = {a for n in d.shape for a in E.elements_read(n)}
        if d.temp and read:  # its scratch could not be sized before the call
            raise SpecError(f"{spec.name}: cannot materialize {d.target}: its shape "
                            f"{fmt_shape(d.shape)} reads the values of {', '.join(sorted(read))}")
    return DNF(spec, tuple(reducer.definitions.values()))


# env: the enclosing Lifts, as (var symbol, extent, the index expression bound to it)
Env = Tuple[Tuple[sympy.Symbol, sympy.Expr, sympy.Expr], ...]


class _Reducer:
    def __init__(self, spec: KernelSpec, materialize):
        self.materialize = materialize
        self.reserved = ({s.name for s in spec.sizes} | {a.name for a in spec.inputs}
                         | set(spec.scalars) | {o.name for o in spec.outputs}
                         | {i for o in spec.outputs for i in o.index})
        self.outputs = {o.name for o in spec.outputs}
        self.in_condition = False  # comparisons are values only inside a Where's condition
        self.flags = {a.name for a in spec.inputs if a.element == "bool"}  # bool arrays: masks
        self.definitions: Dict[str, Definition] = {}  # temporaries and outputs, in order

    def define(self, definition: Definition):
        if definition.target in self.definitions:
            raise SpecError(f"{definition.target} is defined twice: an output's Named "
                            f"intermediate must be that output's own value")
        self.definitions[definition.target] = definition

    def fresh(self, hint) -> sympy.Symbol:
        """A bound variable named after its role, distinct from every other name in the DNF
        (j, j2, j3, ...): no reduction shadows another. The ONF gives back the plain role
        name wherever it is free."""
        name, k = hint, 2
        while name in self.reserved:
            name, k = f"{hint}{k}", k + 1
        self.reserved.add(name)
        return E.sym(name)

    def psi(self, idx, node, env: Env) -> S.ScalarExpr:
        idx = tuple(idx)
        if isinstance(node, E.Array):
            if node.name in self.flags and not self.in_condition:
                raise SpecError(f"{node.name}: a bool array can only be a Where's condition")
            return S.Access(node.name, idx)
        if isinstance(node, E.Scalar):
            return S.Param(node.name)
        if isinstance(node, E.Const):
            return S.Num(node.value)
        if isinstance(node, E.Dim):
            return S.Dim(node.value)
        if isinstance(node, E.Psi):
            bind = {var: value for var, _, value in env}
            return self.psi(tuple(sympy.sympify(p).xreplace(bind) for p in node.index) + idx,
                            node.array, env)
        if isinstance(node, E.Take):
            return self.psi(idx, node.array, env)
        if isinstance(node, E.Drop):
            ax = node.axis % len(idx)
            return self.psi(_put(idx, ax, idx[ax] + node.count), node.array, env)
        if isinstance(node, E.Reverse):
            ax = node.axis % len(idx)
            n = shape_of(node.array)[ax]
            return self.psi(_put(idx, ax, n - 1 - idx[ax]), node.array, env)
        if isinstance(node, E.Transpose):
            source = [None] * len(idx)
            for k, p in enumerate(node.perm):
                source[p] = idx[k]
            return self.psi(tuple(source), node.array, env)
        if isinstance(node, E.Cat):
            ax = node.axis % len(idx)
            split = shape_of(node.left)[ax]
            # both branches clamped into range: a backend may evaluate both (Fortran's merge)
            left, right = sympy.Min(idx[ax], split - 1), sympy.Max(idx[ax] - split, 0)
            return S.Select(sympy.StrictLessThan(idx[ax], split),
                            self.psi(_put(idx, ax, left), node.left, env),
                            self.psi(_put(idx, ax, right), node.right, env))
        if isinstance(node, E.Iota):
            return S.Dim(idx[0])
        if isinstance(node, E.Dropout):
            row = sympy.Integer(0)
            for i, extent in zip(idx[:-1], node.shape):  # the rows' offset, in Horner form
                row = row * extent + i  # (expanded, n*n would print as a float pow)
            return S.Dropout(row, idx[-1], node.seed, self.psi((), node.p, env))
        if isinstance(node, E.Where):
            self.in_condition = True
            cond = self._operand(idx, node.cond, env)
            self.in_condition = False
            if isinstance(cond, S.Access) and cond.array in self.flags:  # a mask's byte, 0 or 1
                return S.IfGreater(cond, S.Num(0.0), self._operand(idx, node.then, env),
                                   self._operand(idx, node.other, env))
            if not (isinstance(cond, S.Bin) and cond.op in E.COMPARISONS
                    and isinstance(cond.left, S.Dim) and isinstance(cond.right, S.Dim)):
                raise SpecError("Where needs a comparison of indices (built from iota) or a bool "
                                "array as its condition")
            relation = sympy.core.relational.Relational(cond.left.value, cond.right.value, cond.op)
            return S.Select(relation, self._operand(idx, node.then, env),
                            self._operand(idx, node.other, env))
        if isinstance(node, (E.BinOp, E.Outer)) and node.op in E.COMPARISONS \
                and not self.in_condition:
            raise SpecError(f"{E.describe(node)}: a comparison can only be a Where's condition")
        if isinstance(node, E.BinOp):
            return S.Bin(node.op, self._operand(idx, node.left, env),
                         self._operand(idx, node.right, env))
        if isinstance(node, E.Map):
            return S.Un(node.fn, self.psi(idx, node.arg, env))
        if isinstance(node, E.Reduce):
            shape = shape_of(node.array)
            ax = node.axis % len(shape)
            var = self.fresh(node.var)
            body = self.psi(idx[:ax] + (var,) + idx[ax:], node.array, env)
            return S.Reduction(node.op, var, shape[ax], body, _acc_name(node))
        if isinstance(node, E.Inner):
            left = shape_of(node.left)
            var = self.fresh(node.var)
            cut = len(left) - 1
            body = S.Bin(node.mul, self.psi(idx[:cut] + (var,), node.left, env),
                         self.psi((var,) + idx[cut:], node.right, env))
            return S.Reduction(node.add, var, left[-1], body, _acc_name(node))
        if isinstance(node, E.Outer):
            cut = len(shape_of(node.left))
            return S.Bin(node.op, self.psi(idx[:cut], node.left, env),
                         self.psi(idx[cut:], node.right, env))
        if isinstance(node, E.Omega):
            cut = len(shape_of(node.cell))
            return S.Bin(node.op, self.psi(idx, node.array, env),
                         self.psi(idx[:cut], node.cell, env))
        if isinstance(node, E.Lift):
            k = len(node.vars)
            bound = tuple((E.sym(v), ext, idx[i])
                          for i, (v, ext) in enumerate(zip(node.vars, node.extents)))
            return self.psi(idx[k:], node.body, env + bound)
        if isinstance(node, E.Named):
            # an intermediate that is also an output lives in that output, in every variant
            if node.label not in self.materialize and node.label not in self.outputs:
                return self.psi(idx, node.value, env)
            env = self._define_temp(node, env)
            return S.Access(node.label, tuple(v for _, _, v in env) + idx)
        raise SpecError(f"psi-reduction has no rule for {node!r}")

    def _operand(self, idx, node, env):
        """Scalar extension: a shape-() operand is indexed by the empty index."""
        return self.psi(idx if shape_of(node) else (), node, env)

    def _define_temp(self, node: E.Named, env: Env) -> Env:
        """Define the intermediate once, over the enclosing Lift axes its value depends on
        (a transposed weight inside the per-batch body is not repeated per batch); returns
        those axes."""
        if node.label in self.definitions:
            lifted = self.definitions[node.label].index
            return tuple(entry for entry in env if entry[0] in lifted)
        shape = shape_of(node.value)
        if len(node.index) < len(shape):
            raise SpecError(f"Named {node.label}: {len(node.index)} index names for shape "
                            f"{fmt_shape(shape)}")
        own = tuple(E.sym(n) for n in node.index[:len(shape)])
        # the temporary's index names are free in its body: no reduction there may bind them
        self.reserved |= {v.name for v in own} | {var.name for var, _, _ in env}
        identity_env = tuple((var, ext, var) for var, ext, _ in env)
        body = self.psi(own, node.value, identity_env)
        used = S.free_names(body) - {v.name for v in own}  # its own index shadows a Lift's
        if node.label not in self.outputs:  # an output keeps the axes its spec gives it
            env = tuple(entry for entry in env if entry[0].name in used)
        self.define(Definition(node.label, tuple(var for var, _, _ in env) + own,
                               tuple(ext for _, ext, _ in env) + shape, body,
                               temp=node.label not in self.outputs))
        return env


def _put(idx, ax, value):
    return idx[:ax] + (value,) + idx[ax + 1:]


def _acc_name(node):
    return node.name or f"{REDUCE_WORD[node.op if isinstance(node, E.Reduce) else node.add]}_{node.var}"


def _named(node):
    if isinstance(node, E.Named):
        yield node
    for _, child in node.children():
        yield from _named(child)


# ---- printing -------------------------------------------------------------------------

PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def format_scalar(e: S.ScalarExpr, width=88, indent=0) -> str:
    """A readable rendering: flat when it fits in `width`, else reductions open an indented
    block. Accesses print in MoA form, `<b h i k> psi Q`."""
    flat = _flat(e)
    if indent + len(flat) <= width or not S.contains(e, S.Reduction):
        return flat
    pad = " " * (indent + 4)
    if isinstance(e, S.Reduction):
        return (f"{_reduction_head(e)}(\n{pad}{format_scalar(e.body, width, indent + 4)}\n"
                f"{' ' * indent})")
    if isinstance(e, S.Bin):
        left = _wrap(e.left, e.op, False, format_scalar(e.left, width, indent))
        right = _wrap(e.right, e.op, True, format_scalar(e.right, width, indent))
        if e.op in PRECEDENCE:
            return f"{left}\n{' ' * indent}{e.op} {right}"
        return f"{e.op}(\n{pad}{format_scalar(e.left, width, indent + 4)},\n{pad}" \
               f"{format_scalar(e.right, width, indent + 4)}\n{' ' * indent})"
    if isinstance(e, S.Un):
        return f"{e.fn}(\n{pad}{format_scalar(e.arg, width, indent + 4)}\n{' ' * indent})"
    return flat


def _reduction_head(e):
    return f"{REDUCE_WORD[e.op]}[{e.var} < {e.extent}]"


def _wrap(child, op, right_side, text):
    if isinstance(child, S.Bin) and child.op in PRECEDENCE:
        mine, theirs = PRECEDENCE[op], PRECEDENCE[child.op]
        if theirs < mine or (right_side and theirs == mine and op in "-/"):
            return f"({text})"
    return text


def _flat(e) -> str:
    if isinstance(e, S.Access):
        return f"(<{' '.join(map(str, e.index))}> psi {e.array})"
    if isinstance(e, S.Load):
        return f"{e.array}[{e.offset}]"
    if isinstance(e, S.Num):
        return repr(e.value)
    if isinstance(e, S.Dim):
        return str(e.value)
    if isinstance(e, (S.Param, S.Local)):
        return e.name
    if isinstance(e, S.Bin):
        if e.op in PRECEDENCE:
            return (f"{_wrap(e.left, e.op, False, _flat(e.left))} {e.op} "
                    f"{_wrap(e.right, e.op, True, _flat(e.right))}")
        return f"{e.op}({_flat(e.left)}, {_flat(e.right)})"
    if isinstance(e, S.Un):
        return f"{e.fn}({_flat(e.arg)})"
    if isinstance(e, S.Select):
        cond = f"{e.cond.lhs} == {e.cond.rhs}" if isinstance(e.cond, sympy.Eq) else str(e.cond)
        return f"({_flat(e.then)} if {cond} else {_flat(e.other)})"
    if isinstance(e, S.IfGreater):
        return f"({_flat(e.then)} if {_flat(e.left)} > {_flat(e.right)} else {_flat(e.other)})"
    if isinstance(e, S.Dropout):
        return f"dropout({e.row}, {e.key}, seed={e.seed}, p={_flat(e.p)})"
    if isinstance(e, S.Reduction):
        return f"{_reduction_head(e)}({_flat(e.body)})"
    raise TypeError(e)


def format_dnf(dnf: DNF) -> str:
    spec = dnf.spec
    lines = [f"kernel {spec.name}",
             "  inputs:  " + ", ".join(f"{a.name}{fmt_shape(a.shape)}" for a in spec.inputs),
             "  scalars: " + (", ".join(spec.scalars) or "(none)")]
    for d in dnf.definitions:
        kind = "temporary" if d.temp else "output"
        head = f"{d.target}[{', '.join(map(str, d.store_index))}]"
        lines += ["", f"{kind} {d.target}{fmt_shape(d.array_shape)}:"]
        if d.stored:  # a packed output: its loops' extents are not its array's
            lines.append("  for " + ", ".join(f"{i} < {n}" for i, n in zip(d.index, d.shape)))
        lines += [f"  {head} =", "    " + format_scalar(d.body, indent=4)]
    return "\n".join(lines) + "\n"
