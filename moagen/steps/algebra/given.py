"""A size the caller gives at call time that the spec does not know: a schedule's own
choice, such as how many keys a warp of flash-decoding walks.

GivenSize("w", choose) adds the size w after the kernel's own, so that later steps may
use it in their expressions and every language's kernel takes it as an argument like a
KV cache's valid length n. `choose(sizes, sms)` is what a binding passes where the caller
gives none (moagen.targets.abi): the other sizes by name and the SMs of the GPU the kernel
runs on (None on a CPU). Precondition of every step that uses it: the call makes it at
least 1, which the binding checks for a given value and `choose` promises for its own."""
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Tuple

from moagen.errors import ScheduleError
from moagen.moa.expr import sym
from moagen.onf.loops import ONF, loop_vars
from moagen.steps.step import Step


@dataclass(frozen=True)
class GivenSize(Step):
    layer = "algorithm"
    name: str
    choose: Callable = field(metadata={"hidden": True})

    def __call__(self, onf: ONF) -> ONF:
        taken = {s.name for s in onf.sizes} | {b.name for b in onf.inputs + onf.outputs
                                                + onf.temps} | set(onf.scalars) \
            | {v for n in onf.nests for v in loop_vars(n.body)}
        if self.name in taken:
            raise ScheduleError(f"{self}: {onf.name} already has a size, array, scalar or "
                                f"loop called {self.name}")
        return replace(onf, sizes=onf.sizes + (sym(self.name),),
                       chosen=onf.chosen + ((self.name, self.choose),),
                       schedule=onf.schedule + (str(self),))


def with_chosen(chosen: Tuple[Tuple[str, Callable], ...], sizes: Dict[str, int],
                sms=None) -> Dict[str, int]:
    """`sizes` by name with each chosen size they lack as its choose picks it for them on
    `sms` SMs (None: this machine's CPU): what a call leaving it out runs at. ValueError for
    one given below 1."""
    low = [f"{name} = {sizes[name]}" for name, _ in chosen if sizes.get(name, 1) < 1]
    if low:
        raise ValueError(f"size {low[0]} must be >= 1 (leave it out for the kernel's choice)")
    return {**{name: choose(sizes, sms) for name, choose in chosen if name not in sizes},
            **sizes}
