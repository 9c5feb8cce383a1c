"""Cotangent arithmetic for moagen.moa.grad. A cotangent may be a *cell*: an expression of
a prefix of its node's shape that stands for its broadcast along the trailing axes (the
cotangent of a row sum is one number a row). Cells combine with whole arrays by omega; only
where a rule needs the whole array (an input's gradient, an inner product) is one spread,
by a Lift over the trailing axes and a transpose."""
from dataclasses import replace

import sympy

from moagen.moa import expr as E
from moagen.moa.shape import shape_of


def rank(e):
    """The rank of an expression's shape."""
    return len(shape_of(e))


def omega_op(op, a, b):
    """a op b for cells of one shape's prefixes (the higher rank first)."""
    if rank(a) == rank(b) or rank(b) == 0 or rank(a) == 0:
        return E.BinOp(op, a, b)
    return E.omega(op, a, b)


def times(a, b):
    """a * b, either a cell of the other's shape."""
    if 0 < rank(a) < rank(b):
        return E.omega("*", b, a)
    if 0 < rank(b) < rank(a):
        return E.omega("*", a, b)
    if isinstance(b, (E.Scalar, E.Const)):  # a scale reads first, as the math is written
        return E.BinOp("*", b, a)
    return E.BinOp("*", a, b)


def over(a, b):
    """a / b, either a cell of the other's shape."""
    if rank(a) < rank(b) and rank(a) > 0:
        return E.omega("*", 1.0 / b, a)
    return omega_op("/", a, b)


def add(a, b):
    """a + b, either a cell of the other's shape; a + a is 2 a, folded into a constant."""
    if a == b:
        return fold(2.0, a)
    if rank(a) < rank(b):
        a, b = b, a
    return omega_op("+", a, b)


def fold(c, e):
    """c * e with c multiplied into a constant factor of e's products where it has one
    (2 * (g * (-0.5 * y)) is g * -y)."""
    def into(x):
        if isinstance(x, E.Const):
            return E.Const(c * x.value)
        if isinstance(x, E.BinOp) and x.op in "*/":
            for side in ("left", "right") if x.op == "*" else ("left",):
                folded = into(getattr(x, side))
                if folded is not None:
                    return replace(x, **{side: folded})
        if isinstance(x, E.Map) and x.fn == "neg":
            folded = into(x.arg)
            return None if folded is None else E.Map("neg", folded)
        return None

    folded = into(e)
    return E.BinOp("*", E.Const(c), e) if folded is None else unit(folded)


def unit(e):
    """e with a factor 1.0 dropped and -1.0 turned into a negation."""
    if isinstance(e, E.BinOp) and e.op in "*/":
        left, right = unit(e.left), unit(e.right)
        if e.op == "*" and left in (E.Const(1.0), E.Const(-1.0)):
            return right if left == E.Const(1.0) else -right
        return replace(e, left=left, right=right)
    return e


def total(g, shape, k, names):
    """The sum of cotangent g (a cell of `shape`, whose axes are `names`) over every axis
    past the first k."""
    broadcast = shape[max(k, rank(g)):]
    while rank(g) > k:
        g = E.reduce("+", g, axis=rank(g) - 1, var=names[rank(g) - 1], name="total")
    if broadcast:
        g = g * E.Dim(sympy.Mul(*broadcast))
    return g


def fit(share, shape, child, names):
    """A share of a node's cotangent for a child the node extends from shape ()."""
    if not shape_of(child) and shape:
        return total(share, shape, 0, names)
    return share


def full(g, shape, node):
    """g as an array of node's whole shape: a cell is broadcast along the trailing axes, by
    a Lift over them (which puts them first) and a transpose that moves them last."""
    k = rank(g)
    trailing = tuple(shape[k:])
    if not trailing:
        return g
    lifted = E.Lift(tuple(f"spread{a}" for a in range(len(trailing))), trailing, g)
    if k == 0:
        return lifted
    return E.Transpose(tuple(range(len(trailing), len(shape))) + tuple(range(len(trailing))),
                       lifted)


def transpose(perm, g):
    """perm applied to g, a transpose of a transpose composed away."""
    if list(perm) == sorted(perm):
        return g
    if perm == (1, 0) and isinstance(g, E.Inner) and rank(g.left) == rank(g.right) == 2:
        # (A B)^T = B^T A^T: the gradient of a transposed operand as the math writes it
        return E.inner(transpose(perm, g.right), transpose(perm, g.left), g.add, g.mul,
                       g.var, g.name)
    if isinstance(g, E.Transpose):
        composed = tuple(g.perm[p] for p in perm)
        return g.array if list(composed) == sorted(composed) else E.Transpose(composed, g.array)
    return E.Transpose(tuple(perm), g)


def inner(left, right, var):
    """left +.x right over var; its accumulator named after two inputs it reads directly
    (dO V^T: dov), else acc."""
    reads = [read(x) for x in (left, right)]
    name = "".join(reads).lower() if all(reads) else "acc"
    return E.inner(left, right, var=var, name=name)


def read(node):
    while isinstance(node, (E.Transpose, E.Psi)):
        node = node.array
    return node.name if isinstance(node, E.Array) else None
