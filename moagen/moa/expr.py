"""The MoA expression IR: one frozen dataclass per node kind, over arrays with symbolic
shapes (tuples of sympy expressions).

A kernel is written once as an expression of these nodes. Python operators build
elementwise nodes (`a + b`, `a * 2.0`, `-a`), with scalar extension for plain numbers and
shape-() nodes. Nothing here computes shapes: that is moagen.moa.shape's job, so a malformed
spec is reported with the path of the offending node.
"""
from dataclasses import dataclass, fields
from functools import lru_cache
from numbers import Real
from typing import Optional, Tuple

import sympy
from sympy.core.function import AppliedUndef

from moagen.errors import SpecError

Shape = Tuple[sympy.Expr, ...]

BINARY_OPS = ("+", "-", "*", "/", "max", "min")
COMPARISONS = ("<", "<=", ">", ">=", "==")  # only in a Where's condition, on indices
UNARY_FNS = ("exp", "log", "sqrt", "rsqrt", "sigmoid", "neg")
REDUCE_OPS = ("+", "max")


def sym(name: str) -> sympy.Symbol:
    """A size or index symbol. Every symbol moagen makes is an integer symbol, so that the
    same name always denotes the same sympy Symbol."""
    return sympy.Symbol(name, integer=True)


class idiv(sympy.Function):
    """Integer division of non-negative operands (tile counts, the KV head of a query head
    in grouped-query attention). Printed as plain integer division in every language."""
    nargs = 2

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer:  # numbers substituted in: evaluate
            return sympy.Integer(a // b)
        if b == 1:
            return a


def divides(f: int, e) -> bool:
    """Whether f divides the index expression e at every value of its symbols: it divides
    every term's coefficient (64*j_blk + 64 for f = 4)."""
    return all(t.as_coeff_Mul()[0] % f == 0 for t in sympy.Add.make_args(sympy.expand(e)))


@lru_cache(maxsize=None)
def simplified(e):
    """An index expression simplified: a ratio of polynomials (the common case: 3*d over d)
    by cancelling common factors, which is all sympy's simplify would do to it, and far
    faster; one with Min, Max or idiv terms the same way with each such term (its arguments
    simplified first) held as a symbol of its own: (x + 2) Min(128, n) - (x + 5) Min(128,
    n) is -3 Min(128, n), as simplify finds it, in a third of the time (simplify tries
    rewrites of the Min that never apply to index expressions). A polynomial (most are: a
    distance between two offsets) is only expanded: cancel gives it the same form, more
    slowly. Remembered: the GPU printers ask for the same loops' extents hundreds of times."""
    held = {}
    poly = e if e.is_rational_function() else _holding_terms(e, held)
    poly = sympy.expand(poly) if poly.is_polynomial() else sympy.cancel(poly)
    return poly.xreplace({s: t for t, s in held.items()})


def _holding_terms(e, held):
    """e with each term that is not a sum, product, integer power, symbol or number (a
    Min, Max, idiv) replaced by a symbol standing for it, recorded in `held`."""
    if e.is_Symbol or e.is_Number:
        return e
    if isinstance(e, (sympy.Add, sympy.Mul)) or (isinstance(e, sympy.Pow) and e.exp.is_Integer):
        return e.func(*(_holding_terms(a, held) for a in e.args))
    term = e.func(*(simplified(a) for a in e.args))
    return held.setdefault(term, sympy.Dummy(integer=True))


# how index arithmetic evaluates in Python (sympy.lambdify), on integers
INDEX_NAMESPACE = {"idiv": lambda a, b: a // b, "Min": min, "Max": max}


def as_dim(value) -> sympy.Expr:
    if isinstance(value, str):
        return sym(value)
    return sympy.sympify(value)


class Expr:
    """Base of every node. Children are the fields whose values are Exprs."""

    def children(self):
        return [(f.name, getattr(self, f.name)) for f in fields(self)
                if isinstance(getattr(self, f.name), Expr)]

    def __add__(self, other):
        return BinOp("+", self, as_expr(other))

    def __radd__(self, other):
        return BinOp("+", as_expr(other), self)

    def __sub__(self, other):
        return BinOp("-", self, as_expr(other))

    def __rsub__(self, other):
        return BinOp("-", as_expr(other), self)

    def __mul__(self, other):
        return BinOp("*", self, as_expr(other))

    def __rmul__(self, other):
        return BinOp("*", as_expr(other), self)

    def __truediv__(self, other):
        return BinOp("/", self, as_expr(other))

    def __rtruediv__(self, other):
        return BinOp("/", as_expr(other), self)

    def __neg__(self):
        return Map("neg", self)


def as_expr(value) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, Real):
        return Const(float(value))
    raise SpecError(f"cannot use {value!r} ({type(value).__name__}) in a MoA expression")


# the element types an input may have besides the kernel's float type ("": that one):
# int64 (offsets), bool (a mask, one byte 0 or 1 an element as numpy and torch store it)
ELEMENTS = ("", "int64", "bool")


@dataclass(frozen=True)
class Array(Expr):
    """A named input array. element: "" (the kernel's float type), "int64" (integers a
    kernel reads as indices: a packed batch's offsets) or "bool" (a mask, read only as a
    Where's condition). offsets_into: for offsets, the
    extent of the axis they cut into sequences (its first entry 0, each at least the one
    before, its last that extent: what the loaders check)."""
    name: str
    shape: Shape
    element: str = ""
    offsets_into: Optional[sympy.Expr] = None

    def __post_init__(self):
        _check_choice("element type", self.element, ELEMENTS)

    def __str__(self):
        return self.name


@dataclass(frozen=True)
class Scalar(Expr):
    """A named scalar parameter passed at call time (e.g. the softmax scale, eps)."""
    name: str

    def __str__(self):
        return self.name


@dataclass(frozen=True)
class Const(Expr):
    value: float

    def __str__(self):
        return repr(self.value)


@dataclass(frozen=True)
class Dim(Expr):
    """A size used as a number, e.g. the d in mean = sum / d."""
    value: sympy.Expr

    def __str__(self):
        return str(self.value)


@dataclass(frozen=True)
class Iota(Expr):
    """iota n = <0 1 ... n-1>: an index used as a value, e.g. to build a causal mask."""
    count: sympy.Expr


@dataclass(frozen=True)
class Dropout(Expr):
    """Dropout's factors, an array of `shape` that is 1 / (1 - p) where an element is kept
    and 0 where it is dropped: element k of its row-major order is kept when the first word
    of Philox4x32-10 of counter k under the key `seed` (a size given at call time), scaled
    to [0, 1), is >= p (moagen.philox). The scale is the node's, not a product around it:
    a loop-invariant 1 / (1 - p) would be hoisted above a nest's parallel loops. A constant
    to grad: it depends on no input."""
    shape: Shape
    seed: sympy.Expr
    p: Expr


@dataclass(frozen=True)
class Where(Expr):
    """`then` where `cond` holds, else `other`; cond compares indices (built from iota), so
    that it can become an index condition in the generated code, or is a bool array (a
    mask: its element read, true where nonzero). A shape-() condition chooses between
    whole branches."""
    cond: Expr
    then: Expr
    other: Expr


@dataclass(frozen=True)
class Psi(Expr):
    """`index psi array`: a (possibly partial) index selects an element or a sub-array."""
    index: Tuple[sympy.Expr, ...]
    array: Expr


@dataclass(frozen=True)
class Take(Expr):
    """The first `count` items along `axis`."""
    count: sympy.Expr
    array: Expr
    axis: int = 0


@dataclass(frozen=True)
class Drop(Expr):
    """All but the first `count` items along `axis`."""
    count: sympy.Expr
    array: Expr
    axis: int = 0


@dataclass(frozen=True)
class Reverse(Expr):
    array: Expr
    axis: int = 0


@dataclass(frozen=True)
class Transpose(Expr):
    """Axis k of the result is axis perm[k] of the array."""
    perm: Tuple[int, ...]
    array: Expr


@dataclass(frozen=True)
class Cat(Expr):
    """Catenation along `axis`."""
    left: Expr
    right: Expr
    axis: int = 0


@dataclass(frozen=True)
class BinOp(Expr):
    """Elementwise binary operation; a shape-() operand is extended to the other's shape."""
    op: str
    left: Expr
    right: Expr

    def __post_init__(self):
        _check_choice("binary operator", self.op, BINARY_OPS + COMPARISONS)


@dataclass(frozen=True)
class Map(Expr):
    """Elementwise unary function."""
    fn: str
    arg: Expr

    def __post_init__(self):
        _check_choice("unary function", self.fn, UNARY_FNS)


@dataclass(frozen=True)
class Reduce(Expr):
    """`op/` along `axis`. `var` names the reduction index, `name` the accumulator: both
    only make the generated code readable."""
    op: str
    array: Expr
    axis: int
    var: str = "j"
    name: Optional[str] = None

    def __post_init__(self):
        _check_choice("reduction operator", self.op, REDUCE_OPS)


@dataclass(frozen=True)
class Inner(Expr):
    """Inner product `left (add . mul) right` over left's last and right's first axis."""
    add: str
    mul: str
    left: Expr
    right: Expr
    var: str = "k"
    name: Optional[str] = None

    def __post_init__(self):
        _check_choice("inner-product reduction", self.add, REDUCE_OPS)
        _check_choice("inner-product operator", self.mul, BINARY_OPS)


@dataclass(frozen=True)
class Outer(Expr):
    """Outer product: result[p ++ q] = left[p] op right[q]."""
    op: str
    left: Expr
    right: Expr

    def __post_init__(self):
        _check_choice("outer-product operator", self.op, BINARY_OPS + COMPARISONS)


@dataclass(frozen=True)
class Omega(Expr):
    """The rank-lifted binary op: `cell` has the shape of `array`'s leading axes (a per-row
    quantity such as a row maximum) and is combined with every item below it:
    <p q> psi result = (<p q> psi array) op (<p> psi cell)."""
    op: str
    array: Expr
    cell: Expr

    def __post_init__(self):
        _check_choice("lifted operator", self.op, BINARY_OPS)


@dataclass(frozen=True)
class Lift(Expr):
    """An array defined by its psi function over leading axes: <p ++ q> psi Lift(vars,
    extents, body) = q psi body[vars := p]. This is how batch and head axes are written:
    the body is the per-(b, h) computation and refers to `Psi((b, h), Q)`."""
    vars: Tuple[str, ...]
    extents: Shape
    body: Expr

    def __post_init__(self):
        if len(self.vars) != len(self.extents):
            raise SpecError(f"Lift: {len(self.vars)} index names for {len(self.extents)} extents")


@dataclass(frozen=True)
class Named(Expr):
    """A named intermediate. Variants that materialize it (the standard implementation
    writes the score matrix) store it in a full-size temporary; all other variants see
    through it. `index` names the temporary's own axes in the generated code."""
    label: str
    value: Expr
    index: Tuple[str, ...] = ("i", "j", "k", "l")


def _check_choice(what, value, choices):
    if value not in choices:
        raise SpecError(f"unknown {what} {value!r}; expected one of {', '.join(choices)}")


# ---- the DSL: small constructors that read like the math -------------------------------

def offsets(name: str, count, into) -> Array:
    """int64 offsets cutting an axis of extent `into` into `count` sequences (count + 1
    entries, as FlashAttention's cu_seqlens): sequence s is rows name[s] .. name[s+1] - 1."""
    return Array(name, (as_dim(count) + 1,), "int64", as_dim(into))


def element(offsets: Array, index) -> sympy.Expr:
    """An integer array's entry at `index` as an index expression: an application of the
    undefined function named after the array (cu_q(s)), which the printers print as the
    array's read."""
    if offsets.element != "int64":
        raise SpecError(f"{offsets.name}: only an integer array's entries are indices")
    return sympy.Function(offsets.name, integer=True)(as_dim(index))


def elements_read(e) -> set:
    """The names of the integer arrays an index expression reads (element's)."""
    return {f.func.__name__ for f in sympy.sympify(e).atoms(AppliedUndef)}


def array(name: str, *shape) -> Array:
    return Array(name, tuple(as_dim(s) for s in shape))


def flags(name: str, *shape) -> Array:
    """A bool array: a mask, read as a Where's condition."""
    return Array(name, tuple(as_dim(s) for s in shape), "bool")


def dim(value) -> Dim:
    return Dim(as_dim(value))


def iota(count) -> Iota:
    return Iota(as_dim(count))


def dropout(shape, seed, p) -> Dropout:
    return Dropout(tuple(as_dim(s) for s in shape), as_dim(seed), as_expr(p))


def where(cond, then, other) -> Where:
    return Where(cond, as_expr(then), as_expr(other))


def psi(index, a) -> Psi:
    return Psi(tuple(as_dim(i) for i in index), as_expr(a))


def take(count, a, axis=0) -> Take:
    return Take(as_dim(count), a, axis)


def drop(count, a, axis=0) -> Drop:
    return Drop(as_dim(count), a, axis)


def transpose(a, perm=(1, 0)) -> Transpose:
    return Transpose(tuple(perm), a)


def inner(left, right, add="+", mul="*", var="k", name=None) -> Inner:
    return Inner(add, mul, left, right, var, name)


def outer(op, left, right) -> Outer:
    return Outer(op, left, right)


def reduce(op, a, axis, var="j", name=None) -> Reduce:
    return Reduce(op, a, axis, var, name)


def omega(op, a, cell) -> Omega:
    return Omega(op, a, as_expr(cell))


def lift(vars, extents, body) -> Lift:
    return Lift(tuple(vars), tuple(as_dim(e) for e in extents), body)


def named(label, value, index=("i", "j", "k", "l")) -> Named:
    return Named(label, value, tuple(index))


def exp(a):
    return Map("exp", as_expr(a))


def log(a):
    return Map("log", as_expr(a))


def sqrt(a):
    return Map("sqrt", as_expr(a))


def rsqrt(a):
    return Map("rsqrt", as_expr(a))


def sigmoid(a):
    return Map("sigmoid", as_expr(a))


def silu(a):
    """a * sigmoid(a), written out: its derivative sigmoid(a) (1 + a (1 - sigmoid(a))) and
    the value then share one sigmoid, which a nest computing both evaluates once."""
    a = as_expr(a)
    return a * sigmoid(a)


def maximum(a, b):
    return BinOp("max", as_expr(a), as_expr(b))


def walk(node: Expr):
    """node and every node below it, parents first (a shared subtree once per use)."""
    yield node
    for _, child in node.children():
        yield from walk(child)


def describe(node: Expr) -> str:
    """One line naming a node without its children, for dumps and error messages."""
    if isinstance(node, (Array, Scalar, Const, Dim)):
        return f"{type(node).__name__} {node}"
    if isinstance(node, Psi):
        return f"Psi <{' '.join(map(str, node.index))}>"
    if isinstance(node, Iota):
        return f"Iota {node.count}"
    if isinstance(node, Where):
        return "Where"
    if isinstance(node, Dropout):
        return f"Dropout seed={node.seed}"
    if isinstance(node, (Take, Drop)):
        return f"{type(node).__name__} {node.count} axis={node.axis}"
    if isinstance(node, Reverse):
        return f"Reverse axis={node.axis}"
    if isinstance(node, Transpose):
        return f"Transpose {node.perm}"
    if isinstance(node, Cat):
        return f"Cat axis={node.axis}"
    if isinstance(node, (BinOp, Outer, Omega)):
        return f"{type(node).__name__}({node.op})"
    if isinstance(node, Map):
        return f"Map({node.fn})"
    if isinstance(node, Reduce):
        return f"Reduce({node.op}) axis={node.axis} over {node.var}"
    if isinstance(node, Inner):
        return f"Inner({node.add}.{node.mul}) over {node.var}"
    if isinstance(node, Lift):
        return f"Lift <{' '.join(node.vars)}>"
    if isinstance(node, Named):
        return f"Named {node.label}"
    raise SpecError(f"not a MoA node: {node!r}")
