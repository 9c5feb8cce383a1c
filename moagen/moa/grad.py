"""Reverse-mode differentiation of a kernel spec: `grad(spec, wrt, cotangents)` is the spec
of the vector-Jacobian product, itself a MoA spec (shape analysis, DNF, schedules and
printers treat it as any other).

The forward's outputs are lifted over the same leading axes (batch, heads: `Lift`), each
written as lifted or through a transpose of its lift (attention's O written (batch, n,
heads, d): the output's cotangent and the saved output are then read through the inverse
transpose); the body of one (b, h) is differentiated as an expression DAG, parents before
children, each node's cotangent the sum of what its users send it, by one rule per node
kind:

    index access <v> psi A   ->  the adjoint of A at <v>: the body's cotangent, lifted over v;
                                 lift axes A is not indexed by are summed (a weight's
                                 gradient is a sum over rows)
    Packed.read (its rows)   ->  as an index access, the gradient an output packed by the
                                 same offsets (a varlen batch's dQ by cu_q)
    A +.x B                  ->  dA = G +.x B^T,  dB = A^T +.x G
    +/ along the last axis   ->  G, spread along that axis (a "cell", below)
    omega(op, A, r)          ->  dA as elementwise; dr = the sum of G (x A) over the lifted axes
    exp, log, rsqrt, sigmoid ->  G times the derivative, from the node's own value
    where(cond, A, B)        ->  dA = where(cond, G, 0), dB = where(cond, 0, G)
    softmax (stable)         ->  dS = P * omega(-, G, delta), delta = rowsum(G * P); also
                                 guarded (rewrites.stable_softmax: rows that see no key)

A cotangent may be a *cell*: an expression of a prefix of the node's shape that stands for
its broadcast over the trailing axes (the cotangent of a row sum is one number a row);
moagen.moa.cotangents combines them.

The row max of a stable softmax is a shift that cancels (softmax and logsumexp do not
change when every score of a row moves by the same amount), so the softmax is one rule and
the max inside it gets no cotangent. A max anywhere else would need its argmax as a data
dependent selection, which the IR has no node for: it is refused.

Named intermediates keep their names; the cotangent of one called L is named dL, so that a
variant can materialize it. The result is then rewritten by moagen.moa.rewrites into the
memory-optimal form (saved statistics used, the softmax recomputed from its lse, attention's
delta from the output).
"""
from dataclasses import dataclass, replace
from typing import Dict, Mapping, Optional, Sequence, Tuple

import sympy

from moagen.errors import SpecError
from moagen.moa import cotangents as C
from moagen.moa import expr as E
from moagen.moa import rewrites as R
from moagen.moa.rewrites import stable_softmax
from moagen.moa.shape import shape_of
from moagen.moa.spec import KernelSpec, Output, Packed, PackedRead, packed_read


@dataclass(frozen=True)
class Derivation:
    """A derived backward: its spec, and the rewrites that shaped it (name, where applied)."""
    spec: KernelSpec
    rewrites: Tuple[Tuple[str, int], ...]


def grad(spec: KernelSpec, wrt=None, cotangents=None, **options) -> KernelSpec:
    """The vector-Jacobian product of `spec` as a KernelSpec; see `derive`."""
    return derive(spec, wrt, cotangents, **options).spec


def derive(spec: KernelSpec, wrt=None, cotangents: Optional[Sequence[str]] = None,
           name: Optional[str] = None, rewrites=None, order=None,
           labels: Optional[Mapping[str, str]] = None) -> Derivation:
    """Differentiate `spec`.

    wrt: the inputs to differentiate with respect to, as names (the gradient's index names
    derived from the outputs') or a mapping name -> index names; default every input.
    cotangents: the outputs given a cotangent `d<output>` (an input of the result); default
    every output. Every forward output may be read by the result (a saved statistic, the
    output itself): the rewrites decide which are.
    rewrites: the names of the rewrites to apply (moagen.moa.rewrites.NAMES, all by default).
    order: the result's inputs in this order (default: the forward's inputs, the saved
    outputs it reads, the cotangents); those it does not read are left out.
    labels: new names for Named intermediates (probs -> P), as a variant refers to them."""
    spec.validate()
    wrt, cotangents, lift = _checked(spec, wrt, cotangents)
    chosen = R.NAMES if rewrites is None else tuple(rewrites)
    unknown = set(chosen) - set(R.NAMES)
    if unknown:
        raise SpecError(f"grad: no rewrite {sorted(unknown)}; the rewrites: {', '.join(R.NAMES)}")
    shapes = {o.name: _stored_shape(o, shape) for o, shape in
              zip(spec.outputs, spec.output_shapes().values())}
    saved = {o.name: E.Array(o.name, shapes[o.name]) for o in spec.outputs}
    given = {c.name: E.Array("d" + c.name, shapes[c.name]) for c in cotangents}

    adjoints = _Adjoints(lift)
    cells = {c.name: _cell(c, given[c.name], lift) for c in cotangents}
    for c in cotangents:
        adjoints.seed(_body(c), cells[c.name], _lifted_index(c)[len(lift.vars):])
    leaves = adjoints.run()

    context = R.Context(saved={o.name: (_body(o), _cell(o, saved[o.name], lift))
                               for o in spec.outputs},
                        cotangents=cells)
    steps = tuple((n, step) for n, step in R.STEPS if n in chosen)
    applied, results = {}, []
    inputs = {a.name: a for a in spec.inputs}
    for w, index in wrt.items():
        gathered, packed_by = _gather(w, leaves, lift)
        value, counts = R.rewrite(gathered, steps, context)
        for step, count in counts.items():
            applied[step] = applied.get(step, 0) + count
        packed = None
        if packed_by:  # stored as the input is read: its rows the axis after the lift's kept
            kept, by = packed_by
            packed = Packed(by.var, index[len(kept)], inputs[by.offsets])
        results.append(Output("d" + w, value, index, packed))
    if "scale into named" in chosen:
        values, moved = R.scale_into_named([o.value for o in results])
        results = [replace(o, value=v) for o, v in zip(results, values)]
        if moved:
            applied["scale into named"] = moved
    if labels:
        results = [replace(o, value=R.relabel(o.value, labels)) for o in results]
    derived = KernelSpec(name=name or f"{spec.name}_vjp",
                         inputs=_inputs(results, (*spec.inputs, *saved.values(),
                                                  *given.values()), order, spec.name),
                         scalars=tuple(s for s in spec.scalars if any(
                             n == E.Scalar(s) for o in results for n in E.walk(o.value))),
                         outputs=tuple(results), given=spec.given)
    derived.validate()
    return Derivation(derived, tuple(applied.items()))


def _checked(spec, wrt, cotangents):
    """(wrt as name -> index names, the outputs given cotangents, their common lift), or a
    SpecError naming what does not fit."""
    inputs = [a.name for a in spec.inputs]
    wrt = _wrt_index(spec, wrt)
    unknown = [w for w in wrt if w not in inputs]
    if unknown:
        raise SpecError(f"grad {spec.name}: wrt {unknown} are not inputs; inputs: "
                        f"{', '.join(inputs)}")
    outputs = {o.name: o for o in spec.outputs}
    unknown = [c for c in cotangents or () if c not in outputs]
    if unknown:
        raise SpecError(f"grad {spec.name}: cotangents for {unknown}, which are not outputs; "
                        f"outputs: {', '.join(outputs)}")
    chosen = [outputs[c] for c in cotangents or outputs]
    clash = {"d" + c.name for c in chosen} & (set(inputs) | set(outputs) | set(spec.scalars))
    if clash:
        raise SpecError(f"grad {spec.name}: the cotangent names {sorted(clash)} are taken")
    lifts = {_lift_of(c) for c in chosen}
    if len(lifts) != 1:
        raise SpecError(f"grad {spec.name}: the outputs given cotangents are lifted over "
                        f"different axes {sorted(lifts)}; differentiate them separately")
    return wrt, chosen, lifts.pop()


def _inputs(results, candidates, order, forward):
    """The candidates the results read (an array, or an integer array's entries in an index
    expression: a packed result's offsets), in `order` if given."""
    used = {o.packed.offsets.name for o in results if o.packed}
    for node in (n for o in results for n in E.walk(o.value)):
        if isinstance(node, E.Array):
            used.add(node.name)
        used |= {a for i in _indices(node) for a in E.elements_read(i)}
    inputs = [a for a in candidates if a.name in used]
    if order is not None:
        missing = [a.name for a in inputs if a.name not in order]
        if missing:
            raise SpecError(f"grad {forward}: order leaves out the inputs {missing}")
        inputs.sort(key=lambda a: list(order).index(a.name))
    return tuple(inputs)


def _indices(node):
    """The index expressions a node holds (a psi's index, a take's or drop's count)."""
    if isinstance(node, E.Psi):
        return node.index
    if isinstance(node, (E.Take, E.Drop)):
        return (node.count,)
    return ()


@dataclass(frozen=True)
class _Lift:
    vars: Tuple[str, ...]
    extents: E.Shape


def _written(output: Output) -> Tuple[E.Expr, Optional[Tuple[int, ...]]]:
    """The output's value as lifted, and the permutation it is written with where it is a
    transpose of a Lift (attention's O written (batch, n, heads, d), its lift over (b, h)
    putting n third); None where it is written as lifted."""
    value = output.value
    if isinstance(value, E.Transpose) and isinstance(value.array, E.Lift):
        return value.array, value.perm
    return value, None


def _lift_of(output: Output) -> _Lift:
    value, _ = _written(output)
    if isinstance(value, E.Lift):
        return _Lift(value.vars, value.extents)
    return _Lift((), ())


def _body(output: Output) -> E.Expr:
    value, _ = _written(output)
    return value.body if isinstance(value, E.Lift) else value


def _lifted_index(output: Output) -> Tuple[str, ...]:
    """The output's index names in the order of its lifted value's axes."""
    _, perm = _written(output)
    return output.index if perm is None else tuple(output.index[k] for k in _inverse(perm))


def _cell(output: Output, array: E.Array, lift: _Lift) -> E.Expr:
    """One body's cell of `array`, laid out as the output is written (the output saved, its
    cotangent): indexed by the lift variables, through the inverse of the output's
    transpose; a packed output's, its sequence's rows of the body's head (Packed.read)."""
    _, perm = _written(output)
    if output.packed:
        packed = output.packed
        if perm is not None or packed.var not in lift.vars or \
                _lifted_index(output)[len(lift.vars)] != packed.rows:
            raise SpecError(f"grad: the packed output {output.name} must be written as lifted, "
                            f"over the sequences {packed.var} among other lift variables, its "
                            f"rows {packed.rows} the axis after them (index {output.index})")
        return packed.read(array, tuple(v for v in lift.vars if v != packed.var))
    return E.psi(lift.vars, array if perm is None else E.Transpose(_inverse(perm), array))


def _stored_shape(output: Output, shape) -> E.Shape:
    """The shape of the array an output is stored in (a packed one's rows axis the total)."""
    if output.packed is None:
        return shape
    return output.packed.stored(tuple(E.sym(n) for n in output.index), shape)[1]


def _wrt_index(spec, wrt) -> Dict[str, Tuple[str, ...]]:
    """wrt as name -> the gradient's index names. A name alone takes, per axis, the index
    name the outputs use for that size (the first output axis of that size), else a fresh
    one."""
    if isinstance(wrt, Mapping):
        return {w: tuple(index) for w, index in wrt.items()}
    names = {}
    for o, shape in spec.output_shapes().items():
        index = next(x.index for x in spec.outputs if x.name == o)
        for dim, n in zip(shape, index):
            names.setdefault(dim, n)
    result = {}
    for w in wrt or [a.name for a in spec.inputs]:
        array = next((a for a in spec.inputs if a.name == w), None)
        if array is None:
            result[w] = ()
            continue
        index = []
        taken = {str(s) for s in spec.sizes}
        for dim in array.shape:
            n = names.get(dim, "i")
            while n in index or n in taken:
                n += "2"
            index.append(n)
        result[w] = tuple(index)
    return result


# ---- the adjoint of one lifted body -----------------------------------------------------

class _Adjoints:
    def __init__(self, lift: _Lift):
        self.lift = lift
        self.cot: Dict[E.Expr, E.Expr] = {}
        self.roots = []
        self.named_of: Dict[E.Expr, E.Named] = {}
        self.leaves: Dict[Tuple[str, Tuple], E.Expr] = {}
        self.names: Dict[E.Expr, Tuple[str, ...]] = {}  # each node's axes, for loop names

    def seed(self, body, cotangent, index):
        self.roots.append(body)
        self.names[body] = index
        self._send(body, cotangent)

    def run(self):
        order = []
        seen = set()
        for root in self.roots:
            _postorder(root, seen, order)
        for node in order:
            if isinstance(node, E.Named):
                self.named_of.setdefault(node.value, node)
        for node in reversed(order):
            self.names.setdefault(node, _default_names(node))
            for child, names in _child_names(node, self.names[node]):
                self.names.setdefault(child, names)
        for node in reversed(order):  # parents before children
            if node in self.cot:
                for child, contribution in self._pull(node, self.cot[node]):
                    self._send(child, contribution)
        return self.leaves

    def _send(self, node, contribution):
        # a later user's share first: the sum reads as the forward's operands (dU Wg^T + dV Wu^T)
        self.cot[node] = C.add(contribution, self.cot[node]) if node in self.cot else contribution

    def value(self, node):
        """The node as the DAG names it (its Named wrapper), so that a rewrite or a variant
        sees the intermediate where a rule reuses it."""
        return self.named_of.get(node, node)

    def _pull(self, node, g):
        """[(child, its share of g)] for node with cotangent g (a cell of node's shape)."""
        shape = shape_of(node)
        if isinstance(node, (E.Const, E.Scalar, E.Dim, E.Iota, E.Dropout)) or \
                (isinstance(node, E.Psi) and isinstance(node.array, E.Dropout)):
            return []  # no input below them: constants
        if isinstance(node, (E.Array, E.Psi)) or packed_read(node):
            self._leaf(node, g)
            return []
        if isinstance(node, E.Named):
            softmax = stable_softmax(node.value)
            if C.rank(g) == len(shape) and shape:
                g = E.named("d" + node.label, g, node.index)
            if softmax:
                return self._softmax(node, softmax, g)
            return [(node.value, g)]
        if isinstance(node, E.BinOp):
            left, right = node.left, node.right
            if node.op == "+":
                shares = [(left, g), (right, g)]
            elif node.op == "-":
                shares = [(left, g), (right, -g)]
            elif node.op == "*":
                shares = [(left, C.times(g, self.value(right))),
                          (right, C.times(g, self.value(left)))]
            elif node.op == "/":
                r = self.value(right)
                shares = [(left, C.over(g, r)),
                          (right, -C.over(C.times(g, self.value(left)), r * r))]
            else:
                raise SpecError(f"grad: no adjoint rule for {E.describe(node)} (elementwise "
                                "max and min, comparisons)")
            names = self.names[node]
            return [(child, C.fit(share, shape, child, names)) for child, share in shares]
        if isinstance(node, E.Map):
            return [(node.arg, self._map(node, g))]
        if isinstance(node, E.Reduce):
            rank = len(shape_of(node.array))
            if node.op != "+":
                raise SpecError(f"grad: {E.describe(node)}: a max is differentiable here only "
                                "as the shift of a stable softmax (its argmax, a data dependent "
                                "selection, has no node in the IR)")
            ax = node.axis % rank
            if ax == rank - 1:
                return [(node.array, g)]  # a cell: spread along the last axis where used
            # spread along the summed axis by a Lift (which puts it first), moved to ax
            spread = E.Lift((f"spread_{node.var}",), (shape_of(node.array)[ax],),
                            C.full(g, shape, node))
            if ax == 0:
                return [(node.array, spread)]
            perm = tuple(range(1, ax + 1)) + (0,) + tuple(range(ax + 1, rank))
            return [(node.array, E.Transpose(perm, spread))]
        if isinstance(node, E.Inner):
            return self._inner(node, C.full(g, shape, node))
        if isinstance(node, E.Outer):
            if node.op in E.COMPARISONS:
                return []
            return self._outer(node, C.full(g, shape, node))
        if isinstance(node, E.Omega):
            return self._omega(node, g, shape)
        if isinstance(node, E.Where):
            g, names = C.full(g, shape, node), self.names[node]
            return [(node.then, C.fit(E.where(node.cond, g, 0.0), shape, node.then, names)),
                    (node.other, C.fit(E.where(node.cond, 0.0, g), shape, node.other, names))]
        if isinstance(node, E.Transpose):
            return [(node.array, C.transpose(_inverse(node.perm), C.full(g, shape, node)))]
        if isinstance(node, E.Lift):
            self._lift(node, C.full(g, shape, node))
            return []
        raise SpecError(f"grad: no adjoint rule for {E.describe(node)} yet")

    def _leaf(self, node, g):
        """An input's adjoint at this body: keyed by the input, the lift variables that
        index it and the permutation it is read through (an input read transposed, e.g. a
        weight's per-head slice W[:, h, :], is indexed in its transposed layout), or how it
        is read packed (its sequence's rows: its gradient is packed as it)."""
        rows = packed_read(node)
        if rows:
            names = tuple(v for v in self.lift.vars if v == rows.var or v in rows.heads)
            if rows.var not in self.lift.vars or \
                    tuple(v for v in names if v != rows.var) != rows.heads:
                raise SpecError(f"grad: {E.describe(node)}: a packed read of {rows.array.name} "
                                f"has an adjoint rule only over the sequences {rows.var} and "
                                f"heads {rows.heads} among the lift variables {self.lift.vars}, "
                                "in their order")
            key = (rows.array.name, names, rows)
        elif isinstance(node, E.Psi):
            array, perm = node.array, None
            if isinstance(array, E.Transpose) and isinstance(array.array, E.Array):
                array, perm = array.array, array.perm
            if not isinstance(array, E.Array):
                raise SpecError(f"grad: {E.describe(node)} of a computed array has no adjoint "
                                "rule; index named inputs (or their transposes) only")
            names = tuple(str(i) for i in node.index)
            if not all(n in self.lift.vars for n in names) or \
                    list(names) != sorted(names, key=self.lift.vars.index):
                raise SpecError(f"grad: {E.describe(node)} {array.name}: only an index of "
                                f"the lift variables {self.lift.vars}, in their order, has an "
                                "adjoint rule")
            key = (array.name, names, perm)
        else:
            key = (node.name, (), None)
        self._add_leaf(key, C.full(g, shape_of(node), node))

    def _add_leaf(self, key, g):
        self.leaves[key] = C.add(self.leaves[key], g) if key in self.leaves else g

    def _lift(self, node, g):
        """A Lift inside the body (the heads of a batch entry, summed over): its body is
        differentiated with its variables added to the lift, seeded with g indexed by them;
        each adjoint found there joins this body's, lifted over those variables (summed
        over those it is not indexed by)."""
        inner = _Adjoints(_Lift(self.lift.vars + node.vars, self.lift.extents + node.extents))
        inner.seed(node.body, _indexed(g, node.vars), self.names[node][len(node.vars):])
        own = _Lift(node.vars, node.extents)
        for key, adjoint in inner.run().items():
            self._add_leaf(key, _lifted(adjoint, key[1], own))

    def _map(self, node, g):
        y, x = self.value(node), self.value(node.arg)
        if node.fn == "exp":
            return C.times(g, y)
        if node.fn == "log":
            return C.over(g, x)
        if node.fn == "sqrt":
            return C.over(C.times(g, E.Const(0.5)), y)
        if node.fn == "rsqrt":  # d x^(-1/2) = -1/2 x^(-3/2) = -1/2 y^3
            return C.times(g, -0.5 * (y * y * y))
        if node.fn == "sigmoid":  # d sigmoid(x) = sigmoid(x) (1 - sigmoid(x))
            return C.times(g, y * (1.0 - y))
        if node.fn == "neg":
            return -g
        raise SpecError(f"grad: no adjoint rule for {E.describe(node)}")

    def _inner(self, node, g):
        if (node.add, node.mul) != ("+", "*"):
            raise SpecError(f"grad: {E.describe(node)}: only +.* inner products have a rule")
        left, right = self.value(node.left), self.value(node.right)
        ranks = len(shape_of(left)), len(shape_of(right))
        if not all(r in (1, 2) for r in ranks):
            raise SpecError(f"grad: {E.describe(node)}: operands of rank 1 or 2 only")
        # dA[p, k] = sum_q G[p, q] B[k, q];  dB[k, q] = sum_p A[p, k] G[p, q]
        names = self.names[node]
        d_left = (C.inner(g, C.transpose((1, 0), right), names[-1])
                  if ranks[1] == 2 else E.outer("*", g, right))
        d_right = (C.inner(C.transpose((1, 0), left), g, names[0])
                   if ranks[0] == 2 else E.outer("*", left, g))
        return [(node.left, d_left), (node.right, d_right)]

    def _outer(self, node, g):
        if node.op != "*" or len(shape_of(node.left)) != 1 or len(shape_of(node.right)) != 1:
            raise SpecError(f"grad: {E.describe(node)}: only the outer product of two vectors "
                            "has a rule")
        names = self.names[node]
        return [(node.left, C.inner(g, self.value(node.right), names[-1])),
                (node.right, C.inner(self.value(node.left), g, names[0]))]

    def _omega(self, node, g, shape):
        array, cell = node.array, node.cell
        k, names = len(shape_of(cell)), self.names[node]
        if node.op == "+":
            return [(array, g), (cell, C.total(g, shape, k, names))]
        if node.op == "-":
            return [(array, g), (cell, -C.total(g, shape, k, names))]
        a, c = self.value(array), self.value(cell)
        if node.op == "*":
            return [(array, C.times(g, c)), (cell, C.total(C.times(g, a), shape, k, names))]
        if node.op == "/":
            return [(array, C.over(g, c)),
                    (cell, -C.total(C.times(g, a), shape, k, names) / (c * c))]
        raise SpecError(f"grad: no adjoint rule for {E.describe(node)}")

    def _softmax(self, probs, parts, g):
        """P = softmax(s) along the last axis: dS = P * omega(-, G, delta), delta = the row
        sums of G * P (a Named row statistic, one number a row)."""
        scores = parts.scores
        shape = shape_of(probs)
        g = C.full(g, shape, probs)
        rows = probs.index[:len(shape) - 1] if isinstance(probs, E.Named) else ("i",)
        delta = E.named("delta", E.reduce("+", g * probs, axis=len(shape) - 1,
                                          var=self.names[probs][-1], name="rowdot"),
                        index=rows)
        return [(scores, probs * C.omega_op("-", g, delta))]


def _default_names(node):
    return tuple(f"k{a}" for a in range(C.rank(node)))


def _child_names(node, names):
    """(child, the names of its axes) given node's axis names: an inner product's summed
    axis is its var, a Named intermediate's axes are its own."""
    if isinstance(node, E.Named):
        own = node.index[:len(names)]
        return [(node.value, own if len(own) == len(names) else names)]
    if isinstance(node, E.Inner):
        cut = C.rank(node.left) - 1
        return [(node.left, names[:cut] + (node.var,)), (node.right, (node.var,) + names[cut:])]
    if isinstance(node, E.Outer):
        cut = C.rank(node.left)
        return [(node.left, names[:cut]), (node.right, names[cut:])]
    if isinstance(node, E.Reduce):
        ax = node.axis % C.rank(node.array)
        return [(node.array, names[:ax] + (node.var,) + names[ax:])]
    if isinstance(node, E.Psi):
        return [(node.array, tuple(str(i) for i in node.index) + names)]
    if isinstance(node, E.Transpose):
        source = [None] * len(names)
        for k, p in enumerate(node.perm):
            source[p] = names[k]
        return [(node.array, tuple(source))]
    return [(child, names[:C.rank(child)]) for _, child in node.children()]


# ---- from the body's leaves to the gradients -------------------------------------------

def _gather(name, leaves, lift: _Lift):
    """The gradient of input `name`: each body adjoint lifted over the lift axes, summed over
    the axes its access does not index by (the rows a weight is shared by), and put back in
    the input's layout where it was read transposed; with, where it was read packed, (the
    lift variables kept, the PackedRead), else None."""
    parts, packings = [], set()
    for (leaf, index, layout), body in leaves.items():
        if leaf != name:
            continue
        value = _lifted(body, index, lift)
        packed = isinstance(layout, PackedRead)
        packings.add((index, layout) if packed else None)
        parts.append(value if layout is None or packed
                     else E.Transpose(_inverse(layout), value))
    if not parts:
        raise SpecError(f"grad: the outputs given cotangents do not depend on {name} (its "
                        "gradient is zero): leave it out of wrt")
    if len(packings) > 1:
        raise SpecError(f"grad: {name} is read both packed and not, or packed by different "
                        "sequences or heads: its gradient has no one layout")
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total, packings.pop()


def _lifted(body, index, lift: _Lift):
    """body lifted over the lift's variables, summed over those not in index."""
    value = E.lift(lift.vars, lift.extents, body) if lift.vars else body
    for axis in reversed(range(len(lift.vars))):
        var = lift.vars[axis]
        if var not in index:
            value = E.reduce("+", value, axis=axis, var=var, name=f"over_{var}")
    return value


def _indexed(g, vars):
    """g indexed by the lift variables vars: a spread (a Lift whose body no index of it
    changes, as a sum's cotangent is) is its body."""
    if isinstance(g, E.Lift) and len(g.vars) == len(vars):
        own = {E.sym(v) for v in g.vars}
        if not any(isinstance(n, E.Psi) and own & set().union(
                *(sympy.sympify(i).free_symbols for i in n.index)) for n in E.walk(g.body)):
            return g.body
    return E.Psi(tuple(E.sym(v) for v in vars), g)


def _inverse(perm):
    inverse = [0] * len(perm)
    for k, p in enumerate(perm):
        inverse[p] = k
    return tuple(inverse)


def _postorder(node, seen, order):
    if node in seen:
        return
    seen.add(node)
    for _, child in node.children():
        _postorder(child, seen, order)
    order.append(node)


