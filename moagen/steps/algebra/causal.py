"""Causal attention by blocks: key blocks no query row of a tile sees are not visited.

With a causal mask the scores of key j for query row r are `r >= j ? s : -inf`. After the
online softmax (by blocks of B keys), a block whose every key lies past every row of the
tile has only -inf scores: its block max is -inf, so the running max does not move, the
rescale is exp(0) = 1 and every probability exp(-inf - m) = 0. The block changes nothing, bit
for bit (x * 1 and x + 0 are exact), so

    for j_blk in [0, blocks): ..   ->   for j_blk in [0, min(blocks, max_r // B + 1)): ..

where max_r is the tile's last row. A causal kernel then computes about half the scores.
The first block always holds key 0, which every row sees, so the running max is finite
before any block is left out. The blocks before (min_r + 1) // B, whose keys every row of
the tile sees, need no mask either: the loop is split there, and only the blocks on the
diagonal select.

The row may be free of the query rows (attention_cross's padded `last >= j`: every row sees
keys 0 to last, a given size): the blocks past last's are not visited, those before it run
unmasked. The row may be shifted (attention_cross's `i + offset >= j`, a query's position past the
first offset keys): r is then the query row's position, and the blocks are bounded by the
tile's last position. The argument above needs every row to see key 0, r >= 0: checked as r
being a sum of loop variables (from 0) and sizes (never negative: the kernels' ABI refuses
a negative size) with non-negative coefficients. Positions may pass the last key (offset >
n - n_q): the unmasked blocks of a shifted row stop at the loop's own end too. Where the
running max is floored (starts at a finite number before the blocks: attention_varlen's), r
may be negative (bottom-right with more queries than keys): a block of masked scores leaves
a finite running max as it was and adds exp(-inf - m) = 0, so it is a no-op for a row that
sees no key too; such a tile visits no block (the bounds clamped at 0).

The diagonal blocks select where the block's scores are read, not where they are stored:

    P[r, j - B j_blk] = r >= j ? s : -inf          ->  P[r, j - B j_blk] = s
    m max= P[r, j - B j_blk]                       ->  m max= (r >= j ? P[..] : -inf)
    P[r, j - B j_blk] = exp(P[r, j - B j_blk] - m') ->  P[..] = (r >= j ? exp(P[..] - m') : 0)

The scores are then a register tile like any other block's (a select per score keeps the
compiler from vectorizing the tile: it takes every accumulator out of its vector register),
the selects are vector compares in loops over the keys, and no exponential is taken of -inf
(exp(-inf - m') = 0 for a finite m', which the running max is; a vector exponential takes
its slow path for a lane of -inf). The values are the same, bit for bit in the ONF's
arithmetic (a compiler contracting the vectorized tile's multiply-adds otherwise than the
scalar ones may round the scores differently, within an ulp or so).

On a GPU (rows="i") the tile is a thread block's rows, the range of the loop over i around
the loop over blocks (BlockTiles'): every thread of the block walks the same key blocks, so
the loops' bounds are the block's, not a thread's row's, and every thread reaches each
barrier inside; the diagonal blocks select by value as above.

Checked: the loop over blocks holds the online softmax's block max (a max accumulated over
the block's scores), and every score it stores is masked as `r >= j` with r free of the
keys and r >= 0 or the running max floored (above); the blocks are B keys from B * j_blk; in a diagonal block every read of a masked
score's element before the element is stored again is at the index the score was stored at.
"""
import math
from dataclasses import dataclass, replace

import sympy

from moagen.errors import ScheduleError
from moagen.moa import scalar as S
from moagen.moa.expr import divides, idiv
from moagen.onf.loops import (Let, Loop, Store, Update, ancestors, map_stmt_exprs, max_extent,
                              rewrite_loops, walk)
from moagen.steps.step import NotApplicable, Step, hidden, option


@dataclass(frozen=True)
class CausalBlocks(Step):
    nest: str
    blocks: str = "j_blk"
    keys: str = hidden("j")
    rows: str = option("rows of the loop over {rows}", "")

    @property
    def layer(self):
        # a thread block's rows exist once the mapping has made the blocks
        return "mapping" if self.rows else "schedule"

    def rewrite_nest(self, nest, names):
        body, count = rewrite_loops(nest.body, lambda loop: loop.var.name == self.blocks,
                                    lambda blocks, _: self._split(blocks, nest.body))
        if not count:
            raise NotApplicable(f"{self}: nest {self.nest} has no loop over {self.blocks}")
        return body

    def _split(self, blocks, within):
        first, last = self._bounds(blocks, within)
        return [replace(blocks, stop=first, body=tuple(_unmasked(blocks.body))),
                replace(blocks, start=first, stop=last,
                        body=_masked_where_read(blocks.body, {}, self))]

    def _bounds(self, blocks: Loop, within):
        """(the first block some row of the tile does not see whole, (min_r + 1) // B; the
        block after the last any row sees, max_r // B + 1), within the loop's range."""
        keys = [s for s in walk(blocks.body) if isinstance(s, Loop) and s.var.name == self.keys]
        if not keys or not any(isinstance(s, Update) and s.op == "max"
                               for s in walk(blocks.body)):
            raise ScheduleError(f"{self}: the loop over {self.blocks} is not the online "
                                f"softmax's loop over blocks of {self.keys} (a block max)")
        size = block_size(blocks, keys, self)
        floored = floored_running_max(blocks, within)
        rows = []
        for key in keys:
            for s in walk(key.body):
                if isinstance(s, Store) and isinstance(s.value, S.Select):
                    rows.append(self._row(s.value, key.var, floored))
        if not rows:
            raise ScheduleError(f"{self}: no score in the loop over {self.blocks} is masked: "
                                "nothing to skip")
        low, high = self._range(rows, blocks, within)
        if nonnegative(low):
            first, last = quotient(low + 1, size), quotient(high, size) + 1
        else:  # a floored row may see no key (low, high < 0): no block unmasked, none visited
            first = quotient(at_least_zero(low + 1), size)
            last = quotient(at_least_zero(high + size), size)
        last = sympy.Min(blocks.stop, last)
        # an unshifted row is a query row, below n: (min_r + 1) // B <= the block count; a
        # shifted one (a size in it) may pass the last key
        loops = {lp.var for lp in ancestors(within, blocks)}
        if any(r.free_symbols - loops for r in rows):
            first = sympy.Min(blocks.stop, first)
        return first, last

    def _range(self, rows, blocks, within):
        """(the least, the most row): of the rows themselves, or (rows=) of the range of the
        loop over `rows` around the loop over blocks."""
        if not self.rows:
            return sympy.Min(*rows), sympy.Max(*rows)
        return tile_rows_range(rows, blocks, within, self.rows, self)

    def _row(self, select, key, floored):
        """r of a score masked as `r >= key ? s : -inf`; r >= 0 unless the running max is
        floored (floored_running_max)."""
        pair = mask_sides(select.cond) if select.other == MASKED else None
        if not (pair and pair[1] == key and key not in pair[0].free_symbols):
            raise ScheduleError(f"{self}: a score is masked by {select.cond}, not as a row >= "
                                "the key: blocks past the rows cannot be told apart")
        if not floored and not nonnegative(pair[0]):
            raise ScheduleError(f"{self}: a score is masked as {pair[0]} >= {key}, and "
                                f"{pair[0]} is not known to be >= 0: a row might see no key, "
                                "and a skipped block would then not be a no-op (its running "
                                "max is not floored)")
        return pair[0]


def floored_running_max(blocks: Loop, within) -> bool:
    """Whether every running max the loop over blocks moves (new max = max(m, block max))
    starts, just before the loop, at a finite number (OnlineSoftmax's floored max: never
    -inf, so that a block of masked scores is a no-op even for a row that sees no key)."""
    around = ancestors(within, blocks)
    siblings = around[-1].body if around else within
    before = siblings[:next(k for k, s in enumerate(siblings) if s is blocks)]
    starts = {s.name: s.value for s in before if isinstance(s, Let)}
    moved = [s.value for s in walk(blocks.body) if isinstance(s, Let)
             and isinstance(s.value, S.Bin) and s.value.op == "max"
             and isinstance(s.value.left, S.Local) and s.value.left.name in starts]
    return bool(moved) and all(
        isinstance(starts[m.left.name], S.Num) and math.isfinite(starts[m.left.name].value)
        for m in moved)


def nonnegative(e) -> bool:
    """e (of loop variables and sizes) is >= 0: a sum of terms with non-negative
    coefficients (loop variables count from 0, sizes are never negative) of such values and
    of their quotients (the first row of an edge's tiles, 6*idiv(n, 6)), or the least or most
    of such sums."""
    if isinstance(e, (sympy.Min, sympy.Max)):
        return all(nonnegative(a) for a in e.args)
    for term in sympy.Add.make_args(sympy.expand(e)):
        coefficient, factors = term.as_coeff_Mul()
        if coefficient < 0 or not all(isinstance(f, sympy.Symbol) or f == 1 or (
                isinstance(f, idiv) and nonnegative(f.args[0]) and f.args[1].is_positive)
                                      for f in sympy.Mul.make_args(factors)):
            return False
    return True


MASKED = S.Num(float("-inf"))  # a masked score's value


def quotient(a, b):
    """idiv(a, b), the terms of a that are whole multiples of b taken out of the division
    (64*i_blk + 63 by 64: i_blk; a's symbols are integers)."""
    terms = sympy.Add.make_args(sympy.expand(a))
    whole = [t for t in terms if t.free_symbols and divides(b, t)]
    return sympy.Add(*whole) / b + idiv(sympy.Add(*(t for t in terms if t not in whole)), b)


def least_row(cond, var):
    """k - t, the least var that a mask's condition var + t >= k lets through (t and k free
    of var; k - t may be negative where shifted); None for any other condition."""
    pair = mask_sides(cond)
    if pair is None:
        return None
    row, key = pair
    shift = sympy.expand(row - var)
    if var in shift.free_symbols or var in key.free_symbols:
        return None
    return key - shift


def at_least_zero(e):
    """max(0, e), as e itself where e is known non-negative (a bound on a loop from 0;
    idiv takes no negative operand)."""
    return e if nonnegative(e) else sympy.Max(0, e)


def mask_sides(cond):
    """(r, k) of a mask's condition r >= k (or k <= r); None for any other condition."""
    if isinstance(cond, sympy.GreaterThan):
        return cond.lhs, cond.rhs
    if isinstance(cond, sympy.LessThan):
        return cond.rhs, cond.lhs
    return None


def _unmasked(stmts):
    """stmts with every masked score `r >= j ? s : -inf` replaced by s."""
    def unmask(e):
        if isinstance(e, S.Select) and e.other == MASKED:
            return unmask(e.then)
        return S.map_children(e, unmask)

    for s in stmts:
        if isinstance(s, Loop):
            yield replace(s, body=tuple(_unmasked(s.body)))
        else:
            yield map_stmt_exprs(s, unmask)


def _masked_where_read(stmts, masked, who):
    """stmts (in order) with each masked score stored unmasked and masked where it is read
    (the module's docstring); masked: (array, index) -> the mask of the score stored there
    and not yet stored over, filled as the statements go."""
    out = []
    for s in stmts:
        if isinstance(s, Loop):
            out.append(replace(s, body=_masked_where_read(s.body, masked, who)))
            continue
        s = map_stmt_exprs(s, lambda e: _mask_reads(e, masked, who))
        if isinstance(s, Store):
            key = (s.array, tuple(s.index))
            if isinstance(s.value, S.Select) and s.value.other == MASKED:
                masked[key] = s.value.cond
                s = replace(s, value=s.value.then)
            elif key in masked:
                del masked[key]  # stored over: its reads after here read the new value
            elif any(array == s.array for array, _ in masked):
                raise ScheduleError(f"{who}: {s.array} is stored at {s.index}, not where its "
                                    "masked scores are: their masks cannot follow them")
        out.append(s)
    return tuple(out)


def _mask_reads(e, masked, who):
    """e with each read of a masked score's element masked (and an exponential of one as
    _exp_of_masked takes it)."""
    if isinstance(e, S.Access) and any(array == e.array for array, _ in masked):
        cond = masked.get((e.array, tuple(e.index)))
        if cond is None:
            raise ScheduleError(f"{who}: {e.array} is read at {e.index}, not where its masked "
                                "scores are stored: their masks cannot follow them")
        return S.Select(cond, e, MASKED)
    return _exp_of_masked(S.map_children(e, lambda c: _mask_reads(c, masked, who)))


def _exp_of_masked(e):
    """e, at its root, with exp((mask ? x : -inf) - m) taken as mask ? exp(x - m) : 0: the
    same value for a finite m (the running max is), and no exponential of -inf."""
    if (isinstance(e, S.Un) and e.fn == "exp" and isinstance(e.arg, S.Bin) and e.arg.op == "-"
            and isinstance(e.arg.left, S.Select) and e.arg.left.other == MASKED):
        shifted = S.Bin("-", e.arg.left.then, e.arg.right)
        return S.Select(e.arg.left.cond, S.Un("exp", shifted), S.Num(0.0))
    return e


def block_size(blocks: Loop, inner, who):
    """B, where each of the loops `inner` over one block of the loop `blocks` starts at
    B * its variable; ScheduleError (naming `who`) otherwise."""
    size = sympy.diff(inner[0].start, blocks.var)
    if not size.is_Integer or any(lp.start != size * blocks.var for lp in inner):
        raise ScheduleError(f"{who}: the loops over {inner[0].var} do not start each block "
                            f"at a multiple of {blocks.var}")
    return size


def tile_rows_range(rows, blocks: Loop, within, over: str, who):
    """(the least, the most of the masked rows `rows`) over the loop over `over` (a thread
    block's rows) around the loop `blocks` in `within`, each row increasing with its
    variable or free of it (attention_cross's padded last key): the bounds a whole tile's
    blocks share. ScheduleError (naming `who`) if no such loop holds them."""
    loop = next((lp for lp in ancestors(within, blocks) if lp.var.name == over), None)
    if loop is None or any(sympy.diff(r, loop.var).is_nonnegative is not True for r in rows):
        raise ScheduleError(f"{who}: the masked rows are not those of a loop over {over} "
                            f"around the loop over {blocks.var}")
    # the last row of a full block: a block past the size's last row is past the loop
    last = loop.start + max_extent(loop) - 1 if max_extent(loop) else loop.stop - 1
    return (sympy.Min(*(r.xreplace({loop.var: loop.start}) for r in rows)),
            sympy.Max(*(r.xreplace({loop.var: last}) for r in rows)))
