"""Sums over one extent added together run as one sum (MergeSums), whose lowered
addition then adds a term at a time (AddTermwise)."""
from dataclasses import dataclass, replace
from typing import Optional

from moagen.moa import scalar as S
from moagen.onf.loops import Loop, Update, map_stmt_exprs
from moagen.steps.step import NotApplicable, Step


def merge_sums(e):
    """sum_k a + sum_k' b -> sum_k (a + b[k' := k]) when the extents agree: one accumulator
    for dU Wg^T + dV Wu^T, or for the sum over heads of dQ Wq^T + dK Wk^T + dV Wv^T."""
    if isinstance(e, S.Reduction):  # sum_h (sum_c a + sum_c' b): the inner sums merge
        return replace(e, body=merge_sums(e.body))
    if isinstance(e, S.Bin) and e.op == "+":
        left, right = merge_sums(e.left), merge_sums(e.right)
        if (isinstance(left, S.Reduction) and isinstance(right, S.Reduction)
                and left.op == right.op == "+" and left.extent == right.extent):
            body = S.Bin("+", left.body, S.subs(right.body, {right.var: left.var}))
            return replace(left, body=merge_sums(body))  # nested sums merge level by level
        return replace(e, left=left, right=right)
    return e


@dataclass(frozen=True)
class MergeSums(Step):
    """Every value of the nest with sums over one extent added together (dX = dU Wg^T +
    dV Wu^T) as one sum: once lowered, one accumulator and one loop, whose steps a GPU
    GEMM's chunks cut with all four operands' tiles staged together (moagen.kernels.gemm).
    The additions in another order: the same value up to rounding, as RegisterTile's
    shared accumulators add them. Not applicable to a nest with no such sums."""
    nest: Optional[str] = None
    layer = "schedule"

    def rewrite_nest(self, nest, names):
        body = tuple(map_stmt_exprs(s, merge_sums) for s in nest.body)
        if body == nest.body:
            raise NotApplicable(f"{self}: nest {nest.label} adds no sums over one extent")
        return body


def sum_terms(e):
    """The terms of a sum (a + b + c), in order; e alone if it is no sum."""
    if isinstance(e, S.Bin) and e.op == "+":
        return sum_terms(e.left) + sum_terms(e.right)
    return [e]


@dataclass(frozen=True)
class AddTermwise(Step):
    """Every addition of a sum of terms into a local (acc += a*b + c*d, a merged sum's
    step once lowered) as one addition a term (acc += a*b; acc += c*d): two fused
    multiply-adds where the sum would take a multiply, a multiply-add and an add. The
    additions in another order: the same value up to rounding. Not applicable to a nest
    with no such addition."""
    nest: Optional[str] = None
    layer = "schedule"

    def rewrite_nest(self, nest, names):
        def block(stmts):
            out = []
            for s in stmts:
                if isinstance(s, Loop):
                    out.append(replace(s, body=block(s.body)))
                elif isinstance(s, Update) and s.op == "+":
                    out += [replace(s, value=term) for term in sum_terms(s.value)]
                else:
                    out.append(s)
            return tuple(out)

        body = block(nest.body)
        if body == nest.body:
            raise NotApplicable(f"{self}: nest {nest.label} adds no sum of terms into a local")
        return body
