"""Counting from the ONF: how many times each statement runs, as a symbolic expression in
the kernel's sizes. The atomic updates a variant performs are read off here, not typed in."""
from functools import lru_cache
from typing import Dict, Iterable

import sympy

from moagen.moa.expr import idiv
from moagen.onf.loops import Loop, Nest, Store


def executions(stmts, predicate, multiplier=sympy.Integer(1)) -> Dict[str, sympy.Expr]:
    """For each statement matching predicate, keyed by its array or local name: how often
    it runs. A loop whose bounds depend on an enclosing loop is summed, not multiplied."""
    counts: Dict[str, sympy.Expr] = {}
    for s in stmts:
        if isinstance(s, Loop):
            inner = executions(s.body, predicate)
            for key, count in inner.items():
                if s.var in count.free_symbols and _term_by_term(count, s):
                    # a causal tile's phases: a few iterations, each a whole division
                    total = sum(count.xreplace({s.var: k}) for k in range(s.start, s.stop))
                elif s.var in count.free_symbols:
                    total = _summed(count, s.var, s.start, s.stop - 1)
                else:
                    total = count * (s.stop - s.start)
                counts[key] = counts.get(key, 0) + multiplier * total
        elif predicate(s):
            key = getattr(s, "array", None) or s.name
            counts[key] = counts.get(key, 0) + multiplier
    return {k: _factored(v) for k, v in counts.items()}


# remembered: a kernel's nests, its variants and its backward sum the same counts over the
# same loops again, and sympy's closed forms (solve, factor) are most of a prediction's time
@lru_cache(maxsize=4096)
def _summed(count, var, first, last):
    return sympy.summation(count, (var, first, last))


@lru_cache(maxsize=4096)
def _factored(e):
    return sympy.factor(e)


def _term_by_term(count, loop) -> bool:
    """Whether count is summed over the loop by its terms: a fixed range, and the variable
    inside a division, which sympy's closed forms do not take."""
    return loop.start.is_Integer and loop.stop.is_Integer and \
        any(loop.var in d.free_symbols for d in count.atoms(idiv))


def atomic_updates(nests: Iterable[Nest]) -> Dict[str, sympy.Expr]:
    """Atomic updates per array over one call of the nests: an ONF's (exact) or its
    counting view's (closed forms where tiles are full)."""
    is_atomic = lambda s: isinstance(s, Store) and s.atomic
    totals: Dict[str, sympy.Expr] = {}
    for nest in nests:
        for key, count in executions(nest.body, is_atomic).items():
            totals[key] = sympy.factor(totals.get(key, 0) + count)
    return totals
