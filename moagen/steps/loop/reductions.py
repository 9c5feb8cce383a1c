"""Reduction lowering, a schedule step like any other: every reduction left in an
expression becomes an accumulator and a loop,

    let row_max = max[j < n](body)   ->   let row_max = -inf
                                          for j in [0, n): row_max max= body

and a reduction nested in a larger expression is first given a local of its own. Loop
variables get back their role's name (j2 -> j) wherever that name is free. Steps that work
on loops of statements (UnrollJam, KeyBlocks) need it before them; every schedule ends with
it (moagen.onf.realize)."""
from dataclasses import dataclass, replace

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import Let, Loop, ONF, Update, map_stmt_exprs, stmt_exprs, walk
from moagen.onf.names import Names, base_name, kernel_names
from moagen.steps.step import Step


@dataclass(frozen=True)
class LowerReductions(Step):

    def __call__(self, onf: ONF) -> ONF:
        lower = _Lowering(kernel_names(onf))
        nests = [replace(n, body=lower.block(n.body, frozenset(), frozenset()))
                 for n in onf.nests]
        return onf.with_nests(nests, str(self))


def require_lowered(nest, who):
    """ScheduleError unless the nest's reductions are loops already (LowerReductions)."""
    if any(isinstance(e, S.Reduction) for s in walk(nest.body) for x in stmt_exprs(s)
           for e in S.subexpressions(x)):
        raise ScheduleError(f"{who}: nest {nest.label} still holds reductions; lower them "
                            "first (lower_reductions before this step)")


class _Lowering:
    def __init__(self, names: Names):
        self.names = names

    def block(self, stmts, scope, visible):
        """scope: loop variables bound around this block; visible: locals declared so far."""
        out = []
        visible = set(visible)
        for s in stmts:
            if isinstance(s, Loop):
                out.append(replace(s, body=self.block(s.body, scope | {s.var.name}, visible)))
                continue
            if isinstance(s, Let) and isinstance(s.value, S.Reduction):
                out += self.accumulate(s.name, s.value, scope, visible)
            else:
                pre = []
                stmt = map_stmt_exprs(s, lambda e: self.lift(e, scope, visible, pre))
                out += pre + [stmt]
            if isinstance(s, Let):
                visible.add(s.name)
        return tuple(out)

    def lift(self, e, scope, visible, pre):
        """Replace each outermost reduction in e by a new local computed in `pre`."""
        if isinstance(e, S.Reduction):
            name = self.names.new(e.name, visible | set(scope))
            self.names.locals.add(name)
            visible.add(name)
            pre += self.accumulate(name, e, scope, visible)
            return S.Local(name)
        return S.map_children(e, lambda c: self.lift(c, scope, visible, pre))

    def accumulate(self, acc, red: S.Reduction, scope, visible):
        var = self.loop_var(red.var.name, scope)
        update = Update(acc, red.op, S.subs(red.body, {red.var: var}))
        loop = Loop(var, sympy.Integer(0), red.extent,
                    self.block((update,), scope | {var.name}, visible | {acc}))
        return [Let(acc, S.Num(S.IDENTITY[red.op])), loop]

    def loop_var(self, name, scope):
        """The role's name unless a variable of that name is live here; sibling loops
        reuse names freely."""
        taken = set(scope) | self.names.locals | self.names.fixed
        fresh = Names(taken).new(base_name(name))
        self.names.claim(fresh)  # a later local must not take a loop variable's name
        return sympy.Symbol(fresh, integer=True)
