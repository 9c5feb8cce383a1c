"""Register tiling of a contraction: the ONF rewrite that puts an inner product next to BLAS.

It takes a nest `for outer..: for r: for c: out[.., r, c] = g(sum_k body(r, k, c))` (k may
be several nested sums, e.g. over batch and rows for a weight gradient) and computes an
mr x nr tile of outputs at once, each in its own accumulator, so that every operand loaded
in the loop over k is used mr or nr times from registers:

    tiles  for outer..: for r_tile: for c_tile in full column tiles:
               acc_u_v = 0                               (u < mr, v < nr)
               for k..: acc_u_v += body(r_u, k, c_v)     r_u = min(mr*r_tile + u, rows - 1)
               out[.., r_u, c_v] = g(acc_u_v)            c_v = nr*c_tile + v
    edge   for outer..: for r: for c in the last (rows mod nr) columns: the plain nest

The columns of a tile are consecutive (the contiguous axis of the output and of the
operand indexed by c), which the compiler turns into vector registers. A row tile past the
last row repeats the last row, recomputing and storing the same value; no edge code for
rows is needed, and the rows of a tile never leave one thread. Sums over one extent
(dU Wg^T + dV Wu^T) share the accumulators, each term with its own loop over k after the
other's (`for k: acc += a; for k: acc += b`): the registers hold one term's operands at a
time.
"""
from dataclasses import dataclass, replace

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import idiv
from moagen.onf.loops import (Buffer, Let, Loop, Nest, ONF, Store, Update, enclose,
                              loop_nest)
from moagen.onf.names import Names, base_name, claim_loop, kernel_names, loop_role, nest_role
from moagen.steps.loop.merge_sums import merge_sums, sum_terms
from moagen.steps.step import Step, flag, hidden, option, shown


@dataclass(frozen=True)
class RegisterTile(Step):
    nest: str
    rows: str = shown("{rows} x {cols}")
    cols: str = hidden()
    mr: int = shown("{mr} x {nr}", 4)
    nr: int = hidden(8)
    pack: bool = flag("packed", True)  # copy the column operand into contiguous panels first
    # rows per cache block (a multiple of mr; 0: none): the row tiles of one block pass
    # over every column panel while the block's rows of the other operand stay in cache
    row_block: int = option("{row_block} rows a block", 0)

    @property
    def row_tiles(self) -> str:
        return loop_role(self.rows, "tile")

    @property
    def col_tiles(self) -> str:
        return loop_role(self.cols, "tile")

    @property
    def tiles(self) -> tuple:
        """The loops over column tiles and row tiles, outermost first: without row blocks,
        a perfect nest with a tile in each iteration."""
        if self.row_block:
            raise ScheduleError(f"{self}: with row blocks, the row tiles' loop is inside a "
                                "block's and cannot be numbered with the column tiles'")
        return (self.col_tiles, self.row_tiles)

    @property
    def row_blocks(self) -> str:
        """The loop over blocks of rows (with row_block)."""
        return loop_role(self.rows, "blk")

    @property
    def edge(self) -> str:
        """The tail nest it creates: the columns past the last full tile."""
        return nest_role(self.nest, "edge")

    @property
    def pointwise(self) -> str:
        """The nest it creates that applies the value's function to the tile's sums."""
        return nest_role(self.nest, "pointwise")

    def packing(self, operand: str) -> str:
        """The nest it creates that copies `operand` into panels."""
        return nest_role(self.nest, f"pack_{operand}")

    def __call__(self, onf: ONF) -> ONF:
        if self.mr < 1 or self.nr < 1:
            raise ScheduleError(f"{self}: tile sizes must be at least 1")
        if self.row_block < 0 or self.row_block % self.mr:
            raise ScheduleError(f"{self}: a row block must be a multiple of {self.mr} rows")
        nest = self.nest_called(onf)
        chain, store = self._pattern(nest)
        store = replace(store, value=merge_sums(store.value))
        *outer, rows, cols = chain
        reduction = self._contraction(store, rows, cols)
        sums, body = S.nested_sums(reduction)

        # loop variables may repeat another nest's, accumulators another nest's locals
        names = kernel_names(onf)
        in_nest = {lp.var.name for lp in chain}
        loop_names = Names(names.fixed | names.locals | in_nest)
        new_var = lambda hint: sympy.Symbol(loop_names.claim(loop_names.new(hint)), integer=True)

        def own(name):  # a loop the caller may address: exactly the rule's name
            var = claim_loop(names, name, in_nest, self)
            loop_names.claim(var.name)
            return var

        r_tile, c_tile = own(self.row_tiles), own(self.col_tiles)
        loop_vars = [new_var(base_name(red.var.name)) for red in sums]
        acc_names = Names(names.reserved - names.locals)
        body = S.subs(body, {red.var: v for red, v in zip(sums, loop_vars)})
        pack = []
        if self.pack:
            body, pack = self._pack(body, outer, rows, cols, c_tile, sums, loop_vars, new_var, names)

        # a tile stores its sums; what the value does with the sum (U sigmoid(U) * sum) is a
        # pointwise nest of its own after it: in the tile's last step it would keep the
        # compiler from holding the accumulators in vector registers (each lane taken out
        # for a scalar call)
        pointwise = store.value != reduction
        # one loop over k a term (the module's docstring): 6 x 2 accumulators, a panel row's
        # two registers and a broadcast fit AVX2's 16 vector registers; two terms' operands
        # at once spilled
        terms = sum_terms(body)
        lets, stores, updates = [], [], [[] for _ in terms]
        for u in range(self.mr):
            r_u = sympy.Min(self.mr * r_tile + u, rows.stop - 1)
            for v in range(self.nr):
                at = {rows.var: r_u, cols.var: self.nr * c_tile + v}
                acc = acc_names.claim(acc_names.new(f"acc_{u}_{v}"))
                lets.append(Let(acc, S.Num(0.0)))
                for term, term_updates in zip(terms, updates):
                    term_updates.append(Update(acc, "+", S.subs(term, at)))
                value = S.Local(acc) if pointwise else \
                    S.subs(S.replace_node(store.value, reduction, S.Local(acc)), at)
                stores.append(Store(store.array, tuple(sympy.sympify(i).xreplace(at)
                                                        for i in store.index), value))
        k_loops = [Loop(v, sympy.Integer(0), red.extent, (), vector_tile=True)
                   for red, v in zip(sums, loop_vars)]
        # column tiles outside row tiles: a panel of the operand indexed by columns stays
        # in cache while every row tile (of a block) passes over it
        row_tiles = idiv(rows.stop + self.mr - 1, self.mr)
        tile_loops = [Loop(c_tile, sympy.Integer(0), idiv(cols.stop, self.nr), ()),
                      Loop(r_tile, sympy.Integer(0), row_tiles, ())]
        if self.row_block:
            r_blk, per_block = own(self.row_blocks), self.row_block // self.mr
            tile_loops = [Loop(r_blk, sympy.Integer(0), idiv(row_tiles + per_block - 1, per_block),
                               ()),
                          tile_loops[0],
                          Loop(r_tile, per_block * r_blk, sympy.Min(row_tiles,
                                                                   per_block * r_blk + per_block),
                               ())]
        tiles = enclose(outer + tile_loops, lets + [loop for term_updates in updates
                                                    for loop in enclose(k_loops, term_updates)]
                        + stores)
        tiled_cols = self.nr * idiv(cols.stop, self.nr)
        edge = enclose(outer + [rows, replace(cols, start=tiled_cols)], (store,))
        nests, temps = [], onf.temps
        for n in onf.nests:
            if n is not nest:
                nests.append(n)
                continue
            for operand, panel, copy in pack:  # U.pack_Wg fills Wg_panel
                nests.append(Nest(panel.name, copy, n.origin, self.packing(operand)))
                temps += (panel,)
            nests.append(replace(n, body=tiles))
            if pointwise:
                apply = self._pointwise(store, reduction, outer, rows, replace(cols, stop=tiled_cols))
                nests.append(Nest(n.target, apply, n.origin, self.pointwise))
            # a row block's loop is the rows' loop in the tail
            renames = ((self.row_blocks, self.rows),) if self.row_block else ()
            nests.append(Nest(n.target, edge, n.origin, self.edge, parent=n.label,
                              renames=renames))
        return replace(onf.with_nests(nests, str(self)), temps=temps)

    @staticmethod
    def _pointwise(store, reduction, outer, rows, cols):
        """The stored value with the tile's sum read back, over the tiled columns; parallel
        over the outer loops and rows (each iteration its own row)."""
        applied = S.replace_node(store.value, reduction, S.Access(store.array, store.index))
        apply = enclose(outer + [rows, cols], (replace(store, value=applied),))
        return (replace(apply[0], parallel=len(outer) + 1),)

    def _pack(self, body, outer, rows, cols, c_tile, sums, loop_vars, new_var, names):
        """Panels: each operand indexed by the columns (and not the rows), copied so that a
        tile reads nr consecutive numbers per step of the sum, the steps one after the
        other: panel[outer.., c_tile, k.., v] = B[.., k.., nr*c_tile + v]. A weight's rows
        a multiple of 512 bytes apart would otherwise share a few cache sets. The copy
        nest is parallel over its first loop: each iteration fills its own panels."""
        operands = dict.fromkeys(e for e in S.subexpressions(body) if isinstance(e, S.Access)
                                 and cols.var in _symbols(e) and rows.var not in _symbols(e))
        if not operands:
            raise ScheduleError(f"{self}: no operand is indexed by {self.cols} and not "
                                f"{self.rows}: nothing to pack")
        lanes, packed = new_var("lane"), []
        for operand in operands:
            used = [lp for lp in outer if lp.var in _symbols(operand)]
            panel = Buffer(names.claim(names.new(f"{operand.array}_panel")),
                           tuple(lp.stop for lp in used) + (idiv(cols.stop, self.nr),)
                           + tuple(red.extent for red in sums) + (sympy.Integer(self.nr),))
            head = tuple(lp.var for lp in used) + (c_tile,) + tuple(loop_vars)
            copy = Store(panel.name, head + (lanes,),
                         S.subs(operand, {cols.var: self.nr * c_tile + lanes}))
            loops = used + [Loop(c_tile, sympy.Integer(0), idiv(cols.stop, self.nr), ())] + [
                Loop(v, sympy.Integer(0), red.extent, ()) for red, v in zip(sums, loop_vars)] + [
                Loop(lanes, sympy.Integer(0), sympy.Integer(self.nr), ())]
            copy_nest = enclose(loops, (copy,))
            packed.append((operand.array, panel, (replace(copy_nest[0], parallel=1),)))
            body = S.replace_node(body, operand,
                                  S.Access(panel.name, head + (cols.var - self.nr * c_tile,)))
        return body, packed

    def _pattern(self, nest: Nest):
        """The loops down to a single plain store, the last two being rows and cols."""
        chain, stmts = loop_nest(nest.body)
        names = [lp.var.name for lp in chain[-2:]]
        if (len(stmts) != 1 or not isinstance(stmts[0], Store) or stmts[0].accumulate
                or names != [self.rows, self.cols]):
            raise ScheduleError(f"{self}: nest {self.nest} is not perfectly nested loops ending "
                                f"in {self.rows}, {self.cols} around one store")
        if any(lp.start != 0 or lp.parallel for lp in chain):
            raise ScheduleError(f"{self}: nest {self.nest} must be tiled before any other "
                                f"loop transform")
        return chain, stmts[0]

    def _contraction(self, store, rows, cols):
        """The one sum in the stored value; its extents may not depend on rows or cols."""
        sums = [e for e in _outermost_reductions(store.value)]
        if len(sums) != 1 or sums[0].op != "+":
            raise ScheduleError(f"{self}: the value stored by nest {self.nest} must contain "
                                f"exactly one sum, found {len(sums)} reductions")
        red = sums[0]
        while isinstance(red, S.Reduction):
            if red.extent.free_symbols & {rows.var, cols.var}:
                raise ScheduleError(f"{self}: the extent {red.extent} of {red.var} depends on "
                                    f"the tiled loops")
            red = red.body
        if any(True for _ in _outermost_reductions(red)):
            raise ScheduleError(f"{self}: the sum stored by nest {self.nest} holds sums of its "
                                f"own inside, over other extents: not one contraction")
        return sums[0]


def _outermost_reductions(e):
    if isinstance(e, S.Reduction):
        yield e
        return
    for c in S.children(e):
        yield from _outermost_reductions(c)


def _symbols(access):
    return set().union(*(sympy.sympify(i).free_symbols for i in access.index))
