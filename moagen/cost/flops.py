"""F: the floating-point operations of one call, counted statement by statement in the ONF.

Each +, -, *, max, min and negation is one flop (a multiply-add is two); an accumulation
(`acc += x`, `O[..] += x`, `m max= x`) adds one. Division and the elementwise functions
(exp, log, sqrt, rsqrt, sigmoid) are counted apart: they cost many flops' time, and the series
lists them apart.
"""
from collections import Counter
from typing import Dict

import sympy

from moagen.moa import scalar as S
from moagen.onf.count import executions
from moagen.onf.loops import Let, Store, Update, walk

FLOP = "flops"
# functions counted as another: FlushExp's exponential is exp's
FLUSHED = {"exp_flushed": "exp"}


def expr_ops(e) -> Counter:
    ops = Counter()
    if isinstance(e, S.Bin):
        ops["div" if e.op == "/" else FLOP] += 1
    elif isinstance(e, S.IfGreater):
        ops[FLOP] += 1  # the comparison
    elif isinstance(e, S.Un):
        ops[FLOP if e.fn == "neg" else FLUSHED.get(e.fn, e.fn)] += 1
    for child in S.children(e):
        ops += expr_ops(child)
    return ops


def stmt_ops(s) -> Counter:
    ops = expr_ops(s.value)
    if (isinstance(s, Update) and s.op != "=") or (isinstance(s, Store) and s.accumulate):
        ops[FLOP] += 1
    return ops


def count_ops(nests) -> Dict[str, sympy.Expr]:
    """Operations by kind over every nest: statements with the same operations are counted
    together, so the loop nest is summed once per kind of statement, not per statement."""
    totals: Dict[str, sympy.Expr] = {}
    for nest in nests:
        kinds = {frozenset(stmt_ops(s).items()) for s in walk(nest.body)
                 if isinstance(s, (Let, Update, Store))} - {frozenset()}
        for kind in kinds:
            runs = sum(executions(nest.body, lambda s, k=kind: _is_kind(s, k)).values())
            for op, per_run in kind:
                totals[op] = totals.get(op, 0) + per_run * runs
    return {op: sympy.factor(total) for op, total in totals.items()}


def _is_kind(s, kind):
    return isinstance(s, (Let, Update, Store)) and frozenset(stmt_ops(s).items()) == kind
