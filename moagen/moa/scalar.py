"""Scalar expressions: what psi-reduction produces (the right-hand side of a DNF) and what
the ONF's statements compute. Index arithmetic is sympy; everything else is a node here.

`Access` is psi with a full index applied to a named array; after the layout step (gamma)
it becomes `Load` with a flat offset. `Local` is a scalar the ONF introduced (a hoisted
value or an accumulator).
"""
import math
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Tuple

import sympy

from moagen.moa.expr import divides, idiv
from moagen.philox import KEYS_PER_RUN


class ScalarExpr:
    pass


@dataclass(frozen=True)
class Access(ScalarExpr):
    array: str
    index: Tuple[sympy.Expr, ...]


@dataclass(frozen=True)
class Load(ScalarExpr):
    array: str
    offset: sympy.Expr


@dataclass(frozen=True)
class Num(ScalarExpr):
    value: float


@dataclass(frozen=True)
class Dim(ScalarExpr):
    """An integer size expression used as a number."""
    value: sympy.Expr


@dataclass(frozen=True)
class Param(ScalarExpr):
    """A scalar argument of the kernel."""
    name: str


@dataclass(frozen=True)
class Local(ScalarExpr):
    name: str


@dataclass(frozen=True)
class Bin(ScalarExpr):
    op: str  # one of moagen.moa.expr.BINARY_OPS
    left: ScalarExpr
    right: ScalarExpr


@dataclass(frozen=True)
class Un(ScalarExpr):
    fn: str  # one of moagen.moa.expr.UNARY_FNS, or exp_flushed (FlushExp's)
    arg: ScalarExpr


# exp_flushed(x) (moagen.steps.loop.flush_exp): exp(x), or 0 where x is below this, by dtype
FLUSHED_BELOW = {"float64": -700.0, "float32": -80.0}


@dataclass(frozen=True)
class Select(ScalarExpr):
    """`then` where the index condition holds, else `other` (catenation)."""
    cond: sympy.Basic
    then: ScalarExpr
    other: ScalarExpr


@dataclass(frozen=True)
class Dropout(ScalarExpr):
    """Dropout's factor at one element, key `key` of row `row` (the offset of the leading
    indices): 1 / (1 - p) where Philox4x32-10 under the key `seed` keeps it at drop
    probability p, else 0 (moagen.moa.expr.Dropout, moagen.philox)."""
    row: sympy.Expr
    key: sympy.Expr
    seed: sympy.Expr
    p: ScalarExpr

    def draw(self):
        """(the key's group of KEYS_PER_RUN, its piece), as index expressions: key 8 g + v
        (v < 8 a number, g's terms multiples of 1) as (g, v), so that the unrolled keys of a
        group read as one (row, group), whose Philox run the compiler makes once."""
        v, rest = sympy.sympify(self.key).as_coeff_Add()
        g = sympy.expand(rest / KEYS_PER_RUN)
        if 0 <= v < KEYS_PER_RUN and divides(KEYS_PER_RUN, rest):
            return g, v
        group = idiv(self.key, KEYS_PER_RUN)
        return group, self.key - KEYS_PER_RUN * group


@dataclass(frozen=True)
class IfGreater(ScalarExpr):
    """`then` where the number left > right, else `other` (the online softmax's choice of
    which of two exponentials is exp(0) = 1)."""
    left: ScalarExpr
    right: ScalarExpr
    then: ScalarExpr
    other: ScalarExpr


@dataclass(frozen=True)
class Reduction(ScalarExpr):
    """op over var in [0, extent) of body. `name` is the accumulator's name in code."""
    op: str  # "+" or "max"
    var: sympy.Symbol
    extent: sympy.Expr
    body: ScalarExpr
    name: str


IDENTITY = {"+": 0.0, "max": float("-inf")}
LEAVES = (Access, Load, Num, Dim, Param, Local)


def children(e: ScalarExpr):
    return [c for c in map(e.__getattribute__, _field_names(type(e)))
            if isinstance(c, ScalarExpr)]


@lru_cache(maxsize=None)
def _field_names(cls) -> tuple:
    """A node class's fields, once (dataclasses.fields builds its tuple on every call, and
    the generator's analyses walk millions of nodes)."""
    return tuple(f.name for f in fields(cls))


def map_children(e: ScalarExpr, fn) -> ScalarExpr:
    """A copy of e with fn applied to each direct child."""
    changes = {name: fn(child) for name in _field_names(type(e))
               if isinstance(child := getattr(e, name), ScalarExpr)}
    return replace(e, **changes) if changes else e


def index_exprs(e: ScalarExpr):
    """The sympy expressions a node holds itself (not its children's)."""
    if isinstance(e, Access):
        return e.index
    if isinstance(e, Load):
        return (e.offset,)
    if isinstance(e, Select):
        return (e.cond,)
    if isinstance(e, Reduction):
        return (e.extent,)
    if isinstance(e, Dim):
        return (e.value,)
    if isinstance(e, Dropout):
        return (e.row, e.key, e.seed)
    return ()


def free_names(e: ScalarExpr) -> frozenset:
    """Index symbols, locals and arrays (as '@name') that e depends on."""
    names = {s.name for x in index_exprs(e) for s in x.free_symbols}
    if isinstance(e, Local):
        names.add(e.name)
    if isinstance(e, (Access, Load)):
        names.add("@" + e.array)
    for c in children(e):
        inner = free_names(c)
        if isinstance(e, Reduction):
            inner = inner - {e.var.name}
        names |= inner
    return frozenset(names)


def subs(e: ScalarExpr, mapping: dict) -> ScalarExpr:
    """Substitute index symbols (sympy Symbol -> expression) everywhere in e."""
    if not mapping:
        return e
    if isinstance(e, Access):
        return Access(e.array, tuple(sympy.sympify(i).xreplace(mapping) for i in e.index))
    if isinstance(e, Load):
        return Load(e.array, e.offset.xreplace(mapping))
    if isinstance(e, Select):
        return Select(e.cond.xreplace(mapping), subs(e.then, mapping), subs(e.other, mapping))
    if isinstance(e, Dim):
        return Dim(e.value.xreplace(mapping))
    if isinstance(e, Dropout):
        return Dropout(e.row.xreplace(mapping), e.key.xreplace(mapping),
                       e.seed.xreplace(mapping), subs(e.p, mapping))
    if isinstance(e, Reduction):
        inner = {k: v for k, v in mapping.items() if k != e.var}
        return Reduction(e.op, e.var, e.extent.xreplace(mapping), subs(e.body, inner), e.name)
    return map_children(e, lambda c: subs(c, mapping))


def rename_locals(e: ScalarExpr, mapping: dict) -> ScalarExpr:
    if isinstance(e, Local):
        return Local(mapping.get(e.name, e.name))
    return map_children(e, lambda c: rename_locals(c, mapping))


def subs_locals(e: ScalarExpr, values: dict) -> ScalarExpr:
    """e with each local named in `values` replaced by its value (an expression)."""
    if isinstance(e, Local):
        return values.get(e.name, e)
    return map_children(e, lambda c: subs_locals(c, values))


def alpha_key(e: ScalarExpr):
    """A key equal for expressions that differ only in bound variable and accumulator
    names: `max_j2 S(j2)` and `max_j4 S(j4)` are the same value."""
    counter = [0]

    def canon(x):
        if isinstance(x, Reduction):
            bound = sympy.Symbol(f"_bound{counter[0]}")
            counter[0] += 1
            body = canon(subs(x.body, {x.var: bound}))
            return Reduction(x.op, bound, x.extent, body, "")
        return map_children(x, canon)

    return canon(e)


def subexpressions(e: ScalarExpr):
    """e and every node below it, parents first (each before its children, the children in
    order). By a stack, not generators nested as deep as the tree: each node would pass
    through every generator above it."""
    stack = [e]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(children(node)))


def nested_sums(e: ScalarExpr):
    """([the + reductions e opens with, outermost first], the body inside the last)."""
    sums = []
    while isinstance(e, Reduction) and e.op == "+":
        sums.append(e)
        e = e.body
    return sums, e


def replace_node(e: ScalarExpr, old: ScalarExpr, new: ScalarExpr) -> ScalarExpr:
    """e with every subexpression equal to old replaced by new."""
    if e == old:
        return new
    return map_children(e, lambda c: replace_node(c, old, new))


def kept_by(e: ScalarExpr):
    """The mask's read M[..] (an Access, or once realized a Load) where e keeps a value by a
    mask's byte, IfGreater(M[..], 0, value, -inf) (the DNF's where(M, value, -inf) of a
    bool M); else None."""
    if (isinstance(e, IfGreater) and isinstance(e.left, (Access, Load)) and e.right == Num(0.0)
            and e.other == Num(float("-inf"))):
        return e.left
    return None


def floored(e: ScalarExpr):
    """(x, c) where e is max(x, c) or max(c, x), c a finite number (e never below c, never
    -inf: attention_varlen's row max floored at -1e30, its sum clamped at 1); else None."""
    if isinstance(e, Bin) and e.op == "max":
        for x, c in ((e.left, e.right), (e.right, e.left)):
            if isinstance(c, Num) and math.isfinite(c.value):
                return x, c.value
    return None


def contains(e: ScalarExpr, kind) -> bool:
    return any(isinstance(x, kind) for x in subexpressions(e))
