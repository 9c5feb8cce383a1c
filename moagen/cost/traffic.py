"""M: elements moved between main memory and the cache, read off the ONF's array accesses.

The cache assumption, printed with every result:
  * within a nest, data the nest uses again is still in cache when it does (a K row block,
    a score row, a KV head shared by a query group): the largest such working set is
    reported, and the assumption holds where the cache holds it;
  * between nests, nothing is (each nest is one pass over main memory: the arrays are
    larger than the cache).
So a nest moves each element it touches once: it reads it from memory unless its first
access to the array writes it, and writes it back if it writes it. The minimum (the
series' M) is the same count over the whole call, as with an infinite cache: every array
element read once if it must be, written once if it is.

An access's region is the set of offsets it touches: its offset is injective in the loop
variables it uses (gamma is), so the region has as many elements as those loops have
iterations, counted by moagen.onf.count. Loops the offset does not use but whose bounds
move the used loops' bounds (a causal row j <= i, a tile, a slice of keys) are replaced by
their extremes: bounds grow with the outer loops. Accesses with the same region (up to
renaming loop variables) count once; different regions of one array are taken disjoint,
except the lanes of a register tile, which together are the region they cover.
"""
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Iterable, Tuple

import sympy

from moagen.moa import scalar as S
from moagen.moa.expr import idiv
from moagen.onf.count import executions
from moagen.onf.loops import Loop, Store, stmt_exprs

Bounds = Tuple[Tuple[sympy.Symbol, sympy.Expr, sympy.Expr], ...]  # (var, start, stop), outer first


@dataclass(frozen=True)
class Access:
    array: str
    offset: sympy.Expr
    loops: Bounds  # the loops around it inside the block it was collected from
    reads: bool
    writes: bool

    @property
    def plain_write(self):
        return self.writes and not self.reads


@dataclass(frozen=True)
class Moved:
    """Elements of one array read from and written to main memory."""
    read: sympy.Expr = sympy.Integer(0)
    written: sympy.Expr = sympy.Integer(0)

    def __add__(self, other):
        return Moved(self.read + other.read, self.written + other.written)


def accesses(stmts, loops: Bounds = ()) -> Iterable[Access]:
    """Every array access under stmts in program order (a store's loads before the store)."""
    for s in stmts:
        if isinstance(s, Loop):
            yield from accesses(s.body, loops + ((s.var, s.start, s.stop),))
            continue
        for value in stmt_exprs(s):
            for load in _loads(value):
                yield Access(load.array, load.offset, loops, True, False)
        if isinstance(s, Store):
            yield Access(s.array, s.index[0], loops, s.accumulate is not None, True)


def moved(stream) -> Dict[str, Moved]:
    """What one pass over main memory moves, per array, for a program-ordered list of
    accesses: reads unless the array's first access writes it, writes where it writes."""
    by_array: Dict[str, list] = {}
    for a in stream:
        by_array.setdefault(a.array, []).append(a)
    out = {}
    for array, accs in by_array.items():
        read = 0 if accs[0].plain_write else footprint(a for a in accs if a.reads)
        out[array] = Moved(sympy.sympify(read), footprint(a for a in accs if a.writes))
    return out


def nest_traffic(nests) -> Dict[str, Moved]:
    """Each nest a pass of its own, summed."""
    total: Dict[str, Moved] = {}
    for nest in nests:
        for array, m in moved(accesses(nest.body)).items():
            total[array] = total.get(array, Moved()) + m
    return {k: Moved(sympy.factor(m.read), sympy.factor(m.written)) for k, m in total.items()}


def minimum_traffic(nests) -> Dict[str, Moved]:
    """The whole call as one pass: every element moved at most once each way."""
    return moved(a for nest in nests for a in accesses(nest.body))


def footprint(accs) -> sympy.Expr:
    """Distinct elements the accesses touch (all of one array). The lanes of a register
    tile, T accesses at T*t + u for u = 0 .. T-1, together touch what one access over the
    untiled range would: when all T are there, they count as that one region."""
    items = {region(a.offset, a.loops)[0]: _merge_lane_loops(a.offset, a.loops) for a in accs}
    merging = True
    while merging:  # a tile has lanes in rows and in columns: merge one, then the other
        groups = {}
        for key, (offset, loops) in items.items():
            lane = _tile_lane(offset, loops)
            if lane:
                merged_offset, merged_loops, u, tiles = lane
                group = groups.setdefault(region(merged_offset, merged_loops)[0],
                                          [merged_offset, merged_loops, tiles, set(), []])
                group[3].add(u)
                group[4].append(key)
        merging = False
        for key, (offset, loops, tiles, seen, members) in groups.items():
            if seen == set(range(tiles)):
                for member in members:
                    items.pop(member, None)
                items[key] = (offset, loops)
                merging = True
    regions = dict(region(offset, loops) for offset, loops in items.values())
    kept = [k for i, k in enumerate(regions)
            if not any(_within(k, other) and (j < i or not _within(other, k))
                       for j, other in enumerate(regions) if other != k)]
    return sympy.factor(sum((regions[k] for k in kept), sympy.Integer(0)))


def _within(small, big) -> bool:
    """Whether region `small` is part of region `big` (keys of region()): the same offset
    over the same loops, each loop's range inside big's for every size (the key blocks
    before a causal tile's diagonal, and all it sees). Rectangular ranges only."""
    (offset, chain), (big_offset, big_chain) = small, big
    if offset != big_offset:
        return False
    ranges = {v: (start, stop) for v, start, stop in big_chain}
    if ranges.keys() != {v for v, _, _ in chain} or any(
            (start.free_symbols | stop.free_symbols) & ranges.keys()
            for _, start, stop in chain | big_chain):
        return False
    return all(at_least(start, ranges[v][0]) and at_least(ranges[v][1], stop)
               for v, start, stop in chain)


def at_least(big, small) -> bool:
    """Whether big >= small for every size >= 1: shown by the difference having no negative
    coefficient once each size s is written 1 + s (False where that does not show it)."""
    shift = {s: s + 1 for s in (big - small).free_symbols}
    try:
        difference = sympy.expand((big - small).xreplace(shift))
        coefficients = sympy.Poly(difference, *shift).coeffs() if shift else [difference]
    except (sympy.PolynomialError, ValueError):
        # idiv, Min: not a polynomial in the sizes; a sum left unevaluated, whose bound
        # variable a shift cannot move
        return False
    return all(c >= 0 for c in coefficients)


def working_set(nests) -> Tuple[sympy.Expr, ...]:
    """Elements the cache must hold for the in-nest reuse to hit: for each loop that reuses
    data (an access that does not move with its variable, or two of its statements touching
    the same region), what one of its iterations touches; for a nest whose top-level
    statements share data, the whole nest. The candidates, for a Max."""
    sets = []
    for nest in nests:
        if _siblings_share(nest.body):
            sets.append(_touched(list(accesses(nest.body))))
        # an iteration whose loops' bounds move with the loops around (a causal row tile's
        # key blocks): the largest, the last
        sets += [_extreme(_touched(list(accesses(loop.body))), "hi",
                          outer + ((loop.var, loop.start, loop.stop),), ())
                 for loop, outer in _reusing_loops(nest.body)]
    return tuple(dict.fromkeys(sympy.factor(s) for s in sets))


def _touched(stream) -> sympy.Expr:
    """Distinct elements the accesses touch, all arrays together."""
    arrays = dict.fromkeys(a.array for a in stream)
    return sympy.factor(sum((footprint(a for a in stream if a.array == x) for x in arrays),
                            sympy.Integer(0)))


def _reusing_loops(stmts, outer: Bounds = ()):
    """Every loop under stmts that carries reuse: an access inside that does not move with
    the loop (but moves with every loop between), or two of its body's statements touching
    the same region; with the loops around it."""
    for s in stmts:
        if not isinstance(s, Loop):
            continue
        this = ((s.var, s.start, s.stop),)
        across = any(not _moves_with(s.var, a.offset, this + a.loops)
                     and all(_moves_with(v, a.offset, a.loops) for v, _, _ in a.loops)
                     for a in accesses(s.body))
        if across or _siblings_share(s.body):
            yield s, outer
        yield from _reusing_loops(s.body, outer + this)


def _moves_with(var, offset, loops: Bounds):
    """Whether an access touches other elements at each iteration of loop `var`: its offset
    uses var (not only through idiv), or a loop it uses starts where var says (a tile, a
    slice of keys). A loop whose stop alone moves (a causal prefix) keeps what it had."""
    offset, loops = _group_divisions(offset, loops)
    used = offset.free_symbols
    return var in used or any(var in start.free_symbols for v, start, _ in loops if v in used)


def _siblings_share(stmts):
    """Two statements of one block touching the same region of an array."""
    touched = [list(accesses((s,))) for s in stmts]
    statements = {}  # array -> the statements touching it: only arrays in two need regions
    for k, accs in enumerate(touched):
        for a in accs:
            statements.setdefault(a.array, set()).add(k)
    shared = {array for array, ks in statements.items() if len(ks) > 1}
    seen = {}
    for k, accs in enumerate(touched):
        for a in accs:
            if a.array in shared and \
                    seen.setdefault((a.array, region(a.offset, a.loops)[0]), k) != k:
                return True
    return False


@lru_cache(maxsize=None)
def region(offset, loops: Bounds):
    """(a key equal for equal regions, the number of elements) of one access (cached: the
    same access is asked about by the traffic, the minimum and the working set)."""
    offset, loops = _relative_to_start(offset, loops)
    offset, loops = _group_divisions(offset, loops)
    offset, loops = _merge_lane_loops(offset, loops)
    used = offset.free_symbols & {v for v, _, _ in loops}
    chain = tuple((v, _extreme(start, "lo", loops, used), _extreme(stop, "hi", loops, used))
                  for v, start, stop in loops if v in used)
    return _canonical(offset, chain), _count(chain)


def _relative_to_start(offset, loops: Bounds):
    """A loop v over [s, e) whose start moves with other loops, accessed at v - s (a block of
    keys' own scratch row) -> v over [0, e - s): the access does not move with those loops."""
    for v, start, stop in loops:
        if v not in offset.free_symbols or not start.free_symbols:
            continue
        shifted = sympy.expand(offset.xreplace({v: v + start}))
        if not shifted.free_symbols & start.free_symbols:
            loops = tuple((w, s, e) if w != v else (v, sympy.Integer(0), stop - start)
                          for w, s, e in loops)
            offset = shifted
    return offset, loops


def _group_divisions(offset, loops: Bounds):
    """idiv(v, G) of a loop variable v over [a, b) -> a new variable over [a/G, b/G)."""
    for v, start, stop in loops:
        divisions = [t for t in offset.atoms(idiv) if t.args[0] == v]
        if len(divisions) != 1:
            continue
        group = sympy.Dummy(f"{v}_group", integer=True)
        replaced = offset.xreplace({divisions[0]: group})
        if v in replaced.free_symbols:
            continue  # v is also used whole: the access moves with v
        g = divisions[0].args[1]
        loops = tuple((w, s, e) if w != v else (group, start / g, stop / g) for w, s, e in loops)
        offset = replaced
    return offset, loops


@lru_cache(maxsize=None)
def _merge_lane_loops(offset, loops: Bounds):
    """A tile loop t over [0, S) and a lane loop l over [0, T) used as T*t + l (a panel's
    copy, a causal row tile's periods) -> one loop over [0, T*S): the same region as an
    untiled loop's."""
    lanes = [(w, w_stop) for w, w_start, w_stop in loops
             if w_start == 0 and w_stop.is_Integer and w_stop >= 2 and w in offset.free_symbols]
    if not lanes:
        return offset, loops
    strides = {w: _stride(offset, w) for w, _ in lanes}
    for v, start, stop in loops:
        if start != 0 or v not in offset.free_symbols:
            continue
        step = _stride(offset, v)
        for w, w_stop in lanes:
            if w != v and sympy.expand(strides[w] * w_stop - step) == 0:
                merged = sympy.Symbol(f"{v}_{w}", integer=True)
                lane = step / w_stop
                offset = sympy.expand(offset - step * v - lane * w + lane * merged)
                loops = tuple((merged, sympy.Integer(0), stop * w_stop) if u == v else (u, s, e)
                              for u, s, e in loops if u != w)
                return _merge_lane_loops(offset, loops)
    return offset, loops


def _tile_lane(offset, loops: Bounds):
    """An access at lane u of a tile loop t over [0, S/T), stride s (offset = s*(T*t + u) +
    rest): (the offset with T*t + u made one variable over [0, S), its loops, u, T), or
    None. Only footprint's grouping decides whether all T lanes are there."""
    used = offset.free_symbols & {v for v, _, _ in loops}
    for v, start, stop in loops:
        # a row block's tiles [16*blk, 16*blk + 16) span [0, S/T) over all blocks
        start, stop = _extreme(start, "lo", loops, used), _extreme(stop, "hi", loops, used)
        tiles, count = sympy.fraction(sympy.together(stop))
        if start != 0 or not count.is_Integer or count < 2:
            continue
        merged = sympy.Symbol(f"{v}_lanes", integer=True)
        merged_loops = tuple((w, s, e) if w != v else (merged, sympy.Integer(0), tiles)
                             for w, s, e in loops)
        divided = _lane_in_division(offset, v, count)
        if divided:  # the query heads of an unrolled group: idiv(4*h_tile + u, group)
            quotient, lane = divided
            return (offset.xreplace({quotient: idiv(merged, quotient.args[1])}), merged_loops,
                    lane, int(count))
        step = _stride(offset, v)
        if step == 0 or step.free_symbols & {w for w, _, _ in loops}:
            continue
        stride = step / count
        rest = sympy.expand(offset - step * v)
        if any(_stride(rest, w) == stride for w, _, _ in loops if w != v):
            continue  # the lanes are a loop (a panel's copy), counted as loops are
        lane = sum((t for t in sympy.Add.make_args(rest) if (t / stride).is_Integer),
                   sympy.Integer(0))
        if not (lane / stride).is_Integer or not 0 <= lane / stride < count:
            continue
        return rest - lane + stride * merged, merged_loops, int(lane / stride), int(count)
    return None


def _lane_in_division(offset, v, count):
    """(idiv(count*v + u, G), u) when v enters the offset only there, with 0 <= u < count;
    or None."""
    for quotient in offset.atoms(idiv):
        numerator = sympy.expand(quotient.args[0])
        lane = numerator - count * v
        if (numerator.coeff(v) == count and lane.is_Integer and 0 <= lane < count
                and v not in offset.xreplace({quotient: sympy.Integer(0)}).free_symbols):
            return quotient, int(lane)
    return None


def _extreme(bound, side, loops: Bounds, used):
    """bound with the unused loops' variables at their extremes: the smallest start ("lo")
    or the largest stop ("hi") over them."""
    ranges = {v: (start, stop) for v, start, stop in loops if v not in used}
    while ranges.keys() & bound.free_symbols:
        bound = bound.xreplace({v: start if side == "lo" else stop - 1
                                for v, (start, stop) in ranges.items()})
    return bound


def _canonical(offset, chain: Bounds):
    """The region with its loop variables renamed in order of their stride in the offset,
    so that the same region reached by differently named or ordered loops has one key."""
    order = sorted(chain, key=lambda b: (str(_stride(offset, b[0])), str(b[1]), str(b[2])))
    names = {v: sympy.Symbol(f"_r{k}", integer=True) for k, (v, _, _) in enumerate(order)}
    return (sympy.expand(offset.xreplace(names)),
            frozenset((names[v], s.xreplace(names), e.xreplace(names)) for v, s, e in chain))


@lru_cache(maxsize=None)
def _stride(offset, var) -> sympy.Expr:
    """d offset / d var, expanded (cached: every region asks it of its loops)."""
    return sympy.expand(sympy.diff(offset, var))


@lru_cache(maxsize=None)
def _count(chain: Bounds) -> sympy.Expr:
    """Iterations of the loops in chain, nested in order (the ONF's own counter)."""
    body = (Store("@", (), S.Num(0.0)),)
    for var, start, stop in reversed(chain):
        body = (Loop(var, start, stop, body),)
    return executions(body, lambda s: isinstance(s, Store)).get("@", sympy.Integer(1))


def _loads(e):
    if isinstance(e, S.Load):
        yield e
    for child in S.children(e):
        yield from _loads(child)
