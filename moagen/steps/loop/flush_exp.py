"""FlushExp: a softmax's exponentials of masked scores that stay on the vector exp's fast
path."""
from dataclasses import dataclass
from typing import Optional

from moagen.moa import scalar as S
from moagen.onf.loops import map_stmt_exprs, stmt_exprs, walk
from moagen.steps.step import NotApplicable, Step


@dataclass(frozen=True)
class FlushExp(Step):
    """Every exp in the nest becomes exp_flushed: exp(x), or 0 where x is below
    moagen.moa.scalar.FLUSHED_BELOW (-700 in float64, -80 in float32), which the C and
    Fortran printers compute as the exponential of x clamped above glibc's vector exp's
    special-case range, then selected. A mask added to the scores puts -inf in them, and
    glibc's vector exp takes its slow path for a whole vector whenever one lane is below
    about -708 (a fifth of the keys masked: half again the kernel's instructions).
    Precondition, the caller's: the exponentials are a softmax's, exp(score - its row's
    maximum or logsumexp): terms of at most 1 whose row sums to at least 1 (or a rescale
    of such a sum), so that a term below e^-700 (float32 e^-80) is below the rounding of
    any sum over its row. Refused: a nest with no exp."""
    nest: Optional[str] = None

    def rewrite_nest(self, nest, names):
        if not any(isinstance(x, S.Un) and x.fn == "exp"
                   for s in walk(nest.body) for e in stmt_exprs(s) for x in S.subexpressions(e)):
            raise NotApplicable(f"{self}: nest {nest.label} has no exp")
        return tuple(map_stmt_exprs(s, _flushed) for s in nest.body)


def _flushed(e):
    if isinstance(e, S.Un) and e.fn == "exp":
        return S.Un("exp_flushed", _flushed(e.arg))
    return S.map_children(e, _flushed)
