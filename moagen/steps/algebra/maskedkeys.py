"""MaskedKeys: the keys a causal mask hides are not visited in a row's passes (the row form,
dnf).

A causal mask makes the score of key j `P >= j ? s : -inf`, P free of j (attention_varlen's
query position i + n_k - n_q). In a row's passes over its keys the masked scores add
nothing:

    max[j < E](P >= j ? s : -inf)              ->  max[j < min(E, P + 1)](s)
    sum[j < E](exp((P >= j ? s : -inf) - t))   ->  sum[j < min(E, P + 1)](exp(s - t))
    for j in [0, E): let p = exp((P >= j ? s : -inf) - t) / u;  X += p * g(j)
                                               ->  for j in [0, min(E, P + 1)): ... exp(s - t) ...

A max skips -inf, its identity. exp(-inf - t) is 0 where t > -inf, which holds where t is
floored (a local let t = max(m, c), c a finite number: attention_varlen's row max), so the
sum skips zeros, and so does the loop whose every use of p is a term p * g of a sum
(x + 0 g = x for a finite g): the same values, bit for bit. A row past every key's mask
(P < 0) runs no iteration: max -inf and sum 0, as when every key was masked.

Refused (NotApplicable): a nest with no such pass. A pass whose exponential subtracts a
local that is not floored, or whose p is used otherwise, is left as it is.
"""
from dataclasses import dataclass, replace
from typing import Optional

import sympy

from moagen.moa import scalar as S
from moagen.onf.loops import Let, Loop, Store, Update, map_stmt_exprs, stmt_exprs, walk
from moagen.steps.step import NotApplicable, Step


@dataclass(frozen=True)
class MaskedKeys(Step):
    layer = "algorithm"
    nest: Optional[str] = None

    def rewrite_nest(self, nest, names):
        floored = frozenset(s.name for s in walk(nest.body)
                            if isinstance(s, Let) and S.floored(s.value))
        cut = []
        body = _block(nest.body, floored, cut)
        if not cut:
            raise NotApplicable(f"{self}: nest {nest.label} has no pass over keys a causal "
                                "mask hides")
        return body


def _block(stmts, floored, cut):
    out = []
    for s in stmts:
        if isinstance(s, Loop):
            s = _cut_loop(s, floored, cut)
            s = replace(s, body=_block(s.body, floored, cut))
        else:
            s = map_stmt_exprs(s, lambda e: _cut_reductions(e, floored, cut))
        out.append(s)
    return tuple(out)


def _last_key(cond, var):
    """P where the condition is P >= var (var <= P), P free of var; else None."""
    if isinstance(cond, sympy.GreaterThan):
        diff = cond.lhs - cond.rhs
    elif isinstance(cond, sympy.LessThan):
        diff = cond.rhs - cond.lhs
    else:
        return None
    last = sympy.expand(diff + var)
    return last if var not in last.free_symbols and sympy.diff(diff, var) == -1 else None


def _masked(e, var):
    """(P, s) where e is `P >= var ? s : -inf`; else None."""
    if isinstance(e, S.Select) and e.other == S.Num(float("-inf")):
        last = _last_key(e.cond, var)
        if last is not None:
            return last, e.then
    return None


def _masked_exp(e, var, floored):
    """(P, exp(s - t)) where e is exp((P >= var ? s : -inf) - t), t floored; else None."""
    if (isinstance(e, S.Un) and e.fn == "exp" and isinstance(e.arg, S.Bin) and e.arg.op == "-"
            and isinstance(e.arg.right, S.Local) and e.arg.right.name in floored):
        masked = _masked(e.arg.left, var)
        if masked:
            return masked[0], S.Un("exp", S.Bin("-", masked[1], e.arg.right))
    return None


def _cut_reductions(e, floored, cut):
    e = S.map_children(e, lambda x: _cut_reductions(x, floored, cut))
    if not isinstance(e, S.Reduction):
        return e
    found = _masked(e.body, e.var) if e.op == "max" else _masked_exp(e.body, e.var, floored)
    if found is None:
        return e
    cut.append(e.name)
    return replace(e, extent=sympy.Min(e.extent, found[0] + 1), body=found[1])


def _cut_loop(loop, floored, cut):
    """A loop over keys whose first statement is let p = exp(masked - t) [/ u] and whose
    every other read of p is a term p * g of a sum, cut at the last key seen."""
    if loop.start != 0 or not loop.body or not isinstance(loop.body[0], Let):
        return loop
    let = loop.body[0]
    value = let.value.left if isinstance(let.value, S.Bin) and let.value.op == "/" else let.value
    found = _masked_exp(value, loop.var, floored)
    if found is None or not all(_a_term_of_a_sum(s, let.name) for s in walk(loop.body[1:])):
        return loop
    unmasked = found[1] if value is let.value else replace(let.value, left=found[1])
    cut.append(let.name)
    return replace(loop, stop=sympy.Min(loop.stop, found[0] + 1),
                   body=(replace(let, value=unmasked),) + loop.body[1:])


def _a_term_of_a_sum(s, p):
    """Whether statement s reads p only as a factor of what it adds to a sum."""
    if not any(p in S.free_names(e) for e in stmt_exprs(s)):
        return True
    adds = (isinstance(s, Store) and s.accumulate == "+") or (isinstance(s, Update)
                                                               and s.op == "+")
    value = s.value
    return (adds and isinstance(value, S.Bin) and value.op == "*"
            and S.Local(p) in (value.left, value.right)
            and p not in S.free_names(value.right if value.left == S.Local(p) else value.left))
