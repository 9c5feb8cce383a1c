"""The rewrites that turn a derived backward (moagen.moa.grad) into its memory-optimal form.
Each is a named step that replaces a subexpression by an equal one only where it can check
the equality from the forward spec itself; `rewrite` reports how often each step applied.

    kept statistic        a forward output that is a Named intermediate (RMSNorm's inv_rms,
                          the MLP's U) is read from the saved output, not recomputed: x * r
                          then costs one product a row element
    softmax from lse      omega(/, w, +/ w), w = exp(s - max/ s), with the forward's
                          lse = max/ s + log(+/ w) saved, is exp(s - lse): each probability
                          recomputed from its score, no row max or row sum, nothing n x n
    delta from output     +/ (dP * P) with dP = dO +.x V^T, and the forward's O = P +.x V
                          saved, is +/ (dO * O): sum_j P_ij sum_c dO_ic V_jc
                          = sum_c dO_ic sum_j P_ij V_jc; a row of d, not of n
    masked zeros          where(cond, P * Y, 0) with P = exp(where(cond, s, -inf) - x) is
                          P * Y: the causal mask's cotangent is already zero where it masks

`quadratic_temporaries` is the check that follows them: a DNF temporary with two axes of
one size (n x n) is what these forms exist to avoid.
"""
from dataclasses import dataclass, fields, replace
from typing import Dict, Tuple

from moagen.moa import expr as E
from moagen.moa.shape import shape_of


@dataclass(frozen=True)
class Context:
    lift_vars: Tuple[str, ...]
    saved: Dict[str, Tuple[E.Expr, E.Array]]  # forward output -> (its lifted body, array)
    cotangents: Dict[str, E.Expr]  # output -> its cotangent in the body, <b h> psi dO

    def read(self, output):
        return E.psi(self.lift_vars, self.saved[output][1])


def kept_statistic(node, context):
    if not isinstance(node, E.Named):
        return None
    for out, (body, _) in context.saved.items():
        if isinstance(body, E.Named) and body.label == node.label and body.value == node.value:
            return context.read(out)
    return None


def softmax_from_lse(node, context):
    from moagen.moa.grad import _softmax_parts
    parts = _softmax_parts(node)
    if parts is None:
        return None
    scores, top = parts
    lse = E.BinOp("+", top, E.log(node.cell))
    for out, (body, _) in context.saved.items():
        if body == lse:
            return E.exp(E.omega("-", scores, context.read(out)))
    return None


def delta_from_output(node, context):
    if not (isinstance(node, E.Reduce) and node.op == "+" and isinstance(node.array, E.BinOp)
            and node.array.op == "*"):
        return None
    rank = len(shape_of(node.array))
    if node.axis % rank != rank - 1:
        return None
    pair = (node.array.left, node.array.right)
    for dprobs, probs in (pair, pair[::-1]):
        dprobs = _unnamed(dprobs)
        if not (isinstance(dprobs, E.Inner) and isinstance(dprobs.right, E.Transpose)
                and dprobs.right.perm == (1, 0)):
            continue
        values = dprobs.right.array
        for out, cotangent in context.cotangents.items():
            body, _ = context.saved[out]
            if dprobs.left == cotangent and isinstance(body, E.Inner) and \
                    (body.add, body.mul) == ("+", "*") and \
                    _unnamed(body.left) == _unnamed(probs) and body.right == values:
                return E.reduce("+", cotangent * context.read(out), axis=rank - 1, var="c",
                                name="rowdot")
    return None


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


def _unnamed(node):
    return node.value if isinstance(node, E.Named) else node


# in the order they apply: each sees the forward's outputs rewritten by those before it
STEPS = (("kept statistic", kept_statistic), ("softmax from lse", softmax_from_lse),
         ("delta from output", delta_from_output), ("masked zeros", masked_zeros))


def rewrite(node, steps, context) -> Tuple[E.Expr, Dict[str, int]]:
    """node with every step applied bottom-up, one step after another; and how often each
    applied."""
    counts = {}
    for k, (name, step) in enumerate(steps):
        seen = replace(context, saved={o: (_apply(body, steps[:k], context), array)
                                       for o, (body, array) in context.saved.items()})
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


def quadratic_temporaries(dnf):
    """The DNF's temporaries with two axes of one size (n x n): empty for a memory-optimal
    backward."""
    return [d.target for d in dnf.temps
            if len({s for s in d.shape[-2:]}) < len(d.shape[-2:])]
