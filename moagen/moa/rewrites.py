"""The rewrites that turn a derived backward (moagen.moa.grad) into its memory-optimal form.
Each is a named step that replaces a subexpression by an equal one only where it can check
the equality from the forward spec itself; `rewrite` reports how often each step applied.

    kept statistic        a forward output that is a Named intermediate (RMSNorm's inv_rms,
                          the MLP's U) is read from the saved output, not recomputed: x * r
                          then costs one product a row element
    softmax from lse      omega(/, w, +/ w), w = exp(s - max/ s), with the forward's
                          lse = max/ s + log(+/ w) saved, is exp(s - lse): each probability
                          recomputed from its score, no row max or row sum, nothing n x n;
                          guarded (stable_softmax), exp(s - max(lse, floor))
    delta from output     +/ (dP * P) with dP = dO +.x V^T, and the forward's O = P +.x V
                          saved, is +/ (dO * O): sum_j P_ij sum_c dO_ic V_jc
                          = sum_c dO_ic sum_j P_ij V_jc; a row of d, not of n. The same
                          with a factor F on both sides (dropout's), dP = (dO +.x V^T) * F
                          and O = (P * F) +.x V
    masked zeros          where(cond, P * Y, 0) with P = exp(where(cond, s, -inf) - x) is
                          P * Y: the causal mask's cotangent is already zero where it masks
    scale into named      c * dL, where a Named cotangent dL is only ever used scaled by
                          one scalar c, becomes dL := c * (its value): the scale applied
                          once per element (attention's dS = scale * P * (dP - delta))

`quadratic_temporaries` and `recomputed_reductions` are the checks that follow them: a DNF
temporary with two axes of one size (n x n), or a reduction recomputed per term of another
over the same extent (n^3 work), is what these forms exist to avoid.
"""
from dataclasses import dataclass, fields, replace
from typing import Dict, Optional, Tuple

from moagen.moa import expr as E
from moagen.moa.shape import shape_of


@dataclass(frozen=True)
class Context:
    # forward output -> (its lifted body, the body's cell read from the saved output:
    # <b h> psi O, or through the transpose the output was written with)
    saved: Dict[str, Tuple[E.Expr, E.Expr]]
    cotangents: Dict[str, E.Expr]  # output -> its cotangent in the body, <b h> psi dO

    def read(self, output):
        return self.saved[output][1]


def kept_statistic(node, context):
    """A Named intermediate equal to a forward output that is that Named node: the output."""
    if not isinstance(node, E.Named):
        return None
    for out, (body, _) in context.saved.items():
        if isinstance(body, E.Named) and body.label == node.label and body.value == node.value:
            return context.read(out)
    return None


def softmax_from_lse(node, context):
    """The stable softmax of s, where a forward output is its max + log(row sum): exp(s - lse)."""
    softmax = stable_softmax(node)
    if softmax is None:
        return None
    lse = E.BinOp("+", softmax.top, E.log(softmax.total))
    for out, (body, _) in context.saved.items():
        if body == lse:
            # guarded, a row that saw no key has lse -inf: floored as the max was, its
            # weights are exp(-inf - floor) = 0; a row that saw one has lse above the floor
            read = context.read(out)
            shift = read if softmax.floor is None else E.maximum(read, softmax.floor)
            return E.exp(E.omega("-", softmax.scores, shift))
    return None


def delta_from_output(node, context):
    """+/ (dP * P) with dP = dO +.x V^T, where a forward output O = P +.x V has cotangent dO:
    +/ (dO * O), along the last axis; also with dP = (dO +.x V^T) * F and O = (P * F) +.x V
    (dropout's factors F)."""
    if not (isinstance(node, E.Reduce) and node.op == "+" and isinstance(node.array, E.BinOp)
            and node.array.op == "*"):
        return None
    rank = len(shape_of(node.array))
    if node.axis % rank != rank - 1:
        return None
    pair = (node.array.left, node.array.right)
    for dprobs, probs in (pair, pair[::-1]):
        dprobs, factor = _factor(dprobs)
        if not (isinstance(dprobs, E.Inner) and isinstance(dprobs.right, E.Transpose)
                and dprobs.right.perm == (1, 0)):
            continue
        values = dprobs.right.array
        for out, cotangent in context.cotangents.items():
            body, _ = context.saved[out]
            if not (isinstance(body, E.Inner) and (body.add, body.mul) == ("+", "*")):
                continue
            weights, weights_factor = _factor(body.left)
            if dprobs.left == cotangent and weights_factor == factor and \
                    _unnamed(weights) == _unnamed(probs) and body.right == values:
                return E.reduce("+", cotangent * context.read(out), axis=rank - 1, var="c",
                                name="rowdot")
    return None


def _factor(node):
    """(x, f) where node is x * f, else (node, None); x seen through its Named."""
    node = _unnamed(node)
    if isinstance(node, E.BinOp) and node.op == "*":
        return _unnamed(node.left), node.right
    return node, None


def masked_zeros(node, context):
    """where(cond, P * Y, 0) is P * Y where P = exp(where(cond, s, -inf) - x): P is an exact
    zero wherever cond fails, and so is the product (Y finite)."""
    if not (isinstance(node, E.Where) and node.other == E.Const(0.0)):
        return None
    product = _unnamed(node.then)
    if not (isinstance(product, E.BinOp) and product.op == "*"):
        return None
    for factor in (product.left, product.right):
        factor = _unnamed(factor)
        if isinstance(factor, E.Map) and factor.fn == "exp" and \
                isinstance(factor.arg, E.Omega) and factor.arg.op == "-":
            masked = _unnamed(factor.arg.array)
            if isinstance(masked, E.Where) and masked.cond == node.cond and \
                    masked.other == E.Const(float("-inf")):
                return node.then
    return None


@dataclass(frozen=True)
class Softmax:
    """The parts of a stable softmax omega(/, w, +/ w), w = exp(omega(-, scores, top)):
    top the row max, or max(row max, floor) where the softmax is guarded (below)."""
    scores: E.Expr
    top: E.Expr
    total: E.Expr  # the row sum +/ w
    floor: Optional[E.Const] = None  # the guarded form's least row max


def stable_softmax(node) -> Optional[Softmax]:
    """The parts of node where it is the stable softmax along the last axis, w =
    exp(omega(-, scores, max/ scores)) over +/ w; else None. Or its guarded form (a packed
    batch's, moagen.kernels.attention_varlen), whose rows may see no key: the row max
    floored, max(max/ scores, floor), and the sum clamped, max(+/ w, 1), so that a row whose
    scores are all -inf gets weights 0, not NaN. For a row with a finite score the floor
    (below it) and the clamp (its max's term is 1) change nothing: the same softmax."""
    if not (isinstance(node, E.Omega) and node.op == "/"):
        return None
    w, total = node.array, _floored(node.cell, 1.0)
    guarded = total is not node.cell
    if not (isinstance(total, E.Reduce) and total.op == "+" and total.array == w
            and isinstance(w, E.Map) and w.fn == "exp"
            and isinstance(w.arg, E.Omega) and w.arg.op == "-"):
        return None
    scores, top = w.arg.array, w.arg.cell
    row_max = _floored(top, None)
    if guarded != (row_max is not top):
        return None  # a clamp without the floor, or a floor without the clamp
    rank = len(shape_of(scores))
    if not (isinstance(row_max, E.Reduce) and row_max.op == "max" and row_max.array == scores
            and row_max.axis % rank == rank - 1 and total.axis % rank == rank - 1):
        return None
    return Softmax(scores, top, total, top.right if guarded else None)


def _floored(node, bound):
    """x where node is max(x, c), c a constant (`bound` if given), else node."""
    if isinstance(node, E.BinOp) and node.op == "max" and isinstance(node.right, E.Const) \
            and (bound is None or node.right.value == bound):
        return node.left
    return node


def _unnamed(node):
    return node.value if isinstance(node, E.Named) else node


# in the order they apply: each sees the forward's outputs rewritten by those before it
STEPS = (("kept statistic", kept_statistic), ("softmax from lse", softmax_from_lse),
         ("delta from output", delta_from_output), ("masked zeros", masked_zeros))
# and then, over all the outputs together, scale_into_named
NAMES = tuple(name for name, _ in STEPS) + ("scale into named",)


def rewrite(node, steps, context) -> Tuple[E.Expr, Dict[str, int]]:
    """node with every step applied bottom-up, one step after another; and how often each
    applied."""
    counts = {}
    for k, (name, step) in enumerate(steps):
        seen = replace(context, saved={o: (_apply(body, steps[:k], context), cell)
                                       for o, (body, cell) in context.saved.items()})
        node, count = _bottom_up(node, step, seen)
        if count:
            counts[name] = count
    return node, counts


def _apply(node, steps, context):
    for _, step in steps:
        node, _ = _bottom_up(node, step, context)
    return node


def _bottom_up(node, step, context):
    memo, count = {}, [0]

    def visit(n):
        if n in memo:
            return memo[n]
        changes = {f.name: visit(getattr(n, f.name)) for f in fields(n)
                   if isinstance(getattr(n, f.name), E.Expr)}
        rebuilt = replace(n, **changes) if any(changes[k] is not getattr(n, k)
                                               for k in changes) else n
        new = step(rebuilt, context)
        if new is not None:
            count[0] += 1
            rebuilt = new
        memo[n] = rebuilt
        return rebuilt

    return visit(node), count[0]


def scale_into_named(values):
    """A Named cotangent that is used only scaled by one scalar (scale * dscores) takes the
    scale into its value, once per element where it is materialized or recomputed, not once
    per use in each product. Returns the values and how many labels moved."""
    uses = {}
    for value in values:
        for parent, child in _edges(value):
            if isinstance(child, E.Named):
                uses.setdefault(child, set()).add(_scaling(parent, child))
    scales = {named: factors.pop() for named, factors in uses.items()
              if len(factors) == 1 and None not in factors}
    labels = [n.label for n in uses]
    scales = {n: c for n, c in scales.items() if labels.count(n.label) == 1}

    def step(node, _):
        for named, factor in scales.items():
            if _scaling(node, named) == factor:
                return E.Named(named.label, E.BinOp("*", factor, named.value), named.index)
        return None

    return [_bottom_up(v, step, None)[0] for v in values], len(scales)


def _scaling(parent, child):
    """The Scalar or Const that parent multiplies child by; None if it is not such a product."""
    if isinstance(parent, E.BinOp) and parent.op == "*":
        for this, other in ((parent.left, parent.right), (parent.right, parent.left)):
            if this == child and isinstance(other, (E.Scalar, E.Const)):
                return other
    return None


def _edges(node, parent=None):
    if parent is not None:
        yield parent, node
    for _, child in node.children():
        yield from _edges(child, node)


def transform(node, fn):
    """node rebuilt bottom-up, each subexpression replaced by fn(it) where that is not None."""
    return _bottom_up(node, lambda n, _: fn(n), None)[0]


def transform_outputs(spec, fn):
    """spec with each output's value transformed (see transform)."""
    return replace(spec, outputs=tuple(replace(o, value=transform(o.value, fn))
                                       for o in spec.outputs))


def substitute(node, mapping):
    """node with every subexpression that is a key of mapping replaced by its value."""
    return transform(node, mapping.get)


def relabel(node, labels):
    """node with its Named intermediates renamed by labels (old -> new)."""
    def step(n, _):
        if isinstance(n, E.Named) and n.label in labels:
            return replace(n, label=labels[n.label])
        return None
    return _bottom_up(node, step, None)[0]


def quadratic_temporaries(dnf):
    """The DNF's temporaries with two axes of one size (n x n): empty for a memory-optimal
    backward."""
    return [d.target for d in dnf.temps
            if len({s for s in d.shape[-2:]}) < len(d.shape[-2:])]


def recomputed_reductions(dnf):
    """The DNF's definitions that recompute a reduction for every term of another over the
    same extent, the inner depending on the outer's variable (a softmax's row max inside
    the sum over query rows of dK: n^3 work). What a backward without its rewrites does in
    place of an n x n temporary."""
    from moagen.moa import scalar as S

    def nested(e):
        for outer in S.subexpressions(e):
            if not isinstance(outer, S.Reduction):
                continue
            for inner in S.subexpressions(outer.body):
                if isinstance(inner, S.Reduction) and inner.extent == outer.extent and \
                        outer.var.name in S.free_names(inner):
                    return True
        return False

    return [d.target for d in dnf.definitions if nested(d.body)]
