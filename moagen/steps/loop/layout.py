"""ApplyLayout: gamma (moagen.onf.layout) turns every index into a flat offset, by the
ONF's layout, row- or column-major. A closing step of every ONF (moagen.onf.realize)."""
from dataclasses import dataclass, replace

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.layout import gamma
from moagen.onf.loops import Loop, ONF, Store, map_stmt_exprs
from moagen.steps.step import Step


@dataclass(frozen=True)
class ApplyLayout(Step):
    """Not recorded in the schedule: every ONF ends with it, whatever the variant chose."""

    def __call__(self, onf: ONF) -> ONF:
        if onf.layout not in ("row", "col"):
            raise ScheduleError(f"unknown layout {onf.layout!r}; expected 'row' or 'col'")
        shapes = {b.name: b.shape for b in onf.inputs + onf.outputs + onf.temps + onf.shared}
        # a block's shared tiles are laid out by the step that made them, row-major
        layouts = {b.name: "row" for b in onf.shared}

        def offset(array, index):
            return gamma(index, shapes[array], layouts.get(array, onf.layout))

        def flat_expr(e):
            if isinstance(e, S.Access):
                return S.Load(e.array, offset(e.array, e.index))
            return S.map_children(e, flat_expr)

        def flat_stmt(s):
            s = map_stmt_exprs(s, flat_expr) if not isinstance(s, Loop) else replace(
                s, body=tuple(flat_stmt(b) for b in s.body))
            if isinstance(s, Store):
                s = replace(s, index=(offset(s.array, s.index),))
            return s

        nests = [replace(n, body=tuple(flat_stmt(s) for s in n.body)) for n in onf.nests]
        return replace(onf, nests=tuple(nests), flat=True)
