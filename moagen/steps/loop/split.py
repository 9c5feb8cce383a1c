"""Loops cut in two: a loop by blocks of its iterations (Split), and a loop over
outer x inner iterations as a loop over groups holding a loop over their members
(SplitLoop).

SplitLoop: a loop over h in [0, outer * inner) as two, h = inner * g + r:

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
from typing import Optional

import sympy

from moagen.errors import ScheduleError
from moagen.moa.expr import as_dim, idiv
from moagen.onf.loops import (Loop, enclose, loop_vars, perfect_chain, rewrite_loops, subs_stmts,
                              walk)
from moagen.onf.names import GROUPS, MEMBERS, claim_loop, loop_role
from moagen.steps.loop.parallel import check_rectangular
from moagen.steps.loop.unroll import outer_loop
from moagen.steps.step import NotApplicable, Step, hidden, shown


@dataclass(frozen=True)
class Split(Step):
    """Dimension lifting: `for i in [0, n)` becomes
    `for i_blk in [0, ceil(n/T)): for i in [i_blk*T, min(n, i_blk*T + T))`."""
    var: str
    tile: int
    nest: Optional[str] = None

    @property
    def blocks(self) -> str:
        """The loop over the blocks it creates."""
        return loop_role(self.var, "blk")

    def rewrite_nest(self, nest, names):
        if self.tile < 1:
            raise ScheduleError(f"{self}: the tile size must be at least 1")

        def split(loop, scope):
            if loop.start != 0:
                raise ScheduleError(f"{self}: loop {loop.var} does not start at 0")
            inside = loop_vars((loop,))
            blk = claim_loop(names, self.blocks, scope | inside, self)
            lo = blk * self.tile
            inner = replace(loop, start=lo, stop=sympy.Min(loop.stop, lo + self.tile), parallel=0)
            return (Loop(blk, sympy.Integer(0), idiv(loop.stop + self.tile - 1, self.tile), (inner,),
                         loop.parallel),)

        body, count = rewrite_loops(nest.body, lambda loop: loop.var.name == self.var, split)
        if not count:
            raise NotApplicable(f"{self}: nest {nest.label} has no loop {self.var}")
        # splitting a parallel loop other than the innermost makes the tile loop's bounds
        # depend on the block loop, which neither OpenMP's collapse nor CUDA can map
        for lp in walk(body):
            if isinstance(lp, Loop) and lp.parallel:
                check_rectangular(self, perfect_chain((lp,), lp.parallel))
        return body


@dataclass(frozen=True)
class SplitLoop(Step):
    nest: str
    loop: str = shown("{loop} = {inner}*{groups} + {members}")
    outer: object = hidden()  # the outer loop's extent (a size name or expression): kv_heads
    inner: object = hidden()  # the inner one's: idiv(q_heads, kv_heads)

    @property
    def groups(self) -> str:
        """The outer loop it creates (g)."""
        return GROUPS

    @property
    def members(self) -> str:
        """The inner loop it creates (r)."""
        return MEMBERS

    def rewrite_nest(self, nest, names):
        around, loop = outer_loop(self, nest.body, self.loop)
        scope = {lp.var.name for lp in around} | loop_vars((loop,))
        g, r = (claim_loop(names, n, scope, self) for n in (self.groups, self.members))
        outer, inner = as_dim(self.outer), as_dim(self.inner)
        h = inner * g + r
        body = subs_stmts(subs_stmts(loop.body, {loop.var: h}), {idiv(h, inner): g})
        split = Loop(g, sympy.Integer(0), outer, (Loop(r, sympy.Integer(0), inner, body),))
        return enclose(around, (split,))
