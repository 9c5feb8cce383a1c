"""In-place update: an output that equals an input except where an index condition picks
new values (a KV cache with one row appended) is written into the input itself, and only
where the condition holds: O(row), not O(cache)."""
from dataclasses import dataclass, replace

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import ONF, Store, enclose, perfect_chain
from moagen.steps.step import Step, hidden, shown


@dataclass(frozen=True)
class InPlace(Step):
    layer = "algorithm"
    output: str = shown("{output} -> {input}")
    input: str = hidden()

    def __call__(self, onf: ONF) -> ONF:
        nest = next((n for n in onf.nests if n.label == self.output), None)
        buffers = {b.name: b for b in onf.inputs + onf.outputs}
        if nest is None or self.input not in buffers or self.output not in buffers:
            raise ScheduleError(f"{self}: no nest {self.output} or no input {self.input}")
        if buffers[self.input].shape != buffers[self.output].shape:
            raise ScheduleError(f"{self}: {self.output} and {self.input} differ in shape")
        chain = perfect_chain(nest.body, len(buffers[self.output].shape))
        store = chain[-1].body[0] if chain and len(chain[-1].body) == 1 else None
        value = store.value if isinstance(store, Store) else None
        if not (isinstance(value, S.Select) and value.other == S.Access(self.input, store.index)):
            raise ScheduleError(f"{self}: {self.output} is not `new where condition, else "
                                f"{self.input}`")
        var, at = _solved(value.cond, [lp.var for lp in chain])
        if var is None:
            raise ScheduleError(f"{self}: the condition {value.cond} does not fix one index")
        write = Store(self.input, tuple(sympy.sympify(i).xreplace({var: at}) for i in store.index),
                      S.subs(value.then, {var: at}))
        body = enclose([lp for lp in chain if lp.var != var], (write,))
        nests = [replace(n, target=self.input, body=body) if n is nest else n for n in onf.nests]
        return replace(onf.with_nests(nests, str(self)),
                       outputs=tuple(b for b in onf.outputs if b.name != self.output),
                       inout=onf.inout + (self.input,))


def _solved(cond, loop_vars):
    """(v, e) when cond is v == e for a loop variable v and e free of loop variables."""
    if not isinstance(cond, sympy.Eq):
        return None, None
    for var, at in ((cond.lhs, cond.rhs), (cond.rhs, cond.lhs)):
        if var in loop_vars and not at.free_symbols & set(loop_vars):
            return var, at
    return None, None
