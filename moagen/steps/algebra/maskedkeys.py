"""MaskedKeys: the iterations a causal mask hides are not visited in a row's passes (the
row form, dnf), forward and backward.

A causal mask makes the score of query i and key j `P >= j ? s : -inf`, P free of j
(attention_varlen's query position i + n_k - n_q). In a pass over a query row's keys (the
forward's passes, the backward's dQ) the keys past P add nothing; in a pass over a key
row's queries (the backward's dK and dV) the queries before the first that sees the key,
F = j - (n_k - n_q) (the condition read as i >= F), add nothing:

    max[j < E](P >= j ? s : -inf)              ->  max[j < min(E, P + 1)](s)
    sum[j < E](exp((P >= j ? s : -inf) - t))   ->  sum[j < min(E, P + 1)](exp(s - t))
    for j in [a, E): let p = a * exp((P >= j ? s : -inf) - t) * b [/ u];  X += p * g(j)
                                               ->  for j in [a, min(E, P + 1)): ... exp(s - t) ...
    for i in [a, E): let p = ... exp((i >= F ? s : -inf) - t) ...;  X += p * g(i)
                                               ->  for i in [max(a, F), E): ... exp(s - t) ...

A max skips -inf, its identity. exp(-inf - t) is 0 where t > -inf, which holds where t is
floored (max(m, c), c a finite number, inline or a local let: attention_varlen's row max,
the backward's lse floored as it was), so the sum skips zeros, and so does the loop whose
p is 0 times finite factors and whose every use of p is a term p * g of a sum (x + 0 g = x
for a finite g; a sum begun at +0 is never -0, so the sign of a zero term is no matter):
the same values, bit for bit. A row past every key's mask (P < 0) runs no iteration: max
-inf and sum 0, as when every key was masked.

Refused (NotApplicable): a nest with no such pass, naming what a masked loop lacked (its
exponential subtracting a value not floored, its p read other than as a term of a sum). A
reduction that bounds its iterations from below (i >= F: a reduction's range starts at 0)
or a pass that lacks a precondition is left as it is.
"""
from dataclasses import dataclass, field, replace
from typing import List, Optional

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
        cuts = _Cuts(floored)
        body = cuts.block(nest.body)
        if not cuts.cut:
            why = "".join(f"; {reason}" for reason in cuts.left)
            raise NotApplicable(f"{self}: nest {nest.label} has no pass a causal mask cuts"
                                f"{why}")
        return body


@dataclass(frozen=True)
class _Seen:
    """The iterations of var a causal mask shows: var <= bound (last) or var >= bound."""
    last: bool
    bound: sympy.Expr

    def cut(self, loop):
        if self.last:
            return replace(loop, stop=sympy.Min(loop.stop, self.bound + 1))
        return replace(loop, start=sympy.Max(loop.start, self.bound))


def _seen(cond, var):
    """The iterations a condition linear in var, slope +-1 (P >= var, var >= F), keeps;
    else None."""
    if isinstance(cond, sympy.GreaterThan):
        diff = cond.lhs - cond.rhs
    elif isinstance(cond, sympy.LessThan):
        diff = cond.rhs - cond.lhs
    else:
        return None
    slope = sympy.diff(diff, var)
    rest = sympy.expand(diff - slope * var)  # diff = slope var + rest >= 0
    if var in rest.free_symbols or slope not in (1, -1):
        return None
    return _Seen(last=True, bound=rest) if slope == -1 else _Seen(last=False, bound=-rest)


def _masked(e, var):
    """(seen, s) where e is `cond ? s : -inf`, cond a causal mask of var; else None."""
    if isinstance(e, S.Select) and e.other == S.Num(float("-inf")):
        seen = _seen(e.cond, var)
        if seen is not None:
            return seen, e.then
    return None


def _masked_exp(e, var):
    """(seen, s, t) where e is exp((masked s) - t); else None."""
    if isinstance(e, S.Un) and e.fn == "exp" and isinstance(e.arg, S.Bin) and e.arg.op == "-":
        masked = _masked(e.arg.left, var)
        if masked:
            return masked + (e.arg.right,)
    return None


def _masked_factor(e, var):
    """(seen, t, e with the factor exp(s - t)) where exp((masked s) - t) is a factor of the
    product e (a divisor's dividend counted); else None."""
    found = _masked_exp(e, var)
    if found:
        seen, s, t = found
        return seen, t, S.Un("exp", S.Bin("-", s, t))
    if isinstance(e, S.Bin) and e.op in ("*", "/"):
        for side in ("left", "right") if e.op == "*" else ("left",):
            found = _masked_factor(getattr(e, side), var)
            if found:
                return found[:2] + (replace(e, **{side: found[2]}),)
    return None


@dataclass
class _Cuts:
    floored: frozenset  # the local lets of a floored value
    cut: List[str] = field(default_factory=list)  # what was cut, by name
    left: List[str] = field(default_factory=list)  # why a masked loop was not

    def is_floored(self, t):
        return (isinstance(t, S.Local) and t.name in self.floored) or bool(S.floored(t))

    def block(self, stmts):
        out = []
        for s in stmts:
            if isinstance(s, Loop):
                s = self.loop(s)
                s = replace(s, body=self.block(s.body))
            else:
                s = map_stmt_exprs(s, self.reductions)
            out.append(s)
        return tuple(out)

    def reductions(self, e):
        e = S.map_children(e, self.reductions)
        if not isinstance(e, S.Reduction):
            return e
        if e.op == "max":
            found = _masked(e.body, e.var)
            body = found and found[1]
        else:
            found = _masked_exp(e.body, e.var)
            found = found if found and self.is_floored(found[2]) else None
            body = found and S.Un("exp", S.Bin("-", found[1], found[2]))
        if found is None or not found[0].last:
            return e
        self.cut.append(e.name)
        return replace(e, extent=sympy.Min(e.extent, found[0].bound + 1), body=body)

    def loop(self, loop):
        """A loop whose first statement is let p = a product with a factor exp(masked - t)
        and whose every other read of p is a term p * g of a sum: cut to what the mask
        shows."""
        if not loop.body or not isinstance(loop.body[0], Let):
            return loop
        let = loop.body[0]
        found = _masked_factor(let.value, loop.var)
        if found is None:
            return loop
        seen, t, unmasked = found
        if not self.is_floored(t):
            subtracted = t.name if isinstance(t, S.Local) else "a value"
            self.left.append(f"loop {loop.var}: {let.name}'s exp subtracts {subtracted}, not "
                             "floored (exp(-inf - t) is 0 only where t > -inf)")
            return loop
        if not all(_a_term_of_a_sum(s, let.name) for s in walk(loop.body[1:])):
            self.left.append(f"loop {loop.var}: {let.name} is read other than as a term "
                             f"{let.name} * g of a sum")
            return loop
        self.cut.append(let.name)
        return seen.cut(replace(loop, body=(replace(let, value=unmasked),) + loop.body[1:]))


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
