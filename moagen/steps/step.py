"""The base of every schedule step.

A step is a named, frozen value: called on an ONF it returns the next ONF, or raises
ScheduleError when its precondition does not hold; str(step) is how the schedule prints it
(the ONF dump, the banner of every generated file). A step that creates loops or nests names
them by moagen.onf.names' rule, or as its caller says, and offers those names as properties,
so that later steps (and the kernel modules) never spell a name another step invented."""
from dataclasses import replace
from typing import Optional

from moagen.errors import ScheduleError
from moagen.onf.loops import Nest, ONF
from moagen.onf.names import Names, kernel_names


LAYERS = ("algorithm", "schedule", "mapping")


class Step:
    # which layer of a variant the step belongs to: an algebraic rewrite or a choice of what
    # is materialized ("algorithm"), a loop transformation ("schedule"), or where loops run
    # on a target ("mapping")
    layer = "schedule"

    def __call__(self, onf: ONF) -> ONF:
        raise NotImplementedError


class NotApplicable(ScheduleError):
    """The nest lacks what the transform works on (as opposed to a violated precondition)."""


class Transform(Step):
    """A step that rewrites nests one at a time: `nest_fn` on the selected nest, or, when
    `nest` is None, on every nest it applies to (at least one)."""
    nest: Optional[str] = None

    def chosen(self, onf: ONF):
        return [n for n in onf.nests if self.nest is None or n.label == self.nest]

    def __call__(self, onf: ONF) -> ONF:
        chosen = self.chosen(onf)
        if not chosen:
            raise ScheduleError(f"{self}: {onf.name} has no nest {self.nest!r}; it has "
                                f"{', '.join(n.label for n in onf.nests)}")
        names = kernel_names(onf)
        nests, misses = [], []
        for n in onf.nests:
            try:
                nests.append(replace(n, body=self.nest_fn(n, names)) if n in chosen else n)
            except NotApplicable as miss:
                if self.nest is not None:
                    raise
                misses.append(miss)
                nests.append(n)
        if len(misses) == len(chosen):
            raise misses[0]
        return onf.with_nests(nests, str(self))

    def nest_fn(self, nest: Nest, names: Names):
        raise NotImplementedError

    def _on(self):
        return f", nest={self.nest}" if self.nest else ""
