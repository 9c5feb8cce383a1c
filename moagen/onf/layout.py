"""gamma: the layout function turning a multi-index into a flat offset.

row-major:    gamma(p, s) = sum_k p_k * prod_{j>k} s_j   (printed in Horner form)
column-major: gamma(p, s) = sum_k p_k * prod_{j<k} s_j

The layout is a parameter of the ONF, applied to every array by the closing step
moagen.steps.loop.layout.ApplyLayout; the math does not change.
"""
import sympy

from moagen.errors import ScheduleError


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
