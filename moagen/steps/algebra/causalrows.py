"""Causal attention's backward by rows: the query rows before a tile of keys see none of them
(and with padded keys no row sees a tile past the last valid key).

In the key rows' pass of a causal backward (attention_fwdbwd's owner: dK, dV and dQ's part
for a tile of key rows j, walking the query rows i by blocks) the score of row i and key j is
`i >= j ? s : -inf`: its probability exp(-inf - lse) is 0, and so is dS = p (dP - delta), and
each term the row adds into dK, dV and dQ's part is a product with one of them. The rows
before the tile's first key k0 see none of its keys: they add zeros (x + 0 = x, bit for bit).
So, inside the tile's loop, every loop over the rows of a block starts past them:

    for i in [s, e): ..        ->   for i in [max(s, L), e): ..          L = A (k0 // A)
    for i_tile in [s, e): ..   ->   for i_tile in [max(s, L / r), e): .. (r rows an iteration)

with L rounded down to A rows, so that the tiles later steps make of the rows (KeyTiles'
lanes; UnrollSum's rows, made before) still line up. A causal backward then walks about half
of the scores; blocks wholly before the tile run no iteration.

A shifted mask `i + t >= key` (attention_cross's i + offset >= j, t free of i) lets rows from
key - t on see the key: k0 is then the least max(0, key - t).

A mask free of the rows, `last >= key` (attention_cross's padded keys: every row sees keys 0
to last, a size given at call time), lets every row see a key or none: a tile whose first
key k0 is past last is seen by no row, and each of its rows loops is left empty,

    for i in [s, e): ..   ->   for i in [max(s, A ceil(e / A) u), e): ..
                                                      u = min(1, max(0, k0 - last))

(u is 1 past last, else 0; A ceil(e / A) a multiple of A, as above). The tile still sets
and stores its dK and dV rows: zeros, as they start.

Checked: every score the tile's loop masks is masked with -inf, all as `i + t >= key` (i the
rows' loop variable, t (0 unless shifted) and the key free of it) or all as `r >= key` with
one r free of the loop variables (a size), and A is a whole number of each rows loop's rows.
That every term a row adds is a product with its masked probability is the form of
attention's gradients (attention_bwd.gradients), not checked here: the interpreter and the
references check the results.
"""
from dataclasses import dataclass, replace

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import divides, idiv, sym
from moagen.onf.loops import Loop, loop_vars, rewrite_loops, stmt_exprs, walk
from moagen.onf.names import loop_role
from moagen.steps.algebra.causal import MASKED, at_least_zero, least_row, mask_sides
from moagen.steps.step import NotApplicable, Step


@dataclass(frozen=True)
class CausalRows(Step):
    nest: str
    tile: str  # the loop over tiles of key rows
    rows: str = "i"  # the query rows: loops over them, or over tiles of them (rows_tile)
    align: int = 1  # A: the rows' first kept row is a multiple of it

    def rewrite_nest(self, nest, names):
        body, count = rewrite_loops(
            nest.body, lambda loop: loop.var.name == self.tile and bool(self._masks(loop)),
            lambda loop, scope: [replace(loop, body=self._cut(loop, scope))])
        if not count:
            raise NotApplicable(f"{self}: nest {self.nest} has no loop over {self.tile} whose "
                                "scores are masked")
        return body

    def _masks(self, tile: Loop):
        """The conditions of the tile's masked scores, `cond ? s : -inf`."""
        return [e.cond for s in walk(tile.body)
                for e in (x for ex in stmt_exprs(s) for x in S.subexpressions(ex))
                if isinstance(e, S.Select) and e.other == MASKED]

    def _keys(self, tile: Loop):
        """The least rows that see the keys of the tile's masked scores, `row >= key ? s :
        -inf` (the keys themselves unless the rows are shifted; then maybe negative)."""
        return [self._key(cond) for cond in self._masks(tile)]

    def _unseen(self, tile: Loop, loops):
        """u: 1 where no row sees any key of the tile, 0 where every row sees one, for masks
        `r >= key` all with r free of the loops (`loops`: their variables) around and in the
        tile (a padded key's); None where they are masks of the rows."""
        sides = [mask_sides(cond) for cond in self._masks(tile)]
        free = [pair is not None and not {x.name for x in pair[0].free_symbols} & loops
                for pair in sides]
        if not any(free):
            return None
        if not all(free) or len({pair[0] for pair in sides}) > 1:
            raise ScheduleError(f"{self}: the tile's scores are masked by rows free of the "
                                "loops and by others, or by two such rows: not built")
        row = sides[0][0]
        return sympy.Min(1, sympy.Max(0, sympy.Min(*(key for _, key in sides)) - row))

    def _key(self, cond):
        """The least row the mask lets see the key: the key, less a shift of the rows' (as
        attention_cross's i + offset >= j)."""
        bound = least_row(cond, sym(self.rows))
        if bound is None:
            raise ScheduleError(f"{self}: a score is masked by {cond}, not as {self.rows} (plus "
                                "a shift free of it) >= a key: the rows before the keys cannot "
                                "be told apart")
        return bound

    def _first_kept(self, tile: Loop):
        """L / A: the first row that sees a key of the tile, in steps of A."""
        first = at_least_zero(sympy.Min(*self._keys(tile)))
        return idiv(first, self.align) if self.align > 1 else first

    def _cut(self, tile: Loop, loops):
        unseen = self._unseen(tile, loops | {tile.var.name} | loop_vars(tile.body))
        first_kept = self._first_kept(tile) if unseen is None else None
        tiled = loop_role(self.rows, "tile")
        one_row = [s for s in walk(tile.body) if isinstance(s, Loop) and s.var.name == self.rows]

        def rows_per_iteration(loop):
            if loop.var.name == self.rows:
                return sympy.Integer(1)
            # a tile's loop starts where the rows' loop of its block does, over r rows a step
            for other in one_row:
                for block in loop.start.free_symbols & other.start.free_symbols:
                    return sympy.diff(other.start, block) / sympy.diff(loop.start, block)
            raise ScheduleError(f"{self}: no loop over {self.rows} beside {loop.var} tells how "
                                "many rows it takes a step")

        def kept(loop, a):
            """The first step kept, in steps of a: L / A, or past the loop's end (ceil(e /
            a), a multiple of a) where no row sees the tile's keys."""
            return first_kept if unseen is None else idiv(loop.stop + a - 1, a) * unseen

        def start(loop):
            r = rows_per_iteration(loop)
            if not (r.is_Integer and self.align % r == 0):
                raise ScheduleError(f"{self}: {self.align} rows are not whole steps of the "
                                    f"loop over {loop.var} ({r} rows a step)")
            a = self.align // int(r)
            if divides(a, loop.start):  # a multiple of a, as later tiles of a rows need
                return a * sympy.Max(sympy.expand(loop.start / a), kept(loop, a))
            return sympy.Max(loop.start, a * kept(loop, a))

        def cut(stmts):
            for s in stmts:
                if isinstance(s, Loop) and s.var.name in (self.rows, tiled):
                    yield replace(s, start=start(s), body=tuple(cut(s.body)))
                elif isinstance(s, Loop):
                    yield replace(s, body=tuple(cut(s.body)))
                else:
                    yield s

        return tuple(cut(tile.body))
