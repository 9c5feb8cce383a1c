"""Scatter: a sum computed in parallel over what it runs over, its terms added atomically
into the zeroed output."""
from dataclasses import dataclass, replace
from typing import Tuple

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import Loop, Nest, ONF, Store, enclose, perfect_chain, walk
from moagen.onf.names import base_name, nest_role
from moagen.steps.step import Step, shown


@dataclass(frozen=True)
class Scatter(Step):
    """`for outer.., for rows.., out[.., row, ..] = sum_i f(i, row)` becomes a nest that zeroes
    `out` (named `<nest>.zero`) and a nest `for outer.., for i, for rows..: out[..] += f`, its
    updates atomic: iterations of i, run in parallel, add to the same rows. This is the
    backward's dK and dV under a loop over query rows."""
    layer = "algorithm"
    nest: str
    over: str = shown("over={over}")
    # loops kept outside the new reduction loop (batch, head)
    outer: Tuple[str, ...] = shown("outer=({outer})")

    @property
    def zero(self) -> str:
        """The nest it creates that zeroes the array before the additions."""
        return nest_role(self.nest, "zero")

    def __call__(self, onf: ONF) -> ONF:
        nest = self.nest_called(onf)
        store = next((s for s in walk(nest.body) if isinstance(s, Store)), None)
        loops = perfect_chain(nest.body, len(store.index) if store else 0)
        red = store.value if store else None
        if (loops is None or store.accumulate or not isinstance(red, S.Reduction)
                or red.op != "+" or base_name(red.var.name) != self.over):
            raise ScheduleError(f"{self}: nest {self.nest} is not a store of a sum over "
                                f"{self.over} inside its output loops")
        names = [lp.var.name for lp in loops]
        if names[:len(self.outer)] != list(self.outer):
            raise ScheduleError(f"{self}: nest {self.nest}'s outer loops are {names}")
        if red.extent.free_symbols & {lp.var for lp in loops}:
            raise ScheduleError(f"{self}: the extent of {red.var} depends on an output index")
        taken = {lp.var.name for lp in loops}
        var = sympy.Symbol(self.over if self.over not in taken else red.var.name, integer=True)
        zero = replace(store, value=S.Num(0.0))
        update = replace(store, value=S.subs(red.body, {red.var: var}), accumulate="+",
                         atomic=True)
        inner = enclose(loops[len(self.outer):], (update,))
        body = enclose(loops[:len(self.outer)], (Loop(var, sympy.Integer(0), red.extent, inner),))
        nests = []
        for n in onf.nests:
            if n is nest:
                nests += [Nest(n.target, enclose(loops, (zero,)), f"{n.target} = 0", self.zero),
                          replace(n, body=body)]
            else:
                nests.append(n)
        return onf.with_nests(nests, str(self))
