"""A reference interpreter for DNFs and ONFs, for tests at tiny sizes.

`evaluate_dnf` computes every definition by brute force over its index space; `run_onf`
executes a loop nest statement by statement, at any stage (reductions still inside
expressions, lowered to accumulator loops, or flattened by the layout step). Both work in
float64 with sizes read off the input arrays' shapes, so a test can compare each stage of
the pipeline with the one before and with numpy.

Expressions and statements are compiled once into Python closures over two environments:
`ints` (sizes and index variables, by name) and `locs` (floating-point locals). Index
expressions are sympy; each is lambdified once, since substituting per element is slow.
"""
import itertools
import math
from functools import lru_cache

import numpy as np
import sympy

from moagen.errors import SpecError
from moagen.moa import scalar as S
from moagen.moa.expr import INDEX_NAMESPACE
from moagen.philox import keep_pieces, kept
from moagen.onf.loops import Barrier, LaneReduce, Let, Loop, Store, Update

UNARY = {
    "exp": math.exp,
    "exp_flushed": lambda x: 0.0 if x < S.FLUSHED_BELOW["float64"] else math.exp(x),
    "sqrt": math.sqrt,
    "rsqrt": lambda x: 1.0 / math.sqrt(x),
    "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)),
    "neg": lambda x: -x,
    "log": lambda x: -math.inf if x == 0 else math.log(x),  # as C's: a row of no key's lse
}
BINARY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "max": max,
    "min": min,
}
ORDER = {"row": "C", "col": "F"}

# what the printed names in a lambdified index expression mean


@lru_cache(maxsize=None)
def _lambdified(expr: sympy.Basic):
    names = tuple(sorted(s.name for s in expr.free_symbols))
    fn = sympy.lambdify([sympy.Symbol(n, integer=True) for n in names], expr,
                        modules=[INDEX_NAMESPACE, "math"])
    return names, fn


def index_fn(expr):
    """ints -> the value of an integer (or boolean) sympy expression."""
    names, fn = _lambdified(sympy.sympify(expr))
    return lambda ints: fn(*[ints[n] for n in names])


def infer_sizes(buffers, arrays) -> dict:
    """Size name -> int, from the arrays given for the symbolically shaped `buffers`
    (anything with .name and .shape). Raises SpecError on a missing or misshapen array."""
    sizes, pending = {}, []
    for b in buffers:
        if b.name not in arrays:
            raise SpecError(f"no array given for input {b.name}")
        actual = np.shape(arrays[b.name])
        if len(actual) != len(b.shape):
            raise SpecError(f"{b.name}: expected rank {len(b.shape)}, got shape {actual}")
        for dim, n in zip(b.shape, actual):
            if isinstance(dim, sympy.Symbol):
                if sizes.setdefault(dim.name, n) != n:
                    raise SpecError(f"{b.name}: size {dim} is both {sizes[dim.name]} and {n}")
            else:
                pending.append((b.name, dim, n))
    for name, dim, n in pending:  # compound dims (n + 1, 2*n) only check what symbols set
        if index_fn(dim)(sizes) != n:
            raise SpecError(f"{name}: dimension {dim} should be {index_fn(dim)(sizes)}, got {n}")
    return sizes


def _no_integer_inputs(inputs):
    """The interpreter's index functions evaluate sizes and loop indices, not an integer
    input's entries (a varlen kernel's offsets): refused by name, not mis-evaluated. A bool
    mask is a value, read as 0 or 1."""
    integer = [b.name for b in inputs if b.element == "int64"]
    if integer:
        raise SpecError(f"the interpreter takes float and bool inputs only, not "
                        f"{', '.join(integer)} (integer arrays indexing the loops); build and "
                        "run the kernel")


def evaluate_dnf(dnf, arrays: dict, scalars: dict) -> dict:
    """Every definition of the DNF (temporaries and outputs), by name, as float64 arrays."""
    _no_integer_inputs(dnf.spec.inputs)
    sizes = infer_sizes(dnf.spec.inputs, arrays)
    sizes.update({g: int(scalars[g]) for g in dnf.spec.given})
    store = {name: np.array(a, dtype=np.float64) for name, a in arrays.items()}
    machine = _Machine(store, _params(dnf.spec.scalars, scalars))
    for d in dnf.definitions:  # temporaries come first, so later bodies can read them
        shape = tuple(index_fn(s)(sizes) for s in d.shape)
        out = store[d.target] = np.full(shape, np.nan)
        body = machine.expr(d.body)
        ints = dict(sizes)
        names = [v.name for v in d.index]
        for idx in itertools.product(*map(range, shape)):
            ints.update(zip(names, idx))
            out[idx] = body(ints, {})
    return {d.target: store[d.target] for d in dnf.definitions}


def run_onf(onf, arrays: dict, scalars: dict) -> dict:
    """Execute the ONF sequentially (parallel marks ignored); the outputs by name, shaped
    as their buffers. Outputs start as NaN, so an element no statement writes shows."""
    _no_integer_inputs(onf.inputs)
    sizes = infer_sizes(onf.inputs, arrays)
    # sizes no input's shape gives (a KV cache's valid rows) come with the scalars
    sizes.update({s.name: int(scalars[s.name]) for s in onf.sizes if s.name not in sizes})
    order = ORDER[onf.layout]
    shapes = {b.name: tuple(index_fn(s)(sizes) for s in b.shape)
              for b in onf.inputs + onf.outputs + onf.temps}
    # copies: a faulty store into an input must not change the caller's arrays
    store = {b.name: np.array(arrays[b.name], dtype=np.float64) for b in onf.inputs}
    store.update({b.name: np.full(shapes[b.name], np.nan) for b in onf.outputs})
    store.update({b.name: np.zeros(shapes[b.name]) for b in onf.temps})
    if onf.flat:  # Load and Store address flat buffers laid out as gamma says
        store = {name: a.ravel(order=order) for name, a in store.items()}
    machine = _Machine(store, _params(onf.scalars, scalars))
    for nest in onf.nests:
        machine.block(nest.body)(dict(sizes), {})
    return {b.name: store[b.name].reshape(shapes[b.name], order=order) for b in onf.outputs}


def _params(names, scalars):
    missing = [n for n in names if n not in scalars]
    if missing:
        raise SpecError(f"no value given for scalar(s) {', '.join(missing)}")
    return {n: float(scalars[n]) for n in names}


def _element(array, fns, ints):
    """The index tuple for array, refusing partial and negative indices (numpy would
    return a sub-array or wrap around)."""
    idx = tuple(f(ints) for f in fns)
    if len(idx) != array.ndim or any(k < 0 for k in idx):
        raise IndexError(f"index {idx} does not address an element of shape {array.shape}")
    return idx


_UNBOUND = object()


def _iterate(ints, var, values):
    """Bind index variable var to each value in turn, then restore any outer binding of
    the same name."""
    saved = ints.get(var, _UNBOUND)
    try:
        for k in values:
            ints[var] = k
            yield
    finally:
        if saved is _UNBOUND:
            ints.pop(var, None)
        else:
            ints[var] = saved


class _Machine:
    """Compiles expressions and statements to closures over the array store."""

    def __init__(self, store: dict, params: dict):
        self.store = store
        self.params = params

    def expr(self, e: S.ScalarExpr):
        """(ints, locs) -> float."""
        if isinstance(e, S.Num):
            return lambda ints, locs: e.value
        if isinstance(e, S.Param):
            value = self.params[e.name]
            return lambda ints, locs: value
        if isinstance(e, S.Local):
            return lambda ints, locs: locs[e.name]
        if isinstance(e, S.Dim):
            f = index_fn(e.value)
            return lambda ints, locs: float(f(ints))
        if isinstance(e, (S.Access, S.Load)):
            array = self.store[e.array]
            fns = [index_fn(i) for i in (e.index if isinstance(e, S.Access) else (e.offset,))]
            return lambda ints, locs: array[_element(array, fns, ints)]
        if isinstance(e, S.Bin):
            op, left, right = BINARY[e.op], self.expr(e.left), self.expr(e.right)
            return lambda ints, locs: op(left(ints, locs), right(ints, locs))
        if isinstance(e, S.Un):
            fn, arg = UNARY[e.fn], self.expr(e.arg)
            return lambda ints, locs: fn(arg(ints, locs))
        if isinstance(e, S.Select):
            cond, then, other = index_fn(e.cond), self.expr(e.then), self.expr(e.other)
            return lambda ints, locs: then(ints, locs) if cond(ints) else other(ints, locs)
        if isinstance(e, S.IfGreater):
            left, right, then, other = map(self.expr, (e.left, e.right, e.then, e.other))
            return lambda ints, locs: then(ints, locs) if left(ints, locs) > right(ints, locs) \
                else other(ints, locs)
        if isinstance(e, S.Dropout):
            row, key, seed, p = index_fn(e.row), index_fn(e.key), index_fn(e.seed), self.expr(e.p)

            def factor(ints, locs):
                drop = p(ints, locs)
                keeps = kept(keep_pieces(row(ints), key(ints), seed(ints)), drop)
                return 1.0 / (1.0 - drop) if keeps else 0.0
            return factor
        if isinstance(e, S.Reduction):
            return self._reduction(e)
        raise TypeError(f"not a scalar expression: {e!r}")

    def _reduction(self, e: S.Reduction):
        op, extent, body, var = BINARY[e.op], index_fn(e.extent), self.expr(e.body), e.var.name

        def run(ints, locs):
            acc = S.IDENTITY[e.op]
            for _ in _iterate(ints, var, range(extent(ints))):
                acc = op(acc, body(ints, locs))
            return acc
        return run

    def block(self, stmts):
        """(ints, locs) -> None, running the statements in order."""
        steps = [self.stmt(s) for s in stmts]

        def run(ints, locs):
            for step in steps:
                step(ints, locs)
        return run

    def stmt(self, s):
        if isinstance(s, Loop):
            start, stop, var = index_fn(s.start), index_fn(s.stop), s.var.name
            body = self.block(s.body)

            def loop(ints, locs):
                for _ in _iterate(ints, var, range(start(ints), stop(ints))):
                    body(ints, locs)
            return loop
        # one thread runs the block here: nothing to wait for, no other lane's partial
        if isinstance(s, (Barrier, LaneReduce)):
            return lambda ints, locs: None
        value = self.expr(s.value)
        if isinstance(s, Let):
            def let(ints, locs):
                locs[s.name] = value(ints, locs)
            return let
        if isinstance(s, Update):
            op = (lambda old, new: new) if s.op == "=" else BINARY[s.op]

            def update(ints, locs):
                locs[s.name] = op(locs[s.name], value(ints, locs))
            return update
        if isinstance(s, Store):
            array = self.store[s.array]
            fns = [index_fn(i) for i in s.index]
            op = BINARY[s.accumulate] if s.accumulate else None

            def store(ints, locs):
                idx = _element(array, fns, ints)
                v = value(ints, locs)
                array[idx] = op(array[idx], v) if op else v
            return store
        raise TypeError(f"not a statement: {s!r}")

