"""BlockTiles: loops to the grid; ThreadTiles: loops inside a block to its threads."""
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import sympy

from moagen.cuda_archs import WARP
from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import idiv
from moagen.onf.loops import (BlockCopy, Grid, Let, Loop, Store, Threads, Unrolled, Update,
                              grid_bounds, is_grid, is_thread_loop, max_extent, most_iterations,
                              names_read, perfect_chain, subs_stmts, walk)
from moagen.onf.names import claim_loop, folded_loop, loop_role
from moagen.steps.loop.parallel import Parallel
from moagen.steps.step import NotApplicable, Step, hidden, option, shown

# the accumulations the threads of a row can each take a part of, then combine by warp
# shuffles (the printer's)
WARP_REDUCIBLE = ("+", "max")


@dataclass(frozen=True)
class BlockTiles(Step):
    """A thread block per iteration of the perfectly nested loops `vars` (their legality
    Parallel's), the last cut into tiles of `rows` iterations, a block a tile: the grid is
    (vars[:-1], tiles), the rows of a tile a loop inside, [rows * t, min(stop, rows * t +
    rows)), for ThreadTiles to give the block's threads. `bounds`: sizes the kernel is
    compiled for at several bounds ((d, (64, 128, 256)): d <= 64, <= 128, <= 256), so that a
    loop over them has a compile-time count of iterations a thread (its register tile).
    `cols` (a product's output tile: rows x columns, a GEMM's): the last loop cut into
    tiles of `cols` too, and the one before it into tiles of `rows`, a block a (row tile,
    column tile): the grid is (vars[:-2], row tiles, column tiles), the tile's rows a loop
    inside with its columns inside that.
    A CUDA grid has 3 axes: where there are more loops, those between the first and the
    row tiles fold into one grid loop over the product of their extents (each variable its
    quotient and remainder past its start: g_r over kv_heads * group, g = g_r / group).
    Refused: a nest with a loop mapped already, and bounds for more than one size."""
    vars: Tuple[str, ...]
    rows: int = shown("{rows} rows a block")
    cols: int = option("{cols} columns", 0)
    bounds: Tuple[Tuple[str, Tuple[int, ...]], ...] = hidden(())
    nest: Optional[str] = None
    layer = "mapping"

    def rewrite_nest(self, nest, names):
        if any(isinstance(lp, Loop) and lp.gpu for lp in walk(nest.body)):
            raise ScheduleError(f"{self}: nest {nest.label} is mapped already (one BlockTiles "
                                "a nest, before its ThreadTiles)")
        if len(self.bounds) > 1:
            raise ScheduleError(f"{self}: bounds for one size only (the kernel's one template "
                                f"parameter), not {', '.join(name for name, _ in self.bounds)}")
        legality = Parallel(self.vars)  # the same as a parallel loop chain's
        try:
            legality.rewrite_nest(nest, names)
        except ScheduleError as refused:
            raise ScheduleError(str(refused).replace(str(legality), str(self), 1)) from None
        chain = perfect_chain(nest.body, len(self.vars))
        sizes = (self.rows, self.cols) if self.cols else (self.rows,)
        cut = chain[-len(sizes):]  # the loops cut into tiles, a block's rows (and columns)
        if len(chain) < len(sizes) or any(lp.start != 0 for lp in cut) or min(sizes) < 1:
            raise ScheduleError(f"{self}: the loops over {', '.join(lp.var.name for lp in cut)} "
                                "must start at 0 and a block hold at least one of each")
        taken = {lp.var.name for lp in walk(nest.body) if isinstance(lp, Loop)}
        tiles, ranges = [], []
        for lp, size in zip(cut, sizes):
            tile = claim_loop(names, loop_role(lp.var.name, "blk"), taken, self)
            # an extent of whole tiles (a multiple of size: every term of stop / size an
            # integer coefficient times sizes): no tile is partial
            whole = all(term.as_coeff_Mul()[0].is_Integer
                        for term in sympy.Add.make_args(sympy.expand(lp.stop / size)))
            end = size * tile + size
            count = sympy.expand(lp.stop / size) if whole else idiv(lp.stop + size - 1, size)
            tiles.append(Loop(tile, sympy.Integer(0), count, ()))
            ranges.append(replace(lp, start=size * tile,
                                  stop=end if whole else sympy.Min(lp.stop, end)))
        inner = (ranges[-1],)  # the tile's ranges nested, the innermost's body the loop's
        for lp in reversed(ranges[:-1]):
            inner = (replace(lp, body=inner),)
        outer, inner = self._fold(chain[:-len(sizes)], inner, names, 3 - len(sizes))
        # the bounds on the innermost grid loop (the printer's template parameter)
        body = (replace(tiles[-1], body=inner, gpu=Grid(bounds=tuple(self.bounds))),)
        for lp in reversed(outer + tiles[:-1]):
            body = (replace(lp, body=body, gpu=Grid()),)
        return body

    def _fold(self, outer, inner, names, axes):
        """(the grid loops outside the tiles, at most `axes`: those from the last axis's
        on folded into one where there are more; the tile's loops with the variables
        recovered from the folded one's)."""
        if len(outer) <= axes:
            return list(outer), inner
        kept, folded = list(outer[:axes - 1]), outer[axes - 1:]
        flat = claim_loop(names, folded_loop([lp.var.name for lp in folded]),
                          {lp.var.name for lp in outer} | {lp.var.name for lp in walk(inner)
                                                           if isinstance(lp, Loop)}, self)
        at, within = {}, sympy.Integer(1)  # within: the iterations of the folded loops inside
        for k, lp in reversed(list(enumerate(folded))):
            extent, quotient = lp.stop - lp.start, idiv(flat, within)
            at[lp.var] = lp.start + (quotient if k == 0 else
                                     quotient - extent * idiv(flat, within * extent))
            within *= extent
        return kept + [Loop(flat, sympy.Integer(0), within, ())], subs_stmts(inner, at)


@dataclass(frozen=True)
class ThreadTiles(Step):
    """The loops over `loop` inside the grid's blocks as the block's threads along `axis`
    ("y": rows, "x": columns): `threads` of them (where 0: the loop's most iterations over
    `tile`), each taking `tile` consecutive iterations, its register tile's rows or columns,
    then as many more tiles `threads * tile` further on as the loop needs. The outermost
    loops over `loop` that can be split this way are: every store inside indexed by the
    loop, every local accumulated inside and defined outside it a sum or a max the loop
    never reads (on axis x only, where the threads that share a row are lanes of one warp:
    the printer combines their parts by shuffles); a loop that cannot be is searched
    inside. The loop's bounds may depend on no other thread loop. Refused: a count of
    threads along the axis other than the block's other loops there have, and a loop with
    no compile-time most iterations (a size without BlockTiles' bounds)."""
    loop: str
    tile: int = shown("{tile} a thread")
    axis: str = shown("axis {axis}", "y")
    threads: int = option("{threads} threads", 0)
    # >0: `threads` warps (not threads) along the axis, each tile a warp's, as tensor-core
    # fragments of `fragment` iterations its 32 lanes hold together (WarpMma's form); a
    # warp takes one tile, the loop at most `threads * tile` iterations
    fragment: int = option("fragments of {fragment}", 0)
    nest: Optional[str] = None
    layer = "mapping"

    def rewrite_nest(self, nest, names):
        if self.axis not in ("x", "y") or self.tile < 1:
            raise ScheduleError(f"{self}: the axis is x or y, a thread's tile at least 1")
        if self.fragment and (self.tile % self.fragment or not self.threads):
            raise ScheduleError(f"{self}: a warp's tile is whole fragments, and the warps "
                                "along the axis given")
        if not any(map(is_grid, walk(nest.body))):
            raise NotApplicable(f"{self}: nest {nest.label} has no grid (BlockTiles first)")
        body, count = self._map(nest.body, thread_vars=set(), axes=set())
        if not count:
            raise NotApplicable(f"{self}: nest {nest.label} has no loop over {self.loop} its "
                                "threads can share")
        self._check_block(body)
        return body

    def _check_block(self, body):
        """A block has one count of threads along an axis, and each thread a compile-time
        count of a loop's iterations (its register tile, unrolled): the loop's extent
        constant, or a size BlockTiles gives bounds for."""
        bounds = grid_bounds(body)
        mine = [lp for lp in walk(body) if is_thread_loop(lp) and lp.gpu.axis == self.axis]
        counts = sorted({lp.gpu.block_threads for lp in mine})
        if len(counts) > 1:
            raise ScheduleError(f"{self}: the block's threads along {self.axis} would be "
                                f"{' and '.join(map(str, counts))} in different loops")
        for lp in mine:
            if most_iterations(lp, bounds) is None:
                sizes = sorted(x.name for x in (lp.stop - lp.start).free_symbols)
                raise ScheduleError(f"{self}: the loop over {lp.var} has no compile-time most "
                                    f"iterations; give BlockTiles a bound for {', '.join(sizes)}")

    def _map(self, stmts, thread_vars, axes):
        """stmts with the loops mapped; how many. thread_vars, axes: the thread loops around
        (a loop inside one on the same axis stays a thread's own loop)."""
        out, count = [], 0
        for s in stmts:
            if not isinstance(s, Loop):
                out.append(s)
                continue
            if s.var.name == self.loop and s.gpu is None and self.axis not in axes \
                    and self._legal(s, thread_vars):
                out.append(replace(s, gpu=Threads(self.axis, self._threads(s), self.tile,
                                                  self.fragment)))
                count += 1
                continue
            threaded = is_thread_loop(s)
            body, n = self._map(s.body, thread_vars | ({s.var} if threaded else set()),
                                axes | ({s.gpu.axis} if threaded else set()))
            out.append(replace(s, body=body))
            count += n
        return tuple(out), count

    def _threads(self, loop):
        if self.fragment:
            most = max_extent(loop)
            if most is None or most > self.threads * self.tile:
                raise ScheduleError(f"{self}: the loop over {loop.var} has more than the "
                                    f"{self.threads} warps' tiles of {self.tile} iterations")
            if self.axis == "x" and self.threads * WARP > 1024:
                raise ScheduleError(f"{self}: {self.threads} warps along x are over 1024 threads")
            return self.threads
        if self.threads:
            threads = self.threads
        else:
            most = max_extent(loop)
            if most is None or most % self.tile:
                raise ScheduleError(f"{self}: the loop over {loop.var} has no whole number of "
                                    f"tiles of {self.tile} at most; give `threads`")
            threads = most // self.tile
        if self.axis == "x" and (threads > WARP or threads & (threads - 1)):
            raise ScheduleError(f"{self}: the threads along x that share a row are lanes of one "
                                f"warp, a power of two up to {WARP}; got {threads}")
        return threads

    def _legal(self, loop, thread_vars) -> bool:
        if (loop.start.free_symbols | loop.stop.free_symbols) & thread_vars:
            return False
        own = {s.name for s in walk(loop.body) if isinstance(s, Let)}
        accumulated = set()
        for s in walk(loop.body):
            if isinstance(s, Store) and not s.atomic and not any(
                    loop.var in sympy.sympify(i).free_symbols for i in s.index):
                return False
            if isinstance(s, Update) and s.name not in own:
                if self.axis != "x" or s.op not in WARP_REDUCIBLE \
                        or s.name in S.free_names(s.value):
                    return False
                accumulated.add(s.name)
        return not (accumulated & names_read(loop.body))


@dataclass(frozen=True)
class ThreadPhases(Step):
    """The thread loop over `loop` around a block's phases (a flash block's whole pass: its
    key blocks' loop, each staging tiles) as one such loop around each run of statements
    between the block's copies, pushed into the sequential loops that hold a copy (the key
    blocks'): a thread runs every loop of one mapping, variable and range alike, its locals
    one register tile across them (the printer's slots), so the value is the same; each
    phase then a loop of its own, which a later step may map otherwise (WarpTiles: a
    product's rows as warps' fragments). Refused: no such thread loop, and a sequential
    loop holding a copy whose range depends on the loop's variable."""
    loop: str
    nest: Optional[str] = None
    layer = "mapping"

    def rewrite_nest(self, nest, names):
        count = [0]

        def holds_copy(s):
            return any(isinstance(x, Loop) and isinstance(x.gpu, BlockCopy)
                       for x in walk((s,)))

        def spread(template, stmts):
            out, run = [], []

            def flush():
                if run:
                    out.append(replace(template, body=tuple(run)))
                    run.clear()

            for s in stmts:
                if isinstance(s, Loop) and isinstance(s.gpu, BlockCopy):
                    flush()
                    out.append(s)
                elif isinstance(s, Loop) and s.gpu is None and holds_copy(s):
                    if template.var in (s.start.free_symbols | s.stop.free_symbols):
                        raise ScheduleError(f"{self}: the loop over {s.var} holding a block's "
                                            f"copy depends on {template.var}")
                    flush()
                    out.append(replace(s, body=tuple(spread(template, s.body))))
                else:
                    run.append(s)
            flush()
            return out

        def visit(stmts):
            out = []
            for s in stmts:
                if is_thread_loop(s) and s.var.name == self.loop and holds_copy(s):
                    count[0] += 1
                    out += spread(s, s.body)
                elif isinstance(s, Loop):
                    out.append(replace(s, body=visit(s.body)))
                else:
                    out.append(s)
            return tuple(out)

        body = visit(nest.body)
        if not count[0]:
            raise NotApplicable(f"{self}: nest {nest.label} has no thread loop over {self.loop} "
                                "around a block's copy")
        return body


@dataclass(frozen=True)
class UnrollInner(Step):
    """The loops over `loop` that a block's threads each run themselves inside their thread
    loops (a register tile's products: the sum over d of a score, over a key block's keys
    of an output) unrolled `factor` times in the printed kernel: `factor` times the
    multiply-adds a back-edge, the loop's counter, compare and branch shared by them. The
    compiler's unrolling; the values are the same. Refused: a factor under 2, and a nest
    with no such loop."""
    loop: str
    factor: int = shown("by {factor}")
    nest: Optional[str] = None
    layer = "mapping"

    def rewrite_nest(self, nest, names):
        if self.factor < 2:
            raise ScheduleError(f"{self}: a factor of at least 2")
        body, count = self._mark(nest.body, inside=False)
        if not count:
            raise NotApplicable(f"{self}: nest {nest.label} has no loop over {self.loop} a "
                                "thread runs itself inside its thread loops")
        return body

    def _mark(self, stmts, inside):
        out, count = [], 0
        for s in stmts:
            if not isinstance(s, Loop):
                out.append(s)
                continue
            if inside and s.gpu is None and s.var.name == self.loop:
                out.append(replace(s, gpu=Unrolled(self.factor)))
                count += 1
                continue
            body, n = self._mark(s.body, inside or is_thread_loop(s))
            out.append(replace(s, body=body))
            count += n
        return tuple(out), count
