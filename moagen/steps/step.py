"""The base of every schedule step.

A step is a named, frozen value: called on an ONF it returns the next ONF, or raises
ScheduleError when its precondition does not hold; str(step) is how the schedule prints it
(the ONF dump, the banner of every generated file). A step that creates loops or nests names
them by moagen.onf.names' rule, or as its caller says, and offers those names as properties,
so that later steps (and the kernel modules) never spell a name another step invented."""
from moagen.onf.loops import ONF


LAYERS = ("algorithm", "schedule", "mapping")


class Step:
    # which layer of a variant the step belongs to: an algebraic rewrite or a choice of what
    # is materialized ("algorithm"), a loop transformation ("schedule"), or where loops run
    # on a target ("mapping")
    layer = "schedule"

    def __call__(self, onf: ONF) -> ONF:
        raise NotImplementedError
