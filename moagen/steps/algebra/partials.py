"""Partial sums: a sum over every row (RMSNorm's dgamma) computed in parallel without
atomics, and in an order that does not depend on the number of threads.

It takes a nest `for c..: out[c..] = sum_b sum_i body(b, i, c..)` and cuts the loop over
one summed axis (i) into a fixed number of parts:

    partial  for p in [0, parts):                      (parallel: each p owns its row)
                 out_part[p, c..] = 0
                 for b: for i in part p of [0, n): for c..: out_part[p, c..] += body
    merge    for c..: out[c..] = sum_p out_part[p, c..]  (p = 0, 1, ... in order)

Inside a part the output loops are innermost, over contiguous elements; whatever depends
only on the row (a row's statistic) is hoisted out of them by a later Hoist.

With `rows`, a nest that walks the same rows, `for b: for i: R(b, i)` (RMSNorm's dx), runs
inside the parts' row loops, before the row's accumulation: each row is read from memory
once for both. Legal when neither nest reads what the other writes (and no nest between
them touches what R writes): R(b, i) then runs once per row, as before, in another order.
"""
from dataclasses import dataclass, replace

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import idiv
from moagen.onf.loops import (Buffer, Let, Loop, Nest, ONF, Store, Update, arrays_read, enclose,
                              loop_nest, loop_vars, perfect_chain, subs_stmts, walk)
from moagen.onf.names import Names, base_name, claim_loop, kernel_names, loop_role, nest_role
from moagen.steps.loop.fusion import as_block, fuse_siblings, independent
from moagen.steps.loop.unroll import outer_loop
from moagen.steps.step import Step, option


class _InParts:
    """PartialSums' and SplitK's frame: nest `nest`'s store of a sum, its parts summed by a
    new nest into a buffer of `parts` rows, the nest itself left to merge them in order."""

    @property
    def partial(self) -> str:
        """The nest it creates that sums the parts (the nest itself merges them)."""
        return nest_role(self.nest, "partial")

    def _check_parts(self):
        if self.parts < 1:
            raise ScheduleError(f"{self}: the number of parts must be at least 1")

    def _in_parts(self, onf, nest, out_loops, store, p, part, buffer, in_part, origin,
                  merged=None, merge_origin=None, dropped=None) -> ONF:
        """onf with `nest` as two: the partial nest, `for p in [0, parts): in_part` (its
        origin `origin`), and the merge, `for out_loops: store of merged(sum_p part[p, ..])`
        (merged: the sum itself where None); buffer added, nest `dropped` left out."""
        partial = Nest(nest.target, (Loop(p, sympy.Integer(0), sympy.Integer(self.parts),
                                          in_part),), origin, self.partial)
        total = _sum_of_parts(p, self.parts, part, store.index, store.array)
        merge = replace(nest, body=enclose(out_loops, (replace(
            store, value=merged(total) if merged else total),)),
            origin=merge_origin or nest.origin)
        nests = []
        for n in onf.nests:
            if n is nest:
                nests += [partial, merge]
            elif dropped is None or n.label != dropped:
                nests.append(n)
        return replace(onf.with_nests(nests, str(self)), temps=onf.temps + (buffer,))


@dataclass(frozen=True)
class PartialSums(_InParts, Step):
    layer = "algorithm"
    nest: str
    var: str  # the summed axis cut into parts
    parts: int
    rows: str = option("rows={rows}", "")  # a nest over the same rows to run inside the parts

    @property
    def part(self) -> str:
        """The loop over the parts it creates."""
        return loop_role(self.var, "part")

    def __call__(self, onf: ONF) -> ONF:
        self._check_parts()
        nest = self.nest_called(onf)
        out_loops, stmts = loop_nest(nest.body)
        store = stmts[0] if len(stmts) == 1 else None
        if not isinstance(store, Store) or store.accumulate or \
                not isinstance(store.value, S.Reduction):
            raise ScheduleError(f"{self}: nest {self.nest} is not loops around one store of a sum")
        sums, body = S.nested_sums(store.value)
        if isinstance(body, S.Reduction) or self.var not in [base_name(r.var.name) for r in sums]:
            raise ScheduleError(f"{self}: the value stored by nest {self.nest} is not a sum over "
                                f"{self.var}")

        names = kernel_names(onf)
        p = claim_loop(names, self.part, {lp.var.name for lp in out_loops}, self)
        part, buffer = _part_buffer(onf, names, store.array, self.parts)
        part_index = (p,) + tuple(store.index)
        # the summed axes become loops named after their role (b2 -> b where free)
        loop_names = Names(names.fixed | names.locals | {lp.var.name for lp in out_loops} | {p.name})
        sum_loops = []
        for red in sums:
            var = sympy.Symbol(loop_names.claim(loop_names.new(base_name(red.var.name))),
                               integer=True)
            body = S.subs(body, {red.var: var})
            loop = Loop(var, sympy.Integer(0), red.extent, ())
            if base_name(red.var.name) == self.var:
                chunk = idiv(red.extent + self.parts - 1, self.parts)
                loop = replace(loop, start=p * chunk, stop=sympy.Min(red.extent, p * chunk + chunk))
            sum_loops.append(loop)
        zero = enclose(out_loops, (Store(part, part_index, S.Num(0.0)),))
        add = enclose(out_loops, (Store(part, part_index, body, accumulate="+"),))
        origin = nest.origin
        if self.rows:
            rows, row_body = self._row_body(onf, nest, sum_loops, [r.extent for r in sums])
            add, origin = fuse_siblings(row_body + add), f"{rows.origin}\n{origin}"
        return self._in_parts(onf, nest, out_loops, store, p, part, buffer,
                              zero + enclose(sum_loops, add), origin,
                              dropped=self.rows or None)

    def _row_body(self, onf, nest, sum_loops, extents):
        """The rows nest and its body inside its row loops, in the parts' loop variables."""
        rows = self.nest_called(onf, self.rows)
        chain = perfect_chain(rows.body, len(sum_loops))
        if chain is None or [(lp.start, lp.stop) for lp in chain] != \
                [(sympy.Integer(0), e) for e in extents]:
            raise ScheduleError(f"{self}: nest {self.rows} does not start with loops over the "
                                f"rows nest {self.nest} sums over")
        first, last = sorted((onf.nests.index(rows), onf.nests.index(nest)))
        for other in onf.nests[first:last + 1]:
            if other is not rows and not independent(as_block(rows), as_block(other)):
                raise ScheduleError(f"{self}: nest {self.rows} shares data with nest "
                                    f"{other.label}: it cannot run inside the parts")
        return rows, subs_stmts(chain[-1].body, {lp.var: own.var
                                                 for lp, own in zip(chain, sum_loops)})


def _part_buffer(onf, names, array, parts):
    """(the parts' array, its buffer): `parts` copies of `array`, part p at [p, ..]."""
    part = names.claim(names.new(f"{array}_part"))
    shape = next(b.shape for b in onf.outputs + onf.temps if b.name == array)
    return part, Buffer(part, (sympy.Integer(parts),) + shape)


def _sum_of_parts(p, parts, part, index, array):
    """sum_p part[p, index], p = 0, 1, ... in order: the same on any number of threads."""
    return S.Reduction("+", p, sympy.Integer(parts), S.Access(part, (p,) + tuple(index)),
                       f"{array}_sum")


@dataclass(frozen=True)
class PartBuffers(Step):
    """A sum scattered over a loop (Scatter's atomic additions: the owner's dQ added from the
    key rows' pass, `for b, h: for j: .. dQ[b, h, i, c] += ds K[j, c]`) computed in a fixed
    number of parts of that loop, each adding into a buffer of its own:

        zero         for outer..: for p: for ..: part[p, outer.., ..] = 0
        nest         for outer..: for p in [0, parts):   (outer and p parallel: each owns a part)
                         for j_in in [0, ceil((stop - p) / parts)): body(j = p + parts j_in)
                                                         (its additions into part[p, ..])
        merge        for ..: out[..] = sum_p part[p, ..]   (p = 0, 1, ... in order)

    out's zero nest zeroes the parts instead, and the merge sets out after the nest. No
    atomics, and the order of every addition is fixed by `parts`, not by the number of
    threads. Part p takes every parts-th iteration from p on (the parts' lengths differ by
    at most one), by a loop from 0 that UnrollJam can take.

    Legal when the loop's iterations add into `out` and do not read it, the zero nest sets
    every element (Scatter's), and no nest between the two touches `out`."""
    layer = "algorithm"
    nest: str
    loop: str
    array: str
    parts: int

    @property
    def part(self) -> str:
        """The loop over the parts it creates (j_part)."""
        return loop_role(self.loop, "part")

    @property
    def within(self) -> str:
        """The loop over one part's iterations it creates (j_in)."""
        return loop_role(self.loop, "in")

    @property
    def zero(self) -> str:
        """The nest that zeroes the parts: Scatter's zero nest of the array."""
        return nest_role(self.array, "zero")

    @property
    def merge(self) -> str:
        """The nest it creates that sums the parts into the array."""
        return nest_role(self.array, "merge")

    def __call__(self, onf: ONF) -> ONF:
        if self.parts < 1:
            raise ScheduleError(f"{self}: the number of parts must be at least 1")
        nest = self.nest_called(onf)
        zero = self.nest_called(onf, self.zero)
        outer, loop = outer_loop(self, nest.body, self.loop)
        stores = lambda stmts: [s for s in walk(stmts)
                                if isinstance(s, Store) and s.array == self.array]
        adds = stores(loop.body)
        if not adds or len(adds) != len(stores(nest.body)) or \
                any(s.accumulate != "+" for s in adds) or self.array in arrays_read(nest.body):
            raise ScheduleError(f"{self}: nest {self.nest} does not only add into "
                                f"{self.array} in its loop over {self.loop}")
        zero_loops, zero_store = self._zero(zero, outer)
        first, last = onf.nests.index(zero), onf.nests.index(nest)
        for other in onf.nests[first + 1:last]:
            if not independent(as_block(zero), as_block(other)):
                raise ScheduleError(f"{self}: nest {other.label} touches {self.array} between "
                                    f"its zero nest and nest {self.nest}")

        names = kernel_names(onf)
        scope = {lp.var.name for lp in outer} | loop_vars((loop,))
        p = claim_loop(names, self.part, scope, self)
        j_in = claim_loop(names, self.within, scope | {p.name}, self)
        part, buffer = _part_buffer(onf, names, self.array, self.parts)
        # part p takes every parts-th iteration from p on: its length is never negative
        length = idiv(loop.stop - p + self.parts - 1, self.parts)
        body = subs_stmts(loop.body, {loop.var: p + self.parts * j_in})
        body = _into_part(body, self.array, part, p)
        part_loop = Loop(p, sympy.Integer(0), sympy.Integer(self.parts), ())
        parts = replace(part_loop, body=(Loop(j_in, sympy.Integer(0), length, body),))
        # the parts zeroed over the nest's outer loops and p: run in parallel as the nest is,
        # each part is first touched by the thread that adds into it
        clear = replace(zero, body=enclose(
            zero_loops[:len(outer)] + [part_loop] + zero_loops[len(outer):],
            (replace(zero_store, array=part, index=(p,) + tuple(zero_store.index)),)))
        total = _sum_of_parts(p, self.parts, part, zero_store.index, self.array)
        merge = Nest(zero.target, enclose(zero_loops, (replace(zero_store, value=total),)),
                     f"{self.array} = the sum of its {self.parts} parts", self.merge)
        nests = []
        for n in onf.nests:
            if n is nest:
                nests += [replace(n, body=enclose(outer, (parts,))), merge]
            else:
                nests.append(clear if n is zero else n)
        return replace(onf.with_nests(nests, str(self)), temps=onf.temps + (buffer,))

    def _zero(self, zero, outer):
        """The zero nest's loops and store; its first loops must run as `outer` do."""
        loops, stmts = loop_nest(zero.body)
        store = stmts[0] if len(stmts) == 1 else None
        if not isinstance(store, Store) or store.array != self.array or store.accumulate or \
                store.value != S.Num(0.0) or len(loops) != len(store.index):
            raise ScheduleError(f"{self}: nest {zero.label} is not loops around {self.array} = 0")
        if [(z.start, z.stop) for z in loops[:len(outer)]] != [(o.start, o.stop) for o in outer]:
            raise ScheduleError(f"{self}: nest {zero.label}'s outer loops run otherwise than "
                                f"nest {self.nest}'s")
        return loops, store


def _into_part(stmts, array, part, p):
    """stmts with their additions into array made, without atomics, into part p of it."""
    out = []
    for s in stmts:
        if isinstance(s, Loop):
            s = replace(s, body=_into_part(s.body, array, part, p))
        elif isinstance(s, Store) and s.array == array:
            s = replace(s, array=part, index=(p,) + tuple(s.index), atomic=False)
        out.append(s)
    return tuple(out)



@dataclass(frozen=True)
class SplitK(_InParts, Step):
    """Split-K: a lowered sum `for out..: acc = 0; .. for k in [a, b): acc += ..; out[out..]
    = acc` whose output has too few tiles to fill a GPU, its loop `loop` (a GEMM's chunks,
    Split's k_blk) cut into `parts` runs of consecutive iterations, a part each, its nest
    two:

        partial  for p in [0, parts): for out..:    (the nest's body, the loop over k
                     acc = 0; ..                     in [a + L p, Min(b, a + L p + L)))
                     out_part[p, out..] = acc
        merge    for out..: out[out..] = sum_p out_part[p, out..]   (p = 0, 1, ... in order)

    A store of a term plus the sum, `out[out..] = term + acc` (out_proj's residual R + the
    heads' sum), keeps its term in the merge alone: the parts store acc, the merge term +
    sum_p out_part[p, out..] (the parts in the same order), so the term is added once.

    L = ceil((b - a) / parts). No atomics: each (p, out..) is written by one iteration, and
    the parts are added in one fixed order, so the bits do not depend on how the partial
    nest's iterations run. PartialSums' form for a product whose output tiles a later
    BlockTiles gives to thread blocks: the part loop outermost (a grid axis), the loop cut
    by its range (a staged tile's index stays its loop's variable); the merge a nest of its
    own (a thread an element).

    Legal when the sum is linear in what the loop adds: inside the nest's loops (perfectly
    nested, its outputs' indices) only locals set to 0, loops, additions into locals of a
    local (an inner sum carried out: a weight gradient's batch entries) or of a value
    reading no local (a term), and last one store, not accumulating, of a local or of a
    value reading no local plus a local (the term then read in the merge, after the
    parts: as before, since the parts write only their own new array); every term added
    inside the loop (else the parts would each add it); the loop's range free of the
    loops around it inside the nest. Refused otherwise, or parts below 1."""
    layer = "schedule"
    nest: str
    loop: str
    parts: int

    @property
    def part(self) -> str:
        """The loop over the parts it creates (e_part for e_blk)."""
        return loop_role(base_name(self.loop).split("_")[0], "part")

    def __call__(self, onf: ONF) -> ONF:
        self._check_parts()
        nest = self.nest_called(onf)
        out_loops, stmts = loop_nest(nest.body)
        store = stmts[-1] if stmts else None
        acc, term = _local_and_term(store.value) if isinstance(store, Store) else (None, None)
        if acc is None or store.accumulate or store.atomic or \
                len(store.index) != len(out_loops) or \
                any(isinstance(s, Store) for s in walk(stmts[:-1])):
            raise ScheduleError(f"{self}: nest {self.nest} is not loops around a sum into a "
                                "local and one store of it (or of a term plus it)")
        cut = [s for s in walk(stmts) if isinstance(s, Loop) and s.var.name == self.loop]
        if len(cut) != 1:
            raise ScheduleError(f"{self}: nest {self.nest} has not one loop {self.loop}")
        cut = cut[0]
        inner = {id(s) for s in walk((cut,))}
        for s in walk(stmts[:-1]):
            if isinstance(s, Let) and s.value != S.Num(0.0) or \
                    not isinstance(s, (Let, Loop, Update)) or \
                    isinstance(s, Update) and (s.op != "+" or not (
                        isinstance(s.value, S.Local) or
                        not S.contains(s.value, S.Local) and id(s) in inner)):
                raise ScheduleError(f"{self}: nest {self.nest}'s sum is not additions of "
                                    f"terms inside its loop {self.loop} (at {s})")
        around = {lp.var for lp in walk(stmts) if isinstance(lp, Loop) and cut in walk((lp,))}
        if _free((cut.start, cut.stop)) & (around - {cut.var}):
            raise ScheduleError(f"{self}: the range of loop {self.loop} depends on the loops "
                                "around it")
        names = kernel_names(onf)
        p = claim_loop(names, self.part, {lp.var.name for lp in out_loops} | loop_vars(stmts),
                       self)
        part, buffer = _part_buffer(onf, names, store.array, self.parts)
        run = idiv(cut.stop - cut.start + self.parts - 1, self.parts)
        start = cut.start + run * p
        body = _replaced(stmts[:-1], cut, replace(cut, start=start,
                                                  stop=sympy.Min(cut.stop, start + run)))
        body += (replace(store, array=part, index=(p,) + tuple(store.index), value=acc),)
        what = f"the sum of its {self.parts} parts"
        return self._in_parts(
            onf, nest, out_loops, store, p, part, buffer, enclose(out_loops, body),
            nest.origin, merged=None if term is None else lambda total: S.Bin("+", term, total),
            merge_origin=f"{store.array} = " + (what if term is None else f"its term + {what}"))


def _local_and_term(value):
    """(the local, the term) of a stored `acc` (no term: None) or `term + acc`, the term
    reading no local; (None, None) for any other value."""
    if isinstance(value, S.Local):
        return value, None
    if isinstance(value, S.Bin) and value.op == "+" and isinstance(value.right, S.Local) and \
            not S.contains(value.left, S.Local):
        return value.right, value.left
    return None, None


def _replaced(stmts, target, new):
    """stmts with statement `target` (by identity) replaced by `new`."""
    return tuple(new if s is target else
                 replace(s, body=_replaced(s.body, target, new)) if isinstance(s, Loop) else s
                 for s in stmts)


def _free(exprs):
    return set().union(*(sympy.sympify(e).free_symbols for e in exprs))
