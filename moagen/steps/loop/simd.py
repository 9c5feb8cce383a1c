"""SIMD marks (MarkSimd), the closing step after lowering and layout that lets the compiler
vectorize innermost loops that are reductions (a dot product q . k, a row's sum of squares).

Without `-ffast-math` a compiler may not reorder a floating-point sum, so `acc += x[c] *
y[c]` runs one element per add latency. A loop marked here is printed with an OpenMP
`simd` directive naming its reductions (`#pragma omp simd reduction(+:acc)`, `!$omp simd
...`): the sum is split over vector lanes and combined at the end. That reorders the sum
(one fixed order per build: runs stay bitwise reproducible), within the verification
tolerances.

A loop is marked only where the lanes cannot interfere: it is innermost, not a register
tile's sum (already vector code), every store in it (plain or accumulating, not atomic) is
indexed by the loop variable, every read of a stored array is at an offset stored in the
loop, stores to one array a whole number of the loop's extents apart (or a fixed distance
at least its longest run), and
the outer locals it changes are accumulated with + or max. That a C function holding a
register tile opts out of the loop vectorizer leaves these loops vectorized: `omp simd`
asks for it loop by loop.

A marked loop's reads that the loop does not move (an element of a row's statistic read at
every column: `dz[c] * inv_rms[i]`) are loaded once, into locals just before it. The
compiler would do it where it can prove the loop's stores miss that element; inside an
OpenMP parallel loop's outlined body the pointers lose `restrict` and it cannot, and gcc
then reloads the element in the loop's latch, which stops it vectorizing the loop at all
(RMSNorm's backward was left scalar: docs/PERFORMANCE.md, "RMSNorm").
"""
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import combinations

import sympy

from moagen.moa import scalar as S
from moagen.moa.expr import simplified
from moagen.onf.loops import (ONF, Let, Loop, Store, Update, bounded_extents, map_stmt_exprs,
                              offsets_of, stmt_exprs)
from moagen.onf.names import kernel_names
from moagen.steps.step import Step


@dataclass(frozen=True)
class MarkSimd(Step):
    """Not recorded in the schedule: every ONF ends with it, whatever the variant chose."""

    def __call__(self, onf: ONF) -> ONF:
        names = kernel_names(onf)
        # the inputs' dimensions: at least 1 in every call (moagen.targets.abi checks)
        positive = frozenset(s for buffer in onf.inputs for dim in buffer.shape
                             for s in sympy.sympify(dim).free_symbols)
        offsets = offsets_of(onf)
        nests = [replace(n, body=_mark_block(n.body, names, positive, offsets))
                 for n in onf.nests]
        return replace(onf, nests=tuple(nests))


def _mark_block(stmts, names, positive, offsets):
    """stmts with their innermost vectorizable loops marked, each after the locals that
    hold its invariant reads; offsets: the kernel's (offsets_of)."""
    out = []
    for s in stmts:
        if not isinstance(s, Loop):
            out.append(s)
        elif any(isinstance(b, Loop) for b in s.body):
            out.append(replace(s, body=_mark_block(s.body, names, positive, offsets)))
        elif _vectorizable(s, positive, offsets):
            loads, loop = _invariant_loads(s, names)
            out += loads
            out.append(replace(loop, simd=True))
        else:
            out.append(s)
    return tuple(out)


def _invariant_loads(loop: Loop, names):
    """Lets loading the elements the loop reads at the same offset in every iteration, of
    arrays it does not store into, and the loop reading those locals instead. As with
    Hoist's values, the element is read even where the loop runs no iteration; its offset
    depends only on the loops around it (in the kernels today a row's statistic: lse,
    delta, inv_rms at the row those loops are at)."""
    stored = {s.array for s in loop.body if isinstance(s, Store)}
    found = {}
    for b in loop.body:
        for x in stmt_exprs(b):
            for e in S.subexpressions(x):
                if (isinstance(e, S.Load) and e.array not in stored and e not in found
                        and loop.var not in e.offset.free_symbols):
                    found[e] = names.claim(names.new(f"{e.array}_at"))
    names.locals.update(found.values())
    body = loop.body
    for load, name in found.items():
        body = tuple(map_stmt_exprs(b, lambda e: S.replace_node(e, load, S.Local(name)))
                     for b in body)
    return tuple(Let(name, load) for load, name in found.items()), replace(loop, body=body)


def simd_reductions(loop: Loop):
    """(op, names) of the outer locals a loop accumulates, op in "+", "max"."""
    declared = {s.name for s in loop.body if isinstance(s, Let)}
    out = {}
    for s in loop.body:
        if isinstance(s, Update) and s.name not in declared:
            out.setdefault(s.op, []).append(s.name)
    return {op: list(dict.fromkeys(names)) for op, names in out.items()}


def simd_clauses(loop: Loop) -> str:
    """The directive's reduction clauses, the same text in C and Fortran."""
    return "".join(f" reduction({op}:{', '.join(names)})"
                   for op, names in simd_reductions(loop).items())


def _vectorizable(loop: Loop, positive=frozenset(), sequences=None) -> bool:
    """positive: the size symbols that are at least 1; sequences: the kernel's offsets, whose
    sequences' extents in the loop's stop are taken at their bound (bounded_extents: the
    stores' distances are then compared with the most a sequence's loop runs)."""
    if loop.vector_tile or loop.parallel:
        return False
    if set(simd_reductions(loop)) - {"+", "max"}:
        return False  # an assignment to an outer local (a running max) depends on order
    stores = [s for s in loop.body if isinstance(s, Store)]
    stored = {}
    for st in stores:
        if st.atomic or loop.var not in sympy.sympify(st.index[0]).free_symbols:
            return False  # every lane would update the same element
        stored.setdefault(st.array, set()).add(st.index[0])
    for array, offsets in stored.items():
        reads = {e.offset for b in loop.body for x in stmt_exprs(b)
                 for e in S.subexpressions(x) if isinstance(e, S.Load) and e.array == array}
        if reads - offsets:
            return False  # another iteration's element: the lanes would see stale values
        stop = bounded_extents(loop.stop, sequences)
        if not all(_ranges_apart(a, b, loop.var, loop.start, stop, positive)
                   for a, b in combinations(offsets, 2)):
            return False
    return True


@lru_cache(maxsize=4096)
def _ranges_apart(a, b, var, start, stop, positive=frozenset()) -> bool:
    """Whether two stores' ranges over the loop var in [start, stop) cannot meet: both step
    by one element per iteration, a whole nonzero number of loop extents apart (the rows of
    unrolled copies), or a distance at least the longest the loop runs (the rows of a
    block's scratch: 64 apart, over at most the 64 keys of a block; 64 times the sizes in
    `positive`, each at least 1, when the scratch has a row per query head of a group;
    min(n, 64) apart over at most min(n, 64) keys; group min(64, n) apart over as many). Remembered: sympy's simplify is most of
    the time the generator takes, and a kernel's dtypes and languages, and the block's
    stages, ask the same questions."""
    if sympy.diff(a, var) != 1 or sympy.diff(b, var) != 1:
        return False
    gap, bounds = simplified(a - b), _longest(start, stop, positive)
    if bounds:
        at_least_one = {s: sympy.Symbol(s.name, integer=True, positive=True)
                        for s in positive & (gap.free_symbols | bounds[-1].free_symbols)}
        # |bound|: a loop whose bound is below 0 runs no iteration (decode's n, a count)
        if any((abs(gap.subs(at_least_one)) - abs(bound.subs(at_least_one))).is_nonnegative
               or _whole_multiple(gap.subs(at_least_one), bound.subs(at_least_one))
               for bound in bounds):
            return True
        if gap.is_number:
            return False
    apart = simplified(gap / (stop - start))
    return bool(apart.is_integer) and apart != 0


def _whole_multiple(gap, bound) -> bool:
    """Whether gap is a nonzero whole multiple of bound, or of the least of some of its
    arguments where it is a Min (a loop that runs past none of them), so at least as long:
    the rows of a group's query heads in a block's scratch, group min(64, n) apart over
    min(n, 64) keys (min(64, n, 64 i_blk + 64) on a causal block), which sympy does not
    order. A bound below 0 is a loop that runs no iteration."""
    args = bound.args if isinstance(bound, sympy.Min) else (bound,)
    for count in range(len(args), 0, -1):
        for some in combinations(args, count):
            ratio = simplified(gap / sympy.Min(*some))
            if ratio.is_integer and ratio.is_nonzero:
                return True
    return False


@lru_cache(maxsize=1024)
def _longest(start, stop, positive=frozenset()):
    """Numbers of iterations a loop from start to stop never exceeds (its stop may be
    Min(n, start + 64), its start Max(64 i_blk, k0): a causal block's rows past its keys):
    the least of its spans that are numbers, then the least of all its spans with their
    loop variables' negative terms dropped (a loop variable, an index, is never negative:
    n - 64 j_blk is at most n); empty where no span is a number. Remembered apart from
    _ranges_apart: a loop's every pair of stores asks it."""
    stops = stop.args if isinstance(stop, sympy.Min) else (stop,)
    spans = [simplified(end - low) for end in stops for low in _lower_bounds(start)]
    numbers = [span for span in spans if span.is_number]
    if not numbers:
        return ()
    dropped = [sympy.Add(*(t for t in sympy.Add.make_args(span)
                           if not (t.as_coeff_Mul()[0] < 0 and t.free_symbols - positive)))
               for span in spans]
    return (min(numbers), sympy.Min(*dropped))


def _lower_bounds(start):
    """start, and where it is a Max (times a positive number), each of the Max's arguments
    (times that number): values start is never below."""
    factor, rest = start.as_coeff_Mul()
    if isinstance(rest, sympy.Max) and factor > 0:
        return (start,) + tuple(factor * arg for arg in rest.args)
    return (start,)
