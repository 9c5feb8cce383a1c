"""The counting view of an ONF: the same loops with bounds sympy can sum in closed form.

A tiled loop counts its tiles with idiv(n + T - 1, T) and ends at Min(n, tile end): exact,
but sympy leaves sums over such bounds unevaluated. The view assumes that every size is a
multiple of the tiles that cut it (and that kv_heads divides q_heads, which the kernel's
validate enforces): then idiv(n + T - 1, T) = n / T, every tile is full, a register tile's
clamped row min(T*t + u, n - 1) is T*t + u, the loop over the columns left after the last
full tile is empty (and dropped), and each rewrite below is exact. The assumptions a kernel
needed are returned, to be printed with its cost.

A loop whose inner bounds divide its variable (the key blocks a causal row tile sees,
idiv(8*i_tile + 7, 64)) is cut into periods: i_tile = 8*t + r, r in [0, 8), where
8*i_tile + 7 = 64*t + 8*r + 7 and the quotient is t + idiv(8*r + 7, 64): linear in t, a
number at each r, whose few values the count adds one by one (assuming the period divides
the loop's count: 64 divides n). Without the cut sympy leaves the sums over such bounds
unevaluated, after minutes of trying.

A loop started past the rows that see no key of a causal tile (CausalRows: max(s, k0 // A)
rows, k0 the tile's first key) is counted from s, as if not cut: sympy does not sum over
such a maximum in reasonable time either. The count of a causal backward's key rows' pass is
then an over-count (up to twice the rows it walks), recorded with the assumptions.
"""
from dataclasses import dataclass, replace
from functools import lru_cache
from math import gcd, lcm
from typing import Dict, Tuple

import sympy

from moagen.moa import scalar as S
from moagen.moa.expr import divides, idiv, simplified
from moagen.onf.loops import Loop, Nest, ONF, Store, map_stmt_exprs, subs_stmts, walk


@dataclass(frozen=True)
class View:
    nests: Tuple[Nest, ...]
    assumptions: Tuple[str, ...]  # e.g. "64 divides n"
    elements: Dict[str, sympy.Expr]  # each array's size as the view counts it


def counting_view(onf: ONF) -> View:
    sizes = frozenset(onf.sizes)
    assumed = []

    def divide(e):
        """idiv over sizes only, as exact division (recording what that assumes)."""
        def exact(a, b):
            if b.is_Integer and divides(int(b), a):
                return a / b  # whole for every value: (64*j_blk + 64) / 4
            if not (a.free_symbols | b.free_symbols) <= sizes:
                return idiv(a, b)  # an index's division (a query head's KV head) stays
            # a tile count, idiv(x + T - 1, T), T a count or of the sizes (128 w)
            if set(sympy.Add.make_args(sympy.expand(b - 1))) <= set(sympy.Add.make_args(a)):
                a = a - b + 1
            assumed.append(f"{b} divides {a}")
            return a / b
        return sympy.sympify(e).replace(idiv, exact)

    def equal_parts(e, parts):
        """The length of part v of P interleaved parts of n rows, idiv(n - v + P - 1, P)
        for v in [0, P) (PartBuffers), as n / P: each part's when P divides n. One part:
        v is 0."""
        for v, count in parts.items():
            if count == 1:
                e = e.xreplace({v: 0})
                continue
            whole = lambda x: x.args[1] == count and \
                (x.args[0] + v - count + 1).free_symbols <= sizes
            e = e.replace(lambda x: isinstance(x, idiv) and whole(x),
                          lambda x: divide(idiv(x.args[0] + v - count + 1, count)))
        return e

    def bound(e, maxima, parts):
        """A loop bound with its tiles full, inside divisions too: the count of a block's
        keys taken f at a time, idiv(Min(n, 64 b + 64) - 64 b, f), is 64 / f."""
        e = divide(_full_tiles(divide(equal_parts(sympy.sympify(e), parts)), maxima))
        uncut = _uncut_causal_rows(e, sizes)
        if uncut != e:
            assumed.append(CAUSAL_ROWS_UNCUT)
        return uncut

    def full_rows(e):
        """Min(B, x) of sizes, a scratch row of a block of B keys (min(n, B) of them), as B:
        the view assumes B divides x, so B <= x (recorded where nothing had assumed it)."""
        def row(m):
            block = [a for a in m.args if a.is_Integer]
            if len(m.args) != 2 or not block or not m.free_symbols <= sizes:
                return m
            (b,), (x,) = block, [a for a in m.args if not a.is_Integer]
            if f"{b} divides {x}" not in assumed:
                assumed.append(f"{x} >= {b}")
            return b
        return sympy.sympify(e).replace(lambda x: isinstance(x, sympy.Min), row)

    def stmt(s, maxima, parts):
        if isinstance(s, Loop):
            start, stop = bound(s.start, maxima, parts), bound(s.stop, maxima, parts)
            stop = _whole_part(start, stop, sizes, assumed)
            if simplified(stop - start) == 0:
                return None  # the columns after the last full tile: none
            periods = _periods(replace(s, start=start, stop=stop), sizes)
            if periods:
                loop, assumption = periods
                if assumption:
                    assumed.append(assumption)
                return stmt(loop, maxima, parts)
            inner = {**maxima, s.var: stop - 1}
            if start == 0 and stop.is_Integer:  # a fixed number of parts, or of lanes
                parts = {**parts, s.var: int(stop)}
            return replace(s, start=start, stop=stop, body=block(s.body, inner, parts))
        index = lambda e: full_rows(_full_tiles(divide(e), maxima))
        s = map_stmt_exprs(s, lambda e: _map_offsets(e, index))
        return replace(s, index=tuple(map(index, s.index))) if isinstance(s, Store) else s

    def block(stmts, maxima, parts):
        return tuple(x for x in (stmt(s, maxima, parts) for s in stmts) if x is not None)

    nests = tuple(replace(n, body=block(n.body, {}, {})) for n in onf.nests)
    elements = {b.name: full_rows(sympy.Mul(*b.shape))
                for b in onf.inputs + onf.outputs + onf.temps}
    return View(tuple(n for n in nests if n.body), tuple(dict.fromkeys(assumed)), elements)


CAUSAL_ROWS_UNCUT = "the causal rows' cut not counted (an over-count of the key rows' pass)"
WHOLE_PARTS = "each part of a split sum whole (its parts divide its chunks)"


def _whole_part(start, stop, sizes, assumed):
    """The end of a part of a split sum (SplitK: from a q-th part's first chunk R q,
    Min(R q + R, N), R and N of the sizes, q a quotient of a grid axis) as R q + R, a
    part's R chunks whole, and so the end of a chunk inside it, Min(N', T c + T), T a
    number, which _full_tile leaves (c's last value is a quotient's): sympy sums no
    minimum over such a quotient. A stop whose other terms are not sizes alone (a causal
    row's) unchanged, and so a stop of a loop from sizes alone."""
    if not isinstance(stop, sympy.Min) or start.free_symbols <= sizes:
        return stop
    for arg in stop.args:
        length = simplified(arg - start)
        others = [a for a in stop.args if a != arg]
        if length != 0 and length.free_symbols <= sizes and \
                all(a.free_symbols <= sizes for a in others):
            if length.free_symbols:
                assumed.append(WHOLE_PARTS)
            return arg
    return stop


def _uncut_causal_rows(e, sizes):
    """e with each max(s, k0 // A) of CausalRows replaced by s: the argument that divides
    a loop variable (the tile's first key) dropped."""
    def by_loop(arg):
        return any(isinstance(x, idiv) and not x.free_symbols <= sizes
                   for x in sympy.preorder_traversal(arg))

    def uncut(m):
        kept = [a for a in m.args if not by_loop(a)]
        return sympy.Max(*kept) if kept and len(kept) < len(m.args) else m
    return e.replace(lambda x: isinstance(x, sympy.Max), uncut)


def _full_tiles(e, maxima):
    """_full_tile on every min in an index expression (a register tile's clamped rows)."""
    return e.replace(lambda x: isinstance(x, sympy.Min), lambda x: _full_tile(x, maxima))


def _full_tile(stop, maxima):
    """Min(n, tile end) -> the tile end, where the tile end is at most n even at the last
    iteration of the enclosing loops (bounds grow with them)."""
    if not isinstance(stop, sympy.Min):
        return stop
    for arg in stop.args:
        last = arg
        while last.free_symbols & maxima.keys():  # a block's tile ends where its block does
            last = last.xreplace(maxima)
        if all(_nonnegative(other - last) for other in stop.args if other != arg):
            return arg
    return stop


@lru_cache(maxsize=None)
def _nonnegative(e) -> bool:
    """Whether e >= 0 for all sizes; cached: a register tile asks once per lane."""
    return bool(sympy.simplify(e).is_nonnegative)


def _map_offsets(e, fn):
    """e with fn applied to every index expression (load offsets, sizes used as numbers,
    select conditions)."""
    if isinstance(e, S.Load):
        return S.Load(e.array, fn(e.offset))
    if isinstance(e, S.Dim):
        return S.Dim(fn(e.value))
    if isinstance(e, S.Select):
        return S.Select(fn(e.cond), _map_offsets(e.then, fn), _map_offsets(e.other, fn))
    return S.map_children(e, lambda c: _map_offsets(c, fn))


def _periods(loop: Loop, sizes):
    """(the loop cut into periods, what that assumes) where the loop runs over a number of
    iterations given by the sizes and the bounds of the loops inside divide its variable v,
    all as idiv(a*v + b, q) with a, b, q whole numbers; else None.
    With g the period (a*g a multiple of every q) and v = g*t + r, idiv(a*v + b, q) is
    (a*g/q)*t + idiv(a*r + b, q): linear in t, and a number at each r of [0, g)."""
    v = loop.var
    divisions = {d for s in walk(loop.body) if isinstance(s, Loop)
                 for d in (s.start.atoms(idiv) | s.stop.atoms(idiv)) if v in d.free_symbols}
    if not divisions or loop.start != 0:
        return None
    forms = {}
    for d in divisions:
        numerator, q = sympy.expand(d.args[0]), d.args[1]
        a, b = numerator.coeff(v), numerator.subs(v, 0)
        if not (a.is_Integer and b.is_Integer and q.is_Integer and a > 0 and q > 0):
            return None
        forms[d] = (a, b, q)
    g = lcm(*(int(q) // gcd(int(a), int(q)) for a, _, q in forms.values()))
    tiles, count = sympy.fraction(sympy.together(loop.stop))
    if not (count.is_Integer and tiles.free_symbols and tiles.free_symbols <= sizes):
        return None  # a fixed number of iterations is counted one by one (the phases)
    assumption = f"{g * count} divides {tiles}" if g > 1 else None
    t, r = sympy.Dummy(f"{v}_period", integer=True), sympy.Dummy(f"{v}_phase", integer=True)
    at = {d: a * g / q * t + idiv(a * r + b, q) for d, (a, b, q) in forms.items()}
    body = subs_stmts(loop.body, {**at, v: g * t + r})
    phases = Loop(r, sympy.Integer(0), sympy.Integer(g), body)
    return replace(loop, var=t, stop=loop.stop / g, body=(phases,)), assumption
