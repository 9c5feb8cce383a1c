"""BlockPartials: a thread block's atomic additions into an output summed over the block's
own rows first, then one atomic addition per element of the tile it adds into: the form of
FlashAttention-2's dQ (a key tile's share of dS K)."""
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import idiv
from moagen.onf.loops import (Let, Loop, Store, Update, ancestors, arrays_read, is_thread_loop,
                              max_extent, walk)
from moagen.onf.names import claim_loop, loop_role
from moagen.steps.step import NotApplicable, Step, option, shown


@dataclass(frozen=True)
class BlockPartials(Step):
    """The atomic additions into `array` inside the block's thread loop over its own rows
    `rows` (a key tile's rows j, each adding dS[i, j] K[j, c] into dQ[i, c]) summed over
    those rows before they are added. Each such addition lies in a loop L, the first
    around it whose variable its index reads (a query block's rows i), inside sequential
    loops only (the query blocks), and L's body holds it in loops of one statement each
    (its columns c); after L comes a loop over L's range and over those loops' ranges (the
    tile it adds into, i by c), each element a local summed over the block's rows in a
    plain loop over their range, then added once, atomically: the atomic additions divided
    by the rows a block holds, and the products a GEMM's, for ThreadTiles to give to the
    block's threads (a register tile of partial sums each) and UnrollInner to unroll.

    pieces: the tile summed a piece at a time, `pieces[k]` iterations of its k-th loop (L,
    then the thread loops; 0 or none: all of them), loops over the pieces around it (the
    last loop's outermost): a thread's register tile of partial sums as small at every
    bound of d (at d 128 a whole tile's spilled in float64 beside the pass's dK and dV).

    The new loop must lie outside the thread loop over `rows`, so that loop is distributed
    over the loops between it and L, around each statement apart from them: a thread loop
    is no loop on the GPU (each statement inside runs for all of a thread's slots before
    the next), so the block runs the same statements in the same order.

    Refused: an addition whose index reads `rows`; a thread loop between the thread loop
    over `rows` and L, or no L; loops inside L around the addition that hold other
    statements too; L's range or theirs reading `rows`; a value reading an array L's body
    writes or a local other than one L's body defines once (inlined: the value is
    computed after L); more pieces than the tile has loops.

    Run after Stage and SharedScratch, which take a tile's index over one range of a loop
    variable: the pieces' ranges are parts of those of the loops they cut."""
    array: str
    rows: str = shown("over {rows}")
    pieces: Tuple[int, ...] = option("pieces of {shape}", ())
    nest: Optional[str] = None
    layer = "mapping"

    @property
    def shape(self) -> str:
        """The pieces as printed: 32 x 64, 32 x all."""
        return " x ".join(str(size) if size else "all" for size in self.pieces)

    def rewrite_nest(self, nest, names):
        body, count = nest.body, 0
        while True:
            found = self._next_addition(body)
            if found is None:
                break
            body = self._summed_first(body, *found, names)
            count += 1
        if not count:
            raise NotApplicable(f"{self}: nest {nest.label} adds into {self.array} atomically "
                                f"inside no thread loop over {self.rows}")
        return body

    def _next_addition(self, body):
        """(an atomic addition into the array inside a thread loop over the rows, the loops
        around it), or None."""
        for s in walk(body):
            if isinstance(s, Store) and s.array == self.array and s.atomic:
                around = ancestors(body, s)
                if any(is_thread_loop(lp) and lp.var.name == self.rows for lp in around):
                    return s, around
        return None

    def _summed_first(self, body, store, around, names):
        """body with `store` (inside the loops `around`) summed over the rows first."""
        k = next(k for k, lp in enumerate(around)
                 if is_thread_loop(lp) and lp.var.name == self.rows)
        rows, inside = around[k], around[k + 1:]
        if rows.var in _free(store.index):
            raise ScheduleError(f"{self}: {self.array}[{', '.join(map(str, store.index))}] is "
                                f"indexed by the rows {self.rows}: a row's own element")
        indexed = _free(store.index)
        m = next((m for m, lp in enumerate(inside) if lp.var in indexed), None)
        if m is None or any(map(is_thread_loop, inside[:m])):
            raise ScheduleError(f"{self}: the loops between the thread loop over {self.rows} "
                                f"and the first that indexes the addition into {self.array} "
                                "are not all sequential")
        seq_path, tile = inside[:m + 1], inside[m + 1:]
        last = seq_path[-1]
        for outer, inner in zip(tile, tile[1:] + (store,)):
            if outer.body != (inner,):
                raise ScheduleError(f"{self}: the loop over {outer.var} around the addition "
                                    f"into {self.array} holds other statements")
        if any(rows.var in _free((lp.start, lp.stop)) for lp in (last,) + tile):
            raise ScheduleError(f"{self}: the range of a loop around the addition into "
                                f"{self.array} depends on the rows {self.rows}")
        loops = (last,) + tile
        if len(self.pieces) > len(loops):
            raise ScheduleError(f"{self}: pieces of {len(self.pieces)} loops, the tile added "
                                f"into {self.array} has {len(loops)}")
        value = self._inlined(store.value, last.body)
        part = names.claim(names.new(f"{self.array}_part"))
        added = (Let(part, S.Num(0.0)),
                 Loop(rows.var, rows.start, rows.stop, (Update(part, "+", value),)),
                 Store(self.array, store.index, S.Local(part), accumulate="+", atomic=True))
        ranges, pieces = self._pieces(loops, {lp.var.name for lp in around}, names)
        for lp in reversed(loops):
            added = (Loop(lp.var, *ranges[lp.var], added),)
        # the last loop's pieces outermost: over the columns, then the rows (nvcc then kept
        # the float64 dq_atomic at d 128 within its registers; rows outermost, it spilled)
        for piece in pieces:
            added = (replace(piece, body=added),)
        moved = tile[0] if tile else store
        kept = tuple(s for s in last.body if s is not moved)
        # L gone where the addition was all it did (what is left defines what it read)
        emptied = replace(last, body=kept) if any(not isinstance(s, Let) for s in kept) else None
        return _splice(body, rows, _distributed(rows, seq_path, emptied, added[0]))

    def _pieces(self, loops, scope, names):
        """(each of the tile's loops' range, a piece's where `pieces` cuts it; the loops
        over the pieces, in the order of the loops they cut)."""
        ranges, outer = {}, []
        for k, lp in enumerate(loops):
            size = self.pieces[k] if k < len(self.pieces) else 0
            if not size:
                ranges[lp.var] = (lp.start, lp.stop)
                continue
            piece = claim_loop(names, loop_role(lp.var.name, "piece"), scope, self)
            start = lp.start + size * piece
            most = max_extent(lp)
            if most is None:
                count, stop = idiv(lp.stop - lp.start + size - 1, size), \
                    sympy.Min(lp.stop, start + size)
            else:
                count = sympy.Integer(-(-most // size))
                stop = _piece_stop(lp.stop, start + size, piece, count - 1)
            ranges[lp.var] = (start, stop)
            outer.append(Loop(piece, sympy.Integer(0), count, ()))
        return ranges, outer

    def _inlined(self, value, stmts):
        """value with the locals the statements `stmts` define (L's body) as their values;
        refused where it reads another local, one they also update, or an array they
        write."""
        lets = {s.name: s.value for s in stmts if isinstance(s, Let)}
        updated = {s.name for s in walk(stmts) if isinstance(s, Update)}
        written = {s.array for s in walk(stmts) if isinstance(s, Store)}

        def expr(e):
            if isinstance(e, S.Local):
                if e.name not in lets or e.name in updated:
                    raise ScheduleError(f"{self}: the addition into {self.array} reads the "
                                        f"local {e.name}, not one value of the loop's body")
                return expr(lets[e.name])
            return S.map_children(e, expr)

        value = expr(value)
        clash = arrays_read((Let("_", value),)) & written
        if clash:
            raise ScheduleError(f"{self}: the addition into {self.array} reads "
                                f"{', '.join(sorted(clash))}, which the loop it is in writes")
        return value


def _piece_stop(stop, end, piece, last):
    """Min(stop, end) less the terms of a Min `stop` that no piece's `end` passes (`piece`,
    its loop's variable, at most `last`): the pieces of 32 of a query block's rows end at
    Min(n, 64*i_blk + 32*i_piece + 32), not also at 64*i_blk + 64, which the cost model's
    counting view then sums in closed form."""
    terms = stop.args if isinstance(stop, sympy.Min) else (stop,)

    def passed(term):
        gap = sympy.expand(term - end)  # linear in piece, least at the last one
        return gap.free_symbols <= {piece} and gap.diff(piece) <= 0 and \
            gap.subs(piece, last) >= 0

    return sympy.Min(*(t for t in terms if not passed(t)), end)


def _free(exprs):
    return set().union(*(sympy.sympify(e).free_symbols for e in exprs))


def _distributed(thread, path, emptied, added):
    """Thread loop `thread` as statements with it around each statement of its body off
    the loops `path` (outermost first: sequential ones, then L), L `emptied` (the addition
    taken out; None: nothing left) and `added` after it, outside the thread loop. A thread
    loop a statement, so that a block's copy that Stage put just before its first reader
    stays just before it."""
    def level(stmts, depth):
        out = []
        for s in stmts:
            if s is not path[depth]:
                out.append(replace(thread, body=(s,)))
            elif depth < len(path) - 1:
                out.append(replace(s, body=tuple(level(s.body, depth + 1))))
            else:
                out += [replace(thread, body=(emptied,))] if emptied else []
                out.append(added)
        return out

    return level(thread.body, 0)


def _splice(stmts, target, replacement):
    """stmts with statement `target` (by identity) replaced by the statements
    `replacement`."""
    out = []
    for s in stmts:
        if s is target:
            out += replacement
        elif isinstance(s, Loop):
            out.append(replace(s, body=_splice(s.body, target, replacement)))
        else:
            out.append(s)
    return tuple(out)
