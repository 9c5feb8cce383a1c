"""A loop over h in [0, outer * inner) as two, h = inner * g + r:

    for h in [0, outer * inner): B(h)  ->  for g in [0, outer): for r in [0, inner): B(inner g + r)

where B's indices hold idiv(h, inner) (grouped-query attention: the KV head of query head h,
inner = q_heads / kv_heads): inside the pair that quotient is g itself.

Why: unrolling and jamming query heads then runs over r, inside one group, so that every
copy reads the same KV row, through one index expression. Jammed over h instead, copy u
reads KV head idiv(f h_tile + u, inner), which the compiler cannot tell are equal: it loads
the row once per copy, and each copy's quotient is a division of its own.

Legal when the loop runs over exactly outer * inner iterations: the kernel's validate hook
must ensure it at every call (decode: kv_heads divides q_heads), as it must for the quotient
in its indices to mean a group."""
from dataclasses import dataclass, replace
from typing import Tuple

import sympy

from moagen.moa.expr import as_dim, idiv
from moagen.onf.loops import Loop, ONF, enclose, find_nest, loop_vars, subs_stmts
from moagen.steps.loop.schedule import claim_loop, kernel_names
from moagen.steps.step import Step
from moagen.steps.loop.unroll import outer_loop


@dataclass(frozen=True)
class SplitLoop(Step):
    nest: str
    loop: str
    outer: object  # the outer loop's extent (a size name or expression): kv_heads
    inner: object  # the inner one's: idiv(q_heads, kv_heads)
    names: Tuple[str, str] = ("g", "r")

    def __str__(self):
        return (f"split_loop({self.nest}, {self.loop} = {self.inner}*{self.names[0]} + "
                f"{self.names[1]})")

    @property
    def groups(self) -> str:
        """The outer loop it creates (g)."""
        return self.names[0]

    @property
    def members(self) -> str:
        """The inner loop it creates (r)."""
        return self.names[1]

    def __call__(self, onf: ONF) -> ONF:
        nest = find_nest(onf, self.nest, self)
        around, loop = outer_loop(self, nest.body, self.loop)
        names = kernel_names(onf)
        scope = {lp.var.name for lp in around} | loop_vars((loop,))
        g, r = (claim_loop(names, n, scope, self) for n in self.names)
        outer, inner = as_dim(self.outer), as_dim(self.inner)
        h = inner * g + r
        body = subs_stmts(subs_stmts(loop.body, {loop.var: h}), {idiv(h, inner): g})
        split = Loop(g, sympy.Integer(0), outer, (Loop(r, sympy.Integer(0), inner, body),))
        return onf.with_nests([replace(n, body=enclose(around, (split,))) if n is nest else n
                               for n in onf.nests], str(self))
