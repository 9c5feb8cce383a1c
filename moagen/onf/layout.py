"""gamma: the layout function turning a multi-index into a flat offset.

row-major:    gamma(p, s) = sum_k p_k * prod_{j>k} s_j   (printed in Horner form)
column-major: gamma(p, s) = sum_k p_k * prod_{j<k} s_j

The layout is a parameter of the ONF, applied to every array; the math does not change.
"""
from dataclasses import replace

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import ONF, Store, Loop, map_stmt_exprs


def gamma(index, shape, layout: str) -> sympy.Expr:
    if len(index) != len(shape):
        raise ScheduleError(f"gamma: index {index} does not fit shape {shape}")
    if not index:
        return sympy.Integer(0)
    order = range(len(index)) if layout == "row" else reversed(range(len(index)))
    offset = None
    for k in order:
        offset = index[k] if offset is None else offset * shape[k] + index[k]
    return offset


def apply_layout(onf: ONF) -> ONF:
    if onf.layout not in ("row", "col"):
        raise ScheduleError(f"unknown layout {onf.layout!r}; expected 'row' or 'col'")
    shapes = {b.name: b.shape for b in onf.inputs + onf.outputs + onf.temps}

    def flat_expr(e):
        if isinstance(e, S.Access):
            return S.Load(e.array, gamma(e.index, shapes[e.array], onf.layout))
        return S.map_children(e, flat_expr)

    def flat_stmt(s):
        s = map_stmt_exprs(s, flat_expr) if not isinstance(s, Loop) else replace(
            s, body=tuple(flat_stmt(b) for b in s.body))
        if isinstance(s, Store):
            s = replace(s, index=(gamma(s.index, shapes[s.array], onf.layout),))
        return s

    nests = [replace(n, body=tuple(flat_stmt(s) for s in n.body)) for n in onf.nests]
    return replace(onf, nests=tuple(nests), flat=True)
