"""A causal backward's passes by blocks: blocks of the other side that no row of a thread
block's tile sees are not visited.

In the backward the probabilities are exp((r >= k ? s : -inf) - lse): 0 where masked, lse
being finite (key 0 is every row's). Every addition a pass makes inside its loop over the
other side's blocks is a product with one of them (dQ += dS K, dK += dS^T Q, dV += P^T dO,
dS = P (dO V^T - delta)), so a block whose every pair is masked adds zeros: x + 0 = x,
and leaving it out changes nothing. The query rows' pass walks key blocks, and those past
the tile's last row are masked:

    for j_blk in [0, blocks): ..   ->   for j_blk in [0, min(blocks, max_i // B + 1)): ..

the key rows' pass walks query blocks, and those before the tile's first key are masked:

    for i_blk in [0, blocks): ..   ->   for i_blk in [min_j // B, blocks): ..

A shifted mask `i + t >= j` (attention_cross's i + offset >= j) bounds the key blocks by the
tile's last row plus t, and starts the query blocks at max(0, min_j - t) // B.

A mask free of the rows, `last >= j` (attention_cross's padded keys, last a size given at
call time), bounds the key blocks by last's: with rows="" the step needs no loop of a
thread block around the blocks, and is a step of the schedule (the CPU's tiles of rows).

The diagonal blocks keep their selects. On a GPU the tile is a thread block's rows (the
loop over `rows` around the blocks, BlockTiles'), so every thread of the block walks the
same blocks and reaches each barrier inside.

Checked: every score in the loop is masked as `query >= key` by -inf, the block's keys (or
queries) the loop's inner variable and the other side free of it, and enters only through
exp(score - m); every addition in the loop into what lives past one block (an output, an
accumulator defined outside the loop) adds a value that is zero where the score is masked,
directly or through the block's locals and scratch; the blocks are B from B * blk; with
rows="", every mask's row is free of the loops around the blocks and in them.
"""
from dataclasses import dataclass, field, replace

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.onf.loops import (Let, Loop, Store, Update, ancestors, loop_vars, rewrite_loops,
                              walk)
from moagen.steps.algebra.causal import (MASKED, at_least_zero, block_size, least_row,
                                         mask_sides, quotient, tile_rows_range)
from moagen.steps.step import NotApplicable, Step, hidden


@dataclass(frozen=True)
class MaskedBlocks(Step):
    nest: str
    blocks: str  # the loop over the other side's blocks
    inner: str = hidden("")  # the variable of the loops over one block (blocks less _blk)
    # the thread block's rows: the loop around the blocks ("": none, the rows free of loops)
    rows: str = field(default="i", metadata={"template": "{printed_rows}"})

    @property
    def printed_rows(self):
        return self.rows or "free rows"

    @property
    def layer(self):
        # a thread block's rows exist once the mapping has made the blocks
        return "mapping" if self.rows else "schedule"

    def rewrite_nest(self, nest, names):
        body, count = rewrite_loops(nest.body, lambda loop: loop.var.name == self.blocks,
                                    lambda blocks, _: (self._bounded(blocks, nest.body),))
        if not count:
            raise NotApplicable(f"{self}: nest {self.nest} has no loop over {self.blocks}")
        return body

    @property
    def _inner(self):
        return self.inner or self.blocks.rsplit("_blk", 1)[0]

    def _bounded(self, blocks: Loop, within) -> Loop:
        inner = [s for s in walk(blocks.body) if isinstance(s, Loop) and
                 s.var.name == self._inner]
        if not inner:
            raise ScheduleError(f"{self}: no loop over {self._inner} inside {self.blocks}")
        size = block_size(blocks, inner, self)
        sides = {self._sides(sel, inner[0].var) for sel in _masked(blocks.body)}
        if not sides:
            raise ScheduleError(f"{self}: no score in the loop over {self.blocks} is masked: "
                                "nothing to skip")
        _check_adds_zero_where_masked(blocks, inner[0].var, self)
        if len({ahead for ahead, _ in sides}) > 1:
            raise ScheduleError(f"{self}: the masks put {self._inner} on both sides")
        ahead = next(iter(sides))[0]
        rows = [row for _, row in sides]
        low, high = tile_rows_range(rows, blocks, within, self.rows, self) if self.rows \
            else self._free_rows(rows, blocks, within)
        if ahead:  # the keys: those past the last row are masked
            return replace(blocks, stop=sympy.Min(blocks.stop, quotient(high, size) + 1))
        if blocks.start != 0:
            raise ScheduleError(f"{self}: the loop over {self.blocks} does not start at 0")
        # the queries before the first key (before 0 where shifted past it)
        return replace(blocks, start=quotient(at_least_zero(low), size))

    def _free_rows(self, rows, blocks: Loop, within):
        """(the least, the most of rows), each free of the loops around the blocks and in
        them (a padded key's last)."""
        loops = {lp.var.name for lp in ancestors(within, blocks)} | {blocks.var.name} | \
            loop_vars(blocks.body)
        if any({x.name for x in row.free_symbols} & loops for row in rows):
            raise ScheduleError(f"{self}: a mask's row varies with the loops ({rows}): with no "
                                "loop of rows named, each must be free of them")
        return sympy.Min(*rows), sympy.Max(*rows)

    def _sides(self, select, inner):
        """(whether the inner variable is the key, the tile's row) of a masked score."""
        pair = mask_sides(select.cond)
        if pair:
            query, key = pair
            if key == inner and inner not in query.free_symbols:
                return True, query
            first = least_row(select.cond, inner)  # the first query row that sees the key
            if first is not None:
                return False, first
        raise ScheduleError(f"{self}: a score is masked by {select.cond}, not as a query >= "
                            f"a key with {self._inner} on one side")

def _masked(stmts):
    """The masked scores (selects with -inf) in the statements' expressions."""
    return [e for e in _values(stmts) for e in S.subexpressions(e)
            if isinstance(e, S.Select) and e.other == MASKED]


def _values(stmts):
    for s in walk(stmts):
        if isinstance(getattr(s, "value", None), S.ScalarExpr):
            yield s.value


def _masked_exp(e) -> bool:
    """e is exp(masked score - m): 0 where masked, m finite."""
    return isinstance(e, S.Un) and e.fn == "exp" and isinstance(e.arg, S.Bin) and \
        e.arg.op == "-" and isinstance(e.arg.left, S.Select) and e.arg.left.other == MASKED


def _masked_only_in_exp(e) -> bool:
    """Every masked score in e is the score of an exp(score - m)."""
    if _masked_exp(e):
        return all(_masked_only_in_exp(c) for c in (e.arg.left.then, e.arg.right))
    if isinstance(e, S.Select) and e.other == MASKED:
        return False
    return all(_masked_only_in_exp(c) for c in S.children(e))


def _check_adds_zero_where_masked(blocks: Loop, inner, who):
    """ScheduleError unless the masked scores enter only through exp(score - m) and every
    addition in the loop into what outlives one block adds a value zero where they are
    masked (the module's doc). What a block stores without adding (its scratch: the
    scores, dS) is stored per key of the block, by the loops inside it."""
    if not all(_masked_only_in_exp(v) for v in _values(blocks.body)):
        raise ScheduleError(f"{who}: a masked score is used other than in exp(score - m)")
    local = {s.name for s in walk(blocks.body) if isinstance(s, Let)}
    zero = set()  # the block's locals and scratch arrays whose value is zero where masked

    def is_zero(e):
        if isinstance(e, S.Bin) and e.op == "*":
            return is_zero(e.left) or is_zero(e.right)
        if isinstance(e, S.Local):
            return e.name in zero
        if isinstance(e, S.Access):
            return e.array in zero
        return _masked_exp(e)

    def define(name, value):
        (zero.add if is_zero(value) else zero.discard)(name)

    for s in walk(blocks.body):
        if isinstance(s, Loop):
            continue
        if isinstance(s, Let) or (isinstance(s, Update) and s.name in local and s.op == "="):
            define(s.name, s.value)
        elif isinstance(s, Update) and s.name in local:
            if not is_zero(s.value):
                zero.discard(s.name)
        elif isinstance(s, Store) and not s.accumulate:
            if not any(inner in sympy.sympify(x).free_symbols for x in s.index):
                raise ScheduleError(f"{who}: {s.array} is stored in the loop over "
                                    f"{blocks.var} but not per key of a block (by "
                                    f"{inner}): not the block's scratch")
            define(s.array, s.value)
        elif not is_zero(s.value):
            name = getattr(s, "array", None) or s.name
            raise ScheduleError(f"{who}: {name} is added to by a value not zero where the "
                                "scores are masked: a masked block is not a no-op")
