"""Fission: a loop whose body is several independent computations, one loop each."""
from dataclasses import dataclass, replace
from typing import Optional

from moagen.onf.loops import rewrite_loops
from moagen.steps.loop.fusion import independent
from moagen.steps.step import NotApplicable, Step


@dataclass(frozen=True)
class Fission(Step):
    """Loop fission: a loop over `var` whose statements fall into chains that share nothing
    (a key block's scores, qk = Q K^T and their store, beside dO V^T and its store) becomes
    one loop per chain, in the order of their first statements, each chain's statements in
    theirs. Two statements are in one chain where a value flows between them or they write
    one thing (moagen.steps.loop.fusion.independent), so each element gets the same
    operations in the same order: the values are the same bit for bit. On a GPU each
    product's loop then reads two staged tiles, not four (Stage's late copies, placed before
    the loop that first reads them)."""
    var: str
    nest: Optional[str] = None

    def rewrite_nest(self, nest, names):
        body, count = rewrite_loops(nest.body, self._selects, lambda loop, scope: self._split(loop))
        if not count:
            raise NotApplicable(f"{self}: nest {nest.label} has no loop over {self.var} whose "
                                "body is independent computations")
        return body

    def _selects(self, loop):
        return loop.var.name == self.var and len(_chains(loop.body)) > 1

    def _split(self, loop):
        return tuple(replace(loop, body=chain) for chain in _chains(loop.body))


def _chains(stmts):
    """stmts as the chains no value flows between, in the order of their first statements."""
    first = list(range(len(stmts)))  # each statement's link toward its chain's first one

    def root(k):
        while first[k] != k:
            k = first[k]
        return k

    for a in range(len(stmts)):
        for b in range(a):
            if not independent(stmts[a], stmts[b]):
                ra, rb = root(a), root(b)
                first[max(ra, rb)] = min(ra, rb)
    chains = {}
    for k, s in enumerate(stmts):
        chains.setdefault(root(k), []).append(s)
    return [tuple(c) for c in chains.values()]
