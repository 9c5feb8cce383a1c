"""Loops in another order: the perfectly nested loops a nest starts with permuted (Reorder),
and blocks of a loop's iterations sweeping an inner loop together (BlockInterchange, cache
blocking):

    for o in [s, e):                    for o_blk:
        pre(o)                              for o in block: pre(o)
        for q: B(o, q)          ->          for q: for o in block: B(o, q)
        post(o)                             for o in block: post(o)

The owner's key rows' pass with dQ's parts: each tile of key rows swept every query row of
its head, reading Q and dO and adding into dQ's part, 3 n d values a tile; at n 4096, d 128
a head's are 12 MiB, past the L2 and, two heads at once, the L3. A block of 64 key rows
sweeps the query rows' blocks together: a query block's rows are read from memory once for
the 64 key rows, and the key block's K, V, dK and dV rows (256 KiB at d 128) stay in L2.

The loop over q may sit inside loops that each hold only the next (the query heads of a
group, in grouped-query attention's backward): those move out with it, around the block.

Legal when the iterations of o share only additions into arrays they do not index (UnrollSum's
condition: then any order of the (o, q) steps computes the same sums), pre's locals are not
read after it, and q's bounds (and those of the loops around q) do not depend on o. The
order of additions to each element is the same as before when q's iterations add into
different elements (dQ's part: a query block's rows): the values are then the same bit for
bit.
"""
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import sympy

from moagen.errors import ScheduleError
from moagen.moa.expr import idiv
from moagen.onf.loops import Let, Loop, loop_vars, names_read, perfect_chain, rewrite_loops
from moagen.onf.names import claim_loop, loop_role
from moagen.steps.loop.unroll import check_sum_only, summed_arrays
from moagen.steps.step import NotApplicable, Step


@dataclass(frozen=True)
class Reorder(Step):
    """Permute the outermost perfectly nested loops of a nest into the given order."""
    order: Tuple[str, ...]
    nest: Optional[str] = None

    def rewrite_nest(self, nest, names):
        chain = perfect_chain(nest.body, len(self.order))
        have = [lp.var.name for lp in chain] if chain else []
        if sorted(have) != sorted(self.order):
            raise ScheduleError(f"{self}: the outermost perfectly nested loops of nest "
                                f"{nest.target} are not {', '.join(sorted(self.order))}")
        by_name = {lp.var.name: lp for lp in chain}
        body = chain[-1].body
        for pos, name in reversed(list(enumerate(self.order))):
            loop = by_name[name]
            outer = {by_name[o].var for o in self.order[pos + 1:]}
            if (loop.start.free_symbols | loop.stop.free_symbols) & outer:
                raise ScheduleError(f"{self}: the bounds of {name} depend on a loop that "
                                    f"would be inside it")
            body = (replace(loop, body=body, parallel=0),)
        return body


@dataclass(frozen=True)
class BlockInterchange(Step):
    nest: str
    loop: str
    across: str
    block: int

    @property
    def blocks(self) -> str:
        """The loop over blocks of `loop` it creates."""
        return loop_role(self.loop, "blk")

    def rewrite_nest(self, nest, names):
        if self.block < 2:
            raise ScheduleError(f"{self}: a block holds at least two iterations")
        body, count = rewrite_loops(nest.body, lambda loop: loop.var.name == self.loop,
                                    lambda loop, scope: self._blocked(loop, names, scope))
        if not count:
            raise NotApplicable(f"{self}: nest {self.nest} has no loop over {self.loop}")
        return body

    def _blocked(self, loop, names, scope):
        across = [(pos, chain) for pos, s in enumerate(loop.body)
                  for chain in (_chain_to(s, self.across),) if chain]
        if len(across) != 1 or loop.parallel:
            raise ScheduleError(f"{self}: the loop over {self.loop} must be sequential and "
                                f"hold one loop over {self.across} among its statements")
        pos, (*between, inner) = across[0]
        pre, post = loop.body[:pos], loop.body[pos + 1:]
        if any(loop.var in lp.start.free_symbols | lp.stop.free_symbols
               for lp in (*between, inner)):
            raise ScheduleError(f"{self}: the bounds of {self.across} depend on {self.loop}")
        read_later = {s.name for s in pre if isinstance(s, Let)} & names_read(loop.body[pos:])
        if read_later:
            raise ScheduleError(f"{self}: the loop over {self.across} and what follows it "
                                f"read {', '.join(sorted(read_later))}, set before it")
        check_sum_only(self, loop, summed_arrays(loop))

        inside = loop_vars((loop,))
        blk = claim_loop(names, self.blocks, scope | inside, self)
        first = loop.start + self.block * blk
        each = lambda stmts: Loop(loop.var, first, sympy.Min(loop.stop, first + self.block),
                                  tuple(stmts))
        swept = replace(inner, body=(each(inner.body),))
        for outer in reversed(between):
            swept = replace(outer, body=(swept,))
        steps = (*((each(pre),) if pre else ()), swept, *((each(post),) if post else ()))
        count = idiv(loop.stop - loop.start + self.block - 1, self.block)
        return (Loop(blk, sympy.Integer(0), count, steps),)


def _chain_to(stmt, name):
    """[the loops from stmt down to the loop over name]: stmt itself when it is that loop,
    or loops each holding only the next (a group's query heads between a tile of key rows
    and its query blocks); [] when stmt leads to no such loop."""
    chain = []
    while isinstance(stmt, Loop):
        chain.append(stmt)
        if stmt.var.name == name:
            return chain
        if len(stmt.body) != 1:
            break
        stmt = stmt.body[0]
    return []
