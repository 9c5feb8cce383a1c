"""Accumulate: a reduction loop moves outside an output loop, so that what depends on the
reduction's variable only is computed once per iteration of it."""
from dataclasses import dataclass, replace
from typing import Optional

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import Loop, Store, rewrite_loops
from moagen.onf.names import Names, base_name
from moagen.steps.step import NotApplicable, Step, shown


@dataclass(frozen=True)
class Accumulate(Step):
    """`for c: out[.., c] = op_j body(j, c)` becomes
    `for c: out[.., c] = identity;  for j: for c: out[.., c] op= body(j, c)`,
    so that whatever in body depends on j but not on c can be computed once per j.
    `for c: out[.., c] op= op_j body(j, c)` (an outer sum's terms, after that sum's own
    Accumulate) becomes `for j: for c: out[.., c] op= body(j, c)`."""
    loop: str
    over: str = shown("over={over}")
    nest: Optional[str] = None

    def rewrite_nest(self, nest, names):
        body, count = rewrite_loops(nest.body, self._selects,
                                    lambda lp, scope: self._interchange(lp, scope, names))
        if not count:
            raise NotApplicable(f"{self}: nest {nest.label} has no loop {self.loop} whose body is "
                                f"a single store of a reduction over {self.over}")
        return body

    def _selects(self, loop):
        """A loop over `loop` around one store of a reduction over `over` (or adding its
        terms into what the store holds)."""
        if loop.var.name != self.loop or len(loop.body) != 1 or not isinstance(loop.body[0], Store):
            return False
        store = loop.body[0]
        red = store.value
        return (isinstance(red, S.Reduction) and base_name(red.var.name) == self.over
                and store.accumulate in (None, red.op))

    def _interchange(self, loop, scope, names):
        store = loop.body[0]
        red = store.value
        if loop.var in red.extent.free_symbols:
            raise ScheduleError(f"{self}: the extent {red.extent} of {red.var} depends on "
                                f"{loop.var}")
        # the role's own name: only the loop itself, enclosing loops and locals can clash
        taken = scope | {loop.var.name} | names.fixed | names.locals
        var = sympy.Symbol(Names(taken).new(self.over), integer=True)
        update = replace(store, value=S.subs(red.body, {red.var: var}), accumulate=red.op)
        sweep = Loop(var, sympy.Integer(0), red.extent, (replace(loop, body=(update,)),))
        if store.accumulate:  # already adding into out (an outer sum's loop): no identity
            return (sweep,)
        init = replace(loop, body=(replace(store, value=S.Num(S.IDENTITY[red.op])),))
        return (init, sweep)

