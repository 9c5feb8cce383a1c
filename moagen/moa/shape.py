"""Shape analysis (rho): infers every node's symbolic shape and reports a mismatch with the
node's path from the root, e.g. `attention_fwd.body.left.right: Inner(+.*) needs ...`."""
from functools import lru_cache
from typing import List, Tuple

import sympy

from moagen.errors import ShapeError
from moagen.moa import expr as E


def fmt_shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")" if shape else "()"


def same_dim(a, b) -> bool:
    return E.simplified(sympy.sympify(a - b)) == 0


def same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same_dim(x, y) for x, y in zip(a, b))


@lru_cache(maxsize=None)
def shape_of(node: E.Expr) -> E.Shape:
    """The shape of a node (cached). Call `check` first for errors that carry a path."""
    return _rule(node, "", tuple(shape_of(child) for _, child in node.children()))


def check(node: E.Expr, root: str = "spec") -> E.Shape:
    """Shape-check a whole expression; a mismatch raises ShapeError naming the node path."""
    return _check(node, root)


def _check(node, path):
    child_shapes = tuple(_check(child, f"{path}.{field}") for field, child in node.children())
    return _rule(node, path, child_shapes)


def annotate(node: E.Expr, root: str = "spec") -> List[Tuple[int, str, str, E.Shape]]:
    """(depth, path, node description, shape) for every node, root first: the `shape` stage
    dump. A Named intermediate used again is listed once with its subtree, then by name."""
    check(node, root)
    rows, seen = [], set()

    def walk(n, path, depth):
        again = isinstance(n, E.Named) and n in seen
        rows.append((depth, path, E.describe(n) + (" (as above)" if again else ""), shape_of(n)))
        if again:
            return
        seen.add(n)
        for field, child in n.children():
            walk(child, f"{path}.{field}", depth + 1)

    walk(node, root, 0)
    return rows


def _axis(path, node, axis, rank):
    if not -rank <= axis < rank:
        raise ShapeError(f"{path}: {E.describe(node)}: axis {axis} out of range for rank {rank}")
    return axis % rank


def _rule(node, path, kids) -> E.Shape:
    """The shape of `node` given its children's shapes (in `children()` order)."""
    if isinstance(node, E.Array):
        return node.shape
    if isinstance(node, (E.Scalar, E.Const, E.Dim)):
        return ()
    if isinstance(node, E.Iota):
        return (node.count,)
    if isinstance(node, E.Dropout):
        if kids != ((),):
            raise ShapeError(f"{path}: Dropout needs a scalar probability, got shape "
                             f"{fmt_shape(kids[0])}")
        return node.shape
    if isinstance(node, E.Where):
        shapes = [k for k in kids if k != ()]
        if any(not same_shape(k, shapes[0]) for k in shapes):
            cond, then, other = (fmt_shape(k) for k in kids)
            raise ShapeError(f"{path}: Where needs condition and branches of one shape (or "
                             f"scalars), but got {cond}, {then} and {other}")
        return shapes[0] if shapes else ()
    if isinstance(node, E.Psi):
        (s,) = kids
        if len(node.index) > len(s):
            raise ShapeError(f"{path}: {E.describe(node)}: index of length {len(node.index)} "
                             f"applied to an array of shape {fmt_shape(s)}")
        return s[len(node.index):]
    if isinstance(node, (E.Take, E.Drop)):
        (s,) = kids
        ax = _axis(path, node, node.axis, len(s))
        if (s[ax] - node.count).is_negative:
            raise ShapeError(f"{path}: {E.describe(node)}: count exceeds axis length {s[ax]} "
                             f"of shape {fmt_shape(s)}")
        new = node.count if isinstance(node, E.Take) else s[ax] - node.count
        return s[:ax] + (new,) + s[ax + 1:]
    if isinstance(node, E.Reverse):
        (s,) = kids
        _axis(path, node, node.axis, len(s))
        return s
    if isinstance(node, E.Transpose):
        (s,) = kids
        if sorted(node.perm) != list(range(len(s))):
            raise ShapeError(f"{path}: {E.describe(node)}: not a permutation of the axes of "
                             f"shape {fmt_shape(s)}")
        return tuple(s[p] for p in node.perm)
    if isinstance(node, E.Cat):
        a, b = kids
        ax = _axis(path, node, node.axis, len(a)) if a else 0
        if len(a) != len(b) or not a or not same_shape(a[:ax] + a[ax + 1:], b[:ax] + b[ax + 1:]):
            _mismatch(path, node, "operands of equal shape except along the axis", a, b)
        return a[:ax] + (a[ax] + b[ax],) + a[ax + 1:]
    if isinstance(node, E.BinOp):
        a, b = kids
        if not a:
            return b
        if not b or same_shape(a, b):
            return a
        _mismatch(path, node, "operands of equal shape (or a scalar)", a, b)
    if isinstance(node, E.Map):
        return kids[0]
    if isinstance(node, E.Reduce):
        (s,) = kids
        if not s:
            raise ShapeError(f"{path}: {E.describe(node)}: cannot reduce a scalar")
        ax = _axis(path, node, node.axis, len(s))
        return s[:ax] + s[ax + 1:]
    if isinstance(node, E.Inner):
        a, b = kids
        if not a or not b or not same_dim(a[-1], b[0]):
            _mismatch(path, node, "left's last axis to match right's first axis", a, b)
        return a[:-1] + b[1:]
    if isinstance(node, E.Outer):
        a, b = kids
        return a + b
    if isinstance(node, E.Omega):
        a, cell = kids
        if len(cell) > len(a) or not same_shape(a[:len(cell)], cell):
            _mismatch(path, node, "the cell's shape to be a prefix of the array's", a, cell)
        return a
    if isinstance(node, E.Lift):
        return node.extents + kids[0]
    if isinstance(node, E.Named):
        return kids[0]
    raise ShapeError(f"{path}: not a MoA node: {node!r}")


def _mismatch(path, node, needs, left, right):
    raise ShapeError(f"{path}: {E.describe(node)} needs {needs}, but got shapes "
                     f"{fmt_shape(left)} and {fmt_shape(right)}")
